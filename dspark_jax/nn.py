"""Shared pure layers: RMSNorm, rotate-half RoPE, masked GQA attention, SwiGLU MLP.

Conventions: activations are [batch, seq, ...]; dense kernels are stored
[in, out] (the transpose of torch ``nn.Linear.weight``); per-layer params of a
stack carry a leading ``layers`` axis and are consumed by ``lax.scan``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # large finite negative, so fully masked rows stay NaN-free


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3 RMSNorm: normalise in float32, cast back, then scale by ``weight``."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(dtype)


def rms_norm_f32(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm scaled in float32 (Gemma4, DeepSeek-V4): ``x * rsqrt(mean(x^2) + eps) * weight``
    (no 1 +; ``weight`` None: unweighted), cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    out = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        out = out * weight.astype(jnp.float32)
    return out.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [*positions.shape, head_dim] for rotate-half RoPE (float32)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, heads, head_dim]; cos/sin [B, S, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def masked_softmax(scores: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """softmax(scores * scale) over the last axis, restricted to ``visible`` (bool, broadcast).

    Masked entries get probability 0; a row with nothing visible is all zeros (not NaN).
    The one masking rule of every attention here (target, drafter blocks, plain).
    """
    scores = jnp.where(visible, scores * scale, NEG_INF)
    return jnp.where(visible, jax.nn.softmax(scores, axis=-1), 0.0)


def read_span(cache_span: int | None, capacity: int) -> int:
    """The number of cache slots an extend reads: ``cache_span`` (static; the caller guarantees
    every row it reads has fewer committed slots), default the whole ``capacity``. ValueError
    outside [0, capacity]."""
    span = capacity if cache_span is None else int(cache_span)
    if not 0 <= span <= capacity:
        raise ValueError(f"cache_span {span} is outside [0, capacity {capacity}]")
    return span


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None,
              scale: float | None = None) -> jax.Array:
    """Masked GQA attention, optionally jointly over a read-only prefix (a KV cache).

    q [B, Q, Hq, D]; k, v [B, K, Hkv, D]; mask [B, Q, K] (True = visible).
    ``prefix = (k_pre, v_pre, pre_mask)`` with k_pre, v_pre [B, L, Hkv, D] and
    pre_mask [B, Q, S], S <= L: one softmax over [the first S prefix slots ; k] without
    materialising their concatenation (a cache read over its used span, ``read_span``; S = 0:
    no prefix). Rows with no visible key return zeros. ``scale`` multiplies the scores
    (default D^-0.5; Gemma4 uses 1.0). Returns [B, Q, Hq, D].
    """
    b, nq, hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    hkv = k.shape[2]
    qg = q.reshape(b, nq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    if prefix is None or prefix[2].shape[-1] == 0:
        probs = masked_softmax(scores, mask[:, None, None, :, :], scale).astype(v.dtype)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
        return out.reshape(b, nq, hq, d)
    k_pre, v_pre, pre_mask = prefix
    s = pre_mask.shape[-1]
    k_pre, v_pre = k_pre[:, :s], v_pre[:, :s]
    s_pre = cache_scores(qg, k_pre)
    m = jnp.concatenate([pre_mask, mask], axis=-1)[:, None, None]
    probs = masked_softmax(jnp.concatenate([s_pre, scores], axis=-1), m, scale).astype(v.dtype)
    out = cache_values(probs[..., :s], v_pre) + jnp.einsum("bhgqk,bkhd->bqhgd", probs[..., s:], v)
    return out.reshape(b, nq, hq, d)


# Attention over a cache stored [B, S, Hkv, D] (the target's KV cache, the drafter's context
# cache). A dot batched over (B, Hkv) wants those two axes leading, so XLA:GPU copies the cache
# into that order first -- and hoists the copy of every layer's cache out of the layer loop: two
# cache-sized temporaries and three cache reads per decode step. For the few queries of a decode
# step (<= SMALL_QUERY per row) the GPU forms below avoid the dot batched over (B, Hkv): values
# as one gemm batched over B alone ([B, Hkv*G*Q, S] x [B, S, Hkv*D], the cache as stored; Hkv
# times the small PV FLOPs) keeping each head's own block -- no V copy; scores as a multiply
# fused into a reduction over D (f32, like the dot's accumulation) -- no K copy at B = 1, but at
# larger B XLA still re-lays K for the key-minor softmax (docs/performance.md section 0a).
# Other backends, and long query blocks (prefill, training), keep the dots.
SMALL_QUERY = 16


def cache_scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """f32 scores [B, Hkv, G, Q, S] of queries qg [B, Q, Hkv, G, D] against a cache k [B, S, Hkv, D]."""
    if qg.shape[1] > SMALL_QUERY:
        return _scores_dot(qg, k)
    return jax.lax.platform_dependent(qg, k, default=_scores_dot, cuda=_scores_in_place)


def cache_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """[B, Q, Hkv, G, D] (v's dtype): probs [B, Hkv, G, Q, S] over a cache v [B, S, Hkv, D]."""
    if probs.shape[3] > SMALL_QUERY:
        return _values_dot(probs, v)
    return jax.lax.platform_dependent(probs, v, default=_values_dot, cuda=_values_in_place)


def _scores_dot(qg, k):
    return jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)


def _scores_in_place(qg, k):
    prod = qg[:, :, None].astype(jnp.float32) * k[:, None, :, :, None, :].astype(jnp.float32)
    return jnp.sum(prod, axis=-1).transpose(0, 3, 4, 1, 2)


def _values_dot(probs, v):
    return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)


def _values_in_place(probs, v):
    b, h, g, q, s = probs.shape
    full = jnp.einsum("bhgqk,bkx->bhgqx", probs, v.reshape(b, s, h * v.shape[-1]),
                      preferred_element_type=jnp.float32).reshape(b, h, g, q, h, v.shape[-1])
    own = jnp.eye(h, dtype=bool)[:, None, None, :, None]
    return jnp.sum(jnp.where(own, full, 0.0), axis=4).transpose(0, 3, 1, 2, 4).astype(v.dtype)


def swiglu_mlp(x: jax.Array, p: dict) -> jax.Array:
    """down(silu(gate(x)) * up(x)); kernels [H, I], [H, I], [I, H]."""
    gate = x @ p["gate_proj"]
    up = x @ p["up_proj"]
    return (jax.nn.silu(gate) * up) @ p["down_proj"]


def qkv_heads(x: jax.Array, p: dict, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """Project x [B, S, H] to q [B,S,Hq,D] and k, v [B,S,Hkv,D]; q/k per-head RMSNorm applied."""
    b, s, _ = x.shape
    q = (x @ p["q_proj"]).reshape(b, s, num_heads, head_dim)
    k = (x @ p["k_proj"]).reshape(b, s, num_kv_heads, head_dim)
    v = (x @ p["v_proj"]).reshape(b, s, num_kv_heads, head_dim)
    return rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps), v


def kv_heads(x: jax.Array, p: dict, num_kv_heads: int, head_dim: int, eps: float):
    """k (normed) and v [B, S, Hkv, D] of x [B, S, H]."""
    b, s, _ = x.shape
    k = (x @ p["k_proj"]).reshape(b, s, num_kv_heads, head_dim)
    v = (x @ p["v_proj"]).reshape(b, s, num_kv_heads, head_dim)
    return rms_norm(k, p["k_norm"], eps), v
