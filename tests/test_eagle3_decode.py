"""Eagle3 chain decoding against DeepSpec's evaluator (eagle3_{qwen3,gemma4}_tiny): greedy rounds
identical in tokens and acceptance lengths, T = 1 acceptance per position within 4 SE.

``rounds`` runs the evaluator's protocol on the chain functions (``draft.eagle3.chain``) with the
target's runtime forward and the engine's ``rejection_sample``: prefill (its argmax / sample is
the first new token), then rounds of k drafts verified in one target forward, both caches
committed with the accepted drafts plus the target's token, until a row's acceptance lengths sum
to ``max_new`` (the reference's stopping rule)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from dspark_jax import families, runtime, sampling
from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.decode.verify import rejection_sample
from dspark_jax.draft.eagle3 import chain

TARGETS = {"qwen3": FIXTURES / "eagle3_qwen3_tiny" / "target",
           "gemma4": FIXTURES / "dspark_gemma4_tiny" / "target"}  # the same target, bit for bit


def rounds(fam, prompts, temperature, max_new, seed=0):
    """(output tokens per row, acceptance lengths per row, accepted drafts per row)."""
    tc, tp = load_target(TARGETS[fam])
    dc, dp = load_draft(FIXTURES / f"eagle3_{fam}_tiny" / "draft")
    rt, ctx, k = families.target_runtime(tc), runtime.Context(dtype=jnp.float32), dc.block_size
    greedy = temperature == 0
    b, p = len(prompts), max(map(len, prompts))
    cap = p + max_new + 2 * (k + 1)
    ids = np.zeros((b, p), np.int32)
    for i, row in enumerate(prompts):
        ids[i, :len(row)] = row
    lens = jnp.asarray([len(r) for r in prompts], jnp.int32)
    stop = jnp.full((1,), -1, jnp.int32)

    @jax.jit
    def prefill(ids, key):
        cache = rt.init_cache(tc, b, cap, jnp.float32, k + 1)
        hidden, feats, delta = rt.forward(tp, tc, ids, cache, ctx=ctx, taps=chain.taps(dc), span=None)
        last = jnp.take_along_axis(rt.logits(tp, tc, hidden), (lens - 1)[:, None, None], 1)[:, 0]
        first = sampling.sample_logits(key, last, temperature or 1.0, greedy).astype(jnp.int32)
        nxt = jnp.concatenate([ids[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1).at[jnp.arange(b), lens - 1].set(first)
        return cache.commit(delta, lens), chain.init(dp, dc, feats, nxt, lens, cap, ctx=ctx), first

    @jax.jit
    def one_round(cache, dstate, anchor, key):
        k_draft, k_verify = jax.random.split(key)
        pos = dstate.cache.lengths
        drafts, dlogits, _, _ = chain.propose(dp, dc, dstate, anchor, pos, k_draft, temperature or 1.0, greedy)
        hidden, feats, delta = rt.forward(tp, tc, jnp.concatenate([anchor[:, None], drafts], 1), cache, ctx=ctx,
                                          taps=chain.taps(dc), span=None)
        v = rejection_sample(k_verify, rt.logits(tp, tc, hidden), dlogits, drafts, jnp.full((b,), k, jnp.int32),
                             temperature or 1.0, greedy, stop)
        n_new = v.accepted + 1
        nxt = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], 1).at[jnp.arange(b), v.accepted].set(v.next_token)
        positions = pos[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
        dstate = chain.commit(dp, dc, dstate, feats, nxt, positions, n_new, ctx=ctx)
        return cache.commit(delta, n_new), dstate, v.next_token, nxt, n_new

    key = jax.random.PRNGKey(seed)
    key, sub = jax.random.split(key)
    cache, dstate, anchor = prefill(jnp.asarray(ids), sub)
    outs, accs = [[int(x)] for x in np.asarray(anchor)], [[] for _ in range(b)]
    while min(sum(a) for a in accs) < max_new:
        key, sub = jax.random.split(key)
        cache, dstate, anchor, nxt, n_new = one_round(cache, dstate, anchor, sub)
        nxt, n_new = np.asarray(nxt), np.asarray(n_new)
        for i in range(b):
            if sum(accs[i]) < max_new:
                accs[i].append(int(n_new[i]))
                outs[i].extend(int(x) for x in nxt[i, :n_new[i]])
    return [o[:max_new] for o in outs], accs, [[a - 1 for a in row] for row in accs]


@pytest.mark.parametrize("fam", ("qwen3", "gemma4"))
def test_greedy_rounds_identical_to_deepspec(fam):
    ref = json.loads((FIXTURES / f"eagle3_{fam}_tiny" / "decode_greedy.json").read_text())
    outs, accs, _ = rounds(fam, ref["prompts"], 0.0, ref["max_new_tokens"])
    assert outs == ref["output_ids"]
    assert accs == ref["acceptance_lengths"]


def accept_rates(accepted_drafts, k):
    """DeepSpec's accept_rate@p: rounds with more than p accepted drafts over rounds (all propose k)."""
    flat = np.concatenate([np.asarray(r) for r in accepted_drafts])
    return np.array([(flat > p).mean() for p in range(k)]), len(flat)


@pytest.mark.slow
@pytest.mark.parametrize("fam", ("qwen3", "gemma4"))
def test_t1_acceptance_per_position_within_4_se(fam):
    ref = json.loads((FIXTURES / f"eagle3_{fam}_tiny" / "sampling_T1.json").read_text())
    _, accs, drafts = rounds(fam, ref["prompts"], 1.0, ref["max_new_tokens"], seed=1)
    ours, n = accept_rates(drafts, ref["draft_steps"])
    theirs = np.asarray(ref["accept_rates_by_position"])
    se = np.sqrt(ours * (1 - ours) / n + theirs * (1 - theirs) / ref["rounds"])
    assert np.all(np.abs(ours - theirs) <= 4 * se + 1e-9), (ours, theirs, se)
    mean = np.mean(np.concatenate([np.asarray(a) for a in accs]))
    assert abs(mean - ref["mean"]) <= 4 * np.hypot(ref["se"], np.std(np.concatenate(accs)) / np.sqrt(n)), mean
