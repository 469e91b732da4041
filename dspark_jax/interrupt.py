"""Ctrl-C, cleanly: "interrupted" and exit code 130, never a swallowed or a mid-XLA interrupt.

Two ways a plain KeyboardInterrupt goes wrong: raised inside a callback whose exceptions
Python ignores (JAX's garbage-collection callback), it is lost and the command runs on to
exit 0; raised while XLA or orbax's background threads are mid-operation, it can crash the
interpreter on the way out (the demo's train stage segfaulted). So:

- ``sigint_recorded()`` (around a whole command, in ``cli.main``): every SIGINT is recorded;
  ``requested()`` then tells the CLI to end with 130 even if the KeyboardInterrupt was lost.
- ``deferred_sigint()`` (around a step loop): the first Ctrl-C only sets the flag; the loop
  calls ``check()`` between steps, which raises KeyboardInterrupt there. A second Ctrl-C
  raises at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

_state = {"requested": False, "defer": 0, "installed": False}


def _handler(signum, frame):
    first = not _state["requested"]
    _state["requested"] = True
    if _state["defer"] and first:
        return  # deferred to the loop's next check()
    raise KeyboardInterrupt


def requested() -> bool:
    """A SIGINT arrived while ``sigint_recorded`` / ``deferred_sigint`` was active."""
    return _state["requested"]


def check() -> None:
    """KeyboardInterrupt when a SIGINT arrived (the step loops' safe point)."""
    if _state["requested"]:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _installed() -> Iterator[None]:
    """Our handler for the duration (main thread only; nested uses share the outer one)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.update(requested=False, installed=True)
    previous = signal.signal(signal.SIGINT, _handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _state["installed"] = False


@contextlib.contextmanager
def sigint_recorded() -> Iterator[None]:
    """Record every SIGINT (``requested()``); it still raises KeyboardInterrupt at once."""
    with _installed():
        yield


@contextlib.contextmanager
def deferred_sigint(enabled: bool = True) -> Iterator[None]:
    """Defer the first SIGINT to the next ``check()`` (not ``enabled``: raise at once as usual)."""
    with _installed():
        _state["defer"] += bool(enabled)
        try:
            yield
        finally:
            _state["defer"] -= bool(enabled)
