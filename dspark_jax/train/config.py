"""TrainConfig: every knob of a DSpark training run, frozen and validated on construction.

Config files (``configs/<name>.py``) define ``CONFIG = dict(...)`` with these
fields; ``dspark-jax train --config FILE key=value ...`` overrides them
(values parsed as Python literals when possible, else kept as strings).
Relative paths in a config file are resolved against the file's directory.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, Mapping

from dspark_jax.config import DraftConfig, LossConfig, TargetConfig
from dspark_jax.draft.backbone import REMAT_MODES
from dspark_jax.errors import ConfigError

FEATURE_MODES = ("online", "cache")
DATA_FORMATS = ("tokens", "chat")
OVERLONG = ("truncate", "refuse")
COMPUTE_DTYPES = ("float32", "bfloat16")
PATH_FIELDS = ("target", "draft_init", "data", "cache_dir", "tokenizer", "output_dir")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. Defaults follow SPEC section 1 (lr 6e-4, 4% warm-up, cosine, clip 1.0).

    target: HF/ours target checkpoint dir. draft: DraftConfig overrides (a dict) applied to
    ``DraftConfig.for_target`` unless ``draft_init`` (a drafter dir to start from) is given.
    features: "online" runs the frozen target inside the step; "cache" reads ``cache_dir``
    (written by ``dspark-jax cache``). data/data_format: JSONL of {"input_ids","loss_mask"}
    ("tokens") or {"messages"} ("chat", needs ``tokenizer``). Sequences are padded to
    ``max_length``; longer ones are cut to max_length ("truncate") or rejected with the
    offending line ("refuse"). batch_size is the GLOBAL number of sequences per optimizer
    step, split into ``grad_accum`` micro-batches (the loss is identical for any split).
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
    max_length: int = 4096
    overlong: str = "truncate"
    batch_size: int = 512
    grad_accum: int = 1
    steps: int = 0
    epochs: int = 10
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    loss_decay_gamma: float = 4.0
    mesh: str = "data=-1"
    num_devices: int = 0  # 0: all devices; else the first N (single process only)
    seed: int = 0
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    log_every: int = 1
    export_format: str = "torch"
    export_dir: str = ""
    progress: bool = True
    fast_compile: bool = False  # lower XLA backend optimisation: quicker compiles, slower steps (CPU smoke runs)
    # Memory options of the train step (numerics unchanged; see train/step.py build_train_step):
    remat: str = "none"  # "none" | "dots" | "full": rematerialise draft layers in the backward pass
    loss_chunk: int = 0  # > 0: heads + loss this many anchors at a time (no full [B, N, G, V] logits)
    shard_activations: bool = False  # pin activations batch-sharded (stops whole-batch all-reduces)
    resume: bool = True
    kill_at_step: int = 0  # testing only: SIGKILL this process after that step's checkpoint is saved

    def __post_init__(self):
        def req(cond, msg):
            if not cond:
                raise ConfigError(f"TrainConfig.{msg}")
        object.__setattr__(self, "draft", dict(self.draft or {}))
        req(self.features in FEATURE_MODES, f"features={self.features!r} must be one of {FEATURE_MODES}")
        req(self.data_format in DATA_FORMATS, f"data_format={self.data_format!r} must be one of {DATA_FORMATS}")
        req(self.overlong in OVERLONG, f"overlong={self.overlong!r} must be one of {OVERLONG}")
        req(self.compute_dtype in COMPUTE_DTYPES,
            f"compute_dtype={self.compute_dtype!r} must be one of {COMPUTE_DTYPES}")
        req(self.export_format in ("torch", "jax", "none"),
            f"export_format={self.export_format!r} must be 'torch', 'jax' or 'none'")
        for name in ("max_length", "batch_size", "grad_accum", "epochs", "log_every"):
            v = getattr(self, name)
            req(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        req(self.remat in REMAT_MODES, f"remat={self.remat!r} must be one of {REMAT_MODES}")
        for name in ("steps", "checkpoint_every", "keep_checkpoints", "kill_at_step", "num_devices", "loss_chunk"):
            v = getattr(self, name)
            req(isinstance(v, int) and v >= 0, f"{name} must be an int >= 0, got {v!r}")
        req(self.batch_size % self.grad_accum == 0,
            f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        req(self.learning_rate >= 0, "learning_rate must be >= 0")
        req(0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)")
        req(self.grad_clip >= 0, "grad_clip must be >= 0 (0 disables clipping)")
        req(self.target != "", "target (a target checkpoint directory) is required")
        if self.features == "cache":
            req(self.cache_dir != "", "cache_dir is required when features='cache'")
        else:
            req(self.data != "", "data (a JSONL file) is required when features='online'")
        if self.data_format == "chat" and self.features == "online":
            req(self.tokenizer != "", "tokenizer is required for data_format='chat'")
        LossConfig(self.ce_weight, self.l1_weight, self.confidence_weight, self.loss_decay_gamma)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    def loss_config(self) -> LossConfig:
        return LossConfig(self.ce_weight, self.l1_weight, self.confidence_weight, self.loss_decay_gamma)

    def draft_config(self, target: TargetConfig) -> DraftConfig:
        """The drafter for ``target`` from the ``draft`` overrides (not used with draft_init)."""
        try:
            cfg = DraftConfig.for_target(target, **self.draft)
        except TypeError as e:
            raise ConfigError(f"TrainConfig.draft: {e}") from None
        cfg.check_compatible(target)
        return cfg

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["draft"] = dict(self.draft)
        return d


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` -> (key, python value); ``draft.markov_rank=0`` sets a draft override."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip(), value


_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else {})
             for f in dataclasses.fields(TrainConfig)}


def apply_overrides(base: Mapping[str, Any], overrides) -> dict:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    out = dict(base)
    out["draft"] = dict(out.get("draft", {}))
    for item in overrides:
        key, value = parse_override(item) if isinstance(item, str) else item
        if key.startswith("draft."):
            out["draft"][key[len("draft."):]] = value
        elif key in fields:
            ftype = type(_DEFAULTS[key])
            if ftype is float and isinstance(value, int):
                value = float(value)
            if ftype is str and not isinstance(value, str):
                value = str(value)
            out[key] = value
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
            continue  # a preset / Hub name (e.g. "Qwen/Qwen3-4B"), not a path next to the config
        if value and not Path(value).is_absolute() and name in base and merged[name] == base[name]:
            merged[name] = str((path.parent / value).resolve())
    try:
        return TrainConfig(**merged)
    except TypeError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
