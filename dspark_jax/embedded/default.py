"""Where the embedded default target lives, and how to get it.

The package ships the checkpoint under ``dspark_jax/assets/default_target``
(a Hugging Face / PyTorch directory, float32, < 10 MB). If that copy is missing
(e.g. a stripped install), ``default_target_dir()`` looks in the user cache
(``$DSPARK_JAX_CACHE``, else ``$XDG_CACHE_HOME/dspark_jax``, else
``~/.cache/dspark_jax``) and, failing that, trains it there with
``dspark_jax.embedded.pretrain``'s default recipe (about 75 minutes on 2 idle CPU cores).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dspark_jax.errors import CheckpointError

REQUIRED_FILES = ("config.json", "model.safetensors", "dspark_tokenizer.json")
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_target"
DEFAULT_PROMPTS_DATASET = "stdlib-heldout"


def cache_dir() -> Path:
    """The user cache directory of dspark-jax (not created)."""
    if os.environ.get("DSPARK_JAX_CACHE"):
        return Path(os.environ["DSPARK_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(base) / "dspark_jax"


def is_complete(directory) -> bool:
    directory = Path(directory)
    return all((directory / name).is_file() for name in REQUIRED_FILES)


def default_target_dir(*, build_if_missing: bool = True, progress: bool = True) -> Path:
    """Path of the default target checkpoint: the packaged copy, else the cached one.

    If neither exists and ``build_if_missing``, pretrain it into the cache with
    the packaged copy's recipe (``pretrain.build_default``); otherwise
    CheckpointError.
    """
    if is_complete(PACKAGED_DIR):
        return PACKAGED_DIR
    cached = cache_dir() / "default_target"
    if is_complete(cached):
        return cached
    if not build_if_missing:
        raise CheckpointError(f"the default target is neither packaged ({PACKAGED_DIR}) nor cached "
                              f"({cached}); run `python -m dspark_jax.embedded.pretrain --recipe default --out {cached}`")
    from dspark_jax.embedded import pretrain

    pretrain.build_default(cached, force=cached.exists(), progress=progress)
    return cached


def load_default_target():
    """``(TargetConfig, params with jnp leaves, ByteTokenizer)`` of the default target."""
    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.tokenizer import ByteTokenizer

    d = default_target_dir()
    cfg, params = load_target(d)
    return cfg, params, ByteTokenizer.load(d)


def default_metadata() -> dict:
    """The packaged/cached checkpoint's ``pretrain_metadata.json`` (empty dict if absent)."""
    from dspark_jax.embedded.pretrain import METADATA_FILE

    path = default_target_dir(build_if_missing=False) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
