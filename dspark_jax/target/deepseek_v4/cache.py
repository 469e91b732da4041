"""DeepSeek-V4's decode cache (``runtime.Cache``): a sliding-window ring, the compressors' partial
windows and pooled entries, the Lightning Indexer's keys.

Shapes: L layers, B rows, W = ``sliding_window``, D = ``head_dim``, N layers of a compressor group
(CSA or HCA), R ring slots, P = a compressor's projection width (2 * width on CSA's overlapping
compressors, width on HCA's), C = capacity // ratio entry slots, T new tokens of a delta.

=================  ==========================  ==============================================
leaf               shape                        holds
=================  ==========================  ==============================================
window             [L, B, W, D] (cache dtype)   rotated K = V of the last W committed positions
                                                (position p at slot p % W): all a query at
                                                p' >= lengths needs of the sliding window
csa / hca / index  ``Compressor``:
  .kv, .gate       [N, B, R, P] float32         the raw projections of the last R committed
                                                positions (slot p % R): the partial window and,
                                                on CSA (R = 2 * ratio), the window before it
  .entries         [N, B, C, E]                 pooled entries (normed, rotated), entry w at
                                                slot w; E = D (cache dtype) or the indexer's
                                                head dim (float32)
lengths            [B] int32                    committed positions per row
=================  ==========================  ==============================================

A forward over T new tokens returns a delta of the same structure (``window`` [L, B, T, D]; each
compressor's ``kv``/``gate`` [N, B, T, P] and ``entries`` [N, B, T, E]: the entry that token t
completes, zero where it completes none); ``commit`` folds in each row's first ``n_new`` tokens.
Pooled entries are never undone: only accepted tokens reach ``commit`` (the protocol has no
rollback), so after a rejection the next forward rebuilds the partial window from the ring.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dspark_jax import runtime
from dspark_jax.target.deepseek_v4.config import CSA, HCA, DeepseekV4Config

RING_AXES = ("layers", runtime.BATCH, None, None)
DELTA_AXES = ("layers", runtime.BATCH, runtime.STEP, None)


@flax.struct.dataclass
class Compressor:
    """One compressor group's state (or its delta: the same fields over T tokens)."""

    kv: jax.Array
    gate: jax.Array
    entries: jax.Array
    ratio: int = flax.struct.field(pytree_node=False)

    def axes(self, leaf_axes: tuple) -> "Compressor":
        return Compressor(leaf_axes, leaf_axes, leaf_axes, self.ratio)

    def commit(self, delta: "Compressor", lengths: jax.Array, n_new: jax.Array) -> "Compressor":
        """Ring: each row's last (at most R) accepted projections; entries: every accepted token
        that completes a window writes its entry."""
        pos, keep = _accepted(lengths, n_new, delta.kv.shape[2])
        ring = self.kv.shape[2]
        slots = jnp.where(keep & (pos >= lengths[:, None] + n_new[:, None] - ring), pos % ring, ring)
        done = keep & ((pos + 1) % self.ratio == 0)
        entry = jnp.where(done, (pos + 1) // self.ratio - 1, self.entries.shape[2])
        return Compressor(_scatter(self.kv, delta.kv, slots), _scatter(self.gate, delta.gate, slots),
                          _scatter(self.entries, delta.entries, entry), self.ratio)


@flax.struct.dataclass
class V4Delta:
    """What T new tokens add to a ``V4Cache`` (module docstring)."""

    window: jax.Array
    csa: Compressor | None
    index: Compressor | None
    hca: Compressor | None


@flax.struct.dataclass
class V4Cache:
    """DeepSeek-V4's decode cache (module docstring)."""

    window: jax.Array
    csa: Compressor | None
    index: Compressor | None
    hca: Compressor | None
    lengths: jax.Array
    capacity: int = flax.struct.field(pytree_node=False)

    def _groups(self, axes: tuple):
        return {k: None if g is None else g.axes(axes) for k, g in
                (("csa", self.csa), ("index", self.index), ("hca", self.hca))}

    def axes(self) -> "V4Cache":
        return V4Cache(window=("layers", runtime.BATCH, None, "head_dim"), lengths=(runtime.BATCH,),
                       capacity=self.capacity, **self._groups(RING_AXES))

    def delta_axes(self) -> V4Delta:
        return V4Delta(window=DELTA_AXES, **self._groups(DELTA_AXES))

    def commit(self, delta: V4Delta, n_new: jax.Array) -> "V4Cache":
        """Fold in the first ``n_new[b]`` tokens of row b's delta and advance ``lengths``."""
        n_new = n_new.astype(jnp.int32)
        pos, keep = _accepted(self.lengths, n_new, delta.window.shape[2])
        w = self.window.shape[2]
        slots = jnp.where(keep & (pos >= self.lengths[:, None] + n_new[:, None] - w), pos % w, w)
        group = lambda g, d: None if g is None else g.commit(d, self.lengths, n_new)  # noqa: E731
        return V4Cache(_scatter(self.window, delta.window, slots), group(self.csa, delta.csa),
                       group(self.index, delta.index), group(self.hca, delta.hca),
                       self.lengths + n_new, self.capacity)


def _accepted(lengths: jax.Array, n_new: jax.Array, steps: int):
    """(positions [B, T] of a delta's tokens, [B, T] bool: among the row's first n_new)."""
    pos = lengths[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    return pos, runtime.step_mask(n_new, steps)


def _scatter(buf: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """buf [N, B, S, ...] with new [N, B, T, ...] written at slots [B, T] (out of range: dropped;
    in place when donated)."""
    rows = jnp.arange(buf.shape[1])[:, None]
    return buf.at[:, rows, slots].set(new.astype(buf.dtype), mode="drop")


def init_cache(cfg: DeepseekV4Config, batch: int, capacity: int, dtype=jnp.float32,
               max_extend: int | None = None) -> V4Cache:
    """An empty cache of ``batch`` rows holding up to ``capacity`` positions (``max_extend`` is
    not needed: the rings hold committed positions only, the new tokens come with the forward)."""
    del max_extend
    d = cfg.head_dim

    def group(kind: str, ratio: int, ring: int, width: int, entry_width: int, entry_dtype):
        n = len(cfg.layer_ids(kind))
        if not n:
            return None
        zeros = jnp.zeros((n, batch, ring, width), jnp.float32)
        return Compressor(zeros, zeros, jnp.zeros((n, batch, capacity // ratio, entry_width), entry_dtype),
                          ratio)

    r = cfg.csa_ratio
    return V4Cache(
        window=jnp.zeros((cfg.num_hidden_layers, batch, cfg.sliding_window, d), dtype),
        csa=group(CSA, r, 2 * r, 2 * d, d, dtype),
        index=group(CSA, r, 2 * r, 2 * cfg.index_head_dim, cfg.index_head_dim, jnp.float32),
        hca=group(HCA, cfg.hca_ratio, cfg.hca_ratio, d, d, dtype),
        lengths=jnp.zeros((batch,), jnp.int32), capacity=capacity)
