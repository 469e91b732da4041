"""Read DeepSeek-V4's in-checkpoint MTP-1 module (``mtp.0.*``, marked by ``num_nextn_predict_layers``
without the ``dspark_*`` keys) as a chain drafter (``draft.deepseek_v4_mtp``).

``holds_module`` tells the two kinds of ``mtp.*`` apart by the ``dspark_*`` keys (a DSpark
checkpoint keeps ``num_nextn_predict_layers`` at 1 too) and by the module's own tensor
(``mtp.0.e_proj.weight``); ``load_module`` reads and validates the tensors as the DSpark module's
are (``dspark_v4.read_module``: FP8 / MXFP4 dequantized like the target's layers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dspark_jax import params as params_lib
from dspark_jax.convert import safetensors_io
from dspark_jax.convert.formats import read_json_object
from dspark_jax.convert.dspark_v4 import read_module
from dspark_jax.draft.deepseek_v4_mtp import DSPARK_KEYS, PREFIX, DeepseekV4MTPConfig, declare, module_specs
from dspark_jax.target.deepseek_v4.config import ARCHITECTURE

MARK = PREFIX + "e_proj.weight"  # the tensor only an MTP module has


def is_v4(path) -> bool:
    """Whether ``path`` holds a DeepSeek-V4 config.json (upstream architecture name)."""
    p = Path(path) / "config.json"
    return p.is_file() and ARCHITECTURE in (read_json_object(p, "config.json").get("architectures") or [])


def holds_module(path) -> bool:
    """Whether ``path`` is a V4 checkpoint (safetensors) holding an MTP module: no ``dspark_*``
    keys, ``num_nextn_predict_layers`` >= 1 and the module's ``mtp.0.e_proj`` tensor."""
    if not is_v4(path):
        return False
    hf = read_json_object(Path(path) / "config.json", "config.json")
    if any(hf.get(k) is not None for k in DSPARK_KEYS) or int(hf.get("num_nextn_predict_layers") or 0) < 1:
        return False
    names = safetensors_io.TensorReader(Path(path)).infos  # a damaged checkpoint: CheckpointError naming it
    return MARK in names


def read_config(path, steps: int = 1) -> DeepseekV4MTPConfig:
    """The MTP module's config (``num_steps`` = ``steps``) from V4 checkpoint ``path``'s config.json."""
    return DeepseekV4MTPConfig.from_hf(read_json_object(Path(path) / "config.json", "config.json")).replace(
        num_steps=steps)


def load_module(path, *, shared: bool = False, steps: int = 1) -> tuple[DeepseekV4MTPConfig, dict]:
    """(config with ``num_steps`` = ``steps``, numpy params) of the MTP module in V4 checkpoint
    ``path``: the ``mtp.0.*`` tensors, with ``shared`` also the target's ``embed`` / ``head``."""
    p = Path(path)
    cfg = read_config(p, steps)
    specs = declare(cfg) if shared else module_specs(cfg)
    tensors = read_module(p, specs, "MTP module", "num_nextn_predict_layers")
    cfg = dataclasses.replace(cfg, target=cfg.target.dequantized())
    return cfg, params_lib.from_torch(declare(cfg) if shared else module_specs(cfg), tensors)
