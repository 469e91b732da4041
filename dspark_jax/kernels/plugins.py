"""Which accelerator plugins this jaxlib has: the ``tpu`` / ``cuda`` extras a kernel branch or a
compile-only ``--hardware`` target needs (``costs.hardware`` reads the same table)."""

from __future__ import annotations

import importlib.util

# platform -> (the plugin module the extra installs, how to install it)
EXTRAS = {"tpu": ("libtpu", 'pip install -e ".[tpu]"'),
          "cuda": ("jax_cuda12_plugin", 'pip install -e ".[cuda]"')}


def has_extra(platform: str) -> bool:
    """Whether the plugin of ``platform`` ("tpu" or "cuda") is importable."""
    return importlib.util.find_spec(EXTRAS[platform][0]) is not None
