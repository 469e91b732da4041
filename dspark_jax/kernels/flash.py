"""Flash-decoding over a KV cache on CUDA: a Pallas (Triton) kernel for a few queries per row.

A decode step attends a handful of queries per row (the target's verify block, Q = G + 1; the
drafter's block, Q = G; the AR step, Q = 1) to one layer's cache. Written as XLA ops, the
scores [B, Hkv, G, Q, S] are an f32 array written and re-read per layer, and XLA:GPU gives the
values dot a copy of the layer's V slice (docs/performance.md section 0d,
benchmarks/results/gpu_copies). This kernel reads K and V once, in place, and keeps the scores
on chip: it returns the softmax *partials* over the cache -- the unnormalised output, the
running max and the running sum of each query row -- which ``partials.merge`` combines (in XLA: small
arrays) with the scores of the block's own keys into the masked softmax of ``nn.masked_softmax``:
masked entries weigh 0, a row with nothing visible anywhere returns zeros.

Layout. Queries qg [B, Q, Hkv, G, D] become, per (row b, KV head h), R = Q * G query rows
(row r = q * G + g, its visibility ``visible[b, r // G]``) padded to Rp = the next power of two
>= 16 (what ``tl.dot`` takes). The grid is (B, Hkv, splits): each program reads one contiguous
chunk of the span S in ``block_k``-key tiles -- scores ``q @ k^T`` in the input dtype with f32
accumulation, times ``scale`` in f32, masked; an online softmax; ``p @ v`` with p cast to the
input dtype, accumulated in f32 -- and writes its (o [Rp, D], m [Rp], l [Rp]). Splitting S
(flash-decoding) gives B = 1 enough programs to fill the GPU; the splits are combined in XLA
(``cache_partials``). Nothing S-sized is written; K / V slots past S are never read. K and V are
read where they lie when they are whole buffers (a per-layer cache); a slice of a stacked cache
is an operand XLA:GPU first copies (as for a cuBLAS gemm). On a mesh the kernel runs per shard of
B and Hkv (``custom_partitioning``).

The kernel runs only inside ``jax.lax.platform_dependent(..., cuda=...)`` branches
(``nn.attention``'s prefix path, the drafter backbone's context attention), so it is lowered only
for CUDA; ``interpret=True`` runs the same kernel body on any backend (the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P

from dspark_jax.kernels.partials import NEG_INF, SMALL_QUERY
from dspark_jax.kernels.plugins import has_extra

# The kernel's name in the compiled HLO (``backend_config={... name = "..."}`` of the
# ``__gpu$xla.gpu.triton`` custom call): ``hlo_cost`` counts its flops by it.
KERNEL_NAME = "dspark_flash_decode"
MIN_ROWS = 16            # tl.dot's smallest M
TARGET_PROGRAMS = 264    # two programs per SM of an H100 / H200 (132 SMs)
MAX_HEAD_DIM = 256       # beyond: the [Rp, D] f32 accumulator no longer fits in registers


def applies(num_queries: int, head_dim: int, group: int) -> bool:
    """Whether the kernel takes an attention of ``num_queries`` queries per row (<= ``SMALL_QUERY``)
    of ``group`` query heads per KV head over a cache of ``head_dim``-wide heads, in a jaxlib that
    can target CUDA at all (without the CUDA plugin the kernel branch is never lowered, and tracing
    it into every CPU decode program only slowed their compiles)."""
    return (num_queries <= SMALL_QUERY and 16 <= head_dim <= MAX_HEAD_DIM
            and head_dim & (head_dim - 1) == 0 and _rows(num_queries * group) <= 64  # Triton tiles: powers of 2
            and cuda_installed())


@functools.cache
def cuda_installed() -> bool:
    """Whether this JAX has its CUDA plugin (the ``cuda`` extra: a GPU or compile-only GPU targets)."""
    return has_extra("cuda")


def _rows(r: int) -> int:
    return max(MIN_ROWS, 1 << max(r - 1, 0).bit_length())


def plan(batch: int, kv_heads: int, span: int, head_dim: int) -> tuple[int, int, int]:
    """(block_k, chunk, splits): keys per tile, keys per program (a multiple of block_k) and
    programs per (row, KV head) covering ``span`` keys; enough programs in all
    (``TARGET_PROGRAMS``) when B * Hkv alone is too few."""
    block_k = 64 if head_dim <= 128 else 32
    tiles = max(-(-span // block_k), 1)
    want = max(1, min(tiles, -(-TARGET_PROGRAMS // (batch * kv_heads))))
    chunk = -(-tiles // want) * block_k
    return block_k, chunk, max(-(-span // chunk), 1)


def _kernel(q_ref, k_ref, v_ref, vis_ref, o_ref, m_ref, l_ref, *, scale, group, num_queries,
            span, block_k, chunk):
    """One (b, h, split) program. q_ref [Rp, D]; k_ref, v_ref [L, D]; vis_ref [Q, S] (bool);
    o_ref [Rp, D], m_ref, l_ref [Rp] (f32)."""
    rows = q_ref.shape[0]
    start = pl.program_id(2) * chunk
    q = q_ref[...]
    query_of_row = jnp.minimum(jnp.arange(rows) // group, num_queries - 1)
    offsets = jnp.arange(block_k)

    def tile(t, carry):
        o, m, l = carry
        keys = start + t * block_k + offsets                                       # [block_k]
        inside = keys < span
        k = plgpu.load(k_ref.at[pl.ds(start + t * block_k, block_k), :], mask=inside[:, None], other=0)
        v = plgpu.load(v_ref.at[pl.ds(start + t * block_k, block_k), :], mask=inside[:, None], other=0)
        vis = plgpu.load(vis_ref.at[query_of_row[:, None], keys[None, :]], mask=inside[None, :],
                         other=False)                                               # [Rp, block_k]
        s = jnp.where(vis, plgpu.dot(q, k, trans_b=True) * scale, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        o = o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return o, m_new, l * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((rows,), NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, chunk // block_k, tile, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    group: int
    splits: int
    chunk: int
    block_k: int
    interpret: bool


def _call(q, k, v, visible, config: _Config):
    """The pallas_call: q [B, Hkv, Rp, D], k, v [B, Hkv, L, D], visible [B, Q, S] -> per split
    (o [B, Hkv, splits, Rp, D], m, l [B, Hkv, splits, Rp])."""
    b, hkv, rp, d = q.shape
    nq, span = visible.shape[1:]
    length = k.shape[2]
    kernel = functools.partial(_kernel, scale=config.scale, group=config.group, num_queries=nq,
                               span=span, block_k=config.block_k, chunk=config.chunk)
    kernel.__name__ = KERNEL_NAME
    splits = config.splits
    return pl.pallas_call(
        kernel,
        grid=(b, hkv, splits),
        in_specs=[pl.BlockSpec((None, None, rp, d), lambda i, h, j: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, length, d), lambda i, h, j: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, length, d), lambda i, h, j: (i, h, 0, 0)),
                  pl.BlockSpec((None, nq, span), lambda i, h, j: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, None, rp, d), lambda i, h, j: (i, h, j, 0, 0)),
                   pl.BlockSpec((None, None, None, rp), lambda i, h, j: (i, h, j, 0)),
                   pl.BlockSpec((None, None, None, rp), lambda i, h, j: (i, h, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, rp, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rp), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=config.interpret,
        name=KERNEL_NAME,
    )(q, k, v, visible)


# On a mesh the kernel runs per shard of B and Hkv (each program reads its own (b, h)); without
# this rule XLA's partitioner would all-gather its operands (a custom call it cannot see into).
_partitioned = custom_partitioning(_call, static_argnums=(4,))


def _shard(config, mesh, arg_shapes, result_shape):
    spec = tuple(arg_shapes[0].sharding.spec) + (None, None)
    batch, heads = spec[0], spec[1]
    args = tuple(NamedSharding(mesh, P(batch, heads)) for _ in range(3)) + (NamedSharding(mesh, P(batch)),)
    outs = (NamedSharding(mesh, P(batch, heads)),) * 3
    return mesh, functools.partial(_call, config=config), outs, args


_partitioned.def_partition(
    partition=_shard,
    infer_sharding_from_operands=lambda config, mesh, arg_shapes, result_shape: _shard(
        config, mesh, arg_shapes, result_shape)[2],
    sharding_rule="b h r d, b h l d, b h l d, b q s -> b h j r d, b h j r, b h j r",
    need_replication_factors=("r", "d", "l", "q", "s", "j"))


def cache_partials(qg: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float,
                   interpret: bool = False, programs: int | None = None):
    """Softmax partials of queries qg [B, Q, Hkv, G, D] over one layer's cache k, v [B, Hkv, L, D],
    of which the first S = ``visible.shape[-1]`` slots are read (visible [B, Q, S], True = seen).

    Returns (o [B, Hkv, G, Q, D], m [B, Hkv, G, Q], l [B, Hkv, G, Q]), all f32: with the scores
    s = scale * q.k over the visible slots, m = max s (``NEG_INF`` where none is visible),
    l = sum exp(s - m), o = sum exp(s - m) v (zeros where none is visible). ``programs``
    overrides the number of S splits (tests); ``interpret`` runs the kernel in Pallas interpret
    mode (any backend)."""
    b, nq, hkv, g, d = qg.shape
    span, rows = visible.shape[-1], nq * g
    if span == 0:                                                                   # nothing to read
        return (jnp.zeros((b, hkv, g, nq, d), jnp.float32), jnp.full((b, hkv, g, nq), NEG_INF, jnp.float32),
                jnp.zeros((b, hkv, g, nq), jnp.float32))
    rp = _rows(rows)
    block_k, chunk, splits = plan(b, hkv, span, d)
    if programs is not None:
        chunk = -(-max(-(-span // programs), 1) // block_k) * block_k
        splits = max(-(-span // chunk), 1)
    q = qg.transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)                      # row r = q * G + g
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rp - rows), (0, 0)))
    o, m, l = _partitioned(q, k, v, visible, _Config(float(scale), g, splits, chunk, block_k, interpret))
    top = jnp.max(m, axis=2)                                                        # combine the splits
    w = jnp.exp(m - top[:, :, None])
    o = jnp.sum(o * w[..., None], axis=2)
    l = jnp.sum(l * w, axis=2)
    unflat = lambda a: jnp.moveaxis(a[:, :, :rows].reshape(b, hkv, nq, g, *a.shape[3:]), 3, 2)
    return unflat(o), unflat(top), unflat(l)


def flops(q_shape, visible_shape) -> float:
    """The kernel's matmul flops from its operands' shapes (q [B, Hkv, Rp, D], visible [B, Q, S]):
    scores and values, 2 * 2 * B * Hkv * Rp * S * D (padded rows included: they run)."""
    return 4.0 * math.prod(q_shape) * visible_shape[-1]
