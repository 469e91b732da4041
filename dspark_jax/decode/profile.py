"""Profile SPS(B): target verification steps per second at B verification tokens.

The measured call is the real verification forward: ``qwen3.forward`` extending a static KV
cache that already holds ``cache_length`` positions, plus the LM head over every new
position (what rejection sampling reads), jitted with the cache donated. Layouts:

- ``"rows"`` (default): B rows of one token each, every row with its own cache of
  ``cache_length`` (B tokens spread over B requests: the memory-bound, pessimistic case);
- ``"block"``: one row of B tokens over one cache (compute-bound, optimistic).

Each batch size compiles once, runs ``warmup`` untimed calls, then ``repeats`` timed chunks
of at least ``iters`` calls and ``min_seconds``; SPS = calls / seconds of the fastest chunk
(other processes only ever slow a chunk down). With ``monotone`` the stored curve is the
isotonic (non-increasing) least-squares fit of the measurements (raw values kept in
``meta["raw_sps"]``): more verification tokens are never faster, so upward/downward timing
noise would otherwise create false SPS cliffs that trap the early-stopping scheduler.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.decode.scheduler import SPSTable
from dspark_jax.errors import InputError
from dspark_jax.target import qwen3

LAYOUTS = ("rows", "block")


def default_batch_sizes(max_batch: int, dense_up_to: int = 16, growth: float = 1.25) -> list[int]:
    """1..dense_up_to every integer, then geometric steps (x``growth``), always ending at max_batch."""
    if max_batch < 1:
        raise InputError(f"max batch must be >= 1, got {max_batch}")
    sizes = list(range(1, min(dense_up_to, max_batch) + 1))
    b = sizes[-1]
    while b < max_batch:
        b = min(max_batch, max(b + 1, int(round(b * growth))))
        sizes.append(b)
    return sizes


def isotonic_decreasing(y: Sequence[float]) -> np.ndarray:
    """Least-squares non-increasing fit of ``y`` (pool-adjacent-violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in np.asarray(y, np.float64):
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return np.concatenate([np.full(int(w), m) for m, w in blocks])


def _verify_fn(config: TargetConfig, compute_dtype):
    def verify(params, cache, tokens):
        start = cache.lengths
        hidden, _, cache = qwen3.forward(params, config, tokens, cache, compute_dtype=compute_dtype)
        logits = qwen3.compute_logits(params, hidden)                    # [rows, T, V]
        return jnp.argmax(logits, axis=-1), cache.with_lengths(start)   # roll back, as a reject would
    return jax.jit(verify, donate_argnums=(1,))


def measure_sps(
    config: TargetConfig,
    params: dict,
    batch_sizes: Sequence[int],
    cache_length: int,
    *,
    layout: str = "rows",
    warmup: int = 2,
    iters: int = 5,
    min_seconds: float = 0.2,
    repeats: int = 3,
    monotone: bool = False,
    cache_dtype=None,
    compute_dtype=None,
    meta: dict | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> SPSTable:
    """SPS table for ``batch_sizes`` (verification tokens per forward) at ``cache_length``."""
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise InputError(f"batch sizes must be positive ints, got {list(batch_sizes)}")
    if cache_length < 0 or cache_length + (sizes[-1] if layout == "block" else 1) > config.max_position_embeddings:
        raise InputError(f"cache length {cache_length} (+ new tokens) must be in [0, "
                         f"max_position_embeddings={config.max_position_embeddings}]")
    if warmup < 1 or iters < 1:
        raise InputError("warmup and iters must be >= 1")
    dtype = cache_dtype or params["embed_tokens"].dtype
    verify = _verify_fn(config, compute_dtype)
    rng = np.random.default_rng(0)
    sps = []
    for b in sizes:
        rows, t = (b, 1) if layout == "rows" else (1, b)
        cache = qwen3.init_cache(config, rows, cache_length + t, dtype)
        cache = cache.with_lengths(jnp.full((rows,), cache_length, jnp.int32))
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (rows, t)), jnp.int32)
        for _ in range(warmup):
            out, cache = verify(params, cache, tokens)
        jax.block_until_ready((out, cache))
        best = 0.0
        for _ in range(max(repeats, 1)):
            calls, t0 = 0, time.perf_counter()
            while True:
                out, cache = verify(params, cache, tokens)
                calls += 1
                if calls >= iters:
                    jax.block_until_ready((out, cache))
                    elapsed = time.perf_counter() - t0
                    if elapsed >= min_seconds:
                        break
            best = max(best, calls / elapsed)
        sps.append(best)
        del cache
        if progress is not None:
            progress(b, sps[-1])
    dev = jax.devices()[0]
    info = {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "num_devices": jax.device_count(),
        "cache_length": int(cache_length),
        "layout": layout,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "warmup": warmup, "iters": iters, "min_seconds": min_seconds, "repeats": repeats,
        "monotone": monotone, "raw_sps": [float(x) for x in sps],
        "dtype": str(np.dtype(dtype)),
        "model": {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads,
                  "num_key_value_heads": config.num_key_value_heads},
        **(meta or {}),
    }
    values = isotonic_decreasing(sps) if monotone else np.asarray(sps)
    return SPSTable(tuple(sizes), tuple(float(v) for v in values), meta=info)
