"""Flash-decoding over a stacked KV cache on TPU: a Pallas (Mosaic) kernel for a few queries per row.

The TPU counterpart of ``dspark_jax.flash`` (the CUDA kernel; read its docstring first): written
as XLA ops, a decode step's attention over one layer's cache writes f32 scores [B, Hkv, G, Q, S]
and re-reads them for the max, the sum, the probabilities and the values dot (~0.7 GB of a
Qwen3-8B round at B = 8 on v5e, benchmarks/results/tpu_copies). This kernel reads the layer's K
and V once, keeps the scores on chip, and returns the same softmax partials (o, m, l) as
``flash.cache_partials``, which ``partials.merge`` combines with the block's own keys.

The stacked cache. On TPU the target's cache is one [L, B, Hkv, C, D] array per K / V and the
forward scans over layers; a custom call whose operand is the layer's dynamic slice gets that
slice materialised (a copy of the layer's cache, more than the kernel saves). So the kernel takes
the WHOLE stack and the layer index, a scalar-prefetch argument (``pltpu.PrefetchScalarGridSpec``)
that its K / V block index maps read: the DMAs fetch the layer's tiles where they lie.

Layout. Queries qg [B, Q, Hkv, G, D] become, per (row b, KV head h), R = G * Qm query rows,
row r = g * Qm + q, with Qm = 1 for one query and Q rounded up to a multiple of 8 otherwise
(padded queries see nothing), R padded to a multiple of 8 (sublanes). The visibility [B, Q, S]
goes in as int8 [B, Qm, nT * T] (padded slots unseen); inside, its Qm rows are tiled G times
(aligned 8-row pieces) or, for one query, broadcast. Grid (B, Hkv, nT): per (b, h) the S slots
in nT tiles of T (a multiple of 128, at most ``MAX_TILE``), the tile axis sequential with the
online softmax in VMEM scratch (o [R, D], m, l [R, 1], f32): scores ``q @ k^T`` in the input
dtype with f32 accumulation, times ``scale``, masked; ``p @ v`` with p in the input dtype,
accumulated in f32 (the CUDA kernel's arithmetic). Slots past S -- the tail of the last tile --
are masked and their V zeroed (an edge tile past C holds undefined data). Nothing S-sized is
written. On a mesh it runs per shard of B and Hkv (``shard_map``).

It is traced only into programs that target TPU (``applies``: the forward's ``Context``
platform, from its mesh's devices) and lowered only in ``platform_dependent``'s ``tpu`` branch
(``partials.dispatch``); ``interpret=True`` runs the kernel body on any backend (the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from dspark_jax import sharding
from dspark_jax.kernels.partials import NEG_INF, SMALL_QUERY

# The kernel's name in the compiled HLO (the ``tpu_custom_call``'s backend config): ``hlo_cost``
# counts its bytes and flops by it.
KERNEL_NAME = "dspark_flash_decode_tpu"
MAX_TILE = 2048  # slots per grid step: K + V tiles double-buffered, 2 x 2 x 2048 x D x 2 B = 2 MiB at D = 128


def applies(platform: str, num_queries: int, head_dim: int, cache_dtype, compute_dtype) -> bool:
    """Whether a forward on ``platform`` (``runtime.Context.platform``) hands its stacked cache to
    the kernel: a TPU program, a decode step's few queries (<= ``SMALL_QUERY``), heads a
    multiple of 128 lanes wide and a cache already in the compute dtype (a cast would copy the
    whole stack). Narrower heads: XLA:TPU lays the cache out with its slots minor, and the kernel's
    row-major operand then costs a relayout copy of the whole stack per round (the tiny fixture's
    16-wide heads: 2 x [6, 1, 1, 256, 16] copies)."""
    return (platform == "tpu" and num_queries <= SMALL_QUERY and head_dim % 128 == 0
            and jnp.dtype(cache_dtype) == jnp.dtype(compute_dtype))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static layout of one call (see the module docstring): padded queries ``qm``, rows ``rows``
    (>= G * qm, a multiple of 8), slots per tile ``tile`` and tiles ``tiles`` covering ``span``."""
    group: int
    qm: int
    rows: int
    span: int
    tile: int
    tiles: int
    scale: float
    interpret: bool

    @classmethod
    def make(cls, nq: int, group: int, span: int, capacity: int, scale: float, interpret: bool = False,
             tile: int | None = None) -> "Plan":
        qm = 1 if nq == 1 else _round_up(nq, 8)
        t = tile or min(MAX_TILE, _round_up(span, 128))
        if t > capacity:  # a short cache: one tile of the whole slot axis (a full-dim block)
            t = capacity
        return cls(group, qm, _round_up(group * qm, 8), span, t, -(-span // t), float(scale), interpret)


def _kernel(layer_ref, q_ref, k_ref, v_ref, vis_ref, o_ref, m_ref, l_ref, acc, m_acc, l_acc, *, plan: Plan):
    """One (b, h, tile) step. q_ref [R, D]; k_ref, v_ref [T, D] (layer ``layer_ref[0]``'s tile);
    vis_ref [Qm, T] int8; outputs o_ref [R, D], m_ref, l_ref [R, 1] (f32), written at the last tile."""
    del layer_ref  # used by the index maps
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)
        m_acc[...] = jnp.full(m_acc.shape, NEG_INF, jnp.float32)
        l_acc[...] = jnp.zeros(l_acc.shape, jnp.float32)

    rows, t = plan.rows, plan.tile
    inside = j * t + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1) < plan.span          # [1, T]
    vis = vis_ref[...].astype(jnp.int32)                                               # [Qm, T]
    if plan.qm == 1:
        vis = jnp.broadcast_to(vis, (rows, t))
    else:
        pieces = [vis] * plan.group
        if rows > plan.group * plan.qm:
            pieces.append(jnp.zeros((rows - plan.group * plan.qm, t), jnp.int32))
        vis = jnp.concatenate(pieces, axis=0)                                          # [R, T], row g * Qm + q
    vis = jnp.logical_and(vis != 0, inside)
    k = k_ref[...]
    # bf16 products are exact in the f32 accumulation: the default precision, whatever
    # jax_default_matmul_precision says (Mosaic refuses an fp32 contract precision of bf16
    # operands: "Bad lhs type"); f32 operands keep the configured precision
    precision = None if k.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    s = jax.lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    s = jnp.where(vis, s * plan.scale, NEG_INF)                                     # [R, T]
    m_prev = m_acc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
    correction = jnp.exp(m_prev - m_new)
    l_acc[...] = l_acc[...] * correction + jnp.sum(p, axis=1, keepdims=True)
    m_acc[...] = m_new
    v = v_ref[...]
    v = jnp.where(j * t + jax.lax.broadcasted_iota(jnp.int32, (t, 1), 0) < plan.span, v, jnp.zeros_like(v))
    acc[...] = acc[...] * correction + jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

    @pl.when(j == plan.tiles - 1)
    def _():
        o_ref[...] = acc[...]
        m_ref[...] = m_acc[...]
        l_ref[...] = l_acc[...]


def _call(layer, q, k, v, vis, plan: Plan):
    """The pallas_call: layer int32 [1], q [B, Hkv, R, D], k, v [L, B, Hkv, C, D] (the whole stacks),
    vis int8 [B, Qm, nT * T] -> (o [B, Hkv, R, D], m, l [B, Hkv, R, 1]), f32."""
    # imported here: Pallas TPU costs every process that imports ``nn`` ~0.25 s, and only TPU
    # programs (and the interpret-mode tests) build the kernel
    from jax.experimental.pallas import tpu as pltpu

    b, hkv, rows, d = q.shape
    t = plan.tile
    kv_spec = pl.BlockSpec((None, None, None, t, d), lambda i, h, j, layer: (layer[0], i, h, j, 0))
    row_spec = lambda width: pl.BlockSpec((None, None, rows, width), lambda i, h, j, layer: (i, h, 0, 0))
    kernel = functools.partial(_kernel, plan=plan)
    kernel.__name__ = KERNEL_NAME
    out_bytes = 4 * b * hkv * rows * (d + 2)
    read = (q.size * q.dtype.itemsize + vis.size + 2 * b * hkv * plan.tiles * t * d * k.dtype.itemsize)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, hkv, plan.tiles),
            in_specs=[row_spec(d), kv_spec, kv_spec,
                      pl.BlockSpec((None, plan.qm, t), lambda i, h, j, layer: (i, 0, j))],
            out_specs=[row_spec(d), row_spec(1), row_spec(1)],
            scratch_shapes=[pltpu.VMEM((rows, d), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                            pltpu.VMEM((rows, 1), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((b, hkv, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, rows, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, rows, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=int(flops(q.shape, plan.tiles * t)),
                                      transcendentals=int(b * hkv * rows * plan.tiles * t),
                                      bytes_accessed=int(read + out_bytes)),
        interpret=plan.interpret,
        name=KERNEL_NAME,
    )(layer, q, *(_in_hbm(a, plan) for a in (k, v)), vis)


def _in_hbm(stack, plan: Plan):
    """The stack pinned to HBM for the kernel: left free, XLA:TPU's memory-space assignment, which
    sees a loop-invariant operand read whole by every layer's call, moves a small enough cache
    (one row of Qwen3-8B at 4096 slots: 2 x 38 MB per v5e chip) into on-chip memory before the
    layer loop and copies it back after the commit -- more HBM traffic than the kernel's reads."""
    from jax.experimental.pallas import tpu as pltpu
    return stack if plan.interpret else pltpu.with_memory_space_constraint(stack, pltpu.HBM)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["index"], meta_fields=["mesh", "batch", "heads"])
@dataclasses.dataclass(frozen=True)
class Layer:
    """Where one layer's cache lies in a stacked [L, B, Hkv, C, D] cache: its ``index`` (an int32
    scalar, traced) and the stack's placement -- ``mesh`` (None: one device) and the mesh axes of
    its B and Hkv dims (``placement``). The fourth element of ``nn.attention``'s stacked prefix."""
    index: Any
    mesh: Any = None
    batch: Any = None
    heads: Any = None


def placement(ctx, axes, shape) -> Layer | None:
    """The stack's placement (a ``Layer`` without index) for a forward in ``ctx`` (``runtime.Context``)
    over a stacked cache of logical ``axes`` and ``shape`` [L, B, Hkv, C, D]; None where the mesh
    splits another dim than B and Hkv (the XLA path then)."""
    if ctx.mesh is None:
        return Layer(None)
    spec = tuple(sharding.logical_to_spec(axes, ctx.rule_map, shape, ctx.mesh)) + (None,) * len(shape)
    if any(spec[i] is not None for i in (0, 3, 4)):
        return None
    return Layer(None, ctx.mesh, spec[1], spec[2])


def _partitioned(layer, q, k, v, vis, plan: Plan, where: Layer):
    """``_call`` per shard of B and Hkv on ``where.mesh`` (each grid step reads its own (b, h) tiles
    of the stacks; without it XLA's partitioner would all-gather the operands of the custom call).
    ``shard_map``, not ``custom_partitioning``: libtpu's compile-only client has no custom
    partitioner callbacks ("Custom emitter for CustomSPMDPartitioning not found")."""
    call = functools.partial(_call, plan=plan)
    if where.mesh is None:
        return call(layer, q, k, v, vis)
    rows, stack = P(where.batch, where.heads), P(None, where.batch, where.heads)
    return jax.shard_map(call, mesh=where.mesh, in_specs=(P(), rows, stack, stack, P(where.batch)),
                         out_specs=(rows,) * 3, check_vma=False)(layer, q, k, v, vis)


def cache_partials(qg: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array, visible: jax.Array,
                   scale: float, where: Layer | None = None, interpret: bool = False, tile: int | None = None):
    """Softmax partials of queries qg [B, Q, Hkv, G, D] over layer ``layer`` (an int32 scalar) of a
    stacked cache k, v [L, B, Hkv, C, D], of which the first S = ``visible.shape[-1]`` slots are
    read (visible [B, Q, S], True = seen). Returns what ``flash.cache_partials`` returns for
    ``k[layer], v[layer]``: (o [B, Hkv, G, Q, D], m, l [B, Hkv, G, Q]), f32, m = ``NEG_INF``,
    l = 0 and o = 0 where nothing is visible. ``where``: the stacks' placement (``placement``;
    None: one device). ``tile`` overrides the slots per grid step (tests);
    ``interpret`` runs the kernel in Pallas interpret mode (any backend)."""
    b, nq, hkv, g, d = qg.shape
    span = visible.shape[-1]
    if span == 0:
        return (jnp.zeros((b, hkv, g, nq, d), jnp.float32), jnp.full((b, hkv, g, nq), NEG_INF, jnp.float32),
                jnp.zeros((b, hkv, g, nq), jnp.float32))
    plan = Plan.make(nq, g, span, k.shape[3], scale, interpret, tile)
    q = jnp.pad(qg.transpose(0, 2, 3, 1, 4), ((0, 0),) * 3 + ((0, plan.qm - nq), (0, 0)))
    q = q.reshape(b, hkv, g * plan.qm, d)                                              # row g * Qm + q
    q = jnp.pad(q, ((0, 0), (0, 0), (0, plan.rows - g * plan.qm), (0, 0)))
    vis = jnp.pad(visible.astype(jnp.int8), ((0, 0), (0, plan.qm - nq), (0, plan.tiles * plan.tile - span)))
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    o, m, l = _partitioned(layer, q, k, v, vis, plan, where or Layer(None))
    unflat = lambda a: a[:, :, :g * plan.qm].reshape(b, hkv, g, plan.qm, *a.shape[3:])[:, :, :, :nq]
    return unflat(o), unflat(m)[..., 0], unflat(l)[..., 0]


def flops(q_shape, slots: int) -> float:
    """The kernel's matmul flops from its q operand's shape [B, Hkv, R, D] and the slots its tiles
    cover: scores and values, 2 * 2 * B * Hkv * R * slots * D (padded rows and slots included)."""
    return 4.0 * math.prod(q_shape) * slots
