"""The drafter's view of the target: one forward that yields the context features.

Online training (inside the train step), the feature-cache writer and speculative decoding
all read the target through its family's runtime forward (``families.target_runtime``;
``dspark_jax.runtime``), whatever the family.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from dspark_jax import families, runtime


def target_features(params: dict, config, layer_ids: Sequence[int], tokens: jax.Array, *,
                    cache: Any = None, compute_dtype=None,
                    ctx: runtime.Context | None = None) -> tuple[jax.Array, jax.Array, Any]:
    """tokens [B, T] -> (features [B, T, n*H], last_hidden [B, T, H], delta).

    features concatenates the raw outputs of target layers ``layer_ids`` (-1 = embedding
    output; Gemma4: decoder-layer outputs after ``layer_scalar``), n = len(layer_ids);
    last_hidden is the hidden state after the final norm. Without a ``cache`` the pass is causal
    over positions 0..T-1 and delta is None; with one (the family's ``runtime.Cache``) the tokens
    extend it and delta is what ``cache.commit`` would fold in (the cache is not written).
    ``ctx``: mesh, rules and compute dtype the forward sees (default: one device,
    ``compute_dtype``).
    """
    ctx = ctx if ctx is not None else runtime.Context(dtype=compute_dtype)
    hidden, features, delta = families.target_runtime(config).forward(
        params, config, tokens, cache, ctx=ctx, taps=tuple(layer_ids), span=None)
    return features, hidden, delta
