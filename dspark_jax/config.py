"""Frozen, validated configs for the target LM and the DSpark drafter.

Both read and write Hugging Face ``config.json`` dictionaries, so a checkpoint
directory converts to a config and back without losing the fields that
PyTorch loaders (transformers, the DeepSpec reference, vLLM) need.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
RELEASED_KINDS = ("dspark", "dflash", "eagle3")  # the released drafter shapes (``presets.released_drafter``)


from dspark_jax.errors import ConfigError, require_positive_int  # noqa: E402  (ConfigError re-exported)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """rope_theta from either the flat (transformers 4) or nested (5) layout."""
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    if "rope_theta" not in params:
        raise ConfigError("config.json has neither 'rope_theta' nor 'rope_parameters.rope_theta'")
    return float(params["rope_theta"])


def _get(hf: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in hf:
        raise ConfigError(f"{where}: required field {key!r} is missing")
    return hf[key]


def _qwen3_hf_kwargs(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Constructor arguments shared by TargetConfig and DraftConfig, from a HF config dict."""
    heads = int(_get(hf, "num_attention_heads", where))
    hidden = int(_get(hf, "hidden_size", where))
    return dict(
        vocab_size=int(_get(hf, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_get(hf, "intermediate_size", where)),
        num_hidden_layers=int(_get(hf, "num_hidden_layers", where)),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
    )


def _qwen3_hf_fields(cfg, architecture: str, *, tie_word_embeddings: bool) -> dict[str, Any]:
    """The Hugging Face Qwen3 config fields shared by targets and drafters."""
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
    }


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A Qwen3 causal LM (the frozen target).

    Shapes: embeddings [vocab_size, hidden_size]; attention with
    num_attention_heads query heads and num_key_value_heads KV heads of head_dim.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            require_positive_int(getattr(self, name), f"TargetConfig.{name}", ConfigError)
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        _require(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        _require(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")
        _require(self.rope_theta > 0, "rope_theta must be > 0")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "TargetConfig":
        """From a Hugging Face Qwen3 ``config.json`` dict (text config of multimodal ones)."""
        if "text_config" in hf:
            hf = hf["text_config"]
        arch = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type not in ("qwen3", None) or (arch and arch[0] not in ("Qwen3ForCausalLM", "Qwen3Model")):
            raise ConfigError(
                f"unsupported target architecture {arch or model_type!r}: only Qwen3ForCausalLM "
                "(model_type 'qwen3') is supported")
        if hf.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported for Qwen3 targets")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf.get('hidden_act')!r} is not supported (only 'silu')")
        return cls(**_qwen3_hf_kwargs(hf, "target config.json"),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))

    def to_hf(self) -> dict[str, Any]:
        return _qwen3_hf_fields(self, "Qwen3ForCausalLM", tie_word_embeddings=self.tie_word_embeddings)


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """The DSpark drafter: a backbone of ``num_hidden_layers`` Qwen3-shaped layers.

    ``block_size`` is gamma (anchor + gamma-1 masks, gamma logits);
    ``target_layer_ids`` index the target's decoder-layer outputs (-1: embeddings);
    ``markov_rank`` 0 disables the Markov head (DFlash).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 7
    mask_token_id: int = 0
    num_anchors: int = 512
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.enable_confidence_head:  # meaningless without the head; keep configs comparable
            object.__setattr__(self, "confidence_head_with_markov", False)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_target_layers",
                     "block_size", "num_anchors", "max_position_embeddings"):
            require_positive_int(getattr(self, name), f"DraftConfig.{name}", ConfigError)
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        _require(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        ids = self.target_layer_ids
        _require(len(ids) > 0, "target_layer_ids must not be empty")
        for prev, cur in zip(ids, ids[1:]):
            _require(cur > prev, f"target_layer_ids must be strictly increasing, got {list(ids)}")
        last = self.num_target_layers - 1
        for i in ids:
            _require(i == -1 or 0 <= i <= last,
                     f"target_layer_id {i} is out of range {{-1}} U [0, {last}] "
                     f"for num_target_layers={self.num_target_layers}")
        _require(last not in ids,
                 f"target_layer_ids must not include the target's final decoder layer {last}: "
                 "Hugging Face stores that entry post-norm; use an earlier layer")
        _require(0 <= self.mask_token_id < self.vocab_size,
                 f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        _require(isinstance(self.markov_rank, int) and self.markov_rank >= 0,
                 f"markov_rank must be an int >= 0, got {self.markov_rank!r}")
        _require(self.markov_head_type in MARKOV_HEAD_TYPES,
                 f"markov_head_type={self.markov_head_type!r} is unknown; expected one of {MARKOV_HEAD_TYPES}")
        _require(not (self.enable_confidence_head and self.confidence_head_with_markov
                      and self.markov_rank == 0),
                 "confidence_head_with_markov=true needs a Markov head (markov_rank > 0); "
                 "set confidence_head_with_markov=false for a DFlash drafter")

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def confidence_uses_markov(self) -> bool:
        return self.enable_confidence_head and self.confidence_head_with_markov and self.has_markov

    def replace(self, **changes) -> "DraftConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target: TargetConfig, **kwargs) -> "DraftConfig":
        """A drafter sharing the target's width, heads and vocabulary."""
        base = dict(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            num_target_layers=target.num_hidden_layers,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
        )
        base.update(kwargs)
        return cls(**base)

    def check_compatible(self, target: TargetConfig) -> None:
        """Raise ConfigError unless this drafter can read ``target``'s features and tokens."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target {target.hidden_size}")
        if self.num_target_layers != target.num_hidden_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target "
                            f"num_hidden_layers {target.num_hidden_layers}")
        bad = [i for i in self.target_layer_ids if i >= target.num_hidden_layers - 1]
        if bad:
            problems.append(f"target_layer_ids {bad} are not usable decoder layers of a "
                            f"{target.num_hidden_layers}-layer target")
        if problems:
            raise ConfigError("drafter and target do not fit together: " + "; ".join(problems))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DraftConfig":
        """From a DSpark ``config.json`` (architectures ["Qwen3DSparkModel"])."""
        arch = hf.get("architectures") or []
        if arch and arch[0] != "Qwen3DSparkModel":
            raise ConfigError(f"unsupported drafter architecture {arch[0]!r}: expected 'Qwen3DSparkModel'")
        where = "drafter config.json"
        rank = int(_get(hf, "markov_rank", where))
        conf = bool(_get(hf, "enable_confidence_head", where))
        if rank > 0 and "markov_head_type" not in hf:
            raise ConfigError(f"{where}: markov_head_type is required when markov_rank > 0")
        if conf and "confidence_head_with_markov" not in hf:
            raise ConfigError(f"{where}: confidence_head_with_markov is required when "
                              "enable_confidence_head is true")
        return cls(
            **_qwen3_hf_kwargs(hf, where),
            num_target_layers=int(_get(hf, "num_target_layers", where)),
            target_layer_ids=tuple(_get(hf, "target_layer_ids", where)),
            block_size=int(_get(hf, "block_size", where)),
            mask_token_id=int(_get(hf, "mask_token_id", where)),
            num_anchors=int(_get(hf, "num_anchors", where)),
            markov_rank=rank,
            markov_head_type=str(hf.get("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=conf,
            confidence_head_with_markov=bool(hf.get("confidence_head_with_markov", False)) if conf else False,
        )

    def to_hf(self) -> dict[str, Any]:
        hf = _qwen3_hf_fields(self, "Qwen3DSparkModel", tie_word_embeddings=False)
        hf.update(dspark_hf_fields(self))
        return hf


def dspark_hf_fields(cfg) -> dict[str, Any]:
    """The DSpark keys of a drafter's ``config.json`` (any family), as the reference writes them."""
    hf = {
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_anchors": cfg.num_anchors,
        "enable_confidence_head": cfg.enable_confidence_head,
        "markov_rank": cfg.markov_rank,
    }
    if cfg.enable_confidence_head:
        hf["confidence_head_with_markov"] = cfg.confidence_head_with_markov
    if cfg.markov_rank > 0:
        hf["markov_head_type"] = cfg.markov_head_type
    return hf


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Weights of the DSpark loss: cross-entropy, L1 to the target distribution, confidence BCE, position decay."""

    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    loss_decay_gamma: float = 4.0

    def __post_init__(self):
        for name in ("ce_weight", "l1_weight", "confidence_weight"):
            _require(getattr(self, name) >= 0, f"LossConfig.{name} must be >= 0")
        _require(self.loss_decay_gamma > 0, "loss_decay_gamma must be > 0")
