"""Eagle3 drafter configs (DeepSpec's ``Qwen3Eagle3Model`` / ``Gemma4Eagle3Model`` config.json).

A DeepSpec Eagle3 config is the target's text config as ``build_draft_config`` edits it (one
decoder layer, all ``full_attention``, untied head) plus the Eagle3 keys: ``num_target_layers``,
``target_layer_ids`` (exactly 5 strictly increasing tapped layers, never the last),
``ttt_length`` (test-time-training steps; also the default chain length when decoding),
``step_loss_decay`` (step k's loss weight is decay^k) and ``draft_num_hidden_layers`` (1).
``text`` holds the drafter's own one-layer text config (a Qwen3 ``TargetConfig`` or a
``Gemma4TargetConfig``); the attribute names generic drafter code reads are forwarded to it.
``num_steps`` (not stored in config.json): tokens proposed per decode round, default
``ttt_length``; decode reads it as ``block_size``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dspark_jax.config import TargetConfig, _get, _qwen3_hf_fields, _qwen3_hf_kwargs
from dspark_jax.errors import ConfigError
from dspark_jax.target import gemma4 as tg

NUM_TAPS = 5  # DeepSpec's Eagle3: fc reads exactly five tapped target layers
KIND = "eagle3"


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """One Eagle3 drafter (see the module docstring); subclassed once per target family."""

    text: Any
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    num_steps: int | None = None
    target_model_name_or_path: str | None = None

    ARCHITECTURE = ""
    TARGET_CLS = object

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        ids, n = self.target_layer_ids, self.num_target_layers
        _require(isinstance(n, int) and n > 1, f"num_target_layers must be an int > 1, got {n!r}")
        _require(len(ids) == NUM_TAPS, f"target_layer_ids must list exactly {NUM_TAPS} target layers "
                                       f"(Eagle3's fc reads 5), got {list(ids)}")
        _require(all(b > a for a, b in zip(ids, ids[1:])),
                 f"target_layer_ids must be strictly increasing, got {list(ids)}")
        bad = [i for i in ids if not 0 <= i < n - 1]
        _require(not bad, f"target_layer_ids {bad} do not exist as tappable layers of a {n}-layer target "
                          f"(valid: 0..{n - 2}; the last layer is stored post-norm)")
        _require(isinstance(self.ttt_length, int) and not isinstance(self.ttt_length, bool)
                 and self.ttt_length >= 1, f"ttt_length must be an int >= 1, got {self.ttt_length!r}")
        _require(0 < float(self.step_loss_decay) <= 1,
                 f"step_loss_decay must be in (0, 1], got {self.step_loss_decay!r}")
        _require(self.text.num_hidden_layers == 1,
                 f"an Eagle3 drafter has one decoder layer, got num_hidden_layers={self.text.num_hidden_layers}")
        k = self.num_steps
        _require(k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 1),
                 f"draft steps must be an int >= 1, got {k!r}")

    # the attribute names generic drafter code reads
    vocab_size = property(lambda self: self.text.vocab_size)
    hidden_size = property(lambda self: self.text.hidden_size)
    intermediate_size = property(lambda self: self.text.intermediate_size)
    num_hidden_layers = property(lambda self: self.text.num_hidden_layers)
    num_attention_heads = property(lambda self: self.text.num_attention_heads)
    rms_norm_eps = property(lambda self: self.text.rms_norm_eps)
    max_position_embeddings = property(lambda self: self.text.max_position_embeddings)
    num_context_features = property(lambda self: len(self.target_layer_ids))
    block_size = property(lambda self: self.num_steps or self.ttt_length)  # decode's k
    kind = property(lambda self: KIND)
    enable_confidence_head = False
    has_markov = False
    markov_rank = 0

    def replace(self, **changes) -> "Eagle3Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target, **kwargs) -> "Eagle3Config":
        """A fresh drafter on ``target`` (DeepSpec's ``build_draft_config``): one full-attention
        layer of the target's shape; ``kwargs``: the Eagle3 keys (``kind`` is accepted and dropped)."""
        kwargs = dict(kwargs)
        kind = kwargs.pop("kind", KIND)
        _require(kind == KIND, f"draft.kind={kind!r} is not {KIND!r}")
        kwargs.setdefault("target_layer_ids", default_taps(target.num_hidden_layers))
        return cls(text=cls.text_for(target), num_target_layers=target.num_hidden_layers, **kwargs)

    def check_compatible(self, target) -> None:
        """ConfigError (one line) unless this drafter reads ``target``'s features and tokens."""
        _require(isinstance(target, self.TARGET_CLS),
                 f"a {self.ARCHITECTURE} drafter needs a {self.TARGET_CLS.__name__} target, got "
                 f"{type(target).__name__}")
        problems = [f"{name} {getattr(self, name)} != target {getattr(target, name)}"
                    for name in ("vocab_size", "hidden_size") if getattr(self, name) != getattr(target, name)]
        if self.num_target_layers != target.num_hidden_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target num_hidden_layers "
                            f"{target.num_hidden_layers}")
        bad = [i for i in self.target_layer_ids if i >= target.num_hidden_layers - 1]
        if bad:
            problems.append(f"target_layer_ids {bad} are not tappable layers of a "
                            f"{target.num_hidden_layers}-layer target")
        _require(not problems, "Eagle3 drafter and target do not fit together: " + "; ".join(problems))

    def describe(self) -> dict[str, Any]:
        """What ``inspect`` shows beyond the common drafter facts."""
        return {"ttt_length": self.ttt_length, "step_loss_decay": self.step_loss_decay,
                "chain steps when decoding": self.block_size}

    def eagle3_fields(self) -> dict[str, Any]:
        hf = {"draft_num_hidden_layers": 1, "num_target_layers": self.num_target_layers,
              "target_layer_ids": list(self.target_layer_ids), "ttt_length": self.ttt_length,
              "step_loss_decay": self.step_loss_decay, "tie_word_embeddings": False}
        if self.target_model_name_or_path is not None:
            hf["target_model_name_or_path"] = self.target_model_name_or_path
        return hf

    @classmethod
    def eagle3_kwargs(cls, hf: Mapping[str, Any], where: str) -> dict[str, Any]:
        arch = (hf.get("architectures") or [cls.ARCHITECTURE])[0]
        _require(arch == cls.ARCHITECTURE, f"{where}: architecture {arch!r} is not {cls.ARCHITECTURE!r}")
        layers = int(hf.get("draft_num_hidden_layers", hf.get("num_hidden_layers", 1)))
        _require(layers == 1, f"{where}: draft_num_hidden_layers={layers}; an Eagle3 drafter has one layer")
        ttt = _get(hf, "ttt_length", where)
        _require(isinstance(ttt, int) and not isinstance(ttt, bool) and ttt >= 1,
                 f"{where}: ttt_length must be an int >= 1, got {ttt!r}")
        return dict(num_target_layers=int(_get(hf, "num_target_layers", where)),
                    target_layer_ids=tuple(_get(hf, "target_layer_ids", where)), ttt_length=ttt,
                    step_loss_decay=float(hf.get("step_loss_decay", 0.8)),
                    target_model_name_or_path=hf.get("target_model_name_or_path"))


def default_taps(num_target_layers: int) -> tuple[int, ...]:
    """Five tapped layers spread over a target's depth (the DSpark ids: round(i * (L - 2) / 4)),
    ending one before the last (DeepSpec rejects the last layer)."""
    last = num_target_layers - 2
    _require(last >= NUM_TAPS - 1, f"an Eagle3 drafter taps {NUM_TAPS} distinct layers; a "
                                   f"{num_target_layers}-layer target has only {max(last + 1, 0)} tappable")
    return tuple(int(round(i * last / (NUM_TAPS - 1))) for i in range(NUM_TAPS))


@dataclasses.dataclass(frozen=True)
class Qwen3Eagle3Config(Eagle3Config):
    """``Qwen3Eagle3Model``: Qwen3 attention (per-head q/k norms) over [2H] inputs."""

    ARCHITECTURE = "Qwen3Eagle3Model"
    TARGET_CLS = TargetConfig

    num_key_value_heads = property(lambda self: self.text.num_key_value_heads)
    head_dim = property(lambda self: self.text.head_dim)
    rope_theta = property(lambda self: self.text.rope_theta)

    @staticmethod
    def text_for(target: TargetConfig) -> TargetConfig:
        return dataclasses.replace(target, num_hidden_layers=1, tie_word_embeddings=False)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Qwen3Eagle3Config":
        where = "drafter config.json"
        kwargs = cls.eagle3_kwargs(hf, where)
        text = TargetConfig(**{**_qwen3_hf_kwargs(hf, where), "num_hidden_layers": 1})
        return cls(text=text, **kwargs)

    def to_hf(self) -> dict[str, Any]:
        hf = _qwen3_hf_fields(self.text, self.ARCHITECTURE, tie_word_embeddings=False)
        hf.update(self.eagle3_fields())
        return hf


@dataclasses.dataclass(frozen=True)
class Gemma4Eagle3Config(Eagle3Config):
    """``Gemma4Eagle3Model``: one Gemma4 full-attention layer (k = v under ``attention_k_eq_v``,
    sandwich norms, ``layer_scalar``) over [2H] inputs; softcapped logits."""

    target_model_type: str = "gemma4_unified"

    ARCHITECTURE = "Gemma4Eagle3Model"
    TARGET_CLS = tg.Gemma4TargetConfig

    num_key_value_heads = property(lambda self: self.text.full_num_key_value_heads)
    head_dim = property(lambda self: self.text.global_head_dim)
    final_logit_softcapping = property(lambda self: self.text.final_logit_softcapping)

    def __post_init__(self):
        super().__post_init__()
        _require(set(self.text.layer_types) == {tg.FULL},
                 f"Gemma4 Eagle3 layer_types must be 'full_attention', got {list(self.text.layer_types)}")

    @staticmethod
    def text_for(target: tg.Gemma4TargetConfig) -> tg.Gemma4TargetConfig:
        return target.replace(num_hidden_layers=1, layer_types=(tg.FULL,), tie_word_embeddings=False)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Gemma4Eagle3Config":
        where = "drafter config.json"
        kwargs = cls.eagle3_kwargs(hf, where)
        text = tg.Gemma4TargetConfig(**{**tg.gemma4_text_kwargs(hf, where), "num_hidden_layers": 1})
        return cls(text=text, target_model_type=str(hf.get("target_model_type", "gemma4_unified")), **kwargs)

    def to_hf(self) -> dict[str, Any]:
        hf = tg.gemma4_text_fields(self.text, self.ARCHITECTURE)
        hf.update(self.eagle3_fields())
        hf.update({"target_model_type": self.target_model_type, "target_text_model_type": self.text.model_type})
        hf["rope_parameters"].update({"rope_theta": None, "rope_type": "default"})  # as build_draft_config writes
        return hf
