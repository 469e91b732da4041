"""The identity of a target: one sha256 over its config and weights.

A feature cache records it (and training refuses a cache of another target); the demo
records it (and refuses to resume with changed weights).
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

from dspark_jax.config import TargetConfig


def target_identity(config: TargetConfig, params) -> str:
    """sha256 hex digest over ``config.to_hf()`` and every weight leaf (sorted by tree path:
    path, dtype, shape and bytes), so the same weights give the same identity in any file format."""
    h = hashlib.sha256(json.dumps(config.to_hf(), sort_keys=True).encode())
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        arr = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(arr.dtype).encode() + str(arr.shape).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()
