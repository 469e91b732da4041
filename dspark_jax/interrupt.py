"""Ctrl-C at safe points: a SIGINT during XLA work is deferred to the next step boundary.

A KeyboardInterrupt raised while JAX/XLA or orbax's background threads are mid-operation can
crash the interpreter on the way out (the demo's train stage segfaulted). Long loops run
inside ``deferred_sigint()`` and call ``check()`` between steps: the first Ctrl-C only sets a
flag (``check`` then raises KeyboardInterrupt there, after the step finished); a second one
raises at once. The CLI turns KeyboardInterrupt into "interrupted", exit code 130.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class _Stop:
    requested = False

    def check(self) -> None:
        """KeyboardInterrupt when a SIGINT arrived since the loop started."""
        if self.requested:
            raise KeyboardInterrupt


@contextlib.contextmanager
def deferred_sigint(enabled: bool = True) -> Iterator[_Stop]:
    """Defer SIGINT to ``check()`` points (main thread only; elsewhere, or not ``enabled``, a no-op)."""
    stop = _Stop()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.requested:  # a second Ctrl-C: now
            raise KeyboardInterrupt
        stop.requested = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
