"""The Gemma4 DSpark drafter (reference ``Gemma4DSparkModel``): config, declaration, backbone.

Same block drafter as the Qwen3 one (SPEC sections 3-7, shared code in ``draft.model``,
``markov``, ``confidence``, ``train.batch``, ``train.loss``) on Gemma4 layers (SPEC 13):
every layer is a full-attention Gemma4 layer (``global_head_dim``, k = v when
``attention_k_eq_v``, proportional rotary, attention scale 1, sandwich norms,
``layer_scalar``); block embeddings are scaled by sqrt(H); context K/V come from
``hidden_norm(fc(features))`` through each layer's k projection, k norm (+ rotary) and
v norm; logits are ``softcap(lm_head(h))`` with the Markov bias added after the cap.

``OPS`` is the ``ops`` argument of ``draft.model.training_forward`` / ``training_hidden`` /
``block_heads``: ``project_context``, ``context_kv``, ``block_forward``, ``embed_block`` and
``compute_logits`` with the signatures of ``draft.model.QWEN3_OPS``.

Params (kernels ``[in, out]``)::

    embed_tokens [V, H]  lm_head [H, V]  (frozen copies of the target's)
    fc [n*H, H]  hidden_norm [H]  norm [H]
    layers {stacked Gemma4 full-attention layer, leading axis Ld; no v_proj under k = v}
    markov_head {...}  confidence_head {...}   (as the Qwen3 drafter)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dspark_jax import nn
from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.config import DraftConfig, dspark_hf_fields
from dspark_jax.draft import backbone, confidence
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import ConfigError
from dspark_jax.params import ParamSpec
from dspark_jax.target import gemma4 as tg

ARCHITECTURE = "Gemma4DSparkModel"


@dataclasses.dataclass(frozen=True)
class Gemma4DraftConfig:
    """A Gemma4 DSpark drafter.

    ``text``: the drafter's own Gemma4 text config (the target's, with ``num_hidden_layers``
    draft layers, all ``full_attention``). The DSpark keys mean what they mean for
    ``DraftConfig`` (which validates them). ``head_dim`` / ``num_key_value_heads`` are the
    drafter's attention shape (``global_head_dim`` and the full-layer KV heads).
    """

    text: tg.Gemma4TargetConfig
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 7
    mask_token_id: int = 0
    num_anchors: int = 512
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    target_model_type: str = "gemma4_unified"

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if set(self.text.layer_types) != {tg.FULL}:
            raise ConfigError(f"Gemma4 drafter layer_types must all be 'full_attention', got "
                              f"{list(self.text.layer_types)}")
        object.__setattr__(self, "confidence_head_with_markov", self.dspark.confidence_head_with_markov)

    @property
    def dspark(self) -> DraftConfig:
        """The DSpark keys on a Qwen3-shaped DraftConfig (validates them; has_markov etc. live there)."""
        t = self.text
        return DraftConfig(
            vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            num_target_layers=self.num_target_layers, target_layer_ids=self.target_layer_ids,
            block_size=self.block_size, mask_token_id=self.mask_token_id, num_anchors=self.num_anchors,
            markov_rank=self.markov_rank, markov_head_type=self.markov_head_type,
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.confidence_head_with_markov, rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.full_rope_theta, max_position_embeddings=t.max_position_embeddings)

    # the attribute names generic drafter code reads
    vocab_size = property(lambda self: self.text.vocab_size)
    hidden_size = property(lambda self: self.text.hidden_size)
    intermediate_size = property(lambda self: self.text.intermediate_size)
    num_hidden_layers = property(lambda self: self.text.num_hidden_layers)
    num_attention_heads = property(lambda self: self.text.num_attention_heads)
    num_key_value_heads = property(lambda self: self.text.full_num_key_value_heads)
    head_dim = property(lambda self: self.text.global_head_dim)
    rms_norm_eps = property(lambda self: self.text.rms_norm_eps)
    max_position_embeddings = property(lambda self: self.text.max_position_embeddings)
    final_logit_softcapping = property(lambda self: self.text.final_logit_softcapping)
    num_context_features = property(lambda self: len(self.target_layer_ids))
    has_markov = property(lambda self: self.markov_rank > 0)
    confidence_uses_markov = property(lambda self: self.dspark.confidence_uses_markov)

    def replace(self, **changes) -> "Gemma4DraftConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target: tg.Gemma4TargetConfig, num_hidden_layers: int, **kwargs) -> "Gemma4DraftConfig":
        """A drafter of ``num_hidden_layers`` layers on ``target`` (as the reference's build_draft_config)."""
        text = target.replace(num_hidden_layers=num_hidden_layers, layer_types=(tg.FULL,) * num_hidden_layers,
                              tie_word_embeddings=False)
        return cls(text=text, num_target_layers=target.num_hidden_layers, **kwargs)

    def check_compatible(self, target) -> None:
        """ConfigError unless ``target`` is a Gemma4 target whose features and tokens this drafter reads."""
        if not isinstance(target, tg.Gemma4TargetConfig):
            raise ConfigError(f"a Gemma4 drafter needs a Gemma4 target, got {type(target).__name__}")
        self.dspark.check_compatible(target)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Gemma4DraftConfig":
        """From a ``Gemma4DSparkModel`` config.json (the target's text config plus the DSpark keys)."""
        where = "drafter config.json"
        arch = (hf.get("architectures") or [ARCHITECTURE])[0]
        if arch != ARCHITECTURE:
            raise ConfigError(f"{where}: architecture {arch!r} is not {ARCHITECTURE!r}")
        rank = int(tg.config._get(hf, "markov_rank", where))
        conf = bool(tg.config._get(hf, "enable_confidence_head", where))
        if rank > 0 and "markov_head_type" not in hf:
            raise ConfigError(f"{where}: markov_head_type is required when markov_rank > 0")
        if conf and "confidence_head_with_markov" not in hf:
            raise ConfigError(f"{where}: confidence_head_with_markov is required when enable_confidence_head is true")
        return cls(
            text=tg.Gemma4TargetConfig(**tg.gemma4_text_kwargs(hf, where)),
            num_target_layers=int(tg.config._get(hf, "num_target_layers", where)),
            target_layer_ids=tuple(tg.config._get(hf, "target_layer_ids", where)),
            block_size=int(tg.config._get(hf, "block_size", where)),
            mask_token_id=int(tg.config._get(hf, "mask_token_id", where)),
            num_anchors=int(tg.config._get(hf, "num_anchors", where)),
            markov_rank=rank,
            markov_head_type=str(hf.get("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=conf,
            confidence_head_with_markov=bool(hf.get("confidence_head_with_markov", False)) if conf else False,
            target_model_type=str(hf.get("target_model_type", "gemma4_unified")),
        )

    def to_hf(self) -> dict[str, Any]:
        hf = tg.gemma4_text_fields(self.text, ARCHITECTURE)
        hf.update({
            "tie_word_embeddings": False,
            "target_model_type": self.target_model_type,
            "target_text_model_type": self.text.model_type,
        })
        hf.update(dspark_hf_fields(self))
        return hf


# ----------------------------------------------------------------------------- declaration


def head_declaration(cfg) -> dict[tuple, ParamSpec]:
    """Markov and confidence heads (family-agnostic; same torch names as the Qwen3 drafter).

    TODO(merge): the shared declaration of these heads (markov.py / confidence.py) replaces this.
    """
    h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    decl = {}
    if cfg.has_markov:
        decl[("markov_head", "markov_w1")] = ParamSpec((v, r), ("vocab", "rank"), "markov_head.markov_w1.weight")
        decl[("markov_head", "markov_w2")] = ParamSpec((r, v), ("rank", "vocab"), "markov_head.markov_w2.weight",
                                                       transpose=True)
        extra = {"gated": ("gate_proj", h + r, r, (None, "rank"), ("rank",)),
                 "rnn": ("joint_proj", 2 * r + h, 3 * r, (None, None), (None,))}.get(cfg.markov_head_type)
        if extra:
            name, d_in, d_out, k_axes, b_axes = extra
            decl[("markov_head", name, "kernel")] = ParamSpec((d_in, d_out), k_axes, f"markov_head.{name}.weight",
                                                              transpose=True)
            decl[("markov_head", name, "bias")] = ParamSpec((d_out,), b_axes, f"markov_head.{name}.bias",
                                                            init="zeros")
    if cfg.enable_confidence_head:
        decl[("confidence_head", "kernel")] = ParamSpec((confidence.input_dim(cfg), 1), (None, None),
                                                        "confidence_head.proj.weight", transpose=True)
        decl[("confidence_head", "bias")] = ParamSpec((1,), (None,), "confidence_head.proj.bias", init="zeros")
    return decl


def declare(cfg: Gemma4DraftConfig) -> dict[tuple, ParamSpec]:
    """Every drafter parameter: our path -> ParamSpec (torch names as ``Gemma4DSparkModel``'s state dict)."""
    v, h, n = cfg.vocab_size, cfg.hidden_size, cfg.num_context_features
    decl = {
        ("embed_tokens",): ParamSpec((v, h), ("vocab", "embed"), "embed_tokens.weight", frozen=True),
        ("lm_head",): ParamSpec((h, v), ("embed", "vocab"), "lm_head.weight", transpose=True, frozen=True),
        ("fc",): ParamSpec((n * h, h), ("features", "embed"), "fc.weight", transpose=True),
        ("hidden_norm",): ParamSpec((h,), (None,), "hidden_norm.weight", init="ones"),
        ("norm",): ParamSpec((h,), (None,), "norm.weight", init="ones"),
    }
    layers = tg.layer_declaration(cfg.text, "full", range(cfg.num_hidden_layers), "layers.{i}.")
    for (_, leaf), spec in layers.items():
        # layer_scalar is a torch buffer in the reference: never trained
        decl[("layers", leaf)] = dataclasses.replace(spec, frozen=True) if leaf == "layer_scalar" else spec
    decl.update(head_declaration(cfg))
    return decl


def init_params(cfg: Gemma4DraftConfig, rng: jax.Array, dtype=jnp.float32, *,
                embed_tokens: jax.Array | None = None, lm_head: jax.Array | None = None) -> dict:
    """Random drafter params; pass the target's ``embed_tokens`` / ``lm_head`` [H, V] to share them."""
    given = {path: x for path, x in ((("embed_tokens",), embed_tokens), (("lm_head",), lm_head))
             if x is not None}
    return params_lib.init_params(declare(cfg), rng, dtype, given=given)


def param_axes(cfg: Gemma4DraftConfig) -> dict:
    return params_lib.param_axes(declare(cfg))


def load_params(directory):
    """(config, numpy params) of a ``Gemma4DSparkModel`` checkpoint directory.

    TODO(merge): the family registry / convert package should own checkpoint loading.
    """
    import json
    from pathlib import Path

    directory = Path(directory)
    cfg = Gemma4DraftConfig.from_hf(json.loads((directory / "config.json").read_text()))
    decl = declare(cfg)
    return cfg, params_lib.from_torch(decl, tg.read_state(directory, decl))


# ----------------------------------------------------------------------------- backbone ops


def project_context(params: dict, cfg: Gemma4DraftConfig, target_features: jax.Array) -> jax.Array:
    """[B, S, n*H] tapped target features -> ctx [B, S, H] = hidden_norm(fc(x))."""
    x = target_features.astype(params["fc"].dtype) @ params["fc"]
    return tg.rms_norm(x, params["hidden_norm"], cfg.rms_norm_eps)


def _rope(cfg: Gemma4DraftConfig, positions: jax.Array, dtype):
    return tg.rope_cos_sin(positions, tg.group_rope(cfg.text, "full"), dtype)


def context_kv(params: dict, cfg: Gemma4DraftConfig, ctx: jax.Array, positions: jax.Array):
    """Per-layer k (k-normed, rotated) and v (v-normed) of ctx [B, S, H]: [Ld, B, Hkv, S, D] each
    (head-major, ``backbone.context_kv``)."""
    cos, sin = _rope(cfg, positions, ctx.dtype)
    b, s, _ = ctx.shape
    hkv, d, eps = cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def one_layer(p):
        k_raw = (ctx @ p["k_proj"]).reshape(b, s, hkv, d)
        v_raw = (ctx @ p["v_proj"]).reshape(b, s, hkv, d) if "v_proj" in p else k_raw
        return (nn.head_major(nn.apply_rope(tg.rms_norm(k_raw, p["k_norm"], eps), cos, sin)),
                nn.head_major(tg.rms_norm(v_raw, None, eps)))

    return backbone.map_layers(one_layer, params["layers"])


def embed_block(params: dict, cfg: Gemma4DraftConfig, ids: jax.Array) -> jax.Array:
    """Block input embeddings ``E[ids] * sqrt(H)``."""
    return tg.embed(params["embed_tokens"], ids)


def block_forward(params: dict, cfg: Gemma4DraftConfig, block_embeds: jax.Array, block_positions: jax.Array,
                  ctx_k: jax.Array, ctx_v: jax.Array, ctx_mask: jax.Array, block_valid: jax.Array,
                  remat: bool | str = False) -> jax.Array:
    """Same contract as ``backbone.block_forward``: blocks [B, N, G, H] -> hidden [B, N, G, H] (final-normed)."""
    b, n, g, h = block_embeds.shape
    cos, sin = _rope(cfg, block_positions.reshape(b, n * g), block_embeds.dtype)
    eps = cfg.rms_norm_eps
    visible = backbone.block_visibility(ctx_mask, block_valid, g)

    def layer(x, xs):
        p, k_ctx, v_ctx = xs
        hx = tg.rms_norm(x, p["input_layernorm"], eps).reshape(b, n * g, h)
        q, k, v = tg.project_qkv(hx, p, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps)
        q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
        split = lambda a: a.reshape(b, n, g, *a.shape[2:])
        attn = backbone._block_attention(split(q), split(k), split(v), k_ctx.astype(q.dtype),
                                         v_ctx.astype(q.dtype), visible, scale=1.0)
        return tg.sandwich(x, attn @ p["o_proj"], p, eps), None

    if remat not in (False, None, "none"):
        layer = jax.checkpoint(layer, policy=backbone.remat_policy(remat))
    x = backbone.over_layers(layer, block_embeds, params["layers"], ctx_k, ctx_v)
    return tg.rms_norm(x, params["norm"], eps)


def compute_logits(params: dict, cfg: Gemma4DraftConfig, hidden: jax.Array) -> jax.Array:
    """Softcapped LM-head logits [..., V] float32 (the Markov bias is added after this)."""
    logits = jnp.einsum("...h,hv->...v", hidden, params["lm_head"].astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    return tg.softcap(logits, cfg.final_logit_softcapping)


OPS = runtime.DraftRuntime(project_context=project_context, context_kv=context_kv,
                           block_forward=block_forward, embed_block=embed_block,
                           compute_logits=compute_logits,
                           replicable=frozenset({"kv_heads"}),  # 1 KV head: stays replicated
                           per_layer=True)  # per-layer layers on GPUs (params.for_platform; backbone.over_layers)

FAMILY = params_lib.Family(
    name="gemma4_dspark", kind="draft", architectures=(ARCHITECTURE,), model_types=tg.MODEL_TYPES,
    config_cls=Gemma4DraftConfig, declare=declare, forward=__name__, pairs_with="gemma4",
    runtime=OPS)


def training_forward(params: dict, cfg: Gemma4DraftConfig, *args, **kwargs) -> draft_model.TrainForward:
    """``draft.model.training_forward`` on the Gemma4 backbone (same arguments)."""
    return draft_model.training_forward(params, cfg, *args, ops=OPS, **kwargs)
