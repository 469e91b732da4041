"""Eagle3 decoding through the chain round (``speculative_generate``), against DeepSpec's
evaluator (eagle3_{qwen3,gemma4}_tiny): greedy tokens and acceptance lengths identical round by
round, T = 1 acceptance per position within 4 SE of sampling_T1.json, and sampling at T = 1
lossless (chi-square, full and fixed policies) on a vocab-8 target with a random Eagle3."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_pairs as testing
from conftest import FIXTURES
from dspark_jax.config import TargetConfig
from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.decode import FixedPolicy, FullPolicy, ThresholdPolicy, speculative_generate, summarize
from dspark_jax.draft.eagle3 import Qwen3Eagle3Config, model
from dspark_jax.errors import ConfigError
from dspark_jax.target import qwen3

TARGETS = {"qwen3": FIXTURES / "eagle3_qwen3_tiny" / "target",
           "gemma4": FIXTURES / "dspark_gemma4_tiny" / "target"}  # the same target, bit for bit


@functools.lru_cache(maxsize=None)
def pair(fam):
    tc, tp = load_target(TARGETS[fam])
    dc, dp = load_draft(FIXTURES / f"eagle3_{fam}_tiny" / "draft")
    return tc, tp, dc, dp


def reference(fam, name):
    return json.loads((FIXTURES / f"eagle3_{fam}_tiny" / name).read_text())


@pytest.mark.parametrize("fam", ("qwen3", "gemma4"))
def test_greedy_rounds_identical_to_deepspec(fam):
    ref = reference(fam, "decode_greedy.json")
    res = speculative_generate(*pair(fam), ref["prompts"], max_new_tokens=ref["max_new_tokens"], temperature=0.0,
                               batch_size=len(ref["prompts"]), max_cache_len=128)
    assert [list(r.output_ids) for r in res] == ref["output_ids"]
    assert [[int(a) for a in r.acceptance_lengths] for r in res] == ref["acceptance_lengths"]
    assert all(p == ref["draft_steps"] for r in res for p in r.proposal_lengths)


def accept_rates(results, k):
    """DeepSpec's accept_rate@p: rounds with more than p accepted drafts over rounds proposing > p."""
    acc = np.concatenate([np.asarray(r.accepted_drafts) for r in results])
    prop = np.concatenate([np.asarray(r.proposal_lengths) for r in results])
    return np.array([(acc > p).sum() / max((prop > p).sum(), 1) for p in range(k)]), len(acc)


@pytest.mark.slow  # 48 of the 96 prompts x 48 tokens per fixture
@pytest.mark.parametrize("fam", ("qwen3", "gemma4"))
def test_t1_acceptance_per_position_within_4_se(fam):
    ref = reference(fam, "sampling_T1.json")
    prompts = ref["prompts"][:48]
    res = speculative_generate(*pair(fam), prompts, max_new_tokens=ref["max_new_tokens"], temperature=1.0,
                               batch_size=len(prompts), max_cache_len=128, seed=1)
    ours, n = accept_rates(res, ref["draft_steps"])
    theirs = np.asarray(ref["accept_rates_by_position"])
    se = np.sqrt(ours * (1 - ours) / n + theirs * (1 - theirs) / ref["rounds"])
    print(fam, "ours", np.round(ours, 3), n, "reference", theirs, ref["rounds"])
    assert np.all(np.abs(ours - theirs) <= 4 * se), (ours, theirs, se)


# ----------------------------------------------------------------------------- losslessness at T = 1

PROMPT = [1, 6, 2, 5]
N_TOKENS = 3
N = 2000


@functools.lru_cache(maxsize=None)
def tiny_eagle3():
    """A vocab-8, 6-layer Qwen3 target and a random Eagle3 of 2 chain steps (numpy-random params,
    std 0.3: the two laws differ, drafts are accepted and rejected)."""
    from flax import traverse_util
    tcfg = TargetConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, rope_theta=1e4,
                        max_position_embeddings=64)
    dcfg = Qwen3Eagle3Config.for_target(tcfg, ttt_length=2)
    rng = np.random.default_rng(0)

    def draw(decl):
        return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(
            {p: ((1.0 if s.init == "ones" else 0.0) + 0.3 * rng.standard_normal(s.shape)).astype(np.float32)
             for p, s in decl.items()}))

    tp = draw(qwen3.declare(tcfg))
    dp = draw(model.declare(dcfg))
    dp.update(embed_tokens=tp["embed_tokens"], lm_head=tp["lm_head"])
    return tcfg, tp, dcfg, dp


@pytest.mark.slow  # one compile of the 2000-row round per policy
@pytest.mark.parametrize("name", ["full", "fixed:1"])
def test_sampling_at_t1_is_lossless(name):
    tc, tp, dc, dp = tiny_eagle3()
    policy = FullPolicy() if name == "full" else FixedPolicy(1)
    res = speculative_generate(tc, tp, dc, dp, [PROMPT] * N, max_new_tokens=N_TOKENS, temperature=1.0,
                               policy=policy, batch_size=N, seed=11)
    out = np.array([r.output_ids for r in res])
    counts = np.zeros((tc.vocab_size,) * N_TOKENS)
    np.add.at(counts, tuple(out.T), 1)
    p = testing.chi_square_pvalue(counts, testing.exact_joint(tc, tp, PROMPT, N_TOKENS, 1.0))
    s = summarize(res, dc.block_size)
    print(f"{name}: chi-square p={p:.3g} accept_rate={s['accept_rate']}")
    assert p > 1e-4, f"{name}: chi-square p={p:.2e}"
    assert 0.05 < s["accept_rate"][0] < 0.95, s  # drafts were both accepted and rejected


def test_policies_that_read_confidence_are_refused():
    tc, tp, dc, dp = tiny_eagle3()
    with pytest.raises(ConfigError, match="confidence"):
        speculative_generate(tc, tp, dc, dp, [[1, 2, 3]], policy=ThresholdPolicy(0.5))
