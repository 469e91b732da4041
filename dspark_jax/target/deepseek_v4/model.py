"""The DeepSeek-V4 forward (prefill, no cache) as pure functions over the declared params tree.

Shapes: B batch, S tokens, H hidden, N = ``hc_mult`` residual streams, nh heads of D = ``head_dim``
(one shared K = V head), r = rope dims (the last ``qk_rope_head_dim`` of a head, interleaved pairs),
T compressed entries (``S // ratio``), E routed experts, k = ``num_experts_per_tok``.

Layer i (mHC residual, streams ``x [B, S, N, H]``)::

    pre, post, comb = hc(x);  y = attn(attn_norm(sum_n pre_n x_n))
    x = post ⊗ y + combᵀ x            (comb: Sinkhorn-projected N x N, applied as combᵀ)
    same again with ffn_norm and the MoE

Attention: sliding window (a query at p sees keys p - W + 1 .. p) plus, on CSA / HCA layers, the
compressed entries of that layer's compressor appended after the window keys. Entry w pools
tokens ``w * ratio .. (w + 1) * ratio - 1`` (CSA also the previous window's first half series)
and is visible to a query at p iff ``w < (p + 1) // ratio`` (all its tokens are <= p). CSA keeps,
per query, the Lightning Indexer's top ``index_topk`` among the entries that query may see
(causal: masked *before* the top-k, so a prefix's logits never depend on later tokens).
transformers' ``DeepseekV4ForCausalLM`` (5.10 and 5.24) is not causal in its full-sequence forward
once entries exceed ``index_topk`` (a 23-token prefix's logits move by ~2.4 when 17 tokens are
appended, 16 experts, top-k 3 of 10 entries), so we match it where it is right: everywhere when
top-k >= entries (the golden fixture), and at a prompt's last position otherwise (no future
entries exist there). tests/test_deepseek_v4.py checks our causality directly.

MoE dispatch (``moe.py``): dense (every expert on every token; the exact reference, for tiny
sizes) or sorted (assignments sorted by expert, a grouped matmul, un-sorted: the routed FLOPs of
the k chosen experts only), both lossless, expert-parallel over an ``expert`` mesh axis; that
module's docstring gives the costs.

Attention is dense too: [B, nh, S, S + T] scores (window and compressed masks), O(S²) memory.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import nn
from dspark_jax.target.deepseek_v4 import moe as moe_lib
from dspark_jax.target.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config

NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------- small pieces

rms_norm = nn.rms_norm_f32  # scaled in float32, cast back


def inv_freq(cfg: DeepseekV4Config, compressed: bool) -> np.ndarray:
    """[r / 2] rotary frequencies: ``rope_theta`` plain (sliding layers) or ``compress_rope_theta``
    with YaRN (compressed layers; attention factor 1, i.e. no magnitude scaling)."""
    dim = cfg.qk_rope_head_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    if not compressed or cfg.yarn is None:
        return (1.0 / pos_freqs).astype(np.float32)
    factor, original, beta_fast, beta_slow = cfg.yarn

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation).astype(np.float32)


def rope_table(cfg: DeepseekV4Config, positions: jax.Array, compressed: bool) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [..., r / 2] float32 at integer ``positions``."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(cfg, compressed))
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x`` [B, S, D] or [B, S, heads, D] as
    interleaved pairs (a, b) -> (a c - b s, b c + a s) in float32; ``cos``/``sin`` [S, r/2].
    The inverse rotation is ``apply_rope(x, cos, -sin)``."""
    half = cos.shape[-1]
    if x.ndim == 4:
        cos, sin = cos[:, None, :], sin[:, None, :]
    nope, rope = x[..., :-2 * half], x[..., -2 * half:].astype(jnp.float32)
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)


# ----------------------------------------------------------------------------- mHC

def hc_weights(cfg: DeepseekV4Config, streams: jax.Array, fn, base, scale):
    """(pre [B,S,N], post [B,S,N], comb [B,S,N,N]) float32 of one hyper-connection."""
    n = cfg.hc_mult
    flat = rms_norm(streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32), None, cfg.rms_norm_eps)
    mixes = flat @ fn.astype(jnp.float32).T
    pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = mixes[..., 2 * n:].reshape(*mixes.shape[:-1], n, n) * scale[2] + base[2 * n:].reshape(n, n)
    comb = jax.nn.softmax(logits, axis=-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdims=True) + cfg.hc_eps)

    def sinkhorn(_, c):
        c = c / (c.sum(-1, keepdims=True) + cfg.hc_eps)
        return c / (c.sum(-2, keepdims=True) + cfg.hc_eps)

    return pre, post, jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn, comb)


def collapse(pre: jax.Array, streams: jax.Array) -> jax.Array:
    """sum_n pre_n streams_n: [B,S,N] x [B,S,N,H] -> [B,S,H] (streams' dtype)."""
    return jnp.einsum("bsn,bsnh->bsh", pre, streams.astype(jnp.float32)).astype(streams.dtype)


def expand(post, comb, out, streams):
    """post ⊗ out + combᵀ streams -> [B,S,N,H]."""
    dt = streams.dtype
    return (post.astype(dt)[..., None] * out[..., None, :]
            + jnp.einsum("bsnm,bsnh->bsmh", comb.astype(dt), streams))


def hc_head(cfg: DeepseekV4Config, params, streams: jax.Array) -> jax.Array:
    """The final stream collapse (before ``norm``): [B,S,N,H] -> [B,S,H]."""
    p = params["hc_head"]
    flat = rms_norm(streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32), None, cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(flat @ p["fn"].astype(jnp.float32).T * p["scale"][0] + p["base"]) + cfg.hc_eps
    return collapse(pre, streams)


# ----------------------------------------------------------------------------- compressed branches

def compress(cfg, x: jax.Array, p: dict, ratio: int, overlap: bool, width: int, prefix: str = ""):
    """Pooled entries [B, T, width] of one compressor (T = S // ratio, trailing partial window
    dropped), normed and rotated at positions ``w * ratio`` (compressed rope table).

    HCA (``overlap`` False): entry w = softmax-gated sum of window w. CSA: the projections are 2x
    wide, series a (first half) and b; entry w pools window w-1's series a with window w's series b
    (2 * ratio slots; entry 0's missing half has gate -inf).
    """
    b, s, _ = x.shape
    t = s // ratio
    xf = x[:, :t * ratio].astype(jnp.float32)
    kv = (xf @ p[prefix + "wkv"].astype(jnp.float32)).reshape(b, t, ratio, -1)
    gate = (xf @ p[prefix + "wgate"].astype(jnp.float32)).reshape(b, t, ratio, -1) + p[prefix + "ape"]
    if overlap:
        prev_kv = jnp.pad(kv[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_gate = jnp.pad(gate[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=NEG_INF)
        kv = jnp.concatenate([prev_kv, kv[..., width:]], axis=2)
        gate = jnp.concatenate([prev_gate, gate[..., width:]], axis=2)
    pooled = (kv * jax.nn.softmax(gate, axis=2)).sum(axis=2)
    pooled = rms_norm(pooled, p[prefix + "norm"], cfg.rms_norm_eps)
    cos, sin = rope_table(cfg, jnp.arange(t) * ratio, compressed=True)
    return apply_rope(pooled, cos, sin)


def visible_entries(positions: jax.Array, t: int, ratio: int) -> jax.Array:
    """[S, T] bool: entry w is complete at query position p iff w < (p + 1) // ratio."""
    return jnp.arange(t)[None, :] < ((positions + 1) // ratio)[:, None]


def index_select(cfg, x, q_residual, p, positions, cos, sin) -> jax.Array:
    """CSA's Lightning Indexer: [B, S, T] bool, the top ``index_topk`` entries by
    sum_h w_h ReLU(q_h . k) among the entries each query may see."""
    b, s, _ = x.shape
    keys = compress(cfg, x, p, cfg.csa_ratio, True, cfg.index_head_dim, prefix="index_")  # [B,T,d]
    t = keys.shape[1]
    q = (q_residual @ p["index_wq_b"]).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, cos, sin)
    scores = jax.nn.relu(jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32)))
    scores = scores * cfg.index_head_dim ** -0.5
    weights = (x @ p["index_weights_proj"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    total = jnp.einsum("bsht,bsh->bst", scores, weights)
    visible = visible_entries(positions, t, cfg.csa_ratio)[None]
    k = min(cfg.index_topk, t)
    if k == t:
        return jnp.broadcast_to(visible, total.shape)
    _, idx = jax.lax.top_k(jnp.where(visible, total, NEG_INF), k)  # [B, S, k]
    chosen = jnp.zeros((b, s, t), bool).at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], idx].set(True)
    return chosen & visible  # fewer than k visible: the -inf picks are dropped here


# ----------------------------------------------------------------------------- attention

def attention(cfg: DeepseekV4Config, lp: dict, cp: dict | None, kind: str, x: jax.Array,
              positions: jax.Array) -> jax.Array:
    """One attention sublayer: x [B,S,H] (normed) -> [B,S,H]. ``lp``: this layer's slice of
    ``layers``; ``cp``: its slice of ``csa`` / ``hca`` (None on sliding-only layers)."""
    b, s, _ = x.shape
    nh, d = cfg.num_attention_heads, cfg.head_dim
    cos, sin = rope_table(cfg, positions, compressed=kind != SLIDING)
    q_residual = rms_norm(x @ lp["wq_a"], lp["q_norm"], cfg.rms_norm_eps)
    q = rms_norm((q_residual @ lp["wq_b"]).reshape(b, s, nh, d), None, cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    kv = apply_rope(rms_norm(x @ lp["wkv"], lp["kv_norm"], cfg.rms_norm_eps), cos, sin)  # [B,S,D]
    rel = positions[:, None] - positions[None, :]
    mask = jnp.broadcast_to(((rel >= 0) & (rel < cfg.sliding_window))[None], (b, s, s))
    if kind != SLIDING:
        ratio = cfg.csa_ratio if kind == CSA else cfg.hca_ratio
        entries = compress(cfg, x, cp, ratio, kind == CSA, d).astype(kv.dtype)
        if kind == CSA:
            seen = index_select(cfg, x, q_residual, cp, positions, cos, sin)
        else:
            seen = jnp.broadcast_to(visible_entries(positions, entries.shape[1], ratio)[None],
                                    (b, s, entries.shape[1]))
        kv = jnp.concatenate([kv, entries], axis=1)
        mask = jnp.concatenate([mask, seen], axis=-1)
    logits = jnp.einsum("bshd,btd->bhst", q, kv).astype(jnp.float32) * d ** -0.5
    logits = jnp.where(mask[:, None], logits, NEG_INF)
    sink = jnp.broadcast_to(lp["attn_sink"].astype(jnp.float32)[None, :, None, None], (b, nh, s, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bhst,btd->bshd", probs.astype(kv.dtype), kv)
    out = apply_rope(out, cos, -sin)
    g = cfg.o_groups
    grouped = out.reshape(b, s, g, nh * d // g)
    wo_a = lp["wo_a"].reshape(nh * d // g, g, cfg.o_lora_rank)
    return jnp.einsum("bsgi,igr->bsgr", grouped, wo_a).reshape(b, s, -1) @ lp["wo_b"]


# ----------------------------------------------------------------------------- MoE

def swiglu(cfg, x, w1, w3, w2):
    """Clamped SwiGLU (the shared expert): silu(min(x w1, limit)) * clip(x w3, ±limit), then w2."""
    lim = cfg.swiglu_limit
    return (jax.nn.silu(jnp.minimum(x @ w1, lim)) * jnp.clip(x @ w3, -lim, lim)) @ w2


def route(cfg, lp: dict, x: jax.Array, tokens: jax.Array, tid2eid: jax.Array | None,
          bias: jax.Array | None) -> jax.Array:
    """Combine weights [B, S, E] (zero for unchosen experts): scores sqrt(softplus(x W)); experts
    from ``tid2eid[token]`` (hash layers) or the top-k of scores + bias (the bias selects only);
    chosen scores renormalised and times ``routed_scaling_factor``."""
    scores = jnp.sqrt(jax.nn.softplus((x @ lp["gate"]).astype(jnp.float32)))
    if tid2eid is not None:
        idx = tid2eid[tokens]
    else:
        _, idx = jax.lax.top_k(scores + bias, cfg.num_experts_per_tok)
    chosen = jnp.take_along_axis(scores, idx, axis=-1)
    chosen = chosen / (chosen.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    onehot = jax.nn.one_hot(idx, cfg.n_routed_experts, dtype=jnp.float32)
    return jnp.einsum("bsk,bske->bse", chosen, onehot)


def moe(cfg, lp: dict, x: jax.Array, combine: jax.Array, ctx: Any = None) -> jax.Array:
    """Routed experts weighted by ``combine`` [B, S, E] (``moe.routed``: dense or sorted dispatch,
    expert-parallel on ``ctx.mesh``) plus the shared expert: x [B, S, H] -> [B, S, H]."""
    out = moe_lib.routed(cfg, x, combine, lp["experts_w1"], lp["experts_w3"], lp["experts_w2"], ctx)
    return out + swiglu(cfg, x, lp["shared_w1"], lp["shared_w3"], lp["shared_w2"])


# ----------------------------------------------------------------------------- the model

def _take(tree: dict, k: int) -> dict:
    return jax.tree.map(lambda a: a[k], tree)


def layer(cfg: DeepseekV4Config, params: dict, i: int, streams: jax.Array, tokens: jax.Array,
          positions: jax.Array, ctx: Any = None) -> jax.Array:
    """Decoder layer ``i``: streams [B,S,N,H] -> [B,S,N,H]."""
    lp = _take(params["layers"], i)
    kind = cfg.layer_types[i]
    group = {CSA: "csa", HCA: "hca"}.get(kind)
    cp = _take(params[group], cfg.layer_ids(kind).index(i)) if group else None
    pre, post, comb = hc_weights(cfg, streams, lp["hc_attn_fn"], lp["hc_attn_base"], lp["hc_attn_scale"])
    y = attention(cfg, lp, cp, kind, rms_norm(collapse(pre, streams), lp["attn_norm"], cfg.rms_norm_eps), positions)
    streams = expand(post, comb, y, streams)
    pre, post, comb = hc_weights(cfg, streams, lp["hc_ffn_fn"], lp["hc_ffn_base"], lp["hc_ffn_scale"])
    x = rms_norm(collapse(pre, streams), lp["ffn_norm"], cfg.rms_norm_eps)
    if cfg.mlp_layer_types[i] == HASH_MOE:
        combine = route(cfg, lp, x, tokens, params["hash"]["tid2eid"][cfg.mlp_ids(HASH_MOE).index(i)], None)
    else:
        combine = route(cfg, lp, x, tokens, None, params["moe"]["bias"][cfg.mlp_ids(MOE).index(i)])
    return expand(post, comb, moe(cfg, lp, x, combine, ctx), streams)


def _compute_dtype(params, ctx):
    dtype = getattr(ctx, "compute_dtype", None) if ctx is not None else None
    return jnp.dtype(dtype) if dtype is not None else params["embed"].dtype


def forward(params: dict, cfg: DeepseekV4Config, tokens: jax.Array, cache=None, *, ctx: Any = None,
            taps: Sequence[int] = (), span=None):
    """Prefill forward: tokens [B, S] int -> (hidden [B,S,H] after hc_head and norm, features, delta).

    ``features``: for each layer in ``taps`` the mean over its output's N streams (what V4's DSpark
    reads), concatenated [B, S, len(taps) * H] (None without taps). ``delta`` is None: only the
    ``cache=None`` path exists (the decode cache belongs to the runtime protocol). ``ctx``
    (optional, any object) carries ``compute_dtype`` and ``mesh`` / ``rules`` (expert-parallel
    sharding constraints in the MoE); ``span`` is accepted for the protocol and unused here.
    """
    if cache is not None:
        raise NotImplementedError("DeepSeek-V4: only the cache=None (prefill) forward exists so far")
    dtype = _compute_dtype(params, ctx)
    b, s = tokens.shape
    positions = jnp.arange(s)
    x = params["embed"][tokens].astype(dtype)
    streams = jnp.broadcast_to(x[:, :, None, :], (b, s, cfg.hc_mult, cfg.hidden_size))
    taps = tuple(taps)
    tapped = {}
    for i in range(cfg.num_hidden_layers):
        streams = layer(cfg, params, i, streams, tokens, positions, ctx)
        if i in taps:
            tapped[i] = streams.astype(jnp.float32).mean(axis=2).astype(dtype)
    hidden = rms_norm(hc_head(cfg, params, streams), params["norm"], cfg.rms_norm_eps)
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    return hidden, features, None


def compute_logits(params: dict, cfg: DeepseekV4Config, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (after the final norm) -> logits [..., V] float32 (untied ``head``)."""
    return (hidden @ params["head"].astype(hidden.dtype)).astype(jnp.float32)
