"""DeepSeek-V4.1's own DSpark module (``mtp.*`` in a V4.1 checkpoint): reading it, one round against
the reference round (``dspark_round.npz``), greedy speculative decoding against ``dspark_greedy*.json``
round by round, and sampling at T = 1 lossless (chi-square against a tiny V4.1 target's exact law).

That the taps are the ATTENTION INPUTS of ``dspark_target_layer_ids`` is checked in
test_deepseek_v41.py (``test_dspark_taps_are_attention_inputs``: it reuses that module's forward).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_pairs as testing
from dspark_jax import families
from dspark_jax.convert import checkpoint
from dspark_jax.decode import FullPolicy, speculative_generate, summarize
from dspark_jax.decode import scheduler as S, tables
from dspark_jax.draft import deepseek_v4 as dv4
from dspark_jax.draft import deepseek_v41 as dv41
from dspark_jax.errors import ConfigError
from dspark_jax.target import deepseek_v41 as v41
from dspark_jax.target.deepseek_v41 import DeepseekV41Config

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

FIX = Path(__file__).parent / "fixtures" / "deepseek_v41_tiny"
PAIR = FIX / "target_dspark"


@functools.lru_cache(maxsize=None)
def _pair(qat: bool = True):
    tcfg, tparams = checkpoint.load_target(PAIR)
    dcfg, dparams = checkpoint.load_draft(PAIR, target_params=tparams)
    if not qat:
        tcfg = dataclasses.replace(tcfg, qat=False)
        dcfg = dataclasses.replace(dcfg, target=tcfg)
    return tcfg, tparams, dcfg, dparams


def test_module_is_read_from_the_target_checkpoint():
    tcfg, tparams, dcfg, dparams = _pair()
    assert isinstance(dcfg, dv41.DeepseekV41DSparkConfig)
    assert dcfg.target_layer_ids == (("attn_in", 5), ("attn_in", 6), ("attn_in", 7))
    assert (dcfg.n_routed_experts, dcfg.num_experts_per_tok, dcfg.markov_rank) == (4, 3, 24)
    assert dparams["embed"] is tparams["embed"] and dparams["head"] is tparams["head"]
    names = {s.torch for s in dv41.module_specs(dcfg).values()}
    assert {"mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight", "mtp.2.norm.weight"} <= names
    assert not any("hc_head" in n for n in names)
    assert dparams["layers"]["experts_w1"].shape == (3, 4, 64, 8)
    families.check_pair(dcfg, tcfg)
    dcfg.check_compatible(tcfg)


def test_v4_module_and_v41_target_do_not_pair():
    """A V4 module on a V4.1 target and the reverse: one-line ConfigErrors before anything runs."""
    tcfg, _, dcfg, _ = _pair()
    v4_target = checkpoint.load_target(Path(__file__).parent / "fixtures" / "deepseek_v4_tiny" / "target")[0]
    v4_module = dv4.DeepseekV4DSparkConfig(target=v4_target, target_layer_ids=(3, 4, 5), markov_rank=16,
                                           noise_token_id=511)
    for module, target in ((v4_module, tcfg), (dcfg, v4_target)):
        with pytest.raises(ConfigError) as e:
            families.check_pair(module, target)
        assert "\n" not in str(e.value)
        with pytest.raises(ConfigError, match="target"):
            module.check_compatible(target)


@functools.partial(jax.jit, static_argnums=(1,))
def _round(dparams, dcfg, taps, block_ids, prev, context):
    """One round from the reference's taps [1, S, 3H]: (main_x, context K = V, h, base logits,
    draft logits, confidence logits); the block sits at position S with the last W rows before it."""
    s, w = taps.shape[1], dcfg.window
    main_x = dv4.project_context(dparams, dcfg, taps)
    k, _ = dv41.context_kv(dparams, dcfg, main_x, jnp.arange(s)[None])
    embeds = dv4.embed_block(dparams, dcfg, block_ids)
    h = dv41.stages_forward(dparams, dcfg, embeds, s + jnp.arange(block_ids.shape[-1])[None, None],
                            k[:, :, 0, s - w:][:, :, None], context)
    logits, conf, _ = dv4.block_heads(dparams, dcfg, h, prev)
    return main_x, k[:, 0, 0, s - w:], h[0, 0], dv4.base_logits(dparams, dcfg, h)[0, 0], logits[0, 0], conf[0, 0]


def test_one_round_equals_the_reference_round():
    """With the quantizers, from the reference's taps: main_x, every stage's context K = V (FP8,
    rotated), the collapsed block hidden (no hc_head), base and Markov-biased logits, confidence."""
    _, _, dcfg, dparams = _pair()
    ref = dict(np.load(FIX / "dspark_round.npz"))
    ids = jnp.asarray(ref["block_ids"][None, None].astype(np.int32))
    prev = jnp.asarray(np.concatenate([ref["block_ids"][:1], ref["drafts"][:-1]])[None, None].astype(np.int32))
    main_x, ctx, h, base, logits, conf = _round(dparams, dcfg, jnp.asarray(ref["taps"][None]), ids, prev,
                                                jnp.ones((1, 1, dcfg.window), bool))
    assert np.asarray(ref["context_positions"]).tolist() == list(range(60 - dcfg.window, 60))
    assert np.abs(np.asarray(main_x)[0] - ref["main_x"]).max() < 1e-4
    for s in range(3):
        assert np.abs(np.asarray(ctx[s]) - ref[f"stage{s}_context_kv"]).max() < 1e-4, s
    for got, want in ((h, "head_hidden"), (base, "base_logits"), (logits, "draft_logits"),
                      (conf, "confidence_logits")):
        assert np.abs(np.asarray(got) - ref[want]).max() < 1e-4, want
    assert np.asarray(logits).argmax(-1).tolist() == ref["drafts"].tolist()


@pytest.mark.slow  # one compile of the V4.1 speculative round per variant (~1.5 min on 2 shared cores)
@pytest.mark.parametrize("variant", ["noqat", "qat"])
def test_greedy_speculative_decoding_equals_the_reference_round_by_round(variant):
    """dspark_greedy{_noqat}.json, the three prompts in one batch: the reference's tokens (the
    target's greedy ones), round for round the same acceptance lengths and accepted drafts, and
    confidence logits within 1e-4. With the quantizers the target's features are chaotic at float
    noise (golden README: prompts 1 and 2's greedy tokens change under a 1e-6 weight perturbation,
    decode_greedy.json ``perturb_1e-6_greedy_unchanged``), so there only the robust prompt 0 is
    held to its tokens and rounds, and its confidence logits to 5e-2 (its taps move by ~0.07)."""
    tcfg, tparams, dcfg, dparams = _pair(qat=variant == "qat")
    ref = json.loads((FIX / f"dspark_greedy{'_noqat' if variant == 'noqat' else ''}.json").read_text())
    rows = ref["rows"]
    res = speculative_generate(tcfg, tparams, dcfg, dparams, [r["prompt"] for r in rows], max_new_tokens=24,
                               cache_spans=(256,), max_cache_len=256, batch_size=3)
    robust = json.loads((FIX / "decode_greedy.json").read_text())["diagnostics"]["perturb_1e-6_greedy_unchanged"]
    checked = 0
    for got, want, ok in zip(res, rows, robust):
        if variant == "qat" and not ok:
            continue
        assert got.output_ids == want["output_ids"]
        rounds = want["rounds"]
        m = min(len(got.acceptance_lengths), len(rounds))
        assert m >= len(rounds) - 1   # the engine may close with one more round (its last token)
        assert got.acceptance_lengths[:m] == [r["acceptance_length"] for r in rounds[:m]]
        assert got.accepted_drafts[:m] == [r["acceptance_length"] - 1 for r in rounds[:m]]
        tokens = [t for r in rounds[:m] for t in r["drafts"][:r["acceptance_length"] - 1]]
        produced = [t for k, r in enumerate(rounds[:m]) for t in got.output_ids[
            1 + sum(x["acceptance_length"] for x in rounds[:k]):][:r["acceptance_length"] - 1]]
        assert produced == tokens   # the accepted drafts are the reference's drafts
        conf = np.asarray(got.confidence_logits[:m])
        want_conf = np.asarray([r["confidence_logits"] for r in rounds[:m]])
        assert np.abs(conf - want_conf).max() < (1e-4 if variant == "noqat" else 5e-2)
        checked += 1
    assert checked == (3 if variant == "noqat" else 1)


# ----------------------------------------------------------------------------- losslessness at T = 1

PROMPT = [1, 6, 2, 5]
N_TOKENS = 3
N = 4000


@functools.lru_cache(maxsize=None)
def tiny_v41_pair():
    """A vocab-8 V4.1 target (a sliding layer, then a ratio-2 CSA2 source) and a one-stage module of
    block 3 reading layer 1's attention input; random params (std 0.3), a strong Markov head."""
    tcfg = DeepseekV41Config(
        vocab_size=8, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2, o_lora_rank=8, compress_ratios=(0, 2),
        kv_source_layer_ids=(1,), index_source_layer_ids=(1,), n_routed_experts=4, num_experts_per_tok=2,
        index_n_heads=2, index_head_dim=16, index_topk=1, sliding_window=4, yarn=(16.0, 256, 32.0, 1.0))
    dcfg = dv41.DeepseekV41DSparkConfig(target=tcfg, tap_layers=(1,), n_routed_experts=4, num_experts_per_tok=2,
                                        block_size=3, markov_rank=4, noise_token_id=7)
    rng = np.random.default_rng(0)

    def draw(decl):
        from flax import traverse_util
        out = {p: ((1.0 if s.init == "ones" else 0.0) + 0.3 * rng.standard_normal(s.shape)).astype(np.float32)
               for p, s in decl.items()}
        return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(out))

    tparams = draw(v41.declare(tcfg))
    dparams = draw({p: s for p, s in dv41.declare(dcfg).items() if p not in (("embed",), ("head",))})
    dparams = {**dparams, "embed": tparams["embed"], "head": tparams["head"]}
    dparams["markov_head"]["markov_w2"] = 2.0 * dparams["markov_head"]["markov_w2"]
    return tcfg, tparams, dcfg, dparams


@pytest.mark.slow  # one compile of the 4000-row V4.1 round per policy
@pytest.mark.parametrize("name", ["full", "scheduler"])
def test_sampling_at_t1_is_lossless(name):
    tc, tp, dc, dp = tiny_v41_pair()
    policy = FullPolicy() if name == "full" else S.make_policy("scheduler", tables.SPSTable((1, N, 3 * N), (1.0, 1.0, 0.4)))
    res = speculative_generate(tc, tp, dc, dp, [PROMPT] * N, max_new_tokens=N_TOKENS, temperature=1.0,
                               policy=policy, batch_size=N, seed=7)
    out = np.array([r.output_ids for r in res])
    counts = np.zeros((tc.vocab_size,) * N_TOKENS)
    np.add.at(counts, tuple(out.T), 1)
    p = testing.chi_square_pvalue(counts, testing.exact_joint(tc, tp, PROMPT, N_TOKENS, 1.0))
    s = summarize(res, dc.block_size)
    assert p > 1e-4, f"{name}: chi-square p={p:.2e}"
    assert 0.05 < s["accept_rate"][0] < 0.95, s


def test_module_written_back_into_the_v41_checkpoint_is_byte_exact(tmp_path):
    """The fixture's module written into the plain target checkpoint (``write_checkpoint``: the
    module's keys into ``text_config``, its tensors beside the target's) gives target_dspark's
    tensors byte for byte and reads back as the same module."""
    from dspark_jax.convert import dspark_v4, safetensors_io
    tcfg, tparams, dcfg, dparams = _pair()
    dspark_v4.write_checkpoint(FIX / "target", tmp_path / "out", dcfg, dparams)
    assert checkpoint.load_draft(tmp_path / "out", target_params=tparams)[0] == dcfg
    a, b = safetensors_io.TensorReader(PAIR), safetensors_io.TensorReader(tmp_path / "out")
    assert sorted(a.infos) == sorted(b.infos)
    assert all(a.get(n).tobytes() == b.get(n).tobytes() for n in a.infos)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["text_config"]["dspark_target_layer_ids"] == [5, 6, 7] and "dspark_block_size" not in hf
