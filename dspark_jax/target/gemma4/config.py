"""Gemma4 text-decoder configs (``gemma4_text`` / ``gemma4_unified_text``, and the text model of
the multimodal wrappers): ``Gemma4TargetConfig`` from a config.json (either layout) and back, and
the torch-name prefix of a checkpoint's text weights."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dspark_jax.errors import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
GROUPS = (("sliding", SLIDING), ("full", FULL))
MODEL_TYPES = ("gemma4_text", "gemma4_unified_text")
TEXT_ARCHITECTURES = {"gemma4_text": "Gemma4ForCausalLM", "gemma4_unified_text": "Gemma4UnifiedForCausalLM"}
# Multimodal wrappers whose text weights sit under ``model.language_model.``.
MULTIMODAL = {"gemma4": "Gemma4ForConditionalGeneration",
              "gemma4_unified": "Gemma4UnifiedForConditionalGeneration"}
TEXT_PREFIX, MULTIMODAL_PREFIX = "model.", "model.language_model."
ACTIVATIONS = ("gelu_pytorch_tanh",)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Gemma4TargetConfig:
    """A Gemma4 text decoder.

    Sliding layers: ``head_dim``, ``num_key_value_heads``, default rotary (``sliding_rope_theta``).
    Full layers: ``global_head_dim``, ``full_num_key_value_heads`` (the global count under
    ``attention_k_eq_v``, as transformers), rotary ``full_rope_type`` ("proportional": only the
    first ``int(partial_rotary_factor * global_head_dim / 2)`` frequencies rotate).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    sliding_rope_theta: float = 1e4
    full_rope_theta: float = 1e6
    full_rope_type: str = "proportional"
    partial_rotary_factor: float = 0.25
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    model_type: str = "gemma4_unified_text"
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: Any = 1

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                     "sliding_window", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     f"Gemma4TargetConfig.{name} must be a positive int, got {value!r}")
        _require(len(self.layer_types) == self.num_hidden_layers,
                 f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        _require(not bad, f"layer_types: unknown {bad}; expected {SLIDING!r} or {FULL!r}")
        for kind, heads, dim in (("sliding", self.num_key_value_heads, self.head_dim),
                                 ("full", self.full_num_key_value_heads, self.global_head_dim)):
            _require(heads > 0 and self.num_attention_heads % heads == 0,
                     f"{kind} layers: num_attention_heads={self.num_attention_heads} is not a multiple "
                     f"of {heads} KV heads")
            _require(dim % 2 == 0, f"{kind} layers: head size {dim} must be even for rotary")
        _require(self.full_rope_type in ("default", "proportional"),
                 f"rope_parameters.full_attention.rope_type={self.full_rope_type!r} is not supported "
                 "('default' or 'proportional')")
        _require(0.0 <= self.partial_rotary_factor <= 1.0,
                 f"partial_rotary_factor={self.partial_rotary_factor} must be in [0, 1]")
        _require(self.hidden_activation in ACTIVATIONS,
                 f"hidden_activation={self.hidden_activation!r} is not supported; expected one of {ACTIVATIONS}")
        _require(self.final_logit_softcapping is None or self.final_logit_softcapping > 0,
                 "final_logit_softcapping must be > 0 or null")
        _require(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")
        _require(self.model_type in MODEL_TYPES, f"model_type={self.model_type!r}; expected one of {MODEL_TYPES}")

    @property
    def full_num_key_value_heads(self) -> int:
        """KV heads of full layers: num_global_key_value_heads under k = v (transformers' rule)."""
        if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def layer_ids(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

    def group_shape(self, group: str) -> tuple[int, int, bool]:
        """(KV heads, head size, has v_proj) of the ``"sliding"`` or ``"full"`` layers."""
        if group == "sliding":
            return self.num_key_value_heads, self.head_dim, True
        return self.full_num_key_value_heads, self.global_head_dim, not self.attention_k_eq_v

    def replace(self, **changes) -> "Gemma4TargetConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Gemma4TargetConfig":
        """From a ``gemma4_text`` / ``gemma4_unified_text`` config.json (or a multimodal one's text_config)."""
        if "text_config" in hf:
            hf = hf["text_config"]
        return cls(**gemma4_text_kwargs(hf, "target config.json"))

    def to_hf(self, architecture: str | None = None) -> dict[str, Any]:
        """The Hugging Face text config (``architectures``: the text CausalLM by default)."""
        return gemma4_text_fields(self, architecture or TEXT_ARCHITECTURES[self.model_type])


def _get(hf: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in hf:
        raise ConfigError(f"{where}: required field {key!r} is missing")
    return hf[key]


def gemma4_text_kwargs(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gemma4TargetConfig arguments from a Gemma4 text config dict; refuses unsupported features."""
    model_type = hf.get("model_type", "gemma4_unified_text")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not a Gemma4 text config; "
                          f"expected one of {MODEL_TYPES}")
    # transformers' gemma4_text defaults to per-layer inputs of size 256; unified has none.
    ple = hf.get("hidden_size_per_layer_input", 256 if model_type == "gemma4_text" else 0)
    for key, value, ok in (("hidden_size_per_layer_input", ple, not ple),
                           ("enable_moe_block", hf.get("enable_moe_block", False), not hf.get("enable_moe_block")),
                           ("num_kv_shared_layers", hf.get("num_kv_shared_layers", 0),
                            not hf.get("num_kv_shared_layers")),
                           ("attention_bias", hf.get("attention_bias", False), not hf.get("attention_bias")),
                           ("use_bidirectional_attention", hf.get("use_bidirectional_attention"),
                            hf.get("use_bidirectional_attention") != "all")):
        if not ok:
            raise ConfigError(f"{where}: {key}={value!r} is not supported for Gemma4")
    layers = int(_get(hf, "num_hidden_layers", where))
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers' default: 5 sliding : 1 full
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    rope = hf.get("rope_parameters") or {}
    sliding_rope = rope.get(SLIDING) or {"rope_type": "default", "rope_theta": 1e4}
    full_rope = rope.get(FULL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1e6}
    if sliding_rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}: rope_parameters.sliding_attention.rope_type="
                          f"{sliding_rope.get('rope_type')!r} is not supported (only 'default')")
    for name, params in (("sliding_attention", sliding_rope), ("full_attention", full_rope)):
        if float(params.get("factor", 1.0)) != 1.0:
            raise ConfigError(f"{where}: rope_parameters.{name}.factor={params['factor']} is not supported")
    softcap = hf.get("final_logit_softcapping")
    heads = int(_get(hf, "num_attention_heads", where))
    global_kv = hf.get("num_global_key_value_heads")
    return dict(
        vocab_size=int(_get(hf, "vocab_size", where)),
        hidden_size=int(_get(hf, "hidden_size", where)),
        intermediate_size=int(_get(hf, "intermediate_size", where)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim", 256)),
        global_head_dim=int(hf.get("global_head_dim", 512)),
        num_global_key_value_heads=None if global_kv is None else int(global_kv),
        attention_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
        layer_types=tuple(layer_types),
        sliding_window=int(_get(hf, "sliding_window", where)),
        sliding_rope_theta=float(sliding_rope.get("rope_theta", 1e4)),
        full_rope_theta=float(full_rope.get("rope_theta", 1e6)),
        full_rope_type=str(full_rope.get("rope_type", "default")),
        partial_rotary_factor=float(full_rope.get("partial_rotary_factor", 1.0)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        hidden_activation=str(hf.get("hidden_activation", "gelu_pytorch_tanh")),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        model_type=model_type,
        pad_token_id=hf.get("pad_token_id", 0),
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=_hashable(hf.get("eos_token_id", 1)),
    )


def _hashable(value):
    """Lists (e.g. several eos ids) as tuples, so configs stay hashable (jit static arguments)."""
    return tuple(value) if isinstance(value, list) else value


def gemma4_text_fields(cfg, architecture: str) -> dict[str, Any]:
    """The Hugging Face Gemma4 text-config fields of ``cfg`` (a target or drafter config)."""
    full_rope = {"rope_type": cfg.full_rope_type, "rope_theta": cfg.full_rope_theta}
    if cfg.full_rope_type == "proportional":
        full_rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    hf = {
        "architectures": [architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "global_head_dim": cfg.global_head_dim,
        "num_global_key_value_heads": cfg.num_global_key_value_heads,
        "attention_k_eq_v": cfg.attention_k_eq_v,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": cfg.sliding_rope_theta},
                            FULL: full_rope},
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "hidden_activation": cfg.hidden_activation,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "enable_moe_block": False,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
    }
    if cfg.model_type == "gemma4_unified_text":
        hf["use_bidirectional_attention"] = "vision"
    return hf


def checkpoint_prefix(hf: Mapping[str, Any]) -> str:
    """Torch-name prefix of the text weights: ``model.language_model.`` for multimodal checkpoints."""
    arch = (hf.get("architectures") or [""])[0]
    if "text_config" in hf or arch in MULTIMODAL.values() or hf.get("model_type") in MULTIMODAL:
        return MULTIMODAL_PREFIX
    return TEXT_PREFIX
