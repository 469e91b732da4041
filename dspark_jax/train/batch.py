"""Training-batch construction: anchor sampling (labels and eval mask live in draft/blocks.py).

Shapes: B sequences of length S, N anchors per sequence, G = block_size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.draft.blocks import block_input_ids, block_targets, label_indices  # noqa: F401


def anchor_candidates(loss_mask: jax.Array) -> jax.Array:
    """[B, S] -> [B, S] bool: a in [0, S-2] with loss_mask[a] and loss_mask[a+1]."""
    lm = loss_mask > 0.5
    cand = lm[:, :-1] & lm[:, 1:]
    return jnp.pad(cand, ((0, 0), (0, 1)))


def sample_anchors(rng: jax.Array, loss_mask: jax.Array, num_anchors: int):
    """Up to ``num_anchors`` candidates per row, uniformly without replacement, sorted.

    Returns anchors [B, N] int32 (unused slots hold 0) and keep [B, N] bool.
    """
    b, s = loss_mask.shape
    cand = anchor_candidates(loss_mask)
    keys = jax.random.uniform(rng, (b, s))
    keys = jnp.where(cand, keys, 2.0)  # invalid positions sort last
    order = jnp.argsort(keys, axis=1)
    n_take = min(num_anchors, s)
    chosen = order[:, :n_take]
    valid = jnp.take_along_axis(cand, chosen, axis=1)
    chosen = jnp.where(valid, chosen, s + 1)
    chosen = jnp.sort(chosen, axis=1)
    if n_take < num_anchors:
        chosen = jnp.pad(chosen, ((0, 0), (0, num_anchors - n_take)), constant_values=s + 1)
    count = jnp.minimum(cand.sum(axis=1), num_anchors)
    keep = jnp.arange(num_anchors)[None, :] < count[:, None]
    anchors = jnp.where(keep, chosen, 0).astype(jnp.int32)
    return anchors, keep
