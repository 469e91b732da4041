"""Bounds before allocation: what a decode will hold in memory, checked against the devices.

``check_decode_memory`` estimates the bytes a decode allocates (weights, the target's KV cache
for ``batch`` rows of ``max_len`` positions, the drafter's context cache, a round's logits) and
refuses (InputError, one line in GiB) a run that cannot fit, before anything is placed or
compiled. Capacity: the devices' ``bytes_limit`` where the backend reports one (GPU, TPU), else
the host's physical memory (CPU).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from dspark_jax import families, runtime
from dspark_jax.draft import kinds
from dspark_jax.errors import InputError

GIB = float(1 << 30)


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (abstract shapes count too)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def capacity(mesh=None) -> tuple[int, str]:
    """(bytes, what): the summed ``bytes_limit`` of the decode's devices, or the host's RAM."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # backends without memory stats
            stats = {}
        limits.append(stats.get("bytes_limit"))
    if limits and all(limits):
        return int(sum(limits)), f"{len(devices)} {devices[0].platform} device(s)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host"


def decode_bytes(tcfg, tparams, dcfg, dparams, batch: int, max_len: int) -> dict:
    """{part: bytes} of a decode of ``batch`` rows with cache capacity ``max_len`` (the target's
    cache from its family's ``init_cache``, abstractly: nothing is allocated)."""
    dtype = runtime.compute_dtype(tparams)
    g = dcfg.block_size if dcfg is not None else 0
    rt = families.target_runtime(tcfg)
    cache = jax.eval_shape(lambda: rt.init_cache(tcfg, batch, max_len, dtype, g + 1))
    parts = {"weights": tree_bytes(tparams) + (tree_bytes(dparams) if dparams is not None else 0),
             "target KV cache": tree_bytes(cache),
             "tokens and logits": batch * (max_len * 4 + 3 * (g + 1) * tcfg.vocab_size * 4)}
    if dcfg is not None:
        parts["drafter context"] = batch * context_bytes_per_row(dcfg, max_len, dtype)
    return parts


def context_bytes_per_row(dcfg, max_len: int, dtype) -> int:
    """Bytes of one row's drafter state (its kind's ``runtime.Proposer.state_bytes``: a block
    drafter's context cache, a chain drafter's own cache and last output)."""
    return kinds.proposer(dcfg).state_bytes(dcfg, max_len, dtype)


def check_decode_memory(tcfg, tparams, dcfg, dparams, batch: int, max_len: int, mesh=None) -> None:
    """InputError (one line, GiB) when the decode's estimate exceeds the devices' memory."""
    parts = decode_bytes(tcfg, tparams, dcfg, dparams, batch, max_len)
    need = sum(parts.values())
    have, where = capacity(mesh)
    if need > have:
        big = max(parts, key=parts.get)
        raise InputError(f"this decode needs about {need / GIB:.1f} GiB ({big} {parts[big] / GIB:.1f} GiB "
                         f"for batch {batch} x cache length {max_len}) but {where} has "
                         f"{have / GIB:.1f} GiB; lower --batch-size or --max-cache-len")
