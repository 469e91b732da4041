"""One step of decoding for every row: the speculative round and the autoregressive step.

Shapes: B rows, P padded prompt length, L cache capacity, G block size (draft tokens per round),
V vocab. The target is reached only through its family's runtime record
(``families.target_runtime``: ``init_cache``, ``forward``, ``logits``; ``dspark_jax.runtime``)
and its cache only through ``commit`` / ``delta_axes``, so any family that implements the
protocol decodes here.

One round (``speculative_round``): the drafter proposes G tokens after position p through its
kind's record (``draft.kinds.proposer``: ``runtime.Proposer``; a block or a chain) -> confidences ->
policy lengths -> one target forward over [x0, x_1..x_{w-1}] at p..p+w-1 for the smallest
compiled width w (``shapes.round_widths``, one ``lax.switch`` branch each; cache spans likewise)
-> rejection sampling of each row's own l_b tokens -> after the switch: the target cache commits
each active row's accepted tokens only (``cache.commit``), the tokens and records are written,
and the drafter commits the committed positions only (``Proposer.commit``: a ring's slots are
reused W positions later). Finished rows stay in the batch as masked no-ops.

Every program has one signature for both modes (``tparams, dparams, state, temperature,
stop_ids, conf_temps``; the autoregressive step ignores the drafter's arguments), so a driver
holds a mode's programs without branching on the mode. ``ctx`` (``runtime.Context``: mesh,
rules, compute dtype) is bound by ``programs.build_decode`` and handed to every forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax import families, runtime, sampling
from dspark_jax import params as params_lib
from dspark_jax.draft import kinds
from dspark_jax.decode.shapes import by_span, compiled_spans, round_widths, span_index, width_index
from dspark_jax.decode.state import ARState, DecodeState, DecodeStatic, insert
from dspark_jax.decode.verify import rejection_sample

LOCAL = runtime.LOCAL


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


# --------------------------------------------------------------------------- prefill


def _prefill(tparams, dparams, prompts, lens, valid, key, temperature, stop_ids,
             static: DecodeStatic, max_len: int, ctx: runtime.Context):
    """Target prefill of padded prompts [B, P] (lengths ``lens``), first token, drafter state.

    The target cache (``init_cache`` of capacity ``max_len``, sized for extends of G+1 tokens, 1
    without a drafter; per-layer buffers for per-layer params) commits each row's ``lens`` prompt
    tokens. Returns (cache, seq [B, L], active [B], the drafter kind's state after the prompt
    (``Proposer.init``; None without a drafter), key).
    """
    b, p = prompts.shape
    tcfg = static.target
    rt = families.target_runtime(tcfg)
    ctx = ctx.for_params(tparams)
    kind = kinds.proposer(static.draft) if static.draft is not None else None
    taps = kind.taps(static.draft) if kind is not None else ()
    extend = static.draft.block_size + 1 if static.draft is not None else 1
    apart = {"per_layer": True} if rt.per_layer and params_lib.per_layer(tparams, rt.stacks) else {}
    cache = rt.init_cache(tcfg, b, max_len, ctx.dtype, extend, **apart)
    hidden, features, delta = rt.forward(tparams, tcfg, prompts, cache, ctx=ctx, taps=taps,
                                         span=0)  # the cache is empty
    cache = cache.commit(delta, lens)
    rows = jnp.arange(b)
    key, k_first = jax.random.split(key)
    logits = rt.logits(tparams, tcfg, hidden[rows, lens - 1])
    first = sampling.guard(sampling.sample_logits(k_first, logits, temperature, static.greedy,
                                                  static.top_p), logits)
    seq = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(prompts).at[rows, lens].set(first)
    active = valid & ~is_stop(first, stop_ids)
    dstate = None
    if kind is not None:  # position t's feature with token t + 1 (the last committed: ``first``)
        following = jnp.concatenate([prompts[:, 1:], prompts[:, :1]], axis=1).at[rows, lens - 1].set(first)
        dstate = kind.init(dparams, static.draft, features, following, lens, max_len, ctx=ctx)
    return cache, seq, active, dstate, key


def _budgets(b: int, r: int, max_new):
    return jnp.full((b,), r, jnp.int32) if max_new is None else max_new.astype(jnp.int32)


def spec_prefill(tparams, dparams, prompts, lens, valid, key, temperature, stop_ids, static,
                 max_len, max_new=None, *, ctx: runtime.Context = LOCAL) -> DecodeState:
    """DecodeState after the prefill (policy_state ``()``: the caller sets ``policy.init_state``,
    so the prefill's compilation does not depend on the policy)."""
    cache, seq, active, draft_ctx, key = _prefill(
        tparams, dparams, prompts, lens, valid, key, temperature, stop_ids, static, max_len, ctx)
    b = prompts.shape[0]
    r, g = static.max_new_tokens, static.draft.block_size
    zeros = jnp.zeros((b, r), jnp.int32)
    max_new = _budgets(b, r, max_new)
    return DecodeState(
        seq=seq, pos=lens, num_input=lens, max_new=max_new, active=active & (max_new > 0), key=key,
        round=jnp.zeros((), jnp.int32), rounds=jnp.zeros((b,), jnp.int32),
        acc_rec=zeros, prop_rec=zeros, drafts_rec=zeros,
        conf_rec=jnp.zeros((b, r, g), jnp.float32), cache=cache, ctx=draft_ctx, policy_state=())


def ar_prefill(tparams, dparams, prompts, lens, valid, key, temperature, stop_ids, static, max_len,
               max_new=None, *, ctx: runtime.Context = LOCAL) -> ARState:
    """ARState after the prefill (``dparams`` unused: the modes share one signature)."""
    del dparams
    cache, seq, active, _, key = _prefill(
        tparams, None, prompts, lens, valid, key, temperature, stop_ids, static, max_len, ctx)
    max_new = _budgets(prompts.shape[0], static.max_new_tokens, max_new)
    return ARState(seq=seq, pos=lens, num_input=lens, max_new=max_new,
                   active=active & (max_new > 1), key=key, cache=cache)


# --------------------------------------------------------------------------- the speculative round


def _verify_width(tparams, state: DecodeState, anchor, drafts, draft_logits, lengths, k_verify,
                  temperature, stop_ids, static: DecodeStatic, ctx: runtime.Context, width: int,
                  span: int):
    """Target verification and rejection sampling over the first ``width`` (static) block tokens
    [x0, x_1..x_{w-1}] at positions p..p+w-1 (every active row has lengths <= w-1), reading the
    first ``span`` cache slots (every active row has p <= span).

    Returns (verdict, taps [B, G+1, F] zero-padded past w, delta): the target's cache delta
    zero-padded to G+1 tokens along its step axis (``runtime.pad_steps``), uncommitted (the
    caller commits outside any ``lax.switch``: in place; a branch that wrote would copy the
    cache). The rejection sampler draws its uniforms for the whole block (G) and uses the first
    w-1, so a sampled run is the same whatever width runs it."""
    tcfg, dcfg = static.target, static.draft
    g = dcfg.block_size
    d, pad = width - 1, g + 1 - width
    verify_tokens = jnp.concatenate([anchor[:, None], drafts[:, :d]], axis=1)      # [B,w]
    rt = families.target_runtime(tcfg)
    hidden, taps, delta = rt.forward(tparams, tcfg, verify_tokens, state.cache, ctx=ctx,
                                     taps=kinds.proposer(dcfg).taps(dcfg), span=span)
    delta = runtime.pad_steps(delta, state.cache.delta_axes(), g + 1)
    t_logits = rt.logits(tparams, tcfg, hidden)
    verdict = rejection_sample(k_verify, t_logits, draft_logits[:, :d], drafts[:, :d],
                               jnp.minimum(lengths, d), temperature, static.greedy, stop_ids,
                               draw_width=g)
    return verdict, jnp.pad(taps, ((0, 0), (0, pad), (0, 0))), delta


def _draft(dparams, state: DecodeState, anchor, key, temperature, conf_temps,
           static: DecodeStatic, spans, s_index, ctx: runtime.Context):
    """The drafter kind's proposal for every row (``Proposer.propose``) and the policy's lengths:
    (drafts [B, G], draft logits [B, G, V], confidence logits [B, G] (zeros without a head),
    lengths [B] in [0, G], new policy state, the drafter state ``propose`` returns)."""
    dcfg = static.draft
    b, g = anchor.shape[0], dcfg.block_size
    drafts, draft_logits, conf_logits, dstate = kinds.proposer(dcfg).propose(
        dparams, dcfg, state.ctx, anchor, state.pos, key, temperature, static.greedy, ctx=ctx,
        spans=spans, span_index=s_index)
    if conf_logits is not None:
        conf = jax.nn.sigmoid(conf_logits / conf_temps)
    else:
        conf, conf_logits = jnp.ones((b, g), jnp.float32), jnp.zeros((b, g), jnp.float32)
    lengths, policy_state = static.policy(state.policy_state, conf, state.active)
    return (drafts, draft_logits, conf_logits, jnp.clip(lengths.astype(jnp.int32), 0, g),
            policy_state, dstate)


def _records(state: DecodeState, static: DecodeStatic, acc_len, verdict, conf_logits) -> dict:
    """The round's per-row records, written at each active row's round index."""
    rows = jnp.arange(state.seq.shape[0])
    rec = jnp.where(state.active, state.rounds, static.max_new_tokens)  # out of range -> dropped
    put = lambda buf, x: buf.at[rows, rec].set(x, mode="drop")
    return dict(acc_rec=put(state.acc_rec, acc_len),
                prop_rec=put(state.prop_rec, verdict.proposal_length),
                drafts_rec=put(state.drafts_rec, verdict.accepted),
                conf_rec=put(state.conf_rec, conf_logits))


def speculative_round(tparams, dparams, state: DecodeState, temperature, stop_ids, conf_temps,
                      static: DecodeStatic, *, ctx: runtime.Context = LOCAL) -> DecodeState:
    """One speculative round for every row (finished rows: masked no-ops).

    The target's branches are (width, span) pairs (``shapes.round_widths`` x
    ``shapes.compiled_spans``); they only verify. The commits (target cache: each active row's
    accepted tokens; tokens; draft context; records) happen after the switch over G+1 padded
    slots, the ones >= w dropped, so the donated buffers are updated in place."""
    dcfg = static.draft
    b, max_len = state.seq.shape
    g = dcfg.block_size
    rows = jnp.arange(b)
    key, k_draft, k_verify = sampling.split(state.key, 3)
    active, ctx = state.active, ctx.for_params(tparams)
    anchor = state.seq[rows, state.pos]
    spans = compiled_spans(static, max_len)
    s_index = span_index(state.pos, active, spans)
    drafts, draft_logits, conf_logits, lengths, policy_state, dstate = _draft(
        dparams, state, anchor, k_draft, temperature, conf_temps, static, spans, s_index, ctx)

    widths = round_widths(static)
    branches = [functools.partial(_verify_width, tparams, state, anchor, drafts, draft_logits,
                                  lengths, k_verify, temperature, stop_ids, static, ctx, w, s)
                for w in widths for s in spans]
    w_index = width_index(lengths, active, widths)
    if len(branches) == 1:
        verdict, taps, delta = branches[0]()
    else:
        verdict, taps, delta = jax.lax.switch(w_index * len(spans) + s_index, branches)
    a = verdict.accepted
    acc_len = jnp.where(verdict.stopped, a, a + 1)
    k_idx = jnp.arange(g + 1, dtype=jnp.int32)[None, :]
    in_width = k_idx < jnp.asarray(widths, jnp.int32)[w_index]                 # [1, G+1]
    cache = state.cache.commit(delta, jnp.where(active, acc_len, 0))  # the accepted tokens only

    # Tokens: slots pos+1..pos+a get the drafts, pos+a+1 the replacement/bonus token.
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tokens = jnp.where(k_idx == a[:, None], verdict.next_token[:, None], padded)
    slots = jnp.where(active[:, None] & in_width, state.pos[:, None] + 1 + k_idx, max_len)
    seq = state.seq.at[rows[:, None], slots].set(new_tokens, mode="drop")
    new_pos = jnp.where(active, state.pos + acc_len, state.pos)
    # The drafter folds in the committed positions p..new_pos-1 (acc_len <= w): their features
    # and, for each, the token after it (the accepted drafts, then the bonus).
    draft_ctx = kinds.proposer(dcfg).commit(
        dparams, dcfg, dstate, taps, new_tokens, state.pos[:, None] + k_idx, jnp.where(active, acc_len, 0),
        ctx=ctx)

    next_stop = ~verdict.stopped & is_stop(verdict.next_token, stop_ids)
    still = (active & ~verdict.stopped & ~next_stop
             & (new_pos - state.num_input < state.max_new))
    return state.replace(
        seq=seq, pos=new_pos, active=still, key=key, round=state.round + 1,
        rounds=state.rounds + active.astype(jnp.int32), cache=cache, ctx=draft_ctx,
        policy_state=policy_state, **_records(state, static, acc_len, verdict, conf_logits))


# --------------------------------------------------------------------------- the autoregressive step


def ar_step(tparams, dparams, state: ARState, temperature, stop_ids, conf_temps, static, *,
            ctx: runtime.Context = LOCAL) -> ARState:
    """One target token for every active row (``dparams`` / ``conf_temps`` unused)."""
    del dparams, conf_temps
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
    logits = rt.logits(tparams, tcfg, hidden[:, 0])
    nxt = sampling.guard(sampling.sample_logits(k_s, logits, temperature, static.greedy, static.top_p),
                         logits)
    seq = state.seq.at[rows, jnp.where(active, state.pos + 1, max_len)].set(nxt, mode="drop")
    pos = jnp.where(active, state.pos + 1, state.pos)
    still = active & ~is_stop(nxt, stop_ids) & (pos + 1 - state.num_input < state.max_new)
    return state.replace(seq=seq, pos=pos, active=still, key=key, cache=cache)


# --------------------------------------------------------------------------- loops over steps


def _loop(step, cond, state):
    return jax.lax.while_loop(cond, step, state)


def spec_run(tparams, dparams, state, temperature, stop_ids, conf_temps, static, *,
             ctx: runtime.Context = LOCAL):
    """Rounds until every row has finished (a device ``lax.while_loop``)."""
    return _loop(lambda s: speculative_round(tparams, dparams, s, temperature, stop_ids, conf_temps,
                                             static, ctx=ctx),
                 lambda s: jnp.any(s.active) & (s.round < static.max_new_tokens), state)


def ar_run(tparams, dparams, state, temperature, stop_ids, conf_temps, static, *,
           ctx: runtime.Context = LOCAL):
    """Autoregressive steps until every row has finished."""
    return _loop(lambda s: ar_step(tparams, dparams, s, temperature, stop_ids, conf_temps, static,
                                   ctx=ctx),
                 lambda s: jnp.any(s.active), state)


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


def chunk_of(step):
    """The chunk program of ``step`` (``speculative_round`` or ``ar_step``)."""
    def chunk(tparams, dparams, state, temperature, stop_ids, conf_temps, max_steps, until_finish,
              static, *, ctx: runtime.Context = LOCAL):
        return _run_chunk(lambda s: step(tparams, dparams, s, temperature, stop_ids, conf_temps,
                                         static, ctx=ctx), state, max_steps, until_finish)
    chunk.__name__ = f"{step.__name__}_chunk"
    return chunk


def prefill_into_of(prefill):
    """The one-request prefill of ``prefill`` written into row ``slot`` of a batched state (the
    continuous engine's refill): prompt [1, P], length [1], max_new [1]."""
    def prefill_into(tparams, dparams, state, slot, prompt, length, max_new, key, temperature,
                     stop_ids, static, max_len, *, ctx: runtime.Context = LOCAL):
        one = prefill(tparams, dparams, prompt, length, jnp.ones((1,), bool), key, temperature,
                      stop_ids, static, max_len, max_new, ctx=ctx)
        return insert(state, one, slot)
    prefill_into.__name__ = f"{prefill.__name__}_into"
    return prefill_into
