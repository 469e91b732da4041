"""The chain drafter kind: k sequential steps of a small model with its own cache (MTP, Eagle3).

A chain family describes its model once (``ChainModule``); ``proposer(module)`` turns it into the
``runtime.Proposer`` the decode round calls. Shapes: B rows, T positions, F target features
(``feature_dim`` of the module's ``taps``), Fh the module's hidden (what a step feeds back), V
vocab, k = ``cfg.block_size`` drafts per round.

Module position t takes (hidden_t, token t+1) and its logits predict token t+2. hidden_t is
``lift(features_t)`` at a committed position (the target's own features), or the module's own
output at the previous position during a round's chain (vLLM's MTP-k and Eagle's step inputs).

- ``commit`` (after verification; ``init`` after the prefill, over the prompt) runs the module
  over the T = G+1 verified positions p..p+G at once (causal, masked by ``n_new``), commits
  their KV for the first ``n_new`` positions only (``cache.commit``) and keeps the output at the
  last committed position p+n_new-1 (``ChainState.h_last`` / ``logits_last``): its token is the
  new anchor, its logits give draft 1 of the next round.
- ``propose``: draft 1 sampled from ``logits_last``; draft j (j = 2..k) from one module step at
  position pos+j-2 fed (its own previous output hidden, draft j-1). The steps' KV goes into a
  local copy of the cache (``cache.commit`` of one token each, lengths advancing): later steps
  of the chain see it, the returned state does not hold it, so no speculative entry is ever
  committed (a ring keeps only committed positions; the copy is the module's cache, small).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import runtime, sampling


@dataclasses.dataclass(frozen=True)
class ChainModule:
    """A chain drafter's model, what ``proposer`` needs of it.

    init_cache(cfg, batch, capacity, dtype, max_extend) -> cache: an empty ``runtime.Cache``.
    lift(params, cfg, features [B, T, F]) -> hidden [B, T, Fh]: the target's features as the
        module's hidden input (MTP: the streams themselves; Eagle3: its fc).
    forward(params, cfg, hidden [B, T, Fh], tokens [B, T], cache, *, ctx, span) -> (logits
        [B, T, V] float32, hidden out [B, T, Fh], delta): T positions at ``cache.lengths + t``
        over the committed ones and each other causally; never writes (``cache.commit``);
        ``cache`` None: positions 0..T-1 of whole sequences (training), delta None.
    taps(cfg) -> tuple: what the target hands over (``runtime.TargetRuntime.forward``'s taps).
    """

    init_cache: Callable[..., Any]
    lift: Callable[..., jax.Array]
    forward: Callable[..., tuple]
    taps: Callable[[Any], tuple]
    replicable: frozenset = frozenset()


@flax.struct.dataclass
class ChainState:
    """A chain drafter's decode state: its cache (committed positions < ``cache.lengths``, =
    the anchor's position), and the module's output at the last committed position:
    ``h_last [B, Fh]`` (fed to step 2) and ``logits_last [B, V]`` float32 (draft 1)."""

    cache: Any
    h_last: jax.Array
    logits_last: jax.Array

    def axes(self) -> "ChainState":
        row = (runtime.BATCH, None)
        return ChainState(self.cache.axes(), row, row)


def _last(x: jax.Array, n_new: jax.Array, old: jax.Array) -> jax.Array:
    """x [B, T, ...] at each row's position n_new - 1; ``old`` [B, ...] where n_new = 0."""
    at = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0).reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]
    return jnp.where((n_new > 0).reshape(-1, *([1] * (at.ndim - 1))), at.astype(old.dtype), old)


def commit(module: ChainModule, params, cfg, state: ChainState, features, next_tokens, positions,
           n_new, *, ctx) -> ChainState:
    """``runtime.Proposer.commit``: the module over the verified positions (features [B, T, F],
    next_tokens [B, T]: the token after each), their first ``n_new`` committed (``positions``
    [B, T] are ``cache.lengths + t`` by construction)."""
    del positions
    n_new = n_new.astype(jnp.int32)
    logits, hidden, delta = module.forward(params, cfg, module.lift(params, cfg, features), next_tokens,
                                           state.cache, ctx=ctx, span=None)
    return ChainState(state.cache.commit(delta, n_new), _last(hidden, n_new, state.h_last),
                      _last(logits, n_new, state.logits_last))


def init(module: ChainModule, params, cfg, features, next_tokens, lens, max_len, *, ctx) -> ChainState:
    """``runtime.Proposer.init``: an empty cache of ``max_len`` positions (extends of G+1), then
    ``commit`` of the prompt's positions 0..lens-1."""
    b = features.shape[0]
    cache = module.init_cache(cfg, b, max_len, ctx.dtype, cfg.block_size + 1)
    out = jax.eval_shape(lambda: module.forward(params, cfg, module.lift(params, cfg, features[:, :1]),
                                                next_tokens[:, :1], cache, ctx=ctx, span=None))
    empty = ChainState(cache, jnp.zeros((b, out[1].shape[-1]), out[1].dtype),
                       jnp.zeros((b, out[0].shape[-1]), jnp.float32))
    return commit(module, params, cfg, empty, features, next_tokens, None, lens, ctx=ctx)


def propose(module: ChainModule, params, cfg, state: ChainState, anchor, pos, key, temperature, greedy,
            *, ctx, spans, span_index):
    """``runtime.Proposer.propose``: k drafts per row (module docstring), each sampled from its
    logits at ``temperature`` (greedy: argmax) with those logits returned for rejection
    sampling; no confidence; the state unchanged (the chain's KV lives in a local copy)."""
    del anchor, pos, spans, span_index  # the state's lengths are the anchor's positions
    k = cfg.block_size
    keys = sampling.split(key, k)
    first = sampling.sample_logits(keys[0], state.logits_last, temperature, greedy)
    if k == 1:
        return first[:, None], state.logits_last[:, None], None, state
    ones = jnp.ones_like(first)

    def step(carry, key_j):
        cache, h, tok = carry
        logits, hidden, delta = module.forward(params, cfg, h[:, None], tok[:, None], cache, ctx=ctx, span=None)
        nxt = sampling.sample_logits(key_j, logits[:, 0], temperature, greedy)
        return (cache.commit(delta, ones), hidden[:, 0].astype(h.dtype), nxt), (nxt, logits[:, 0])

    _, (drafts, logits) = jax.lax.scan(step, (state.cache, state.h_last, first), keys[1:])
    drafts = jnp.concatenate([first[:, None], jnp.moveaxis(drafts, 0, 1)], axis=1)
    logits = jnp.concatenate([state.logits_last[:, None], jnp.moveaxis(logits, 0, 1)], axis=1)
    return drafts, logits, None, state


def teacher_forced_loss(module: ChainModule, params, cfg, features, tokens, mask, labels=None):
    """(summed cross-entropy, count) of the module over whole sequences, the loss an MTP module
    trains with: position t takes (lift(features_t), token t+1) and predicts token t+2 (``labels``
    [B, S-2] override, e.g. the target's own argmax there). features [B, S, F] from the frozen
    target, tokens [B, S], mask [B, S] weights each label by its token's mask (positions 2..S-1)."""
    hidden = module.lift(params, cfg, features[:, :-2])
    logits, _, _ = module.forward(params, cfg, hidden, tokens[:, 1:-1], None, ctx=None, span=None)
    labels = tokens[:, 2:] if labels is None else labels
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]
    m = mask[:, 2:].astype(jnp.float32)
    return (nll * m).sum(), m.sum()


def state_bytes(module: ChainModule, cfg, max_len: int, dtype, hidden: int, vocab: int) -> int:
    """One row's ``ChainState``: the module's cache of ``max_len`` positions plus h_last
    (``hidden`` wide, ``dtype``) and logits_last (float32)."""
    cache = jax.eval_shape(lambda: module.init_cache(cfg, 1, max_len, dtype, cfg.block_size + 1))
    cache_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(cache))
    return cache_bytes + hidden * np.dtype(dtype).itemsize + vocab * 4


def proposer(module: ChainModule, hidden_width: Callable[[Any], int]) -> runtime.Proposer:
    """The ``runtime.Proposer`` of a chain family (``hidden_width(cfg)`` = Fh, for the memory
    estimate; its config's ``num_steps`` field is k = ``block_size``, ``cfg.replace`` sets it)."""
    return runtime.Proposer(
        taps=module.taps,
        init=lambda *a, **k: init(module, *a, **k),
        propose=lambda *a, **k: propose(module, *a, **k),
        commit=lambda *a, **k: commit(module, *a, **k),
        state_bytes=lambda cfg, max_len, dtype: state_bytes(module, cfg, max_len, dtype, hidden_width(cfg),
                                                            cfg.vocab_size),
        confidence=False, with_steps=lambda cfg, k: cfg.replace(num_steps=k), replicable=module.replicable)
