"""The DeepSeek-V4 forward as pure functions over the declared params tree: a whole sequence
(training, features) or new tokens over a decode cache (``cache.V4Cache``).

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

Attention over a whole sequence is dense too: [B, nh, S, S + T] scores (window and compressed
masks), O(S²) memory.

With a cache (``attention_step``), T new tokens at positions ``lengths[b] + t`` attend over
[the W-slot window ring | the T new keys | the committed entries (below ``span // ratio``) | the
M = ceil(T / ratio) entries the new tokens complete], masked by position: O(T (W + T + S / ratio))
per layer. An entry that the new tokens complete is pooled from the compressor's ring (the last
R committed projections) and the new projections (``pool_new``); the top-k of CSA's indexer is
taken over committed and new entries together, among those each query may see, so the cached
path selects what the whole-sequence path selects (tests/test_deepseek_v4_decode.py).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import nn
from dspark_jax.errors import ConfigError
from dspark_jax.target.deepseek_v4 import moe as moe_lib
from dspark_jax.target.deepseek_v4.cache import Compressor, V4Cache, V4Delta
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
    interleaved pairs (a, b) -> (a c - b s, b c + a s) in float32; ``cos``/``sin`` [S, r/2] (one
    table for every row) or [B, S, r/2] (per-row positions).
    The inverse rotation is ``apply_rope(x, cos, -sin)``."""
    half = cos.shape[-1]
    if x.ndim == 4:  # heads axis: cos [S, r/2] or [B, S, r/2] -> [..., S, 1, r/2]
        cos, sin = cos[..., None, :], sin[..., None, :]
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

def projections(x: jax.Array, p: dict, prefix: str = "") -> tuple[jax.Array, jax.Array]:
    """A compressor's raw per-token projections (kv, gate) [B, S, P] float32 (P = 2 * width on
    CSA's overlapping compressors, width on HCA's); what a decode cache keeps of a partial window."""
    xf = x.astype(jnp.float32)
    return xf @ p[prefix + "wkv"].astype(jnp.float32), xf @ p[prefix + "wgate"].astype(jnp.float32)


def pool(cfg, p: dict, prefix: str, kv, gate, prev_kv, prev_gate, entry_ids, ratio: int, width: int):
    """Pooled entries [B, M, width] (normed, rotated at ``entry_ids * ratio``) from windows' raw
    projections ``kv`` / ``gate`` [B, M, ratio, P] (window w of each entry, in slot order) and, on
    an overlapping (CSA) compressor, ``prev_*`` the window before it (gate -inf where it does not
    exist; None on HCA). HCA: softmax-gated sum of the window; CSA: window w-1's series a (the
    first ``width`` dims) pooled with window w's series b (the rest) over 2 * ratio slots.
    ``entry_ids`` [M] or [B, M]."""
    ape = p[prefix + "ape"]
    gate = gate + ape
    if prev_kv is not None:
        kv = jnp.concatenate([prev_kv[..., :width], kv[..., width:]], axis=-2)
        gate = jnp.concatenate([(prev_gate + ape)[..., :width], gate[..., width:]], axis=-2)
    pooled = (kv * jax.nn.softmax(gate, axis=-2)).sum(axis=-2)
    pooled = rms_norm(pooled, p[prefix + "norm"], cfg.rms_norm_eps)
    cos, sin = rope_table(cfg, entry_ids * ratio, compressed=True)
    return apply_rope(pooled, cos, sin)


def compress(cfg, x: jax.Array, p: dict, ratio: int, overlap: bool, width: int, prefix: str = ""):
    """Pooled entries [B, T, width] of one compressor over a whole sequence (T = S // ratio,
    trailing partial window dropped; ``pool``): entry w pools tokens w * ratio .. (w+1) * ratio - 1
    (CSA also window w-1's series a; entry 0's missing half has gate -inf)."""
    b, s, _ = x.shape
    t = s // ratio
    kv, gate = (a[:, :t * ratio].reshape(b, t, ratio, a.shape[-1]) for a in projections(x, p, prefix))
    prev_kv = prev_gate = None
    if overlap:
        shift = ((0, 0), (1, 0), (0, 0), (0, 0))
        prev_kv = jnp.pad(kv, shift)[:, :t]  # window w-1 at w (none at 0)
        prev_gate = jnp.pad(gate, shift, constant_values=NEG_INF)[:, :t]
    return pool(cfg, p, prefix, kv, gate, prev_kv, prev_gate, jnp.arange(t), ratio, width)


def visible_entries(positions: jax.Array, t: int, ratio: int) -> jax.Array:
    """[S, T] bool: entry w is complete at query position p iff w < (p + 1) // ratio."""
    return jnp.arange(t)[None, :] < ((positions + 1) // ratio)[:, None]


def index_scores(cfg, x, q_residual, p, keys, cos, sin) -> jax.Array:
    """The Lightning Indexer's score of every entry key ``keys`` [B, T, d] for every query:
    sum_h w_h ReLU(q_h . k) -> [B, S, T] float32."""
    b, s, _ = x.shape
    q = (q_residual @ p["index_wq_b"]).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, cos, sin)
    scores = jax.nn.relu(jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32)))
    scores = scores * cfg.index_head_dim ** -0.5
    weights = (x @ p["index_weights_proj"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    return jnp.einsum("bsht,bsh->bst", scores, weights)


def top_k_visible(cfg, scores: jax.Array, visible: jax.Array) -> jax.Array:
    """[B, S, T] bool: the top ``index_topk`` entries by ``scores`` among the ``visible`` ones
    (masked *before* the top-k: causal); all visible ones when top-k covers every entry."""
    b, s, t = scores.shape
    k = min(cfg.index_topk, t)
    if k == t:
        return visible
    _, idx = jax.lax.top_k(jnp.where(visible, scores, NEG_INF), k)  # [B, S, k]
    chosen = jnp.zeros((b, s, t), bool).at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], idx].set(True)
    return chosen & visible  # fewer than k visible: the -inf picks are dropped here


def index_select(cfg, x, q_residual, p, positions, cos, sin) -> jax.Array:
    """CSA's Lightning Indexer over a whole sequence: [B, S, T] bool (``top_k_visible``)."""
    keys = compress(cfg, x, p, cfg.csa_ratio, True, cfg.index_head_dim, prefix="index_")  # [B,T,d]
    visible = visible_entries(positions, keys.shape[1], cfg.csa_ratio)[None]
    scores = index_scores(cfg, x, q_residual, p, keys, cos, sin)
    return top_k_visible(cfg, scores, jnp.broadcast_to(visible, scores.shape))


# ----------------------------------------------------------------------------- attention

def query_and_kv(cfg: DeepseekV4Config, lp: dict, x: jax.Array, cos, sin):
    """(q_residual [B,S,q_lora], q [B,S,nh,D] rotated, kv [B,S,D] rotated) of normed x [B,S,H]."""
    b, s, _ = x.shape
    q_residual = rms_norm(x @ lp["wq_a"], lp["q_norm"], cfg.rms_norm_eps)
    q = rms_norm((q_residual @ lp["wq_b"]).reshape(b, s, cfg.num_attention_heads, cfg.head_dim), None,
                 cfg.rms_norm_eps)
    kv = apply_rope(rms_norm(x @ lp["wkv"], lp["kv_norm"], cfg.rms_norm_eps), cos, sin)
    return q_residual, apply_rope(q, cos, sin), kv


def attend(cfg: DeepseekV4Config, lp: dict, q: jax.Array, keys: jax.Array, mask: jax.Array, cos, sin):
    """Shared-K=V attention with sinks: q [B,S,nh,D] over keys [B,K,D] where ``mask`` [B,S,K];
    the inverse rotation on the output, then the grouped output projection -> [B,S,H]."""
    b, s, nh, d = q.shape
    logits = jnp.einsum("bshd,btd->bhst", q, keys).astype(jnp.float32) * d ** -0.5
    logits = jnp.where(mask[:, None], logits, NEG_INF)
    sink = jnp.broadcast_to(lp["attn_sink"].astype(jnp.float32)[None, :, None, None], (b, nh, s, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bhst,btd->bshd", probs.astype(keys.dtype), keys)
    out = apply_rope(out, cos, -sin)
    g = cfg.o_groups
    grouped = out.reshape(b, s, g, nh * d // g)
    wo_a = lp["wo_a"].reshape(nh * d // g, g, cfg.o_lora_rank)
    return jnp.einsum("bsgi,igr->bsgr", grouped, wo_a).reshape(b, s, -1) @ lp["wo_b"]


def attention(cfg: DeepseekV4Config, lp: dict, cp: dict | None, kind: str, x: jax.Array,
              positions: jax.Array) -> jax.Array:
    """One attention sublayer over a whole sequence: x [B,S,H] (normed) -> [B,S,H]. ``lp``: this
    layer's slice of ``layers``; ``cp``: its slice of ``csa`` / ``hca`` (None on sliding-only
    layers)."""
    b, s, _ = x.shape
    cos, sin = rope_table(cfg, positions, compressed=kind != SLIDING)
    q_residual, q, kv = query_and_kv(cfg, lp, x, cos, sin)
    rel = positions[:, None] - positions[None, :]
    mask = jnp.broadcast_to(((rel >= 0) & (rel < cfg.sliding_window))[None], (b, s, s))
    if kind != SLIDING:
        ratio = cfg.csa_ratio if kind == CSA else cfg.hca_ratio
        entries = compress(cfg, x, cp, ratio, kind == CSA, cfg.head_dim).astype(kv.dtype)
        if kind == CSA:
            seen = index_select(cfg, x, q_residual, cp, positions, cos, sin)
        else:
            seen = jnp.broadcast_to(visible_entries(positions, entries.shape[1], ratio)[None],
                                    (b, s, entries.shape[1]))
        kv = jnp.concatenate([kv, entries], axis=1)
        mask = jnp.concatenate([mask, seen], axis=-1)
    return attend(cfg, lp, q, kv, mask, cos, sin)


# ----------------------------------------------------------------------------- the cached path

def _rows(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a [B, N, ...] indexed per row by idx [B, ...] (clipped to [0, N)) -> [B, *idx[0].shape, ...]."""
    return jax.vmap(lambda x, i: x[i])(a, jnp.clip(idx, 0, a.shape[1] - 1))


def pool_new(cfg, p: dict, prefix: str, ring: Any, kv: jax.Array, gate: jax.Array, lengths: jax.Array,
             overlap: bool, width: int):
    """The entries that T new tokens (positions lengths[b] + t, raw projections kv / gate [B,T,P])
    complete, from ``ring`` (a ``cache.Compressor`` slice: the last R committed projections
    [B,R,P]). With M = ceil(T / ratio): (entries [B, M, width], zero where m is not completed;
    ends [B, M]: the token that completes entry m; valid [B, M])."""
    ratio = ring.ratio
    b, t, _ = kv.shape
    r = ring.kv.shape[1]
    recent = lengths[:, None] - r + jnp.arange(r)[None]  # [B, R]: positions of the ring, in order
    kv_all = jnp.concatenate([_rows(ring.kv, recent % r), kv], axis=1)  # [B, R+T, P]
    gate_all = jnp.concatenate([jnp.where((recent >= 0)[..., None], _rows(ring.gate, recent % r), NEG_INF),
                                gate], axis=1)
    ends = jnp.mod(ratio - 1 - lengths, ratio)[:, None] + ratio * jnp.arange(-(-t // ratio))[None]
    valid = ends < t
    window = r + ends[..., None] - ratio + 1 + jnp.arange(ratio)  # [B, M, ratio] into the *_all
    prev_kv = prev_gate = None
    if overlap:
        prev_kv, prev_gate = _rows(kv_all, window - ratio), _rows(gate_all, window - ratio)
    ids = (lengths[:, None] + ends + 1) // ratio - 1
    entries = pool(cfg, p, prefix, _rows(kv_all, window), _rows(gate_all, window), prev_kv, prev_gate,
                   ids, ratio, width)
    return jnp.where(valid[..., None], entries, 0), ends, valid


def _per_token(entries: jax.Array, ends: jax.Array, valid: jax.Array, steps: int) -> jax.Array:
    """Compact entries [B, M, E] at the tokens that complete them: [B, T, E], zero elsewhere."""
    b = entries.shape[0]
    at = jnp.where(valid, ends, steps)
    return jnp.zeros((b, steps, entries.shape[-1]), entries.dtype).at[jnp.arange(b)[:, None], at].set(
        entries, mode="drop")


def attention_step(cfg: DeepseekV4Config, lp: dict, cp: dict | None, kind: str, x: jax.Array,
                   positions: jax.Array, cache: Any, i: int, span: int | None):
    """One attention sublayer over T new tokens x [B,T,H] (normed) at ``positions`` [B,T] =
    ``cache.lengths[:, None] + t``, reading layer ``i``'s cache (``cache.V4Cache``; committed
    entries below ``span`` only). Keys: the window ring, the new tokens, the committed entries
    and the entries the new tokens complete. Returns (out [B,T,H], (window [B,T,D],
    compressor delta, indexer delta)): this layer's part of the ``V4Delta``."""
    b, t, _ = x.shape
    lengths = cache.lengths
    cos, sin = rope_table(cfg, positions, compressed=kind != SLIDING)
    q_residual, q, kv = query_and_kv(cfg, lp, x, cos, sin)
    ring = cache.window[i].astype(kv.dtype)  # [B, W, D]; slot s holds the latest position = s mod W
    w = ring.shape[1]
    held = lengths[:, None] - 1 - jnp.mod(lengths[:, None] - 1 - jnp.arange(w)[None], w)  # [B, W]
    step = jnp.arange(t)
    rel = step[:, None] - step[None, :]
    keys = [ring, kv]
    masks = [(held[:, None, :] >= 0) & (positions[:, :, None] - held[:, None, :] < cfg.sliding_window),
             jnp.broadcast_to(((rel >= 0) & (rel < cfg.sliding_window))[None], (b, t, t))]
    comp_delta = index_delta = None
    if kind != SLIDING:
        group = cache.csa if kind == CSA else cache.hca
        j = cfg.layer_ids(kind).index(i)
        comp = jax.tree.map(lambda a: a[j], group)
        ratio = comp.ratio
        n = comp.entries.shape[1] if span is None else min(comp.entries.shape[1], span // ratio)
        pk, pg = projections(x, cp)
        entries, ends, valid = pool_new(cfg, cp, "", comp, pk, pg, lengths, kind == CSA, cfg.head_dim)
        committed = jnp.arange(n)[None] < (lengths // ratio)[:, None]                # [B, n]
        fresh = valid[:, None, :] & (ends[:, None, :] <= step[None, :, None])         # [B, T, M]
        seen = jnp.concatenate([jnp.broadcast_to(committed[:, None], (b, t, n)), fresh], axis=-1)
        if kind == CSA:
            index = jax.tree.map(lambda a: a[j], cache.index)
            ik, ig = projections(x, cp, "index_")
            new_keys, _, _ = pool_new(cfg, cp, "index_", index, ik, ig, lengths, True, cfg.index_head_dim)
            scores = index_scores(cfg, x, q_residual, cp,
                                  jnp.concatenate([index.entries[:, :n], new_keys], axis=1), cos, sin)
            seen = top_k_visible(cfg, scores, seen)
            index_delta = (ik, ig, _per_token(new_keys, ends, valid, t))
        keys += [comp.entries[:, :n].astype(kv.dtype), entries.astype(kv.dtype)]
        masks.append(seen)
        comp_delta = (pk, pg, _per_token(entries, ends, valid, t))
    out = attend(cfg, lp, q, jnp.concatenate(keys, axis=1), jnp.concatenate(masks, axis=-1), cos, sin)
    return out, (kv, comp_delta, index_delta)


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
          positions: jax.Array, ctx: Any = None, cache: Any = None, span: int | None = None):
    """Decoder layer ``i``: streams [B,S,N,H] -> (streams [B,S,N,H], this layer's cache delta).
    Without ``cache``: a whole sequence at ``positions`` [S], delta None; with one: S new tokens
    at ``positions`` [B, S] (``attention_step``)."""
    lp = _take(params["layers"], i)
    kind = cfg.layer_types[i]
    group = {CSA: "csa", HCA: "hca"}.get(kind)
    cp = _take(params[group], cfg.layer_ids(kind).index(i)) if group else None
    pre, post, comb = hc_weights(cfg, streams, lp["hc_attn_fn"], lp["hc_attn_base"], lp["hc_attn_scale"])
    x = rms_norm(collapse(pre, streams), lp["attn_norm"], cfg.rms_norm_eps)
    if cache is None:
        y, delta = attention(cfg, lp, cp, kind, x, positions), None
    else:
        y, delta = attention_step(cfg, lp, cp, kind, x, positions, cache, i, span)
    streams = expand(post, comb, y, streams)
    pre, post, comb = hc_weights(cfg, streams, lp["hc_ffn_fn"], lp["hc_ffn_base"], lp["hc_ffn_scale"])
    x = rms_norm(collapse(pre, streams), lp["ffn_norm"], cfg.rms_norm_eps)
    if cfg.mlp_layer_types[i] == HASH_MOE:
        combine = route(cfg, lp, x, tokens, params["hash"]["tid2eid"][cfg.mlp_ids(HASH_MOE).index(i)], None)
    else:
        combine = route(cfg, lp, x, tokens, None, params["moe"]["bias"][cfg.mlp_ids(MOE).index(i)])
    return expand(post, comb, moe(cfg, lp, x, combine, ctx), streams), delta


def forward_dtype(params, ctx):
    dtype = getattr(ctx, "dtype", None) if ctx is not None else None
    return jnp.dtype(dtype) if dtype is not None else params["embed"].dtype


def stack_delta(cfg: DeepseekV4Config, cache: V4Cache, parts: list) -> V4Delta:
    """The per-layer (window, compressor, indexer) deltas stacked into one ``V4Delta``."""
    def group(kind, pick, like):
        if like is None:
            return None
        rows = [pick(parts[i]) for i in cfg.layer_ids(kind)]
        return Compressor(*(jnp.stack(a) for a in zip(*rows)), like.ratio)
    return V4Delta(window=jnp.stack([p[0] for p in parts]),
                   csa=group(CSA, lambda p: p[1], cache.csa), index=group(CSA, lambda p: p[2], cache.index),
                   hca=group(HCA, lambda p: p[1], cache.hca))


def forward(params: dict, cfg: DeepseekV4Config, tokens: jax.Array, cache: V4Cache | None = None, *,
            ctx: Any = None, taps: Sequence[int] = (), span=None):
    """The runtime protocol's forward: tokens [B, T] int -> (hidden [B,T,H] after hc_head and
    norm, features, delta).

    Without ``cache``: a causal pass over positions 0..T-1, delta None. With one (``V4Cache``):
    token t of row b at position ``cache.lengths[b] + t``, seeing the committed positions and the
    new tokens causally; ``delta`` (``V4Delta``) is what ``cache.commit`` folds in; committed
    entries at or above ``span // ratio`` are not read (the caller guarantees lengths <= span).
    ``features``: for each layer id in ``taps`` the mean over its output's N streams (what V4's
    DSpark reads), for the tag ``STREAMS`` the last layer's N streams before ``hc_head``
    flattened [B, T, N * H] (what V4's MTP module reads), concatenated in ``taps`` order
    (``tap_width``; None without taps). ``ctx``
    (``runtime.Context``) carries the compute dtype and ``mesh`` / ``rules`` (expert-parallel
    sharding constraints in the MoE).
    """
    dtype = forward_dtype(params, ctx)
    b, s = tokens.shape
    positions = jnp.arange(s) if cache is None else cache.lengths[:, None] + jnp.arange(s)[None]
    x = params["embed"][tokens].astype(dtype)
    streams = jnp.broadcast_to(x[:, :, None, :], (b, s, cfg.hc_mult, cfg.hidden_size))
    taps = tuple(taps)
    tap_width(cfg, taps)  # ConfigError for a tag this family does not know
    tapped, parts = {}, []
    for i in range(cfg.num_hidden_layers):
        streams, part = layer(cfg, params, i, streams, tokens, positions, ctx, cache, span)
        parts.append(part)
        if i in taps:
            tapped[i] = streams.astype(jnp.float32).mean(axis=2).astype(dtype)
    tapped[STREAMS] = streams.reshape(b, s, -1)
    hidden = rms_norm(hc_head(cfg, params, streams), params["norm"], cfg.rms_norm_eps)
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    return hidden, features, None if cache is None else stack_delta(cfg, cache, parts)


STREAMS = ("streams",)  # the tap of the last layer's residual streams before ``hc_head``


def tap_width(cfg: DeepseekV4Config, taps) -> int:
    """``runtime.TargetRuntime.feature_dim``: H per layer id, N * H for ``STREAMS``; ConfigError
    for another tag (before anything compiles)."""
    width = 0
    for t in taps:
        if isinstance(t, tuple):
            if t != STREAMS:
                raise ConfigError(f"DeepSeek-V4 target: unknown feature tap {t!r} (known: layer ids, {STREAMS!r})")
            width += cfg.hc_mult * cfg.hidden_size
        else:
            width += cfg.hidden_size
    return width


def compute_logits(params: dict, cfg: DeepseekV4Config, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (after the final norm) -> logits [..., V] float32 (untied ``head``)."""
    return (hidden @ params["head"].astype(hidden.dtype)).astype(jnp.float32)
