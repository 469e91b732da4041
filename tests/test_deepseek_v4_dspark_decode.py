"""Decoding a DeepSeek-V4 target with its own DSpark module (``mtp.*``) through the engine.

``--draft`` naming a V4 checkpoint reads the module from it (``checkpoint.load_draft`` ->
``dspark_v4.load_drafter``), sharing the target's embedding and head. Greedy speculative decoding
of the fixture pair gives exactly the target's greedy tokens (decode_greedy.json: static batch 1,
all prompts batched, continuously batched on a data=2 x expert=4 mesh); sampling at T = 1 is
lossless (chi-square against the exact joint of a tiny V4 target, full / threshold / scheduler).
The fixture's module is random, so its acceptance is low: the tokens are the target's either way.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_pairs as testing
from dspark_jax.convert import checkpoint
from dspark_jax.decode import FullPolicy, ThresholdPolicy, speculative_generate, summarize
from dspark_jax.decode import scheduler as S, tables
from dspark_jax.draft import deepseek_v4 as dv4
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.target import deepseek_v4 as v4
from test_deepseek_v4 import _small

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"
PAIR = FIX / "target_dspark"


@functools.lru_cache(maxsize=None)
def _golden():
    return json.loads((FIX / "decode_greedy.json").read_text())


@functools.lru_cache(maxsize=None)
def _pair():
    tcfg, tparams = checkpoint.load_target(PAIR)
    dcfg, dparams = checkpoint.load_draft(PAIR, target_params=tparams)
    return tcfg, tparams, dcfg, dparams


def test_draft_read_from_the_target_checkpoint_shares_its_head():
    """``load_draft`` of a V4 checkpoint with the dspark_* keys: the module, with the target's own
    embedding and head arrays when given (no copy), else the same values read from the checkpoint;
    a module-only directory (``save_module``) needs the target's; a mismatched target is refused."""
    tcfg, tparams, dcfg, dparams = _pair()
    assert isinstance(dcfg, dv4.DeepseekV4DSparkConfig) and dcfg.block_size == 5
    assert dparams["embed"] is tparams["embed"] and dparams["head"] is tparams["head"]
    _, own = checkpoint.load_draft(PAIR)
    for k in ("embed", "head", "main_proj"):
        np.testing.assert_array_equal(np.asarray(own[k]), np.asarray(dparams[k]))
    dcfg.check_compatible(tcfg)
    with pytest.raises(ConfigError, match="hidden_size"):
        dcfg.check_compatible(_small())


def test_module_only_directory_needs_the_target(tmp_path):
    from dspark_jax.convert import dspark_v4
    tcfg, tparams, dcfg, dparams = _pair()
    dspark_v4.save_module(tmp_path / "m", dcfg, dparams)
    with pytest.raises(CheckpointError, match="embed.weight"):
        checkpoint.load_draft(tmp_path / "m")
    cfg, p = checkpoint.load_draft(tmp_path / "m", target_params=tparams)
    assert p["head"] is tparams["head"]
    np.testing.assert_array_equal(np.asarray(p["main_norm"]), np.asarray(dparams["main_norm"]))


def test_draft_context_is_a_ring_of_the_window():
    """The decode state's drafter context holds each stage's last W = sliding_window rows once
    (K = V), whatever the cache length: O(W) per row, not O(L)."""
    from dspark_jax.decode import memory, programs
    from dspark_jax.decode.state import DecodeStatic
    tcfg, tparams, dcfg, dparams = _pair()
    static = DecodeStatic(tcfg, dcfg, None, True, 8)
    ctx = programs.abstract_decode_state(tparams, dparams, static, 2, 256, prompt_len=40).ctx
    assert ctx.ring and ctx.v is None and ctx.k.shape == (3, 2, 1, dcfg.window, dcfg.head_dim), ctx
    assert memory.context_bytes_per_row(dcfg, 256, np.float32) == 3 * dcfg.window * dcfg.head_dim * 4


@pytest.mark.slow  # two compiles of the V4 speculative round (~1.5 min each on 2 shared cores)
def test_greedy_speculative_decoding_gives_the_target_tokens(tmp_path):
    """decode_greedy.json token for token: one prompt at a time and the three in one batch (prompts
    of 53..136 tokens, past the drafter's window W = 16: the context ring wraps) with a fourth,
    prompt 2 + its first token (its tokens: prompt 2's from the second on); the rings the rounds
    drafted from (``_check_rings``). Then the export of a trained module into an FP8 / MXFP4 target
    (test_deepseek_v4_dspark_export), loaded back: its tokens are that FP8 target's own (the same
    program as the fixture pair's module on it)."""
    from test_deepseek_v4_dspark_export import export_into_fp8
    ref = _golden()
    tcfg, tparams, dcfg, dparams = _pair()
    assert min(len(p) for p in ref["prompts"]) > dcfg.window
    n = len(ref["output_ids"][0])
    prompts = ref["prompts"] + [ref["prompts"][2] + ref["output_ids"][2][:1]]
    run = functools.partial(speculative_generate, max_new_tokens=n, cache_spans=(256,), max_cache_len=256)
    for batch, ps in ((1, ref["prompts"]), (4, prompts)):
        res = run(tcfg, tparams, dcfg, dparams, ps, batch_size=batch)
        assert [list(r.output_ids) for r in res[:3]] == ref["output_ids"], batch
        assert all(a >= 1 for r in res for a in r.acceptance_lengths)
    assert res[3].output_ids[:n - 1] == ref["output_ids"][2][1:]
    _check_rings(res, ref)
    _, _, dst, _ = export_into_fp8(tmp_path)
    qcfg, qparams = checkpoint.load_target(dst)
    assert qcfg == tcfg   # the model, dequantized: the compiled round is reused
    _, exported = checkpoint.load_draft(dst, target_params=qparams)
    res = run(qcfg, qparams, dcfg, exported, prompts, batch_size=4)
    own = run(qcfg, qparams, dcfg, {**dparams, "embed": qparams["embed"], "head": qparams["head"]}, prompts,
              batch_size=4)
    assert [list(r.output_ids) for r in res] == [list(r.output_ids) for r in own]
    print("fp8 target tokens differ from the float target's at", sum(
        a != b for r, want in zip(res, ref["output_ids"]) for a, b in zip(r.output_ids, want)), "positions")


def _check_rings(res, ref):
    """The rings the rounds drafted from, through each round's first confidence logit
    (proj . [h_0 ; W1[anchor]], h_0 the block against the ring): at round 0 of prompts 0, 1, 2 (the
    prefill's rings of 80-, 53- and 136-token rows in one padded batch) it equals the training
    forward's block at the same anchors over the HF reference's features (forward.npz: prompt 0,
    prompt 2, whose first 53 tokens are prompt 1); at round 1 of prompt 2 (the ring after a round
    of rejected drafts: its committed position written, the rejected ones not) it equals round 0
    of request 3 (prompt 2 + that token, a fresh prefill's ring)."""
    from dspark_jax.draft import model as draft_model
    _, _, dcfg, dparams = _pair()
    fwd = np.load(FIX / "forward.npz")
    lens = [len(p) for p in ref["prompts"]]
    assert [list(fwd["input_ids"][r, :lens[i]]) for r, i in ((0, 0), (1, 1), (1, 2))] == ref["prompts"]
    feats = np.concatenate([fwd["layer_mean"][i] for i in dcfg.target_layer_ids], axis=-1)   # [2, 160, 3H]
    ids = np.array(fwd["input_ids"], np.int32)
    anchors = np.array([[lens[0], lens[0]], [lens[1], lens[2]]], np.int32)
    ids[0, lens[0]], ids[1, lens[1]] = ref["output_ids"][0][0], ref["output_ids"][1][0]   # the anchors
    ids[1, lens[2]] = ref["output_ids"][2][0]
    h = draft_model.training_hidden(dparams, dcfg, jnp.asarray(ids), jnp.asarray(feats), jnp.ones(ids.shape),
                                    jnp.asarray(anchors), jnp.ones((2, 2), bool), compute_dtype=jnp.float32,
                                    ops=dv4.OPS).hidden[:, :, 0]                          # [2, 2, H]
    want = dv4.confidence_logits(dparams, dcfg, h, jnp.asarray(np.take_along_axis(ids, anchors, 1)))
    got = [[res[0].confidence_logits[0][0]] * 2, [res[1].confidence_logits[0][0], res[2].confidence_logits[0][0]]]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3, rtol=1e-3)
    assert res[2].acceptance_lengths[0] == 1   # rejected drafts: positions 137..141 never written
    np.testing.assert_allclose(res[2].confidence_logits[1][0], res[3].confidence_logits[0][0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # an 8-device SPMD compile of the continuous engine's round
def test_generate_command_reads_the_module_and_decodes_on_an_expert_mesh(tmp_path):
    """`dspark-jax generate --target D --draft D`, continuously batched through 2 slots on a
    data=2 x expert=4 mesh of simulated devices: the fixture's (the target's) tokens."""
    from dspark_jax import cli
    ref = _golden()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ref["prompts"]))
    out = tmp_path / "out.jsonl"
    rc = cli.main(["generate", "--target", str(PAIR), "--draft", str(PAIR), "--prompts", str(prompts),
                   "--out", str(out), "--max-new-tokens", str(len(ref["output_ids"][0])), "--batch-size", "2",
                   "--mesh", "data=2,expert=4", "--stop-token-ids", "--max-cache-len", "256"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["output_ids"] for r in rows] == ref["output_ids"]
    assert all(len(r["proposal_lengths"]) == len(r["acceptance_lengths"]) for r in rows)


# ----------------------------------------------------------------------------- losslessness at T = 1

PROMPT = [1, 6, 2, 5]
N_TOKENS = 3
N = 4000  # requests in one batch; the power argument is test_decode_lossless's
SPS = tables.SPSTable((1, N, 3 * N), (1.0, 1.0, 0.4))  # flat to N tokens, then each one costs


@functools.lru_cache(maxsize=None)
def tiny_v4_pair():
    """A vocab-8 V4 target (two sliding-window layers, score-routed MoE) and a one-stage module of
    block 3 reading layer 0; numpy-random params (target weights std 0.3 so its law is far from
    uniform, the module's Markov head strong so the drafter's law differs from the target's)."""
    tcfg = _small(vocab_size=8, num_hidden_layers=2, layer_types=("sliding_attention",) * 2,
                  mlp_layer_types=("moe", "moe"))
    dcfg = dv4.DeepseekV4DSparkConfig(target=tcfg, target_layer_ids=(0,), block_size=3, markov_rank=4,
                                      noise_token_id=7)
    rng = np.random.default_rng(0)

    def draw(decl, std):
        from flax import traverse_util
        out = {}
        for path, s in decl.items():
            base = 1.0 if s.init == "ones" else 0.0
            out[path] = (base + std * rng.standard_normal(s.shape)).astype(np.float32)
        return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(out))

    tparams = draw(v4.declare(tcfg), 0.3)
    decl = {p: s for p, s in dv4.declare(dcfg).items() if p not in (("embed",), ("head",))}
    dparams = dv4.with_target(draw(decl, 0.3), tparams)
    dparams["markov_head"]["markov_w2"] = 2.0 * dparams["markov_head"]["markov_w2"]
    return tcfg, tparams, dcfg, dparams


def _pvalue(policy, seed):
    tc, tp, dc, dp = tiny_v4_pair()
    res = speculative_generate(tc, tp, dc, dp, [PROMPT] * N, max_new_tokens=N_TOKENS, temperature=1.0,
                               policy=policy, batch_size=N, seed=seed)
    out = np.array([r.output_ids for r in res])
    counts = np.zeros((tc.vocab_size,) * N_TOKENS)
    np.add.at(counts, tuple(out.T), 1)
    exact = testing.exact_joint(tc, tp, PROMPT, N_TOKENS, 1.0)
    props = np.concatenate([r.proposal_lengths for r in res])
    return testing.chi_square_pvalue(counts, exact), summarize(res, dc.block_size), props


@pytest.mark.slow  # one compile of the 4000-row V4 round per policy
# full and the scheduler (variable proposal lengths); the threshold policy's verification is the
# same family-independent code, tested lossless on Qwen3 and Gemma4 (test_decode_lossless.py,
# test_engine_lossless.py, test_gemma4_decode_lossless.py)
@pytest.mark.parametrize("name", ["full", "scheduler"])
def test_sampling_at_t1_is_lossless(name):
    policy = {"full": FullPolicy(), "threshold": ThresholdPolicy(0.5),
              "scheduler": S.make_policy("scheduler", SPS)}[name]
    p, s, props = _pvalue(policy, seed=7)
    print(f"{name}: chi-square p={p:.3g} accept_rate={s['accept_rate']} mean_proposal={s['mean_proposal']:.3f}")
    assert p > 1e-4, f"{name}: chi-square p={p:.2e}"
    assert 0.05 < s["accept_rate"][0] < 0.95, s  # drafts were both accepted and rejected
    if name != "full":
        assert len(set(props.tolist())) > 1, "the policy verified only one proposal length"


# ----------------------------------------------------------------------------- eval, calibrate, profile-sps


@pytest.mark.slow  # two compiles of the V4 round (eval's static batch 1, profile-sps' round)
def test_eval_calibrate_and_profile_sps_run_on_the_pair(tmp_path):
    """`eval`, `calibrate` (on eval's logs) and `profile-sps --draft` with the V4 checkpoint as both
    --target and --draft (beside it a word-level tokenizer over the fixture's 512 ids, built here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dspark_jax import cli
    pair = tmp_path / "pair"
    pair.mkdir()
    for name in ("config.json", "model.safetensors"):
        (pair / name).symlink_to((PAIR / name).resolve())
    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", eos_token="w1").save_pretrained(pair)
    data = tmp_path / "data"
    data.mkdir()
    (data / "alpha.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n"
                                              for t in ("w5 w17 w300 w2 w44", "w9 w8 w7")))
    rc = cli.main(["eval", "--target", str(pair), "--draft", str(pair), "--datasets", "alpha",
                   "--data-dir", str(data), "--max-new-tokens", "12", "--batching", "static", "--raw-prompt",
                   "--out", str(tmp_path / "eval"), "--no-progress"])
    assert rc == 0
    s = json.loads((tmp_path / "eval" / "eval.json").read_text())["datasets"]["alpha"]
    assert s["requests"] == 2 and 1.0 <= s["tau"] <= 6 and s["mean_proposal"] == 5
    rc = cli.main(["calibrate", "--logs", str(tmp_path / "eval" / "results" / "alpha.jsonl"),
                   "--out", str(tmp_path / "sts"), "--draft", str(pair)])
    assert rc == 0 and len(json.loads((tmp_path / "sts" / "sts.json").read_text())["temperatures"]) == 5
    rc = cli.main(["profile-sps", "--target", str(pair), "--draft", str(pair), "--batch-sizes", "1",
                   "--widths", "2", "--rounds", "2", "--cache-length", "32", "--warmup", "1", "--iters", "1",
                   "--repeats", "1", "--min-seconds", "0", "--out", str(tmp_path / "sps.json")])
    assert rc == 0
    table = json.loads((tmp_path / "sps.json").read_text())
    print("profile-sps:", table)
