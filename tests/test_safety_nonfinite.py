"""Non-finite values never reach a result (issue 27).

A drafter with NaN weights must leave the output the target's own: every verified row
rejects its drafts and takes the target's token, at T=1 (chi-square against the exact
joint law, as tests/test_decode_lossless.py) and greedy (equal to autoregressive). A target
with NaN weights is an error naming the first bad token, in every decode path.
"""

import warnings

import jax
import numpy as np
import pytest

import decode_pairs as testing
from dspark_jax.decode import FullPolicy, autoregressive_generate, speculative_generate
from dspark_jax.errors import CheckpointError

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

PROMPT = [1, 6, 2]
N_TOKENS = 3
N_SAMPLES = 4000


def _nan(tree):
    return jax.tree.map(lambda a: np.full(a.shape, np.nan, np.float32), tree)


@pytest.fixture(scope="module")
def pair():
    return testing.tiny_pair()


def test_nan_drafter_output_is_the_targets_at_t1(pair):
    tc, tp, dc, dp = pair
    res = speculative_generate(tc, tp, dc, _nan(dp), [PROMPT] * N_SAMPLES, max_new_tokens=N_TOKENS,
                               temperature=1.0, policy=FullPolicy(), batch_size=N_SAMPLES, seed=1)
    out = np.array([r.output_ids for r in res])
    assert out.shape == (N_SAMPLES, N_TOKENS)
    counts = np.zeros((tc.vocab_size,) * N_TOKENS)
    np.add.at(counts, tuple(out.T), 1)
    p = testing.chi_square_pvalue(counts, testing.exact_joint(tc, tp, PROMPT, N_TOKENS, 1.0))
    assert p > 1e-4, f"NaN drafter at T=1: chi-square p={p:.2e}"
    assert not np.any(out == testing.TARGET_ZERO)
    assert all(a == 0 for r in res for a in r.accepted_drafts)  # every draft rejected: the target alone


def test_nan_drafter_greedy_equals_autoregressive_and_nan_target_is_an_error(pair):
    tc, tp, dc, dp = pair
    prompts = [PROMPT, [2, 4], [7, 1, 1, 0]]
    kw = dict(max_new_tokens=6, temperature=0.0, batch_size=2)
    ar = autoregressive_generate(tc, tp, prompts, **kw)
    spec = speculative_generate(tc, tp, dc, _nan(dp), prompts, policy=FullPolicy(), **kw)
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    bad = dict(tp, lm_head=_nan(tp["lm_head"]))  # same shapes: no new compilation
    for run in (lambda: speculative_generate(tc, bad, dc, dp, prompts, policy=FullPolicy(), **kw),
                lambda: autoregressive_generate(tc, bad, prompts, **kw)):
        with pytest.raises(CheckpointError, match="target's logits are not finite .* at new token 0"):
            run()


@pytest.mark.parametrize("greedy", [True, False])
def test_verify_rejects_a_non_finite_draft_row_and_stops_at_non_finite_target_logits(greedy):
    from dspark_jax import sampling
    from dspark_jax.decode.verify import rejection_sample

    v, g = 5, 3
    t = np.full((3, g + 1, v), -4.0, np.float32)
    t[:, :, 2] = 4.0                                      # the target wants token 2 everywhere
    d = np.full((3, g, v), -4.0, np.float32)
    d[:, :, 2] = 4.0                                      # the drafter agrees...
    d[0, 1, :] = np.nan                                   # ...except row 0's drafter is NaN at position 1
    t[1, 2, :] = np.nan                                   # row 1's target is NaN at position 2
    drafts = np.full((3, g), 2, np.int32)
    verify = jax.jit(rejection_sample, static_argnames=("greedy",))  # one compile beats eager op by op
    verdict = verify(jax.random.PRNGKey(0), t, d, drafts, np.array([3, 3, 3], np.int32), 1.0,
                     greedy=greedy, stop_ids=np.array([-1], np.int32))
    accepted, nxt = np.asarray(verdict.accepted), np.asarray(verdict.next_token)
    assert accepted[0] == 0 and nxt[0] == 2              # all drafts rejected; the target's token
    assert accepted[1] == 2 and nxt[1] == sampling.NONFINITE  # cut where the target broke
    assert accepted[2] == 3 and nxt[2] == 2              # untouched
    assert not np.asarray(verdict.stopped).any()
