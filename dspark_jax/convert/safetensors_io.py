"""Read and write the tensors of a Hugging Face checkpoint directory.

Reading: ``model.safetensors``, or a sharded ``model.safetensors.index.json``
(every listed shard must exist and hold exactly the tensors the index assigns
to it). ``TensorReader`` opens the files lazily: names, shapes and dtypes are
known before any data is read (so a checkpoint is validated first), and
``get``/``__iter__`` read one tensor at a time with ``safe_open``.

PyTorch pickles (``*.bin``/``*.pt``/``*.pth``) are refused unless
``allow_pickle=True``, and then read only with ``torch.load(weights_only=True)``.

Writing: one ``model.safetensors``, or shards of at most ``max_shard_size``
bytes plus ``model.safetensors.index.json`` (HF naming:
``model-00001-of-00003.safetensors``). Values and dtypes are written as given
(bfloat16 through ``ml_dtypes``), so reading back is bit-exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

from dspark_jax.errors import CheckpointError, InputError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth")
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"

# safetensors dtype tags -> numpy dtypes (bfloat16 / float8 via ml_dtypes).
_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor, read from the header only."""

    shape: tuple[int, ...]
    dtype: np.dtype
    file: str


def parse_size(text) -> int:
    """'2GB' / '500MB' / '1.5GiB' / '1000' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise InputError(f"max shard size {text!r} is not a size like '2GB', '500MB' or '1000000'")
    unit = (m.group(2) or "").upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[:1] if unit[:1] in "KMGT" else ""]
    size = int(float(m.group(1)) * base ** power)
    if size <= 0:
        raise InputError(f"max shard size {text!r} must be positive")
    return size


def has_weights(directory) -> bool:
    d = Path(directory)
    return any((d / n).exists() for n in (WEIGHTS_NAME, INDEX_NAME, PICKLE_INDEX_NAME, *PICKLE_NAMES))


def _pickle_files(d: Path) -> list[Path]:
    if (d / PICKLE_INDEX_NAME).exists():
        index = _read_index(d / PICKLE_INDEX_NAME)
        return [d / f for f in sorted(set(index.values()))]
    found = [d / n for n in PICKLE_NAMES if (d / n).exists()]
    return found or sorted(p for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth"))


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read index ({e})") from e
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{path}: field 'weight_map' is missing or empty")
    for name, file in wm.items():
        if not isinstance(file, str) or "/" in file or file in ("", ".", ".."):
            raise CheckpointError(f"{path}: weight_map[{name!r}] = {file!r} is not a file name")
    return wm


def _st_dtype(tag: str, name: str, file: Path) -> np.dtype:
    if tag not in _ST_DTYPES:
        raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {tag}")
    return _ST_DTYPES[tag]


class TensorReader:
    """Lazy, validated view of the tensors of a checkpoint directory.

    ``infos`` maps name -> TensorInfo (headers only); ``get(name)`` returns a
    numpy array; iterating yields ``(name, array)`` one tensor at a time.
    """

    def __init__(self, directory, *, allow_pickle: bool = False):
        d = Path(directory)
        self.directory = d
        self._pickled: dict[str, np.ndarray] | None = None
        if (d / INDEX_NAME).exists():
            self.files = self._open_sharded(d)
        elif (d / WEIGHTS_NAME).exists():
            self.files = [d / WEIGHTS_NAME]
            self.infos = self._headers(d / WEIGHTS_NAME)
        elif d.is_dir() and any(p.suffix in (".bin", ".pt", ".pth") for p in d.iterdir()):
            files = _pickle_files(d)
            if not allow_pickle:
                raise CheckpointError(
                    f"{d}: weights are PyTorch pickles ({', '.join(p.name for p in files)}); pickles can run "
                    "code when loaded, so they are refused. Convert them once with "
                    f"`dspark-jax convert {d} OUT --allow-pickle` (read with "
                    "torch.load(weights_only=True); Python: allow_pickle=True) and use OUT")
            self.files = files
            self._pickled = _load_pickles(files)
            self.infos = {k: TensorInfo(tuple(v.shape), v.dtype, files[0].name) for k, v in self._pickled.items()}
        else:
            raise CheckpointError(f"{d}: no weights found (expected {WEIGHTS_NAME} or {INDEX_NAME})")

    @staticmethod
    def _headers(file: Path) -> dict[str, TensorInfo]:
        from safetensors import safe_open
        try:
            with safe_open(str(file), framework="np") as f:
                out = {}
                for name in f.keys():
                    sl = f.get_slice(name)
                    out[name] = TensorInfo(tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), name, file), file.name)
                return out
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError, OSError
            raise CheckpointError(f"{file}: not a valid safetensors file ({e})") from e

    def _open_sharded(self, d: Path) -> list[Path]:
        index_path = d / INDEX_NAME
        wm = _read_index(index_path)
        shards = sorted(set(wm.values()))
        for s in shards:
            if not (d / s).is_file():
                first = next(k for k, v in wm.items() if v == s)
                raise CheckpointError(f"{index_path}: shard {s!r} (holding e.g. {first!r}) does not exist")
        self.infos = {}
        for s in shards:
            infos = self._headers(d / s)
            listed = {k for k, v in wm.items() if v == s}
            for name in infos:
                if name not in listed:
                    where = f"listed under {wm[name]!r}" if name in wm else "not listed in the index"
                    raise CheckpointError(f"{d / s}: tensor {name!r} is in this shard but {where}")
            for name in listed:
                if name not in infos:
                    raise CheckpointError(f"{index_path}: tensor {name!r} is listed in shard {s!r}, "
                                          "which does not contain it")
            self.infos.update(infos)
        return [d / s for s in shards]

    def names(self) -> list[str]:
        return list(self.infos)

    def get(self, name: str) -> np.ndarray:
        if self._pickled is not None:
            return self._pickled[name]
        info = self.infos[name]
        from safetensors import safe_open
        file = self.directory / info.file
        try:
            if info.dtype.name.startswith("float8"):  # safetensors' numpy reader lacks the float8 types
                return _read_raw(file, name, info)
            with safe_open(str(file), framework="np") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from e

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        if self._pickled is not None:
            yield from self._pickled.items()
            return
        from safetensors import safe_open
        for file in self.files:
            names = [k for k, i in self.infos.items() if i.file == file.name]
            try:
                with safe_open(str(file), framework="np") as f:
                    for name in names:
                        raw = self.infos[name].dtype.name.startswith("float8")  # as in ``get``
                        yield name, _read_raw(file, name, self.infos[name]) if raw else f.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{file}: cannot read tensors ({e})") from e

    def read_all(self) -> dict[str, np.ndarray]:
        return dict(iter(self))


def _raw_entry(file: Path, name: str) -> tuple[dict, bytes]:
    """(header entry, bytes) of one tensor straight from a safetensors file (8-byte header size,
    JSON header whose ``data_offsets`` are relative to the data section): any dtype, float8 too."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + n + start)
        return entry, f.read(end - start)


def _read_raw(file: Path, name: str, info: TensorInfo) -> np.ndarray:
    """One tensor (a dtype safetensors' numpy reader lacks), viewed as ``info.dtype``."""
    return np.frombuffer(_raw_entry(file, name)[1], np.uint8).view(info.dtype).reshape(info.shape).copy()


def copy_raw(directory, names, dst: Path) -> int:
    """Copy tensors ``names`` of a safetensors checkpoint ``directory`` byte for byte (any dtype,
    float8 included) into one safetensors file ``dst``, one tensor in memory at a time; returns
    how many were copied."""
    reader = TensorReader(directory)
    names = list(names)
    entries = [(n, reader.infos[n].dtype, reader.infos[n].shape) for n in names]
    _write_file(Path(dst), entries, ((n, _read_raw(reader.directory / reader.infos[n].file, n, reader.infos[n]))
                                     for n in names))
    return len(names)


_ST_TAGS = {v: k for k, v in _ST_DTYPES.items()}


def _write_file(path: Path, entries, arrays) -> None:
    """One safetensors file whose tensors ``entries`` [(name, dtype, shape)] are known up front:
    the header is written first, then each array of ``arrays`` ((name, array), same order) is
    appended as it arrives, so only one tensor is held at a time."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _ST_TAGS[np.dtype(dtype)], "shape": [int(n) for n in shape],
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (name, dtype, shape), (got, array) in zip(entries, arrays, strict=True):
            array = np.ascontiguousarray(array)
            if got != name or array.dtype != np.dtype(dtype) or tuple(array.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {got!r} {array.dtype}{array.shape} arrived where "
                                 f"{name!r} {np.dtype(dtype)}{tuple(shape)} was planned")
            f.write(array.reshape(-1).view(np.uint8).data)  # any dtype (float8 too) as bytes
    os.chmod(path, 0o644)


def write_file(path, tensors: Mapping[str, np.ndarray]) -> None:
    """One safetensors file of ``tensors`` (any dtype, float8 too; mode 0644)."""
    _write_file(Path(path), [(n, t.dtype, t.shape) for n, t in tensors.items()], tensors.items())


def write_planned(directory, entries, arrays, *, max_shard_size=None) -> list[str]:
    """Write tensors known up front (``entries`` [(name, dtype, shape)]) from the iterator
    ``arrays`` of (name, array) in that order, holding one tensor at a time (headers are
    planned from ``entries``). Sharded like ``write_tensors``; returns the file names written."""
    d = Path(directory)
    entries = list(entries)
    sizes = [int(np.prod(s, dtype=np.int64)) * np.dtype(t).itemsize for _, t, s in entries]
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[list] = [[]]
    size = 0
    for entry, n in zip(entries, sizes):
        if limit is not None and shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    arrays = iter(arrays)
    if len(shards) == 1:
        _write_file(d / WEIGHTS_NAME, shards[0], arrays)
        return [WEIGHTS_NAME]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_file(d / name, shard, (next(arrays) for _ in shard))
        names.append(name)
        weight_map.update({e[0]: name for e in shard})
    index = {"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}
    (d / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX_NAME]


def read_tensors(directory, *, allow_pickle: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of ``directory`` as numpy arrays (stored dtype)."""
    return TensorReader(directory, allow_pickle=allow_pickle).read_all()


def _torch_to_numpy(t) -> np.ndarray:
    import torch
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _load_pickles(files: list[Path]) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:
        raise CheckpointError("reading PyTorch pickle weights needs torch (pip install 'dspark-jax[test]' "
                              "or torch); better: convert them to safetensors") from e
    out: dict[str, np.ndarray] = {}
    for file in files:
        try:
            sd = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot load with torch.load(weights_only=True) ({e})") from e
        if not isinstance(sd, Mapping):
            raise CheckpointError(f"{file}: expected a state dict (name -> tensor), got {type(sd).__name__}")
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                raise CheckpointError(f"{file}: entry {k!r} is a {type(v).__name__}, not a tensor")
            if k in out:
                raise CheckpointError(f"{file}: tensor {k!r} appears in more than one file")
            out[k] = _torch_to_numpy(v)
    return out


def write_tensors(directory, tensors: Mapping[str, np.ndarray], *, max_shard_size=None,
                  metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write ``tensors`` into an existing ``directory``; returns the file names written.

    ``max_shard_size`` (bytes or '2GB'): shard when the total exceeds it, with an index.
    """
    from safetensors.numpy import save_file

    d = Path(directory)
    meta = {"format": "pt", **(metadata or {})}
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    total = sum(a.nbytes for a in arrays.values())
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    if limit is None or total <= limit:
        save_file(arrays, str(d / WEIGHTS_NAME), metadata=meta)
        os.chmod(d / WEIGHTS_NAME, 0o644)  # save_file leaves 0600: unreadable by a server user
        return [WEIGHTS_NAME]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k, a in arrays.items():
        if shards[-1] and size + a.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k] = a
        size += a.nbytes
    n = len(shards)
    weight_map, names = {}, []
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(d / name), metadata=meta)
        os.chmod(d / name, 0o644)
        names.append(name)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": int(total)}, "weight_map": weight_map}
    (d / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX_NAME]
