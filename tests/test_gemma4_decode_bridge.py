"""Greedy parity of the Gemma4 pair with decode_greedy.json through today's decode loop.

TEMPORARY BRIDGE: the decode loop does not dispatch by model family yet, so this test swaps the
Gemma4 functions into ``decode.loop`` (its ``qwen3`` name) and ``draft.decode`` (its ``backbone`` /
``draft_model`` names) and
pre-scales the drafter's embedding by sqrt(H) (the loop embeds block tokens without the scale).
Once the loop takes the family's functions, replace this with a plain call like
``test_decode_parity.py`` and delete the patching.
"""

import json
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode import loop, speculative_generate, summarize
from dspark_jax.draft import decode as draft_decode
from dspark_jax.draft import gemma4 as draft_gemma4
from dspark_jax.target import gemma4 as target_gemma4

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
FIXTURE = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny"


@pytest.fixture(scope="module")
def pair():
    tc, tp = target_gemma4.load_params(FIXTURE / "target")
    dc, dp = draft_gemma4.load_params(FIXTURE / "draft")
    tp, dp = jax.tree.map(jnp.asarray, tp), jax.tree.map(jnp.asarray, dp)
    dp["embed_tokens"] = draft_gemma4.embed_block(dp, dc, jnp.arange(dc.vocab_size))
    return tc, tp, dc, dp, json.loads((FIXTURE / "decode_greedy.json").read_text())


@pytest.mark.parametrize("batch_size,ring", [(1, False), (8, False), (8, True)])
def test_greedy_parity(pair, batch_size, ring, monkeypatch):
    """ring: sliding layers keep window - 1 + (G + 1) slots instead of the whole context."""
    tc, tp, dc, dp, ref = pair
    slots = target_gemma4.ring_slots(tc, dc.block_size + 1) if ring else None
    monkeypatch.setattr(loop, "qwen3", types.SimpleNamespace(
        init_cache=lambda *a: target_gemma4.init_cache(*a, sliding_slots=slots), forward=target_gemma4.forward,
        compute_logits=lambda p, h: target_gemma4.compute_logits(p, tc, h)))
    monkeypatch.setattr(draft_decode, "backbone", types.SimpleNamespace(
        project_context=draft_gemma4.project_context, context_kv=draft_gemma4.context_kv,
        block_forward=draft_gemma4.block_forward))
    monkeypatch.setattr(draft_decode, "draft_model", types.SimpleNamespace(
        compute_logits=lambda p, h: draft_gemma4.compute_logits(p, dc, h)))
    assert max(len(p) for p in ref["prompts"]) > tc.sliding_window
    res = speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                               temperature=0.0, batch_size=batch_size)
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
        assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance lengths differ"
        assert r.proposal_lengths == ref["proposal_lengths"][i]
    acc = [a for x in ref["acceptance_lengths"] for a in x]
    assert summarize(res, dc.block_size)["tau"] == pytest.approx(np.mean(acc))
