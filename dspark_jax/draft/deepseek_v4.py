"""DeepSeek-V4's own DSpark module (``mtp.{s}.*`` inside a V4 checkpoint): config, declaration, forward.

Facts (``shared/reference/DEEPSEEK_V4.md``, "The DSpark module inside the checkpoint"; read from
vLLM ``vllm/models/deepseek_v4/nvidia/dspark.py`` and SGLang
``python/sglang/srt/models/deepseek_v4_dspark.py``)::

    main_x = main_norm(main_proj(concat_l mean_streams(target layer l's output)))   l in target_layer_ids
    per stage s (a V4 block, compress ratio 0, score-routed MoE, mHC):
        context KV  kv_s[p] = rope_p(kv_norm_s(wkv_s(main_x[p])))      one shared K = V head
    block = [anchor, noise x (G-1)] at positions a .. a+G-1, embedded with the TARGET's embedding,
        broadcast to the hc streams; each stage's attention: every block query sees the context rows
        of positions max(0, a-W) .. a-1 (W = ``sliding_window``, 128 in the released models) and all G
        block rows (non-causal), plain RoPE (``rope_theta``), one learned sink per head
    h = hc_head(streams)                          (the last stage's ``hc_head_*``; pre-norm)
    base logits = head(norm(h))                   (the module's own ``mtp.{S-1}.norm``, the TARGET's head)
    logits_k = base_k + markov_w2 . markov_w1[x_{k-1}]     (vanilla, drafted left to right)
    confidence_k = sigmoid(proj . [h_k ; markov_w1[x_{k-1}]])   (no bias, float32)

The module has no embedding or head: ``embed`` / ``head`` in our params tree are the target's own
arrays (``with_target`` puts them in without copying; declared frozen with the target's tensor
names, never written under ``mtp.``). ``module_specs`` is the ``mtp.*`` part of the declaration
(what conversion reads and writes).

Training runs through ``draft.model.training_forward`` / ``training_hidden`` with ``OPS`` (the shared
labels, eval mask, anchor packing; this module's heads via ``DraftRuntime.block_heads``). Decoding
runs the generic drafter path (``draft.decode`` over ``OPS``) with ``OPS.ring``: each stage keeps only
its last W context rows, position p in slot p mod W, K = V stored once (what the engines keep);
``ring_forward`` attends to them (tests/test_deepseek_v4_dspark.py: equal to the training block).

Shapes: B rows, N blocks per row, G = block_size, S context rows, W window rows, H hidden,
nh heads of D = head_dim, N_hc = hc_mult streams, Ls stages, V vocab, r Markov rank.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.draft import backbone, confidence, markov
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import ConfigError
from dspark_jax.params import ParamSpec
from dspark_jax.target import deepseek_v4 as v4
from dspark_jax.target.deepseek_v4 import model as v4m
from dspark_jax.target.deepseek_v4.config import MOE, SLIDING, DeepseekV4Config

KEYS = ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_noise_token_id")
F32 = "float32"


@dataclasses.dataclass(frozen=True)
class DeepseekV4DSparkConfig:
    """The DSpark module of a V4 checkpoint: the target's config plus the ``dspark_*`` keys.

    One stage per entry of ``target_layer_ids`` (Flash [40, 41, 42], Pro [58, 59, 60]);
    ``noise_token_id`` fills the block after the anchor (128799 in the released models).
    """

    target: DeepseekV4Config
    target_layer_ids: tuple[int, ...]
    block_size: int = 5
    markov_rank: int = 256
    noise_token_id: int = 128799
    num_anchors: int = 512            # training only (anchors per sequence)
    enable_confidence_head: bool = True

    markov_head_type = "vanilla"      # the only Markov head V4's module has
    confidence_head_with_markov = True
    num_key_value_heads = 1           # one shared K = V head

    def __post_init__(self):
        t = self.target
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        ids = self.target_layer_ids
        if not ids or any(not 0 <= i < t.num_hidden_layers for i in ids):
            raise ConfigError(f"config.json: dspark_target_layer_ids {list(ids)} must name layers of the "
                              f"{t.num_hidden_layers}-layer target")
        if self.block_size < 1:
            raise ConfigError(f"config.json: dspark_block_size must be >= 1, got {self.block_size}")
        if self.markov_rank <= 0:  # both engines refuse a V4 DSpark module without the Markov head
            raise ConfigError(f"config.json: dspark_markov_rank must be > 0, got {self.markov_rank}")
        if not 0 <= self.noise_token_id < t.vocab_size:
            raise ConfigError(f"config.json: dspark_noise_token_id {self.noise_token_id} is outside the "
                              f"vocabulary (0..{t.vocab_size - 1})")

    # the attribute names the shared drafter code (blocks, markov, confidence, decode) reads
    vocab_size = property(lambda self: self.target.vocab_size)
    hidden_size = property(lambda self: self.target.hidden_size)
    num_attention_heads = property(lambda self: self.target.num_attention_heads)
    head_dim = property(lambda self: self.target.head_dim)
    rms_norm_eps = property(lambda self: self.target.rms_norm_eps)
    window = property(lambda self: self.target.sliding_window)
    num_hidden_layers = property(lambda self: len(self.target_layer_ids))   # stages
    num_target_layers = property(lambda self: self.target.num_hidden_layers)
    num_context_features = property(lambda self: len(self.target_layer_ids))
    max_position_embeddings = property(lambda self: self.target.max_position_embeddings)
    mask_token_id = property(lambda self: self.noise_token_id)
    has_markov = property(lambda self: self.markov_rank > 0)
    confidence_uses_markov = property(lambda self: self.markov_rank > 0)

    @property
    def stage_config(self) -> DeepseekV4Config:
        """The stages as a V4 stack: sliding-window only (compress ratio 0), score-routed MoE."""
        n = self.num_hidden_layers
        return dataclasses.replace(self.target, num_hidden_layers=n, layer_types=(SLIDING,) * n,
                                   mlp_layer_types=(MOE,) * n, extra=())

    def check_compatible(self, target) -> None:
        """ConfigError unless ``target`` is the V4 model this module was built on (its tokens,
        width, streams and depth, so the tapped layers exist)."""
        if not isinstance(target, DeepseekV4Config):
            raise ConfigError(f"V4's DSpark module needs a DeepSeek-V4 target, got {type(target).__name__}")
        mine = self.target
        problems = [f"{k} {getattr(mine, k)} != target {getattr(target, k)}"
                    for k in ("vocab_size", "hidden_size", "hc_mult", "num_hidden_layers")
                    if getattr(mine, k) != getattr(target, k)]
        if problems:
            raise ConfigError("DSpark module and target do not fit together: " + "; ".join(problems))

    def replace(self, **changes) -> "DeepseekV4DSparkConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target: DeepseekV4Config, **fields) -> "DeepseekV4DSparkConfig":
        """A module on ``target`` from the drafter fields a train config's ``draft`` section holds
        (``target_layer_ids`` required; ``block_size``, ``markov_rank``, ``mask_token_id`` = the noise
        token, ``num_anchors``, ``enable_confidence_head``); ``num_hidden_layers`` must be one stage
        per tapped layer and the heads V4's (vanilla Markov, confidence on Markov features)."""
        f = dict(fields)
        if "target_layer_ids" not in f:
            raise ConfigError("draft.target_layer_ids is required for a DeepSeek-V4 DSpark module")
        ids = tuple(f.pop("target_layer_ids"))
        fixed = {"num_hidden_layers": len(ids), "markov_head_type": cls.markov_head_type,
                 "confidence_head_with_markov": True}
        for key, want in fixed.items():
            if key in f and f.pop(key) != want:
                raise ConfigError(f"draft.{key} must be {want!r} for V4's DSpark module "
                                  f"(one stage per target layer, V4's heads)")
        if "mask_token_id" in f:
            f["noise_token_id"] = f.pop("mask_token_id")
        known = {"block_size", "markov_rank", "noise_token_id", "num_anchors", "enable_confidence_head"}
        unknown = sorted(set(f) - known)
        if unknown:
            raise ConfigError(f"draft.{unknown[0]} is not a field of V4's DSpark module; known "
                              f"{sorted(known | set(fixed) | {'target_layer_ids', 'mask_token_id'})}")
        return cls(target=target, target_layer_ids=ids, **f)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DeepseekV4DSparkConfig":
        """From a V4 config.json carrying the ``dspark_*`` keys (ConfigError naming a missing one)."""
        missing = [k for k in KEYS if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json: no DSpark module (field {missing[0]!r} is missing)")
        target = DeepseekV4Config.from_hf(hf)
        ratios = list(hf.get("compress_ratios") or ())
        n, stages = target.num_hidden_layers, len(hf["dspark_target_layer_ids"])
        if ratios and (len(ratios) != n + stages or any(ratios[n:])):
            raise ConfigError(f"config.json: compress_ratios has {len(ratios)} entries; a {n}-layer target "
                              f"with {stages} DSpark stages has {n + stages}, the last {stages} of them 0")
        # the keys modelled here leave the target's pass-through ``extra`` (written back by ``to_hf``)
        target = dataclasses.replace(target, extra=tuple(
            (k, v) for k, v in target.extra if k not in (*KEYS, "compress_ratios")))
        return cls(target=target, target_layer_ids=tuple(hf["dspark_target_layer_ids"]),
                   block_size=int(hf["dspark_block_size"]), markov_rank=int(hf["dspark_markov_rank"]),
                   noise_token_id=int(hf["dspark_noise_token_id"]))

    def hf_fields(self) -> dict[str, Any]:
        """The config.json keys that mark and shape the module (merged over the target's)."""
        return {"dspark_block_size": self.block_size, "dspark_target_layer_ids": list(self.target_layer_ids),
                "dspark_markov_rank": self.markov_rank, "dspark_noise_token_id": self.noise_token_id,
                "compress_ratios": list(self.target.compress_ratios) + [0] * self.num_hidden_layers}

    def to_hf(self) -> dict[str, Any]:
        """The whole V4 config.json (target keys + ``hf_fields``)."""
        hf = self.target.to_hf()
        hf.update(self.hf_fields())
        return hf


def describe(hf: Mapping[str, Any]) -> dict[str, Any]:
    """What ``inspect`` shows of a V4 config.json's DSpark module (``present`` False when absent)."""
    if any(hf.get(k) is None for k in KEYS):
        return {"present": False}
    cfg = DeepseekV4DSparkConfig.from_hf(hf)
    return {"present": True, "block_size": cfg.block_size, "target_layer_ids": list(cfg.target_layer_ids),
            "stages": cfg.num_hidden_layers, "markov_rank": cfg.markov_rank, "heads": cfg.num_attention_heads,
            "window": cfg.window, "noise_token_id": cfg.noise_token_id,
            "experts": f"{cfg.target.n_routed_experts} routed (top {cfg.target.num_experts_per_tok}) + 1 shared"}


# ----------------------------------------------------------------------------- declaration


def declare(cfg: DeepseekV4DSparkConfig) -> dict[tuple, ParamSpec]:
    """Every parameter once: the stages are the target's own layer declaration (``v4.declare`` of
    ``stage_config``) renamed ``layers.{i}.`` -> ``mtp.{i}.``; the last stage holds ``norm``,
    ``hc_head_*`` and the heads; ``embed`` / ``head`` are the target's (frozen, not ``mtp.``)."""
    h, r, n = cfg.hidden_size, cfg.markov_rank, cfg.num_hidden_layers
    last = f"mtp.{n - 1}."
    stage = v4.declare(cfg.stage_config)
    decl = {("embed",): dataclasses.replace(stage[("embed",)], frozen=True),
            ("head",): dataclasses.replace(stage[("head",)], frozen=True),
            ("main_proj",): ParamSpec((n * h, h), (None, "embed"), "mtp.0.main_proj.weight", transpose=True,
                                      quant=stage[("layers", "wq_a")].quant),
            ("main_norm",): ParamSpec((h,), (None,), "mtp.0.main_norm.weight", init="ones", dtype=F32)}
    for path, spec in stage.items():
        if path[0] in ("layers", "moe"):
            # the gate bias only selects experts (no gradient reaches it) and is V4's aux-loss-free
            # balance term, set outside backprop: training keeps the checkpoint's (frozen)
            decl[path] = dataclasses.replace(spec, torch="mtp." + spec.torch[len("layers."):],
                                             frozen=spec.frozen or path == ("moe", "bias"))
        elif path[0] in ("norm", "hc_head"):
            decl[path] = dataclasses.replace(spec, torch=last + spec.torch)
    decl.update(params_lib.with_prefix(markov.declare(cfg), ("markov_head",), last + "markov_head."))
    if cfg.enable_confidence_head:
        decl[("confidence_head", "kernel")] = ParamSpec((h + r, 1), (None, None), last + "confidence_head.proj.weight",
                                                        transpose=True)
    return decl


def module_specs(cfg: DeepseekV4DSparkConfig) -> dict[tuple, ParamSpec]:
    """The ``mtp.*`` part of ``declare`` (what the checkpoint stores for the module)."""
    return {p: s for p, s in declare(cfg).items() if s.torch.startswith("mtp.")}


def init_params(cfg: DeepseekV4DSparkConfig, rng: jax.Array, dtype=jnp.float32, *,
                embed: jax.Array | None = None, head: jax.Array | None = None) -> dict:
    """Random module params (std 0.02; norms and mHC scales 1; gate bias 0); pass the target's
    ``embed`` [V, H] / ``head`` [H, V] to share them."""
    given = {path: x for path, x in ((("embed",), embed), (("head",), head)) if x is not None}
    return params_lib.init_params(declare(cfg), rng, dtype, given=given)


def with_target(params: Mapping, target_params: Mapping) -> dict:
    """The module's params with the target's ``embed`` and ``head`` (the same arrays, no copy)."""
    return {**params, **shared_from_target(target_params)}


def shared_from_target(target_params: Mapping) -> dict:
    """``init_params`` keywords of a fresh module on a target (``families.shared_with_target``)."""
    return {"embed": target_params["embed"], "head": target_params["head"]}


def param_axes(cfg: DeepseekV4DSparkConfig) -> dict:
    return params_lib.param_axes(declare(cfg))


# ----------------------------------------------------------------------------- forward pieces


def project_context(p: dict, cfg: DeepseekV4DSparkConfig, features: jax.Array) -> jax.Array:
    """Tapped target features [B, S, n*H] (stream means, ``target_layer_ids`` order) -> main_x [B, S, H]."""
    x = features.astype(p["main_proj"].dtype) @ p["main_proj"]
    return v4m.rms_norm(x, p["main_norm"], cfg.rms_norm_eps)


def context_rows(p: dict, cfg: DeepseekV4DSparkConfig, main_x: jax.Array, positions: jax.Array) -> jax.Array:
    """Every stage's context K = V rows kv_norm(wkv(main_x)) rotated at ``positions [B, S]``: [Ls, B, S, D]."""
    cos, sin = v4m.rope_table(cfg.target, positions, compressed=False)

    def one(lp):
        return v4m.apply_rope(v4m.rms_norm(main_x @ lp["wkv"], lp["kv_norm"], cfg.rms_norm_eps), cos, sin)

    return jax.lax.map(one, {"wkv": p["layers"]["wkv"], "kv_norm": p["layers"]["kv_norm"]})


def context_kv(p: dict, cfg: DeepseekV4DSparkConfig, main_x: jax.Array, positions: jax.Array):
    """``runtime.DraftRuntime.context_kv``: (k, v) [Ls, B, 1, S, D] (head-major, one K = V head),
    the same array."""
    kv = context_rows(p, cfg, main_x, positions)[:, :, None]
    return kv, kv


def embed_block(p: dict, cfg: DeepseekV4DSparkConfig, ids: jax.Array) -> jax.Array:
    """Block input embeddings: the target's embedding rows ``embed[ids]``."""
    return p["embed"][ids]


def _attention(cfg: DeepseekV4DSparkConfig, lp: dict, x: jax.Array, cos, sin, ctx: jax.Array,
               ctx_visible: jax.Array) -> jax.Array:
    """One stage's attention: x [B, N, G, H] (normed) -> [B, N, G, H]. Queries and the block's own
    K = V rows as the target's attention (``v4m.query_and_kv``: q-LoRA, per-head RMSNorm, RoPE on
    the last r dims at cos / sin [B, N*G, r/2]); each block's queries see the context rows ctx
    [B, N, W, D] where ``ctx_visible [B, N, W]`` and all G rows of their block (``v4m.attend``
    per block: one softmax with the head's sink, inverse rotation, grouped output projection)."""
    b, n, g, h = x.shape
    tcfg = cfg.stage_config
    _, q, kv = v4m.query_and_kv(tcfg, lp, x.reshape(b, n * g, h), cos, sin)
    per_block = lambda a: a.reshape(b * n, g, *a.shape[2:])  # noqa: E731
    keys = jnp.concatenate([ctx.astype(kv.dtype), kv.reshape(b, n, g, -1)], axis=2).reshape(b * n, -1, kv.shape[-1])
    mask = jnp.concatenate([ctx_visible, jnp.ones((b, n, g), bool)], axis=-1).reshape(b * n, 1, -1)
    y = v4m.attend(tcfg, lp, per_block(q), keys, jnp.broadcast_to(mask, (b * n, g, mask.shape[-1])),
                   per_block(cos), per_block(sin))
    return y.reshape(b, n, g, h)


def stages_forward(p: dict, cfg: DeepseekV4DSparkConfig, embeds: jax.Array, positions: jax.Array,
                   ctx: jax.Array, ctx_visible: jax.Array, remat: bool | str = False,
                   where: runtime.Context | None = None) -> jax.Array:
    """The stages over blocks: embeds [B, N, G, H] at positions [B, N, G]; ctx [Ls, B, N, W, D] (each
    block's window of context rows) visible where ``ctx_visible [B, N, W]`` -> h [B, N, G, H], the
    ``hc_head`` collapse (before ``norm``). Each stage is a V4 layer (``v4m.hc_weights`` / ``collapse``
    / ``expand`` around attention and the score-routed MoE, ``v4m.route`` / ``v4m.moe``); ``remat`` as
    ``backbone.block_forward``'s (per stage). ``where``: the ``runtime.Context`` the MoE dispatch
    runs on (its mesh's ``expert`` axis: expert-parallel ``shard_map``, as the target's); None:
    one device (or whatever XLA's partitioner makes of it).

    MoE training: the router is the target's kind (top-k of sqrt(softplus) scores plus the gate
    bias); the gradient reaches the gate weights through the chosen experts' renormalised scores,
    not through the selection; the bias is frozen (V4 balances load by adjusting it outside
    backprop, no auxiliary loss) and no load-balance term is added to the DSpark loss."""
    b, n, g, h = embeds.shape
    tcfg, eps = cfg.stage_config, cfg.rms_norm_eps
    cos, sin = v4m.rope_table(tcfg, positions.reshape(b, n * g), compressed=False)
    streams = jnp.broadcast_to(embeds.reshape(b, n * g, 1, h), (b, n * g, tcfg.hc_mult, h))

    def stage(streams, xs):  # one V4 layer; lax.scan over the stacked stages
        lp, bias, rows = xs
        pre, post, comb = v4m.hc_weights(tcfg, streams, lp["hc_attn_fn"], lp["hc_attn_base"], lp["hc_attn_scale"])
        x = v4m.rms_norm(v4m.collapse(pre, streams), lp["attn_norm"], eps).reshape(b, n, g, h)
        y = _attention(cfg, lp, x, cos, sin, rows, ctx_visible).reshape(b, n * g, h)
        streams = v4m.expand(post, comb, y, streams)
        pre, post, comb = v4m.hc_weights(tcfg, streams, lp["hc_ffn_fn"], lp["hc_ffn_base"], lp["hc_ffn_scale"])
        x = v4m.rms_norm(v4m.collapse(pre, streams), lp["ffn_norm"], eps)
        combine = v4m.route(tcfg, lp, x, None, None, bias)
        return v4m.expand(post, comb, v4m.moe(tcfg, lp, x, combine, where), streams), None

    if remat not in (False, None, "none"):
        stage = jax.checkpoint(stage, policy=backbone.remat_policy(remat))
    streams, _ = jax.lax.scan(stage, streams, (p["layers"], p["moe"]["bias"], ctx))
    return v4m.hc_head(tcfg, p, streams).reshape(b, n, g, h)


def window_of(ctx_rows: jax.Array, ctx_mask: jax.Array, anchors: jax.Array, window: int):
    """Each block's context window from full per-position rows: ctx_rows [Ls, B, S, D] (row j =
    position j), ctx_mask [B, N, S], anchors [B, N] -> (rows [Ls, B, N, W, D], visible [B, N, W]):
    positions a - W .. a - 1 that exist and ``ctx_mask`` allows."""
    s = ctx_rows.shape[2]
    idx = anchors[:, :, None] - window + jnp.arange(window, dtype=jnp.int32)          # [B, N, W]
    safe = jnp.clip(idx, 0, s - 1)
    visible = (idx >= 0) & jnp.take_along_axis(ctx_mask, safe, axis=2)
    rows = jax.vmap(lambda r: jnp.take_along_axis(r[:, None], safe[..., None], axis=2))(ctx_rows)
    return rows, visible


def block_forward(p: dict, cfg: DeepseekV4DSparkConfig, embeds: jax.Array, positions: jax.Array,
                  ctx_k: jax.Array, ctx_v: jax.Array, ctx_mask: jax.Array, block_valid: jax.Array,
                  remat: bool | str = False, where: runtime.Context | None = None) -> jax.Array:
    """``runtime.DraftRuntime.block_forward``: context rows indexed by position (ctx_k = ctx_v
    [Ls, B, 1, S, D]; ``ctx_mask [B, N, S]`` rows < anchor), each block windowed to its last W rows;
    returns h [B, N, G, H] (pre-norm). ``where``: as ``stages_forward``'s (``OPS.on(ctx)`` sets it)."""
    del ctx_v
    rows, visible = window_of(ctx_k[:, :, 0], ctx_mask & block_valid[:, :, None], positions[:, :, 0], cfg.window)
    return stages_forward(p, cfg, embeds, positions, rows, visible, remat, where)


def base_logits(p: dict, cfg: DeepseekV4DSparkConfig, h: jax.Array) -> jax.Array:
    """head(norm(h)): h [..., H] (pre-norm, ``stages_forward``) -> [..., V] float32."""
    return v4m.compute_logits(p, cfg.target, v4m.rms_norm(h, p["norm"], cfg.rms_norm_eps))


def confidence_logits(p: dict, cfg: DeepseekV4DSparkConfig, h: jax.Array, prev: jax.Array) -> jax.Array:
    """proj . [h ; markov_w1[prev]] in float32 (no bias): h [..., H], prev [...] -> [...]."""
    return confidence.logits(p, cfg, h.astype(jnp.float32), prev)


def block_heads(p: dict, cfg: DeepseekV4DSparkConfig, h: jax.Array, prev: jax.Array,
                target_hidden: jax.Array | None = None):
    """(draft logits [..., G, V] with the Markov bias of the true previous tokens, confidence logits
    [..., G] or None, aligned target logits [..., G, V] = target head(target hidden) or None)."""
    logits = markov.teacher_forced(p["markov_head"], cfg, base_logits(p, cfg, h), prev, h)
    conf = confidence_logits(p, cfg, h, prev) if cfg.enable_confidence_head else None
    aligned = v4m.compute_logits(p, cfg.target, target_hidden) if target_hidden is not None else None
    return logits, conf, aligned


def _on(where: runtime.Context) -> runtime.DraftRuntime:
    """``OPS`` whose stages run their MoE on ``where`` (its mesh: expert-parallel)."""
    return dataclasses.replace(OPS, block_forward=functools.partial(block_forward, where=where), bind=None)


def ring_forward(p: dict, cfg: DeepseekV4DSparkConfig, embeds: jax.Array, positions: jax.Array,
                 k: jax.Array, v: None, visible: jax.Array) -> jax.Array:
    """``runtime.ContextRing.forward``: each row's one block (embeds [B, 1, G, H] at positions
    [B, 1, G]) against its ring of context rows k [Ls, B, 1, W, D] (one K = V head, slot p mod W,
    rotated at p) where ``visible [B, 1, W]`` -> h [B, 1, G, H] (pre-norm)."""
    del v
    return stages_forward(p, cfg, embeds, positions, k, visible)   # the K = V head axis is the block axis (N = 1)


OPS = runtime.DraftRuntime(project_context=project_context, context_kv=context_kv, embed_block=embed_block,
                           block_forward=block_forward, compute_logits=base_logits, block_heads=block_heads,
                           replicable=frozenset({"kv_heads"}),
                           ring=runtime.ContextRing(rows=lambda cfg: cfg.window, forward=ring_forward, shared_kv=True),
                           bind=_on)


def training_forward(params: dict, cfg: DeepseekV4DSparkConfig, input_ids: jax.Array, features: jax.Array,
                     loss_mask: jax.Array, anchors: jax.Array, keep: jax.Array,
                     target_last_hidden: jax.Array | None = None,
                     compute_dtype=jnp.float32) -> draft_model.TrainForward:
    """``draft_model.training_forward`` with this family's ``OPS`` (the same labels, eval mask and
    anchor packing as the other families; this module's heads): input_ids [B, S]; features
    [B, S, n*H] (stream means of the tapped layers); loss_mask [B, S]; anchors, keep [B, N];
    target_last_hidden [B, S, H] (after the target's norm) or None."""
    return draft_model.training_forward(params, cfg, input_ids, features, loss_mask, anchors, keep,
                                        target_last_hidden, compute_dtype, ops=OPS)


FAMILY = params_lib.Family(
    name="deepseek_v4_dspark", kind="draft", architectures=(), model_types=(),
    config_cls=DeepseekV4DSparkConfig, declare=declare, forward=__name__, pairs_with="deepseek_v4",
    runtime=OPS, shared_from_target=shared_from_target)
