"""The two on-disk checkpoint formats: detection, metadata, and validation before any data is read.

* ``"torch"``: a Hugging Face directory, ``config.json`` plus ``model.safetensors``
  or a sharded ``model.safetensors.index.json``. Its ``architectures`` picks the model
  family (``families.for_hf``), whose declaration gives the tensor names and layouts. Pickled
  ``*.bin``/``*.pt`` weights only with ``allow_pickle=True``.
* ``"jax"``: a directory with ``dspark_jax.json`` ::

      {"format": "dspark-jax", "version": 1, "kind": "draft"|"target",
       "dtype": "float32", "config": <HF config dict>, "extras": {...}}

  and the params pytree (our layout: kernels [in, out], stacked layers) saved
  with orbax under ``params/``.

``detect_format`` / ``detect_family`` / ``detect_kind`` read only the metadata;
``validated_torch`` and ``check_params`` check names, shapes and dtypes against the family's
declaration (CheckpointError / ConfigError naming the tensor or field) before any tensor data is
read. The loaders and writers above this (``checkpoint``, ``bounded``, ``dspark_v4``, ``foreign``)
all start here.
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

def np_dtype(dtype) -> np.dtype | None:
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


def tree_dtype(params, config=None) -> np.dtype:
    fixed = _fixed(config)
    dtypes = {np.dtype(x.dtype) for k, x in flat_params(params).items() if k not in fixed}
    return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)


def cast_tree(tree, dtype: np.dtype | None, config=None):
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
        return _family_of_hf(read_meta(p)["config"], f"{p / META_NAME} 'config'")
    return _family_of_hf(read_json_object(p / "config.json", "config.json"), str(p / "config.json"))


def detect_kind(path) -> str:
    """'draft' or 'target', from the stored config's architectures."""
    p = Path(path)
    if detect_format(p) == "jax":
        return read_meta(p)["kind"]
    return detect_family(p).kind


def read_meta(p: Path) -> dict:
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


# --------------------------------------------------------------------------- validation

def _expected_tree(config) -> dict:
    """ShapeDtypeStruct tree of our params for ``config`` (from its declaration)."""
    return params_lib.abstract_params(families.declare(config))


def flat_params(tree) -> dict[str, Any]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(getattr(k, "key", k)) for k in path)] = leaf
    return out


def check_params(config, params, what: str) -> None:
    """Raise CheckpointError unless ``params`` (ours, any leaf type with shape/dtype) fit ``config``."""
    want = flat_params(_expected_tree(config))
    have = flat_params(params)
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

def config_from_hf(kind: str, hf: Mapping[str, Any], where: str, directory=None):
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
    cfg = config_from_hf(kind, hf, str(p / "config.json"), p)
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


def text_config(hf: Mapping[str, Any]) -> dict:
    """The config a checkpoint is written back with: a multimodal wrapper's ``text_config`` (its
    towers are not read, so the copy is the text model), else ``hf`` itself."""
    return dict(hf["text_config"]) if isinstance(hf.get("text_config"), dict) else dict(hf)


# --------------------------------------------------------------------------- extras

def read_extras(path) -> dict:
    """The ``extras`` dict saved with a checkpoint ({} when none)."""
    p = Path(path)
    if detect_format(p) == "jax":
        return dict(read_meta(p).get("extras") or {})
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


def write_aside(tmp: Path, src: Path, family: Family) -> None:
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
