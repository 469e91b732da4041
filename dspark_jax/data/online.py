"""Online target features: run the frozen target inside the train step (no cache on disk)."""

from __future__ import annotations

import jax

from dspark_jax.config import TargetConfig
from dspark_jax.target import qwen3


def target_features(target_params: dict, config: TargetConfig, layer_ids, tokens: jax.Array,
                    compute_dtype=None) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] -> (features [B, S, n*H] raw layer outputs, last_hidden [B, S, H] post-norm).

    Gradients are stopped: the target is frozen.
    """
    hidden, taps, _ = qwen3.forward(target_params, config, tokens, tap_layer_ids=tuple(layer_ids),
                                    compute_dtype=compute_dtype)
    return jax.lax.stop_gradient(taps), jax.lax.stop_gradient(hidden)
