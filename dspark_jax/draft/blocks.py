"""Block maths of a training batch: labels, eval mask and block inputs per anchor.

Shapes: B sequences of length S, N anchors per sequence, G = block_size. Block n of row b
starts at anchor a = anchors[b, n]: its input is [x_a, MASK, ..., MASK] at positions
a..a+G-1 and its labels are x_{a+1}..x_{a+G} (paper section 3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
