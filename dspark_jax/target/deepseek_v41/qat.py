"""DeepSeek-V4.1's fake quantizers: part of the model (transformers' V4.1 applies them in every
forward, "QAT semantics"), each a quantize-then-dequantize of the last dim in blocks.

- ``fp8_block``: window K = V -> FP8 e4m3, one ue8m0 (power of two, rounded up) scale per 32.
- ``fp4_block``: e2m1 values (0, .5, 1, 1.5, 2, 3, 4, 6 and negatives), one scale per block:
  ue8m0 per 32 (indexer q and keys) or e4m3 per 16 (compressed entries).

A last dim that is not a multiple of the block is returned unchanged (as the reference does).
Scales are computed as the reference computes them (``amax * (1 / max)``, then the exponent
bits), so the roundings agree bit for bit (tests/test_deepseek_v41.py: ``qat_ops.npz``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX, FP4_MAX = 448.0, 6.0
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# round-to-nearest-even onto e2m1: ties at 0.25, 1.25, 2.5, 5 go down, at 0.75, 1.75, 3.5 up
_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_TIES_UP = np.array([False, True, False, True, False, True, False])
_THRESHOLDS = np.where(_TIES_UP, _BOUNDS, np.nextafter(_BOUNDS, np.float32(np.inf)))


def pow2_ceil(t: jax.Array) -> jax.Array:
    """2^ceil(log2 t) of float32 t > 0 from its exponent and mantissa bits (ue8m0 rounding)."""
    bits = jax.lax.bitcast_convert_type(t.astype(jnp.float32), jnp.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)  # exact (exp2 is not, on CPU)


def _e4m3(x: jax.Array) -> jax.Array:
    """x rounded to float8 e4m3 (nearest even), saturating at ±448 as torch's cast does."""
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_block(x: jax.Array, block: int = 32) -> jax.Array:
    """x [..., n] through FP8 e4m3 with a ue8m0 scale per ``block`` (n % block: unchanged)."""
    if x.shape[-1] % block:
        return x
    b = _blocks(x, block)
    amax = jnp.maximum(jnp.abs(b).max(-1, keepdims=True), 1e-4)
    scale = pow2_ceil(amax * np.float32(1.0 / FP8_MAX))
    q = _e4m3(b / scale)
    return (q * scale).reshape(x.shape).astype(x.dtype)


def e2m1(q: jax.Array) -> jax.Array:
    """Values q (already within ±6) rounded to the nearest e2m1 value (ties to even)."""
    code = (jnp.abs(q)[..., None] >= jnp.asarray(_THRESHOLDS)).sum(-1)
    mag = jnp.asarray(_E2M1)[code]
    return jnp.where(jnp.signbit(q), -mag, mag)


def fp4_block(x: jax.Array, block: int, e4m3_scales: bool = False) -> jax.Array:
    """x [..., n] through FP4 e2m1 with one scale per ``block``: e4m3 (``e4m3_scales``) or ue8m0."""
    if x.shape[-1] % block:
        return x
    b = _blocks(x, block)
    amax = jnp.abs(b).max(-1, keepdims=True)
    if e4m3_scales:
        scale = _e4m3(jnp.maximum(amax, FP4_MAX * 2.0 ** -9) / FP4_MAX)
    else:
        scale = pow2_ceil(jnp.maximum(amax, FP4_MAX * 2.0 ** -126) * np.float32(1.0 / FP4_MAX))
    q = e2m1(jnp.clip(b / scale, -FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)


def window_kv(cfg, kv: jax.Array) -> jax.Array:
    """The window K = V as the model stores it (FP8 per 32 when ``cfg.qat``)."""
    return fp8_block(kv, 32) if cfg.qat else kv


def entries(cfg, x: jax.Array) -> jax.Array:
    """Compressed KV entries as stored (FP4, e4m3 scale per 16, when ``cfg.qat``)."""
    return fp4_block(x, 16, e4m3_scales=True) if cfg.qat else x


def indexer(cfg, x: jax.Array) -> jax.Array:
    """Indexer queries / keys as scored (FP4, ue8m0 scale per 32, when ``cfg.qat``)."""
    return fp4_block(x, 32) if cfg.qat else x
