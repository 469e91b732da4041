"""DeepSeek-V4.1's own DSpark module (``mtp.{s}.*`` inside a V4.1 checkpoint): config, declaration,
forward. V4's module (``draft.deepseek_v4``) with six differences (``shared/reference/DEEPSEEK_V4.md``,
"DeepSeek-V4.1"; the golden README's ``deepseek_v41_tiny`` section states the reference's choices)::

    taps   the mean over the streams ENTERING each ``dspark_target_layer_ids`` layer (its attention
           input, before its Engram), not the layer's output: runtime taps ("attn_in", i)
    stages V4.1 blocks (no per-head q norm, single-pass mHC: the pre-mix is carried from stage to
           stage, one-hot stream 0 into the first; FP8-rounded K = V as the trunk's)
    MoE    ``dspark_n_routed_experts`` experts, top ``dspark_num_experts_per_tok`` (the stages' own)
    head   no ``hc_head``: h = collapse(streams, the last stage's FFN pre-mix), then ``mtp.{S-1}.norm``
    Markov ``mtp.{S-1}.markov_head.embed`` / ``.head`` (our ``markov_w1`` / ``markov_w2``)
    keys   nested in ``text_config`` with the target's

Everything else is V4's module: main_x = main_norm(main_proj(taps)); each stage's context K = V
kv_norm(wkv_s(main_x)) rotated at its position (plain rope) and FP8-rounded, in a ring of the last
``sliding_window`` positions; block [anchor, noise x (G-1)] at positions a .. a+G-1 embedded with
the target's ``embed``, non-causal over the context and the block; base logits head(norm(h));
vanilla Markov bias; confidence proj . [h ; markov_w1[prev]] in float32. V4's functions are reused
where they read only these names (``project_context``, ``embed_block``, ``window_of``, the heads).

Shapes: B rows, N blocks, G = block_size, W window rows, H hidden, D head_dim, Ls stages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.draft import backbone, markov
from dspark_jax.draft import deepseek_v4 as dv4
from dspark_jax.errors import ConfigError
from dspark_jax.params import ParamSpec
from dspark_jax.target import deepseek_v41 as v41
from dspark_jax.target.deepseek_v4 import model as v4m
from dspark_jax.target.deepseek_v41 import model as v41m
from dspark_jax.target.deepseek_v41 import qat
from dspark_jax.target.deepseek_v41.config import DeepseekV41Config
from dspark_jax.target.deepseek_v41.declare import block_specs

KEYS = dv4.KEYS + ("dspark_n_routed_experts", "dspark_num_experts_per_tok")
F32 = "float32"
ATTN_IN = "attn_in"


@dataclasses.dataclass(frozen=True)
class DeepseekV41DSparkConfig:
    """The DSpark module of a V4.1 checkpoint: the target's config plus the ``dspark_*`` keys.
    ``tap_layers``: ``dspark_target_layer_ids`` (Flash [37, 38, 39]); ``target_layer_ids`` (what
    decode and training ask the target for) tags them ("attn_in", i)."""

    target: DeepseekV41Config
    tap_layers: tuple[int, ...]
    n_routed_experts: int = 128
    num_experts_per_tok: int = 3
    block_size: int = 5
    markov_rank: int = 256
    noise_token_id: int = 128799
    num_anchors: int = 512
    enable_confidence_head: bool = True

    markov_head_type = "vanilla"
    confidence_head_with_markov = True
    num_key_value_heads = 1

    def __post_init__(self):
        t = self.target
        object.__setattr__(self, "tap_layers", tuple(int(i) for i in self.tap_layers))
        ids = self.tap_layers
        if not ids or any(not 0 <= i < t.num_hidden_layers for i in ids):
            raise ConfigError(f"config.json: dspark_target_layer_ids {list(ids)} must name layers of the "
                              f"{t.num_hidden_layers}-layer target")
        if not 1 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ConfigError(f"config.json: dspark_num_experts_per_tok {self.num_experts_per_tok} must be in "
                              f"2 .. dspark_n_routed_experts ({self.n_routed_experts})")
        if self.block_size < 1 or self.markov_rank <= 0:
            raise ConfigError("config.json: dspark_block_size must be >= 1 and dspark_markov_rank > 0")
        if not 0 <= self.noise_token_id < t.vocab_size:
            raise ConfigError(f"config.json: dspark_noise_token_id {self.noise_token_id} is outside the vocabulary")

    target_layer_ids = property(lambda self: tuple((ATTN_IN, i) for i in self.tap_layers))
    vocab_size = property(lambda self: self.target.vocab_size)
    hidden_size = property(lambda self: self.target.hidden_size)
    num_attention_heads = property(lambda self: self.target.num_attention_heads)
    head_dim = property(lambda self: self.target.head_dim)
    rms_norm_eps = property(lambda self: self.target.rms_norm_eps)
    window = property(lambda self: self.target.sliding_window)
    num_hidden_layers = property(lambda self: len(self.tap_layers))
    num_target_layers = property(lambda self: self.target.num_hidden_layers)
    num_context_features = property(lambda self: len(self.tap_layers))
    max_position_embeddings = property(lambda self: self.target.max_position_embeddings)
    mask_token_id = property(lambda self: self.noise_token_id)
    has_markov = property(lambda self: True)
    confidence_uses_markov = property(lambda self: True)

    @property
    def stage_config(self) -> DeepseekV41Config:
        """The stages as a V4.1 stack: sliding window only, no Engram, the stages' experts."""
        n = self.num_hidden_layers
        return dataclasses.replace(
            self.target, num_hidden_layers=n, compress_ratios=(0,) * n, kv_source_layer_ids=(),
            index_source_layer_ids=(), candidate_source_layer_id=-1, engram_layer_ids=(), engram_num_embeddings=(),
            engram_token_map=None, n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok, extra=())

    def check_compatible(self, target) -> None:
        """ConfigError unless ``target`` is the V4.1 model this module was built on."""
        if not isinstance(target, DeepseekV41Config):
            raise ConfigError(f"V4.1's DSpark module needs a DeepSeek-V4.1 target, got {type(target).__name__}")
        problems = [f"{k} {getattr(self.target, k)} != target {getattr(target, k)}"
                    for k in ("vocab_size", "hidden_size", "hc_mult", "num_hidden_layers")
                    if getattr(self.target, k) != getattr(target, k)]
        if problems:
            raise ConfigError("DSpark module and target do not fit together: " + "; ".join(problems))

    def replace(self, **changes) -> "DeepseekV41DSparkConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target: DeepseekV41Config, **fields) -> "DeepseekV41DSparkConfig":
        """A module on ``target`` from a train config's ``draft`` fields: ``target_layer_ids`` (the
        layer ids whose attention inputs it reads) required; ``block_size``, ``markov_rank``,
        ``mask_token_id`` (the noise token), ``n_routed_experts``, ``num_experts_per_tok``,
        ``num_anchors``, ``enable_confidence_head``; one stage per tapped layer, V4's heads."""
        f = dict(fields)
        if "target_layer_ids" not in f:
            raise ConfigError("draft.target_layer_ids is required for a DeepSeek-V4.1 DSpark module")
        ids = tuple(i[1] if isinstance(i, (tuple, list)) else i for i in f.pop("target_layer_ids"))
        for key, want in {"num_hidden_layers": len(ids), "markov_head_type": cls.markov_head_type,
                          "confidence_head_with_markov": True}.items():
            if key in f and f.pop(key) != want:
                raise ConfigError(f"draft.{key} must be {want!r} for V4.1's DSpark module")
        if "mask_token_id" in f:
            f["noise_token_id"] = f.pop("mask_token_id")
        known = {"block_size", "markov_rank", "noise_token_id", "n_routed_experts", "num_experts_per_tok",
                 "num_anchors", "enable_confidence_head"}
        unknown = sorted(set(f) - known)
        if unknown:
            raise ConfigError(f"draft.{unknown[0]} is not a field of V4.1's DSpark module; known {sorted(known)}")
        return cls(target=target, tap_layers=ids, **f)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DeepseekV41DSparkConfig":
        """From a V4.1 config.json (the keys in ``text_config``; ConfigError naming a missing one)."""
        text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else hf
        missing = [k for k in KEYS if text.get(k) is None]
        if missing:
            raise ConfigError(f"config.json: no V4.1 DSpark module (field 'text_config.{missing[0]}' is missing)")
        target = DeepseekV41Config.from_hf(hf)
        stages = len(text["dspark_target_layer_ids"])
        if text.get("num_nextn_predict_layers", stages) != stages:
            raise ConfigError(f"config.json: num_nextn_predict_layers {text['num_nextn_predict_layers']} != "
                              f"{stages} dspark_target_layer_ids")
        return cls(target=target, tap_layers=tuple(text["dspark_target_layer_ids"]),
                   n_routed_experts=int(text["dspark_n_routed_experts"]),
                   num_experts_per_tok=int(text["dspark_num_experts_per_tok"]),
                   block_size=int(text["dspark_block_size"]), markov_rank=int(text["dspark_markov_rank"]),
                   noise_token_id=int(text["dspark_noise_token_id"]))

    def hf_fields(self) -> dict[str, Any]:
        """The ``text_config`` keys that mark and shape the module."""
        return {"dspark_block_size": self.block_size, "dspark_target_layer_ids": list(self.tap_layers),
                "dspark_markov_rank": self.markov_rank, "dspark_noise_token_id": self.noise_token_id,
                "dspark_n_routed_experts": self.n_routed_experts,
                "dspark_num_experts_per_tok": self.num_experts_per_tok,
                "num_nextn_predict_layers": self.num_hidden_layers,
                "compress_ratios": list(self.target.compress_ratios) + [0] * self.num_hidden_layers}

    def to_hf(self) -> dict[str, Any]:
        hf = self.target.to_hf()
        hf["text_config"].update(self.hf_fields())
        return hf


def describe(hf: Mapping[str, Any]) -> dict[str, Any]:
    """What ``inspect`` shows of a V4.1 config.json's DSpark module (``present`` False when absent)."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else hf
    if any(text.get(k) is None for k in KEYS):
        return {"present": False}
    cfg = DeepseekV41DSparkConfig.from_hf(hf)
    return {"present": True, "block_size": cfg.block_size, "target_layer_ids": list(cfg.tap_layers),
            "taps": "attention inputs", "stages": cfg.num_hidden_layers, "markov_rank": cfg.markov_rank,
            "heads": cfg.num_attention_heads, "window": cfg.window, "noise_token_id": cfg.noise_token_id,
            "experts": f"{cfg.n_routed_experts} routed (top {cfg.num_experts_per_tok}) + 1 shared"}


# ----------------------------------------------------------------------------- declaration


_MARKOV_NAMES = {"markov_w1.weight": "embed.weight", "markov_w2.weight": "head.weight"}


def declare(cfg: DeepseekV41DSparkConfig) -> dict[tuple, ParamSpec]:
    """Every parameter once: the stages are V4.1 blocks (``block_specs`` of ``stage_config`` under
    ``mtp.{i}.``, gate bias frozen as V4's); the last stage holds ``norm`` and the heads; ``embed``
    / ``head`` are the target's (frozen, not ``mtp.``)."""
    h, r, n = cfg.hidden_size, cfg.markov_rank, cfg.num_hidden_layers
    last = f"mtp.{n - 1}."
    target = v41.declare(cfg.target)
    stage = block_specs(cfg.stage_config, tuple(range(n)), cfg.n_routed_experts, "mtp.{i}.")
    decl = {("embed",): dataclasses.replace(target[("embed",)], frozen=True),
            ("head",): dataclasses.replace(target[("head",)], frozen=True),
            ("main_proj",): ParamSpec((n * h, h), (None, "embed"), "mtp.0.main_proj.weight", transpose=True,
                                      quant=stage["wq_a"].quant),
            ("main_norm",): ParamSpec((h,), (None,), "mtp.0.main_norm.weight", init="ones", dtype=F32),
            ("norm",): dataclasses.replace(target[("norm",)], torch=last + "norm.weight")}
    for k, spec in stage.items():
        decl[("layers", k)] = dataclasses.replace(spec, frozen=k in ("gate_bias", "gate_bias_vl"))
    for path, spec in params_lib.with_prefix(markov.declare(cfg), ("markov_head",), "").items():
        decl[path] = dataclasses.replace(spec, torch=last + "markov_head." + _MARKOV_NAMES[spec.torch])
    if cfg.enable_confidence_head:
        decl[("confidence_head", "kernel")] = ParamSpec((h + r, 1), (None, None), last + "confidence_head.proj.weight",
                                                        transpose=True)
    return decl


def module_specs(cfg: DeepseekV41DSparkConfig) -> dict[tuple, ParamSpec]:
    """The ``mtp.*`` part of ``declare`` (what the checkpoint stores for the module)."""
    return {p: s for p, s in declare(cfg).items() if s.torch.startswith("mtp.")}


def init_params(cfg: DeepseekV41DSparkConfig, rng: jax.Array, dtype=jnp.float32, *,
                embed: jax.Array | None = None, head: jax.Array | None = None) -> dict:
    """Random module params; pass the target's ``embed`` / ``head`` to share them."""
    given = {path: x for path, x in ((("embed",), embed), (("head",), head)) if x is not None}
    return params_lib.init_params(declare(cfg), rng, dtype, given=given)


# ----------------------------------------------------------------------------- forward


def context_kv(p: dict, cfg: DeepseekV41DSparkConfig, main_x: jax.Array, positions: jax.Array):
    """``runtime.DraftRuntime.context_kv``: every stage's context K = V FP8(rope(kv_norm(wkv(main_x))))
    at ``positions [B, S]`` (plain rope) as (k, v) [Ls, B, 1, S, D], the same array."""
    cos, sin = v4m.rope_table(cfg.target, positions, compressed=False)

    def one(lp):
        kv = v4m.rms_norm(main_x @ lp["wkv"], lp["kv_norm"], cfg.rms_norm_eps)
        return qat.window_kv(cfg.target, v4m.apply_rope(kv, cos, sin))

    kv = jax.lax.map(one, {"wkv": p["layers"]["wkv"], "kv_norm": p["layers"]["kv_norm"]})[:, :, None]
    return kv, kv


def _attention(cfg: DeepseekV41DSparkConfig, lp: dict, x: jax.Array, cos, sin, ctx: jax.Array,
               ctx_visible: jax.Array, shape: tuple) -> jax.Array:
    """One stage's attention: x [B, N*G, H] (normed) -> [B, N*G, H]; each block's queries see the
    context rows ctx [B, N, W, D] where ``ctx_visible [B, N, W]`` and its G own rows."""
    b, n, g, h = shape
    tcfg = cfg.stage_config
    _, q, kv = v41m.query_and_kv(tcfg, lp, x, cos, sin)
    per_block = lambda a: a.reshape(b * n, g, *a.shape[2:])  # noqa: E731
    keys = jnp.concatenate([ctx.astype(kv.dtype), kv.reshape(b, n, g, -1)], axis=2).reshape(b * n, -1, kv.shape[-1])
    mask = jnp.concatenate([ctx_visible, jnp.ones((b, n, g), bool)], axis=-1).reshape(b * n, 1, -1)
    y = v4m.attend(tcfg, lp, per_block(q), keys, jnp.broadcast_to(mask, (b * n, g, mask.shape[-1])),
                   per_block(cos), per_block(sin))
    return y.reshape(b, n * g, h)


def stages_forward(p: dict, cfg: DeepseekV41DSparkConfig, embeds: jax.Array, positions: jax.Array,
                   ctx: jax.Array, ctx_visible: jax.Array, remat: bool | str = False,
                   where: runtime.Context | None = None) -> jax.Array:
    """The stages over blocks: embeds [B, N, G, H] at positions [B, N, G]; ctx [Ls, B, N, W, D]
    visible where ``ctx_visible [B, N, W]`` -> h [B, N, G, H] = collapse(streams, the last stage's
    FFN pre-mix) (before ``norm``). ``where``: the ``runtime.Context`` the MoE runs on."""
    b, n, g, h = embeds.shape
    tcfg = cfg.stage_config
    cos, sin = v4m.rope_table(tcfg, positions.reshape(b, n * g), compressed=False)
    streams = jnp.broadcast_to(embeds.reshape(b, n * g, 1, h), (b, n * g, tcfg.hc_mult, h))

    def stage(carry, xs):
        streams, pre = carry
        lp, rows = xs
        attend = lambda x: _attention(cfg, lp, x, cos, sin, rows, ctx_visible, (b, n, g, h))  # noqa: E731
        return v41m.block(tcfg, lp, streams, pre, attend, where), None

    if remat not in (False, None, "none"):
        stage = jax.checkpoint(stage, policy=backbone.remat_policy(remat))
    (streams, pre), _ = jax.lax.scan(stage, (streams, v41m.first_pre_mix(streams)), (p["layers"], ctx))
    return v4m.collapse(pre, streams).reshape(b, n, g, h)


def block_forward(p: dict, cfg: DeepseekV41DSparkConfig, embeds: jax.Array, positions: jax.Array,
                  ctx_k: jax.Array, ctx_v: jax.Array, ctx_mask: jax.Array, block_valid: jax.Array,
                  remat: bool | str = False, where: runtime.Context | None = None) -> jax.Array:
    """``runtime.DraftRuntime.block_forward`` (as V4's module: each block windowed to its last W
    context rows) -> h [B, N, G, H] (pre-norm)."""
    del ctx_v
    rows, visible = dv4.window_of(ctx_k[:, :, 0], ctx_mask & block_valid[:, :, None], positions[:, :, 0], cfg.window)
    return stages_forward(p, cfg, embeds, positions, rows, visible, remat, where)


def ring_forward(p: dict, cfg: DeepseekV41DSparkConfig, embeds: jax.Array, positions: jax.Array,
                 k: jax.Array, v: None, visible: jax.Array) -> jax.Array:
    """``runtime.ContextRing.forward``: each row's block against its ring of context rows."""
    del v
    return stages_forward(p, cfg, embeds, positions, k, visible)


def _on(where: runtime.Context) -> runtime.DraftRuntime:
    return dataclasses.replace(OPS, block_forward=functools.partial(block_forward, where=where), bind=None)


OPS = runtime.DraftRuntime(project_context=dv4.project_context, context_kv=context_kv, embed_block=dv4.embed_block,
                           block_forward=block_forward, compute_logits=dv4.base_logits, block_heads=dv4.block_heads,
                           replicable=frozenset({"kv_heads"}),
                           ring=runtime.ContextRing(rows=lambda cfg: cfg.window, forward=ring_forward, shared_kv=True),
                           bind=_on)

FAMILY = params_lib.Family(
    name="deepseek_v41_dspark", kind="draft", architectures=(), model_types=(),
    config_cls=DeepseekV41DSparkConfig, declare=declare, forward=__name__, pairs_with="deepseek_v41",
    runtime=OPS, shared_from_target=dv4.shared_from_target)
