"""DeepSeek-V4's own MTP-1 module (``mtp.0.*`` of the original V4-Flash / -Pro checkpoints) as a
chain drafter: config, declaration, forward, and its ``runtime.Proposer`` (``draft.chain``).

Facts (``shared/reference/DEEPSEEK_V4.md``, "The MTP-1 module"; DeepSeek ``MTPBlock``, vLLM
``DeepSeekV4MultiTokenPredictorLayer``, SGLang ``DeepseekV4ModelNextN``), at module position t::

    e = enorm(embed(token t+1))                      the TARGET's embedding
    h = hnorm(x_t)  per stream                       x_t [N, H]: the target's last-layer residual
                                                     streams before its hc_head (not normed)
    z = e_proj(e) (broadcast over the N streams) + h_proj(h)
    y = one V4 block on z (mHC; sliding-window-only attention over the module's own KV, plain
        RoPE at position t, sinks; score-routed MoE with the selection-only bias + shared expert)
    logits = head(norm(hc_head(y)))                  the module's hc_head_* / norm, the TARGET's head

The block is the target's own layer code (``v4m.layer`` on ``layer_config``: one SLIDING / MOE
layer) over a ``V4Cache`` of that one layer (its window ring), so decoding and the whole-sequence
forward are the target's paths. MTP-k re-applies the module (vLLM, SGLang): draft step j+1 runs at
the next position on (y of step j, flattened [N * H] as x is, and the token step j drafted).
The token embedding at position 0 is kept (DeepSeek, SGLang; vLLM zeroes it).

Params: the ``mtp.0.*`` tensors under our names (``layers`` / ``moe`` stacked [1, ...] as the
target's, ``e_proj`` / ``h_proj`` [H, H] kernels, ``enorm`` / ``hnorm`` / ``norm``, ``hc_head``)
plus the target's ``embed`` / ``head`` (declared frozen, never written under ``mtp.``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax.draft import chain
from dspark_jax.errors import ConfigError
from dspark_jax.params import ParamSpec
from dspark_jax.target import deepseek_v4 as v4
from dspark_jax.target.deepseek_v4 import cache as v4_cache
from dspark_jax.target.deepseek_v4 import model as v4m
from dspark_jax.target.deepseek_v4.config import MOE, SLIDING, DeepseekV4Config

PREFIX = "mtp.0."
DSPARK_KEYS = ("dspark_block_size", "dspark_target_layer_ids")  # a DSpark module's marks (not MTP)
F32 = "float32"


@dataclasses.dataclass(frozen=True)
class DeepseekV4MTPConfig:
    """The MTP module of a V4 checkpoint: the target's config (the block has its geometry) and
    ``num_steps`` = k drafts per round (MTP-k; ``--draft-steps``), exposed as ``block_size``."""

    target: DeepseekV4Config
    num_steps: int = 1

    enable_confidence_head = False    # MTP has none: policies that need one are refused
    num_key_value_heads = 1           # one shared K = V head
    num_hidden_layers = 1

    def __post_init__(self):
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ConfigError(f"--draft-steps must be an integer >= 1, got {self.num_steps!r}")

    block_size = property(lambda self: self.num_steps)
    vocab_size = property(lambda self: self.target.vocab_size)
    hidden_size = property(lambda self: self.target.hidden_size)
    num_attention_heads = property(lambda self: self.target.num_attention_heads)
    head_dim = property(lambda self: self.target.head_dim)
    rms_norm_eps = property(lambda self: self.target.rms_norm_eps)
    max_position_embeddings = property(lambda self: self.target.max_position_embeddings)

    @property
    def layer_config(self) -> DeepseekV4Config:
        """The module's block as a one-layer V4 stack: sliding-window only, score-routed MoE."""
        return dataclasses.replace(self.target, num_hidden_layers=1, layer_types=(SLIDING,),
                                   mlp_layer_types=(MOE,), extra=())

    def replace(self, **changes) -> "DeepseekV4MTPConfig":
        return dataclasses.replace(self, **changes)

    def check_compatible(self, target) -> None:
        """ConfigError unless ``target`` is the V4 model the module was built on."""
        if not isinstance(target, DeepseekV4Config):
            raise ConfigError(f"V4's MTP module needs a DeepSeek-V4 target, got {type(target).__name__}")
        problems = [f"{k} {getattr(self.target, k)} != target {getattr(target, k)}"
                    for k in ("vocab_size", "hidden_size", "hc_mult") if getattr(self.target, k) != getattr(target, k)]
        if problems:
            raise ConfigError("MTP module and target do not fit together: " + "; ".join(problems))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DeepseekV4MTPConfig":
        """From a V4 config.json marking one MTP module (``num_nextn_predict_layers`` >= 1, no
        ``dspark_*`` keys; ``compress_ratios`` one entry past the layers, 0)."""
        if any(hf.get(k) is not None for k in DSPARK_KEYS):
            raise ConfigError("config.json: the dspark_* keys mark a DSpark module, not an MTP module")
        target = DeepseekV4Config.from_hf(hf)
        if int(hf.get("num_nextn_predict_layers") or 0) < 1:
            raise ConfigError("config.json: num_nextn_predict_layers is 0: the checkpoint has no MTP module")
        ratios, n = list(hf.get("compress_ratios") or ()), target.num_hidden_layers
        if ratios and (len(ratios) < n + 1 or ratios[n] != 0):
            raise ConfigError(f"config.json: compress_ratios has {len(ratios)} entries; a {n}-layer target "
                              f"with an MTP module has {n + 1}, the last 0")
        return cls(target=target)


def describe(hf: Mapping[str, Any], aside_names) -> dict[str, Any] | None:
    """What ``inspect`` shows of a V4 checkpoint's MTP module (None when it holds none: a DSpark
    module's keys, no ``num_nextn_predict_layers``, or no ``mtp.0.e_proj`` among ``aside_names``)."""
    if any(hf.get(k) is not None for k in DSPARK_KEYS) or PREFIX + "e_proj.weight" not in set(aside_names):
        return None
    cfg = DeepseekV4MTPConfig.from_hf(hf)
    t = cfg.target
    return {"layers": 1, "window": t.sliding_window, "heads": t.num_attention_heads, "hc_mult": t.hc_mult,
            "experts": f"{t.n_routed_experts} routed (top {t.num_experts_per_tok}) + 1 shared",
            "reads": "the target's last-layer residual streams before hc_head"}


# ----------------------------------------------------------------------------- declaration


def declare(cfg: DeepseekV4MTPConfig) -> dict[tuple, ParamSpec]:
    """Every parameter once: the block is the target's layer declaration (``v4.declare`` of
    ``layer_config``) renamed ``layers.0.`` -> ``mtp.0.``, ``norm`` / ``hc_head_*`` under
    ``mtp.0.``, e_proj / h_proj stored as the attention's projections are (FP8 in the released
    checkpoints); ``embed`` / ``head`` are the target's (frozen, not ``mtp.``)."""
    h = cfg.hidden_size
    stage = v4.declare(cfg.layer_config)
    proj = lambda name: ParamSpec((h, h), (None, "embed"), PREFIX + name + ".weight", transpose=True,  # noqa: E731
                                  quant=stage[("layers", "wq_a")].quant)
    norm = lambda name: ParamSpec((h,), (None,), PREFIX + name + ".weight", init="ones", dtype=F32)  # noqa: E731
    decl = {("embed",): dataclasses.replace(stage[("embed",)], frozen=True),
            ("head",): dataclasses.replace(stage[("head",)], frozen=True),
            ("e_proj",): proj("e_proj"), ("h_proj",): proj("h_proj"),
            ("enorm",): norm("enorm"), ("hnorm",): norm("hnorm")}
    for path, spec in stage.items():
        if path[0] in ("layers", "moe"):
            # the gate bias only selects experts: V4 sets it outside backprop (frozen, as the DSpark module's)
            decl[path] = dataclasses.replace(spec, torch="mtp." + spec.torch[len("layers."):],  # layer {i} = 0
                                             frozen=spec.frozen or path == ("moe", "bias"))
        elif path[0] in ("norm", "hc_head"):
            decl[path] = dataclasses.replace(spec, torch=PREFIX + spec.torch)
    return decl


def module_specs(cfg: DeepseekV4MTPConfig) -> dict[tuple, ParamSpec]:
    """The ``mtp.0.*`` part of ``declare`` (what the checkpoint stores for the module)."""
    return {p: s for p, s in declare(cfg).items() if s.torch.startswith("mtp.")}


def init_params(cfg: DeepseekV4MTPConfig, rng: jax.Array, dtype=jnp.float32, *,
                embed: jax.Array | None = None, head: jax.Array | None = None) -> dict:
    """Random module params; pass the target's ``embed`` / ``head`` to share them."""
    given = {path: x for path, x in ((("embed",), embed), (("head",), head)) if x is not None}
    return params_lib.init_params(declare(cfg), rng, dtype, given=given)


def shared_from_target(target_params: Mapping) -> dict:
    """The target arrays the module shares (``families.shared_with_target``)."""
    return {"embed": target_params["embed"], "head": target_params["head"]}


# ----------------------------------------------------------------------------- forward


def block_input(p: dict, cfg: DeepseekV4MTPConfig, hidden: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """z [B, T, N, H]: e_proj(enorm(embed(tokens))) on every stream + h_proj(hnorm(x)) per stream,
    hidden [B, T, N * H] (x: the target's streams, or the module's own y at an MTP-k step)."""
    b, t = tokens.shape
    n, h, eps = cfg.target.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
    e = v4m.rms_norm(p["embed"][tokens].astype(dtype), p["enorm"], eps) @ p["e_proj"].astype(dtype)
    x = v4m.rms_norm(hidden.reshape(b, t, n, h).astype(dtype), p["hnorm"], eps) @ p["h_proj"].astype(dtype)
    return e[:, :, None, :] + x


def forward(p: dict, cfg: DeepseekV4MTPConfig, hidden: jax.Array, tokens: jax.Array, cache=None, *,
            ctx: Any = None, span=None):
    """``chain.ChainModule.forward``: hidden [B, T, N * H] and tokens [B, T] (token t+1 of each
    position) -> (logits [B, T, V] float32, y [B, T, N * H] (the block's output streams, what
    an MTP-k step feeds back), delta). Without ``cache``: positions 0..T-1 causally (delta
    None); with one (a one-layer ``V4Cache``): positions ``cache.lengths + t``."""
    lcfg = cfg.layer_config
    dtype = v4m.forward_dtype(p, ctx)
    b, t = tokens.shape
    positions = jnp.arange(t) if cache is None else cache.lengths[:, None] + jnp.arange(t)[None]
    z = block_input(p, cfg, hidden, tokens, dtype)
    y, part = v4m.layer(lcfg, p, 0, z, tokens, positions, ctx, cache, span)
    out = v4m.rms_norm(v4m.hc_head(lcfg, p, y), p["norm"], cfg.rms_norm_eps)
    delta = None if cache is None else v4m.stack_delta(lcfg, cache, [part])
    return v4m.compute_logits(p, cfg.target, out), y.reshape(b, t, -1), delta


def init_cache(cfg: DeepseekV4MTPConfig, batch: int, capacity: int, dtype=jnp.float32, max_extend=None):
    """The module's cache: the window ring of its one layer (``V4Cache``, no compressors)."""
    return v4_cache.init_cache(cfg.layer_config, batch, capacity, dtype, max_extend)


MODULE = chain.ChainModule(init_cache=init_cache, lift=lambda p, cfg, features: features, forward=forward,
                           taps=lambda cfg: (v4m.STREAMS,), replicable=frozenset({"kv_heads"}))
PROPOSER = chain.proposer(MODULE, hidden_width=lambda cfg: cfg.target.hc_mult * cfg.hidden_size)

FAMILY = params_lib.Family(
    name="deepseek_v4_mtp", kind="draft", architectures=(), model_types=(),
    config_cls=DeepseekV4MTPConfig, declare=declare, forward=__name__, pairs_with="deepseek_v4",
    runtime=PROPOSER, shared_from_target=shared_from_target)
