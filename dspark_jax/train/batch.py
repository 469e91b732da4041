"""Training batch (anchor-bounded packing): up to N anchors drawn per sequence where the loss mask
holds at a and a+1, each starting a block of G positions; keep mask, labels, eval mask.

Shapes: B sequences of length S, N anchors per sequence, G = block_size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def label_indices(anchors: jax.Array, keep: jax.Array, seq_len: int, block_size: int):
    """Raw label positions a+k+1 [B,N,G] and their safe version (clamped to S-1, 0 if not kept)."""
    raw = anchors[:, :, None] + jnp.arange(1, block_size + 1, dtype=jnp.int32)[None, None, :]
    safe = jnp.where(keep[:, :, None], jnp.minimum(raw, seq_len - 1), 0)
    return raw, safe


def block_targets(input_ids: jax.Array, loss_mask: jax.Array, anchors: jax.Array, keep: jax.Array,
                  block_size: int):
    """Labels y [B,N,G], eval mask [B,N,G] (contiguous prefix), and safe label positions."""
    b, s = input_ids.shape
    raw, safe = label_indices(anchors, keep, s, block_size)
    gather = lambda a: jnp.take_along_axis(a[:, None, :], safe.reshape(b, 1, -1), axis=2).reshape(safe.shape)
    labels = gather(input_ids)
    valid = (raw < s) & (gather(loss_mask) > 0.5) & keep[:, :, None]
    eval_mask = jnp.cumprod(valid.astype(jnp.int32), axis=-1).astype(bool)
    return labels, eval_mask, safe


def block_input_ids(input_ids: jax.Array, anchors: jax.Array, keep: jax.Array, block_size: int,
                    mask_token_id: int) -> jax.Array:
    """[x0, MASK, ..., MASK] per block [B, N, G]; all MASK for unused slots."""
    anchor_tok = jnp.take_along_axis(input_ids, anchors, axis=1)
    first = jnp.where(keep, anchor_tok, mask_token_id)
    rest = jnp.full((*anchors.shape, block_size - 1), mask_token_id, input_ids.dtype)
    return jnp.concatenate([first[..., None].astype(input_ids.dtype), rest], axis=-1)
