"""Gemma4 target + Gemma4 DSpark drafter through the shipped decode loop (family dispatch).

Greedy speculative decoding reproduces the reference's ``decode_greedy.json`` token for token with
the same acceptance length every round: one prompt per batch, all prompts in one batch (prompts
longer than the sliding window, so the ring cache of the sliding layers wraps), and through the
continuous-batching engine. A Qwen3 drafter on a Gemma4 target fails before compiling.
"""

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import DraftConfig
from dspark_jax.decode import speculative_generate, summarize
from dspark_jax.draft import gemma4 as draft_gemma4
from dspark_jax.errors import ConfigError
from dspark_jax.target import gemma4 as target_gemma4

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
FIXTURE = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny"


@pytest.fixture(scope="module")
def pair():
    tc, tp = target_gemma4.load_params(FIXTURE / "target")
    dc, dp = draft_gemma4.load_params(FIXTURE / "draft")
    tp, dp = jax.tree.map(jnp.asarray, tp), jax.tree.map(jnp.asarray, dp)
    return tc, tp, dc, dp, json.loads((FIXTURE / "decode_greedy.json").read_text())


@pytest.mark.parametrize("batch_size,batching", [(1, "static"), (8, "static"), (4, "continuous")])
def test_greedy_matches_reference(pair, batch_size, batching):
    tc, tp, dc, dp, ref = pair
    assert max(len(p) for p in ref["prompts"]) > tc.sliding_window
    res = speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                               temperature=0.0, batch_size=batch_size, batching=batching)
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
        assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance lengths differ"
        assert r.proposal_lengths == ref["proposal_lengths"][i]
    acc = [a for x in ref["acceptance_lengths"] for a in x]
    assert summarize(res, dc.block_size)["tau"] == pytest.approx(np.mean(acc))


def test_greedy_matches_reference_per_layer_weights(pair, batching="continuous"):
    """The target's sliding / full stacks and the drafter's layers as per-layer buffers (decode's
    placement on GPUs, params.for_platform: unrolled layer loops over per-layer weights and
    per-layer cache buffers, ring, full and the drafter's context) give the reference tokens and
    acceptance lengths, in static batches and when requests are written into slots."""
    from dspark_jax import params as params_lib
    tc, tp, dc, dp, ref = pair
    per_layer = params_lib.for_platform(tp, "gpu", target_gemma4.STACKS)
    assert all(isinstance(per_layer[g], tuple) for g in target_gemma4.STACKS if g in tp)
    assert params_lib.for_platform(tp, "tpu", target_gemma4.STACKS)["full"] is tp["full"]
    dp_layers = params_lib.for_platform(dp, "gpu")  # the Gemma4 drafter's layers too
    assert isinstance(dp_layers["layers"], tuple)
    res = speculative_generate(tc, per_layer, dc, dp_layers, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                               temperature=0.0, batch_size=4, batching=batching)
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
        assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance lengths differ"


def test_qwen3_drafter_on_gemma4_target_is_rejected(pair):
    tc, tp, _, _, ref = pair
    qd = DraftConfig(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=16,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                     num_target_layers=tc.num_hidden_layers, target_layer_ids=(0,))
    with pytest.raises(ConfigError, match="gemma4"):
        speculative_generate(tc, tp, qd, {}, ref["prompts"][:1], max_new_tokens=4)


def test_greedy_matches_reference_on_a_mesh(pair):
    """data=2 x tensor=2: batch over data, sliding-group KV heads (2) over tensor; the full group's
    single KV head stays replicated. Same tokens and acceptance lengths as the reference."""
    from dspark_jax.decode import sharded
    tc, tp, dc, dp, ref = pair
    mesh = sharded.make_decode_mesh("data=2,tensor=2")
    res = speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                               temperature=0.0, batch_size=4, mesh=mesh)
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
        assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance lengths differ"
