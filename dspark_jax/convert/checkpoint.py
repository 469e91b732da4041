"""Load and save drafters and targets of any registered family, in either on-disk format (``formats``).

Every load validates names, shapes and dtypes against the config's declaration before any
tensor data is read (``formats.validated_torch`` / ``formats.check_params``); restores are
bit-exact (bfloat16 included). Every save writes into a temporary directory next to the
destination and renames it at the end (``fileio.atomic_dir``); an existing destination is
refused unless ``force=True``; a failure leaves nothing behind. ``convert`` between the formats
runs one tensor at a time (``bounded``); a DeepSeek-V4 checkpoint's DSpark module loads as a
drafter (``dspark_v4``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import bounded, dspark_v4, foreign, mapping, module_io, mtp_v4, quant, safetensors_io
from dspark_jax.draft import kinds
from dspark_jax.convert.formats import (FORMAT_VERSION, META_NAME, PARAMS_DIR, cast_tree, check_params,
                                        config_from_hf, detect_format, detect_kind, np_dtype, read_json_object,
                                        read_meta, text_config, tree_dtype, validated_torch)
from dspark_jax.errors import CheckpointError, ConfigError, InputError
from dspark_jax.fileio import atomic_dir


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
    return cfg, text_config(hf), mapping.from_torch(cfg, tensors)


def _write_torch(tmp: Path, kind: str, config, params, *, extras, max_shard_size) -> None:
    host = jax.tree.map(np.asarray, params)
    check_params(config, host, f"{kind} params")
    tensors = mapping.to_torch(config, host)
    hf = config.to_hf()
    dtype = tree_dtype(host, config).name
    hf["dtype"] = dtype
    hf.pop("torch_dtype", None)
    if extras:
        hf["dspark_jax"] = {"extras": dict(extras)}
    safetensors_io.write_tensors(tmp, tensors, max_shard_size=max_shard_size)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- jax format

def _load_jax(kind: str, p: Path):
    import orbax.checkpoint as ocp

    meta = read_meta(p)
    if meta["kind"] != kind:
        raise CheckpointError(f"{p / META_NAME}: field 'kind' is {meta['kind']!r}, not {kind!r}")
    hf = meta["config"]
    cfg = config_from_hf(kind, hf, f"{p / META_NAME} 'config'", p)
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
    hf["dtype"] = tree_dtype(params, config).name
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
    return cfg, hf, cast_tree(params, np_dtype(dtype), cfg)


def load_draft(path, dtype=None, *, allow_pickle: bool = False,
               target_params: Mapping | None = None, steps: int | None = None) -> tuple[DraftConfig, dict]:
    """(config, params with jnp leaves) from a drafter directory (torch or jax format), or the
    module inside a DeepSeek-V4 checkpoint: its DSpark module (``mtp.*`` + ``dspark_*`` keys) or
    its MTP module (``mtp.0.*``, a chain drafter); either shares ``target_params``' embedding and
    head when given, else reads the checkpoint's.

    ``dtype`` None keeps the stored dtype; 'float32'/'bfloat16' casts. ``steps`` (``--draft-steps``):
    the drafts per round of a chain drafter (MTP-k); ConfigError for a drafter whose round is fixed
    by its checkpoint (a block drafter), CheckpointError for a V4 checkpoint without a module.
    """
    if module_io.module_dir(path) is not None:  # a checkpoint's DSpark module (either format)
        cfg, params = module_io.load_module_draft(path, load_target, target_params,
                                                  cast=lambda p, c: cast_tree(p, np_dtype(dtype), c))
    elif mtp_v4.holds_module(path):
        cfg, params = mtp_v4.load_module(path, shared=target_params is None)
        params = cast_tree(params, np_dtype(dtype), cfg)
        if target_params is not None:
            params = dspark_v4.with_target(params, target_params)
    elif mtp_v4.is_v4(path):
        raise CheckpointError(f"{path}: a DeepSeek-V4 checkpoint without a drafter module (no dspark_* keys, "
                              f"no {mtp_v4.MARK} tensor); pass a checkpoint holding one as --draft")
    else:
        cfg, _, params = _load("draft", path, dtype, allow_pickle)
    return (cfg if steps is None else with_steps(cfg, steps, path)), params


def with_steps(cfg, steps: int, path) -> DraftConfig:
    """``cfg`` proposing ``steps`` drafts per round (``runtime.Proposer.with_steps``); ConfigError
    (one line) for a drafter kind whose round its checkpoint fixes."""
    kind = kinds.proposer(cfg)
    if kind.with_steps is None:
        raise ConfigError(f"--draft-steps {steps}: {path} holds a {families.for_config(cfg).name} drafter, which "
                          f"proposes its checkpoint's block of {cfg.block_size} tokens; only a chain drafter "
                          f"(an MTP module) takes steps")
    return kind.with_steps(cfg, steps)


def load_target(path, dtype=None, *, allow_pickle: bool = False) -> tuple[TargetConfig, dict]:
    """(config, params with jnp leaves) from a target directory of any registered family (Qwen3,
    Gemma4 text or multimodal; torch or jax format)."""
    cfg, _, params = _load("target", path, dtype, allow_pickle)
    return cfg, params


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
    return bounded.convert_bounded(src, dst, to=to, force=force, allow_pickle=allow_pickle, dtype=dtype,
                                   max_shard_size=max_shard_size, allow_nonfinite=allow_nonfinite)


def convert_foreign(src, dst, fmt: str | None = None, *, target=None, num_target_layers=None,
                    to: str = "jax", force: bool = False, dtype=None) -> Path:
    """Import a foreign drafter and save it in our format (or the reference torch layout)."""
    cfg, params, _ = foreign.load_foreign(src, fmt, target=target, num_target_layers=num_target_layers)
    if dtype is not None:
        params = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, dtype)), params)
    return save_draft(dst, cfg, params, format=to, force=force,
                      extras={"imported_from": fmt or foreign.detect(src)})


def nonfinite(params) -> list[str]:
    """Paths ("a/b/kernel") of the float leaves of ``params`` holding NaN/inf, in tree order:
    what ``convert`` refuses, so what ``export`` and ``inspect`` refuse too."""
    from flax import traverse_util
    bad = []
    for path, a in traverse_util.flatten_dict(dict(params)).items():
        a = np.asarray(a)
        if a.dtype.kind in "fV" and not np.isfinite(a.astype(np.float32)).all():
            bad.append("/".join(map(str, path)))
    return bad


def describe(path) -> dict:
    """A JSON-able summary of a checkpoint directory: format, kind, dtype, files, param count."""
    p = Path(path)
    fmt, kind = detect_format(p), detect_kind(p)
    files = sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file())
    size = sum((p / f).stat().st_size for f in files)
    return {"path": str(p), "format": fmt, "kind": kind, "files": len(files), "bytes": size}
