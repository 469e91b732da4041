"""Stream large safetensors checkpoints onto a Mesh, and back, one tensor slice at a time.

Loading: each params leaf becomes ``jax.make_array_from_callback``; the callback
reads only the slice a local device holds (``safe_open(...).get_slice``), so a
process never materialises tensors its devices do not own. Stacked layer
leaves [L, ...] read just the layers in the requested slice. Exporting writes
one tensor at a time (gathered to host 0), so peak host memory is about one
tensor, not the model.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Mapping

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.convert import mapping, quant
from dspark_jax.convert.safetensors_io import TensorReader
from dspark_jax.params import ParamSpec


class _SliceReader:
    """Keeps one safe_open handle per shard file; reads [rows, cols] slices of named tensors."""

    def __init__(self, reader: TensorReader, stack: contextlib.ExitStack, stored: Mapping[str, str],
                 quantized: Mapping[str, "quant.Stored"] = {}):
        from safetensors import safe_open
        self._reader = reader
        self._stored = stored  # declared name -> the checkpoint's name
        self._quantized = quantized  # declared name -> its quantized format and scale
        self._handles = {}
        self._stack = stack
        self._open = safe_open
        self.bytes_read = 0

    def read(self, name: str, index: tuple, transpose: bool) -> np.ndarray:
        if name in self._quantized:  # dequantized whole (one expert / one weight), then sliced
            q = self._quantized[name]
            full = quant.dequantize(self._reader.get(self._stored.get(name, name)),
                                    self._reader.get(self._stored.get(q.scale, q.scale)), q.quant)
            full = full.T if transpose else full
            block = full[tuple(index)] if index else full
            self.bytes_read += block.nbytes
            return block
        name = self._stored.get(name, name)
        info = self._reader.infos[name]
        if info.file not in self._handles:
            path = str(self._reader.directory / info.file)
            self._handles[info.file] = self._stack.enter_context(self._open(path, framework="np"))
        sl = self._handles[info.file].get_slice(name)
        idx = tuple(reversed(index)) if transpose else tuple(index)
        block = np.asarray(sl[idx] if idx else sl[:])
        self.bytes_read += block.nbytes
        return block.T if transpose else block


def stream_load(directory, config, mesh: Mesh, *, dtype=None,
                rules: Mapping[str, object] = sharding_lib.DEFAULT_RULES, stats: dict | None = None):
    """Params of a HF safetensors checkpoint (single file or sharded index), placed on ``mesh``.

    Names, shapes, layouts and logical axes come from the config's family declaration.
    Shapes are validated from headers before any data is read. Every array is
    built with ``jax.make_array_from_callback``: only the slices of this
    process's devices are read. ``stats`` (optional dict) receives bytes_read.
    """
    reader = TensorReader(directory)
    specs = families.declare(config)
    hf_path = Path(directory) / "config.json"
    hf = json.loads(hf_path.read_text()) if hf_path.is_file() else {}
    names = families.for_config(config).stored_names(hf, reader.infos)  # declared -> stored
    infos = mapping.checkpoint_tensors(config, {d: reader.infos[s] for d, s in names.items()},
                                       f"checkpoint {directory}")
    fixed = params_lib.fixed_dtypes(specs)
    infos, stored = quant.logical_infos(params_lib.quantized(specs), infos, f"checkpoint {directory}",
                                        lambda shape, dt, info: _ShapeOnly(shape, dt), fixed)
    mapping.check_tensors({k: _ShapeOnly(v.shape, v.dtype) for k, v in infos.items()},
                          params_lib.torch_shapes(specs), f"checkpoint {directory}", fixed=fixed)
    flat: dict = {}
    with contextlib.ExitStack() as stack:
        slices = _SliceReader(reader, stack, names, stored)
        for path, spec in specs.items():
            src_dtype = infos[spec.torch_names()[0]].dtype
            out_dtype = np.dtype(spec.dtype or dtype or src_dtype)
            pspec = sharding_lib.logical_to_spec(spec.axes, rules, spec.shape, mesh)
            flat[path] = jax.make_array_from_callback(spec.shape, NamedSharding(mesh, pspec),
                                                      _make_callback(slices, spec, out_dtype))
        if stats is not None:
            stats["bytes_read"] = slices.bytes_read
    return traverse_util.unflatten_dict(flat)


class _ShapeOnly:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _make_callback(slices: _SliceReader, spec: ParamSpec, out_dtype: np.dtype) -> Callable:
    def callback(index):
        if not spec.stacked:
            block = slices.read(spec.torch, index, spec.transpose)
        else:
            n = len(spec.stacks)  # leading stacking axes (layers, then experts)
            names = np.asarray(spec.torch_names(), dtype=object).reshape(spec.stack_shape)[tuple(index[:n])]
            blocks = [slices.read(name, index[n:], spec.transpose) for name in names.reshape(-1)]
            block = np.stack(blocks).reshape(*names.shape, *blocks[0].shape)
        return params_lib.check_bound(spec, block).astype(out_dtype, copy=False)
    return callback


def stream_export(directory, config, params, *, force: bool = False,
                  max_shard_size="2GB") -> Path:
    """Write (possibly sharded) params as a HF checkpoint, one tensor at a time.

    Each tensor is gathered to the host (``process_allgather`` on multi-host
    meshes), written, and dropped before the next, so host memory peaks at one
    tensor. Only process 0 writes; the directory appears atomically.
    """
    from dspark_jax.convert import checkpoint as ckpt

    specs = families.declare(config)

    def tensors():
        return params_lib.iter_torch(specs, params, to_host=_to_host)

    if jax.process_index() != 0:
        for _ in tensors():  # participate in the collectives, write nothing
            pass
        return Path(directory)
    with ckpt.atomic_dir(directory, force=force) as tmp:
        write_tensor_stream(tmp, tensors(), max_shard_size=max_shard_size)
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    return Path(directory)


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)



def write_tensor_stream(directory: Path, tensors, *, max_shard_size="2GB") -> None:
    """Write (name, array) pairs as safetensors shards of at most ``max_shard_size`` bytes.

    Holds at most one shard in memory. One shard is named ``model.safetensors``;
    several get HF names ``model-0000k-of-0000n.safetensors`` and an index.
    """
    from safetensors.numpy import save_file

    from dspark_jax.convert.safetensors_io import INDEX_NAME, WEIGHTS_NAME, parse_size

    limit = parse_size(max_shard_size)
    directory = Path(directory)
    shards: list[tuple[str, list[str]]] = []
    pending: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        nonlocal pending, size
        if pending:
            tmp_name = f"shard-{len(shards):05d}.tmp"
            save_file(pending, str(directory / tmp_name))
            shards.append((tmp_name, list(pending)))
            pending, size = {}, 0

    for name, array in tensors:
        if pending and size + array.nbytes > limit:
            flush()
        pending[name] = array
        size += array.nbytes
        total += array.nbytes
    flush()
    if len(shards) == 1:
        (directory / shards[0][0]).rename(directory / WEIGHTS_NAME)
        return
    weight_map = {}
    for k, (tmp_name, names) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / tmp_name).rename(directory / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
