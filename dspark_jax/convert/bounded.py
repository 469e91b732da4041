"""Convert a checkpoint one stored tensor at a time: host memory bounded by a few tensors.

``checkpoint.convert`` (and so ``dspark-jax convert``) runs here, so a checkpoint larger than the
host's RAM converts. The unit of work is one PyTorch tensor (one layer's, one expert's): it is
read (dequantized from FP8 / MXFP4 when stored so), cast, and written before the next is read,
in either direction:

* torch source: ``safe_open`` reads only that tensor (mmapped); its scale too when quantized.
* jax source: tensorstore reads only that slice ``[i, e]`` of the orbax leaf (a leaf stored as
  one chunk, as orbax's own save writes it, is read whole once: one leaf in memory).
* torch output: safetensors headers are planned from the declaration first, then each tensor's
  bytes are appended as it arrives (``safetensors_io.write_planned``); ``quantize="fp8"`` stores
  the declared quantizable weights as FP8 (and the routed experts as MXFP4 when
  ``expert_dtype="fp4"``), each with its ue8m0 block scale.
* jax output: orbax writes the tree's structure and metadata from 1-element placeholders, then
  each leaf is created at its full shape in the same OCDBT store, chunked one unit per chunk,
  and filled unit by unit with tensorstore; the result restores with orbax like any other.

Everything is validated from headers before any data is read (as ``checkpoint.convert``). The
output appears atomically. ``stats`` receives ``units`` and ``peak_unit_bytes``: the most tensor
bytes held at once (a unit read and converted; for jax output, the ``WRITES_IN_FLIGHT`` unit
writes tensorstore may still hold).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.convert import formats, module_io, quant, safetensors_io
from dspark_jax.errors import CheckpointError, InputError, warn
from dspark_jax.fileio import atomic_dir


WRITES_IN_FLIGHT = 8  # jax output: unit writes tensorstore may hold (a copy each) while earlier ones commit


@dataclasses.dataclass
class _Unit:
    """One PyTorch tensor of a leaf: its torch name, leaf path and index along the stacking axes."""

    name: str
    path: tuple
    spec: params_lib.ParamSpec
    index: tuple


def _units(specs) -> list[_Unit]:
    out = []
    for path, spec in specs.items():
        names = spec.torch_names()
        for k, name in enumerate(names):
            index = tuple(int(i) for i in np.unravel_index(k, spec.stack_shape)) if spec.stacked else ()
            out.append(_Unit(name, path, spec, index))
    return out


def _leaf_dtype(spec, source_dtype: np.dtype, dtype: np.dtype | None) -> np.dtype:
    """Our params dtype of a leaf: its fixed dtype, else ``dtype`` (a cast), else the source's."""
    return np.dtype(spec.dtype) if spec.dtype else np.dtype(dtype or source_dtype)


# --------------------------------------------------------------------------- sources

class TorchSource:
    """A HF directory, validated from its headers; ``read(unit)`` -> the tensor in torch layout,
    dequantized, in our leaf dtype."""

    def __init__(self, p: Path, kind: str, allow_pickle: bool = False):
        hf, cfg, self.reader, self.names, self.infos, self.stored = formats.validated_torch(kind, p, allow_pickle=allow_pickle)
        self.source_config = cfg
        if params_lib.quantized(families.declare(cfg)):  # the params are unquantized: so is the config written
            hf = {k: v for k, v in hf.items() if k not in ("quantization_config", "expert_dtype")}
            cfg = cfg.dequantized()
        self.config, self.hf = cfg, formats.text_config(hf)
        self.extras = (hf.get("dspark_jax") or {}).get("extras") or {}
        self.specs = families.declare(cfg)

    def dtype(self, unit: _Unit) -> np.dtype:
        return np.dtype(self.infos[unit.name].dtype)

    def read(self, unit: _Unit) -> np.ndarray:
        a = self.reader.get(self.names[unit.name])
        if unit.name in self.stored:
            q = self.stored[unit.name]
            a = quant.dequantize(a, self.reader.get(self.names[q.scale]), q.quant).astype(self.dtype(unit))
        a = params_lib._as_dtype(a, unit.spec.dtype, unit.name)
        return params_lib.check_bound(unit.spec, a)


class JaxSource:
    """A dspark-jax directory; ``read(unit)`` -> that unit's slice of its orbax leaf (tensorstore),
    in torch layout."""

    def __init__(self, p: Path, kind: str, allow_pickle: bool = False):
        import orbax.checkpoint as ocp
        meta = formats.read_meta(p)
        if meta["kind"] != kind:
            raise CheckpointError(f"{p / formats.META_NAME}: field 'kind' is {meta['kind']!r}, not {kind!r}")
        self.hf = meta["config"]
        self.config = self.source_config = formats.config_from_hf(kind, self.hf, f"{p / formats.META_NAME} 'config'", p)
        self.extras = meta.get("extras") or {}
        self.specs = families.declare(self.config)
        self.params_dir = (p / formats.PARAMS_DIR).absolute()
        if not self.params_dir.is_dir():
            raise CheckpointError(f"{self.params_dir}: params directory is missing")
        with ocp.StandardCheckpointer() as ckptr:
            try:
                stored = ckptr.metadata(self.params_dir).item_metadata.tree
            except Exception as e:
                raise CheckpointError(f"{self.params_dir}: cannot read orbax metadata ({e})") from e
        formats.check_params(self.config, stored, str(self.params_dir))
        self.dtypes = {k: np.dtype(v.dtype) for k, v in formats.flat_params(stored).items()}
        self._stores = {}

    def dtype(self, unit: _Unit) -> np.dtype:
        return self.dtypes["/".join(unit.path)]

    def read(self, unit: _Unit) -> np.ndarray:
        if unit.path not in self._stores:  # one leaf open at a time
            store = _open_leaf(self.params_dir, unit.path)
            n = len(unit.spec.stacks)
            if any(c > 1 for c in store.chunk_layout.read_chunk.shape[:n]):
                # chunks span several units (orbax's own save: one chunk per leaf): every unit read
                # would decode the whole chunk, so the leaf is read once (memory: one leaf)
                store = store.read().result()
            self._stores = {unit.path: store}
        a = self._stores[unit.path][unit.index]
        a = np.asarray(a) if isinstance(a, np.ndarray) else a.read().result()
        return np.asarray(a.T if unit.spec.transpose else a)


def open_source(p: Path, kind: str, *, allow_pickle: bool = False):
    """The checkpoint directory ``p`` (either format) as a source of units, validated from its
    headers / orbax metadata (no tensor data read; pickled weights only with ``allow_pickle``)."""
    return (TorchSource if formats.detect_format(p) == "torch" else JaxSource)(Path(p), kind, allow_pickle)


def _leaf_spec(params_dir: Path, path: tuple) -> dict:
    """The tensorstore spec of one orbax leaf (OCDBT store, zarr array under its dotted key)."""
    return {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{params_dir}/",
                                          "path": ".".join(path) + "/"}}


def _open_leaf(params_dir: Path, path: tuple):
    import tensorstore as ts
    return ts.open(_leaf_spec(params_dir, path), open=True).result()


def _create_leaf(params_dir: Path, path: tuple, dtype: np.dtype, shape: tuple, chunk: tuple):
    """(A future of) a new zarr array (replacing orbax's placeholder) of ``shape``, chunked ``chunk``, with the
    compressor orbax uses."""
    import tensorstore as ts
    spec = _leaf_spec(params_dir, path)
    spec["metadata"] = {"shape": list(shape), "chunks": list(chunk), "compressor": {"id": "zstd", "level": 1}}
    return ts.open(spec, create=True, delete_existing=True, dtype=ts.dtype(np.dtype(dtype).name))


def _patch_orbax_shapes(params_dir: Path, specs, chunks) -> None:
    """Orbax's per-leaf records (``write_shape``, ``chunk_shape``) of the placeholders set to the
    real shapes, so its metadata describes the arrays now stored."""
    meta_path = params_dir / "_METADATA"
    meta = json.loads(meta_path.read_text())
    for path, spec in specs.items():
        meta["tree_metadata"][str(tuple(path))]["value_metadata"]["write_shape"] = list(spec.shape)
    meta_path.write_text(json.dumps(meta))
    by_key = {".".join(path): (spec.shape, chunks[path]) for path, spec in specs.items()}
    for f in (params_dir / "array_metadatas").glob("*"):
        records = json.loads(f.read_text())
        for r in records["array_metadatas"]:
            shape, chunk = by_key[r["array_metadata"]["param_name"]]
            r["array_metadata"]["write_shape"], r["array_metadata"]["chunk_shape"] = list(shape), list(chunk)
        f.write_text(json.dumps(records))


def _account(stats: dict, nbytes: int) -> None:
    stats["units"] = stats.get("units", 0) + 1
    stats["peak_unit_bytes"] = max(stats.get("peak_unit_bytes", 0), int(nbytes))


# --------------------------------------------------------------------------- sinks

def _quantized(config, quantize: str | None, expert_dtype: str):
    """(the config written, torch name -> ``Quant`` of the tensors stored quantized): ``config``
    and {} unless ``quantize``."""
    if quantize is None:
        return config, {}
    if quantize != "fp8":
        raise InputError(f"--quantize {quantize!r} is unknown; expected 'fp8'")
    if not hasattr(config, "quantized"):
        raise InputError(f"--quantize: the {families.for_config(config).name} family has no quantized "
                         "checkpoint format (DeepSeek-V4 only)")
    config = config.quantized(expert_dtype)
    return config, params_lib.quantized(families.declare(config))


def _write_torch(tmp: Path, src, units, dtypes, *, config, qplan, max_shard_size, stats, finite) -> None:
    entries = []
    for u in units:
        t = np.dtype(u.spec.torch_dtype or dtypes[u.name])
        shape = u.spec.torch_shape
        if u.name in qplan:
            q = qplan[u.name]
            stored = (*shape[:-1], shape[-1] // 2) if q.fmt == "fp4" else shape
            entries += [(u.name, np.dtype(np.int8) if q.fmt == "fp4" else quant.FP8, stored),
                        (q.scale_name(u.name), quant.UE8M0, q.scale_shape(shape))]
        else:
            entries.append((u.name, t, shape))

    def arrays():
        for u in units:
            a = src.read(u)
            finite(u, a)
            a = a.astype(dtypes[u.name], copy=False)
            held = a.nbytes
            if u.spec.torch_dtype:
                a = params_lib._as_dtype(a, u.spec.torch_dtype, u.name)
            if u.name in qplan:
                stored = quant.store(u.name, a, qplan[u.name])
                held += sum(t.nbytes for t in stored.values())
                _account(stats, held)
                yield from stored.items()
            else:
                _account(stats, held)
                yield u.name, a

    safetensors_io.write_planned(tmp, entries, arrays(), max_shard_size=max_shard_size)
    hf = {k: v for k, v in src.hf.items() if k != "dspark_jax"}
    hf.update(config.to_hf())
    float_dtypes = {dtypes[u.name] for u in units if not u.spec.dtype}
    hf["dtype"] = float_dtypes.pop().name if len(float_dtypes) == 1 else "float32"
    hf.pop("torch_dtype", None)
    if src.extras:
        hf["dspark_jax"] = {"extras": dict(src.extras)}
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


def _write_jax(tmp: Path, src, units, dtypes, *, stats, finite) -> None:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import traverse_util

    leaf_dtype = {u.path: dtypes[u.name] for u in units}
    placeholder = {path: jnp.zeros((1,) * len(spec.shape), leaf_dtype[path]) for path, spec in src.specs.items()}
    params_dir = (tmp / formats.PARAMS_DIR).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(params_dir, traverse_util.unflatten_dict(placeholder))
        ckptr.wait_until_finished()
    chunks = {path: (1,) * len(spec.stacks) + tuple(spec.shape[len(spec.stacks):])  # one unit per chunk
              for path, spec in src.specs.items()}
    opening = {path: _create_leaf(params_dir, path, leaf_dtype[path], spec.shape, chunks[path])
               for path, spec in src.specs.items()}  # each leaf at its full shape, created concurrently
    stores = {path: f.result() for path, f in opening.items()}
    in_flight: collections.deque = collections.deque()  # (future, bytes): tensorstore holds a copy until written
    try:
        for u in units:
            a = src.read(u)
            finite(u, a)
            a = np.asarray(a.T if u.spec.transpose else a).astype(leaf_dtype[u.path], copy=False)
            in_flight.append((stores[u.path][u.index].write(a), a.nbytes))
            _account(stats, sum(n for _, n in in_flight))
            if len(in_flight) >= WRITES_IN_FLIGHT:
                in_flight.popleft()[0].result()
    finally:  # no write may land in the output directory after this returns (or it is removed)
        for f, _ in in_flight:
            f.exception()
    for f, _ in in_flight:
        f.result()
    _patch_orbax_shapes(params_dir, src.specs, chunks)
    hf = {k: v for k, v in src.hf.items() if k != "dspark_jax"}
    hf.update(src.config.to_hf())
    fixed = params_lib.fixed_paths(src.specs)
    float_dtypes = {d for p, d in leaf_dtype.items() if "/".join(p) not in fixed}
    hf["dtype"] = float_dtypes.pop().name if len(float_dtypes) == 1 else "float32"
    hf.pop("torch_dtype", None)
    meta = {"format": "dspark-jax", "version": formats.FORMAT_VERSION, "kind": families.for_config(src.config).kind,
            "dtype": hf["dtype"], "config": hf, "extras": dict(src.extras)}
    (tmp / formats.META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- the conversion

def convert_bounded(src, dst, *, to: str | None = None, force: bool = False, allow_pickle: bool = False, dtype=None,
                    max_shard_size=None, allow_nonfinite: bool = False, quantize: str | None = None,
                    expert_dtype: str | None = None, stats: dict | None = None) -> str:
    """``checkpoint.convert`` one tensor at a time (see the module docstring); returns the format
    written. ``quantize="fp8"`` (torch output only): FP8 weights with ue8m0 128x128 block scales,
    routed experts in ``expert_dtype`` (default: the source config's, else "fp4" as released)."""
    src_p, dst_p = Path(src), Path(dst)
    src_fmt = formats.detect_format(src_p)
    to = to or ("jax" if src_fmt == "torch" else "torch")
    if to not in ("torch", "jax"):
        raise InputError(f"--to {to!r} is unknown; expected 'torch' or 'jax'")
    if quantize and to != "torch":
        raise InputError("--quantize writes a PyTorch checkpoint: pass --to torch")
    if src_p.absolute().resolve() == dst_p.absolute().resolve():
        raise InputError(f"{dst_p}: destination is the source directory")
    kind = formats.detect_family(src_p).kind
    source = open_source(src_p, kind, allow_pickle=allow_pickle)
    cast = formats.np_dtype(dtype)
    out_config, qplan = _quantized(source.config, quantize,
                                   expert_dtype or getattr(source.source_config, "expert_dtype", None) or "fp4")
    units = _units(source.specs)
    dtypes = {u.name: _leaf_dtype(u.spec, source.dtype(u), cast) for u in units}
    stats = {} if stats is None else stats
    bad: list[str] = []

    def finite(unit, a):
        if a.dtype.kind in "fV" and not np.isfinite(np.asarray(a, np.float32)).all():
            bad.append("/".join(unit.path))
            if not allow_nonfinite:
                raise CheckpointError(f"{src_p}: tensor {unit.name!r} ({'/'.join(unit.path)}) holds NaN/inf values "
                                      "(pass --allow-nonfinite to convert it unchanged)")

    family = families.for_config(source.config)
    module = module_io.read_module(src_p, lambda name, a: finite(_Unit(name, ("module", name), None, ()), a)) \
        if kind == "target" else None
    with atomic_dir(dst_p, force=force) as tmp:
        if to == "torch":
            _write_torch(tmp, source, units, dtypes, config=out_config, qplan=qplan, max_shard_size=max_shard_size,
                         stats=stats, finite=finite)
        else:
            _write_jax(tmp, source, units, dtypes, stats=stats, finite=finite)
        if module is not None:  # the checkpoint's own module: carried, not put aside
            module_io.write_module(tmp, to, module, json.loads((tmp / "config.json").read_text())
                                   if to == "torch" else {})
        else:
            formats.write_aside(tmp, src_p, family)
        for name in formats.SIDECAR_FILES:
            if module is not None and name == formats.ASIDE_NAME:
                continue
            if (src_p / name).is_file() and not (tmp / name).exists():
                shutil.copy2(src_p / name, tmp / name)
    if bad:
        names = sorted(set(bad))
        warn(f"{src_p}: {len(names)} tensor(s) hold NaN/inf values (converted unchanged): "
             f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    return to
