"""The drafter's view of the target: one forward that yields the context features.

Online training (inside the train step), the feature-cache writer and speculative decoding
all read the target through ``target_features``, whatever its family (the family module's
``forward``: ``target.qwen3``, ``target.gemma4``).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from dspark_jax import families


def target_features(params: dict, config, layer_ids: Sequence[int], tokens: jax.Array, *,
                    cache: Any = None, num_new: jax.Array | None = None,
                    compute_dtype=None) -> tuple[jax.Array, jax.Array, Any]:
    """tokens [B, T] -> (features [B, T, n*H], last_hidden [B, T, H], cache).

    features concatenates the raw outputs of target layers ``layer_ids`` (-1 = embedding
    output; Gemma4: decoder-layer outputs after ``layer_scalar``), n = len(layer_ids);
    last_hidden is the hidden state after the final norm. With a KV ``cache`` (the family's:
    ``qwen3.KVCache``, ``gemma4.Gemma4Cache``) the tokens extend it (see the family's
    ``forward``) and the updated cache is returned; without one the pass is causal over
    positions 0..T-1 and the cache is None.
    """
    forward = families.for_config(config).module().forward
    hidden, taps, cache = forward(params, config, tokens, cache, num_new=num_new,
                                  tap_layer_ids=tuple(layer_ids), compute_dtype=compute_dtype)
    return taps, hidden, cache
