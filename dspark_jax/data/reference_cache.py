"""Read the reference's (DeepSpec) target-feature cache, version 2, as a `train features=cache` source.

Layout, read from deepspec/data/target_cache_dataset.py (writer ``LocalTargetCacheWriter``,
``finalize_target_cache_index``, ``build_target_cache_manifest``; reader ``CacheDataset``) and
scripts/data/prepare_target_cache.py::

    manifest.json   {"version": 2, "num_samples", "num_shards", "target_layer_ids",
                     "hidden_dtype": "bfloat16" | "float8_e4m3fn" | "float8_e5m2",
                     "token_dtype": "int32", "mask_dtype": "uint8", "index_record_size": 56,
                     "hidden_size", "shards": [{"shard_id", "file_name"}], ...
                     "target_model_name_or_path", "max_length", ...}
    samples.idx     num_samples records, little-endian struct "<QIIQQQQQ":
                    sample_id, shard_id, seq_len, then byte offsets (in the shard) of
                    input_ids, attention_mask, loss_mask, target_hidden_states,
                    target_last_hidden_states
    shard-NNNNN.bin per sample, back to back: input_ids int32 [L], attention_mask uint8 [L],
                    loss_mask uint8 [L], target_hidden_states [L, n*H] (the outputs of the
                    target layers ``target_layer_ids`` concatenated), target_last_hidden_states
                    [L, H] (after the final norm), in ``hidden_dtype``

This is the same information as our cache (dspark_jax/data/cache.py): ``ReferenceFeatureCache``
has ``FeatureCache``'s interface (records input_ids, loss_mask, features, last_hidden, index)
and ``open_feature_cache`` picks the reader from the manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.data.sources import pad_record
from dspark_jax.errors import CheckpointError, ConfigError, InputError

VERSION = 2
INDEX_DTYPE = np.dtype([("sample_id", "<u8"), ("shard_id", "<u4"), ("seq_len", "<u4"),
                        ("input_ids", "<u8"), ("attention_mask", "<u8"), ("loss_mask", "<u8"),
                        ("target_hidden_states", "<u8"), ("target_last_hidden_states", "<u8")])
HIDDEN_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
                 "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
_REQUIRED = ("version", "num_samples", "num_shards", "target_layer_ids", "hidden_dtype", "token_dtype",
             "mask_dtype", "index_record_size", "hidden_size", "shards")


def is_reference_cache(path) -> bool:
    """True when ``path`` holds a DeepSpec v2 cache (manifest.json with version 2 + samples.idx)."""
    p = Path(path)
    try:
        m = json.loads((p / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("version") == VERSION and (p / "samples.idx").is_file()


class ReferenceFeatureCache:
    """Memory-mapped reader of a DeepSpec v2 target cache; a grain random-access source.

    Records as ``FeatureCache``: input_ids int32 [S], loss_mask float32 [S],
    features float32 [S, n*H], last_hidden float32 [S, H] (zeros past the sequence), index.
    """

    def __init__(self, path, max_length: int | None = None, overlong: str = "truncate"):
        self.path = Path(path)
        mf = self.path / "manifest.json"
        try:
            m = json.loads(mf.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{str(self.path)!r} is not a feature cache: manifest.json is missing") from None
        except ValueError as e:
            raise CheckpointError(f"{mf}: invalid JSON ({e})") from None
        missing = [k for k in _REQUIRED if k not in m]
        if missing:
            raise CheckpointError(f"{mf}: DeepSpec cache manifest lacks field {missing[0]!r}")
        if m["version"] != VERSION:
            raise CheckpointError(f"{mf}: field 'version' is {m['version']!r}; this reader reads {VERSION}")
        if m["hidden_dtype"] not in HIDDEN_DTYPES:
            raise CheckpointError(f"{mf}: field 'hidden_dtype' {m['hidden_dtype']!r} is not one of "
                                  f"{sorted(HIDDEN_DTYPES)}")
        if m["token_dtype"] != "int32" or m["mask_dtype"] != "uint8":
            raise CheckpointError(f"{mf}: token_dtype/mask_dtype must be int32/uint8")
        if int(m["index_record_size"]) != INDEX_DTYPE.itemsize:
            raise CheckpointError(f"{mf}: field 'index_record_size' is {m['index_record_size']}, "
                                  f"expected {INDEX_DTYPE.itemsize}")
        self.manifest = m
        idx = self.path / "samples.idx"
        if not idx.is_file():
            raise CheckpointError(f"{idx}: index file is missing")
        if idx.stat().st_size != int(m["num_samples"]) * INDEX_DTYPE.itemsize:
            raise CheckpointError(f"{idx}: size {idx.stat().st_size} != num_samples {m['num_samples']} "
                                  f"x {INDEX_DTYPE.itemsize}")
        self.index = np.fromfile(idx, dtype=INDEX_DTYPE)
        if len(self.index) == 0:
            raise InputError(f"feature cache {str(self.path)!r} is empty: no training sequences")
        if not np.array_equal(self.index["sample_id"], np.arange(len(self.index))):
            raise CheckpointError(f"{idx}: sample ids are not 0..{len(self.index) - 1} in order")
        self.hidden_size = int(m["hidden_size"])
        self.num_layers = len(m["target_layer_ids"])
        self.hidden_dtype = HIDDEN_DTYPES[m["hidden_dtype"]]
        self.max_length = int(max_length or m.get("max_length") or int(self.index["seq_len"].max()))
        longest = int(self.index["seq_len"].max())
        if longest > self.max_length and overlong == "refuse":
            bad = int(np.argmax(self.index["seq_len"]))
            raise InputError(f"feature cache record {bad}: sequence of {longest} tokens is longer than "
                             f"max_length={self.max_length} (set overlong='truncate' to cut it)")
        self._shards = {}
        for i, sh in enumerate(m["shards"]):
            if int(sh["shard_id"]) != i:
                raise CheckpointError(f"{mf}: shard ids must be 0..{len(m['shards']) - 1} in order")
            f = self.path / sh["file_name"]
            if not f.is_file():
                raise CheckpointError(f"feature cache shard file {f} is missing")
            self._shards[i] = np.memmap(f, dtype=np.uint8, mode="r")
        bad = np.flatnonzero(self.index["shard_id"] >= len(self._shards))
        if bad.size:
            raise CheckpointError(f"{idx}: record {int(bad[0])} names shard "
                                  f"{int(self.index['shard_id'][bad[0]])}, which does not exist")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.manifest["target_layer_ids"])

    def validate(self, draft: DraftConfig, target: TargetConfig | None = None,
                 target_sha256: str | None = None) -> None:
        """Raise ConfigError unless this cache fits ``draft``'s layers and width.

        A DeepSpec cache names its target by path only (``target_model_name_or_path``), so
        the target's weights cannot be checked here (``target`` / ``target_sha256`` only
        check the hidden size)."""
        problems = []
        if self.layer_ids != tuple(draft.target_layer_ids):
            problems.append(f"target_layer_ids {list(self.layer_ids)} != drafter target_layer_ids "
                            f"{list(draft.target_layer_ids)}")
        if self.hidden_size != draft.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != drafter hidden_size {draft.hidden_size}")
        if target is not None and target.hidden_size != self.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if problems:
            raise ConfigError(f"feature cache {str(self.path)!r} does not fit this run: " + "; ".join(problems))

    def __len__(self) -> int:
        return len(self.index)

    def _array(self, rec, field: str, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._shards[int(rec["shard_id"])]
        start = int(rec[field])
        end = start + count * dtype.itemsize
        if end > buf.size:
            raise CheckpointError(f"feature cache record {int(rec['sample_id'])}: {field} extends past "
                                  f"the end of shard {int(rec['shard_id'])}")
        return np.frombuffer(buf, dtype=dtype, count=count, offset=start)

    def __getitem__(self, i: int) -> dict:
        rec = self.index[i]
        length = int(rec["seq_len"])
        n = min(length, self.max_length)
        h, k = self.hidden_size, self.num_layers
        ids = self._array(rec, "input_ids", np.dtype("<i4"), length)
        mask = self._array(rec, "loss_mask", np.dtype(np.uint8), length)
        out = pad_record(ids[:n], mask[:n].astype(np.float32), self.max_length, i)
        for key, field, width in (("features", "target_hidden_states", k * h),
                                  ("last_hidden", "target_last_hidden_states", h)):
            arr = self._array(rec, field, self.hidden_dtype, length * width).reshape(length, width)
            full = np.zeros((self.max_length, width), np.float32)
            full[:n] = arr[:n].astype(np.float32)
            out[key] = full
        return out


def open_feature_cache(path, max_length: int | None = None, overlong: str = "truncate"):
    """Our FeatureCache or a ReferenceFeatureCache, whichever ``path`` holds."""
    if is_reference_cache(path):
        return ReferenceFeatureCache(path, max_length, overlong)
    from dspark_jax.data.cache import FeatureCache
    return FeatureCache(path, max_length, overlong)
