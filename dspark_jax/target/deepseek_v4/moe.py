"""DeepSeek-V4's routed-expert dispatch: dense (the exact reference) and sorted (sparse), one
device or expert-parallel over a mesh's ``expert`` axis.

Shapes: T = B * S tokens, H hidden, I = ``moe_intermediate_size``, E routed experts, k =
``num_experts_per_tok``, M = T * k (token, expert) assignments, G = E / ep experts per device.
The router (``model.route``) gives ``combine [B, S, E]``: a token's weight for each expert, zero
for the experts it did not choose. Both dispatches compute

    routed[t] = sum_e combine[t, e] * w2_e(silu(min(x_t w1_e, lim)) * clip(x_t w3_e, ±lim))

**dense**: every expert on every token, then the combine matrix weights them. Exact (an
unchosen expert adds exact zeros), no capacity, no dropping. FLOPs 6·T·E·H·I; temporaries
[T, E, I] (gate, up, hidden) and [T, E, H]. The cost is E / k times the routed FLOPs (V4-Flash:
256 / 6 ≈ 43x), so it is used only for tiny sizes (``DENSE_MAX``): the golden fixture, tests.

**sorted**: the k chosen experts of each token are the top k of ``combine`` (its only non-zero
entries, so this is the same function; a hash table naming one expert twice gives one entry of
the summed weight, as in dense). The M assignments are sorted by expert (stable argsort), the
sorted rows' tokens gathered, and each expert's rows go through its SwiGLU as one grouped matmul
(``grouped_swiglu``), then the rows are un-sorted, weighted and summed per token. Lossless: no
capacity, every assignment is computed (static shapes: the bound is M rows). Grouped matmul:

- ``blocks`` (default off TPU): the rows of each expert are cut into blocks of ``block`` rows
  (one expert per block; the last block of an expert is partly padding); a ``lax.scan`` over at
  most ``ceil(M / block) + G`` blocks runs each used block against its expert's weights (unused
  trailing blocks are skipped by ``lax.cond``). FLOPs 6·H·I·(M + G·block) at most (padding
  included), weight reads 3·H·I per used block; temporaries [M, H] (sorted rows), the block
  outputs [ceil(M / block) + G, block, H] and one block's [block, I].
- ``ragged`` (default on TPU): ``jax.lax.ragged_dot``, three of them. TPU lowers it to its
  grouped matmul (6·M·H·I FLOPs); XLA:CPU lowers it to a masked dense form over [E, M, H] (E
  times the FLOPs and memory), so ``blocks`` is the default off TPU (GPU's ragged-dot lowering
  was not measured here).

Against dense: 6·M·H·I = k / E of dense's routed FLOPs plus padding; memory O(M·H) instead of
O(T·E·(H + I)); the price is the sort (O(M log M)) and gathers of [M, H].

**Expert parallelism** (a mesh with an ``expert`` axis, ``ctx.mesh``): ``shard_map`` over the
mesh; tokens are sharded by batch (data / fsdp) and replicated over the expert and tensor axes;
each device holds its G = E / ep experts (their ``mlp`` dim split over ``tensor``), takes the
assignments to its own experts among all its tokens' M (the others sort to the end and are never
computed), and one ``psum`` over the expert (and tensor) axes sums the per-device partial outputs.
No all-to-all: the static row bound per device stays M (any token may choose only local experts),
the work is what was routed there. fsdp-sharded expert weights are all-gathered at the
``shard_map`` boundary (ZeRO-3). Dense on a mesh keeps [T, E, ·] sharded over ``expert``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dspark_jax import sharding

DENSE, SORTED = "dense", "sorted"
DISPATCHES = (DENSE, SORTED)
DENSE_MAX = 1024  # tokens x experts up to which the dense dispatch is chosen (tiny models, tests)
MAX_BLOCK = 128


def choose(tokens: int, cfg) -> str:
    """The dispatch for ``tokens`` tokens (static): dense while tokens * E <= ``DENSE_MAX`` or
    every expert is chosen anyway (k == E), else sorted."""
    e = cfg.n_routed_experts
    return DENSE if tokens * e <= DENSE_MAX or cfg.num_experts_per_tok == e else SORTED


def _rules(ctx) -> dict:
    """The logical->mesh rules of ``ctx`` (``runtime.Context.rule_map``, a plain mapping, or the
    default rules)."""
    rules = getattr(ctx, "rule_map", None)
    if rules is None:
        rules = getattr(ctx, "rules", None)
    return dict(rules) if rules else dict(sharding.DEFAULT_RULES)


def _names(part) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return (part,) if isinstance(part, str) else tuple(part or ())


def _mesh(ctx):
    return getattr(ctx, "mesh", None) if ctx is not None else None


def _act(cfg, x, w1, w3):
    """Clamped SwiGLU's hidden activation of rows x [..., H] for one expert's (w1, w3) [H, I]."""
    lim = cfg.swiglu_limit
    return jax.nn.silu(jnp.minimum(x @ w1, lim)) * jnp.clip(x @ w3, -lim, lim)


# ----------------------------------------------------------------------------- dense (reference)

def dense(cfg, x: jax.Array, combine: jax.Array, w1, w3, w2, ctx: Any = None) -> jax.Array:
    """Routed output [B, S, H]: every expert on every token, weighted by ``combine`` [B, S, E];
    on a mesh the per-expert activations stay sharded over the ``expert`` axis until the sum."""
    mesh, rules = _mesh(ctx), _rules(ctx)

    def pin(a, axes):
        if mesh is None:
            return a
        return jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, sharding.logical_to_spec(axes, rules, a.shape, mesh)))

    lim = cfg.swiglu_limit
    gate = jnp.minimum(jnp.einsum("bsh,ehi->bsei", x, w1), lim)
    up = jnp.clip(jnp.einsum("bsh,ehi->bsei", x, w3), -lim, lim)
    hidden = pin(jax.nn.silu(gate) * up, ("batch", None, "expert", "mlp"))
    per_expert = pin(jnp.einsum("bsei,eih->bseh", hidden, w2), ("batch", None, "expert", None))
    return jnp.einsum("bseh,bse->bsh", per_expert, combine.astype(per_expert.dtype))


# ----------------------------------------------------------------------------- grouped matmuls

def block_rows(m: int, e: int) -> int:
    """Rows per block of the ``blocks`` grouped matmul: the power of two at or above the mean
    rows per expert (M / E), within [8, ``MAX_BLOCK``]."""
    mean = max(1, -(-m // e))
    return min(MAX_BLOCK, max(8, 1 << (mean - 1).bit_length()))


def grouped_swiglu_blocks(cfg, xs: jax.Array, sizes: jax.Array, w1, w3, w2, block: int) -> jax.Array:
    """xs [M, H] rows sorted by expert, ``sizes [G]`` rows per expert (sum <= M; later rows are
    ignored and come back as garbage) -> [M, H]: row j through its expert's SwiGLU.

    Blocks of ``block`` rows, one expert each; a scan over the ``ceil(M / block) + G`` possible
    blocks computes the used ones (module docstring)."""
    m, h = xs.shape
    g = sizes.shape[0]
    n_blocks = -(-m // block) + g
    per_expert = -(-sizes // block)                 # [G] blocks of each expert
    block_end = jnp.cumsum(per_expert)              # [G] exclusive end block of each expert
    block_start = block_end - per_expert
    row_start = jnp.cumsum(sizes) - sizes           # [G] first sorted row of each expert
    used = block_end[-1]
    padded = jnp.pad(xs, ((0, block), (0, 0)))      # a block's slice never runs past the end

    # for the backward pass keep each block's matmul outputs: without the checkpoint every block's
    # w1[e], w3[e], w2[e] slice is saved ([blocks, H, I] x 3, the layer's experts several times
    # over); with it w2's slices and the block intermediates are not (w1's and w3's still are)
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    def one(_, b):
        e = jnp.minimum(jnp.searchsorted(block_end, b, side="right"), g - 1)
        start = row_start[e] + (b - block_start[e]) * block
        rows = jax.lax.dynamic_slice_in_dim(padded, start, block)

        def run(rows):
            return _act(cfg, rows, w1[e], w3[e]) @ w2[e]
        zeros = lambda r: jnp.zeros((block, w2.shape[-1]), jnp.result_type(xs, w1, w2))
        out = jax.lax.cond(b < used, run, zeros, rows)
        return None, out

    _, out = jax.lax.scan(one, None, jnp.arange(n_blocks))  # [n_blocks, block, H]
    # sorted row j: its expert, then its block and slot
    j = jnp.arange(m)
    e = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), j, side="right"), g - 1)
    offset = j - row_start[e]
    return out[block_start[e] + offset // block, offset % block]


def grouped_swiglu_ragged(cfg, xs: jax.Array, sizes: jax.Array, w1, w3, w2) -> jax.Array:
    """As ``grouped_swiglu_blocks`` with ``jax.lax.ragged_dot`` (TPU's grouped matmul)."""
    lim = cfg.swiglu_limit
    gate = jnp.minimum(jax.lax.ragged_dot(xs, w1, sizes), lim)
    up = jnp.clip(jax.lax.ragged_dot(xs, w3, sizes), -lim, lim)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w2, sizes)


def default_impl(mesh=None) -> str:
    return "ragged" if sharding.platform_of(mesh) == "tpu" else "blocks"


# ----------------------------------------------------------------------------- sorted

def _sorted_local(cfg, x: jax.Array, combine: jax.Array, w1, w3, w2, first, impl: str, block: int | None):
    """The routed output [T, H] of the experts ``first .. first + G - 1`` held here (w* [G, ...])
    for tokens x [T, H] with ``combine [T, E]``: sort the M = T * k assignments by expert (the
    other devices' last), grouped SwiGLU, un-sort, weight, sum per token."""
    t, h = x.shape
    k, g = cfg.num_experts_per_tok, w1.shape[0]
    weight, expert = jax.lax.top_k(combine, k)                  # [T, k] each
    local = expert - first
    mine = (local >= 0) & (local < g)
    key = jnp.where(mine, local, g).reshape(-1)                 # [M]; g = not here
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((g,), jnp.int32).at[key].add(1, mode="drop")
    xs = x[order // k]                                          # [M, H] sorted rows' tokens
    if impl == "ragged":
        ys = grouped_swiglu_ragged(cfg, xs, sizes, w1, w3, w2)
    else:
        ys = grouped_swiglu_blocks(cfg, xs, sizes, w1, w3, w2, block or block_rows(t * k, cfg.n_routed_experts))
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, h)  # un-sort
    weight = jnp.where(mine, weight, 0).astype(ys.dtype)
    ys = jnp.where(mine[..., None], ys, 0)                      # rows never computed here
    return jnp.einsum("tkh,tk->th", ys, weight)


def sorted_dispatch(cfg, x: jax.Array, combine: jax.Array, w1, w3, w2, ctx: Any = None, *,
                    impl: str | None = None, block: int | None = None) -> jax.Array:
    """Routed output [B, S, H] through the sorted dispatch (module docstring); expert-parallel
    (``shard_map``) when ``ctx.mesh`` is set. ``impl``: "blocks" or "ragged" (default: ragged on
    TPU, else blocks); ``block``: rows per block (default ``block_rows``)."""
    b, s, h = x.shape
    e = cfg.n_routed_experts
    mesh = _mesh(ctx)
    impl = impl or default_impl(mesh)
    if mesh is None:
        out = _sorted_local(cfg, x.reshape(b * s, h), combine.reshape(b * s, e), w1, w3, w2, 0, impl, block)
        return out.reshape(b, s, h)

    rules = _rules(ctx)
    spec = lambda axes, shape: sharding.logical_to_spec(axes, rules, shape, mesh)
    x_spec = spec(("batch", None, None), x.shape)
    c_spec = P(*x_spec[:2], None)
    up_spec = spec(("expert", None, "mlp"), w1.shape)
    down_spec = spec(("expert", "mlp", None), w2.shape)
    ep = _names(up_spec[0])                       # mesh axes over the experts
    summed = ep + _names(up_spec[2])              # ... and over their width: partial sums

    def local(x, combine, w1, w3, w2):
        bl, sl, _ = x.shape
        first = jnp.zeros((), jnp.int32)
        for axis in ep:  # flattened index of this device's expert shard
            first = first * mesh.shape[axis] + jax.lax.axis_index(axis)
        first = first * w1.shape[0]
        out = _sorted_local(cfg, x.reshape(bl * sl, h), combine.reshape(bl * sl, e), w1, w3, w2, first,
                            impl, block)
        out = out.reshape(bl, sl, h)
        return jax.lax.psum(out, summed) if summed else out

    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, c_spec, up_spec, up_spec, down_spec),
                         out_specs=x_spec, check_vma=False)(x, combine, w1, w3, w2)


def routed(cfg, x: jax.Array, combine: jax.Array, w1, w3, w2, ctx: Any = None,
           dispatch: str | None = None) -> jax.Array:
    """Routed-expert output [B, S, H] of x [B, S, H] with ``combine [B, S, E]`` and the experts'
    w1, w3 [E, H, I], w2 [E, I, H]; ``dispatch`` "dense" / "sorted" (default ``choose``)."""
    dispatch = dispatch or choose(x.shape[0] * x.shape[1], cfg)
    if dispatch == DENSE:
        return dense(cfg, x, combine, w1, w3, w2, ctx)
    if dispatch == SORTED:
        return sorted_dispatch(cfg, x, combine, w1, w3, w2, ctx)
    raise ValueError(f"unknown MoE dispatch {dispatch!r}; known {DISPATCHES}")
