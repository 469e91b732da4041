"""TrainConfig: every knob of a DSpark training run, frozen and validated on construction.

Config files (``configs/<name>.py``) define ``CONFIG = dict(...)`` with these fields; the
sections ``optimizer``, ``loss``, ``checkpoint`` and ``memory`` are nested dicts (or the
config dataclasses below). ``dspark-jax train --config FILE key=value ...`` overrides them,
with dotted paths for nested fields (``optimizer.learning_rate=1e-3``,
``draft.markov_rank=0``); values are parsed as Python literals when possible, else kept as
strings. Relative paths in a config file are resolved against the file's directory.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, Mapping

from dspark_jax.config import DraftConfig, LossConfig, TargetConfig
from dspark_jax.convert.engines import ENGINES
from dspark_jax.draft.backbone import REMAT_MODES
from dspark_jax.errors import ConfigError

FEATURE_MODES = ("online", "cache")
DATA_FORMATS = ("tokens", "chat")
OVERLONG = ("truncate", "refuse")
COMPUTE_DTYPES = ("float32", "bfloat16")
PATH_FIELDS = ("target", "draft_init", "data", "cache_dir", "tokenizer", "output_dir")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _is_int(v, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up then cosine decay to 0 and global-norm clipping (paper defaults:
    lr 6e-4, 4% warm-up, clip 1.0; ``grad_clip`` 0 disables clipping)."""

    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        _require(self.learning_rate >= 0, "TrainConfig.optimizer.learning_rate must be >= 0")
        _require(0 <= self.warmup_ratio < 1, "TrainConfig.optimizer.warmup_ratio must be in [0, 1)")
        _require(self.grad_clip >= 0, "TrainConfig.optimizer.grad_clip must be >= 0 (0 disables clipping)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints: every ``every`` steps (0: none) and at the end, the newest ``keep``
    kept (0: all), written asynchronously if ``async_save``; ``resume`` continues a run."""

    every: int = 1000
    keep: int = 3
    async_save: bool = True
    resume: bool = True

    def __post_init__(self):
        for name in ("every", "keep"):
            v = getattr(self, name)
            _require(_is_int(v, 0), f"TrainConfig.checkpoint.{name} must be an int >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Memory options of the train step; numerics unchanged (see ``train/step.py``).

    remat: "none" | "dots" | "full": rematerialise draft layers in the backward pass.
    loss_chunk: > 0: heads + loss this many anchors at a time (no full [B, N, G, V] logits).
    shard_activations: pin activations batch-sharded (stops whole-batch all-reduces).
    """

    remat: str = "none"
    loss_chunk: int = 0
    shard_activations: bool = False

    def __post_init__(self):
        _require(self.remat in REMAT_MODES, f"TrainConfig.memory.remat={self.remat!r} must be one of {REMAT_MODES}")
        _require(_is_int(self.loss_chunk, 0),
                 f"TrainConfig.memory.loss_chunk must be an int >= 0, got {self.loss_chunk!r}")


SECTIONS = {"optimizer": OptimizerConfig, "loss": LossConfig, "checkpoint": CheckpointConfig,
            "memory": MemoryConfig}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run.

    target: HF/ours target checkpoint dir. draft: DraftConfig overrides (a dict) applied to
    ``DraftConfig.for_target`` unless ``draft_init`` (a drafter dir to start from) is given.
    features: "online" runs the frozen target inside the step; "cache" reads ``cache_dir``
    (written by ``dspark-jax cache``). data/data_format: JSONL of {"input_ids","loss_mask"}
    ("tokens") or chat rows {"messages"} / ShareGPT {"conversations"} ("chat", rendered with
    the chat template of ``tokenizer``, default the target's; ``chat_thinking`` is the
    template's enable_thinking, None its default; loss on assistant tokens, see data/chat.py). Sequences are padded to
    ``max_length``; longer ones are cut to max_length ("truncate") or rejected with the
    offending line ("refuse"). batch_size is the GLOBAL number of sequences per optimizer
    step, split into ``grad_accum`` micro-batches (the loss is identical for any split).
    ``steps`` 0 (the default) trains ``epochs`` passes over the data (epochs x sequences //
    batch_size steps); steps > 0 trains exactly that many steps, whatever ``epochs``.
    ``num_devices`` 0 uses all devices, else the first N (single process only).
    """

    target: str = ""
    output_dir: str = "runs/default"
    draft: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    draft_init: str = ""
    features: str = "online"
    cache_dir: str = ""
    data: str = ""
    data_format: str = "tokens"
    tokenizer: str = ""
    chat_thinking: bool | None = None
    max_length: int = 4096
    overlong: str = "truncate"
    batch_size: int = 512
    grad_accum: int = 1
    steps: int = 0
    epochs: int = 10
    compute_dtype: str = "bfloat16"
    mesh: str = "data=-1"
    num_devices: int = 0
    seed: int = 0
    log_every: int = 1
    export_format: str = "torch"
    export_dir: str = ""
    progress: bool = True
    serve_engines: tuple[str, ...] = ()
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)

    def __post_init__(self):
        object.__setattr__(self, "draft", dict(self.draft or {}))
        engines = self.serve_engines
        object.__setattr__(self, "serve_engines",
                           (engines,) if isinstance(engines, str) else tuple(engines or ()))
        for name, cls in SECTIONS.items():
            object.__setattr__(self, name, _section(name, cls, getattr(self, name)))
        self._validate()

    def _validate(self) -> None:
        def req(cond, msg):
            _require(cond, f"TrainConfig.{msg}")
        req(self.features in FEATURE_MODES, f"features={self.features!r} must be one of {FEATURE_MODES}")
        req(self.data_format in DATA_FORMATS, f"data_format={self.data_format!r} must be one of {DATA_FORMATS}")
        req(self.overlong in OVERLONG, f"overlong={self.overlong!r} must be one of {OVERLONG}")
        req(self.compute_dtype in COMPUTE_DTYPES,
            f"compute_dtype={self.compute_dtype!r} must be one of {COMPUTE_DTYPES}")
        req(self.export_format in ("torch", "jax", "none"),
            f"export_format={self.export_format!r} must be 'torch', 'jax' or 'none'")
        for name in ("max_length", "batch_size", "grad_accum", "epochs", "log_every"):
            v = getattr(self, name)
            req(_is_int(v, 1), f"{name} must be a positive int, got {v!r}")
        for name in ("steps", "num_devices"):
            v = getattr(self, name)
            req(_is_int(v, 0), f"{name} must be an int >= 0, got {v!r}")
        req(self.max_length >= 2, f"max_length must be >= 2 (an anchor and a token to predict), got "
                                  f"{self.max_length}")
        req(self.batch_size % self.grad_accum == 0,
            f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        req(self.target != "", "target (a target checkpoint directory) is required")
        for engine in self.serve_engines:
            req(engine in ENGINES, f"serve_engines: unknown engine {engine!r} (known: {ENGINES})")
        if self.features == "cache":
            req(self.cache_dir != "", "cache_dir is required when features='cache'")
        else:
            req(self.data != "", "data (a JSONL file) is required when features='online'")
        req(self.chat_thinking is None or isinstance(self.chat_thinking, bool),
            f"chat_thinking must be None, True or False, got {self.chat_thinking!r}")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    def draft_config(self, target: TargetConfig) -> DraftConfig:
        """The drafter for ``target`` from the ``draft`` overrides (not used with draft_init)."""
        from dspark_jax import families  # the drafter family of draft.kind that reads this target's
        draft = dict(self.draft)
        kind = draft.pop("kind", "dspark")
        try:
            cfg = families.drafter_family(target, kind).config_cls.for_target(target, **draft)
        except TypeError as e:
            raise ConfigError(f"TrainConfig.draft: {e}") from None
        cfg.check_compatible(target)
        return cfg

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self, *, changed_only: bool = False) -> dict:
        """Nested plain dict (sections as dicts) that ``TrainConfig(**d)`` and config files accept;
        ``changed_only`` keeps only the fields that differ from the defaults."""
        d = dataclasses.asdict(self)
        d["draft"] = dict(self.draft)
        if not changed_only:
            return d
        default = dataclasses.asdict(TrainConfig(target="x", data="x"))
        out = {}
        for k, v in d.items():
            if k in SECTIONS:
                v = {f: x for f, x in v.items() if x != default[k][f]}
                if v:
                    out[k] = v
            elif k in ("target", "data") or v != default[k]:
                out[k] = v
        return out


def _section(name: str, cls, value):
    """A config section from its dataclass or a dict of its fields (ConfigError otherwise)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return cls(**value)
        except TypeError as e:
            raise ConfigError(f"TrainConfig.{name}: {e}") from None
    raise ConfigError(f"TrainConfig.{name} must be a dict of {cls.__name__} fields, got {value!r}")


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` -> (key, python value); ``optimizer.learning_rate=1e-3`` sets a nested field."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip(), value


def _fields(cls) -> dict[str, Any]:
    """name -> default value of a config dataclass (``{}`` for dict-valued fields)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()
    return out


def _coerce(default, value, key: str = ""):
    """Override value with the type of the field's default (1 -> 1.0 for floats, any -> str);
    a value of the wrong kind for a number or bool field is a ConfigError naming ``key``."""
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    number = (int, float)
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"override {key}={value!r}: {key} must be True or False")
    if isinstance(default, number) and not isinstance(default, bool) and (
            isinstance(value, bool) or not isinstance(value, number)
            or (isinstance(default, int) and not isinstance(value, int))):
        kind = "an int" if isinstance(default, int) else "a number"
        raise ConfigError(f"override {key}={value!r}: {key} must be {kind}")
    if isinstance(default, str) and not isinstance(value, str):
        return str(value)
    return value


def apply_overrides(base: Mapping[str, Any], overrides) -> dict:
    """``base`` (a CONFIG dict) with ``key=value`` overrides (strings or (key, value) pairs)."""
    top = _fields(TrainConfig)
    out = dict(base)
    out["draft"] = dict(out.get("draft", {}))
    for name, cls in SECTIONS.items():
        section = out.get(name, {})
        out[name] = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else dict(section)
    for item in overrides:
        key, value = parse_override(item) if isinstance(item, str) else item
        head, _, field = key.partition(".")
        if head == "draft" and field:
            out["draft"][field] = value
        elif head in SECTIONS and field:
            defaults = _fields(SECTIONS[head])
            if field not in defaults:
                raise ConfigError(f"unknown TrainConfig field {key!r} in override {key}=...")
            out[head][field] = _coerce(defaults[field], value, key)
        elif key in top and key not in SECTIONS and key != "draft":
            out[key] = _coerce(top[key], value, key)
        else:
            raise ConfigError(f"unknown TrainConfig field {key!r} in override {key}=...")
    return out


def load_config(path, overrides=()) -> TrainConfig:
    """TrainConfig from a python config file defining ``CONFIG`` (dict), plus overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_dspark_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken config file is the user's input
        raise ConfigError(f"config file {str(path)!r} failed to load: {e}") from None
    base = getattr(module, "CONFIG", None)
    if not isinstance(base, Mapping):
        raise ConfigError(f"config file {str(path)!r} must define CONFIG = dict(...)")
    merged = apply_overrides(base, overrides)
    from dspark_jax.presets import TARGETS
    for name in PATH_FIELDS:
        value = merged.get(name)
        if name in ("target", "tokenizer") and value in TARGETS and not Path(value).exists():
            continue  # a preset / Hub name (e.g. "org/model-4B"), not a path next to the config
        if value and not Path(value).is_absolute() and name in base and merged[name] == base[name]:
            merged[name] = str((path.parent / value).resolve())
    try:
        return TrainConfig(**merged)
    except TypeError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
