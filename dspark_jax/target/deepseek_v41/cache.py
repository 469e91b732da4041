"""DeepSeek-V4.1's decode cache (``runtime.Cache``) and the forward over it.

Shapes: L layers, B rows, W = ``sliding_window``, D = ``head_dim``, d_i = ``index_head_dim``, N
KV sources of one compress ratio r, R = r ring slots (1 at ratio 1, unused), C = capacity // r
entry slots, T new tokens, n = ``engram_max_ngram_size``.

=================  ==========================  ==============================================
leaf               shape                        holds
=================  ==========================  ==============================================
window             [L, B, W, D] (cache dtype)   stored (FP8-rounded) rotated K = V of the last W
                                                committed positions (position p at slot p % W)
sources[g]         V4's ``Compressor``, one per compress ratio of the KV sources:
  .kv, .gate       [N, B, R, D] float32         raw projections of the last R committed positions
  .entries         [N, B, C, D + d_i] float32   entry w at slot w: the stored compressed K = V
                                                and the indexer key (both rotated, quantized)
history            [B, n - 1] int32             the last committed tokens (-1: before the start):
                                                the Engram n-grams' look-back
lengths            [B] int32                    committed positions per row
=================  ==========================  ==============================================

Each KV source's entries are committed once, in its own slot; the layers after it read them
(the shared compressed KV). The delta of T tokens holds the window rows, each source's
projections and the entry each token completes (zero where none), and the tokens; ``commit``
folds in each row's first ``n_new`` (V4's ``Compressor.commit``): only accepted tokens reach a
cache, so the partial group is rebuilt from the ring after a rejection.

The forward (``forward_cached``) lays every source's entries out by entry id (committed slots
with the new tokens' entries written over them, in registers), so visibility (entry w visible
at p iff w < (p + 1) // r), the selection and the candidate blocks are the whole-sequence
functions of ``model``: the cached path selects what the whole sequence selects.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp

from dspark_jax import runtime
from dspark_jax.target.deepseek_v4 import model as v4
from dspark_jax.target.deepseek_v4.cache import Compressor, _accepted, _scatter
from dspark_jax.target.deepseek_v41 import engram as engram_lib
from dspark_jax.target.deepseek_v41 import model

RING_AXES = ("layers", runtime.BATCH, None, None)
DELTA_AXES = ("layers", runtime.BATCH, runtime.STEP, None)


def ratios(cfg) -> tuple[int, ...]:
    """The distinct compress ratios of the KV sources, in order of first appearance (one
    ``Compressor`` each)."""
    out = []
    for i in cfg.kv_source_layer_ids:
        if cfg.compress_ratios[i] not in out:
            out.append(cfg.compress_ratios[i])
    return tuple(out)


def _slot(cfg, i: int) -> tuple[int, int]:
    """(group, index in group) of KV source ``i``."""
    r = cfg.compress_ratios[i]
    same = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == r]
    return ratios(cfg).index(r), same.index(i)


@flax.struct.dataclass
class V41Delta:
    """What T new tokens add to a ``V41Cache`` (module docstring)."""

    window: jax.Array
    sources: tuple
    tokens: jax.Array


@flax.struct.dataclass
class V41Cache:
    """DeepSeek-V4.1's decode cache (module docstring)."""

    window: jax.Array
    sources: tuple
    history: jax.Array
    lengths: jax.Array
    capacity: int = flax.struct.field(pytree_node=False)

    def axes(self) -> "V41Cache":
        return V41Cache(window=("layers", runtime.BATCH, None, "head_dim"),
                        sources=tuple(g.axes(RING_AXES) for g in self.sources), history=(runtime.BATCH, None),
                        lengths=(runtime.BATCH,), capacity=self.capacity)

    def delta_axes(self) -> V41Delta:
        return V41Delta(window=DELTA_AXES, sources=tuple(g.axes(DELTA_AXES) for g in self.sources),
                        tokens=(runtime.BATCH, runtime.STEP))

    def commit(self, delta: V41Delta, n_new: jax.Array) -> "V41Cache":
        """Fold in the first ``n_new[b]`` tokens of row b's delta and advance ``lengths``."""
        n_new = n_new.astype(jnp.int32)
        pos, keep = _accepted(self.lengths, n_new, delta.window.shape[2])
        w = self.window.shape[2]
        slots = jnp.where(keep & (pos >= self.lengths[:, None] + n_new[:, None] - w), pos % w, w)
        seq = jnp.concatenate([self.history, delta.tokens.astype(jnp.int32)], axis=1)
        look = n_new[:, None] + jnp.arange(self.history.shape[1])[None]
        return V41Cache(_scatter(self.window, delta.window, slots),
                        tuple(g.commit(d, self.lengths, n_new) for g, d in zip(self.sources, delta.sources)),
                        jnp.take_along_axis(seq, look, axis=1), self.lengths + n_new, self.capacity)


def init_cache(cfg, batch: int, capacity: int, dtype=jnp.float32, max_extend: int | None = None) -> V41Cache:
    """An empty cache of ``batch`` rows holding up to ``capacity`` positions (the rings hold
    committed positions only: ``max_extend`` is not needed)."""
    del max_extend
    groups = []
    for r in ratios(cfg):
        n = sum(cfg.compress_ratios[s] == r for s in cfg.kv_source_layer_ids)
        ring = jnp.zeros((n, batch, r, cfg.head_dim if r > 1 else 1), jnp.float32)
        groups.append(Compressor(ring, ring, jnp.zeros((n, batch, capacity // r, cfg.head_dim + cfg.index_head_dim),
                                                       jnp.float32), r))
    return V41Cache(window=jnp.zeros((cfg.num_hidden_layers, batch, cfg.sliding_window, cfg.head_dim), dtype),
                    sources=tuple(groups), history=jnp.full((batch, max(cfg.engram_max_ngram_size - 1, 1)), -1,
                                                            jnp.int32),
                    lengths=jnp.zeros((batch,), jnp.int32), capacity=capacity)


# ----------------------------------------------------------------------------- the cached forward

def new_latents(cfg, params, i: int, x: jax.Array, ring: Compressor, lengths: jax.Array):
    """KV source ``i``'s latents completed by T new tokens x [B,T,H] (normed) at lengths[b] + t:
    (latents [B, M, D], entry ids [B, M], ends [B, M] (the token completing each), valid [B, M],
    (kv, gate) [B, T, P] raw projections for the ring). Ratio 1: every token, M = T; ratio r > 1:
    M = ceil(T / r) groups pooled from the ring's last r committed projections and the new ones."""
    r = cfg.compress_ratios[i]
    b, t, _ = x.shape
    kp = model._take(params["kv_source"], cfg.kv_source_layer_ids.index(i))
    if r == 1:
        lat = v4.rms_norm(x @ kp["wkv"], kp["norm"], cfg.rms_norm_eps)
        ends = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        zeros = jnp.zeros((b, t, 1), jnp.float32)
        return lat, lengths[:, None] + ends, ends, jnp.ones((b, t), bool), (zeros, zeros)
    wgate = params["gated_source"]["wgate"][cfg.gated_sources.index(i)]
    xf = x.astype(jnp.float32)
    kv, gate = xf @ kp["wkv"].astype(jnp.float32), xf @ wgate.astype(jnp.float32)
    recent = lengths[:, None] - r + jnp.arange(r)[None]                       # ring positions, in order
    kv_all = jnp.concatenate([v4._rows(ring.kv, recent % r), kv], axis=1)     # [B, r + T, D]
    gate_all = jnp.concatenate([v4._rows(ring.gate, recent % r), gate], axis=1)
    ends = jnp.mod(r - 1 - lengths, r)[:, None] + r * jnp.arange(-(-t // r))[None]
    window = r + ends[..., None] - r + 1 + jnp.arange(r)                      # [B, M, r] into *_all
    g_kv, g_gate = v4._rows(kv_all, window), v4._rows(gate_all, window)
    pooled = (g_kv * jax.nn.softmax(g_gate, axis=2)).sum(axis=2)
    lat = v4.rms_norm(pooled.astype(x.dtype), kp["norm"], cfg.rms_norm_eps)
    return lat, (lengths[:, None] + ends + 1) // r - 1, ends, ends < t, (kv, gate)


def _per_token(values: jax.Array, ends: jax.Array, valid: jax.Array, steps: int) -> jax.Array:
    """values [B, M, E] placed at the tokens completing them: [B, T, E], zero elsewhere."""
    b = values.shape[0]
    at = jnp.where(valid, ends, steps)
    return jnp.zeros((b, steps, values.shape[-1]), values.dtype).at[jnp.arange(b)[:, None], at].set(
        values, mode="drop")


def source_step(cfg, params, i, x, cache: V41Cache, shared: dict, slots: int):
    """KV source ``i`` over the new tokens: its entries and index keys by entry id ([B, slots, .]:
    committed, then the new ones written over) into ``shared``; returns its delta ``Compressor``."""
    g, k = _slot(cfg, i)
    group = cache.sources[g]
    ring = jax.tree.map(lambda a: a[k], group)
    lat, ids, ends, valid, (kv, gate) = new_latents(cfg, params, i, x, ring, cache.lengths)
    entries, keys = model.source_outputs(cfg, params, i, lat, ids * cfg.compress_ratios[i])
    new = jnp.concatenate([entries.astype(jnp.float32), keys.astype(jnp.float32)], axis=-1)  # [B, M, D + d_i]
    committed = ring.entries[:, :slots]
    if committed.shape[1] < slots:
        committed = jnp.pad(committed, ((0, 0), (0, slots - committed.shape[1]), (0, 0)))
    at = jnp.where(valid, ids, slots)
    merged = committed.at[jnp.arange(x.shape[0])[:, None], at].set(new, mode="drop")
    shared["entries"], shared["index_keys"] = merged[..., :cfg.head_dim], merged[..., cfg.head_dim:]
    return Compressor(kv, gate, _per_token(new, ends, valid, x.shape[1]), group.ratio)


def attention_step(cfg, params, lp: dict, i: int, x: jax.Array, positions: jax.Array, cache: V41Cache,
                   shared: dict, deltas: dict, span: int | None):
    """Layer ``i``'s attention over T new tokens x [B,T,H] (normed) at ``positions`` [B,T]: the
    window ring, the new keys and (ratio > 0) the shared entries by id. Returns (out [B,T,H],
    the new window rows [B,T,D]); KV sources put their delta in ``deltas``."""
    b, t, _ = x.shape
    lengths, ratio = cache.lengths, cfg.compress_ratios[i]
    cos, sin = v4.rope_table(cfg, positions, compressed=ratio > 0)
    q_residual, q, kv = model.query_and_kv(cfg, lp, x, cos, sin)
    ring = cache.window[i].astype(kv.dtype)
    w = ring.shape[1]
    held = lengths[:, None] - 1 - jnp.mod(lengths[:, None] - 1 - jnp.arange(w)[None], w)
    rel = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    keys = [ring, kv]
    masks = [(held[:, None, :] >= 0) & (positions[:, :, None] - held[:, None, :] < cfg.sliding_window),
             jnp.broadcast_to(((rel >= 0) & (rel < cfg.sliding_window))[None], (b, t, t))]
    if ratio:
        slots = cache.capacity // ratio if span is None else min(cache.capacity // ratio, (span + t) // ratio)
        if i in cfg.kv_source_layer_ids:
            deltas[i] = source_step(cfg, params, i, x, cache, shared, slots)
        if i in cfg.index_source_layer_ids:
            model.select(cfg, params, i, x, q_residual, positions, shared, cos, sin)
        keys.append(shared["entries"].astype(kv.dtype))
        masks.append(shared["selected"])
    out = v4.attend(cfg, lp, q, jnp.concatenate(keys, axis=1), jnp.concatenate(masks, axis=-1), cos, sin)
    return out, kv


def forward(params: dict, cfg, tokens: jax.Array, cache: V41Cache | None = None, *, ctx: Any = None,
            taps: Sequence = (), span=None):
    """The runtime protocol's forward: without ``cache`` ``model.forward`` (a causal pass over
    positions 0..T-1, delta None); with one ``forward_cached`` (the ``V41Delta`` of the T tokens)."""
    if cache is None:
        return model.forward(params, cfg, tokens, ctx=ctx, taps=taps)
    return forward_cached(params, cfg, tokens, cache, ctx=ctx, taps=taps, span=span)


def forward_cached(params: dict, cfg, tokens: jax.Array, cache: V41Cache, *, ctx: Any = None,
                   taps: Sequence = (), span=None):
    """The protocol's forward over a cache: tokens [B, T] at ``cache.lengths[b] + t`` -> (hidden,
    features, ``V41Delta``); as ``model.forward`` otherwise."""
    dtype = v4.forward_dtype(params, ctx)
    b, t = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(t)[None]
    x = params["embed"][tokens].astype(dtype)
    streams = jnp.broadcast_to(x[:, :, None, :], (b, t, cfg.hc_mult, cfg.hidden_size))
    pre = model.first_pre_mix(streams)
    hashes = engram_lib.hash_ids(cfg, tokens, cache.history) if cfg.engram_layer_ids else None
    want = {model.tap_key(tap) for tap in taps}
    tapped, shared, deltas, windows = {}, {}, {}, []

    def attend(h, lp, i):
        out, kv = attention_step(cfg, params, lp, i, h, positions, cache, shared, deltas, span)
        windows.append(kv)
        return out

    for i in range(cfg.num_hidden_layers):
        streams, pre = model.layer(cfg, params, i, streams, pre, hashes, want, tapped, attend, ctx)
    hidden = v4.rms_norm(v4.collapse(pre, streams), params["norm"], cfg.rms_norm_eps)
    features = jnp.concatenate([tapped[model.tap_key(tap)] for tap in taps], axis=-1) if taps else None
    groups = []
    for g, r in enumerate(ratios(cfg)):
        ids = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == r]
        groups.append(Compressor(*(jnp.stack(a) for a in zip(*[(deltas[s].kv, deltas[s].gate, deltas[s].entries)
                                                                  for s in ids])), r))
    return hidden, features, V41Delta(jnp.stack(windows), tuple(groups), tokens)
