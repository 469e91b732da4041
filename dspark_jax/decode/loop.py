"""Jitted, batched speculative decoding and the autoregressive baseline (paper section 4).

Shapes: B rows (requests), P padded prompt length, L cache capacity, G block
size (draft tokens per round), V vocab, R = max_new_tokens (round budget),
Ld draft layers. All shapes are static; per-row progress lives in arrays:

- the target cache (the target family's, ``dspark_jax.runtime``) holds the committed positions
  < ``pos[b]``: every forward returns a delta, and only accepted tokens are committed;
- the draft context cache (``draft.decode.ContextCache``, k/v ``[Ld, B, L, Hkv, D]``)
  holds the drafter's context keys/values of the same committed positions;
- ``seq[b, pos[b]]`` is the anchor x0 (the last committed token, not yet fed
  to the target).

One round (``_round``): ``draft.decode.propose`` drafts a block at positions
p..p+G-1 (queries see context rows < p and the whole block; Markov sampling
with ``lax.scan``) -> confidences -> policy lengths -> one target extend over
[x0, x_1..x_{w-1}] at p..p+w-1 -> rejection sampling of each row's own l_b tokens
-> commit the accepted tokens to the target cache, scatter the verified positions' features into
the draft context cache. Finished rows stay in the batch as masked no-ops.

The verification width w follows the lengths: the round compiles a small set of widths
(``round_widths``: ``_Static.widths``, else the policy's ``verify_widths``, else
``default_widths(G)`` = 1, 2, 4, .., G+1; one width only for a constant-length policy such as
``full`` or ``fixed:K``), one ``lax.switch`` branch each, and runs the smallest width >= the
longest active row's length + 1 (``width_index``). Every shape stays static (the cache and the
state are the same in every branch), so nothing recompiles as widths change from round to round.
Attention reads the used part of the caches the same way: a few compiled cache spans
(``compiled_spans``: ``default_spans`` of the capacity L, or ``cache_spans=``), and each round /
AR step attends over the smallest span >= its longest active row instead of all L slots
(``span_index``; the round's target branches are (width, span) pairs).

The loop over rounds is a ``lax.while_loop`` on device (``loop="device"``,
default, measured faster than a host loop over one compiled round, see
benchmarks/decode.py) or a host loop (``loop="host"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Sequence

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import families, runtime, sampling
from dspark_jax import sharding as sharding_lib
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.decode import sharded
from dspark_jax.decode.policies import FullPolicy, VerifyPolicy, constant_length
from dspark_jax.decode.verify import rejection_sample
from dspark_jax.draft import decode as draft_decode
from dspark_jax.errors import ConfigError, InputError, require_positive_int

MAX_STOP_IDS = 8     # stop-id slots (padded with -1) so the count never changes shapes
MIN_PROMPT_BUCKET = 16  # padded prompt length P is a power of two >= this
CACHE_BUCKET = 64    # default cache capacity L is a multiple of this
SPAN_ALIGN = 128     # compiled cache spans (``default_spans``) are multiples of this
NUM_SPANS = 4        # at most this many spans by default


# --------------------------------------------------------------------------- state


@flax.struct.dataclass
class DecodeState:
    """Speculative decode state (a pytree; donated to each jitted round).

    seq [B, L] int32 prompt + generated tokens; pos [B] anchor position;
    num_input [B] prompt lengths; max_new [B] per-row output budget (<= R); active [B] bool; key PRNG key; round [] int32;
    rounds [B] rounds run per row; acc_rec / prop_rec / drafts_rec [B, R] int32
    acceptance length (bonus included), proposal length and accepted drafts per
    round; conf_rec [B, R, G] raw confidence logits; cache target KV cache;
    ctx the draft context cache; policy_state pytree.
    """

    seq: jax.Array
    pos: jax.Array
    num_input: jax.Array
    max_new: jax.Array
    active: jax.Array
    key: jax.Array
    round: jax.Array
    rounds: jax.Array
    acc_rec: jax.Array
    prop_rec: jax.Array
    drafts_rec: jax.Array
    conf_rec: jax.Array
    cache: Any  # the target family's ``runtime.Cache``
    ctx: draft_decode.ContextCache
    policy_state: Any


@flax.struct.dataclass
class ARState:
    """Autoregressive state: seq [B, L]; pos [B] position of the newest token (not yet cached)."""

    seq: jax.Array
    pos: jax.Array
    num_input: jax.Array
    max_new: jax.Array
    active: jax.Array
    key: jax.Array
    cache: Any


@dataclasses.dataclass(frozen=True)
class _Static:
    """Hashable static configuration of the compiled functions."""

    target: TargetConfig
    draft: DraftConfig | None
    policy: Any
    greedy: bool
    max_new_tokens: int
    top_p: float = 1.0       # nucleus sampling of the target (AR only); 1 = off (unchanged program)
    widths: tuple[int, ...] | None = None  # compiled verification widths (``round_widths``)
    spans: tuple[int, ...] | None = None   # compiled cache spans (``compiled_spans``)


@dataclasses.dataclass
class Result:
    """One request's output. ``confidence_logits``: per round [G] raw logits (None without a head)."""

    output_ids: list[int]
    acceptance_lengths: list[int]
    proposal_lengths: list[int]
    accepted_drafts: list[int]
    confidence_logits: list[list[float]] | None
    prompt_length: int
    batch_index: int
    batch_seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- helpers


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def target_logits(tcfg, tparams, hidden):
    """hidden [..., H] -> [..., V] float32 logits through ``tcfg``'s family."""
    return families.target_runtime(tcfg).logits(tparams, tcfg, hidden)


def _tap_ids(static: _Static) -> tuple[int, ...]:
    return tuple(static.draft.target_layer_ids) if static.draft is not None else ()


def _prefill(tparams, dparams, prompts, lens, valid, key, temperature, stop_ids, static: _Static,
             max_len: int, ctx: runtime.Context):
    """Target prefill of padded prompts [B, P] (lengths ``lens``), first token, draft context.

    The target cache (``init_cache`` of capacity ``max_len``, sized for extends of G+1 tokens, 1
    without a drafter) commits each row's ``lens`` prompt tokens. Returns (cache, seq [B, L],
    first [B], active [B], draft context cache (None without a drafter), key).
    """
    b, p = prompts.shape
    tcfg = static.target
    rt = families.target_runtime(tcfg)
    ctx = ctx.for_params(tparams)
    extend = static.draft.block_size + 1 if static.draft is not None else 1
    cache = rt.init_cache(tcfg, b, max_len, ctx.dtype, extend)
    hidden, taps, delta = rt.forward(tparams, tcfg, prompts, cache, ctx=ctx, taps=_tap_ids(static),
                                     span=0)  # the cache is empty
    cache = cache.commit(delta, lens)
    rows = jnp.arange(b)
    last = hidden[rows, lens - 1]
    key, k_first = jax.random.split(key)
    first = sampling.sample_logits(k_first, rt.logits(tparams, tcfg, last), temperature,
                                   static.greedy, static.top_p)
    seq = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(prompts)
    seq = seq.at[rows, lens].set(first)
    active = valid & ~_is_stop(first, stop_ids)
    draft_ctx = None
    if static.draft is not None:
        draft_ctx = draft_decode.init_context(dparams, static.draft, taps, max_len)
    return cache, seq, first, active, draft_ctx, key


def _spec_prefill(tparams, dparams, prompts, lens, valid, key, temperature, stop_ids, static,
                  max_len, max_new=None, *, ctx: runtime.Context = runtime.LOCAL):
    cache, seq, _, active, draft_ctx, key = _prefill(
        tparams, dparams, prompts, lens, valid, key, temperature, stop_ids, static, max_len, ctx)
    b = prompts.shape[0]
    r, g = static.max_new_tokens, static.draft.block_size
    zeros = jnp.zeros((b, r), jnp.int32)
    max_new = jnp.full((b,), r, jnp.int32) if max_new is None else max_new.astype(jnp.int32)
    active = active & (max_new > 0)
    return DecodeState(
        seq=seq, pos=lens, num_input=lens, max_new=max_new, active=active, key=key,
        round=jnp.zeros((), jnp.int32), rounds=jnp.zeros((b,), jnp.int32),
        acc_rec=zeros, prop_rec=zeros, drafts_rec=zeros,
        conf_rec=jnp.zeros((b, r, g), jnp.float32), cache=cache, ctx=draft_ctx,
        policy_state=())  # set by the caller: the prefill's compilation does not depend on the policy


def default_widths(block_size: int) -> tuple[int, ...]:
    """The default compiled verification widths for block size G: the powers of two below G+1,
    then G+1 (G=7: (1, 2, 4, 8)). A width w verifies the anchor and w-1 drafts per row; a
    round runs the smallest width >= its longest active proposal + 1, so doubling widths
    keep the padding waste under 2x with log2(G+1)+1 compiled branches."""
    out, w = [], 1
    while w < block_size + 1:
        out.append(w)
        w *= 2
    return tuple(out) + (block_size + 1,)


def verify_widths(block_size: int, widths=None) -> tuple[int, ...]:
    """Sorted distinct widths in [1, G+1], G+1 always included (``widths`` None: the default).
    ConfigError on a width outside [1, G+1]."""
    if widths is None:
        return default_widths(block_size)
    ws = sorted({int(w) for w in widths} | {block_size + 1})
    if ws[0] < 1 or ws[-1] > block_size + 1:
        raise ConfigError(f"verification widths must be in [1, block_size + 1 = {block_size + 1}], "
                          f"got {sorted(widths)}")
    return tuple(ws)


def round_widths(static: _Static) -> tuple[int, ...]:
    """The widths the round of ``static`` compiles: ``static.widths``, else the policy's
    ``verify_widths`` (a scheduler measured on a round table uses the table's widths), else
    ``default_widths(G)``; a policy of one constant length l (``policies.constant_length``:
    full, fixed:K) keeps only the smallest width >= l+1 (one branch, no switch)."""
    g = static.draft.block_size
    ws = static.widths if static.widths is not None else getattr(static.policy, "verify_widths", None)
    ws = verify_widths(g, ws)
    fixed = constant_length(static.policy, g)
    if fixed is not None:
        return (next(w for w in ws if w >= min(fixed, g) + 1),)
    return ws


def width_index(lengths: jax.Array, active: jax.Array, widths: Sequence[int]) -> jax.Array:
    """Index into ``widths`` (sorted, last >= G+1) of the smallest width >= max(lengths of
    active rows) + 1 (scalar int32; ``widths[0]`` when no row is active). lengths/active [B]."""
    longest = jnp.max(jnp.where(active, lengths, 0), initial=0)
    ws = jnp.asarray(widths, jnp.int32)
    return jnp.minimum(jnp.sum((ws < longest + 1).astype(jnp.int32)), len(widths) - 1)


def default_spans(max_len: int, n: int = NUM_SPANS) -> tuple[int, ...]:
    """The default compiled cache spans for capacity L: ceil(k L / n) rounded up to SPAN_ALIGN,
    k = 1..n, at most L (L = 448: 128, 256, 384, 448; L <= SPAN_ALIGN: L alone). A step whose
    longest row holds p positions attends over the smallest span >= p instead of all L slots,
    so attention reads the used part of the cache (to within SPAN_ALIGN or L/n), at the price
    of up to n times more compiled verification branches."""
    return tuple(sorted({min(max_len, -(-math.ceil(k * max_len / n) // SPAN_ALIGN) * SPAN_ALIGN)
                         for k in range(1, n + 1)}))


def compiled_spans(static: _Static, max_len: int) -> tuple[int, ...]:
    """The cache spans the round / AR step of ``static`` compiles for capacity ``max_len``:
    ``static.spans`` (sorted, capacity added, ConfigError outside [1, L]) or ``default_spans``."""
    if static.spans is None:
        return default_spans(max_len)
    spans = sorted({int(s) for s in static.spans} | {max_len})
    if spans[0] < 1 or spans[-1] > max_len:
        raise ConfigError(f"cache spans must be in [1, cache capacity {max_len}], got {sorted(static.spans)}")
    return tuple(spans)


def _spans_arg(spans) -> tuple[int, ...] | None:
    """A user's ``cache_spans`` as a tuple of positive ints (None stays None); InputError else."""
    if spans is None:
        return None
    try:
        out = tuple(int(x) for x in spans)
    except (TypeError, ValueError):
        raise InputError(f"cache_spans must be a list of positive integers, got {spans!r}") from None
    if not out or min(out) < 1 or any(isinstance(x, bool) or int(x) != x for x in spans):
        raise InputError(f"cache_spans must be a list of positive integers, got {spans!r}")
    return out


def span_index(pos: jax.Array, active: jax.Array, spans: Sequence[int]) -> jax.Array:
    """Index into ``spans`` (sorted, last = capacity) of the smallest span >= the longest active
    row's committed length ``pos`` [B] (scalar int32; 0 when no row is active). Finished rows may
    read a truncated cache: their outputs are masked no-ops."""
    longest = jnp.max(jnp.where(active, pos, 0), initial=0)
    ss = jnp.asarray(spans, jnp.int32)
    return jnp.minimum(jnp.sum((ss < longest).astype(jnp.int32)), len(spans) - 1)


def by_span(fn: Callable[[int], Any], spans: Sequence[int], index: jax.Array):
    """``fn(span)`` for the span at the traced ``index`` (one ``lax.switch`` branch per span;
    no switch for one span)."""
    if len(spans) == 1:
        return fn(spans[0])
    return jax.lax.switch(index, [functools.partial(fn, s) for s in spans])


def _verify_width(tparams, state: DecodeState, anchor, drafts, draft_logits, lengths, k_verify,
                  temperature, stop_ids, static: _Static, ctx: runtime.Context, width: int,
                  span: int):
    """Target verification and rejection sampling over the first ``width`` (static) block tokens
    [x0, x_1..x_{w-1}] at positions p..p+w-1 (every active row has lengths <= w-1), reading the
    first ``span`` cache slots (every active row has p <= span).

    Returns (verdict, taps [B, G+1, F] zero-padded past w, delta): the target's cache delta
    zero-padded to G+1 tokens along its step axis (``runtime.pad_steps``), uncommitted (the
    caller commits outside any ``lax.switch``: in place; a branch that wrote would copy the cache). The rejection sampler
    draws its uniforms for the whole block (G) and uses the first w-1, so a sampled run is the
    same whatever width runs it."""
    tcfg, dcfg = static.target, static.draft
    g = dcfg.block_size
    d, pad = width - 1, g + 1 - width
    verify_tokens = jnp.concatenate([anchor[:, None], drafts[:, :d]], axis=1)      # [B,w]
    rt = families.target_runtime(tcfg)
    hidden, taps, delta = rt.forward(tparams, tcfg, verify_tokens, state.cache, ctx=ctx,
                                     taps=tuple(dcfg.target_layer_ids), span=span)
    delta = runtime.pad_steps(delta, state.cache.delta_axes(), g + 1)
    t_logits = rt.logits(tparams, tcfg, hidden)
    verdict = rejection_sample(k_verify, t_logits, draft_logits[:, :d], drafts[:, :d],
                               jnp.minimum(lengths, d), temperature, static.greedy, stop_ids,
                               draw_width=g)
    return verdict, jnp.pad(taps, ((0, 0), (0, pad), (0, 0))), delta


def _round(tparams, dparams, state: DecodeState, temperature, stop_ids, conf_temps,
           static: _Static, *, ctx: runtime.Context = runtime.LOCAL) -> DecodeState:
    """One speculative round for every row (finished rows: masked no-ops).

    The verification width follows the policy's lengths: ``round_widths(static)`` are compiled
    (one ``lax.switch`` branch each, no switch when there is one), and the round runs the
    smallest width w >= the longest active proposal + 1 (``width_index``). Attention (drafter
    context and target cache) reads the smallest compiled cache span >= the longest active row
    (``compiled_spans``, ``span_index``): the target's branches are (width, span) pairs. The branches
    only verify; the commits (target cache: each active row's accepted tokens; tokens; draft
    context) happen after the switch over G+1 padded slots, the ones >= w dropped, so the donated
    buffers are updated in place."""
    tcfg, dcfg = static.target, static.draft
    b, max_len = state.seq.shape
    g = dcfg.block_size
    rows = jnp.arange(b)
    key, k_draft, k_verify = sampling.split(state.key, 3)
    active = state.active
    ctx = ctx.for_params(tparams)

    anchor = state.seq[rows, state.pos]
    spans = compiled_spans(static, max_len)
    s_index = span_index(state.pos, active, spans)
    hidden = by_span(lambda s: draft_decode.block_hidden(dparams, dcfg, anchor, state.pos, state.ctx, s),
                     spans, s_index)
    drafts, draft_logits, conf_logits = draft_decode.propose_from_hidden(
        dparams, dcfg, hidden, anchor, k_draft, temperature, static.greedy)
    if dcfg.enable_confidence_head:
        conf = jax.nn.sigmoid(conf_logits / conf_temps)
    else:
        conf = jnp.ones((b, g), jnp.float32)
    lengths, policy_state = static.policy(state.policy_state, conf, active)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, g)

    widths = round_widths(static)
    branches = [functools.partial(_verify_width, tparams, state, anchor, drafts, draft_logits,
                                  lengths, k_verify, temperature, stop_ids, static, ctx, w, s)
                for w in widths for s in spans]
    w_index = width_index(lengths, active, widths)
    if len(branches) == 1:
        verdict, taps, delta = branches[0]()
    else:
        verdict, taps, delta = jax.lax.switch(w_index * len(spans) + s_index, branches)
    width = jnp.asarray(widths, jnp.int32)[w_index]
    a = verdict.accepted
    acc_len = jnp.where(verdict.stopped, a, a + 1)
    k_idx = jnp.arange(g + 1, dtype=jnp.int32)[None, :]
    in_width = k_idx < width                                                     # [1, G+1]
    cache = state.cache.commit(delta, jnp.where(active, acc_len, 0))  # the accepted tokens only

    # Commit: slots pos+1..pos+a get the drafts, pos+a+1 the replacement/bonus token.
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tokens = jnp.where(k_idx == a[:, None], verdict.next_token[:, None], padded)
    slots = jnp.where(active[:, None] & in_width, state.pos[:, None] + 1 + k_idx, max_len)
    seq = state.seq.at[rows[:, None], slots].set(new_tokens, mode="drop")
    new_pos = jnp.where(active, state.pos + acc_len, state.pos)

    # Draft context: features of the verified positions p..p+w-1 (only < new_pos are ever read).
    ctx_cache = draft_decode.extend_context(
        dparams, dcfg, state.ctx, taps,
        jnp.where(in_width, state.pos[:, None] + k_idx, state.ctx.max_len), active)

    rec = jnp.where(active, state.rounds, static.max_new_tokens)  # out of range -> dropped
    acc_rec = state.acc_rec.at[rows, rec].set(acc_len, mode="drop")
    prop_rec = state.prop_rec.at[rows, rec].set(verdict.proposal_length, mode="drop")
    drafts_rec = state.drafts_rec.at[rows, rec].set(a, mode="drop")
    conf_rec = state.conf_rec.at[rows, rec].set(conf_logits, mode="drop")

    next_stop = ~verdict.stopped & _is_stop(verdict.next_token, stop_ids)
    generated = new_pos - state.num_input
    still = active & ~verdict.stopped & ~next_stop & (generated < state.max_new)
    return DecodeState(
        seq=seq, pos=new_pos, num_input=state.num_input, max_new=state.max_new, active=still, key=key,
        round=state.round + 1, rounds=state.rounds + active.astype(jnp.int32),
        acc_rec=acc_rec, prop_rec=prop_rec, drafts_rec=drafts_rec, conf_rec=conf_rec,
        cache=cache, ctx=ctx_cache, policy_state=policy_state)


def _spec_run_device(tparams, dparams, state, temperature, stop_ids, conf_temps, static, *,
                     ctx: runtime.Context = runtime.LOCAL):
    def cond(s):
        return jnp.any(s.active) & (s.round < static.max_new_tokens)

    def body(s):
        return _round(tparams, dparams, s, temperature, stop_ids, conf_temps, static, ctx=ctx)

    return jax.lax.while_loop(cond, body, state)


def _ar_prefill(tparams, prompts, lens, valid, key, temperature, stop_ids, static, max_len,
                max_new=None, *, ctx: runtime.Context = runtime.LOCAL):
    cache, seq, _, active, _, key = _prefill(
        tparams, None, prompts, lens, valid, key, temperature, stop_ids, static, max_len, ctx)
    b = prompts.shape[0]
    max_new = (jnp.full((b,), static.max_new_tokens, jnp.int32) if max_new is None
               else max_new.astype(jnp.int32))
    active = active & (max_new > 1)
    return ARState(seq=seq, pos=lens, num_input=lens, max_new=max_new, active=active, key=key,
                   cache=cache)


def _ar_step(tparams, state: ARState, temperature, stop_ids, static, *,
             ctx: runtime.Context = runtime.LOCAL) -> ARState:
    b, max_len = state.seq.shape
    rows = jnp.arange(b)
    key, k_s = sampling.split(state.key)
    tok = state.seq[rows, state.pos][:, None]
    tcfg, rt, ctx = static.target, families.target_runtime(static.target), ctx.for_params(tparams)
    spans = compiled_spans(static, max_len)
    hidden, _, delta = by_span(lambda s: rt.forward(tparams, tcfg, tok, state.cache, ctx=ctx, taps=(),
                                                    span=s),
                               spans, span_index(state.pos, state.active, spans))
    active = state.active
    cache = state.cache.commit(delta, active.astype(jnp.int32))
    nxt = sampling.sample_logits(k_s, rt.logits(tparams, tcfg, hidden[:, 0]), temperature,
                                 static.greedy, static.top_p)
    seq = state.seq.at[rows, jnp.where(active, state.pos + 1, max_len)].set(nxt, mode="drop")
    pos = jnp.where(active, state.pos + 1, state.pos)
    still = active & ~_is_stop(nxt, stop_ids) & (pos + 1 - state.num_input < state.max_new)
    return ARState(seq=seq, pos=pos, num_input=state.num_input, max_new=state.max_new,
                   active=still, key=key, cache=cache)


def _ar_run_device(tparams, state, temperature, stop_ids, static, *,
                   ctx: runtime.Context = runtime.LOCAL):
    return jax.lax.while_loop(lambda s: jnp.any(s.active),
                              lambda s: _ar_step(tparams, s, temperature, stop_ids, static, ctx=ctx),
                              state)


def _run_chunk(step, state, max_steps, until_finish):
    """Run ``step`` while any row is active, at most ``max_steps`` times, and (when
    ``until_finish``) only until some row that was active has finished: the continuous
    engine's unit of work between refills."""
    n0 = jnp.sum(state.active.astype(jnp.int32))

    def cond(c):
        s, n = c
        live = jnp.sum(s.active.astype(jnp.int32))
        return (live > 0) & (n < max_steps) & ~(until_finish & (live < n0))

    def body(c):
        s, n = c
        return step(s), n + 1

    return jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))[0]


def _spec_chunk(tparams, dparams, state, temperature, stop_ids, conf_temps, max_steps, until_finish,
                static, *, ctx: runtime.Context = runtime.LOCAL):
    return _run_chunk(lambda s: _round(tparams, dparams, s, temperature, stop_ids, conf_temps,
                                       static, ctx=ctx), state, max_steps, until_finish)


def _ar_chunk(tparams, state, temperature, stop_ids, max_steps, until_finish, static, *,
              ctx: runtime.Context = runtime.LOCAL):
    return _run_chunk(lambda s: _ar_step(tparams, s, temperature, stop_ids, static, ctx=ctx), state,
                      max_steps, until_finish)


def _insert(big, one, slot):
    """Write the one-row state ``one`` into row ``slot`` of ``big``: every leaf with a batch axis
    (``sharded.state_axes``: the state's and the caches' declarations) along it; key / round /
    policy state kept, except per-row keys (``big.key`` [B, 2]), whose row is written too."""
    axes = sharded.state_axes(big)
    fields = {}
    for f in dataclasses.fields(big):
        b, o, a = getattr(big, f.name), getattr(one, f.name), getattr(axes, f.name)
        if f.name == "key" and b.ndim == 2:
            fields[f.name] = runtime.put_row(b, o[None], sharded.ROW + (None,), slot)
        elif any(runtime.BATCH in x for x in jax.tree.leaves(a, is_leaf=lambda x: isinstance(x, tuple))):
            fields[f.name] = runtime.put_row(b, o, a, slot)
        else:
            fields[f.name] = b
    return big.replace(**fields)


def _spec_prefill_into(tparams, dparams, state, slot, prompt, length, max_new, key, temperature,
                       stop_ids, static, max_len, *, ctx: runtime.Context = runtime.LOCAL):
    """Prefill one request (prompt [1, P], length [1], max_new [1]) into row ``slot`` of ``state``."""
    one = _spec_prefill(tparams, dparams, prompt, length, jnp.ones((1,), bool), key, temperature,
                        stop_ids, static, max_len, max_new, ctx=ctx)
    return _insert(state, one, slot)


def _ar_prefill_into(tparams, state, slot, prompt, length, max_new, key, temperature, stop_ids,
                     static, max_len, *, ctx: runtime.Context = runtime.LOCAL):
    one = _ar_prefill(tparams, prompt, length, jnp.ones((1,), bool), key, temperature, stop_ids,
                      static, max_len, max_new, ctx=ctx)
    return _insert(state, one, slot)


# --------------------------------------------------------------------------- the builder


@dataclasses.dataclass(frozen=True)
class DecodeProgram:
    """The compiled-program set of one (static config, mesh) — what every caller runs.

    Jitted functions (``static=``/``max_len=`` keyword-static; the state is donated and keeps
    its sharding ``state_sharding`` from call to call, so nothing recompiles as rows change):

    - ``prefill(tp, dp, prompts [B,P], lens [B], valid [B], key, temp, stop, *, static, max_len)``
      -> DecodeState (policy_state ``()``, set it with ``policy.init_state``)
    - ``run(tp, dp, state, temp, stop, conf_temps, *, static)``: rounds until every row ends
    - ``round(...)``: one round (host loop, planner, profile-sps)
    - ``chunk(tp, dp, state, temp, stop, conf_temps, max_steps, until_finish, *, static)``
    - ``prefill_into(tp, dp, state, slot, prompt [1,P], len [1], max_new [1], key, temp, stop,
      *, static, max_len)``: the continuous engine's per-slot prefill
    - ``ar_prefill / ar_run / ar_step / ar_chunk / ar_prefill_into``: the same for the AR baseline.

    ``mesh`` None: one device, plain jit. Otherwise params go through ``place_params`` (their
    declared logical axes) and state leaves through ``sharded.STATE_AXES``.
    """

    mesh: Any
    rules: Any
    prefill: Any
    run: Any
    round: Any
    chunk: Any
    prefill_into: Any
    ar_prefill: Any
    ar_run: Any
    ar_step: Any
    ar_chunk: Any
    ar_prefill_into: Any

    def state_sharding(self, like):
        """The full sharding tree of the state ``like`` (a state or its shapes, any target
        family; ``sharded.state_sharding_tree``); None without a mesh."""
        if self.mesh is None:
            return None
        return sharded.state_sharding_tree(like, self.mesh, self.rules)

    def place_params(self, params, config):
        return sharded.place_params(params, config, self.mesh, self.rules)

    def place(self, x):
        """A host input (prompts, lens, ...) on the mesh, batch-sharded when its dim 0 divides."""
        if self.mesh is None:
            return x
        x = jnp.asarray(x)
        if x.ndim and x.shape[0] % sharded.batch_multiple(self.mesh, self.rules) == 0:
            return sharding_lib.to_global(x, sharding_lib.batch_sharding(self.mesh, x.ndim, self.rules))
        return sharding_lib.to_global(x, sharding_lib.replicated(self.mesh))

    def jitted(self):
        return (self.prefill, self.run, self.round, self.chunk, self.prefill_into, self.ar_prefill,
                self.ar_run, self.ar_step, self.ar_chunk, self.ar_prefill_into)


_PROGRAMS: dict = {}


def build_decode(mesh=None, rules=None) -> DecodeProgram:
    """The decode program set for ``mesh`` (None: one device), built once per (mesh, rules).

    Static configs (``_Static``: target/draft config, policy, greedy, max_new_tokens) are
    static arguments of the jitted functions, so one program set serves every config; with
    a mesh the outputs are constrained to ``state_sharding`` so a state keeps one layout.
    """
    rules = sharded.DECODE_RULES if rules is None else rules
    key = (mesh, tuple(sorted((k, str(v)) for k, v in rules.items())))
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    ctx = runtime.Context.make(mesh, rules)  # what every family forward sees

    def jit(fn, statics, donate=(), ar=None):
        kw = dict(static_argnames=statics, donate_argnames=donate)
        fn = functools.wraps(fn)(functools.partial(fn, ctx=ctx))
        if mesh is not None and ar is not None:
            # The output state is constrained leaf by leaf from its own pytree (the cache layout
            # differs per target family), so one program set serves Qwen3 and Gemma4 targets.
            @functools.wraps(fn)
            def fn(*a, _fn=fn, **k):
                out = _fn(*a, **k)
                return jax.lax.with_sharding_constraint(
                    out, sharded.state_sharding_tree(out, mesh, rules))
        return jax.jit(fn, **kw)

    s, sm, st = ("static", "max_len"), ("static", "max_len"), ("state",)
    prog = DecodeProgram(
        mesh=mesh, rules=rules,
        prefill=jit(_spec_prefill, sm, ar=False),
        run=jit(_spec_run_device, ("static",), st, ar=False),
        round=jit(_round, ("static",), st, ar=False),
        chunk=jit(_spec_chunk, ("static",), st, ar=False),
        prefill_into=jit(_spec_prefill_into, s, st, ar=False),
        ar_prefill=jit(_ar_prefill, sm, ar=True),
        ar_run=jit(_ar_run_device, ("static",), st, ar=True),
        ar_step=jit(_ar_step, ("static",), st, ar=True),
        ar_chunk=jit(_ar_chunk, ("static",), st, ar=True),
        ar_prefill_into=jit(_ar_prefill_into, s, st, ar=True),
    )
    _PROGRAMS[key] = prog
    return prog


DecodeStatic = _Static  # public name of the static config the builder's programs take


def abstract_decode_state(tparams, dparams, static: _Static, batch: int, max_len: int,
                          prompt_len: int = 64):
    """ShapeDtypeStruct tree of a DecodeState of ``batch`` rows and cache capacity ``max_len``
    (params may be abstract): what the planner compiles ``build_decode(mesh).round`` against."""
    return jax.eval_shape(
        lambda tp, dp: _spec_prefill(
            tp, dp, jnp.zeros((batch, prompt_len), jnp.int32),
            jnp.full((batch,), prompt_len, jnp.int32), jnp.ones((batch,), bool),
            jax.random.PRNGKey(0), jnp.float32(1.0), jnp.full((MAX_STOP_IDS,), -1, jnp.int32),
            static, max_len),
        tparams, dparams)


_LOCAL = build_decode()
# Single-device entry points (kept for benchmarks/round_cost.py and older callers).
spec_prefill_jit, spec_round_jit, spec_run_jit = _LOCAL.prefill, _LOCAL.round, _LOCAL.run
ar_prefill_jit, ar_step_jit, ar_run_jit = _LOCAL.ar_prefill, _LOCAL.ar_step, _LOCAL.ar_run


def compile_cache_sizes() -> int:
    """Total number of compiled variants held by every built program's jitted functions."""
    return sum(f._cache_size() for p in _PROGRAMS.values() for f in p.jitted())


# --------------------------------------------------------------------------- validation


def _round_up(x: int, m: int) -> int:
    return int(math.ceil(x / m) * m)


def plan_shapes(prompts: Sequence[Sequence[int]], max_new_tokens: int, slack: int,
                max_positions: int, max_cache_len: int | None) -> tuple[int, int]:
    """(P, L): padded prompt length and cache capacity; InputError when a request does not fit."""
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens + slack
    limit = max_positions if max_cache_len is None else min(max_cache_len, max_positions)
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens + slack > limit:
            which = ("max_cache_len" if max_cache_len is not None and max_cache_len < max_positions
                     else "max_position_embeddings")
            raise InputError(
                f"prompt {i}: length {len(p)} + max_new_tokens {max_new_tokens} + block slack "
                f"{slack} = {len(p) + max_new_tokens + slack} exceeds the cache capacity "
                f"({which} = {limit})")
    max_len = max_cache_len if max_cache_len is not None else min(_round_up(need, CACHE_BUCKET), limit)
    bucket = max(MIN_PROMPT_BUCKET, 1 << (longest - 1).bit_length())
    return min(bucket, max_len), max_len


def validate_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """Check prompts are non-empty lists of in-vocabulary ints; returns list[list[int]]."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise InputError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        p = list(np.asarray(p).reshape(-1).tolist()) if not isinstance(p, list) else p
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty")
        for j, t in enumerate(p):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise InputError(f"prompt {i}: token {j} is {t!r}, not an int")
            if not 0 <= int(t) < vocab_size:
                raise InputError(f"prompt {i}: token id {int(t)} at index {j} is outside the "
                                 f"vocabulary [0, {vocab_size})")
        out.append([int(t) for t in p])
    return out


def _validate_common(tcfg, prompts, max_new_tokens, temperature, batch_size, stop_token_ids):
    prompts = validate_prompts(prompts, tcfg.vocab_size)
    require_positive_int(max_new_tokens, "max_new_tokens")
    require_positive_int(batch_size, "batch_size")
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise InputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    stops = list(stop_token_ids or [])
    if len(stops) > MAX_STOP_IDS:
        raise InputError(f"at most {MAX_STOP_IDS} stop token ids are supported, got {len(stops)}")
    for t in stops:
        if not 0 <= int(t) < tcfg.vocab_size:
            raise InputError(f"stop token id {t} is outside the vocabulary [0, {tcfg.vocab_size})")
    stop_arr = jnp.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), jnp.int32)
    return prompts, stop_arr, stops


def _confidence_temperatures(temperatures, block_size: int) -> jax.Array:
    """[G] float32 STS temperatures (ones when None); InputError unless G positive numbers."""
    if temperatures is None:
        return jnp.ones((block_size,), jnp.float32)
    temps = [float(t) for t in temperatures]
    if len(temps) != block_size or not all(t > 0 and math.isfinite(t) for t in temps):
        raise InputError(f"confidence_temperatures must be {block_size} positive numbers (one per "
                         f"block position), got {list(temperatures)}")
    return jnp.asarray(temps, jnp.float32)


def per_request_budgets(max_new_tokens, n: int) -> list[int]:
    """One output budget per request from an int or a sequence of n ints; InputError otherwise."""
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        vals = list(max_new_tokens)
        if len(vals) != n:
            raise InputError(f"max_new_tokens: {len(vals)} values for {n} prompts")
        for i, v in enumerate(vals):
            require_positive_int(v, f"max_new_tokens[{i}]")
        return [int(v) for v in vals]
    require_positive_int(max_new_tokens, "max_new_tokens")
    return [int(max_new_tokens)] * n


def _batches(prompts, batch_size: int, p_len: int, budgets: Sequence[int]):
    """Yield (indices, prompts [B, P], lens [B], valid [B], budgets [B]), last batch padded."""
    for start in range(0, len(prompts), batch_size):
        idx = list(range(start, min(start + batch_size, len(prompts))))
        arr = np.zeros((batch_size, p_len), np.int32)
        lens = np.ones((batch_size,), np.int32)
        valid = np.zeros((batch_size,), bool)
        mx = np.ones((batch_size,), np.int32)
        for r, i in enumerate(idx):
            arr[r, :len(prompts[i])] = prompts[i]
            lens[r] = len(prompts[i])
            valid[r] = True
            mx[r] = budgets[i]
        yield idx, jnp.asarray(arr), jnp.asarray(lens), jnp.asarray(valid), jnp.asarray(mx)


def _drive(prompts, batch_size: int, p_len: int, seed: int, decode_batch, row_result,
           progress, budgets: Sequence[int]) -> list[Result]:
    """The batch loop shared by both decoders.

    Per batch (padded to ``batch_size`` rows of length ``p_len``): ``decode_batch(prompts
    [B, P], lens [B], valid [B], budgets [B], key)`` returns host arrays; ``row_result(host, row,
    prompt_length, batch_index, seconds)`` makes each request's Result; ``progress(n)``
    (optional) is told how many requests finished. Results are in prompt order.
    """
    key = jax.random.PRNGKey(seed)
    results: list[Result | None] = [None] * len(prompts)
    for bi, (idx, arr, lens, valid, mx) in enumerate(_batches(prompts, batch_size, p_len, budgets)):
        key, k_batch = jax.random.split(key)
        t0 = time.perf_counter()
        host = decode_batch(arr, lens, valid, mx, k_batch)
        seconds = time.perf_counter() - t0
        for r, i in enumerate(idx):
            results[i] = row_result(host, r, len(prompts[i]), bi, seconds, budgets[i])
        if progress is not None:
            progress(len(idx))
    return results  # type: ignore[return-value]


def _trim(tokens: list[int], max_new: int, stops: list[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


# --------------------------------------------------------------------------- public API


def speculative_generate(
    target_cfg: TargetConfig,
    target_params: dict,
    draft_cfg: DraftConfig,
    draft_params: dict,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 128,
    temperature: float = 0.0,
    policy: VerifyPolicy | None = None,
    batch_size: int = 1,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    confidence_temperatures: Sequence[float] | None = None,
    max_cache_len: int | None = None,
    loop: str = "device",
    progress: Callable[[int], None] | None = None,
    mesh=None,
    batching: str = "static",
    stats: dict | None = None,
    cache_spans: Sequence[int] | None = None,
) -> list[Result]:
    """Speculative decoding of ``prompts`` (token-id lists) in batches of ``batch_size``.

    Returns one Result per prompt (same order): new tokens only (at most
    max_new_tokens, cut after the first stop token), per-round acceptance
    lengths (bonus included), proposal lengths, accepted drafts and raw
    confidence logits. ``policy`` defaults to FullPolicy; ``loop`` is "device"
    (lax.while_loop) or "host" (Python loop over one compiled round);
    ``progress(n)`` is called with the number of requests finished per batch; ``mesh``
    (a ``jax.sharding.Mesh``, see ``sharded.make_decode_mesh``) shards params by their declared
    axes and the state by ``sharded.STATE_AXES`` (``build_decode``).
    ``batching="continuous"`` serves the prompts through ``batch_size`` slots instead
    (``decode.engine.serve``: StreamResults with per-request latency; ``stats`` receives the
    stream's throughput). ``cache_spans``: the compiled attention spans over the cache (default
    ``default_spans`` of the capacity; outputs do not depend on them, only the time does).
    Raises ConfigError / InputError before compiling anything.
    """
    if batching != "static":
        return _continuous(target_cfg, target_params, draft_cfg, draft_params, prompts, batching,
                           max_new_tokens=max_new_tokens, temperature=temperature, policy=policy,
                           slots=batch_size, seed=seed, stop_token_ids=stop_token_ids,
                           confidence_temperatures=confidence_temperatures,
                           max_cache_len=max_cache_len, mesh=mesh, progress=progress, stats=stats,
                           cache_spans=cache_spans)
    families.check_pair(draft_cfg, target_cfg)
    draft_cfg.check_compatible(target_cfg)
    sharded.check_mesh(mesh, target_cfg, draft_cfg, batch_size)
    budgets = per_request_budgets(max_new_tokens, len(prompts) if isinstance(prompts, (list, tuple)) else 0)
    max_new_tokens = max(budgets) if budgets else max_new_tokens
    prompts, stop_arr, stops = _validate_common(target_cfg, prompts, max_new_tokens, temperature,
                                                batch_size, stop_token_ids)
    g = draft_cfg.block_size
    conf_temps = _confidence_temperatures(confidence_temperatures, g)
    if loop not in ("device", "host"):
        raise InputError(f"loop must be 'device' or 'host', got {loop!r}")
    max_pos = min(target_cfg.max_position_embeddings, draft_cfg.max_position_embeddings)
    p_len, max_len = plan_shapes(prompts, max_new_tokens, g, max_pos, max_cache_len)
    policy = policy if policy is not None else FullPolicy()
    static = _Static(target_cfg, draft_cfg, policy, sampling.is_greedy(temperature), max_new_tokens,
                     spans=_spans_arg(cache_spans))
    compiled_spans(static, max_len)  # ConfigError now, not at trace time
    prefill_static = dataclasses.replace(static, policy=None)  # one prefill compile for all policies
    temp = jnp.float32(max(float(temperature), sampling.GREEDY_EPS))
    prog = build_decode(mesh, sharded.decode_rules(target_cfg))
    target_params = prog.place_params(target_params, target_cfg)
    draft_params = prog.place_params(draft_params, draft_cfg)

    def decode_batch(arr, lens, valid, mx, k_batch):
        arr, lens, valid, mx = prog.place(arr), prog.place(lens), prog.place(valid), prog.place(mx)
        state = prog.prefill(target_params, draft_params, arr, lens, valid, k_batch, temp,
                             stop_arr, static=prefill_static, max_len=max_len, max_new=mx)
        state = state.replace(policy_state=policy.init_state(batch_size, g))
        if loop == "device":
            state = prog.run(target_params, draft_params, state, temp, stop_arr, conf_temps,
                             static=static)
        else:
            for _ in range(max_new_tokens):
                if not bool(jnp.any(state.active)):
                    break
                state = prog.round(target_params, draft_params, state, temp, stop_arr,
                                   conf_temps, static=static)
        return sharding_lib.to_host({"seq": state.seq, "rounds": state.rounds, "acc": state.acc_rec,
                               "prop": state.prop_rec, "drafts": state.drafts_rec,
                               "conf": state.conf_rec})

    def row_result(host, r, start, bi, seconds, budget):
        n = int(host["rounds"][r])
        acc = [int(x) for x in host["acc"][r, :n]]
        count = 1 + sum(acc)
        out = _trim([int(t) for t in host["seq"][r, start:start + count]], budget, stops)
        conf = ([[float(c) for c in row] for row in host["conf"][r, :n]]
                if draft_cfg.enable_confidence_head else None)
        return Result(out, acc, [int(x) for x in host["prop"][r, :n]],
                      [int(x) for x in host["drafts"][r, :n]], conf, start, bi, seconds)

    return _drive(prompts, batch_size, p_len, seed, decode_batch, row_result, progress, budgets)


def autoregressive_generate(
    target_cfg: TargetConfig,
    target_params: dict,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 128,
    temperature: float = 0.0,
    batch_size: int = 1,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    max_cache_len: int | None = None,
    progress: Callable[[int], None] | None = None,
    mesh=None,
    batching: str = "static",
    stats: dict | None = None,
    cache_spans: Sequence[int] | None = None,
) -> list[Result]:
    """Baseline: one target token per step, same cache code, no drafter.

    Results have one "round" per generated token after the first (acceptance
    length 1, proposal length 0) so ``summarize`` works on both. ``mesh`` / ``batching`` /
    ``stats`` / ``cache_spans``: as for ``speculative_generate``.
    """
    if batching != "static":
        return _continuous(target_cfg, target_params, None, None, prompts, batching,
                           max_new_tokens=max_new_tokens, temperature=temperature, slots=batch_size,
                           seed=seed, stop_token_ids=stop_token_ids, max_cache_len=max_cache_len,
                           mesh=mesh, progress=progress, stats=stats, cache_spans=cache_spans)
    budgets = per_request_budgets(max_new_tokens, len(prompts) if isinstance(prompts, (list, tuple)) else 0)
    max_new_tokens = max(budgets) if budgets else max_new_tokens
    prompts, stop_arr, stops = _validate_common(target_cfg, prompts, max_new_tokens, temperature,
                                                batch_size, stop_token_ids)
    sharded.check_mesh(mesh, target_cfg, None, batch_size)
    p_len, max_len = plan_shapes(prompts, max_new_tokens, 1, target_cfg.max_position_embeddings,
                                 max_cache_len)
    static = _Static(target_cfg, None, None, sampling.is_greedy(temperature), max_new_tokens,
                     spans=_spans_arg(cache_spans))
    compiled_spans(static, max_len)  # ConfigError now, not at trace time
    temp = jnp.float32(max(float(temperature), sampling.GREEDY_EPS))

    prog = build_decode(mesh, sharded.decode_rules(target_cfg))
    target_params = prog.place_params(target_params, target_cfg)

    def decode_batch(arr, lens, valid, mx, k_batch):
        arr, lens, valid, mx = prog.place(arr), prog.place(lens), prog.place(valid), prog.place(mx)
        state = prog.ar_prefill(target_params, arr, lens, valid, k_batch, temp, stop_arr,
                                static=static, max_len=max_len, max_new=mx)
        state = prog.ar_run(target_params, state, temp, stop_arr, static=static)
        return sharding_lib.to_host((state.seq, state.pos))

    def row_result(host, r, start, bi, seconds, budget):
        seq, pos = host
        out = _trim([int(t) for t in seq[r, start:int(pos[r]) + 1]], budget, stops)
        n = max(len(out) - 1, 0)
        return Result(out, [1] * n, [0] * n, [0] * n, None, start, bi, seconds)

    return _drive(prompts, batch_size, p_len, seed, decode_batch, row_result, progress, budgets)


def _continuous(target_cfg, target_params, draft_cfg, draft_params, prompts, batching, **kw):
    if batching != "continuous":
        raise InputError(f"batching must be 'continuous' or 'static', got {batching!r}")
    from dspark_jax.decode import engine  # the engine is built on this module
    return engine.serve(target_cfg, target_params, draft_cfg, draft_params, prompts, **kw)


# --------------------------------------------------------------------------- metrics


def summarize(results: Sequence[Result], block_size: int | None = None) -> dict:
    """Aggregate metrics of decode results (paper section 5's tau and acceptance rates).

    tau: mean acceptance length per round (bonus included); mean_proposal;
    verify_rate = sum(acceptance) / sum(proposal + 1); accept_rate@k = rounds with
    > k accepted drafts / rounds that proposed > k; conditional_accept@k = rounds
    with > k accepted / rounds with >= k accepted that proposed > k; tokens/s =
    output tokens / summed batch wall time.
    """
    acc = [a for r in results for a in r.acceptance_lengths]
    prop = [p for r in results for p in r.proposal_lengths]
    drafts = [d for r in results for d in r.accepted_drafts]
    g = block_size or max(prop + [0])
    rounds = len(acc)
    out_tokens = sum(len(r.output_ids) for r in results)
    seconds = sum({(r.batch_index): r.batch_seconds for r in results}.values())
    accept_rate, conditional = [], []
    for k in range(g):
        proposed = sum(1 for p in prop if p > k)
        reached = sum(1 for p, d in zip(prop, drafts) if p > k and d >= k)
        passed = sum(1 for d in drafts if d > k)
        accept_rate.append(passed / proposed if proposed else None)
        conditional.append(passed / reached if reached else None)
    return {
        "requests": len(results),
        "rounds": rounds,
        "output_tokens": out_tokens,
        "tau": sum(acc) / rounds if rounds else 0.0,
        "mean_proposal": sum(prop) / rounds if rounds else 0.0,
        "verify_rate": sum(acc) / (sum(prop) + rounds) if rounds else 0.0,
        "accept_rate": accept_rate,
        "conditional_accept": conditional,
        "seconds": seconds,
        "tokens_per_second": out_tokens / seconds if seconds > 0 else 0.0,
    }
