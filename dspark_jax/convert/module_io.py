"""A checkpoint's own drafter module through conversion (DeepSeek-V4's ``mtp.*`` DSpark module,
told apart by its config keys: ``dspark_v4.holds_module``).

The module is part of the checkpoint: ``convert`` carries it both ways, validated as the target's
tensors are (declared shapes and dtypes: ``dspark_v4.load_module``; finite values), never as
opaque ``aside`` bytes. Where it lives:

* PyTorch / HF format (upstream layout): the ``mtp.*`` tensors in the checkpoint's own safetensors
  (``dspark_v4.MODULE_FILE`` in the index), the module keys in ``config.json``; stored as the
  target's layers are (FP8 / MXFP4 when the output is quantized: ``dspark_v4.stored_module``).
* the project format: ``MODULE_DIR/``, a module checkpoint (``dspark_v4.save_module``: config.json
  + the module's float tensors) beside ``params/``.

``module_dir`` says where a checkpoint's module is, so ``--draft D`` reads it after any conversion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from dspark_jax.convert import dspark_v4, safetensors_io
from dspark_jax.draft.deepseek_v4 import DeepseekV4DSparkConfig
from dspark_jax.errors import CheckpointError

MODULE_DIR = "module"


def module_dir(path) -> Path | None:
    """The directory holding ``path``'s in-checkpoint module (``path`` itself in the HF layout,
    ``path/MODULE_DIR`` in the project format), else None."""
    p = Path(path)
    for d in (p, p / MODULE_DIR):
        if dspark_v4.holds_module(d) and _has_module_tensors(d):
            return d
    return None


def _has_module_tensors(d: Path) -> bool:
    """Whether ``d``'s safetensors headers name any ``mtp.*`` tensor (a V4.1 config carries the
    ``dspark_*`` keys by default, with or without a module)."""
    try:
        return any(n.startswith(dspark_v4.PREFIX) for n in safetensors_io.TensorReader(d).infos)
    except CheckpointError:
        return False


def read_module(src, finite: Callable[[str, np.ndarray], None]):
    """(module config, float params) of ``src``'s module, or None when it holds none. Shapes and
    dtypes are checked against the declaration before any data is read (CheckpointError naming
    the tensor); ``finite(name, array)`` is called on every tensor (it refuses NaN/inf)."""
    d = module_dir(src)
    if d is None:
        return None
    cfg, params = dspark_v4.load_module(d)
    for name, a in dspark_v4.module_tensors(cfg, params).items():
        finite(name, a)
    return cfg, params


def write_module(tmp: Path, to: str, module, out_hf: dict) -> None:
    """Write ``module`` ((config, params) from ``read_module``) into the converted checkpoint
    ``tmp`` in format ``to``, for the target config ``out_hf`` written there (its quantization
    decides how a PyTorch output stores the module)."""
    cfg, params = module
    if to == "jax":
        dspark_v4.save_module(tmp / MODULE_DIR, cfg, params)
        return
    out_cfg = DeepseekV4DSparkConfig.from_hf({**out_hf, **cfg.hf_fields()})
    reader = safetensors_io.TensorReader(tmp)
    tensors = dspark_v4.stored_module(out_cfg, params, tmp, reader.infos)
    clash = sorted(set(tensors) & set(reader.infos))
    if clash:
        raise CheckpointError(f"{tmp}: module tensor {clash[0]!r} is also a target tensor")
    safetensors_io.write_file(tmp / dspark_v4.MODULE_FILE, tensors)
    weight_map = {n: i.file for n, i in reader.infos.items()} | {n: dspark_v4.MODULE_FILE for n in tensors}
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    (tmp / safetensors_io.INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    hf = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**hf, **cfg.hf_fields()}, indent=2, sort_keys=True) + "\n")


def load_module_draft(path, load_target, target_params=None, cast=lambda params, cfg: params):
    """(config, params) of the module of ``path`` as a drafter (``checkpoint.load_draft``'s):
    ``cast(params, cfg)`` (a dtype) applied to the module's own tensors, then ``target_params``'
    embedding and head shared as they are (no copy; else the checkpoint's own target's, read by
    ``load_target(path) -> (config, params)``: the checkpoint API's, passed down)."""
    d = module_dir(path)
    if d == Path(path):  # HF layout: the checkpoint reads its own embedding and head
        cfg, params = dspark_v4.load_module(d, shared=target_params is None)
    else:  # project format: the module alone; the target's params come from beside it
        cfg, params = dspark_v4.load_module(d)
        if target_params is None:
            return cfg, cast(dspark_v4.with_target(params, load_target(path)[1]), cfg)
    params = cast(params, cfg)
    if target_params is not None:
        params = dspark_v4.with_target(params, target_params)
    return cfg, params


def describe_module(path) -> dict | None:
    """What ``inspect`` says of ``path``'s module, from headers only: where it is, its tensors and
    bytes, and ``problem`` (the validation's one line: a missing tensor, a wrong shape or dtype)
    or None. None when the checkpoint holds no module."""
    d = module_dir(path)
    if d is None:
        return None
    out = {"where": str(d), "tensors": 0, "bytes": 0, "problem": None}
    try:
        reader, infos, _ = dspark_v4.module_headers(d, dspark_v4.module_specs_of(dspark_v4.read_config(d)))
    except CheckpointError as e:
        out["problem"] = str(e)
        return out
    names = [n for n in reader.infos if n.startswith(dspark_v4.PREFIX)]
    out["tensors"] = len(names)
    out["bytes"] = int(sum(int(np.prod(reader.infos[n].shape)) * np.dtype(reader.infos[n].dtype).itemsize
                           for n in names))
    return out
