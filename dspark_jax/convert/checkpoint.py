"""Load and save drafters and targets (PyTorch/HF directories and our own format).

MINIMAL VERSION: HF directories with a single model.safetensors only. The
conversion work extends this module (sharded index, own format, validation,
atomic writes) without changing these signatures.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
from safetensors.numpy import load_file

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import mapping


def load_draft(path) -> tuple[DraftConfig, dict]:
    """(config, params with jnp leaves) from a drafter directory."""
    path = Path(path)
    cfg = DraftConfig.from_hf(json.loads((path / "config.json").read_text()))
    params = mapping.draft_from_torch(cfg, load_file(str(path / "model.safetensors")))
    return cfg, _to_jnp(params)


def load_target(path) -> tuple[TargetConfig, dict]:
    """(config, params with jnp leaves) from a target directory."""
    path = Path(path)
    cfg = TargetConfig.from_hf(json.loads((path / "config.json").read_text()))
    params = mapping.target_from_torch(cfg, load_file(str(path / "model.safetensors")))
    return cfg, _to_jnp(params)


def _to_jnp(tree):
    if isinstance(tree, dict):
        return {k: _to_jnp(v) for k, v in tree.items()}
    return jnp.asarray(tree)
