"""Attention over the used prefix of the cache (``shapes.compiled_spans``): same outputs, fewer slots read.

A round (and an AR step) attends over the smallest compiled span >= its longest active row instead
of the whole capacity. Spans small enough that generations cross several of them must reproduce the
reference's greedy tokens and acceptance lengths (Qwen3 and Gemma4, static and continuous batching),
and sampled decoding must give the very same tokens as without spans (same keys: the distribution is
the target's by construction). A span choice that were too short would drop visible cache slots and
change these outputs.
"""

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.decode import autoregressive_generate, shapes, speculative_generate
from dspark_jax.decode.state import DecodeStatic
from dspark_jax.errors import ConfigError, InputError

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
GEMMA4 = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny"
SPANS = (16, 32, 48, 64)  # fixture prompts are 5..36 tokens, + 48 new: every row crosses spans


def test_default_spans_follow_the_capacity():
    assert shapes.default_spans(64) == (64,)
    assert shapes.default_spans(128) == (128,)
    assert shapes.default_spans(192) == (128, 192)
    assert shapes.default_spans(448) == (128, 256, 384, 448)
    assert shapes.default_spans(4096) == (1024, 2048, 3072, 4096)
    static = DecodeStatic(None, None, None, True, 8, spans=(48, 16))
    assert shapes.compiled_spans(static, 128) == (16, 48, 128)


def test_span_index_takes_the_longest_active_row():
    spans = (16, 32, 48, 128)
    pos, active = jnp.array([10, 40, 100]), jnp.array([True, True, False])
    assert int(shapes.span_index(pos, active, spans)) == 2        # 40 -> 48 (the finished row is ignored)
    assert int(shapes.span_index(pos, jnp.array([True, False, False]), spans)) == 0
    assert int(shapes.span_index(jnp.array([32]), jnp.array([True]), spans)) == 1  # p <= span
    assert int(shapes.span_index(jnp.array([33]), jnp.array([True]), spans)) == 2
    assert int(shapes.span_index(pos, jnp.zeros(3, bool), spans)) == 0


@pytest.mark.parametrize("spans,error", [([0], InputError), (["a"], InputError), ([1.5], InputError),
                                         ([10_000], ConfigError)])
def test_bad_spans_fail_before_compiling(tiny_reference, spans, error):
    tc, tp, dc, dp, ref = tiny_reference
    with pytest.raises(error, match="cache.spans"):
        speculative_generate(tc, tp, dc, dp, ref["prompts"][:1], max_new_tokens=4, cache_spans=spans)


def test_spans_reproduce_the_reference_through_the_engine(tiny_reference):
    """Continuous batching: rows finish and new ones start, so the longest live row (and the span)
    goes down as well as up."""
    tc, tp, dc, dp, ref = tiny_reference
    res = speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                               batch_size=3, batching="continuous", cache_spans=SPANS)
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
        assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance differs"


def test_sampled_tokens_do_not_depend_on_spans(tiny_reference):
    """T = 1, same seed: speculative and autoregressive decoding give the same tokens with and
    without spans (the fixture's capacity of 128 has one default span)."""
    tc, tp, dc, dp, ref = tiny_reference
    prompts = ref["prompts"]
    kw = dict(max_new_tokens=40, temperature=1.0, seed=3, batch_size=4)
    plain = speculative_generate(tc, tp, dc, dp, prompts, **kw)
    spanned = speculative_generate(tc, tp, dc, dp, prompts, cache_spans=SPANS, **kw)
    assert [r.output_ids for r in spanned] == [r.output_ids for r in plain]
    assert [r.acceptance_lengths for r in spanned] == [r.acceptance_lengths for r in plain]
    ar_plain = autoregressive_generate(tc, tp, prompts, **kw)
    ar_spanned = autoregressive_generate(tc, tp, prompts, cache_spans=SPANS, **kw)
    assert [r.output_ids for r in ar_spanned] == [r.output_ids for r in ar_plain]


def test_gemma4_spans_reproduce_the_reference():
    """Gemma4: spans cut the full-attention layers' reads; the sliding ring is read whole."""
    from dspark_jax.draft import gemma4 as draft_gemma4
    from dspark_jax.target import gemma4 as target_gemma4
    tc, tp = target_gemma4.load_params(GEMMA4 / "target")
    dc, dp = draft_gemma4.load_params(GEMMA4 / "draft")
    tp, dp = jax.tree.map(jnp.asarray, tp), jax.tree.map(jnp.asarray, dp)
    ref = json.loads((GEMMA4 / "decode_greedy.json").read_text())
    longest = max(len(p) for p in ref["prompts"])
    spans = tuple(range(longest // 2, longest + ref["max_new_tokens"] + 8, 16))
    res = speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                               batch_size=len(ref["prompts"]), cache_spans=spans)
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
        assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance differs"
