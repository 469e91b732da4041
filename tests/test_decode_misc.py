"""No recompilation, bad input, stop tokens, policies, rejection sampler, CLI end to end."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_pairs as testing
from dspark_jax.cli import main
from dspark_jax.config import DraftConfig
from dspark_jax.costs.compiles import COMPILES
from dspark_jax.decode import (FixedPolicy, FullPolicy, ThresholdPolicy, autoregressive_generate,
                               parse_policy, speculative_generate)
from dspark_jax.decode import programs as decode_programs
from dspark_jax.decode.verify import rejection_sample
from dspark_jax.errors import ConfigError, InputError

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

@pytest.fixture(scope="module")
def pair():
    return testing.tiny_pair(block_size=3)


def test_no_recompilation(pair):
    tc, tp, dc, dp = pair
    rng = np.random.default_rng(0)
    kw = dict(max_new_tokens=6, temperature=1.0, batch_size=4, max_cache_len=32,
              policy=ThresholdPolicy(0.5))

    def prompts(n, lo, hi):
        return [rng.integers(0, 8, size=rng.integers(lo, hi + 1)).tolist() for _ in range(n)]

    for loop in ("device", "host"):
        speculative_generate(tc, tp, dc, dp, prompts(4, 1, 4), seed=0, loop=loop, **kw)  # warm-up
    autoregressive_generate(tc, tp, prompts(4, 1, 4), max_new_tokens=6, batch_size=4, max_cache_len=32)
    before, sizes = COMPILES[0], decode_programs.compile_cache_sizes()
    rounds = set()
    for seed, (n, lo, hi), stops in [(1, (7, 9, 16), [0]), (2, (3, 1, 16), [4, 6]),
                                     (4, (2, 16, 16), [1, 2, 7])]:
        for loop in ("device", "host"):
            res = speculative_generate(tc, tp, dc, dp, prompts(n, lo, hi), seed=seed, loop=loop,
                                       stop_token_ids=stops, **kw)
            rounds.update(len(r.acceptance_lengths) for r in res)
            rounds.update(a for r in res for a in r.acceptance_lengths)
        autoregressive_generate(tc, tp, prompts(n, lo, hi), max_new_tokens=6, batch_size=4,
                                max_cache_len=32, seed=seed, stop_token_ids=stops)
    assert len(rounds) > 3  # really different round counts / accepted lengths / finished rows
    assert decode_programs.compile_cache_sizes() == sizes
    assert COMPILES[0] == before, "recompiled after warm-up"


def test_bad_input_raises_before_compiling(pair, tiny_reference):
    tc, tp, dc, dp = pair
    before = COMPILES[0]
    gen = lambda prompts, **kw: speculative_generate(tc, tp, dc, dp, prompts, max_new_tokens=4, **kw)
    with pytest.raises(InputError, match="prompt 1 is empty"):
        gen([[1, 2], []])
    with pytest.raises(InputError, match="token id 8 .*vocabulary"):
        gen([[1, 8]])
    with pytest.raises(InputError, match="token id -1"):
        gen([[-1]])
    with pytest.raises(InputError, match="exceeds the cache capacity"):
        gen([[1] * 60])
    with pytest.raises(InputError, match="max_cache_len"):
        gen([[1] * 20], max_cache_len=24)
    with pytest.raises(InputError, match="stop token id"):
        gen([[1]], stop_token_ids=[99])
    with pytest.raises(InputError, match="confidence_temperatures"):
        gen([[1]], confidence_temperatures=[1.0])
    with pytest.raises(InputError, match="max_new_tokens"):
        speculative_generate(tc, tp, dc, dp, [[1]], max_new_tokens=0)
    ftc, ftp, fdc, fdp, _ = tiny_reference
    with pytest.raises(ConfigError, match="vocab_size"):
        speculative_generate(ftc, ftp, dc, dp, [[1]], max_new_tokens=4)
    with pytest.raises(ConfigError, match="hidden_size"):
        speculative_generate(tc, tp, dc.replace(hidden_size=32), dp, [[1]], max_new_tokens=4)
    bad_layers = DraftConfig.for_target(ftc, num_hidden_layers=2, target_layer_ids=(0, 2, 4),
                                        num_target_layers=8, block_size=7, mask_token_id=511)
    with pytest.raises(ConfigError, match="do not fit"):
        speculative_generate(ftc, ftp, bad_layers, fdp, [[1]], max_new_tokens=4)
    with pytest.raises(InputError, match="empty"):
        autoregressive_generate(tc, tp, [[]], max_new_tokens=4)
    assert COMPILES[0] == before


def test_stop_tokens_match_reference_prefix(tiny_reference):
    """Every prompt (one batch of 8, sharing the parity test's compilation) stops at the first
    occurrence of a token that first appears mid-stream (maybe among accepted drafts)."""
    tc, tp, dc, dp, ref = tiny_reference
    n = len(ref["prompts"])
    stopped = 0
    for stop in (ref["output_ids"][0][5], ref["output_ids"][0][20]):
        res = speculative_generate(tc, tp, dc, dp, ref["prompts"], max_new_tokens=48,
                                   stop_token_ids=[stop], batch_size=n)
        for i, r in enumerate(res):
            ref_out, ref_acc = ref["output_ids"][i], ref["acceptance_lengths"][i]
            if stop not in ref_out:
                assert r.output_ids == ref_out and r.acceptance_lengths == ref_acc
                continue
            stopped += 1
            cut = ref_out.index(stop)
            assert r.output_ids == ref_out[:cut + 1]
            k = len(r.acceptance_lengths)
            assert r.acceptance_lengths[:-1] == ref_acc[:k - 1]
            assert 1 + sum(r.acceptance_lengths) == cut + 1
    assert stopped >= 2
    stop = ref["output_ids"][0][20]
    ar = autoregressive_generate(tc, tp, ref["prompts"], max_new_tokens=48, stop_token_ids=[stop],
                                 batch_size=n)
    for i, r in enumerate(ar):
        ref_out = ref["output_ids"][i]
        assert r.output_ids == (ref_out[:ref_out.index(stop) + 1] if stop in ref_out else ref_out)


def test_autoregressive_greedy_matches_reference(tiny_reference):
    tc, tp, dc, dp, ref = tiny_reference
    res = autoregressive_generate(tc, tp, ref["prompts"], max_new_tokens=ref["max_new_tokens"],
                                  batch_size=8)
    assert [r.output_ids for r in res] == ref["output_ids"]


def test_policies():
    c = jnp.array([[0.9, 0.8, 0.3, 0.9], [0.2, 0.9, 0.9, 0.9], [0.95, 0.95, 0.95, 0.95]])
    active = jnp.ones((3,), bool)
    assert ThresholdPolicy(0.5)((), c, active)[0].tolist() == [2, 0, 4]
    assert ThresholdPolicy(0.0)((), c, active)[0].tolist() == [4, 4, 4]
    assert FullPolicy()((), c, active)[0].tolist() == [4, 4, 4]
    assert FixedPolicy(2)((), c, active)[0].tolist() == [2, 2, 2]
    assert FixedPolicy(9)((), c, active)[0].tolist() == [4, 4, 4]
    assert parse_policy("full") == FullPolicy()
    assert parse_policy("threshold", confidence_threshold=0.7) == ThresholdPolicy(0.7)
    assert parse_policy("threshold:0.3") == ThresholdPolicy(0.3)
    assert parse_policy("fixed:3") == FixedPolicy(3)
    hash(parse_policy("fixed:3"))
    for bad in ("fixed:x", "nope", "threshold:2"):
        with pytest.raises(ConfigError):
            parse_policy(bad)


def test_rejection_sampler_rows_are_independent_and_ragged():
    """Greedy verdicts on a hand-made block: row lengths, stop tokens, bonus and replacement."""
    v, g = 6, 3
    tl = jnp.full((3, g + 1, v), -5.0)
    target_argmax = jnp.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 5, 3, 4]])
    tl = tl.at[jnp.arange(3)[:, None], jnp.arange(g + 1)[None], target_argmax].set(5.0)
    drafts = jnp.array([[1, 2, 0], [1, 2, 3], [1, 2, 3]])
    lengths = jnp.array([3, 1, 3])
    stop = jnp.array([5, -1])
    sample = jax.jit(rejection_sample, static_argnums=(6,))  # one compile, not op-by-op dispatch
    out = sample(jax.random.PRNGKey(0), tl, jnp.zeros((3, g, v)), drafts, lengths, 1.0, True, stop)
    assert out.accepted.tolist() == [2, 1, 1]      # mismatch at 2; own length 1; mismatch at 1
    assert out.next_token.tolist() == [3, 2, 5]    # replacement, bonus at l=1, replacement
    stop_out = sample(jax.random.PRNGKey(0), tl, jnp.zeros((3, g, v)), drafts, lengths, 1.0, True,
                      jnp.array([2, -1]))
    assert stop_out.stopped.tolist() == [True, False, False]
    assert stop_out.accepted.tolist() == [2, 1, 1] and stop_out.proposal_length.tolist() == [2, 1, 3]


def test_cli_generate_end_to_end(tiny_dir, tmp_path, capsys):
    ref = json.loads((tiny_dir / "decode_greedy.json").read_text())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n"
                               for i, p in enumerate(ref["prompts"])))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"),
            "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "48",
            "--batch-size", "8", "--stop-token-ids"]  # batch 8: the parity test's compilation
    assert main(argv) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == list(range(len(ref["prompts"])))
    for i, x in enumerate(lines):
        assert x["output_ids"] == ref["output_ids"][i]
        assert x["acceptance_lengths"] == ref["acceptance_lengths"][i]
        assert x["proposal_lengths"] == ref["proposal_lengths"][i]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tau"] > 1 and len(summary["accept_rate"]) == 7
    assert main(argv) == 2                           # exists, no --force
    assert "exists" in capsys.readouterr().err
    prompts.write_text(json.dumps({"text": "hello"}) + "\n")
    assert main(argv + ["--force"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    prompts.write_text(json.dumps({"prompt_ids": [1, 999]}) + "\n")
    assert main(argv + ["--force"]) == 2
    assert "vocabulary" in capsys.readouterr().err


def test_cli_generate_applies_saved_sts_temperatures(tiny_reference, tiny_dir, tmp_path, capsys):
    """A drafter saved with extras {"sts_temperatures": [...]} gets them; the flag overrides."""
    from dspark_jax.convert.checkpoint import save_draft

    tc, tp, dc, dp, ref = tiny_reference
    g = dc.block_size
    draft = save_draft(tmp_path / "draft", dc, dp, format="jax",
                       extras={"sts_temperatures": [1e-3] * g})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ref["prompts"]))

    def run(name, *extra):
        out = tmp_path / name
        assert main(["generate", "--target", str(tiny_dir / "target"), "--draft", str(draft),
                     "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "48",
                     "--batch-size", "8", "--stop-token-ids", "--verify", "threshold",
                     "--confidence-threshold", "0.9", *extra]) == 0
        return [json.loads(x) for x in out.read_text().splitlines()]

    def expected(line, cut):  # longest prefix with every raw logit >= cut (not stopped early)
        return [int(np.sum(np.cumprod(np.asarray(c) >= cut))) for c in line["confidence_logits"]]

    saved = run("saved.jsonl")
    assert "extras" in capsys.readouterr().err
    flag = run("flag.jsonl", "--confidence-temperatures", *["1"] * g)
    differ = 0
    for i, (a, b) in enumerate(zip(saved, flag)):
        assert a["output_ids"] == b["output_ids"] == ref["output_ids"][i]   # greedy: lossless
        assert a["proposal_lengths"] == expected(a, 0.0)                    # sigmoid(x / 1e-3) >= 0.9
        assert b["proposal_lengths"] == expected(b, float(np.log(0.9 / 0.1)))  # sigmoid(x) >= 0.9
        differ += a["proposal_lengths"] != b["proposal_lengths"]
    assert differ > 0
