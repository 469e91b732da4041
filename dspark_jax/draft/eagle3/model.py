"""The Eagle3 drafter (DeepSpec's ``Qwen3Eagle3Model`` / ``Gemma4Eagle3Model``): declaration and
the one decoder layer both training (TTT, ``ttt.py``) and decoding (the chain, ``chain.py``) run.

Params (kernels ``[in, out]``; torch names as DeepSpec's state dict)::

    embed_tokens [V, H]   lm_head [H, V]   (frozen copies of the target's)
    fc [5H, H]   norm [H]
    layers {one stacked layer, leading axis 1: hidden_norm, input_layernorm, q/k/v_proj [2H, .],
            o_proj, q_norm, k_norm, MLP, post_attention_layernorm (+ Gemma4's sandwich norms,
            layer_scalar; no v_proj under k = v)}

One step of the module (``step``): ``x = concat(input_layernorm(embed(tok)), hidden_norm(h))``
[2H]; q, k, v from x (per-head q/k norms, rotary at the step's positions); attention against
whatever keys the caller supplies (``attend``); the residual stream is ``h`` itself; the output
``h'`` (before ``norm``) is what the next step reads; logits are ``head(norm(h'))``.
The two families differ only in ``Variant`` (embedding scale, q/k/v, the layer's tail, softcap).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from dspark_jax import nn
from dspark_jax import params as params_lib
from dspark_jax.params import ParamSpec
from dspark_jax.target import gemma4 as tg
from dspark_jax.target import qwen3
from dspark_jax.draft.eagle3.config import Eagle3Config, Gemma4Eagle3Config, Qwen3Eagle3Config

QKV = ("q_proj", "k_proj", "v_proj")


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a target family changes in the Eagle3 layer.

    embed(p, cfg, ids [..]) -> [.., H]; norm(x, w, eps); qkv(p, cfg, x [B, T, 2H], positions
    [B, T]) -> q [B, T, Hq, D], k, v [B, T, Hkv, D] (q, k rotated); finish(p, cfg, h [B, T, H],
    attn [B, T, Hq*D]) -> h'; cap: the logit softcap of cfg (None: none); scale(cfg): attention scale.
    """

    embed: Callable
    norm: Callable
    qkv: Callable
    finish: Callable
    cap: Callable
    scale: Callable


def _layer(p: dict) -> dict:
    """The one layer of a stacked ``params["layers"]`` ([1, ...] leaves)."""
    return jax.tree.map(lambda a: a[0], p["layers"])


# ----------------------------------------------------------------------------- Qwen3


def _qwen3_qkv(p, cfg: Qwen3Eagle3Config, x, positions):
    q, k, v = nn.qkv_heads(x, p, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                           cfg.rms_norm_eps)
    cos, sin = nn.rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    return nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin), v


def _qwen3_finish(p, cfg, h, attn):
    h = h + attn @ p["o_proj"]
    return h + nn.swiglu_mlp(nn.rms_norm(h, p["post_attention_layernorm"], cfg.rms_norm_eps), p)


QWEN3 = Variant(embed=lambda p, cfg, ids: p["embed_tokens"][ids], norm=nn.rms_norm, qkv=_qwen3_qkv,
                finish=_qwen3_finish, cap=lambda cfg: None, scale=lambda cfg: 1.0 / math.sqrt(cfg.head_dim))


# ----------------------------------------------------------------------------- Gemma4


def _gemma4_qkv(p, cfg: Gemma4Eagle3Config, x, positions):
    q, k, v = tg.project_qkv(x, p, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.rms_norm_eps)
    cos, sin = tg.rope_cos_sin(positions, tg.group_rope(cfg.text, "full"), x.dtype)
    return nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin), v


GEMMA4 = Variant(embed=lambda p, cfg, ids: tg.embed(p["embed_tokens"], ids), norm=tg.rms_norm,
                 qkv=_gemma4_qkv, finish=lambda p, cfg, h, attn: tg.sandwich(h, attn @ p["o_proj"], p,
                                                                           cfg.rms_norm_eps),
                 cap=lambda cfg: cfg.final_logit_softcapping, scale=lambda cfg: 1.0)

VARIANTS = {Qwen3Eagle3Config: QWEN3, Gemma4Eagle3Config: GEMMA4}


def variant(cfg: Eagle3Config) -> Variant:
    return VARIANTS[type(cfg)]


# ----------------------------------------------------------------------------- declaration


def _widen(spec: ParamSpec, width: int) -> ParamSpec:
    """A [1, H, out] projection read from the [2H] concat instead."""
    return dataclasses.replace(spec, shape=(spec.shape[0], width, *spec.shape[2:]))


def _layer_specs(cfg: Eagle3Config) -> dict[str, ParamSpec]:
    if isinstance(cfg, Gemma4Eagle3Config):
        specs = {leaf: spec for (_, leaf), spec in
                 tg.layer_declaration(cfg.text, "full", (0,), "layers.{i}.").items()}
        specs["layer_scalar"] = dataclasses.replace(specs["layer_scalar"], frozen=True)  # a torch buffer
        return specs
    return {leaf: dataclasses.replace(spec, rng_path=None)
            for (_, leaf), spec in qwen3.declare_layers(cfg.text, "").items()}


def declare(cfg: Eagle3Config) -> dict[tuple, ParamSpec]:
    """Every leaf of the drafter, in DeepSpec's checkpoint order."""
    v, h, n = cfg.vocab_size, cfg.hidden_size, cfg.num_context_features
    decl = {
        ("embed_tokens",): ParamSpec((v, h), ("vocab", "embed"), "embed_tokens.weight", frozen=True),
        ("fc",): ParamSpec((n * h, h), ("features", "embed"), "fc.weight", transpose=True),
        ("layers", "hidden_norm"): ParamSpec((1, h), ("layers", None), "layers.{i}.hidden_norm.weight",
                                             init="ones", layer_ids=(0,)),
    }
    for leaf, spec in _layer_specs(cfg).items():
        decl[("layers", leaf)] = _widen(spec, 2 * h) if leaf in QKV else spec
    decl[("norm",)] = ParamSpec((h,), (None,), "norm.weight", init="ones")
    decl[("lm_head",)] = ParamSpec((h, v), ("embed", "vocab"), "lm_head.weight", transpose=True, frozen=True)
    return decl


def init_params(cfg: Eagle3Config, rng: jax.Array, dtype=jnp.float32, *,
                embed_tokens: jax.Array | None = None, lm_head: jax.Array | None = None) -> dict:
    """Random drafter params; pass the target's ``embed_tokens`` / ``lm_head`` [H, V] to share them."""
    given = {path: x for path, x in ((("embed_tokens",), embed_tokens), (("lm_head",), lm_head))
             if x is not None}
    return params_lib.init_params(declare(cfg), rng, dtype, given=given)


def param_axes(cfg: Eagle3Config) -> dict:
    return params_lib.param_axes(declare(cfg))


# ----------------------------------------------------------------------------- forward pieces


def project_features(p: dict, cfg: Eagle3Config, features: jax.Array) -> jax.Array:
    """[B, T, 5H] tapped target features -> the first hidden state h [B, T, H] = fc(features)."""
    return features.astype(p["fc"].dtype) @ p["fc"]


def step_inputs(p: dict, cfg: Eagle3Config, h: jax.Array, ids: jax.Array, positions: jax.Array):
    """(q [B, T, Hq, D], k, v [B, T, Hkv, D]) of one module step on hidden h [B, T, H] and tokens
    ids [B, T] at rotary ``positions`` [B, T]."""
    var, lp = variant(cfg), _layer(p)
    eps = cfg.rms_norm_eps
    x = jnp.concatenate([var.norm(var.embed(p, cfg, ids).astype(h.dtype), lp["input_layernorm"], eps),
                         var.norm(h, lp["hidden_norm"], eps)], axis=-1)
    return var.qkv(lp, cfg, x, positions)


def step_output(p: dict, cfg: Eagle3Config, h: jax.Array, attn: jax.Array) -> jax.Array:
    """The layer's tail: residual h [B, T, H] plus attention output attn [B, T, Hq, D] -> h'."""
    b, t = h.shape[:2]
    return variant(cfg).finish(_layer(p), cfg, h, attn.reshape(b, t, -1).astype(h.dtype))


def head(p: dict, cfg: Eagle3Config, normed: jax.Array) -> jax.Array:
    """[..., H] after a final norm -> [..., V] float32 logits (softcapped where the family caps):
    the draft's logits on ``norm(h)``, the target's on its own last hidden state."""
    logits = jnp.einsum("...h,hv->...v", normed, p["lm_head"].astype(normed.dtype),
                        preferred_element_type=jnp.float32)
    return tg.softcap(logits, variant(cfg).cap(cfg))


def logits(p: dict, cfg: Eagle3Config, h: jax.Array) -> jax.Array:
    """Draft logits [..., V] float32 of layer outputs h [..., H]."""
    return head(p, cfg, variant(cfg).norm(h, p["norm"], cfg.rms_norm_eps))


def scale(cfg: Eagle3Config) -> float:
    return variant(cfg).scale(cfg)
