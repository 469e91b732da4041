"""The prefix schedulers inside the real decode loop are lossless (statistical check).

Reuses the decode loop's tiny target/drafter pair and exact-distribution helpers
(tests/decode_pairs.py): 4k requests in one batch, T = 1, the joint law of the
first 3 new tokens against the target's exact joint (chi-square). The SPS curve is
chosen so that, at this batch size, the scheduler verifies a real mix of lengths.
(The retrospective search's bias is diluted to nothing in a 4k-row global search, so it is
not caught here; the exact Appendix A test in test_scheduler.py covers it.)
"""

import warnings

import numpy as np
import pytest

from dspark_jax.decode import scheduler as S, tables
import decode_pairs as testing
from dspark_jax.decode import speculative_generate, summarize

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

PROMPT = [1, 6, 2]
N_TOKENS = 3
N = 4000  # same batch as test_decode_lossless (shared prefill compile); power argument there
# flat up to N tokens (one per request), then each extra verification token costs throughput
SPS = tables.SPSTable((1, N, 3 * N), (1.0, 1.0, 0.4))


@pytest.fixture(scope="module")
def pair():
    return testing.tiny_pair()


def _check(pair, policy, temperature=1.0, seed=3):
    tc, tp, dc, dp = pair
    res = speculative_generate(tc, tp, dc, dp, [PROMPT] * N, max_new_tokens=N_TOKENS,
                               temperature=temperature, policy=policy, batch_size=N, seed=seed)
    out = np.array([r.output_ids for r in res])
    counts = np.zeros((tc.vocab_size,) * N_TOKENS)
    np.add.at(counts, tuple(out.T), 1)
    exact = testing.exact_joint(tc, tp, PROMPT, N_TOKENS, temperature)
    props = np.concatenate([r.proposal_lengths for r in res])
    return testing.chi_square_pvalue(counts, exact), summarize(res, dc.block_size), props


@pytest.mark.parametrize("spec", ["scheduler", "scheduler-async:1"])
def test_scheduler_lossless_in_decode_loop(pair, spec):
    p, s, props = _check(pair, S.make_policy(spec, SPS))
    assert p > 1e-4, f"{spec}: chi-square p={p:.2e}"
    counts = np.bincount(props, minlength=3)
    assert np.all(counts > 0.05 * len(props)), counts  # lengths 0, 1 and 2 all occur

