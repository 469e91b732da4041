"""Lossless sampling with a Gemma4 target and a Gemma4 DSpark drafter (chi-square, as
tests/test_decode_lossless.py): the joint law of the first 3 new tokens of 4k independent
requests must match the target's exact joint, for the full and the threshold policies.

The pair is tiny (vocab 8) and random; the target has a sliding window of 4 (shorter than
prompt + new tokens, so the sliding layers' ring cache wraps) and a softcapped head.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode import FullPolicy, ThresholdPolicy, speculative_generate, summarize
from dspark_jax.draft import gemma4 as draft_gemma4
from dspark_jax.target import gemma4 as target_gemma4
import decode_pairs as testing

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

VOCAB = 8
PROMPT = [1, 6, 2, 4, 3]
N_TOKENS = 3
N_SAMPLES = 4000


@functools.lru_cache(maxsize=None)
def gemma4_pair(seed: int = 0):
    """(target_cfg, target_params, draft_cfg, draft_params): numpy-initialised, no XLA init."""
    tc = target_gemma4.Gemma4TargetConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"), sliding_window=4,
        final_logit_softcapping=30.0, max_position_embeddings=64)
    dc = draft_gemma4.Gemma4DraftConfig.for_target(
        tc, 1, target_layer_ids=(0, 1), block_size=2, mask_token_id=VOCAB - 1, num_anchors=4,
        markov_rank=4, markov_head_type="vanilla")
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(0)  # eval_shape only

    def init(tree, std=0.3):
        def leaf(path, a):
            name = jax.tree_util.keystr(path)
            if "norm" in name or "scalar" in name:
                return np.ones(a.shape, np.float32)
            if "bias" in name:
                return np.zeros(a.shape, np.float32)
            return (std * rng.standard_normal(a.shape)).astype(np.float32)
        return jax.tree_util.tree_map_with_path(leaf, tree)

    tp = init(jax.eval_shape(lambda k: target_gemma4.init_params(tc, k), key))
    tp["embed_tokens"] = (0.5 * rng.standard_normal((VOCAB, 16))).astype(np.float32)
    dp = init(jax.eval_shape(lambda k: draft_gemma4.init_params(dc, k), key))
    dp["embed_tokens"] = tp["embed_tokens"]
    dp["lm_head"] = (0.5 * rng.standard_normal((16, VOCAB))).astype(np.float32)
    return tc, jax.tree.map(jnp.asarray, tp), dc, jax.tree.map(jnp.asarray, dp)


@pytest.mark.parametrize("policy", [FullPolicy(), ThresholdPolicy(0.5)], ids=["full", "threshold"])
def test_gemma4_speculative_matches_target(policy):
    tc, tp, dc, dp = gemma4_pair()
    assert len(PROMPT) + N_TOKENS > tc.sliding_window
    res = speculative_generate(tc, tp, dc, dp, [PROMPT] * N_SAMPLES, max_new_tokens=N_TOKENS,
                               temperature=1.0, policy=policy, batch_size=N_SAMPLES, seed=1)
    out = np.array([r.output_ids for r in res])
    assert out.shape == (N_SAMPLES, N_TOKENS)
    counts = np.zeros((VOCAB,) * N_TOKENS)
    np.add.at(counts, tuple(out.T), 1)
    p = testing.chi_square_pvalue(counts, testing.exact_joint(tc, tp, PROMPT, N_TOKENS, 1.0))
    s = summarize(res, dc.block_size)
    print(f"gemma4 {type(policy).__name__}: chi-square p={p:.3g} accept_rate={s['accept_rate']} "
          f"mean_proposal={s['mean_proposal']:.3f}")
    assert p > 1e-4, f"{policy}: chi-square p={p:.2e}"
    assert 0.1 < s["accept_rate"][0] < 0.95, s  # drafts were accepted and rejected
    if isinstance(policy, ThresholdPolicy):
        assert 0.0 < s["mean_proposal"] < 2.0  # a real mix of lengths
