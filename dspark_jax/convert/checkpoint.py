"""Load and save drafters and targets: PyTorch/HF directories and our own format.

Two on-disk formats, detected by ``detect_format``:

* ``"torch"``: a Hugging Face directory, ``config.json`` plus ``model.safetensors``
  or a sharded ``model.safetensors.index.json``. Its ``architectures`` picks the model
  family (``families.for_hf``), whose declaration gives the tensor names and layouts. Pickled
  ``*.bin``/``*.pt`` weights only with ``allow_pickle=True``.
* ``"jax"``: a directory with ``dspark_jax.json`` ::

      {"format": "dspark-jax", "version": 1, "kind": "draft"|"target",
       "dtype": "float32", "config": <HF config dict>, "extras": {...}}

  and the params pytree (our layout: kernels [in, out], stacked layers) saved
  with orbax under ``params/``. Restores are bit-exact (bfloat16 included).

Every load validates names, shapes and dtypes against the config's declaration before any
tensor data is read, and raises CheckpointError/ConfigError naming the
offending tensor or field. Every save writes into a temporary directory next
to the destination and renames it at the end; an existing destination is
refused unless ``force=True``; a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import mapping, quant, safetensors_io
from dspark_jax.errors import CheckpointError, ConfigError, InputError
from dspark_jax.params import Family

META_NAME = "dspark_jax.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1
# Files copied alongside the weights when converting (tokenizer, generation defaults).
ASIDE_NAME = "aside.safetensors"  # tensors a family keeps but does not read (``Family.aside_tensors``)
SIDECAR_FILES = (ASIDE_NAME, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "chat_template.jinja", "chat_template.json")
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
           "float16": np.dtype(np.float16)}


# --------------------------------------------------------------------------- helpers

def _np_dtype(dtype) -> np.dtype | None:
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _DTYPES:
        raise InputError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from ``path`` (``what`` names it in errors: missing, unparsable, not an object)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: {what} is missing") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot parse {what} ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object")
    return data


def _fixed(config) -> dict[str, str]:
    """``"a/b"`` leaf path -> dtype of the leaves ``config``'s family keeps in their own dtype."""
    return params_lib.fixed_paths(families.declare(config)) if config is not None else {}


def _tree_dtype(params, config=None) -> np.dtype:
    fixed = _fixed(config)
    dtypes = {np.dtype(x.dtype) for k, x in _flat(params).items() if k not in fixed}
    return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)


def _cast_tree(tree, dtype: np.dtype | None, config=None):
    """numpy leaves -> jnp leaves (optionally cast; leaves with a fixed dtype keep it)."""
    fixed = _fixed(config)

    def leaf(path, x):
        x = np.asarray(x)
        want = fixed.get("/".join(str(getattr(k, "key", k)) for k in path), dtype)
        if want is not None and x.dtype != np.dtype(want):
            x = x.astype(want)
        return jnp.asarray(x)
    return jax.tree_util.tree_map_with_path(leaf, tree)


def _family_of_hf(hf: Mapping[str, Any], where: str) -> Family:
    return families.for_hf(hf, where)


def detect_format(path) -> str:
    """'jax' (``dspark_jax.json`` present) or 'torch' (``config.json`` + weights)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CheckpointError(f"{p}: is a file; a checkpoint is a directory (config.json + weights, "
                              f"or {META_NAME} + params/): pass its directory")
    if not p.is_dir():
        raise CheckpointError(f"{p}: checkpoint directory does not exist")
    if (p / META_NAME).is_file():
        return "jax"
    if (p / "config.json").is_file():
        return "torch"
    raise CheckpointError(f"{p}: neither {META_NAME} (dspark-jax format) nor config.json "
                          "(PyTorch / Hugging Face format) found")


def detect_family(path) -> Family:
    """The model family of a checkpoint directory, from its stored config's architectures."""
    p = Path(path)
    if detect_format(p) == "jax":
        return _family_of_hf(_read_meta(p)["config"], f"{p / META_NAME} 'config'")
    return _family_of_hf(read_json_object(p / "config.json", "config.json"), str(p / "config.json"))


def detect_kind(path) -> str:
    """'draft' or 'target', from the stored config's architectures."""
    p = Path(path)
    if detect_format(p) == "jax":
        return _read_meta(p)["kind"]
    return detect_family(p).kind


def _read_meta(p: Path) -> dict:
    meta = read_json_object(p / META_NAME, META_NAME)
    where = str(p / META_NAME)
    if meta.get("format") != "dspark-jax":
        raise CheckpointError(f"{where}: field 'format' is {meta.get('format')!r}, expected 'dspark-jax'")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: field 'version' is {meta.get('version')!r}; this build reads "
                              f"version {FORMAT_VERSION}")
    if meta.get("kind") not in ("draft", "target"):
        raise CheckpointError(f"{where}: field 'kind' is {meta.get('kind')!r}, expected 'draft' or 'target'")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{where}: field 'config' is missing")
    return meta


# --------------------------------------------------------------------------- atomic output

from dspark_jax.fileio import atomic_dir  # noqa: E402,F401  (one helper; re-exported)


# --------------------------------------------------------------------------- validation

def _expected_tree(config) -> dict:
    """ShapeDtypeStruct tree of our params for ``config`` (from its declaration)."""
    return params_lib.abstract_params(families.declare(config))


def _flat(tree) -> dict[str, Any]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(getattr(k, "key", k)) for k in path)] = leaf
    return out


def check_params(config, params, what: str) -> None:
    """Raise CheckpointError unless ``params`` (ours, any leaf type with shape/dtype) fit ``config``."""
    want = _flat(_expected_tree(config))
    have = _flat(params)
    fixed = _fixed(config)
    for k in want:
        if k not in have:
            raise CheckpointError(f"{what}: missing param {k!r}")
    for k in have:
        if k not in want:
            raise CheckpointError(f"{what}: unexpected param {k!r} for this config")
    for k, leaf in have.items():
        if tuple(leaf.shape) != tuple(want[k].shape):
            raise CheckpointError(f"{what}: param {k!r} has shape {tuple(leaf.shape)}, "
                                  f"expected {tuple(want[k].shape)}")
        dt = np.dtype(leaf.dtype)
        if k in fixed:
            if dt != np.dtype(fixed[k]):
                raise CheckpointError(f"{what}: param {k!r} has dtype {dt.name}, expected {fixed[k]}")
            continue
        if dt.name not in _DTYPES:
            raise CheckpointError(f"{what}: param {k!r} has dtype {dt.name}, expected one of {sorted(_DTYPES)}")
    names = {np.dtype(leaf.dtype).name: k for k, leaf in have.items() if k not in fixed}
    if len(names) > 1:
        raise CheckpointError(f"{what}: params have mixed dtypes: "
                              + ", ".join(f"{k!r} is {d}" for d, k in sorted(names.items())))


# --------------------------------------------------------------------------- torch format

def _config_from_hf(kind: str, hf: Mapping[str, Any], where: str, directory=None):
    family = _family_of_hf(hf, where)
    if family.kind != kind:
        raise ConfigError(f"{where}: architectures {hf.get('architectures')!r} is a {family.kind}, "
                          f"not a {kind} checkpoint")
    return family.config_from_hf(hf, directory)


def validated_torch(kind: str, p: Path, *, allow_pickle: bool = False):
    """(config.json dict, config, TensorReader, {declared: stored name}, {declared: TensorInfo at
    the dequantized shape and dtype}, {declared: quant.Stored} of the quantized ones) of a HF
    directory, validated from its headers only: no tensor data is read."""
    hf = read_json_object(p / "config.json", "config.json")
    cfg = _config_from_hf(kind, hf, str(p / "config.json"), p)
    family = families.for_config(cfg)
    reader = safetensors_io.TensorReader(p, allow_pickle=allow_pickle)
    what = f"{p}"
    specs = families.declare(cfg)
    names = family.stored_names(hf, reader.infos)  # declared -> stored (multimodal layouts)
    infos = mapping.checkpoint_tensors(cfg, {d: reader.infos[s] for d, s in names.items()}, what)
    fixed = params_lib.fixed_dtypes(specs)
    infos, stored = quant.logical_infos(params_lib.quantized(specs), infos, what,
                                        lambda shape, dtype, info: dataclasses.replace(info, shape=shape, dtype=dtype),
                                        fixed)
    mapping.check_tensors(infos, params_lib.torch_shapes(specs), what, fixed=fixed)
    return hf, cfg, reader, names, infos, stored


def _load_torch(kind: str, p: Path, *, allow_pickle: bool):
    hf, cfg, reader, names, infos, stored = validated_torch(kind, p, allow_pickle=allow_pickle)
    specs = families.declare(cfg)
    tensors = {}
    for d in infos:
        tensors[d] = reader.get(names[d])
        if d in stored:
            scale = reader.get(names[stored[d].scale])
            tensors[d] = quant.dequantize(tensors[d], scale, stored[d].quant).astype(infos[d].dtype)
    if params_lib.quantized(specs):  # the params are unquantized: so is the config written back
        hf = {k: v for k, v in hf.items() if k not in ("quantization_config", "expert_dtype")}
        cfg = cfg.dequantized()
    return cfg, _text_config(hf), mapping.from_torch(cfg, tensors)


def _text_config(hf: Mapping[str, Any]) -> dict:
    """The config a checkpoint is written back with: a multimodal wrapper's ``text_config`` (its
    towers are not read, so the copy is the text model), else ``hf`` itself."""
    return dict(hf["text_config"]) if isinstance(hf.get("text_config"), dict) else dict(hf)


def _write_torch(tmp: Path, kind: str, config, params, *, extras, max_shard_size) -> None:
    host = jax.tree.map(np.asarray, params)
    check_params(config, host, f"{kind} params")
    tensors = mapping.to_torch(config, host)
    hf = config.to_hf()
    dtype = _tree_dtype(host, config).name
    hf["dtype"] = dtype
    hf.pop("torch_dtype", None)
    if extras:
        hf["dspark_jax"] = {"extras": dict(extras)}
    safetensors_io.write_tensors(tmp, tensors, max_shard_size=max_shard_size)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- jax format

def _load_jax(kind: str, p: Path):
    import orbax.checkpoint as ocp

    meta = _read_meta(p)
    if meta["kind"] != kind:
        raise CheckpointError(f"{p / META_NAME}: field 'kind' is {meta['kind']!r}, not {kind!r}")
    hf = meta["config"]
    cfg = _config_from_hf(kind, hf, f"{p / META_NAME} 'config'", p)
    params_dir = (p / PARAMS_DIR).absolute()
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir}: params directory is missing")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            stored = ckptr.metadata(params_dir).item_metadata.tree
        except Exception as e:
            raise CheckpointError(f"{params_dir}: cannot read orbax metadata ({e})") from e
        check_params(cfg, stored, str(params_dir))
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding),
                                stored)
        try:
            params = ckptr.restore(params_dir, abstract)
        except Exception as e:
            raise CheckpointError(f"{params_dir}: cannot restore params ({e})") from e
    return cfg, hf, params, meta.get("extras") or {}


def _write_jax(tmp: Path, kind: str, config, params, *, extras) -> None:
    import orbax.checkpoint as ocp

    params = jax.tree.map(jnp.asarray, params)
    check_params(config, params, f"{kind} params")
    hf = config.to_hf()
    hf["dtype"] = _tree_dtype(params, config).name
    hf.pop("torch_dtype", None)
    meta = {"format": "dspark-jax", "version": FORMAT_VERSION, "kind": kind,
            "dtype": hf["dtype"], "config": hf, "extras": dict(extras or {})}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((tmp / PARAMS_DIR).absolute(), params)
        ckptr.wait_until_finished()
    (tmp / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- public API

def _load(kind: str, path, dtype, allow_pickle: bool):
    p = Path(path)
    fmt = detect_format(p)
    if fmt == "jax":
        cfg, hf, params, _ = _load_jax(kind, p)
    else:
        cfg, hf, params = _load_torch(kind, p, allow_pickle=allow_pickle)
    return cfg, hf, _cast_tree(params, _np_dtype(dtype), cfg)


def load_draft(path, dtype=None, *, allow_pickle: bool = False,
               target_params: Mapping | None = None) -> tuple[DraftConfig, dict]:
    """(config, params with jnp leaves) from a drafter directory (torch or jax format), or the
    DSpark module inside a DeepSeek-V4 checkpoint (``mtp.*`` + ``dspark_*`` keys; it shares
    ``target_params``' embedding and head when given, else reads the checkpoint's).

    ``dtype`` None keeps the stored dtype; 'float32'/'bfloat16' casts.
    """
    from dspark_jax.convert import dspark_v4  # it imports this module
    if dspark_v4.holds_module(path):
        cfg, params = dspark_v4.load_module(path, shared=target_params is None)
        params = _cast_tree(params, _np_dtype(dtype), cfg)
        if target_params is not None:
            params = dspark_v4.with_target(params, target_params)
        return cfg, params
    cfg, _, params = _load("draft", path, dtype, allow_pickle)
    return cfg, params


def load_target(path, dtype=None, *, allow_pickle: bool = False) -> tuple[TargetConfig, dict]:
    """(config, params with jnp leaves) from a target directory of any registered family (Qwen3,
    Gemma4 text or multimodal; torch or jax format)."""
    cfg, _, params = _load("target", path, dtype, allow_pickle)
    return cfg, params


def read_extras(path) -> dict:
    """The ``extras`` dict saved with a checkpoint ({} when none)."""
    p = Path(path)
    if detect_format(p) == "jax":
        return dict(_read_meta(p).get("extras") or {})
    hf = read_json_object(p / "config.json", "config.json")
    return dict((hf.get("dspark_jax") or {}).get("extras") or {})


def sts_temperatures(draft_dir, override=None) -> list[float] | None:
    """STS temperatures for decoding: ``override`` (a flag) if given, else the ones saved
    with the drafter (``extras["sts_temperatures"]`` from `calibrate --write-draft`), else None."""
    if override is not None:
        return list(override)
    temps = read_extras(draft_dir).get("sts_temperatures")
    if temps is not None and not (isinstance(temps, list)
                                  and all(isinstance(t, (int, float)) for t in temps)):
        raise CheckpointError(f"drafter {str(draft_dir)!r}: extras['sts_temperatures'] must be a "
                              f"list of numbers, got {temps!r}")
    return temps


def default_stop_ids(target_dir, tokenizer=None) -> list[int]:
    """Stop tokens of a target: ``eos_token_id`` of its generation_config.json, else of its
    config.json, else the tokenizer's (empty when none is known)."""
    target_dir = Path(target_dir)
    for name in ("generation_config.json", "config.json"):
        path = target_dir / name
        if path.is_file():
            eos = read_json_object(path, name).get("eos_token_id")
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else sorted({int(e) for e in eos})
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return [int(eos)] if eos is not None else []


def _save(kind, path, config, params, *, format, force, extras, max_shard_size) -> Path:
    if format not in ("torch", "jax"):
        raise InputError(f"format={format!r} is unknown; expected 'torch' or 'jax'")
    family = families.for_config(config)
    if family.kind != kind:
        raise ConfigError(f"{type(config).__name__} is a {family.kind} config ({family.name}), "
                          f"not a {kind} config")
    with atomic_dir(path, force=force) as tmp:
        if format == "torch":
            _write_torch(tmp, kind, config, params, extras=extras,
                         max_shard_size=max_shard_size)
        else:
            _write_jax(tmp, kind, config, params, extras=extras)
    return Path(path)


def save_draft(path, config: DraftConfig, params, *, format: str = "torch", force: bool = False,
               extras: Mapping | None = None, max_shard_size=None) -> Path:
    """Write a drafter: 'torch' (config.json + safetensors, loadable by the reference) or 'jax'."""
    return _save("draft", path, config, params, format=format, force=force, extras=extras,
                 max_shard_size=max_shard_size)


def save_target(path, config: TargetConfig, params, *, format: str = "torch", force: bool = False,
                extras: Mapping | None = None, max_shard_size=None) -> Path:
    """Write a target: 'torch' (HF directory of the family's CausalLM, e.g. Qwen3ForCausalLM,
    Gemma4UnifiedForCausalLM) or 'jax'."""
    return _save("target", path, config, params, format=format, force=force, extras=extras,
                 max_shard_size=max_shard_size)


def convert(src, dst, *, to: str | None = None, force: bool = False, allow_pickle: bool = False,
            dtype=None, max_shard_size=None, allow_nonfinite: bool = False) -> str:
    """Convert a drafter or target of any registered family between formats; returns the format written.

    ``to`` defaults to the other format (torch -> jax, jax -> torch). Unknown
    config.json fields, extras and tokenizer/generation files are carried over. Tensors
    holding NaN/inf are a CheckpointError naming them, unless ``allow_nonfinite`` (a warning).
    One stored tensor at a time, so host memory stays about one tensor (``bounded.convert_bounded``).
    """
    from dspark_jax.convert import bounded
    return bounded.convert_bounded(src, dst, to=to, force=force, allow_pickle=allow_pickle, dtype=dtype,
                                   max_shard_size=max_shard_size, allow_nonfinite=allow_nonfinite)


def _write_aside(tmp: Path, src: Path, family: Family) -> None:
    """A torch source's ``family.aside_tensors`` copied byte for byte into ``tmp / ASIDE_NAME``."""
    if not family.aside_tensors or detect_format(src) != "torch" or not any(
            (src / n).is_file() for n in (safetensors_io.WEIGHTS_NAME, safetensors_io.INDEX_NAME)):
        return
    names = [n for n in safetensors_io.TensorReader(src).infos if n.startswith(family.aside_tensors)]
    if names:
        count = safetensors_io.copy_raw(src, names, tmp / ASIDE_NAME)
        from dspark_jax.errors import warn
        warn(f"{src}: {count} tensor(s) under {', '.join(family.aside_tensors)} are not part of the "
             f"{family.name} model; kept unchanged in {ASIDE_NAME}")


def describe(path) -> dict:
    """A JSON-able summary of a checkpoint directory: format, kind, dtype, files, param count."""
    p = Path(path)
    fmt, kind = detect_format(p), detect_kind(p)
    files = sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file())
    size = sum((p / f).stat().st_size for f in files)
    return {"path": str(p), "format": fmt, "kind": kind, "files": len(files), "bytes": size}
