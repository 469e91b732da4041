"""The decode engine: sharded decoding over a mesh (build_decode) and continuous batching (serve).

Greedy outputs equal tests/fixtures/dspark_qwen3_tiny/decode_greedy.json token for token on
1 device, tensor=2, data=2 x tensor=2 and data=4 x tensor=2 (8 simulated CPU devices from
tests/conftest.py), in static and continuous mode, whatever the slot count and arrival order;
bad meshes / prompts fail before compiling; no recompilation while requests come and go.
"""

import warnings

import numpy as np
import pytest

from dspark_jax.costs.compiles import COMPILES
from dspark_jax.decode import ThresholdPolicy, autoregressive_generate, engine, sharded, speculative_generate
from dspark_jax.errors import ConfigError, InputError

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

def _same(res, ref, acceptance=True):
    for i, r in enumerate(res):
        assert r.output_ids == ref["output_ids"][i], f"request {i}: tokens differ"
        if acceptance:
            assert r.acceptance_lengths == ref["acceptance_lengths"][i], f"request {i}"


@pytest.mark.parametrize("mesh_spec,slots", [(None, 3), ("tensor=2", 2), ("data=2,tensor=2", 4),
                                             ("data=4,tensor=2", 4)])
def test_greedy_identical_on_every_mesh(tiny_reference, mesh_spec, slots):
    tc, tp, dc, dp, ref = tiny_reference
    mesh = sharded.make_decode_mesh(mesh_spec)
    n, r = len(ref["prompts"]), ref["max_new_tokens"]
    _same(speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=r, batch_size=n,
                               mesh=mesh), ref)
    order = list(range(n))[::-1] if slots % 2 == 0 else None
    res = engine.serve(tc, tp, dc, dp, ref["prompts"], max_new_tokens=r, slots=slots, mesh=mesh,
                       order=order)
    _same(res, ref)
    assert all(0 <= x.ttft_s <= x.latency_s and x.tokens_per_second > 0 for x in res)


def test_autoregressive_sharded_and_continuous(tiny_reference):
    tc, tp, dc, dp, ref = tiny_reference
    n, r = len(ref["prompts"]), ref["max_new_tokens"]
    mesh = sharded.make_decode_mesh("data=2,tensor=2")
    _same(autoregressive_generate(tc, tp, ref["prompts"], max_new_tokens=r, batch_size=n,
                                  mesh=mesh), ref, acceptance=False)
    _same(engine.serve(tc, tp, None, None, ref["prompts"], max_new_tokens=r, slots=3), ref,
          acceptance=False)


def test_bad_mesh_and_prompts_fail_before_compiling(tiny_reference):
    tc, tp, dc, dp, ref = tiny_reference
    before = COMPILES[0]
    with pytest.raises(ConfigError, match="needs 16 devices but 8"):
        sharded.make_decode_mesh("data=2,tensor=8")
    mesh3 = sharded.make_decode_mesh("tensor=3")
    with pytest.raises(ConfigError, match="does not divide the target's num_attention_heads"):
        speculative_generate(tc, tp, dc, dp, [[1, 2]], max_new_tokens=4, mesh=mesh3)
    with pytest.raises(ConfigError, match="does not divide"):
        engine.serve(tc, tp, dc, dp, [[1, 2]], max_new_tokens=4, slots=3, mesh=mesh3)
    with pytest.raises(ConfigError, match="not a multiple of the data-parallel size 4"):
        engine.serve(tc, tp, dc, dp, [[1, 2]], max_new_tokens=4, slots=6,
                     mesh=sharded.make_decode_mesh("data=4,tensor=2"))
    with pytest.raises(InputError, match="exceeds the cache capacity"):
        engine.serve(tc, tp, dc, dp, [[1, 2], [1] * 100], max_new_tokens=8, max_cache_len=64)
    with pytest.raises(InputError, match=r"max_new_tokens\[1\]"):
        engine.serve(tc, tp, dc, dp, [[1], [2]], max_new_tokens=[3, 0])
    with pytest.raises(InputError, match="permutation"):
        engine.serve(tc, tp, dc, dp, [[1], [2]], order=[0, 0])
    assert COMPILES[0] == before


def _stream(rng, n, vocab):
    prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]
    budgets = rng.integers(1, 13, size=n).tolist()
    return prompts, budgets


def test_continuous_no_recompilation_and_matches_static(tiny_reference):
    """Warm-up covers the prompt buckets; then streams with other lengths, budgets, stop tokens
    and orders compile nothing, and every request equals its own static greedy decode."""
    tc, tp, dc, dp, _ = tiny_reference
    rng = np.random.default_rng(0)
    kw = dict(slots=4, max_cache_len=64, policy=ThresholdPolicy(0.3))
    warm = [[1] * 10, [2] * 20, [3] * 40]
    engine.serve(tc, tp, dc, dp, warm, max_new_tokens=[12, 1, 5], **kw)
    engine.serve(tc, tp, None, None, warm, max_new_tokens=[12, 1, 5], **kw)
    before = COMPILES[0]
    for seed in (1, 2):
        prompts, budgets = _stream(rng, 11, tc.vocab_size)
        stops = [int(rng.integers(0, tc.vocab_size))]
        order = rng.permutation(len(prompts)).tolist()
        st = {}
        res = engine.serve(tc, tp, dc, dp, prompts, max_new_tokens=budgets, stop_token_ids=stops,
                           order=order, seed=seed, stats=st, **kw)
        ar = engine.serve(tc, tp, None, None, prompts, max_new_tokens=budgets,
                          stop_token_ids=stops, seed=seed, **kw)
        assert st["prefills"] == len(prompts) and st["chunks"] > 2
        for i, r in enumerate(res):
            assert len(r.output_ids) <= budgets[i]
            assert r.output_ids == ar[i].output_ids, f"request {i}: speculative != autoregressive"
    assert COMPILES[0] == before, "recompiled while requests came and went"
    # ... and equal to the static mode (one request per batch: its own budget)
    for i in range(3):
        static = speculative_generate(tc, tp, dc, dp, [prompts[i]], max_new_tokens=budgets[i],
                                      stop_token_ids=stops, max_cache_len=64)
        assert static[0].output_ids == res[i].output_ids


def test_cli_mesh_flag_refuses_too_many_devices(tiny_dir, tmp_path, capsys):
    from dspark_jax.cli import main
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    before = COMPILES[0]
    rc = main(["generate", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"),
               "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"),
               "--mesh", "data=4,tensor=4", "--batching", "continuous"])
    assert rc == 2 and "needs 16 devices" in capsys.readouterr().err
    assert COMPILES[0] == before
