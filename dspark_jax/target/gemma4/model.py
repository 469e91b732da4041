"""Gemma4 text decoder (``gemma4_text`` / ``gemma4_unified_text``) as pure functions: declaration, shared math, cache, forward.

Params (kernels ``[in, out]``)::

    {"embed_tokens": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "sliding": {stacked params of the sliding-window layers, leading axis Ls},
     "full":    {stacked params of the full-attention layers, leading axis Lf}}

Sliding and full layers differ in head size and KV-head count, so each type is its own
stack; a group absent from ``layer_types`` is absent from the tree. Full layers with
``attention_k_eq_v`` have no ``v_proj``: V is a weightless RMS norm of the K projection.

Layer (SPEC section 13)::

    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    out = h * layer_scalar

KV cache (``Gemma4Cache``, a ``runtime.Cache``): static, per layer type, K and V ``[L_type, B,
slots, Hkv_type, D_type]`` plus per-row ``lengths [B]``. Full layers hold ``capacity`` slots
(position p in slot p, as Qwen3). Sliding layers hold a ring of R slots (position p in slot
p mod R; key j visible to query i iff i - window < j <= i): R = capacity when ``init_cache`` gets
no ``max_extend``, else ``ring_slots(cfg, max_extend)`` = window - 1 + max_extend rounded up to
a multiple of 8. ``commit`` writes only accepted tokens (a prefill longer than R keeps each row's last R), so the ring
always holds the last R committed positions, all an extend needs.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import nn
from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.params import ParamSpec
from dspark_jax.target.gemma4.config import GROUPS, SLIDING, TEXT_PREFIX, Gemma4TargetConfig


# ----------------------------------------------------------------------------- declaration


def layer_declaration(cfg, group: str, layer_ids: Sequence[int], name: str) -> dict[tuple, ParamSpec]:
    """Stacked Gemma4 decoder-layer leaves ``(group, leaf)`` of one head shape.

    ``name`` is the torch name of layer ``{i}`` without the leaf (``model.layers.{i}.``).
    """
    n, h, inter, hq = len(layer_ids), cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    kv, d, has_v = cfg.group_shape(group)
    ids = tuple(layer_ids)

    def leaf(shape, axes, torch, **kw):
        return ParamSpec((n, *shape), ("layers", *axes), name + torch, layer_ids=ids, **kw)

    decl = {
        "q_proj": leaf((h, hq * d), ("embed", "heads"), "self_attn.q_proj.weight", transpose=True),
        "k_proj": leaf((h, kv * d), ("embed", "kv_heads"), "self_attn.k_proj.weight", transpose=True),
        "o_proj": leaf((hq * d, h), ("heads", "embed"), "self_attn.o_proj.weight", transpose=True),
        "q_norm": leaf((d,), (None,), "self_attn.q_norm.weight", init="ones"),
        "k_norm": leaf((d,), (None,), "self_attn.k_norm.weight", init="ones"),
        "gate_proj": leaf((h, inter), ("embed", "mlp"), "mlp.gate_proj.weight", transpose=True),
        "up_proj": leaf((h, inter), ("embed", "mlp"), "mlp.up_proj.weight", transpose=True),
        "down_proj": leaf((inter, h), ("mlp", "embed"), "mlp.down_proj.weight", transpose=True),
        "layer_scalar": leaf((1,), (None,), "layer_scalar", init="ones"),
    }
    if has_v:
        decl["v_proj"] = leaf((h, kv * d), ("embed", "kv_heads"), "self_attn.v_proj.weight", transpose=True)
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        decl[norm] = leaf((h,), (None,), f"{norm}.weight", init="ones")
    return {(group, k): v for k, v in decl.items()}


def declare(cfg: Gemma4TargetConfig, prefix: str = TEXT_PREFIX) -> dict[tuple, ParamSpec]:
    """Every parameter: our path -> ParamSpec. ``prefix``: ``model.`` or ``model.language_model.``."""
    v, h = cfg.vocab_size, cfg.hidden_size
    decl = {
        ("embed_tokens",): ParamSpec((v, h), ("vocab", "embed"), f"{prefix}embed_tokens.weight"),
        ("norm",): ParamSpec((h,), (None,), f"{prefix}norm.weight", init="ones"),
    }
    if not cfg.tie_word_embeddings:
        decl[("lm_head",)] = ParamSpec((h, v), ("embed", "vocab"), "lm_head.weight", transpose=True)
    for group, layer_type in GROUPS:
        ids = cfg.layer_ids(layer_type)
        if ids:
            decl.update(layer_declaration(cfg, group, ids, f"{prefix}layers.{{i}}."))
    return decl


def init_params(cfg: Gemma4TargetConfig, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random params (std 0.02, norms and layer_scalar 1), for tests and from-scratch runs."""
    return params_lib.init_params(declare(cfg), rng, dtype)


def param_axes(cfg: Gemma4TargetConfig) -> dict:
    """Logical axis names, same tree structure as ``init_params``."""
    return params_lib.param_axes(declare(cfg))


# ----------------------------------------------------------------------------- shared math


rms_norm = nn.rms_norm_f32  # scaled in float32, cast back


def inv_freq(head_dim: int, theta: float, rope_type: str = "default", partial: float = 1.0) -> np.ndarray:
    """[head_dim / 2] rotary frequencies; "proportional" zeroes those past int(partial * head_dim / 2)."""
    half = head_dim // 2
    rotated = int(partial * head_dim // 2) if rope_type == "proportional" else half
    freq = np.zeros((half,), np.float32)
    freq[:rotated] = 1.0 / (theta ** (np.arange(0, 2 * rotated, 2, dtype=np.float32) / head_dim))
    return freq


def rope_cos_sin(positions: jax.Array, freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [*positions.shape, 2 * len(freq)] (rotate-half layout), in ``dtype``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freq)
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def group_rope(cfg, group: str) -> np.ndarray:
    if group == "sliding":
        return inv_freq(cfg.head_dim, cfg.sliding_rope_theta)
    return inv_freq(cfg.global_head_dim, cfg.full_rope_theta, cfg.full_rope_type, cfg.partial_rotary_factor)


def gelu_mlp(x: jax.Array, p: dict) -> jax.Array:
    """down(gelu_tanh(gate(x)) * up(x))."""
    return (jax.nn.gelu(x @ p["gate_proj"], approximate=True) * (x @ p["up_proj"])) @ p["down_proj"]


def embed(embed_tokens: jax.Array, ids: jax.Array, dtype=None) -> jax.Array:
    """Scaled embeddings ``E[ids] * sqrt(H)``, the scale cast to the weight dtype first (as transformers)."""
    scale = jnp.asarray(math.sqrt(embed_tokens.shape[-1]), embed_tokens.dtype)
    x = embed_tokens[ids] * scale
    return x if dtype is None else x.astype(dtype)


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def project_qkv(h: jax.Array, p: dict, num_heads: int, num_kv: int, head_dim: int, eps: float):
    """q [B,S,Hq,D] (q-normed), k [B,S,Hkv,D] (k-normed), v [B,S,Hkv,D] (v-normed), all before rotary.

    Without ``v_proj`` (k = v) V is the raw K projection through the weightless v norm.
    """
    b, s, _ = h.shape
    q = rms_norm((h @ p["q_proj"]).reshape(b, s, num_heads, head_dim), p["q_norm"], eps)
    k_raw = (h @ p["k_proj"]).reshape(b, s, num_kv, head_dim)
    v_raw = (h @ p["v_proj"]).reshape(b, s, num_kv, head_dim) if "v_proj" in p else k_raw
    return q, rms_norm(k_raw, p["k_norm"], eps), rms_norm(v_raw, None, eps)


def sandwich(x: jax.Array, attn_out: jax.Array, p: dict, eps: float) -> jax.Array:
    """The rest of a Gemma4 layer after attention: post-attn norm, residual, MLP sandwich, layer_scalar."""
    h = x + rms_norm(attn_out, p["post_attention_layernorm"], eps)
    mlp = gelu_mlp(rms_norm(h, p["pre_feedforward_layernorm"], eps), p)
    h = h + rms_norm(mlp, p["post_feedforward_layernorm"], eps)
    return h * p["layer_scalar"].astype(h.dtype)


# ----------------------------------------------------------------------------- cache and forward


KV_AXES = ("layers", runtime.BATCH, "kv_heads", runtime.STEP, "head_dim")  # head-major: nn.cache_scores
LAYER_KV_AXES = KV_AXES[1:]  # one layer's buffer of a per-layer cache
STACKS = tuple(g for g, _ in GROUPS)  # the params' stacked-layer subtrees, one per head shape


def _slots(a) -> int:
    """Positions a group's cache holds: a stacked [L, B, Hkv, S, D] array or a tuple of per-layer
    [B, Hkv, S, D] buffers."""
    return (a[0] if isinstance(a, tuple) else a).shape[-2]


@flax.struct.dataclass
class Gemma4Cache:
    """Static cache. k/v: {"sliding": [Ls, B, Hkv, R, D] (ring), "full": [Lf, B, Hkv_g, capacity,
    D_g]}, or per group a tuple of per-layer [B, Hkv, slots, D] buffers (``per_layer``: GPUs, for
    per-layer params, as ``qwen3.KVCache``); lengths [B]; ``capacity`` (static): positions per
    row. The delta of T tokens is ``(k_new, v_new)``, dicts {group: [L_g, B, Hkv_g, T, D_g]} (or
    L_g-tuples of [B, Hkv_g, T, D_g])."""

    k: dict
    v: dict
    lengths: jax.Array
    capacity: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def per_layer(self) -> bool:
        return any(isinstance(a, tuple) for a in self.k.values())

    def _group_axes(self) -> dict:
        return {g: tuple(LAYER_KV_AXES for _ in a) if isinstance(a, tuple) else KV_AXES
                for g, a in self.k.items()}

    def axes(self) -> "Gemma4Cache":
        return self.replace(k=self._group_axes(), v=self._group_axes(), lengths=(runtime.BATCH,))

    def delta_axes(self) -> tuple:
        return (self._group_axes(), self._group_axes())

    def commit(self, delta: tuple, n_new: jax.Array) -> "Gemma4Cache":
        """Write each row's first ``n_new`` delta tokens: full layers at slot p, the sliding ring
        at p mod R (only a row's last R committed positions); positions >= capacity are dropped.
        One masked scatter per tensor (or per layer's buffer), in place when donated; ``lengths``
        advance by n_new."""
        k_new, v_new = delta
        t = _slots(next(iter(k_new.values())))
        n_new = n_new.astype(jnp.int32)
        positions = self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        live = runtime.step_mask(n_new, t) & (positions < self.capacity)
        slots = {"full": jnp.where(live, positions, self.capacity)}
        if "sliding" in self.k:
            ring = _slots(self.k["sliding"])
            end = (self.lengths + n_new)[:, None]
            slots["sliding"] = jnp.where(live & (positions >= end - ring), positions % ring, ring)

        def write(bufs, news):
            return {g: jax.tree.map(lambda a, n, g=g: runtime.write_steps(a, n, slots[g]), a, news[g])
                    for g, a in bufs.items()}
        return self.replace(k=write(self.k, k_new), v=write(self.v, v_new), lengths=self.lengths + n_new)


RING_MULTIPLE = 8  # XLA:TPU's sublane tile: a 1031-slot ring made it copy the whole sliding cache twice per round


def ring_slots(cfg: Gemma4TargetConfig, max_extend: int) -> int:
    """Sliding-layer ring size for extends of up to ``max_extend`` tokens: window - 1 + max_extend
    (what an extend needs: the window before its first token and its own tokens), rounded up to
    a multiple of ``RING_MULTIPLE`` (the extra slots hold older positions, masked out)."""
    need = cfg.sliding_window - 1 + max_extend
    return -(-need // RING_MULTIPLE) * RING_MULTIPLE


def init_cache(cfg: Gemma4TargetConfig, batch: int, capacity: int, dtype=jnp.float32,
               max_extend: int | None = None, *, per_layer: bool = False) -> Gemma4Cache:
    """Empty cache for ``capacity`` positions; the sliding ring has ``ring_slots(cfg,
    max_extend)`` slots (at most ``capacity``; all ``capacity`` without ``max_extend``).
    ``per_layer``: one buffer per layer (for per-layer params, ``params.for_platform``)."""
    ring = capacity if max_extend is None else min(ring_slots(cfg, max_extend), capacity)
    slots = {"sliding": ring, "full": capacity}
    k, v = {}, {}
    for group, layer_type in GROUPS:
        n = len(cfg.layer_ids(layer_type))
        if n:
            kv, d, _ = cfg.group_shape(group)
            shape = (batch, kv, slots[group], d)
            if per_layer:
                k[group] = tuple(jnp.zeros(shape, dtype) for _ in range(n))
                v[group] = tuple(jnp.zeros(shape, dtype) for _ in range(n))
            else:
                k[group], v[group] = jnp.zeros((n, *shape), dtype), jnp.zeros((n, *shape), dtype)
    return Gemma4Cache(k, v, jnp.zeros((batch,), jnp.int32), capacity)


def lm_head_kernel(params: dict) -> jax.Array:
    """[H, V] output projection (the embedding's transpose when tied)."""
    return params["lm_head"] if "lm_head" in params else params["embed_tokens"].T


def compute_logits(params: dict, cfg: Gemma4TargetConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (after the final norm) -> softcapped logits [..., V] float32."""
    logits = nn.project_f32(hidden, lm_head_kernel(params).astype(hidden.dtype))
    return softcap(logits, cfg.final_logit_softcapping)


def _period(layer_types: tuple[str, ...]) -> int:
    """Smallest P such that layer_types is its first P entries repeated."""
    n = len(layer_types)
    for p in range(1, n + 1):
        if n % p == 0 and layer_types == layer_types[:p] * (n // p):
            return p
    return n


def forward_pure(params: dict, cfg: Gemma4TargetConfig, tokens: jax.Array,
                 cache: Gemma4Cache | None = None, *, ctx: runtime.Context = runtime.LOCAL,
                 taps: Sequence[int] = (), span: int | None = None):
    """The runtime protocol's forward over ``tokens [B, T]`` (``dspark_jax.runtime``; same
    contract as ``target.qwen3.forward_pure``; ``span`` limits the full layers' cache reads, the
    sliding ring is read whole).

    Without a cache: a causal pass over positions 0..T-1. With one: an extend at positions
    ``lengths[b] + t`` that sees the committed slots (and, on sliding layers, only those inside
    the window). Returns ``(hidden [B, T, H] after the final norm, features [B, T, n*H] or None,
    delta)``: features are decoder-layer outputs after ``layer_scalar`` (-1 = the scaled
    embedding); delta the new ``(k, v)`` dicts {group: [L_g, B, Hkv_g, T, D_g]} (L_g-tuples for a
    per-layer cache; None without a cache), for ``Gemma4Cache.commit``.

    ``params["sliding"]`` / ``params["full"]`` are stacked (a ``lax.scan`` over repeats of the
    layer-type pattern) or tuples of per-layer trees (``params.for_platform`` on GPUs: an unrolled
    loop over the layers in order, reading each layer's weights and cache where they lie). Same
    outputs.
    """
    b, t = tokens.shape
    tap_ids = tuple(taps)
    dtype = ctx.dtype or params["embed_tokens"].dtype
    eps, hq = cfg.rms_norm_eps, cfg.num_attention_heads
    x = embed(params["embed_tokens"], tokens, dtype)
    if cache is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    else:
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    offset = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]          # query - key, new tokens
    new_mask = {"full": jnp.broadcast_to(offset >= 0, (b, t, t)),
                "sliding": jnp.broadcast_to((offset >= 0) & (offset < cfg.sliding_window), (b, t, t))}
    cache_mask = {}
    if cache is not None:
        lengths = cache.lengths[:, None, None]
        if "full" in cache.k:
            span = nn.read_span(span, _slots(cache.k["full"]))
            slots = jnp.arange(span, dtype=jnp.int32)[None, None, :]
            cache_mask["full"] = jnp.broadcast_to(slots < lengths, (b, t, span))
        if "sliding" in cache.k:  # ring: slot s holds the last position < lengths that is s mod R
            ring = _slots(cache.k["sliding"])
            slots = jnp.arange(ring, dtype=jnp.int32)[None, None, :]
            held = slots + ring * jnp.floor_divide(lengths - 1 - slots, ring)
            cache_mask["sliding"] = (held >= 0) & (held > positions[:, :, None] - cfg.sliding_window)
    rope = {g: rope_cos_sin(positions, group_rope(cfg, g), dtype) for g, _ in GROUPS}

    n_taps = max(len(tap_ids), 1)
    taps = jnp.zeros((n_taps, b, t, cfg.hidden_size), dtype)
    if -1 in tap_ids:
        taps = taps.at[tap_ids.index(-1)].set(x)
    tap_slot = np.full((cfg.num_hidden_layers,), -1, np.int32)
    for n, layer_id in enumerate(tap_ids):
        if layer_id >= 0:
            tap_slot[layer_id] = n

    def layer(x, taps, p, g, slot, k_cache=None, v_cache=None):
        """One decoder layer of group g over x [B, T, H]: (x, taps, k, v), the new k, v head-major
        [B, Hkv, T, D] (the cache's order); ``k_cache, v_cache``: this layer's cache."""
        kv, d, _ = cfg.group_shape(g)
        q, k, v = project_qkv(rms_norm(x, p["input_layernorm"], eps), p, hq, kv, d, eps)
        cos, sin = rope[g]
        q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
        prefix = None
        if k_cache is not None:  # attention reads the cache_mask's span of it
            prefix = (k_cache.astype(dtype), v_cache.astype(dtype), cache_mask[g])
        attn = nn.attention(q, k, v, new_mask[g], prefix, scale=1.0, causal=True,
                            window=cfg.sliding_window if g == "sliding" else None)
        x = sandwich(x, attn.reshape(b, t, -1) @ p["o_proj"], p, eps)
        taps = jnp.where(slot >= 0, jax.lax.dynamic_update_index_in_dim(taps, x, jnp.maximum(slot, 0), 0), taps)
        return x, taps, nn.head_major(k), nn.head_major(v)

    cast = lambda a: a.astype(dtype) if a.dtype != dtype else a  # noqa: E731
    if cache is not None and cache.per_layer and not params_lib.per_layer(params, STACKS):
        raise ValueError("a per-layer Gemma4 cache needs per-layer params (params.unstack_layers)")
    if params_lib.per_layer(params, STACKS):
        # One params tree per layer (params.for_platform on GPUs): an unrolled loop over the layers.
        seen = {g: 0 for g in STACKS}
        new_k, new_v = {g: [] for g in STACKS if g in params}, {g: [] for g in STACKS if g in params}
        for i, layer_type in enumerate(cfg.layer_types):
            g = "sliding" if layer_type == SLIDING else "full"
            j, seen[g] = seen[g], seen[g] + 1
            kv = ()
            if cache is not None:
                kv = ((cache.k[g][j], cache.v[g][j]) if cache.per_layer
                      else nn.layer_slices((cache.k[g], cache.v[g]), j))
            x, taps, k, v = layer(x, taps, jax.tree.map(cast, params[g][j]), g, jnp.int32(tap_slot[i]), *kv)
            new_k[g].append(k)
            new_v[g].append(v)
        join = tuple if cache is not None and cache.per_layer else jnp.stack
        delta = None if cache is None else ({g: join(a) for g, a in new_k.items()},
                                            {g: join(a) for g, a in new_v.items()})
    else:
        # Scan over repeats of the layer-type pattern; each step runs one period unrolled. Layer
        # i of a group is read from the whole stack at its run-time index (rep * per_rep + j):
        # a slice the compiler fuses into the layer's dots. (Scanning over the stacks regrouped
        # [reps, per_rep, ...] and indexing the period's block statically made XLA:TPU copy
        # each period's weights and cache first: 2.5-3x the compulsory bytes of a Gemma4-12B
        # decode step, benchmarks/results/hw_tables.)
        period = _period(cfg.layer_types)
        reps = cfg.num_hidden_layers // period
        pattern = ["sliding" if lt == SLIDING else "full" for lt in cfg.layer_types[:period]]
        per_rep = {g: pattern.count(g) for g, _ in GROUPS}
        layers = {g: jax.tree.map(cast, params[g]) for g, _ in GROUPS if per_rep[g]}
        xs = {"rep": jnp.arange(reps, dtype=jnp.int32), "tap": jnp.asarray(tap_slot.reshape(reps, period))}

        def body(carry, xs):
            x, taps = carry
            new_k = {g: [] for g in layers}
            new_v = {g: [] for g in layers}
            seen = {g: 0 for g in layers}
            for j, g in enumerate(pattern):
                at = lambda a, g=g: jax.lax.dynamic_index_in_dim(  # noqa: E731
                    a, xs["rep"] * per_rep[g] + seen[g], 0, keepdims=False)
                p = jax.tree.map(at, layers[g])
                kv = () if cache is None else (at(cache.k[g]), at(cache.v[g]))
                x, taps, k, v = layer(x, taps, p, g, xs["tap"][j], *kv)
                new_k[g].append(k)
                new_v[g].append(v)
                seen[g] += 1
            out = None
            if cache is not None:
                out = ({g: jnp.stack(a) for g, a in new_k.items()}, {g: jnp.stack(a) for g, a in new_v.items()})
            return (x, taps), out

        (x, taps), new_kv = jax.lax.scan(body, (x, taps), xs)
        flat = lambda kv: {g: a.reshape(-1, *a.shape[2:]) for g, a in kv.items()}  # noqa: E731  [L_g, B, T, ..]
        delta = None if cache is None else (flat(new_kv[0]), flat(new_kv[1]))
    hidden = rms_norm(x, params["norm"].astype(dtype), eps)
    features = None
    if tap_ids:
        features = jnp.moveaxis(taps, 0, 2).reshape(b, t, len(tap_ids) * cfg.hidden_size)
    return hidden, features, delta


def forward(params: dict, cfg: Gemma4TargetConfig, tokens: jax.Array,
            cache: Gemma4Cache | None = None, *, num_new: jax.Array | None = None,
            tap_layer_ids: Sequence[int] = (), compute_dtype=None, cache_span: int | None = None):
    """``forward_pure`` then ``cache.commit`` of each row's first ``num_new`` tokens (default T):
    ``(hidden, taps or None, updated cache or None)`` (training, feature extraction, tests)."""
    return runtime.forward_and_commit(forward_pure, params, cfg, tokens, cache, num_new=num_new,
                                      taps=tap_layer_ids, compute_dtype=compute_dtype, span=cache_span)
