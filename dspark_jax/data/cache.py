"""Target-feature cache: written once by ``dspark-jax cache``, memory-mapped by training.

Layout of a cache directory (flat token-major arrays, one folder per shard)::

    manifest.json      format, version, target identity (config + sha256 of config and weights),
                       layer_ids, hidden_size, feature_dim, max_length, dtypes, shard list
    index.npy          int64 [R, 3]: (shard, start token, length) per record
    shard_00000/
      tokens.npy       int32 [T_shard]
      loss_mask.npy    uint8 [T_shard]
      features.npy     dtype [T_shard, n*H]  raw outputs of target layers ``layer_ids``, concatenated
      last_hidden.npy  dtype [T_shard, H]    final hidden state after the final norm

``dtype`` is the manifest's ``feature_dtype`` (float32 or bfloat16). NumPy has no bfloat16 of its
own: bfloat16 arrays are stored as their uint16 bit pattern (``storage_dtype``) and viewed back
as bfloat16 when read; caches written before that (bfloat16 saved as raw ``|V2``) read the same.

Writing goes to a temporary sibling directory renamed into place at the end
(atomic); an existing cache is only replaced with ``force``.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from tqdm import tqdm

from dspark_jax import families
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert.identity import target_identity
from dspark_jax.data.sources import TokenSequences, pad_record
from dspark_jax.decode.memory import ROW_WORKING_SET, check_fits, tree_bytes
from dspark_jax.errors import CheckpointError, ConfigError, InputError
from dspark_jax.fileio import atomic_dir
from dspark_jax.target.features import target_features

FORMAT = "dspark-feature-cache"
VERSION = 1
ARRAYS = ("tokens", "loss_mask", "features", "last_hidden")
FEATURE_ARRAYS = ("features", "last_hidden")
MIN_BUCKET = 16  # shortest padded length a batch is run at


def storage_dtype(dtype) -> np.dtype:
    """The dtype a feature array of ``dtype`` is saved with: itself when it is a NumPy type
    (float32), else the unsigned int of its width (ml_dtypes' bfloat16, kind "V" -> uint16, its
    bit pattern)."""
    dtype = np.dtype(dtype)
    return np.dtype(f"u{dtype.itemsize}") if dtype.kind == "V" else dtype


def as_feature_dtype(array: np.ndarray, dtype, where: str) -> np.ndarray:
    """View a loaded feature array (stored as ``storage_dtype`` or, in older caches, raw
    ``|V<n>`` void) as the manifest's ``feature_dtype``; no copy (works on memmaps)."""
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    if array.dtype.itemsize != dtype.itemsize or array.dtype.kind not in "uV":
        raise CheckpointError(f"{where}: stored dtype {array.dtype} does not hold the manifest's "
                              f"feature_dtype {dtype.name}")
    return array.view(dtype)


def bucket_length(longest: int, max_length: int) -> int:
    """The padded length a batch whose longest row has ``longest`` tokens runs at: the smallest
    power of two >= ``longest`` (at least ``MIN_BUCKET``), capped at ``max_length``. The target is
    causal, so a real token's features do not depend on the padding after it; buckets keep the
    number of compiled shapes at about log2(max_length / MIN_BUCKET) + 1."""
    size = max(MIN_BUCKET, 1 << max(int(longest) - 1, 0).bit_length())
    return min(size, max_length)


def _feature_fn(config: TargetConfig, layer_ids, compute_dtype):
    """jit(params, tokens [B, S]) -> (features [B, S, n*H], last_hidden [B, S, H]), through the
    target family's forward (``target_features`` dispatches on ``config``'s family)."""
    return jax.jit(lambda params, tokens: target_features(params, config, layer_ids, tokens,
                                                          compute_dtype=compute_dtype)[:2])


def write_cache(out_dir, target_config: TargetConfig, target_params, layer_ids, data: TokenSequences,
                *, batch_size: int = 8, dtype: str = "float32", shard_tokens: int = 1 << 22,
                force: bool = False, progress: bool = True, compute_dtype=None) -> dict:
    """Run the target over every sequence of ``data`` and write the cache; returns the manifest."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise InputError(f"cache directory {str(out_dir)!r} already exists (pass --force to replace it)")
    with atomic_dir(out_dir, force=force, make_parents=True) as tmp:
        return _write_cache_into(tmp, target_config, target_params, layer_ids, data, batch_size=batch_size,
                                 dtype=dtype, shard_tokens=shard_tokens, progress=progress,
                                 compute_dtype=compute_dtype)


def _write_cache_into(tmp: Path, target_config: TargetConfig, target_params, layer_ids,
                      data: TokenSequences, *, batch_size, dtype, shard_tokens, progress,
                      compute_dtype) -> dict:
    """``write_cache``'s work inside the staging directory ``tmp``."""
    layer_ids = [int(i) for i in layer_ids]
    families.drafter_family(target_config).config_cls.for_target(
        target_config, num_hidden_layers=len(layer_ids), target_layer_ids=tuple(layer_ids),
        mask_token_id=0)  # validates the layer ids (V4: one DSpark stage per tapped layer)
    np_dtype = np.dtype(jnp.dtype(dtype))
    s = data.max_length
    n = len(data)
    batch_size = min(batch_size, n)  # rows past the data would be padding only
    check_fits("--batch-size", batch_size, _row_bytes(target_config, len(layer_ids), s),
               fixed=tree_bytes(target_params), what=f"rows of {s} tokens through the target")
    run = _feature_fn(target_config, layer_ids, compute_dtype)
    index = np.zeros((n, 3), np.int64)
    shards: list[dict] = []
    buf = {k: [] for k in ARRAYS}
    buf_tokens = 0

    def flush():
        nonlocal buf, buf_tokens
        if not buf_tokens:
            return
        d = tmp / f"shard_{len(shards):05d}"
        d.mkdir()
        for k in ARRAYS:
            a = np.concatenate(buf[k], axis=0)
            np.save(d / f"{k}.npy", a.view(storage_dtype(a.dtype)) if k in FEATURE_ARRAYS else a)
        shards.append({"name": d.name, "tokens": buf_tokens})
        buf = {k: [] for k in ARRAYS}
        buf_tokens = 0

    for start in tqdm(range(0, n, batch_size), desc="cache", unit="batch", disable=not progress):
        idx = list(range(start, min(start + batch_size, n)))
        width = bucket_length(max(len(data.raw(i)[0]) for i in idx), s)  # not every row to s
        tokens = np.stack([data[i]["input_ids"][:width] for i in idx])
        if len(idx) < batch_size:  # static shapes: pad the last batch
            tokens = np.concatenate([tokens, np.zeros((batch_size - len(idx), width), np.int32)])
        taps, last = jax.device_get(run(target_params, jnp.asarray(tokens)))
        _check_finite(taps[:len(idx)], last[:len(idx)], idx)
        for row, i in enumerate(idx):
            ids, mask = data.raw(i)
            length = len(ids)
            index[i] = (len(shards), buf_tokens, length)
            buf["tokens"].append(np.asarray(ids, np.int32))
            buf["loss_mask"].append(np.asarray(mask, np.float32).round().astype(np.uint8))
            buf["features"].append(np.asarray(taps[row, :length]).astype(np_dtype))
            buf["last_hidden"].append(np.asarray(last[row, :length]).astype(np_dtype))
            buf_tokens += length
            if buf_tokens >= shard_tokens:
                flush()
    flush()
    np.save(tmp / "index.npy", index)
    manifest = {
        "format": FORMAT, "version": VERSION,
        "target": {"config": target_config.to_hf(), "sha256": target_identity(target_config, target_params)},
        "layer_ids": layer_ids, "hidden_size": target_config.hidden_size,
        "feature_dim": len(layer_ids) * target_config.hidden_size, "max_length": s,
        "feature_dtype": np_dtype.name, "num_records": n, "num_tokens": int(index[:, 2].sum()),
        "shards": shards,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _row_bytes(cfg: TargetConfig, taps: int, length: int) -> float:
    """Bytes one row of ``length`` tokens costs a cache batch: its float32 tapped layers and last
    hidden state (on the device and copied to the host), the layer's activations (MLP width,
    attention scores), counted twice for XLA's temporaries (``decode.memory.ROW_WORKING_SET``)."""
    h = cfg.hidden_size
    width = getattr(cfg, "intermediate_size", 4 * h) or 4 * h
    per_token = 2 * (taps + 1) * h + 6 * h + width + cfg.num_attention_heads * length
    return ROW_WORKING_SET * 4 * length * per_token


def _check_finite(taps: np.ndarray, last: np.ndarray, rows) -> None:
    """CheckpointError when the target produced NaN/inf features (broken weights): a cache of
    them trains nothing; names the first record."""
    bad = ~(np.isfinite(taps).all(axis=(1, 2)) & np.isfinite(last).all(axis=(1, 2)))
    if bad.any():
        raise CheckpointError(f"the target's features are not finite (NaN/inf) for record {rows[int(np.argmax(bad))]} "
                              f"({int(bad.sum())} of this batch's {len(rows)}): its weights are broken; "
                              "no cache written")


def _load_npy(path: Path, **kw) -> np.ndarray:
    """``np.load`` with a CheckpointError naming the file when it is missing, truncated or corrupt."""
    try:
        return np.load(path, **kw)
    except (OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"feature cache file {path} is missing, truncated or corrupt ({e}); rewrite "
                              "the cache with `dspark-jax cache --force`") from None


class FeatureCache:
    """Memory-mapped reader; a grain random-access source of padded records.

    Records: input_ids int32 [S], loss_mask float32 [S], features [S, n*H],
    last_hidden [S, H] (zeros past the sequence), index int64 [].
    """

    def __init__(self, path, max_length: int | None = None, overlong: str = "truncate"):
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise CheckpointError(f"{str(self.path)!r} is not a feature cache: manifest.json is missing")
        try:
            self.manifest = json.loads(mf.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{mf}: invalid JSON ({e.msg})") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise CheckpointError(f"{mf}: not a {FORMAT} v{VERSION} manifest")
        self.index = _load_npy(self.path / "index.npy")
        if self.index.shape != (self.manifest["num_records"], 3):
            raise CheckpointError(f"{self.path}/index.npy has shape {self.index.shape}, manifest says "
                                  f"{self.manifest['num_records']} records")
        if len(self.index) == 0:
            raise InputError(f"feature cache {str(self.path)!r} is empty: no training sequences")
        self.max_length = max_length or int(self.manifest["max_length"])
        longest = int(self.index[:, 2].max())
        if longest > self.max_length and overlong == "refuse":
            bad = int(np.argmax(self.index[:, 2]))
            raise InputError(f"feature cache record {bad}: sequence of {longest} tokens is longer than "
                             f"max_length={self.max_length} (set overlong='truncate' to cut it)")
        try:
            feature_dtype = np.dtype(jnp.dtype(self.manifest.get("feature_dtype", "float32")))
        except TypeError:
            raise CheckpointError(f"{mf}: unknown feature_dtype {self.manifest.get('feature_dtype')!r}") from None
        self._shards = []
        for sh in self.manifest["shards"]:
            arrays = {}
            for k in ARRAYS:
                f = self.path / sh["name"] / f"{k}.npy"
                if not f.is_file():
                    raise CheckpointError(f"feature cache shard file {f} is missing")
                arrays[k] = _load_npy(f, mmap_mode="r")
                if len(arrays[k]) != sh["tokens"]:
                    raise CheckpointError(f"feature cache shard file {f} holds {len(arrays[k])} tokens, the "
                                          f"manifest says {sh['tokens']}: the cache is incomplete; rewrite it "
                                          "with `dspark-jax cache --force`")
                if k in FEATURE_ARRAYS:
                    arrays[k] = as_feature_dtype(arrays[k], feature_dtype, str(f))
            self._shards.append(arrays)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest["layer_ids"])

    def validate(self, draft: DraftConfig, target: TargetConfig | None = None,
                 target_sha256: str | None = None) -> None:
        """Raise ConfigError unless this cache was written for ``draft``'s layers and the target."""
        m = self.manifest
        problems = []
        if tuple(m["layer_ids"]) != draft.target_layer_ids:
            problems.append(f"layer_ids {m['layer_ids']} != drafter target_layer_ids {list(draft.target_layer_ids)}")
        if m["hidden_size"] != draft.hidden_size:
            problems.append(f"hidden_size {m['hidden_size']} != drafter hidden_size {draft.hidden_size}")
        if m["target"]["config"].get("num_hidden_layers") != draft.num_target_layers:
            problems.append(f"target num_hidden_layers {m['target']['config'].get('num_hidden_layers')} != "
                            f"drafter num_target_layers {draft.num_target_layers}")
        if target is not None and m["target"]["config"] != target.to_hf():
            problems.append("target config differs from the training target's")
        if target_sha256 is not None and m["target"]["sha256"] != target_sha256:
            problems.append(f"target identity {m['target']['sha256'][:12]} != training target "
                            f"{target_sha256[:12]} (different weights)")
        if problems:
            raise ConfigError(f"feature cache {str(self.path)!r} does not fit this run: " + "; ".join(problems))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        shard, start, length = (int(x) for x in self.index[i])
        a = self._shards[shard]
        n = min(length, self.max_length)
        rec = pad_record(a["tokens"][start:start + n], a["loss_mask"][start:start + n], self.max_length, i)
        for k in ("features", "last_hidden"):
            out = np.zeros((self.max_length, a[k].shape[1]), np.float32)
            out[:n] = a[k][start:start + n]
            rec[k] = out
        return rec
