"""The DeepSeek-V4.1 forward as pure functions over the declared params tree (whole sequence).

Shapes: B batch, S tokens, H hidden, N = ``hc_mult`` streams, nh heads of D = ``head_dim`` (one
shared K = V head), T compressed entries of the current KV source (S // ratio), d_i / h_i the
indexer's head dim / heads. V4's pieces are reused (rope, sink attention, mHC weights, router,
experts); what differs:

Layer i (single-pass mHC: each site's pre-mix is consumed by the *next* site)::

    streams = engram(streams)                           (engram_layer_ids)
    a_pre, a_post, a_comb = hc(streams, hc_attn)
    y = attn(attn_norm(collapse(streams, pre_in)))      (pre_in: one-hot stream 0 at layer 0)
    streams = a_post ⊗ y + a_combᵀ streams
    f_pre, f_post, f_comb = hc(streams, hc_ffn)
    streams = f_post ⊗ moe(ffn_norm(collapse(streams, a_pre))) + f_combᵀ streams
    pre_out = f_pre;   output = norm(collapse(streams, last pre_out))   (no hc_head)

Attention: q = wq_b(q_norm(wq_a x)) (no per-head norm), K = V = FP8(rope(kv_norm(wkv x))), sliding
window; CSA2 layers (ratio > 0) also attend the entries of their KV source (``shared``): ratio 2
pools non-overlapping pairs with a softmax gate, ratio 1 projects every token; entries are
FP4(rope(latent)) at their group's first position. The index source's selection (top
``index_topk`` among the entries a query may see: causal) masks them; the candidate source also
keeps ``candidate_topk_blocks`` blocks, inside which later index sources select.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from dspark_jax.target.deepseek_v4 import model as v4
from dspark_jax.target.deepseek_v4 import moe as moe_lib
from dspark_jax.target.deepseek_v41 import engram as engram_lib
from dspark_jax.target.deepseek_v41 import qat
from dspark_jax.target.deepseek_v41.config import DeepseekV41Config

NEG_INF = -jnp.inf
DENSE_MAX = 4 * moe_lib.DENSE_MAX  # tokens x experts up to which the reference-order dense MoE runs
rms_norm = v4.rms_norm


def _take(tree: dict, k: int) -> dict:
    return jax.tree.map(lambda a: a[k], tree)


# ----------------------------------------------------------------------------- CSA2

def latent(cfg: DeepseekV41Config, params: dict, i: int, x: jax.Array) -> jax.Array:
    """KV source ``i``'s pre-rope latents [B, S // ratio, D] of normed x [B, S, H] (trailing partial
    group dropped): ratio 1 norm(x wkv); ratio > 1 the softmax(gate)-weighted sum of each group's
    projections (float32), then norm."""
    ratio = cfg.compress_ratios[i]
    kp = _take(params["kv_source"], cfg.kv_source_layer_ids.index(i))
    if ratio == 1:
        return rms_norm(x @ kp["wkv"], kp["norm"], cfg.rms_norm_eps)
    wgate = params["gated_source"]["wgate"][cfg.gated_sources.index(i)]
    b, s, _ = x.shape
    t = s // ratio
    xf = x[:, :t * ratio].astype(jnp.float32)
    kv = (xf @ kp["wkv"].astype(jnp.float32)).reshape(b, t, ratio, -1)
    gate = (xf @ wgate.astype(jnp.float32)).reshape(b, t, ratio, -1)
    pooled = (kv * jax.nn.softmax(gate, axis=2)).sum(axis=2)
    return rms_norm(pooled.astype(x.dtype), kp["norm"], cfg.rms_norm_eps)


def source_outputs(cfg, params, i: int, lat: jax.Array, positions: jax.Array):
    """(entries [B, T, D], index keys [B, T, d_i]) of KV source ``i``'s latents [B, T, D] whose
    groups start at ``positions`` ([T] or [B, T]): rotated there (compress rope), then stored-
    quantized; the keys are k_norm(wk(latent)), rotated, indexer-quantized."""
    kp = _take(params["kv_source"], cfg.kv_source_layer_ids.index(i))
    cos, sin = v4.rope_table(cfg, positions, compressed=True)
    keys = rms_norm(lat @ kp["index_wk"], kp["index_k_norm"], cfg.rms_norm_eps)
    keys = qat.indexer(cfg, v4.apply_rope(keys, cos, sin))
    return qat.entries(cfg, v4.apply_rope(lat, cos, sin)), keys


def index_scores(cfg, params, i: int, x, q_residual, keys, cos, sin) -> jax.Array:
    """Index source ``i``'s scores [B, S, T]: sum_h (w_h / sqrt(h_i)) ReLU(q_h . k) / sqrt(d_i),
    q = FP4(rope(wq_b q_residual))."""
    ip = _take(params["index_source"], cfg.index_source_layer_ids.index(i))
    b, s, _ = x.shape
    q = (q_residual @ ip["wq_b"]).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
    q = qat.indexer(cfg, v4.apply_rope(q, cos, sin))
    scores = jax.nn.relu(jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32)))
    scores = scores * cfg.index_head_dim ** -0.5
    weights = (x @ ip["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    return (scores * weights[..., None]).sum(axis=2)


def candidate_blocks(cfg, scores: jax.Array, visible_count: jax.Array) -> jax.Array:
    """[B, S, T] bool: the entries of each query's best ``candidate_topk_blocks`` blocks of
    ``candidate_block_size`` (block score: its best visible entry; the block of the newest visible
    entry always kept). ``scores`` [B, S, T] with -inf where not visible; ``visible_count`` [B, S]."""
    size = cfg.candidate_block_size
    t = scores.shape[-1]
    n = -(-t // size)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, n * size - t)), constant_values=NEG_INF)
    blocks = padded.reshape(*scores.shape[:2], n, size).max(-1)
    last = jnp.floor_divide(visible_count - 1, size)[..., None]
    blocks = jnp.where(jnp.arange(n) == last, jnp.inf, blocks)
    k = min(cfg.candidate_topk_blocks, n)
    top, idx = jax.lax.top_k(blocks, k)
    keep = jnp.zeros(blocks.shape, bool)
    keep = jax.vmap(jax.vmap(lambda kk, i, ok: kk.at[i].set(ok)))(keep, idx, top > NEG_INF)
    return jnp.repeat(keep, size, axis=-1)[..., :t]


def select(cfg, params, i: int, x, q_residual, positions, shared: dict, cos, sin) -> None:
    """Index source ``i``: the selection [B, S, T] over the shared keys into ``shared``
    ("selected"; "candidates" at the candidate source)."""
    keys = shared["index_keys"]
    ratio = cfg.compress_ratios[i]
    scores = index_scores(cfg, params, i, x, q_residual, keys, cos, sin)
    count = jnp.broadcast_to((positions + 1) // ratio, scores.shape[:2])
    visible = jnp.arange(keys.shape[1]) < count[..., None]
    if i == cfg.candidate_source_layer_id:
        shared["candidates"] = candidate_blocks(cfg, jnp.where(visible, scores, NEG_INF), count)
    elif 0 <= cfg.candidate_source_layer_id < i and "candidates" in shared:
        visible = visible & shared["candidates"]
    shared["selected"] = v4.top_k_visible(cfg, scores, visible)


# ----------------------------------------------------------------------------- attention

def query_and_kv(cfg, lp: dict, x: jax.Array, cos, sin):
    """(q_residual [B,S,r], q [B,S,nh,D] rotated, K = V [B,S,D] rotated and stored-quantized)."""
    b, s, _ = x.shape
    q_residual = rms_norm(x @ lp["wq_a"], lp["q_norm"], cfg.rms_norm_eps)
    q = (q_residual @ lp["wq_b"]).reshape(b, s, cfg.num_attention_heads, cfg.head_dim)
    kv = v4.apply_rope(rms_norm(x @ lp["wkv"], lp["kv_norm"], cfg.rms_norm_eps), cos, sin)
    return q_residual, v4.apply_rope(q, cos, sin), qat.window_kv(cfg, kv)


def attention(cfg, params, lp: dict, i: int, x: jax.Array, positions: jax.Array, shared: dict) -> jax.Array:
    """Layer ``i``'s attention over a whole sequence: normed x [B,S,H] -> [B,S,H]; KV / index
    sources write their entries, keys and selection into ``shared`` for the layers after them."""
    b, s, _ = x.shape
    ratio = cfg.compress_ratios[i]
    cos, sin = v4.rope_table(cfg, positions, compressed=ratio > 0)
    q_residual, q, kv = query_and_kv(cfg, lp, x, cos, sin)
    rel = positions[:, None] - positions[None, :]
    mask = jnp.broadcast_to(((rel >= 0) & (rel < cfg.sliding_window))[None], (b, s, s))
    if ratio:
        if i in cfg.kv_source_layer_ids:
            lat = latent(cfg, params, i, x)
            shared["entries"], shared["index_keys"] = source_outputs(cfg, params, i, lat,
                                                                     ratio * jnp.arange(lat.shape[1]))
        if i in cfg.index_source_layer_ids:
            select(cfg, params, i, x, q_residual, positions, shared, cos, sin)
        kv = jnp.concatenate([kv, shared["entries"].astype(kv.dtype)], axis=1)
        mask = jnp.concatenate([mask, shared["selected"]], axis=-1)
    return v4.attend(cfg, lp, q, kv, mask, cos, sin)


# ----------------------------------------------------------------------------- layers

def moe(cfg, lp: dict, x: jax.Array, ctx: Any = None) -> jax.Array:
    """Router (sqrt-softplus, ``gate_bias`` selects only; ``bias_vl`` is for image tokens, which a
    text-only model never has) and experts: V4's dispatch, except at the dense sizes, where the
    routing weight scales the activation before ``w2`` and the experts are summed in order, as
    the reference does (its roundings then agree more often under the fake quantizers)."""
    combine = v4.route(cfg, lp, x, None, None, lp["gate_bias"])
    if x.shape[0] * x.shape[1] * cfg.n_routed_experts > DENSE_MAX:
        return v4.moe(cfg, lp, x, combine, ctx)
    lim = cfg.swiglu_limit
    gate = jnp.minimum(jnp.einsum("bsh,ehi->bsei", x, lp["experts_w1"]), lim)
    act = jax.nn.silu(gate) * jnp.clip(jnp.einsum("bsh,ehi->bsei", x, lp["experts_w3"]), -lim, lim)
    per = jnp.einsum("bsei,eih->bseh", act * combine[..., None].astype(act.dtype), lp["experts_w2"])
    out = per[:, :, 0]
    for e in range(1, per.shape[2]):
        out = out + per[:, :, e]
    return out + v4.swiglu(cfg, x, lp["shared_w1"], lp["shared_w3"], lp["shared_w2"])


def block(cfg, lp: dict, streams: jax.Array, pre_in: jax.Array, attend_fn, ctx: Any = None):
    """One V4.1 block (single-pass mHC; module docstring) around ``attend_fn(normed x) -> y``:
    (streams [B,S,N,H], pre_in [B,S,N]) -> (streams, pre_out)."""
    a_pre, a_post, a_comb = v4.hc_weights(cfg, streams, lp["hc_attn_fn"], lp["hc_attn_base"], lp["hc_attn_scale"])
    y = attend_fn(rms_norm(v4.collapse(pre_in, streams), lp["attn_norm"], cfg.rms_norm_eps))
    streams = v4.expand(a_post, a_comb, y, streams)
    f_pre, f_post, f_comb = v4.hc_weights(cfg, streams, lp["hc_ffn_fn"], lp["hc_ffn_base"], lp["hc_ffn_scale"])
    x = rms_norm(v4.collapse(a_pre, streams), lp["ffn_norm"], cfg.rms_norm_eps)
    return v4.expand(f_post, f_comb, moe(cfg, lp, x, ctx), streams), f_pre


def first_pre_mix(streams: jax.Array) -> jax.Array:
    """The pre-mix entering layer 0 (and the DSpark module's first stage): one-hot stream 0."""
    return jnp.zeros(streams.shape[:-1], jnp.float32).at[..., 0].set(1.0)


def tap_key(tap) -> tuple[str, int]:
    """A runtime tap: an int i (layer i's output) or ("attn_in", i) (the streams entering layer i,
    before its Engram): V4.1's DSpark reads the latter."""
    if isinstance(tap, int):
        return ("out", tap)
    if isinstance(tap, tuple) and len(tap) == 2 and tap[0] == "attn_in" and isinstance(tap[1], int):
        return ("attn_in", tap[1])
    raise ValueError(f"unknown DeepSeek-V4.1 tap {tap!r}: a layer id or ('attn_in', layer id)")


def layer(cfg, params, i: int, streams, pre, hashes, want: set, tapped: dict, attend_fn, ctx: Any = None):
    """Layer ``i`` (Engram, then the block with ``attend_fn(normed x, lp, i)``), recording the
    wanted taps (``tap_key``) in ``tapped``: (streams, pre_out)."""
    dtype = streams.dtype
    if ("attn_in", i) in want:
        tapped[("attn_in", i)] = streams.astype(jnp.float32).mean(axis=2).astype(dtype)
    if i in cfg.engram_layer_ids:
        k = cfg.engram_layer_ids.index(i)
        streams = engram_lib.inject(cfg, _take(params["engram"], k), params["engram_table"][str(k)], streams,
                                    hashes[:, :, k])
    lp = _take(params["layers"], i)
    streams, pre = block(cfg, lp, streams, pre, lambda h: attend_fn(h, lp, i), ctx)
    if ("out", i) in want:
        tapped[("out", i)] = streams.astype(jnp.float32).mean(axis=2).astype(dtype)
    return streams, pre


def forward(params: dict, cfg: DeepseekV41Config, tokens: jax.Array, *, ctx: Any = None, taps: Sequence = ()):
    """The whole-sequence forward: tokens [B, T] -> (hidden [B,T,H] after the final collapse and
    norm, features [B, T, len(taps) * H] (each tap the mean over the N streams, ``tap_key``) or
    None, None), a causal pass over positions 0..T-1. The runtime protocol's forward, which also
    runs over a cache, is ``cache.forward`` (the cache module sits above this one)."""
    dtype = v4.forward_dtype(params, ctx)
    b, s = tokens.shape
    positions = jnp.arange(s)
    x = params["embed"][tokens].astype(dtype)
    streams = jnp.broadcast_to(x[:, :, None, :], (b, s, cfg.hc_mult, cfg.hidden_size))
    pre = first_pre_mix(streams)
    hashes = engram_lib.hash_ids(cfg, tokens) if cfg.engram_layer_ids else None
    want = {tap_key(t) for t in taps}
    tapped, shared = {}, {}
    for i in range(cfg.num_hidden_layers):
        streams, pre = layer(cfg, params, i, streams, pre, hashes, want, tapped,
                             lambda h, lp, i: attention(cfg, params, lp, i, h, positions, shared), ctx)
    hidden = rms_norm(v4.collapse(pre, streams), params["norm"], cfg.rms_norm_eps)
    features = jnp.concatenate([tapped[tap_key(t)] for t in taps], axis=-1) if taps else None
    return hidden, features, None


def compute_logits(params: dict, cfg, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (after the final norm) -> logits [..., V] float32 (untied ``head``)."""
    return (hidden @ params["head"].astype(hidden.dtype)).astype(jnp.float32)
