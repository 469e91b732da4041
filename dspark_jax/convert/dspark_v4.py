"""Read and write DeepSeek-V4's in-checkpoint DSpark module (``mtp.*`` + the ``dspark_*`` keys).

The module lives in the target's own checkpoint (upstream layout, what the released V4-DSpark repos
hold): ``load_module`` reads only the ``mtp.*`` tensors of a V4 directory (FP8 / MXFP4 ones
dequantized as the target's are, ``quant.dequantize``), validated against the declaration
(``draft.deepseek_v4.module_specs``) before any data is read. ``module_tensors`` is the inverse
(torch layout, upstream names, same bits), ``save_module`` writes them with the config.json that
marks the module. The embedding and head are the target's: neither is read nor written here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

import numpy as np

from dspark_jax import params as params_lib
from dspark_jax.convert import mapping, quant, safetensors_io
from dspark_jax.draft.deepseek_v4 import DeepseekV4DSparkConfig, module_specs
from dspark_jax.errors import CheckpointError
from dspark_jax.fileio import atomic_dir

PREFIX = "mtp."


def read_config(path) -> DeepseekV4DSparkConfig:
    """The module's config from ``path/config.json`` (ConfigError when it has no DSpark keys)."""
    from dspark_jax.convert.checkpoint import read_json_object
    return DeepseekV4DSparkConfig.from_hf(read_json_object(Path(path) / "config.json", "config.json"))


def load_module(path) -> tuple[DeepseekV4DSparkConfig, dict]:
    """(config, numpy params without ``embed`` / ``head``) of the DSpark module in V4 checkpoint ``path``.

    Quantized tensors come back float (the checkpoint's widest plain float dtype) and the config
    unquantized, as the target's conversion does."""
    p = Path(path)
    cfg = read_config(p)
    specs = module_specs(cfg)
    reader = safetensors_io.TensorReader(p)
    infos = {n: i for n, i in reader.infos.items() if n.startswith(PREFIX)}
    if not infos:
        raise CheckpointError(f"{p}: config.json has the dspark_* keys but no {PREFIX}* tensors")
    fixed = params_lib.fixed_dtypes(specs)
    infos, stored = quant.logical_infos(params_lib.quantized(specs), infos, str(p),
                                        lambda shape, dtype, info: dataclasses.replace(info, shape=shape, dtype=dtype),
                                        fixed)
    mapping.check_tensors(infos, params_lib.torch_shapes(specs), f"{p} (DSpark module)", fixed=fixed)
    tensors = {}
    for name in infos:
        tensors[name] = reader.get(name)
        if name in stored:
            scale = reader.get(stored[name].scale)
            tensors[name] = quant.dequantize(tensors[name], scale, stored[name].quant).astype(infos[name].dtype)
    cfg = dataclasses.replace(cfg, target=cfg.target.dequantized())
    return cfg, params_lib.from_torch(module_specs(cfg), tensors)


def module_tensors(cfg: DeepseekV4DSparkConfig, params: Mapping) -> dict[str, np.ndarray]:
    """The module's ``mtp.*`` tensors (torch layout, upstream names) of ``params`` (a tree with or
    without the target's ``embed`` / ``head``; they are not written)."""
    specs = module_specs(cfg)
    host = {k: v for k, v in params.items() if k not in ("embed", "head")}
    out = params_lib.to_torch(specs, host)
    mapping.check_tensors(out, params_lib.torch_shapes(specs), "DSpark module params",
                          fixed=params_lib.fixed_dtypes(specs))
    return out


def save_module(path, cfg: DeepseekV4DSparkConfig, params: Mapping, *, force: bool = False) -> Path:
    """Write ``path/config.json`` (the V4 config with the ``dspark_*`` keys) and ``model.safetensors``
    holding the ``mtp.*`` tensors; atomic, an existing ``path`` refused unless ``force``."""
    tensors = module_tensors(cfg, params)
    with atomic_dir(path, force=force) as tmp:
        safetensors_io.write_tensors(tmp, tensors)
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2, sort_keys=True) + "\n")
    return Path(path)
