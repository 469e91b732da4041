"""The drafter's view of the target: one forward that yields the context features.

Online training (inside the train step), the feature-cache writer and speculative decoding
all read the target through ``target_features``.
"""

from __future__ import annotations

from typing import Sequence

import jax

from dspark_jax.config import TargetConfig
from dspark_jax.target import qwen3


def target_features(params: dict, config: TargetConfig, layer_ids: Sequence[int], tokens: jax.Array, *,
                    cache: qwen3.KVCache | None = None, num_new: jax.Array | None = None,
                    compute_dtype=None) -> tuple[jax.Array, jax.Array, qwen3.KVCache | None]:
    """tokens [B, T] -> (features [B, T, n*H], last_hidden [B, T, H], cache).

    features concatenates the raw outputs of target layers ``layer_ids`` (-1 = embedding
    output), n = len(layer_ids); last_hidden is the hidden state after the final norm. With
    a KV ``cache`` the tokens extend it (see ``qwen3.forward``) and the updated cache is
    returned; without one the pass is causal over positions 0..T-1 and the cache is None.
    """
    hidden, taps, cache = qwen3.forward(params, config, tokens, cache, num_new=num_new,
                                        tap_layer_ids=tuple(layer_ids), compute_dtype=compute_dtype)
    return taps, hidden, cache
