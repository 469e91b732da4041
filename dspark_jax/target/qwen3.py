"""Qwen3 causal LM as pure functions over a params pytree, with a static KV cache.

Params::

    {"embed_tokens": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "layers": {stacked decoder-layer params, leading axis L}}

The KV cache holds ``k, v [L, B, Hkv, capacity, D]`` (head-major: ``nn.cache_scores``), or on GPUs
one ``[B, Hkv, capacity, D]`` buffer per layer (``init_cache(per_layer=True)``), and per-row
``lengths [B]``; an extend of
T tokens at positions ``lengths[b] .. lengths[b]+T-1`` sees every committed slot and the new
tokens causally. ``forward_pure`` is the runtime protocol's forward (``dspark_jax.runtime``:
returns the new k/v, never writes); ``KVCache.commit`` writes the accepted ones (out-of-range
slots are dropped); ``forward`` is the two together (training, tests, sampling).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from dspark_jax import nn
from dspark_jax.kernels import flash_tpu
from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.config import TargetConfig
from dspark_jax.params import ParamSpec


KV_AXES = ("layers", runtime.BATCH, "kv_heads", runtime.STEP, "head_dim")
LAYER_KV_AXES = KV_AXES[1:]  # one layer's buffer of a per-layer cache


@flax.struct.dataclass
class KVCache:
    """Static-shape KV cache (``runtime.Cache``). k, v: [L, B, Hkv, capacity, D], or a tuple of L
    per-layer [B, Hkv, capacity, D] buffers (``per_layer``); lengths: [B] int32. The delta of T
    tokens is ``(k_new, v_new)`` in the same form: [L, B, Hkv, T, D], or L-tuples of [B, Hkv, T, D].

    Per-layer buffers are for GPUs, where the forward's layer loop is unrolled over per-layer
    weights (``params.for_platform``): XLA:GPU hands a cuBLAS gemm (the values dot of a multi-query
    block) a copy of a layer's slice of a stacked cache, and an unrolled loop's one-row update of
    the stacked cache copied the whole cache twice per AR step at B = 1; a layer's own buffer is
    read and updated in place."""

    k: jax.Array | tuple
    v: jax.Array | tuple
    lengths: jax.Array

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def capacity(self) -> int:
        return (self.k[0] if self.per_layer else self.k).shape[-2]

    def axes(self) -> "KVCache":
        kv = tuple(LAYER_KV_AXES for _ in self.k) if self.per_layer else KV_AXES
        return KVCache(kv, kv, (runtime.BATCH,))

    def delta_axes(self) -> tuple:
        axes = self.axes()
        return (axes.k, axes.v)

    def commit(self, delta: tuple, n_new: jax.Array) -> "KVCache":
        """Write the first ``n_new[b]`` of the delta's tokens at slots ``lengths[b] + t`` (one
        masked scatter per tensor, or per layer's buffer; in place when donated) and advance
        ``lengths``."""
        k_new, v_new = delta
        t = (k_new[0] if self.per_layer else k_new).shape[-2]
        positions = self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        slots = jnp.where(runtime.step_mask(n_new, t), positions, self.capacity)
        write = lambda buf, new: runtime.write_steps(buf, new, slots)  # noqa: E731
        k, v = (jax.tree.map(write, self.k, k_new), jax.tree.map(write, self.v, v_new))
        return KVCache(k, v, self.lengths + n_new.astype(jnp.int32))


def init_cache(config: TargetConfig, batch: int, capacity: int, dtype=jnp.float32,
               max_extend: int | None = None, *, per_layer: bool = False) -> KVCache:
    """Empty cache of ``capacity`` positions per row (``max_extend``: unused, every slot is kept);
    ``per_layer``: one buffer per layer (for per-layer params, ``params.for_platform``)."""
    del max_extend
    shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
    n = config.num_hidden_layers
    if per_layer:
        k, v = (tuple(jnp.zeros(shape, dtype) for _ in range(n)) for _ in range(2))
    else:
        k, v = jnp.zeros((n, *shape), dtype), jnp.zeros((n, *shape), dtype)
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


# Our key in a stacked decoder layer -> (torch suffix inside layer i, kernel?). Kernels are
# nn.Linear weights (stored transposed), initialised N(0, 0.02) in this order; norms are ones.
_LAYER = {
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
    "input_layernorm": ("input_layernorm.weight", False),
    "post_attention_layernorm": ("post_attention_layernorm.weight", False),
}
_KERNEL_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def declare_layers(config, torch_prefix: str, rng_path: tuple = ()) -> dict[tuple, ParamSpec]:
    """Stacked Qwen3 decoder layers ``("layers", key)`` of a target or drafter ``config``.

    Shapes are [L, in, out] for kernels and [L, size] for norms; torch names
    ``{torch_prefix}layers.{i}.<suffix>``. ``rng_path`` is the key path of the whole stack
    (kernel j then takes ``split(key, 7)[j]``).
    """
    h, m, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    dims = {"q_proj": ((h, q), ("embed", "heads")), "k_proj": ((h, kv), ("embed", "kv_heads")),
            "v_proj": ((h, kv), ("embed", "kv_heads")), "o_proj": ((q, h), ("heads", "embed")),
            "q_norm": ((d,), (None,)), "k_norm": ((d,), (None,)),
            "gate_proj": ((h, m), ("embed", "mlp")), "up_proj": ((h, m), ("embed", "mlp")),
            "down_proj": ((m, h), ("mlp", "embed")),
            "input_layernorm": ((h,), (None,)), "post_attention_layernorm": ((h,), (None,))}
    ids = tuple(range(config.num_hidden_layers))
    specs = {}
    for key, (suffix, kernel) in _LAYER.items():
        shape, axes = dims[key]
        specs[("layers", key)] = ParamSpec(
            (len(ids), *shape), ("layers", *axes), f"{torch_prefix}layers.{{i}}.{suffix}",
            transpose=kernel, init="normal" if kernel else "ones", layer_ids=ids,
            rng_path=(*rng_path, (len(_KERNEL_ORDER), _KERNEL_ORDER.index(key))) if kernel else None)
    return specs


def declare(config: TargetConfig) -> dict[tuple, ParamSpec]:
    """Every leaf of a ``Qwen3ForCausalLM`` params tree, in checkpoint order (SPEC section 11).

    {"embed_tokens": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied), "layers": {...}}.
    """
    h, v = config.hidden_size, config.vocab_size
    specs = {("embed_tokens",): ParamSpec((v, h), ("vocab", "embed"), "model.embed_tokens.weight",
                                          rng_path=((3, 0),)),
             ("norm",): ParamSpec((h,), (None,), "model.norm.weight", init="ones")}
    if not config.tie_word_embeddings:
        specs[("lm_head",)] = ParamSpec((h, v), ("embed", "vocab"), "lm_head.weight", transpose=True,
                                        rng_path=((3, 2),))
    specs.update(declare_layers(config, "model.", ((3, 1),)))
    return specs


def init_params(config: TargetConfig, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random params (std 0.02), for tests and from-scratch experiments."""
    return params_lib.init_params(declare(config), rng, dtype)


def param_axes(config: TargetConfig) -> dict:
    """Logical axis names, same tree structure as ``init_params``."""
    return params_lib.param_axes(declare(config))


def _tied_head(config: TargetConfig) -> tuple[str, str] | None:
    return ("lm_head.weight", "model.embed_tokens.weight") if config.tie_word_embeddings else None


def lm_head_kernel(params: dict) -> jax.Array:
    """[H, V] output projection (the embedding's transpose when tied)."""
    return params["lm_head"] if "lm_head" in params else params["embed_tokens"].T


def compute_logits(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (after the final norm) -> logits [..., V] in float32."""
    return nn.project_f32(hidden, lm_head_kernel(params))


def logits(params: dict, config: TargetConfig, hidden: jax.Array) -> jax.Array:
    """The runtime protocol's ``logits`` (Qwen3 needs nothing from the config)."""
    del config
    return compute_logits(params, hidden)


def _layer(config: TargetConfig, x, p, positions, mask, k_cache=None, v_cache=None, cache_mask=None,
           layer=None):
    """One decoder layer over x [B, T, H].

    Without a cache: attention over the T new tokens (``mask`` [B, T, T], causal: the fused
    form on CUDA, ``nn.attention``). With
    one: this layer's read-only ``k_cache, v_cache [B, Hkv, max_len, D]``, of which the first
    S = ``cache_mask.shape[-1]`` slots are read (``nn.attention``; visible per ``cache_mask``
    [B, T, S]), plus the new tokens (``mask``); with ``layer`` (``flash_tpu.Layer``), the whole
    stacked caches [L, B, Hkv, max_len, D] (in the compute dtype), read at ``layer.index``.
    Returns (x, k, v) with the new tokens' k, v [B, Hkv, T, D] (head-major like the cache;
    written by the caller).
    """
    h = nn.rms_norm(x, p["input_layernorm"], config.rms_norm_eps)
    q, k, v = nn.qkv_heads(h, p, config.num_attention_heads, config.num_key_value_heads,
                           config.head_dim, config.rms_norm_eps)
    cos, sin = nn.rope_cos_sin(positions, config.head_dim, config.rope_theta)
    q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
    if k_cache is None:
        attn = nn.attention(q, k, v, mask, causal=True)
    elif layer is not None:
        attn = nn.attention(q, k, v, mask, causal=True, prefix=(k_cache, v_cache, cache_mask, layer))
    else:
        attn = nn.attention(q, k, v, mask, causal=True,
                            prefix=(k_cache.astype(q.dtype), v_cache.astype(q.dtype), cache_mask))
    b, t = x.shape[:2]
    x = x + attn.reshape(b, t, -1) @ p["o_proj"]
    x = x + nn.swiglu_mlp(nn.rms_norm(x, p["post_attention_layernorm"], config.rms_norm_eps), p)
    return x, nn.head_major(k), nn.head_major(v)


def forward_pure(params: dict, config: TargetConfig, tokens: jax.Array, cache: KVCache | None = None,
                 *, ctx: runtime.Context = runtime.LOCAL, taps: Sequence[int] = (),
                 span: int | None = None):
    """The runtime protocol's forward over ``tokens [B, T]`` (``dspark_jax.runtime``).

    Without a cache: a causal pass over positions 0..T-1. With one: an extend at positions
    ``lengths[b] + t`` reading the first ``span`` cache slots (default all). Returns ``(hidden
    [B, T, H] after the final norm, features [B, T, n*H] or None, delta)``: features concatenate
    the raw outputs of decoder layers ``taps`` (-1 = embedding output); delta is the new
    ``(k, v)`` [L, B, Hkv, T, D] (None without a cache), for ``KVCache.commit``.

    ``params["layers"]`` is the stacked tree (a ``lax.scan`` over layers) or a sequence of
    per-layer trees (``params.unstack_layers``: a Python loop over layers whose weights are
    separate buffers; XLA:GPU otherwise copies each layer's weights out of the stacked arrays
    before its gemms, docs/performance.md section 0a). Same outputs.
    """
    b, t = tokens.shape
    embed = params["embed_tokens"]
    dtype = ctx.dtype or embed.dtype
    x = embed[tokens].astype(dtype)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    if cache is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cache_mask = None
    else:
        # The cache is read-only here: queries see the committed slots < lengths[b] plus the
        # new tokens causally.
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        slots = jnp.arange(nn.read_span(span, cache.capacity), dtype=jnp.int32)
        cache_mask = jnp.broadcast_to(slots[None, None, :] < cache.lengths[:, None, None],
                                      (b, t, slots.shape[0]))

    tap_ids = tuple(taps)
    tap_index = [len(tap_ids)] * config.num_hidden_layers  # other layers write a scratch slot
    for n, layer_id in enumerate(tap_ids):
        if layer_id >= 0:
            tap_index[layer_id] = n
    # [n + 1, B, T, H]: one in-place row write per layer (a select over the whole buffer per layer
    # moved it all: 0.09 GB of a Qwen3-8B round at B = 8 on TPU v5e)
    taps0 = jnp.zeros((len(tap_ids) + 1, b, t, config.hidden_size), dtype)
    if -1 in tap_ids:
        taps0 = taps0.at[tap_ids.index(-1)].set(x)

    layers = jax.tree.map(lambda a: a.astype(dtype) if a.dtype != dtype else a, params["layers"])
    # A TPU program's scan hands the attention the whole stacked cache and the layer's index, for
    # the kernel that reads the layer in place (``flash_tpu``; a scanned slice would be copied).
    stacked = None
    if (cache is not None and not cache.per_layer and not params_lib.per_layer(params)
            and flash_tpu.applies(ctx.platform, t, config.head_dim, cache.k.dtype, dtype)):
        stacked = flash_tpu.placement(ctx, cache.axes().k, cache.k.shape)

    def body(carry, xs):
        x, taps = carry
        if cache is None:
            p, idx = xs
            x, k, v = _layer(config, x, p, positions, causal)
        elif stacked is not None:
            p, idx, layer = xs
            x, k, v = _layer(config, x, p, positions, causal, cache.k, cache.v, cache_mask,
                             dataclasses.replace(stacked, index=layer))
        else:
            p, idx, k_cache, v_cache = xs
            x, k, v = _layer(config, x, p, positions, causal, k_cache, v_cache, cache_mask)
        if tap_ids:
            taps = jax.lax.dynamic_update_index_in_dim(taps, x, idx, 0)
        return (x, taps), (None if cache is None else (k, v))

    if cache is not None and cache.per_layer and not params_lib.per_layer(params):
        raise ValueError("a per-layer KV cache needs per-layer params (params.unstack_layers)")
    if params_lib.per_layer(params):  # one params tree per layer: an unrolled loop
        carry, outs = (x, taps0), []
        for i, p in enumerate(layers):
            if cache is None:
                kv = ()
            elif cache.per_layer:
                kv = (cache.k[i], cache.v[i])
            else:
                kv = nn.layer_slices((cache.k, cache.v), i)
            carry, out = body(carry, (p, jnp.int32(tap_index[i]), *kv))
            outs.append(out)
        (x, taps_out) = carry
        delta = None
        if cache is not None:  # in the cache's own form
            delta = tuple(zip(*outs)) if cache.per_layer else tuple(jnp.stack(a) for a in zip(*outs))
    else:
        xs = (layers, jnp.asarray(tap_index, jnp.int32))
        if stacked is not None:
            xs = xs + (jnp.arange(config.num_hidden_layers, dtype=jnp.int32),)
        elif cache is not None:
            xs = xs + (cache.k, cache.v)
        (x, taps_out), delta = jax.lax.scan(body, (x, taps0), xs)     # delta: [Lyr, B, Hkv, T, D] x2
    hidden = nn.rms_norm(x, params["norm"].astype(dtype), config.rms_norm_eps)
    features = None
    if tap_ids:
        features = jnp.moveaxis(taps_out[:len(tap_ids)], 0, 2).reshape(b, t, len(tap_ids) * config.hidden_size)
    return hidden, features, delta


def forward(params: dict, config: TargetConfig, tokens: jax.Array, cache: KVCache | None = None,
            *, num_new: jax.Array | None = None, tap_layer_ids: Sequence[int] = (),
            compute_dtype=None, cache_span: int | None = None):
    """``forward_pure`` then ``cache.commit`` of each row's first ``num_new`` tokens (default T):
    ``(hidden, taps or None, updated cache or None)`` (training, feature extraction, tests)."""
    return runtime.forward_and_commit(forward_pure, params, config, tokens, cache, num_new=num_new,
                                      taps=tap_layer_ids, compute_dtype=compute_dtype, span=cache_span)


RUNTIME = runtime.TargetRuntime(
    init_cache=init_cache, forward=forward_pure, logits=logits,
    feature_dim=lambda config, taps: runtime.concat_features(config.hidden_size, taps), per_layer=True)

FAMILY = params_lib.Family(
    name="qwen3", kind="target", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",),
    config_cls=TargetConfig, declare=declare, forward=__name__, tied_head=_tied_head,
    runtime=RUNTIME)
