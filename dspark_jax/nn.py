"""Shared pure layers: RMSNorm, rotate-half RoPE, masked GQA attention, SwiGLU MLP.

Conventions: activations are [batch, seq, ...]; dense kernels are stored
[in, out] (the transpose of torch ``nn.Linear.weight``); per-layer params of a
stack carry a leading ``layers`` axis and are consumed by ``lax.scan``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from dspark_jax.kernels import flash, flash_tpu, partials
from dspark_jax.kernels.partials import NEG_INF, SMALL_QUERY


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
              prefix: tuple | None = None,
              scale: float | None = None, causal: bool = False, window: int | None = None) -> jax.Array:
    """Masked GQA attention, optionally jointly over a read-only prefix (a KV cache).

    q [B, Q, Hq, D]; k, v [B, K, Hkv, D]; mask [B, Q, K] (True = visible).
    ``prefix = (k_pre, v_pre, pre_mask)`` with k_pre, v_pre [B, Hkv, L, D] (head-major, the
    layout caches are stored in: see ``cache_scores``) and pre_mask [B, Q, S], S <= L: one
    softmax over [the first S prefix slots ; k] without materialising their concatenation (a
    cache read over its used span, ``read_span``; S = 0: no prefix). Or ``(k_all, v_all, pre_mask,
    layer)``: whole stacked caches [Lyr, B, Hkv, L, D] and this layer's place in them
    (``flash_tpu.Layer``), read at ``layer.index`` (for TPU programs, whose kernel reads the stack
    in place: a slice would be copied first). Rows with no visible key
    return zeros. ``scale`` multiplies the scores (default D^-0.5; Gemma4 uses 1.0).
    ``causal``: the caller's promise that ``mask`` is the causal mask of the new tokens (query t
    sees keys <= t; Q = K; with ``window``: only keys > t - window, a sliding window): without a
    prefix, on CUDA, that is cuDNN's fused flash attention (``causal_fused``), which never writes
    the [Q, K] scores to memory. With a prefix, on CUDA, a few queries (``flash.applies``: a
    decode step's) read it in the fused flash-decoding kernel (``kernels.flash``); a stacked
    prefix on TPU, in ``kernels.flash_tpu``'s.
    Returns [B, Q, Hq, D].
    """
    b, nq, hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    if causal and (prefix is None or prefix[2].shape[-1] == 0) and fused_causal_ok(q):
        return jax.lax.platform_dependent(q, k, v, default=lambda q, k, v: attention(q, k, v, mask, None, scale),
                                          cuda=lambda q, k, v: causal_fused(q, k, v, scale, window))
    hkv = k.shape[2]
    qg = q.reshape(b, nq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    if prefix is None or prefix[2].shape[-1] == 0:
        probs = masked_softmax(scores, mask[:, None, None, :, :], scale).astype(v.dtype)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
        return out.reshape(b, nq, hq, d)
    if len(prefix) == 4:  # a stacked cache: on TPU the flash-decoding kernel reads layer ``index`` in place
        k_all, v_all, pre_mask, layer = prefix
        where = dataclasses.replace(layer, index=None)
        out = partials.dispatch(functools.partial(_joint_stacked_xla, scale=scale),
                                functools.partial(_joint_stacked_tpu, scale=scale, where=where),
                                qg, scores, mask, v, k_all, v_all, pre_mask, layer.index, platform="tpu")
        return out.reshape(b, nq, hq, d)
    args = (qg, scores, mask, v, *prefix)
    if flash.applies(nq, d, hq // hkv):  # a few queries: on CUDA the fused kernel (kernels.flash)
        out = partials.dispatch(functools.partial(_joint_xla, scale=scale),
                                functools.partial(_joint_flash, scale=scale), *args)
    else:
        out = _joint_xla(*args, scale=scale)
    return out.reshape(b, nq, hq, d)


def _joint_xla(qg, scores, mask, v, k_pre, v_pre, pre_mask, scale):
    """``attention``'s joint softmax over [cache ; block] in XLA ops: [B, Q, Hkv, G, D]."""
    s = pre_mask.shape[-1]
    k_pre, v_pre = k_pre[:, :, :s], v_pre[:, :, :s]
    s_pre = cache_scores(qg, k_pre)
    m = jnp.concatenate([pre_mask, mask], axis=-1)[:, None, None]
    probs = masked_softmax(jnp.concatenate([s_pre, scores], axis=-1), m, scale).astype(v.dtype)
    return cache_values(probs[..., :s], v_pre) + jnp.einsum("bhgqk,bkhd->bqhgd", probs[..., s:], v)


def _joint_stacked_xla(qg, scores, mask, v, k_all, v_all, pre_mask, layer, scale):
    """``_joint_xla`` over layer ``layer`` of stacked caches k_all, v_all [Lyr, B, Hkv, L, D]."""
    k_pre, v_pre = (jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False) for a in (k_all, v_all))
    return _joint_xla(qg, scores, mask, v, k_pre, v_pre, pre_mask, scale)


def _joint_flash(qg, scores, mask, v, k_pre, v_pre, pre_mask, scale):
    """The same with the cache part in the flash-decoding kernel (CUDA): the cache is read in place."""
    return _merge_block(flash.cache_partials(qg, k_pre, v_pre, pre_mask, scale), scores, mask, v, scale)


def _joint_stacked_tpu(qg, scores, mask, v, k_all, v_all, pre_mask, layer, scale, where):
    """``_joint_stacked_xla`` with the cache part in the TPU kernel, which reads the stacks in place."""
    parts = flash_tpu.cache_partials(qg, k_all, v_all, layer, pre_mask, scale, where)
    return _merge_block(parts, scores, mask, v, scale)


def _merge_block(parts, scores, mask, v, scale):
    """The cache's softmax partials (o, m, l) [B, Hkv, G, Q, ..] merged with the block's own raw
    scores [B, Hkv, G, Q, K] (``partials.merge``) and its values v [B, K, Hkv, D]: [B, Q, Hkv, G, D]."""
    out_pre, probs = partials.merge(*parts, scores, mask[:, None, None], scale)
    return (out_pre.astype(v.dtype).transpose(0, 3, 1, 2, 4)
            + jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v))


def fused_causal_ok(q: jax.Array) -> bool:
    """Whether ``causal_fused`` takes queries like q [B, T, Hq, D]: bf16 / f16, D a multiple of 8
    up to 128 (cuDNN flash attention in jax 0.10; Gemma4's 256 / 512 head dims keep the XLA
    form), and a jaxlib that has cuDNN (the CUDA plugin; tracing the fused form needs it, even
    where only the CPU branch is compiled)."""
    d = q.shape[-1]
    return q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128 and _has_cudnn()


def causal_fused(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, window: int | None = None) -> jax.Array:
    """Causal GQA attention of q [B, T, Hq, D] over k, v [B, T, Hkv, D] by cuDNN's flash attention
    (CUDA only): softmax(q k^T * scale) v with the [T, T] scores kept on chip; ``window``: query t
    sees keys t - window + 1 .. t. The train step's and the prefill's target attention: the XLA
    form writes f32 scores [B, Hq, T, T] and reads them back several times, most of a train
    step's HBM traffic (docs/performance.md)."""
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=local,
                                        implementation="cudnn")


@functools.cache
def _has_cudnn() -> bool:
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
    except Exception:  # no CUDA plugin / cuDNN in this jaxlib: the XLA form everywhere
        return False
    return True


# Attention over a cache (the target's KV cache, the drafter's context cache). Caches are stored
# head-major, [.., B, Hkv, S, D] per layer, so that the attention dots -- batched over (B, Hkv),
# contracting D (scores) and S (values) -- read them as they are: no relayout of the cache on
# GPU (stored [B, S, Hkv, D], XLA:GPU copied the whole stacked K cache into this order every
# step; docs/performance.md sections 0a, 0c). Inside a layer scan XLA:GPU still gives a
# cuBLAS gemm its own copy of the layer's slice; for the few queries of a decode step
# (<= SMALL_QUERY per row) the scores on CUDA are therefore a multiply fused into a reduction
# over D (f32, like the dot's accumulation), which reads K in place. Other backends, and long
# query blocks (prefill, training), use the dot. (On CUDA, ``attention`` and the drafter's block
# attention hand a decode step's few queries to ``kernels.flash`` instead, which reads K and V
# in place and keeps the scores on chip; these XLA ops remain for shapes it does not take.)


def head_major(x: jax.Array) -> jax.Array:
    """[B, S, Hkv, D] -> [B, Hkv, S, D]: new keys / values in the order caches keep them."""
    return x.transpose(0, 2, 1, 3)


def cache_scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """f32 scores [B, Hkv, G, Q, S] of queries qg [B, Q, Hkv, G, D] against a cache k [B, Hkv, S, D]."""
    if qg.shape[1] > SMALL_QUERY:
        return _scores_dot(qg, k)
    return jax.lax.platform_dependent(qg, k, default=_scores_dot, cuda=_scores_in_place)


def cache_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """[B, Q, Hkv, G, D] (v's dtype): probs [B, Hkv, G, Q, S] over a cache v [B, Hkv, S, D]. The
    dot's output keeps (B, Hkv) leading (``bhgqd``; XLA:GPU transposes the cache for a ``bqhgd``
    output at B = 1), then the small result is transposed. On CUDA, for one query, a multiply
    fused into a reduction over S reads V in place (like ``cache_scores``). For several queries
    (a verify block, a drafter block) XLA:GPU lays that reduction out with S minor: a transposed
    copy of V (of the whole stack inside a layer scan, of the layer's slice in an unrolled loop),
    written and read in f32-probability-sized passes; the dot's copy of one layer's slice costs
    less (Qwen3-8B + DSpark round at B = 8 on H200: 55.7 -> 51.6 GB per step)."""
    if probs.shape[3] > 1:
        out = _values_dot(probs, v)
    else:
        out = jax.lax.platform_dependent(probs, v, default=_values_dot, cuda=_values_in_place)
    return out.transpose(0, 3, 1, 2, 4)


def _values_dot(probs, v):
    return jnp.einsum("bhgqk,bhkd->bhgqd", probs, v)


def _values_in_place(probs, v):
    p = probs[..., None].astype(jnp.float32)                                   # [B, Hkv, G, Q, S, 1]
    return jnp.sum(p * v[:, :, None, None].astype(jnp.float32), axis=-2).astype(v.dtype)


def _scores_dot(qg, k):
    return jnp.einsum("bqhgd,bhkd->bhgqk", qg, k, preferred_element_type=jnp.float32)


def _scores_in_place(qg, k):
    q = qg.transpose(0, 2, 3, 1, 4)[:, :, :, :, None, :].astype(jnp.float32)   # [B, Hkv, G, Q, 1, D]
    return jnp.sum(q * k[:, :, None, None].astype(jnp.float32), axis=-1)


def layer_slices(stacked: tuple[jax.Array, ...], i: int) -> tuple[jax.Array, ...]:
    """Layer ``i`` of each of the ``stacked`` [L, ...] arrays, indexed at run time: the index
    passes an optimisation barrier, so that in an unrolled layer loop every layer's kernels are
    the same program (compiled once) rather than one program per constant slice."""
    index = jax.lax.optimization_barrier(jnp.int32(i))
    return tuple(jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False) for a in stacked)


def project_f32(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., H] @ kernel [H, V] accumulated and returned in float32 (LM heads; ``dense``)."""
    return dense(x, kernel, jnp.float32)


def dense(x: jax.Array, kernel: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., H] @ kernel [H, N] (``out_dtype``: the accumulation and result dtype; None: the
    operands' product dtype).

    A single row (an AR step at B = 1) is padded to two on CUDA, where XLA:GPU turns a one-row
    product into something that moves the kernel more than once: with an f32 result a gemv that
    first converts the whole kernel to f32 (a 2.3 GiB copy of Qwen3-8B's LM head per step); two
    products of one input (a layer's k and v projections) a multiply fusion that writes both
    [H, N] products out before reducing them (3x the weights' bytes). Two rows go to cuBLAS."""
    if math.prod(x.shape[:-1]) != 1:
        return _dot(x, kernel, out_dtype)
    return jax.lax.platform_dependent(x, kernel, default=lambda x, k: _dot(x, k, out_dtype),
                                      cuda=lambda x, k: _dot_two_rows(x, k, out_dtype))


def _dot(x, kernel, out_dtype):
    return jnp.einsum("...h,hv->...v", x, kernel, preferred_element_type=out_dtype)


def _dot_two_rows(x, kernel, out_dtype):
    rows = x.reshape(1, x.shape[-1])
    return _dot(jnp.concatenate([rows, jnp.zeros_like(rows)]), kernel, out_dtype)[:1].reshape(*x.shape[:-1], -1)


def swiglu_mlp(x: jax.Array, p: dict) -> jax.Array:
    """down(silu(gate(x)) * up(x)); kernels [H, I], [H, I], [I, H]."""
    gate = x @ p["gate_proj"]
    up = x @ p["up_proj"]
    return (jax.nn.silu(gate) * up) @ p["down_proj"]


def qkv_heads(x: jax.Array, p: dict, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """Project x [B, S, H] to q [B,S,Hq,D] and k, v [B,S,Hkv,D]; q/k per-head RMSNorm applied.

    On TPU, for more than one row, each product is kept out of the fusion that follows it
    (``_unfused_on_tpu``): fused with the per-head norm / head split, XLA:TPU copies the layer's
    kernel shard transposed (head-minor) before each product (Qwen3-8B, v5e tensor=8: the q
    kernel's [4096, 512] shard; v5p tensor=4: also k's and v's [4096, 256]; 3 passes of the
    shard per layer and step where the product reads it once; ``benchmarks/results/tpu_copies``).
    Same values."""
    b, s, _ = x.shape
    q = _unfused_on_tpu(dense(x, p["q_proj"])).reshape(b, s, num_heads, head_dim)
    k, v = kv_heads(x, p, num_kv_heads, head_dim, eps)
    return rms_norm(q, p["q_norm"], eps), k, v


def _unfused_on_tpu(y: jax.Array) -> jax.Array:
    """y [B, S, N] behind an optimization barrier on TPU when B * S > 1 (``qkv_heads``)."""
    if y.shape[0] * y.shape[1] == 1:
        return y
    return jax.lax.platform_dependent(y, default=lambda a: a, tpu=jax.lax.optimization_barrier)


def kv_heads(x: jax.Array, p: dict, num_kv_heads: int, head_dim: int, eps: float):
    """k (normed) and v [B, S, Hkv, D] of x [B, S, H] (products unfused on TPU: ``qkv_heads``)."""
    b, s, _ = x.shape
    k = _unfused_on_tpu(dense(x, p["k_proj"])).reshape(b, s, num_kv_heads, head_dim)
    v = _unfused_on_tpu(dense(x, p["v_proj"])).reshape(b, s, num_kv_heads, head_dim)
    return rms_norm(k, p["k_norm"], eps), v
