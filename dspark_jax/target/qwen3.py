"""Qwen3 causal LM as pure functions over a params pytree, with a static KV cache.

Params::

    {"embed_tokens": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "layers": {stacked decoder-layer params, leading axis L}}

The KV cache holds ``k, v [L, B, max_len, Hkv, D]`` and per-row ``lengths [B]``;
an extend of T tokens writes them at slots ``lengths[b] .. lengths[b]+T-1``
(out-of-range writes are dropped) and queries see every slot ``<=`` their own
position. Rolling back is setting ``lengths``: nothing is copied.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from dspark_jax import nn
from dspark_jax.config import TargetConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Static-shape KV cache. k, v: [L, B, max_len, Hkv, D]; lengths: [B] int32."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def init_cache(config: TargetConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (config.num_hidden_layers, batch, max_len, config.num_key_value_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def init_params(config: TargetConfig, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random params (std 0.02), for tests and from-scratch experiments."""
    k_embed, k_layers, k_head = jax.random.split(rng, 3)
    params = {
        "embed_tokens": (0.02 * jax.random.normal(k_embed, (config.vocab_size, config.hidden_size))).astype(dtype),
        "layers": nn.init_decoder_layers(
            k_layers, config.num_hidden_layers, config.hidden_size, config.intermediate_size,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype),
        "norm": jnp.ones((config.hidden_size,), dtype),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = (0.02 * jax.random.normal(k_head, (config.hidden_size, config.vocab_size))).astype(dtype)
    return params


def param_axes(config: TargetConfig) -> dict:
    """Logical axis names, same tree structure as ``init_params``."""
    axes = {"embed_tokens": ("vocab", "embed"), "layers": dict(nn.DECODER_LAYER_AXES), "norm": (None,)}
    if not config.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def lm_head_kernel(params: dict) -> jax.Array:
    """[H, V] output projection (the embedding's transpose when tied)."""
    return params["lm_head"] if "lm_head" in params else params["embed_tokens"].T


def compute_logits(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (after the final norm) -> logits [..., V] in float32."""
    return jnp.einsum("...h,hv->...v", hidden, lm_head_kernel(params),
                      preferred_element_type=jnp.float32)


def _layer(config: TargetConfig, x, p, positions, k_all, v_all, write_slots, mask):
    """One decoder layer. With a cache, k_all/v_all are this layer's [B, max_len, Hkv, D]."""
    h = nn.rms_norm(x, p["input_layernorm"], config.rms_norm_eps)
    q, k, v = nn.qkv_heads(h, p, config.num_attention_heads, config.num_key_value_heads,
                           config.head_dim, config.rms_norm_eps)
    cos, sin = nn.rope_cos_sin(positions, config.head_dim, config.rope_theta)
    q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
    if k_all is None:
        keys, values = k, v
    else:
        rows = jnp.arange(x.shape[0])[:, None]
        k_all = k_all.at[rows, write_slots].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[rows, write_slots].set(v.astype(v_all.dtype), mode="drop")
        keys, values = k_all.astype(q.dtype), v_all.astype(q.dtype)
    attn = nn.attention(q, keys, values, mask)
    b, t = x.shape[:2]
    x = x + attn.reshape(b, t, -1) @ p["o_proj"]
    x = x + nn.swiglu_mlp(nn.rms_norm(x, p["post_attention_layernorm"], config.rms_norm_eps), p)
    return x, k_all, v_all


def forward(
    params: dict,
    config: TargetConfig,
    tokens: jax.Array,
    cache: KVCache | None = None,
    *,
    num_new: jax.Array | None = None,
    tap_layer_ids: Sequence[int] = (),
    compute_dtype=None,
):
    """Run the target over ``tokens [B, T]``.

    Without a cache: a causal pass over positions 0..T-1 (training / feature
    extraction). With a cache: an extend at positions ``lengths[b] + t``; the
    returned cache has ``lengths + num_new`` (``num_new`` [B] defaults to T).

    Returns ``(hidden [B, T, H] after the final norm, taps [B, T, n*H] or None,
    cache or None)``. ``taps`` concatenates the raw outputs of decoder layers
    ``tap_layer_ids`` (-1 = embedding output), the drafter's context features.
    """
    b, t = tokens.shape
    embed = params["embed_tokens"]
    dtype = compute_dtype or embed.dtype
    x = embed[tokens].astype(dtype)
    if cache is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        write_slots = None
    else:
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        slots = jnp.arange(cache.max_len, dtype=jnp.int32)
        mask = slots[None, None, :] <= positions[:, :, None]
        write_slots = positions

    tap_ids = tuple(tap_layer_ids)
    tap_index = [-1] * config.num_hidden_layers
    for n, layer_id in enumerate(tap_ids):
        if layer_id >= 0:
            tap_index[layer_id] = n
    taps0 = jnp.zeros((max(len(tap_ids), 1), b, t, config.hidden_size), dtype)
    if -1 in tap_ids:
        taps0 = taps0.at[tap_ids.index(-1)].set(x)

    layers = jax.tree.map(lambda a: a.astype(dtype) if a.dtype != dtype else a, params["layers"])

    def body(carry, xs):
        x, taps = carry
        p, idx, k_all, v_all = xs
        x, k_all, v_all = _layer(config, x, p, positions, k_all, v_all, write_slots, mask)
        if tap_ids:
            slot = jnp.maximum(idx, 0)
            taps = jnp.where(idx >= 0, jax.lax.dynamic_update_index_in_dim(taps, x, slot, 0), taps)
        return (x, taps), (k_all, v_all)

    k_stack = None if cache is None else cache.k
    v_stack = None if cache is None else cache.v
    (x, taps), (k_new, v_new) = jax.lax.scan(
        body, (x, taps0), (layers, jnp.asarray(tap_index, jnp.int32), k_stack, v_stack))
    hidden = nn.rms_norm(x, params["norm"].astype(dtype), config.rms_norm_eps)
    tap_features = None
    if tap_ids:
        tap_features = jnp.moveaxis(taps, 0, 2).reshape(b, t, len(tap_ids) * config.hidden_size)
    new_cache = None
    if cache is not None:
        step = jnp.full((b,), t, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
        new_cache = KVCache(k_new, v_new, cache.lengths + step)
    return hidden, tap_features, new_cache
