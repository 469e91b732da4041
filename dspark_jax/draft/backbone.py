"""DSpark parallel backbone: context projection and block attention over [ctx ; block].

Shapes: B batch, N blocks per row (anchors; 1 at decode time), G = block_size,
S context rows, H hidden, Ld draft layers, Hkv KV heads, D head_dim.

Context keys/values are computed once per layer (``context_kv``) so decoding
can keep them in a cache and training computes them for the whole sequence.
Each block attends jointly (one softmax) to the context rows it may see and
to every position of its own block, at cost O(N*G*(S+G)) per head.

``params["layers"]`` is either stacked ([Ld, ...] leaves: a ``lax.scan`` over layers) or a tuple
of per-layer trees (``params.for_platform`` on GPUs: an unrolled loop that reads each layer's
weights and context K/V where they lie; XLA:GPU copies a scan's slices before each gemm).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax import nn
from dspark_jax.kernels import flash, partials
from dspark_jax.config import DraftConfig


def project_context(params: dict, config: DraftConfig, target_features: jax.Array) -> jax.Array:
    """[B, S, n*H] concatenated target layer outputs -> ctx [B, S, H] = RMSNorm(fc(x))."""
    x = target_features.astype(params["fc"].dtype) @ params["fc"]
    return nn.rms_norm(x, params["hidden_norm"], config.rms_norm_eps)


def context_kv(params: dict, config: DraftConfig, ctx: jax.Array, positions: jax.Array):
    """Per-layer keys/values of ctx [B, S, H] at ``positions [B, S]``.

    Returns k, v [Ld, B, Hkv, S, D] (k normed and rotated; head-major, the context cache's
    layout: ``nn.cache_scores``), the same for every layer's input since ctx does not pass
    through the layers' input norms.
    """
    cos, sin = nn.rope_cos_sin(positions, config.head_dim, config.rope_theta)

    def one_layer(p):
        k, v = nn.kv_heads(ctx, p, config.num_key_value_heads, config.head_dim, config.rms_norm_eps)
        return nn.head_major(nn.apply_rope(k, cos, sin)), nn.head_major(v)

    return map_layers(one_layer, params["layers"])


def map_layers(one_layer, layers):
    """``one_layer(p) -> (k, v)`` over a drafter's layers, stacked into [Ld, ...]: ``lax.map`` over
    stacked ``layers``, a Python loop over a tuple of per-layer trees (``params.for_platform``)."""
    if isinstance(layers, (list, tuple)):
        ks, vs = zip(*map(one_layer, layers))
        return jnp.stack(ks), jnp.stack(vs)
    return jax.lax.map(one_layer, layers)


def over_layers(layer, x, layers, ctx_k, ctx_v):
    """``layer(x, (p, k_ctx, v_ctx)) -> (x, None)`` applied layer after layer: a ``lax.scan`` over
    stacked ``layers`` and context K/V [Ld, B, Hkv, S, D], or for a tuple of per-layer trees an
    unrolled loop reading layer i's context K/V where it lies: per-layer buffers (L-tuples, a
    per-layer context cache) or the stacked arrays at a run-time index (``nn.layer_slices``: one
    kernel set for all layers)."""
    if not isinstance(layers, (list, tuple)):
        return jax.lax.scan(layer, x, (layers, ctx_k, ctx_v))[0]
    for i, p in enumerate(layers):
        kv = (ctx_k[i], ctx_v[i]) if isinstance(ctx_k, tuple) else nn.layer_slices((ctx_k, ctx_v), i)
        x, _ = layer(x, (p, *kv))
    return x


def block_visibility(ctx_mask: jax.Array, block_valid: jax.Array, g: int) -> jax.Array:
    """[B,1,1,N,1,S+G] bool: which of [ctx ; block] each block query sees (ctx_mask [B,N,S],
    block_valid [B,N]); the same for every layer, so ``block_forward`` builds it once."""
    b, n = block_valid.shape
    vis_ctx = ctx_mask & block_valid[:, :, None]
    vis_blk = jnp.broadcast_to(block_valid[:, :, None], (b, n, g))
    return jnp.concatenate([vis_ctx, vis_blk], axis=-1)[:, None, None, :, None, :]


def _block_attention(q, k_blk, v_blk, k_ctx, v_ctx, visible, scale=None):
    """q, k_blk, v_blk [B,N,G,H*,D]; k_ctx, v_ctx [B,Hkv,L,D] of which the first S slots are read
    (L >= S, S from ``visible``: ``block_visibility`` over S context rows).

    ``scale`` multiplies the scores (default D^-0.5; Gemma4 uses 1.0).
    """
    b, n, g, hq, d = q.shape
    hkv = k_ctx.shape[1]
    q = q.reshape(b, n, g, hkv, hq // hkv, d)
    s_blk = jnp.einsum("bngjrd,bnkjd->bjrngk", q, k_blk, preferred_element_type=jnp.float32)
    args = (q, s_blk, v_blk, k_ctx, v_ctx, visible)
    scale = d ** -0.5 if scale is None else scale
    if flash.applies(n * g, d, hq // hkv):  # a few queries: on CUDA the fused kernel (dspark_jax.kernels.flash)
        out = partials.dispatch(functools.partial(_joint_xla, scale=scale),
                             functools.partial(_joint_flash, scale=scale), *args)
    else:
        out = _joint_xla(*args, scale=scale)
    return out.reshape(b, n, g, hq * d)


def _joint_xla(q, s_blk, v_blk, k_ctx, v_ctx, visible, scale):
    """``_block_attention``'s joint softmax over [ctx ; block] in XLA ops: [B, N, G, Hkv, Hq/Hkv, D]."""
    b, n, g, hkv, r, d = q.shape
    s = visible.shape[-1] - g
    k_ctx, v_ctx = k_ctx[:, :, :s], v_ctx[:, :, :s]
    s_ctx = nn.cache_scores(q.reshape(b, n * g, hkv, r, d), k_ctx).reshape(b, hkv, r, n, g, s)
    probs = nn.masked_softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), visible, scale).astype(v_ctx.dtype)
    return (nn.cache_values(probs[..., :s].reshape(b, hkv, r, n * g, s), v_ctx).reshape(q.shape)
            + jnp.einsum("bjrngk,bnkjd->bngjrd", probs[..., s:], v_blk))


def _joint_flash(q, s_blk, v_blk, k_ctx, v_ctx, visible, scale):
    """The same with the context part in the flash-decoding kernel (CUDA): the cache is read in place."""
    b, n, g, hkv, r, d = q.shape
    s = visible.shape[-1] - g
    vis_ctx = jnp.broadcast_to(visible[:, 0, 0, :, :, :s], (b, n, g, s)).reshape(b, n * g, s)
    o, m, l = flash.cache_partials(q.reshape(b, n * g, hkv, r, d), k_ctx, v_ctx, vis_ctx, scale)
    unflat = lambda a: a.reshape(b, hkv, r, n, g, *a.shape[4:])
    out_ctx, probs = partials.merge(unflat(o), unflat(m), unflat(l), s_blk, visible[..., s:], scale)
    return (out_ctx.astype(v_ctx.dtype).transpose(0, 3, 4, 1, 2, 5)
            + jnp.einsum("bjrngk,bnkjd->bngjrd", probs.astype(v_ctx.dtype), v_blk))


def block_forward(
    params: dict,
    config: DraftConfig,
    block_embeds: jax.Array,
    block_positions: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_mask: jax.Array,
    block_valid: jax.Array,
    remat: bool | str = False,
) -> jax.Array:
    """Run the backbone over blocks.

    block_embeds [B, N, G, H]; block_positions [B, N, G]; ctx_k/ctx_v
    [Ld, B, Hkv, S, D] from ``context_kv``; ctx_mask [B, N, S] marks the context
    rows each block sees (position < anchor); block_valid [B, N] (False: the
    block sees nothing and its attention output is zero).
    ``remat`` rematerialises each layer in the backward pass (``jax.checkpoint``):
    False/"none" keeps everything, True/"dots" keeps only the weight matmuls'
    outputs (attention scores and elementwise ops are recomputed), "full" keeps
    nothing but the layer inputs. Values and gradients do not change.
    Per-layer ``params["layers"]`` (a tuple): an unrolled loop reading layer i's ctx_k / ctx_v,
    either per-layer buffers (L-tuples of [B, Hkv, L, D], L >= S: a per-layer context cache passed
    whole, its first S slots read) or the
    stacked arrays at a run-time index (``nn.layer_slices``: one kernel set for all layers).
    Returns hidden [B, N, G, H] after the final norm.
    """
    b, n, g, h = block_embeds.shape
    cos, sin = nn.rope_cos_sin(block_positions.reshape(b, n * g), config.head_dim, config.rope_theta)
    eps = config.rms_norm_eps
    visible = block_visibility(ctx_mask, block_valid, g)

    def layer(x, xs):
        p, k_ctx, v_ctx = xs
        hx = nn.rms_norm(x, p["input_layernorm"], eps).reshape(b, n * g, h)
        q, k, v = nn.qkv_heads(hx, p, config.num_attention_heads, config.num_key_value_heads,
                               config.head_dim, eps)
        q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
        split = lambda a: a.reshape(b, n, g, *a.shape[2:])
        attn = _block_attention(split(q), split(k), split(v), k_ctx.astype(q.dtype),
                                v_ctx.astype(q.dtype), visible)
        x = x + attn @ p["o_proj"]
        x = x + nn.swiglu_mlp(nn.rms_norm(x, p["post_attention_layernorm"], eps), p)
        return x, None

    if remat not in (False, None, "none"):
        layer = jax.checkpoint(layer, policy=remat_policy(remat))
    x = over_layers(layer, block_embeds, params["layers"], ctx_k, ctx_v)
    return nn.rms_norm(x, params["norm"], eps)


REMAT_MODES = ("none", "dots", "full")


def remat_policy(remat: bool | str):
    """jax.checkpoint policy of a ``remat`` setting (True = "dots")."""
    mode = "dots" if remat is True else remat
    if mode == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if mode == "full":
        return jax.checkpoint_policies.nothing_saveable
    raise ValueError(f"remat={remat!r} must be one of {REMAT_MODES} or a bool")
