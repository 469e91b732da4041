"""The runtime protocol: the functions a model family gives the decode engine and the trainer.

A family registers one record next to its model code (``params.Family(..., runtime=...)``);
``families.target_runtime(cfg)`` / ``families.draft_runtime(cfg)`` find it. Nothing under
``decode/`` or ``train/`` knows a family by name, tests for attributes or sniffs signatures:
everything model-specific goes through these records and the cache's own declarations.

Target (``TargetRuntime``)
--------------------------
Shapes: B rows, T new tokens, S cache capacity, H hidden size, n = len(taps), V vocab.

- ``init_cache(cfg, batch, capacity, dtype, max_extend) -> cache``: an empty cache (``lengths``
  zeros) holding up to ``capacity`` positions per row; ``max_extend`` is the longest extend
  after the prefill (G + 1 verified tokens for speculative decoding, 1 autoregressive; None: no
  bound): a family may size windows / rings from it. ``dtype``: the cache's storage dtype. A
  family with ``per_layer`` also takes ``per_layer=True``: the cache for per-layer params
  (``params.for_platform`` on GPUs), its layers as separate buffers.
- ``forward(params, cfg, tokens [B, T], cache | None, *, ctx, taps, span) -> (hidden, features,
  delta)``: ``hidden [B, T, H]`` after the final norm; ``features [B, T, feature_dim]`` the
  concatenated outputs of layers ``taps`` (-1 = the embedding output; None when ``taps`` is
  empty): the drafter's context features. A tap may also be a tagged tuple that only its family
  interprets (DeepSeek-V4.1: ``("attn_in", i)``, the stream mean entering layer i, which V4.1's
  DSpark module reads); the drafter config's ``target_layer_ids`` holds what its family asks for. Without a cache: a causal pass over positions 0..T-1,
  ``delta`` None. With one: token t of row b sits at position ``cache.lengths[b] + t`` and sees
  the committed positions < ``lengths[b]`` plus the new tokens causally; ``delta`` holds what
  the T tokens would add to the cache. **forward never writes**: the caller commits (below),
  outside any ``lax.switch``, so donated buffers are updated in place. ``span`` (static int or
  None = all): the caller guarantees every row it reads has ``lengths <= span``; a family may read
  only the first ``span`` slots of position-indexed leaves. ``ctx`` (``Context``): the mesh, the
  logical->mesh rules and the compute dtype, so a forward may shard inside itself (e.g.
  ``shard_map`` an expert dispatch over ``ctx.mesh``); ``ctx.mesh`` None = one device.
- ``logits(params, cfg, hidden [..., H]) -> [..., V] float32`` (softcapped where the family caps).
- ``feature_dim(cfg, taps) -> int``: the width of ``features`` for layer ids ``taps``.
- ``rules``: extra logical->mesh rules the family's declarations use (e.g. ``{"expert":
  "expert"}``), merged over the decode rules; ``replicable``: logical axes a mesh may leave
  replicated where it does not divide them (``check_mesh`` refuses any other indivisible
  head / MLP dimension before compiling).

Cache (any pytree, e.g. a ``flax.struct.dataclass``) declares itself:

- ``lengths [B] int32``: committed positions per row (row b holds positions < lengths[b]);
- ``capacity`` (static int): positions a row can hold;
- ``axes()``: the same pytree with every array leaf replaced by its logical axes (a tuple of
  names or None, one per dim). Every leaf has one ``BATCH`` axis; position-indexed leaves have
  one ``STEP`` axis. The engine derives from it the shardings (``decode.sharded``), writing one
  request into a batch row (``put_row``) and the mesh checks;
- ``delta_axes()``: the same for the delta ``forward`` returns: every delta leaf has one
  ``BATCH`` axis and one ``STEP`` axis (its T tokens), along which the engine zero-pads a delta
  of a narrow verification to the widest (so every ``lax.switch`` branch returns one shape);
- ``commit(delta, n_new [B] int32) -> cache``: fold in the first ``n_new[b]`` tokens of row b's
  delta (0 <= n_new <= T; 0 for rows that are done) and advance ``lengths`` by ``n_new``. Only
  accepted tokens ever reach a cache (there is no rollback), so a family whose state folds
  tokens in (pooled / compressed entries, running sums) stays exact. Positions past
  ``capacity`` are dropped.

Drafter (``DraftRuntime``)
--------------------------
The backbone functions the training step (``draft.model``) and the decode-time drafter
(``draft.decode``) call: ``project_context(params, cfg, features [B, S, n*H]) -> ctx [B, S, H]``,
``context_kv(params, cfg, ctx, positions [B, S]) -> (k, v) [Ld, B, Hkv, S, D]`` (head-major, as
caches are stored: ``nn.cache_scores``),
``embed_block(params, cfg, ids [B, G]) -> [B, G, H]``, ``block_forward(params, cfg, embeds,
positions, k_ctx, v_ctx, ctx_mask, block_valid, ...) -> hidden``, ``compute_logits(params, cfg,
hidden) -> [..., V] float32``, and ``replicable`` as for a target; ``block_heads`` (optional,
the signature of ``draft.model.block_heads`` without ``ops``) replaces the shared heads for a
family whose heads read other than the backbone's normed output (DeepSeek-V4's module);
``ring`` (optional, ``ContextRing``) makes the decode-time context cache a ring of the window's
rows for a drafter whose blocks read only a sliding window of the context (DeepSeek-V4's module).
``objective`` (optional, ``TrainObjective``): a drafter trained on its own objective instead of
anchored blocks (Eagle3's test-time training); the trainer then calls only it and
``compute_logits`` (the block functions may be None).
``bind`` (optional, ``Context -> DraftRuntime``): the record for a ``Context`` (its mesh), for a
family whose backbone shards inside itself (DeepSeek-V4's module: its MoE stages ``shard_map``
the expert dispatch over ``ctx.mesh``); ``on(ctx)`` gives it (the record itself without ``bind``).

Drafter kinds (``Proposer``)
----------------------------
The decode round reaches a drafter only through its kind's record (``draft.kinds.proposer(cfg)``):
the *block* kind (``draft.decode``: every ``DraftRuntime`` family) or a family's own record
registered as its ``runtime`` (a *chain* kind, ``draft.chain``: MTP, Eagle3). Shapes: G =
``cfg.block_size`` tokens proposed per round (every drafter config exposes it), P prompt
positions, F = ``feature_dim(taps)``. ``dstate`` is the kind's own pytree with ``axes()`` (its
logical axes, ``BATCH`` on every leaf: sharding and ``put_row``).

- ``taps(cfg) -> tuple``: what the target's ``forward`` hands over as ``features`` (layer ids;
  a family may accept tagged entries, e.g. ``("streams",)``; an unknown tag: ConfigError).
- ``init(dparams, cfg, features [B, P, F], next_tokens [B, P], lens [B], max_len, *, ctx) ->
  dstate``: after the prefill; position t's feature and token t + 1 (the last: the first
  sampled token), row b's first ``lens[b]`` positions committed.
- ``propose(dparams, cfg, dstate, anchor [B], pos [B], key, temperature, greedy, *, ctx, spans,
  span_index) -> (drafts [B, G] int32, draft logits [B, G, V] float32 (the distribution each
  draft was sampled from), confidence logits [B, G] or None, dstate)``: the returned dstate may
  hold speculative writes past the committed positions, which ``commit`` overwrites.
- ``commit(dparams, cfg, dstate, features [B, G+1, F], next_tokens [B, G+1], positions [B, G+1],
  n_new [B], *, ctx) -> dstate``: fold in each row's first ``n_new`` verified positions (the
  features of positions pos..pos+n_new-1 and, for each, the token after it).
- ``confidence``: whether the kind can have a confidence head (policies that need one are
  refused before compiling otherwise); ``state_bytes(cfg, max_len, dtype)``: one row's dstate;
  ``with_steps(cfg, k)``: the config proposing k tokens per round (``--draft-steps``; None when
  the checkpoint fixes G).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp

from dspark_jax import sharding

BATCH = "batch"      # the request-row axis of every cache / delta leaf
STEP = "sequence"    # the position (cache) / token (delta) axis


@dataclasses.dataclass(frozen=True)
class Context:
    """What a forward may need to know about where it runs (hashable: a jit static).

    mesh: a ``jax.sharding.Mesh`` or None (one device); rules: logical->mesh rules as sorted
    ``(name, mesh axes)`` pairs (``rule_map`` gives the dict); dtype: the compute dtype (None:
    the params' own, ``compute_dtype``)."""

    mesh: Any = None
    rules: tuple = ()
    dtype: Any = None

    @classmethod
    def make(cls, mesh=None, rules: Mapping[str, Any] | None = None, dtype=None) -> "Context":
        frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                              for k, v in (rules or {}).items()))
        return cls(mesh, frozen, dtype)

    @property
    def rule_map(self) -> dict:
        return dict(self.rules)

    @property
    def platform(self) -> str:
        """The platform the forward's program targets: its mesh's devices' (compile-only TPU / GPU
        devices included), else JAX's default backend."""
        return sharding.platform_of(self.mesh)

    def for_params(self, params) -> "Context":
        """This context with ``dtype`` set (``compute_dtype(params)`` when None)."""
        return self if self.dtype is not None else dataclasses.replace(self, dtype=compute_dtype(params))


LOCAL = Context()


def compute_dtype(params):
    """The dtype a model computes in by default: that of its largest floating-point leaf."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return max(leaves, key=lambda x: math.prod(x.shape)).dtype


class Cache(Protocol):
    """A target family's decode cache (see the module docstring)."""

    lengths: jax.Array

    @property
    def capacity(self) -> int: ...

    def axes(self) -> Any: ...

    def delta_axes(self) -> Any: ...

    def commit(self, delta: Any, n_new: jax.Array) -> "Cache": ...


@dataclasses.dataclass(frozen=True)
class TargetRuntime:
    """A target family's runtime functions (see the module docstring for each contract)."""

    init_cache: Callable[..., Any]
    forward: Callable[..., tuple]
    logits: Callable[..., jax.Array]
    feature_dim: Callable[[Any, tuple], int]
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    replicable: frozenset = frozenset()
    per_layer: bool = False  # ``forward`` also takes its layer stacks as per-layer trees (``params.for_platform``)
    stacks: tuple[str, ...] = ("layers",)  # the params' stacked-layer subtrees ([L, ...] leaves)


@dataclasses.dataclass(frozen=True)
class ContextRing:
    """A drafter whose blocks read only the last ``rows(cfg)`` committed positions (a sliding
    window): its decode-time context cache is a ring of that many rows, position p in slot
    p mod rows (``draft.decode``), one array when ``shared_kv`` (K = V). ``forward(params, cfg,
    embeds [B, 1, G, H], positions [B, 1, G], k [Ld, B, Hkv, W, D], v (None when shared_kv),
    visible [B, 1, W]) -> hidden [B, 1, G, H]``: the block against the visible slots (in slot
    order, each row rotated at its own position)."""

    rows: Callable[[Any], int]
    forward: Callable[..., jax.Array]
    shared_kv: bool = False


@dataclasses.dataclass(frozen=True)
class TrainObjective:
    """A drafter family's own training objective (``DraftRuntime.objective``).

    ``denominator(cfg, input_ids [N, S], loss_mask [N, S]) -> []``: the global batch's loss
    denominator, computed before the gradient pass; ``sums(params, cfg, input_ids [Bm, S],
    features [Bm, S, F], last_hidden [Bm, S, H], loss_mask [Bm, S], *, remat) -> dict``: additive
    statistics of one micro-batch, ``"loss"`` the loss numerator; ``finalize(sums, denominator)
    -> (loss, metrics)`` over the summed statistics."""

    denominator: Callable[..., jax.Array]
    sums: Callable[..., dict]
    finalize: Callable[..., tuple]


@dataclasses.dataclass(frozen=True)
class DraftRuntime:
    """A drafter family's backbone functions (see the module docstring)."""

    project_context: Callable[..., jax.Array]
    context_kv: Callable[..., tuple]
    embed_block: Callable[..., jax.Array]
    block_forward: Callable[..., jax.Array]
    compute_logits: Callable[..., jax.Array]
    replicable: frozenset = frozenset()
    block_heads: Callable[..., tuple] | None = None  # a family's own [.., V] heads (``draft.model.block_heads``)
    ring: ContextRing | None = None  # a windowed drafter's decode context cache (None: position-indexed)
    per_layer: bool = False  # ``context_kv`` / ``block_forward`` also take per-layer ``params["layers"]``
    stacks: tuple[str, ...] = ("layers",)  # the params' stacked-layer subtrees ([L, ...] leaves)
    bind: Callable[[Context], "DraftRuntime"] | None = None  # the record on a Context (its mesh)
    objective: TrainObjective | None = None  # a family's own training objective (Eagle3's TTT)

    def on(self, ctx: Context) -> "DraftRuntime":
        """This record for ``ctx`` (``bind(ctx)``; itself when the family has no ``bind``)."""
        return self.bind(ctx) if self.bind is not None else self


@dataclasses.dataclass(frozen=True)
class Proposer:
    """A drafter kind's decode functions (see the module docstring, "Drafter kinds")."""

    taps: Callable[[Any], tuple]
    init: Callable[..., Any]
    propose: Callable[..., tuple]
    commit: Callable[..., Any]
    state_bytes: Callable[[Any, int, Any], int]
    confidence: bool = False
    with_steps: Callable[[Any, int], Any] | None = None  # cfg -> cfg proposing k per round (None: fixed)
    replicable: frozenset = frozenset()
    per_layer: bool = False        # a chain family's params are plain trees (``params.for_platform`` skips them)
    stacks: tuple[str, ...] = ()
    objective: TrainObjective | None = None  # a chain family's training objective (Eagle3's TTT)


def by_span(fn: Callable[[int], Any], spans, index: jax.Array):
    """``fn(span)`` for the span at the traced ``index`` (one ``lax.switch`` branch per span;
    no switch for one span)."""
    if len(spans) == 1:
        return fn(spans[0])
    return jax.lax.switch(index, [functools.partial(fn, s) for s in spans])


def concat_features(hidden_size: int, taps) -> int:
    """``feature_dim`` of a family whose features concatenate ``len(taps)`` hidden states."""
    return len(tuple(taps)) * hidden_size


# --------------------------------------------------------------------------- generic cache helpers


def axis_of(axes, name: str) -> int | None:
    """Index of logical axis ``name`` in ``axes`` (None when absent)."""
    return axes.index(name) if axes is not None and name in axes else None


def map_axes(fn: Callable[[jax.Array, tuple], Any], tree, axes_tree):
    """``fn(leaf, its axes)`` over ``tree`` (``axes_tree``: the same pytree, tuple leaves)."""
    return jax.tree.map(fn, tree, axes_tree)


def pad_steps(delta, axes_tree, width: int):
    """``delta`` with every leaf zero-padded along its ``STEP`` axis to ``width`` tokens."""
    def pad(x, axes):
        i = axis_of(axes, STEP)
        widths = [(0, 0)] * x.ndim
        widths[i] = (0, width - x.shape[i])
        return jnp.pad(x, widths)
    return map_axes(pad, delta, axes_tree)


def put_row(big, one, axes_tree, slot):
    """``big`` (a batched pytree) with batch row ``slot`` replaced by ``one``'s only row (every
    leaf along its ``BATCH`` axis; one ``dynamic_update_slice`` per leaf)."""
    def put(x, y, axes):
        idx = [jnp.zeros((), jnp.int32)] * x.ndim
        idx[axis_of(axes, BATCH)] = slot
        return jax.lax.dynamic_update_slice(x, y.astype(x.dtype), idx)
    return jax.tree.map(put, big, one, axes_tree)


def write_steps(buf: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """A head-major cache leaf ``buf [(L,) B, Hkv, S, D]`` (stacked layers or one layer's buffer)
    with ``new [(L,) B, Hkv, T, D]`` written at slots ``slots [B, T]`` (slot >= S: dropped): one
    scatter, in place when ``buf`` is donated.

    On TPU the stacked form's scatter indexes every axis but D (each update is one D-vector):
    XLA:TPU lays a scatter's buffer out with its update window minor, so the (L, Hkv, D) window
    of the plain form made it copy the whole cache into an L-minor layout and back around the
    scatter (4 cache-sized copies per K / V pair; 2.4 GB of a Qwen3-8B step at B = 8 on v5e, 36
    layers, one KV head per chip: ``benchmarks/results/tpu_copies``). Same writes, same drops.
    Per-layer buffers (GPUs) take the plain form."""
    if buf.ndim == 5:
        return jax.lax.platform_dependent(buf, new, slots, default=_write_windows, tpu=_write_vectors)
    return _write_windows(buf, new, slots)


def _write_windows(buf, new, slots):
    lead = buf.ndim - 4
    rows = jnp.arange(slots.shape[0])[:, None]
    index = (slice(None),) * lead + (rows, slice(None), slots)
    order = (lead, lead + 2, *range(lead), lead + 1, lead + 3)    # [B, T, (L,) Hkv, D], the scatter's
    return buf.at[index].set(new.transpose(order).astype(buf.dtype), mode="drop")


def _write_vectors(buf, new, slots):
    n_layers, b, hkv = new.shape[:3]
    layer = jnp.arange(n_layers)[:, None, None, None]
    row = jnp.arange(b)[None, :, None, None]
    head = jnp.arange(hkv)[None, None, :, None]
    return buf.at[layer, row, head, slots[None, :, None, :]].set(new.astype(buf.dtype), mode="drop")


def step_mask(n_new: jax.Array, steps: int) -> jax.Array:
    """[B, T] bool: token t of row b is committed (t < n_new[b])."""
    return jnp.arange(steps, dtype=jnp.int32)[None, :] < n_new.astype(jnp.int32)[:, None]


def forward_and_commit(forward, params, cfg, tokens: jax.Array, cache, *, num_new=None, taps=(),
                       compute_dtype=None, span=None):
    """A family's protocol ``forward`` then ``cache.commit`` of each row's first ``num_new``
    tokens (default all T of tokens [B, T]): ``(hidden, features, updated cache or None)``, the
    one-call form training, feature extraction and tests use."""
    hidden, features, delta = forward(params, cfg, tokens, cache, ctx=Context(dtype=compute_dtype),
                                      taps=taps, span=span)
    if cache is None:
        return hidden, features, None
    n = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32) if num_new is None else num_new
    return hidden, features, cache.commit(delta, n)
