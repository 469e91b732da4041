"""Block-scaled FP8 and MXFP4 checkpoint tensors (DeepSeek-V4's formats), read and written with numpy.

FP8: float8 e4m3 values, one ue8m0 scale per ``block`` (128 x 128) of the torch-layout tensor
(partial blocks at the edges included). MXFP4: two e2m1 values per int8 byte along the last dim,
low nibble first (value codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), one ue8m0 scale per
32 consecutive values along the input (last) dim. ue8m0: an exponent byte e, the scale is
``2 ** (e - 127)``. Dequantized value = decoded value x its block's scale.

Which tensors may be stored quantized, and in which format, is declared (``ParamSpec.quant``);
``logical_infos`` validates a checkpoint's headers against that (dtype, scale tensor present and
of the right block count) before any data is read, ``dequantize`` decodes one tensor and
``store`` encodes one (``quantize``: what every writer of a quantized checkpoint calls).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import ml_dtypes
import numpy as np

from dspark_jax.errors import CheckpointError
from dspark_jax.params import Quant

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
UE8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Stored:
    """How one quantized tensor is stored: its format and its scale tensor's name."""

    quant: Quant
    scale: str


def is_float(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def logical_infos(quantized: Mapping[str, Quant], infos: Mapping, what: str, make_info: Callable,
                  fixed: Mapping[str, str] = {}):
    """(infos with quantized tensors at their dequantized shape and the scale tensors removed,
    {name: Stored} of the quantized ones). Dequantized tensors take the checkpoint's widest plain
    float dtype (tensors with a ``fixed`` dtype aside; float32 when there is none). CheckpointError
    names a tensor whose dtype is neither a float nor its declared format, a missing scale or one
    whose block count is wrong."""
    out = dict(infos)
    stored, shapes = {}, {}
    for name, q in quantized.items():
        if name not in infos:
            continue
        info, scale = infos[name], q.scale_name(name)
        if is_float(info.dtype):
            continue
        want = FP8 if q.fmt == "fp8" else (np.dtype(np.int8), np.dtype(np.uint8))
        if np.dtype(info.dtype) not in (want if isinstance(want, tuple) else (want,)):
            raise CheckpointError(f"{what}: tensor {name!r} has dtype {np.dtype(info.dtype).name}; expected a "
                                  f"float or {q.fmt} ({'float8_e4m3fn' if q.fmt == 'fp8' else 'int8 pairs'})")
        if scale not in infos:
            raise CheckpointError(f"{what}: tensor {name!r} is {q.fmt} but its scale {scale!r} is missing")
        shape = tuple(info.shape[:-1]) + (info.shape[-1] * (2 if q.fmt == "fp4" else 1),)
        want_scale = q.scale_shape(shape)
        if tuple(infos[scale].shape) != want_scale:
            raise CheckpointError(f"{what}: scale {scale!r} has shape {tuple(infos[scale].shape)}, expected "
                                  f"{want_scale} (one per {q.block[0]}x{q.block[1]} block of {shape})")
        del out[scale]
        stored[name], shapes[name] = Stored(q, scale), shape
    plain = [np.dtype(i.dtype) for k, i in out.items() if k not in stored and k not in fixed and is_float(i.dtype)]
    dtype = max(plain, key=lambda d: d.itemsize) if plain else np.dtype(np.float32)
    return {k: make_info(shapes[k], dtype, i) if k in stored else i for k, i in out.items()}, stored


def scale_values(scale: np.ndarray) -> np.ndarray:
    """ue8m0 (float8_e8m0fnu or its uint8 bytes) -> float32 ``2 ** (e - 127)`` (byte 0xFF, ue8m0's
    NaN: NaN, quietly, for the caller's finiteness check to name); float scales as they are."""
    scale = np.asarray(scale)
    if scale.dtype in (UE8M0, np.dtype(np.uint8)):
        e = scale.view(np.uint8).astype(np.int32)
        with np.errstate(over="ignore"):
            values = np.ldexp(np.float32(1), e - 127).astype(np.float32)
        return np.where(e == 0xFF, np.float32(np.nan), values)
    return scale.astype(np.float32)


def _expand(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    s = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :shape[-2], :shape[-1]]


def dequantize(data: np.ndarray, scale: np.ndarray, q: Quant) -> np.ndarray:
    """The float32 values of one stored tensor (torch layout) and its scale."""
    if q.fmt == "fp4":
        b = np.asarray(data).view(np.uint8)
        vals = np.empty((*b.shape[:-1], b.shape[-1] * 2), np.float32)
        vals[..., 0::2] = E2M1[b & 0xF]
        vals[..., 1::2] = E2M1[b >> 4]
    else:
        vals = np.asarray(data).astype(np.float32)
    return vals * _expand(scale_values(scale), q.block, vals.shape)


def _round(x: np.ndarray, fmt: str) -> np.ndarray:
    """``x`` rounded to the nearest value of ``fmt`` without saturating (beyond the format's
    largest value: larger than it, so an overflow shows)."""
    if fmt == "fp8":
        with np.errstate(invalid="ignore", over="ignore"):
            out = np.asarray(x, np.float32).astype(FP8).astype(np.float32)
        return np.where(np.isfinite(out), np.abs(out), np.inf)
    grid = np.append(E2M1[:8], 8.0)  # 8: the next step past 6, i.e. an overflow
    return grid[np.abs(np.abs(x)[..., None] - grid).argmin(-1)]


def _ue8m0_for(amax: np.ndarray, fmt: str) -> np.ndarray:
    """Per block, the smallest power-of-two scale at which ``amax`` rounds to a value of ``fmt``
    without overflow, as ue8m0 bytes. The smallest such scale makes quantization canonical: the
    dequantized values quantize again to the same bytes."""
    top = 6.0 if fmt == "fp4" else FP8_MAX
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / top)).astype(np.int32)  # amax / 2**e <= top
    e = np.clip(e, -127, 127)
    lower = np.clip(e - 1, -127, 127)
    fits = _round(amax / np.ldexp(np.float32(1), lower), fmt) <= top
    return (np.where(fits, lower, e) + 127).astype(np.uint8).view(UE8M0)


def _blocks(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Per-block max |w| [ceil(rows/b0), ceil(cols/b1)] (edge blocks padded with zeros)."""
    r, c = w.shape
    pr, pc = -r % block[0], -c % block[1]
    a = np.pad(np.abs(w.astype(np.float32)), ((0, pr), (0, pc)))
    return a.reshape(a.shape[0] // block[0], block[0], a.shape[1] // block[1], block[1]).max(axis=(1, 3))


def quantize(w: np.ndarray, q: Quant) -> tuple[np.ndarray, np.ndarray]:
    """(stored tensor, ue8m0 scale) of a 2-D torch-layout tensor ``w`` in format ``q`` (round to
    nearest; power-of-two block scales chosen so that no value overflows the format)."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a 2-D tensor, got shape {w.shape}")
    if q.fmt == "fp4" and w.shape[-1] % 2:
        raise ValueError(f"quantize: fp4 needs an even last dim, got {w.shape}")
    scale = _ue8m0_for(_blocks(w, q.block), q.fmt)
    x = w / _expand(scale_values(scale), q.block, w.shape)
    if q.fmt == "fp8":
        with np.errstate(over="ignore"):
            return x.astype(FP8), scale
    codes = np.abs(np.abs(x)[..., None] - E2M1[:8]).argmin(-1).astype(np.uint8) | (np.signbit(x) * 8).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(np.int8), scale


def store(name: str, w: np.ndarray, q: Quant) -> dict[str, np.ndarray]:
    """The checkpoint tensors holding torch-layout ``w`` (named ``name``) in format ``q``: the stored
    data under ``name`` and its ue8m0 scale under ``q.scale_name(name)`` (``quantize``)."""
    data, scale = quantize(w, q)
    return {name: data, q.scale_name(name): scale}
