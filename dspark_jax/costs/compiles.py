"""Counting XLA backend compilations: benchmarks report them, tests assert none happen after warm-up.

``COMPILES[0]`` is the number of compilations in this process since this module was imported
(read it before and after a region: ``before = COMPILES[0]; ...; COMPILES[0] - before``).
"""

from __future__ import annotations

import jax

COMPILES = [0]


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)
