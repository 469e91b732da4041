"""Greedy parity with the PyTorch reference (decode_greedy.json), at batch 1 and one batch of all prompts."""

import warnings

import pytest

from dspark_jax.decode import speculative_generate, summarize

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_parity(tiny_reference, batch_size):
    tc, tp, dc, dp, ref = tiny_reference
    assert ref["temperature"] == 0.0 and ref["confidence_threshold"] == 0.0
    n = len(ref["prompts"])
    res = speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                               temperature=0.0, batch_size=batch_size if batch_size == 1 else n)
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
        assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance lengths differ"
        assert r.proposal_lengths == ref["proposal_lengths"][i], f"prompt {i}: proposal lengths differ"
        assert len(r.confidence_logits) == len(r.acceptance_lengths)
        assert all(len(c) == dc.block_size for c in r.confidence_logits)
        assert [a - 1 for a in r.acceptance_lengths] == r.accepted_drafts
    s = summarize(res, dc.block_size)
    acc = [a for x in ref["acceptance_lengths"] for a in x]
    assert s["tau"] == pytest.approx(sum(acc) / len(acc))
    assert s["output_tokens"] == n * ref["max_new_tokens"]


def test_greedy_parity_per_layer_weights(tiny_reference):
    """Target and drafter layers as per-layer buffers (decode's placement on GPUs,
    params.for_platform: unrolled layer loops over per-layer weights, per-layer KV cache buffers
    and a per-layer context cache; TPUs and CPUs keep the stacks) give the reference tokens, in a
    static batch and in continuous batching (a request's prefill and context written into a slot
    of every layer's buffer)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from dspark_jax import params as params_lib
    from dspark_jax.decode import engine, programs
    from dspark_jax.draft import backbone
    tc, tp, dc, dp, ref = tiny_reference
    tp_layers, dp_layers = params_lib.for_platform(tp, "gpu"), params_lib.for_platform(dp, "gpu")
    assert isinstance(tp_layers["layers"], tuple) and len(tp_layers["layers"]) == tc.num_hidden_layers
    assert isinstance(dp_layers["layers"], tuple) and len(dp_layers["layers"]) == dc.num_hidden_layers
    assert params_lib.for_platform(tp, "tpu")["layers"] is tp["layers"]
    ctx = jax.random.normal(jax.random.PRNGKey(0), (2, 5, dc.hidden_size), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    for a, b in zip(backbone.context_kv(dp, dc, ctx, pos), backbone.context_kv(dp_layers, dc, ctx, pos)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    static = programs.DecodeStatic(target=tc, draft=dc, policy=None, greedy=True, max_new_tokens=4)
    state = programs.abstract_decode_state(tp_layers, dp_layers, static, batch=2, max_len=32, prompt_len=4)
    assert state.cache.per_layer and len(state.cache.k) == tc.num_hidden_layers and state.cache.k[0].shape[2] == 32
    assert state.ctx.per_layer and len(state.ctx.k) == dc.num_hidden_layers and state.ctx.max_len == 32
    for res in (speculative_generate(tc, tp_layers, dc, dp_layers, ref["prompts"],
                                     max_new_tokens=ref["max_new_tokens"], temperature=0.0,
                                     batch_size=len(ref["prompts"])),
                engine.serve(tc, tp_layers, dc, dp_layers, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                             slots=3)):
        for i, r in enumerate(res):
            assert r.output_ids == ref["output_ids"][i], f"prompt {i}: tokens differ"
            assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"prompt {i}: acceptance lengths differ"
