"""The drafter at decode time: its context cache and one block proposal per row.

Shapes: B rows, L cache capacity, G block size, V vocab, Ld draft layers, Hkv KV
heads, D head_dim, T new context positions, n*H concatenated target features.

The context cache holds the drafter's keys/values of the committed positions
(``context_kv`` of the projected target features): row p at slot p, or for a family with a
``runtime.ContextRing`` (a sliding-window drafter, DeepSeek-V4's module) only the last W rows,
position p at slot p mod W (memory O(W), not O(L)). Only committed positions are written, so a
ring's slots always hold the W positions before the anchor. The backbone functions are the
drafter family's (``families.draft_ops``: Qwen3 ``draft.backbone``, Gemma4 ``draft.gemma4.OPS``).
A block at anchor position p reads context rows < p and the whole block (paper section 3).
``PROPOSER`` is the block kind's ``runtime.Proposer`` (the context cache is its dstate).
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import DraftConfig
from dspark_jax import families, runtime, sampling
from dspark_jax import params as params_lib
from dspark_jax.draft import confidence, markov


CONTEXT_AXES = ("layers", runtime.BATCH, "kv_heads", runtime.STEP, "head_dim")  # head-major: nn.cache_scores
LAYER_CONTEXT_AXES = CONTEXT_AXES[1:]  # one layer's buffer of a per-layer cache


@flax.struct.dataclass
class ContextCache:
    """Draft context keys/values ``k, v [Ld, B, Hkv, L, D]``, or L-tuples of per-layer
    ``[B, Hkv, L, D]`` buffers (``per_layer``: for per-layer draft params on GPUs, as the target's
    ``KVCache``); row b holds positions < pos[b] (slot = position; with ``ring`` the last L of
    them, slot = position mod L; ``v`` None: K = V)."""

    k: jax.Array | tuple
    v: jax.Array | tuple | None
    ring: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return (self.k[0] if self.per_layer else self.k).shape[-2]

    def axes(self) -> "ContextCache":
        """Logical axes of k and v (``runtime``'s cache declaration)."""
        kv = tuple(LAYER_CONTEXT_AXES for _ in self.k) if self.per_layer else CONTEXT_AXES
        return ContextCache(kv, None if self.v is None else kv, self.ring)

    @classmethod
    def from_prefix(cls, k_new: jax.Array, v_new: jax.Array, max_len: int,
                    per_layer: bool = False) -> "ContextCache":
        """A cache of capacity ``max_len`` holding k_new, v_new [Ld, B, Hkv, P, D] at slots 0..P-1
        (``per_layer``: one buffer per layer)."""
        p = k_new.shape[3]
        shape = (*k_new.shape[1:3], max_len, k_new.shape[4])
        fill = lambda new: jnp.zeros(shape, new.dtype).at[:, :, :p].set(new)  # noqa: E731
        if per_layer:
            return cls(tuple(map(fill, k_new)), tuple(map(fill, v_new)))
        full = (k_new.shape[0], *shape)
        return cls(jnp.zeros(full, k_new.dtype).at[:, :, :, :p].set(k_new),
                   jnp.zeros(full, v_new.dtype).at[:, :, :, :p].set(v_new))

    def scatter(self, k_new: jax.Array, v_new: jax.Array, slots: jax.Array) -> "ContextCache":
        """Write k_new, v_new [Ld, B, Hkv, T, D] at ``slots [B, T]`` (slots >= L are dropped)."""
        def write(buf, new):  # new is stacked [Ld, ...] either way (``backbone.map_layers``)
            if self.per_layer:
                return tuple(runtime.write_steps(b, n, slots) for b, n in zip(buf, new))
            return runtime.write_steps(buf, new, slots)
        return self.replace(k=write(self.k, k_new), v=None if self.v is None else write(self.v, v_new))

    def read(self, span: int) -> tuple:
        """(k, v) as ``block_forward`` reads the first ``span`` slots: the stacked arrays cut to
        them; per-layer buffers whole (``block_forward`` reads their first ``span`` slots where
        they lie: a slice would be a copy for the CUDA attention kernel's operands)."""
        if self.per_layer:
            return self.k, self.v
        cut = lambda a: a[..., :span, :]  # noqa: E731
        return jax.tree.map(cut, self.k), jax.tree.map(cut, self.v)

    def slots(self, positions: jax.Array, write: jax.Array) -> jax.Array:
        """Slots [B, T] of positions [B, T] where ``write`` (else L: dropped). A ring keeps each
        row's last L written positions (distinct mod L) at position mod L."""
        if not self.ring:
            return jnp.where(write, positions, self.max_len)
        last = jnp.max(jnp.where(write, positions, -1), axis=1, keepdims=True)
        return jnp.where(write & (positions > last - self.max_len), positions % self.max_len, self.max_len)


def context_kv(dparams: dict, dcfg: DraftConfig, taps: jax.Array, positions: jax.Array):
    """Context k, v [Ld, B, Hkv, T, D] of target features taps [B, T, n*H] at positions [B, T]."""
    ops = families.draft_ops(dcfg)
    ctx = ops.project_context(dparams, dcfg, taps)
    return ops.context_kv(dparams, dcfg, ctx, positions)


def init_context(dparams: dict, dcfg: DraftConfig, taps: jax.Array, max_len: int,
                 lengths: jax.Array | None = None, per_layer: bool = False) -> ContextCache:
    """Context cache after a prefill: taps [B, P, n*H] of positions 0..P-1 (row b's first
    ``lengths[b]`` committed, default all P), capacity ``max_len`` (a ring family's: its window W,
    at most ``max_len``); ``per_layer``: one buffer per layer (position-indexed caches only)."""
    b, p = taps.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    k, v = context_kv(dparams, dcfg, taps, positions)
    ring = families.draft_ops(dcfg).ring
    if ring is None:
        return ContextCache.from_prefix(k, v, max_len, per_layer)
    shape = (*k.shape[:3], min(ring.rows(dcfg), max_len), k.shape[4])
    empty = ContextCache(jnp.zeros(shape, k.dtype), None if ring.shared_kv else jnp.zeros(shape, v.dtype), True)
    lengths = jnp.full((b,), p, jnp.int32) if lengths is None else lengths
    return empty.scatter(k, v, empty.slots(positions, positions < lengths[:, None]))


def extend_context(dparams: dict, dcfg: DraftConfig, cache: ContextCache, taps: jax.Array,
                   positions: jax.Array, write: jax.Array) -> ContextCache:
    """Add the features taps [B, T, n*H] of positions [B, T] where ``write [B, T]`` (committed
    positions only: a ring's slot is reused W positions later)."""
    k_new, v_new = context_kv(dparams, dcfg, taps, positions)
    return cache.scatter(k_new, v_new, cache.slots(positions, write))


class Proposal(NamedTuple):
    """One drafted block per row: drafts [B, G]; logits [B, G, V] (after the Markov bias,
    the distribution the drafts were sampled from); conf_logits [B, G] (zeros without a
    confidence head)."""

    drafts: jax.Array
    logits: jax.Array
    conf_logits: jax.Array


def block_hidden(dparams: dict, dcfg: DraftConfig, anchor: jax.Array, pos: jax.Array,
                 ctx: ContextCache, span: int | None = None) -> jax.Array:
    """Backbone output hidden [B, G, H] of the block [anchor, MASK, ..] at positions pos..pos+G-1
    (anchor [B], pos [B]), attending to context rows < pos and the whole block. ``span`` (static,
    default the capacity): read only the first ``span`` context rows (every row needs pos <= span;
    a ring reads all its W slots: those < pos hold positions pos-W..pos-1 that exist)."""
    b = anchor.shape[0]
    g = dcfg.block_size
    chex.assert_shape(pos, (b,))
    chex.assert_shape(jax.tree.leaves((ctx.k, ctx.v)), (b, dcfg.num_key_value_heads, None, dcfg.head_dim)
                      if ctx.per_layer else (dcfg.num_hidden_layers, b, dcfg.num_key_value_heads, None, dcfg.head_dim))
    block_ids = jnp.concatenate(
        [anchor[:, None], jnp.full((b, g - 1), dcfg.mask_token_id, jnp.int32)], axis=1)
    ops = families.draft_ops(dcfg)
    embeds = ops.embed_block(dparams, dcfg, block_ids)[:, None]               # [B,1,G,H]
    block_pos = (pos[:, None] + jnp.arange(g, dtype=jnp.int32))[:, None]      # [B,1,G]
    if ctx.ring:
        visible = (jnp.arange(ctx.max_len)[None, :] < pos[:, None])[:, None]  # [B,1,W]
        return ops.ring.forward(dparams, dcfg, embeds, block_pos, ctx.k, ctx.v, visible)[:, 0]
    span = ctx.max_len if span is None else int(span)
    ctx_mask = jnp.arange(span)[None, None, :] < pos[:, None, None]          # [B,1,S]
    return ops.block_forward(dparams, dcfg, embeds, block_pos, *ctx.read(span),
                             ctx_mask, jnp.ones((b, 1), bool))[:, 0]         # [B,G,H]


def sample_block(dparams: dict, dcfg: DraftConfig, hidden: jax.Array, anchor: jax.Array,
                 key: jax.Array, temperature, greedy: bool) -> tuple[jax.Array, jax.Array]:
    """Drafts [B, G] sampled left to right from hidden [B, G, H] (``lax.scan``, each position
    with the Markov bias of the previous token) and their logits [B, G, V].

    Greedy: the scan carries only tokens (no [G, B, V] stack is written); the logits are
    recomputed after it from the drafts in one batched Markov step (the same values: the
    bias of position k depends only on token k-1 and h_k, except for the recurrent ``rnn``
    head, whose ``teacher_forced`` replays the same ``step`` sequence). A greedy caller that
    does not read them (rejection sampling) lets XLA drop them.
    """
    b, g = anchor.shape[0], dcfg.block_size
    base = families.draft_ops(dcfg).compute_logits(dparams, dcfg, hidden)   # [B,G,V]

    def step(carry, xs):
        prev, mstate = carry
        u_k, h_k, key_k = xs
        if dcfg.has_markov:
            bias, mstate = markov.step(dparams["markov_head"], dcfg, mstate, prev, h_k)
            logits_k = u_k + bias
        else:
            logits_k = u_k
        x_k = sampling.sample_logits(key_k, logits_k, temperature, greedy)
        return (x_k, mstate), (x_k if greedy else (x_k, logits_k))

    mstate0 = markov.init_state(dcfg, (b,), jnp.float32)
    _, ys = jax.lax.scan(
        step, (anchor, mstate0),
        (jnp.moveaxis(base, 1, 0), jnp.moveaxis(hidden, 1, 0), sampling.split(key, g)))
    if not greedy:
        drafts, logits = ys
        return jnp.moveaxis(drafts, 0, 1), jnp.moveaxis(logits, 0, 1)
    drafts = jnp.moveaxis(ys, 0, 1)
    if not dcfg.has_markov:
        return drafts, base
    prev = jnp.concatenate([anchor[:, None], drafts[:, :-1]], axis=1)
    return drafts, markov.teacher_forced(dparams["markov_head"], dcfg, base, prev, hidden)


def propose(dparams: dict, dcfg: DraftConfig, anchor: jax.Array, pos: jax.Array,
            ctx: ContextCache, key: jax.Array, temperature, greedy: bool) -> Proposal:
    """Draft one block per row after ``anchor [B]`` (the last committed token, at ``pos [B]``).

    The block [anchor, MASK, ..] at positions pos..pos+G-1 runs through the backbone
    against context rows < pos (``block_hidden``); then tokens are sampled left to right
    (``sample_block``), each with the Markov bias of the previous one.
    """
    hidden = block_hidden(dparams, dcfg, anchor, pos, ctx)
    return propose_from_hidden(dparams, dcfg, hidden, anchor, key, temperature, greedy)


def propose_from_hidden(dparams: dict, dcfg: DraftConfig, hidden: jax.Array, anchor: jax.Array,
                        key: jax.Array, temperature, greedy: bool) -> Proposal:
    """``propose`` after the backbone: drafts, logits and confidence logits of the block whose
    backbone output is hidden [B, G, H] (``block_hidden``)."""
    b, g = anchor.shape[0], dcfg.block_size
    drafts, logits = sample_block(dparams, dcfg, hidden, anchor, key, temperature, greedy)
    if dcfg.enable_confidence_head:
        prev = jnp.concatenate([anchor[:, None], drafts[:, :-1]], axis=1)
        conf_logits = confidence.logits(dparams, dcfg, hidden, prev)
    else:
        conf_logits = jnp.zeros((b, g), jnp.float32)
    return Proposal(drafts, logits, conf_logits)


# --------------------------------------------------------------------------- the block kind's record


def _init(dparams, dcfg, features, next_tokens, lens, max_len, *, ctx):
    """``runtime.Proposer.init``: the context cache of the prompt's features (tokens unused: a
    block reads the anchor only)."""
    del next_tokens, ctx
    per_layer = params_lib.per_layer(dparams, families.draft_ops(dcfg).stacks)
    return init_context(dparams, dcfg, features, max_len, lens, per_layer=per_layer)


def _propose(dparams, dcfg, cache: ContextCache, anchor, pos, key, temperature, greedy, *, ctx,
             spans, span_index):
    """``runtime.Proposer.propose``: one block per row (``block_hidden`` at the round's compiled
    context span; a ring reads its W slots) and its drafts (``propose_from_hidden``); the cache
    unchanged."""
    del ctx
    hidden = runtime.by_span(lambda s: block_hidden(dparams, dcfg, anchor, pos, cache, s),
                             (None,) if cache.ring else spans, span_index)
    p = propose_from_hidden(dparams, dcfg, hidden, anchor, key, temperature, greedy)
    return p.drafts, p.logits, p.conf_logits if dcfg.enable_confidence_head else None, cache


def _commit(dparams, dcfg, cache: ContextCache, features, next_tokens, positions, n_new, *, ctx):
    """``runtime.Proposer.commit``: the committed positions' context rows (``extend_context``)."""
    del next_tokens, ctx
    return extend_context(dparams, dcfg, cache, features, positions,
                          runtime.step_mask(n_new, positions.shape[1]))


def _state_bytes(dcfg, max_len: int, dtype) -> int:
    """One row's context cache: k and v of every draft layer at ``max_len`` positions, or for a
    ring family (``runtime.ContextRing``) its window's rows (k alone when K = V)."""
    ring = families.draft_ops(dcfg).ring
    rows = max_len if ring is None else min(ring.rows(dcfg), max_len)
    arrays = 1 if ring is not None and ring.shared_kv else 2
    return (arrays * dcfg.num_hidden_layers * rows * dcfg.num_key_value_heads * dcfg.head_dim
            * np.dtype(dtype).itemsize)


PROPOSER = runtime.Proposer(taps=lambda dcfg: tuple(dcfg.target_layer_ids), init=_init, propose=_propose,
                            commit=_commit, state_bytes=_state_bytes, confidence=True)
