"""Continuous batching is lossless: the chi-square test of tests/test_decode_lossless.py with the
scored requests arriving and leaving mid-run among distractor requests of other prompts and
budgets (so rows are refilled while others are half-way), for full, threshold and scheduler (on a
token SPS table, and width-aware on a round table: narrow verification widths chosen per round)."""

import warnings

import numpy as np
import pytest

import decode_pairs as testing
from dspark_jax.decode import FullPolicy, ThresholdPolicy, engine, summarize
from dspark_jax.decode import scheduler as S, tables

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

PROMPT = [1, 6, 2]
N_TOKENS = 3
N = 4000       # scored requests (power argument: tests/test_decode_lossless.py)
DISTRACT = 800  # other requests mixed in: other prompts, budgets 1..6
SLOTS = 256


@pytest.fixture(scope="module")
def pair():
    return testing.tiny_pair()


# Rounds/s at verification widths 1, 2, 3 (the pair's block size is 2), set so that the
# width-aware scheduler's choice varies with the round's confidences: first rounds of the scored
# requests verified 0, 1 and 2 drafts (214 / 3428 / 358 of 4000 when written).
ROUNDS = tables.RoundTable((1, SLOTS), (1, 2, 3), ((100.0, 65.0, 54.0), (100.0, 65.0, 54.0)))


def _policy(name):
    if name == "full":
        return FullPolicy()
    if name == "threshold":
        return ThresholdPolicy(0.5)
    table = tables.SPSTable((1, SLOTS, 3 * SLOTS), (1.0, 1.0, 0.4)) if name == "scheduler" else ROUNDS
    return S.make_policy("scheduler", table)


@pytest.mark.parametrize("name", ["full", "threshold", "scheduler", "scheduler-rounds"])
def test_continuous_batching_is_lossless(pair, name):
    tc, tp, dc, dp = pair
    policy = _policy(name)
    rng = np.random.default_rng(7)
    prompts = [PROMPT] * N + [rng.integers(0, 8, size=int(rng.integers(1, 6))).tolist()
                              for _ in range(DISTRACT)]
    budgets = [N_TOKENS] * N + rng.integers(1, 7, size=DISTRACT).tolist()
    order = rng.permutation(len(prompts)).tolist()
    st = {}
    res = engine.serve(tc, tp, dc, dp, prompts, max_new_tokens=budgets, temperature=1.0,
                       policy=policy, slots=SLOTS, seed=5, order=order, stats=st)
    assert st["chunks"] > 10  # refills really happened mid-run
    out = np.array([r.output_ids for r in res[:N]])
    assert out.shape == (N, N_TOKENS)
    counts = np.zeros((tc.vocab_size,) * N_TOKENS)
    np.add.at(counts, tuple(out.T), 1)
    p = testing.chi_square_pvalue(counts, testing.exact_joint(tc, tp, PROMPT, N_TOKENS, 1.0))
    assert p > 1e-4, f"{name}: chi-square p={p:.2e}"
    assert not np.any(out == testing.TARGET_ZERO)
    s = summarize(res[:N], dc.block_size)
    assert 0.1 < s["accept_rate"][0] < 0.95, s
    if name == "scheduler-rounds":  # the round table really made the budget vary
        first = np.bincount([r.proposal_lengths[0] for r in res[:N]], minlength=dc.block_size + 1)
        assert np.count_nonzero(first) >= 2, first
