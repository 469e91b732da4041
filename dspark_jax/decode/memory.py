"""Bounds before allocation: what a decode will hold in memory, checked against the devices.

``check_decode_memory`` estimates the bytes a decode allocates (weights, the target's KV cache
for ``batch`` rows of ``max_len`` positions, the drafter's context cache, a round's logits) and
refuses (InputError, one line in GiB naming the flag and the largest value that fits) a run that
cannot fit, before anything is placed or compiled. Capacity: the devices' ``bytes_limit`` where
the backend reports one (GPU, TPU), else the host memory available now (CPU: ``MemAvailable``, the
machine is shared). ``check_fits`` is the same bound for any count with a per-unit cost.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from dspark_jax import families, runtime
from dspark_jax.draft import kinds
from dspark_jax.errors import InputError

GIB = float(1 << 30)
# The rows' state is not all a round holds: XLA's temporaries (the round's logits, probabilities,
# gathered caches) came to ~1.6x the estimated per-row bytes (generate, tiny fixture, batch 4000,
# CPU peak RSS); the bound counts per-row bytes twice.
ROW_WORKING_SET = 2.0


def host_available() -> int:
    """Bytes of host memory available now (``MemAvailable``), else the physical memory."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(flag: str, value: int, per_unit: float, *, fixed: float = 0, what: str = "",
               mesh=None, hint: str = "") -> None:
    """InputError (one line) when ``fixed + value * per_unit`` bytes exceed the capacity (devices,
    else the host's available memory): names ``flag``, its largest value that fits and the GiB
    ``value`` would need. Called before the first allocation that grows with ``value``."""
    need = fixed + value * per_unit
    have, where = capacity(mesh)
    if need > have:
        most = max(0, int((have - fixed) // per_unit)) if per_unit > 0 else 0
        raise InputError(f"{flag} {value} needs about {need / GIB:.1f} GiB{' (' + what + ')' if what else ''} "
                         f"but {where} has {have / GIB:.1f} GiB: at most {flag} {most}{hint}")


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
    return host_available(), "this host (available now)"


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


def check_decode_memory(tcfg, tparams, dcfg, dparams, batch: int, max_len: int, mesh=None,
                        flag: str = "--batch-size",
                        length_flags: str = "--max-cache-len / --max-new-tokens") -> None:
    """InputError (one line: ``flag``, the most rows that fit, GiB) when the decode's estimate
    (per-row bytes times ``ROW_WORKING_SET``) exceeds the devices' memory."""
    parts = decode_bytes(tcfg, tparams, dcfg, dparams, batch, max_len)
    weights = parts.pop("weights")
    big = max(parts, key=parts.get)
    check_fits(flag, batch, ROW_WORKING_SET * sum(parts.values()) / batch, fixed=weights, mesh=mesh,
               what=f"{big} {parts[big] / GIB:.1f} GiB at cache length {max_len}",
               hint=f" (or lower {length_flags})")
