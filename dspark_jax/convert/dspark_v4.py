"""Read and write DeepSeek-V4's in-checkpoint DSpark module (``mtp.*`` + the ``dspark_*`` keys).

The module lives in the target's own checkpoint (upstream layout, what the released V4-DSpark repos
hold): ``load_module`` reads only the ``mtp.*`` tensors of a V4 directory (FP8 / MXFP4 ones
dequantized as the target's are, ``quant.dequantize``), validated against the declaration
(``draft.deepseek_v4.module_specs``) before any data is read. ``module_tensors`` is the inverse
(torch layout, upstream names, same bits), ``save_module`` writes them with the config.json that
marks the module, ``write_checkpoint`` a whole V4 checkpoint whose ``mtp.*`` tensors and
``dspark_*`` keys are the given module and whose target tensors are the source's, byte for byte
(shard files without ``mtp.*`` hard-linked or copied, mixed ones re-packed raw). The embedding and
head are the target's: neither is read nor written as part of the module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Mapping

import numpy as np

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.convert import mapping, quant, safetensors_io
from dspark_jax.convert.formats import read_json_object
from dspark_jax.draft import deepseek_v4 as _dv4
from dspark_jax.draft import deepseek_v41 as dv41
from dspark_jax.draft.deepseek_v4 import KEYS, DeepseekV4DSparkConfig
from dspark_jax.draft.deepseek_v4 import with_target  # noqa: F401 (load_draft's, beside load_module)
from dspark_jax.errors import CheckpointError
from dspark_jax.fileio import atomic_dir

PREFIX = "mtp."


def _kind(hf: Mapping):
    """The draft module (``draft.deepseek_v4`` or ``draft.deepseek_v41``) whose DSpark keys ``hf``
    carries (V4: top level; V4.1: in ``text_config``), None when it carries none."""
    text = hf.get("text_config")
    if isinstance(text, Mapping) or hf.get("model_type") == "deepseek_v41_text":
        return dv41 if all((text or hf).get(k) is not None for k in dv41.KEYS) else None
    return _dv4 if all(hf.get(k) is not None for k in KEYS) else None


def read_config(path) -> DeepseekV4DSparkConfig:
    """The module's config from ``path/config.json`` (V4's or V4.1's; ConfigError when it has no
    DSpark keys)."""
    hf = read_json_object(Path(path) / "config.json", "config.json")
    return (_kind(hf) or _dv4).FAMILY.config_cls.from_hf(hf)


def _with_module(hf: Mapping, cfg) -> dict:
    """config.json ``hf`` carrying ``cfg``'s module keys (V4: top level; V4.1: in ``text_config``)."""
    if isinstance(hf.get("text_config"), Mapping):
        return {**hf, "text_config": {**hf["text_config"], **cfg.hf_fields()}}
    return {**hf, **cfg.hf_fields()}


def module_specs_of(cfg, shared: bool = False):
    """``declare`` (with the shared embed / head) or ``module_specs`` of ``cfg``'s module."""
    mod = dv41 if isinstance(cfg, dv41.DeepseekV41DSparkConfig) else _dv4
    return mod.declare(cfg) if shared else mod.module_specs(cfg)


def load_module(path, *, shared: bool = False) -> tuple[DeepseekV4DSparkConfig, dict]:
    """(config, numpy params) of the DSpark module in V4 checkpoint ``path``: the ``mtp.*`` tensors,
    and with ``shared`` also the target's ``embed`` / ``head`` read from the same checkpoint.

    Quantized tensors come back float (the checkpoint's widest plain float dtype) and the config
    unquantized, as the target's conversion does."""
    cfg = read_config(path)
    tensors = read_module(path, module_specs_of(cfg, shared), "DSpark module", "dspark_* keys")
    cfg = dataclasses.replace(cfg, target=cfg.target.dequantized())
    return cfg, params_lib.from_torch(module_specs_of(cfg, shared), tensors)


def read_module(path, specs, what: str, marks: str) -> dict[str, np.ndarray]:
    """{torch name: array} of the in-checkpoint module declared by ``specs`` (its ``mtp.*`` tensors
    and the target's it shares) in V4 checkpoint ``path``, validated by ``module_headers`` before
    any data is read, quantized ones dequantized as the target's are."""
    reader, infos, stored = module_headers(path, specs, what, marks)
    tensors = {}
    for name in infos:
        tensors[name] = reader.get(name)
        if name in stored:
            scale = reader.get(stored[name].scale)
            tensors[name] = quant.dequantize(tensors[name], scale, stored[name].quant).astype(infos[name].dtype)
    return tensors


def module_headers(path, specs, what: str = "DSpark module", marks: str = "dspark_* keys"):
    """(reader, {name: logical TensorInfo}, {name: stored quantized}) of the module declared by
    ``specs`` in ``path``, every name, shape, dtype and FP8 / MXFP4 scale shape checked against the
    declaration from the headers alone (CheckpointError naming the tensor). ``what`` / ``marks``
    name the module and the config keys that mark it in error messages."""
    p = Path(path)
    reader = safetensors_io.TensorReader(p)
    if not any(n.startswith(PREFIX) for n in reader.infos):
        raise CheckpointError(f"{p}: config.json has the {marks} but no {PREFIX}* tensors")
    shared_names = {s.torch for s in specs.values() if not s.torch.startswith(PREFIX)}
    missing = sorted(shared_names - set(reader.infos))
    if missing:
        raise CheckpointError(f"{p}: tensor {missing[0]!r} (the target's, which the {what} shares) "
                              f"is missing; pass the target's params instead")
    infos = {n: i for n, i in reader.infos.items() if n.startswith(PREFIX) or n in shared_names}
    fixed = params_lib.fixed_dtypes(specs)
    infos, stored = quant.logical_infos(params_lib.quantized(specs), infos, str(p),
                                        lambda shape, dtype, info: dataclasses.replace(info, shape=shape, dtype=dtype),
                                        fixed)
    mapping.check_tensors(infos, params_lib.torch_shapes(specs), f"{p} ({what})", fixed=fixed)
    return reader, infos, stored


def holds_module(path) -> bool:
    """Whether ``path`` is a V4 / V4.1 checkpoint whose config.json has the ``dspark_*`` keys."""
    p = Path(path) / "config.json"
    if not p.is_file():
        return False
    return _kind(read_json_object(p, "config.json")) is not None


def module_tensors(cfg: DeepseekV4DSparkConfig, params: Mapping) -> dict[str, np.ndarray]:
    """The module's ``mtp.*`` tensors (torch layout, upstream names) of ``params`` (a tree with or
    without the target's ``embed`` / ``head``; they are not written)."""
    specs = module_specs_of(cfg, False)
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


MODULE_FILE = "model-dspark.safetensors"


def _model(target_cfg):
    """A target config as the model it describes (unquantized, pass-through config keys aside)."""
    return dataclasses.replace(target_cfg.dequantized(), extra=())


def _role(name: str) -> str:
    """The target-layer tensor a module tensor is stored like: ``mtp.{s}.<rest>`` -> ``<rest>``
    (the target's ``layers.{i}.<rest>``); ``main_proj`` as the attention's first projection (a
    linear of the model's quantization config in both engines)."""
    return "attn.wq_a.weight" if name == "mtp.0.main_proj.weight" else name.split(".", 2)[-1]


def storage_plan(src, infos: Mapping, names) -> dict[str, quant.Quant]:
    """{module tensor name: its stored format} for the module tensors ``names`` written into the V4
    checkpoint ``src`` (safetensors header ``infos``): each stored as the target stores the same
    tensor of its own layers (FP8 e4m3 with the config's ue8m0 block scales; the experts in the
    target's expert dtype, e.g. MXFP4); not in the plan (float) where the target's are float or
    it has no such tensor. CheckpointError when the target's layers store one tensor in more than
    one format (then no format is the target's)."""
    hf = read_json_object(Path(src) / "config.json", "config.json")
    declared = params_lib.quantized(families.declare(families.for_hf(hf).config_from_hf(hf)))
    formats: dict[str, set] = {}
    for name, info in infos.items():
        if name.startswith("layers."):
            formats.setdefault(name.split(".", 2)[2], set()).add(
                None if quant.is_float(info.dtype) else declared.get(name))
    plan = {}
    for name in names:
        fmts = formats.get(_role(name), {None})
        if len(fmts) > 1:
            raise CheckpointError(f"{src}: the target's layers store {_role(name)} in more than one format "
                                  f"({', '.join(sorted(str(f and f.fmt) for f in fmts))}); the module's "
                                  f"{name} has no single format to match")
        if None not in fmts:
            plan[name] = next(iter(fmts))
    return plan


def stored_module(cfg: DeepseekV4DSparkConfig, params: Mapping, src, infos: Mapping) -> dict[str, np.ndarray]:
    """The module's checkpoint tensors for the V4 checkpoint ``src``: ``module_tensors`` stored as
    the target's own layers are (``storage_plan``; ``quant.store``: data + ``.scale``)."""
    tensors = module_tensors(cfg, params)
    plan = storage_plan(src, infos, tensors)
    out = {}
    for name, t in tensors.items():
        out.update(quant.store(name, t, plan[name]) if name in plan else {name: t})
    return out


def write_checkpoint(src, dst, cfg: DeepseekV4DSparkConfig, params: Mapping, *, force: bool = False,
                     sidecars: Mapping[str, str] | None = None) -> Path:
    """The V4 checkpoint ``src`` with its DSpark module replaced by ``params`` (config ``cfg``) at
    ``dst``: the target's tensors untouched (a shard holding no ``mtp.*`` tensor is hard-linked, or
    copied where links fail; others have their target tensors copied raw), the module in
    ``MODULE_FILE`` stored as the target's layers are (``stored_module``: FP8 / MXFP4 in a quantized
    checkpoint), a ``model.safetensors.index.json`` over all, and ``src``'s config.json with the
    module's ``dspark_*`` keys. Other files (tokenizer, generation config) are copied, and
    ``sidecars`` ({file name: text}) written beside them."""
    s = Path(src)
    hf = _target_config(s, cfg)
    reader = safetensors_io.TensorReader(s)
    return _write(s, dst, hf, cfg, stored_module(cfg, params, s, reader.infos), reader, force, sidecars)


def _target_config(src: Path, cfg: DeepseekV4DSparkConfig) -> dict:
    """``src``'s config.json; CheckpointError unless it is the model ``cfg``'s module was built on."""
    hf = read_json_object(src / "config.json", "config.json")
    if _model(type(cfg).from_hf(_with_module(hf, cfg)).target) != _model(cfg.target):
        raise CheckpointError(f"{src}: the module's target config differs from this checkpoint's")
    return hf


def _write(s: Path, dst, hf: Mapping, cfg: DeepseekV4DSparkConfig, tensors: Mapping, reader, force: bool,
           sidecars: Mapping[str, str] | None) -> Path:
    """``write_checkpoint``'s writing, of the module's stored ``tensors``."""
    by_file: dict[str, list[str]] = {}
    for name, info in reader.infos.items():
        by_file.setdefault(info.file, []).append(name)
    weight_map = {}
    with atomic_dir(dst, force=force) as tmp:
        for file, names in by_file.items():
            keep = [n for n in names if not n.startswith(PREFIX)]
            if not keep:
                continue
            if len(keep) == len(names):
                try:
                    os.link(s / file, tmp / file)
                except OSError:
                    shutil.copy2(s / file, tmp / file)
            else:
                safetensors_io.copy_raw(s, keep, tmp / file)
            weight_map.update({n: file for n in keep})
        safetensors_io.write_file(tmp / MODULE_FILE, tensors)
        weight_map.update({n: MODULE_FILE for n in tensors})
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        (tmp / safetensors_io.INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(_with_module(hf, cfg), indent=2) + "\n")
        for other in s.iterdir():
            if other.is_file() and other.suffix != ".safetensors" and other.name not in (
                    "config.json", safetensors_io.INDEX_NAME):
                shutil.copy2(other, tmp / other.name)
        for name, text in (sidecars or {}).items():
            (tmp / name).write_text(text)
    return Path(dst)

