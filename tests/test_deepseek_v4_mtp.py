"""DeepSeek-V4's own MTP-1 module (``mtp.0.*``) as a chain drafter (``draft.deepseek_v4_mtp``).

The fixture checkpoint is ``target/``'s tensors plus the golden module's ``mtp.0.*`` tensors
(``target_mtp/``: the module's shard ``model-mtp.safetensors``, ``target/``'s shard as a relative
link and the index over both, which the README's command decodes; ``write_mtp_checkpoint`` builds
the same two-shard checkpoint with a real file, or with a broken module for the error cases).
Its module logits equal the reference's (``mtp_forward.npz``: transformers' own V4 blocks);
greedy MTP-1 / MTP-3 decoding gives ``mtp_greedy.json``'s drafts, acceptance lengths and tokens
(the target's), static and continuously batched; sampling at T = 1 is lossless (chi-square
against the exact joint of a tiny V4 target); bad input is one line, exit 2.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_pairs as testing
from dspark_jax import cli
from dspark_jax.convert import bounded, checkpoint
from dspark_jax.decode import FixedPolicy, FullPolicy, ThresholdPolicy, speculative_generate, summarize
from dspark_jax.draft import deepseek_v4_mtp as mtp
from dspark_jax.errors import ConfigError
from dspark_jax.target import deepseek_v4 as v4
from test_deepseek_v4 import _small

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"


def write_mtp_checkpoint(d: Path, module_file: Path = FIX / "target_mtp" / "model-mtp.safetensors") -> Path:
    """A V4 checkpoint with an MTP module at ``d``: ``target/``'s shard (hard-linked), the module's
    shard, the index over both and the module's config.json (``compress_ratios`` + 1, 0)."""
    from safetensors import safe_open
    d.mkdir(parents=True)
    shutil.copy(FIX / "target_mtp" / "config.json", d / "config.json")
    os.link(FIX / "target" / "model.safetensors", d / "model-00001-of-00002.safetensors")
    shutil.copy(module_file, d / "model-00002-of-00002.safetensors")
    weights = {}
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with safe_open(str(d / f), "np") as h:
            weights.update({k: f for k in h.keys()})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "target_mtp")


@pytest.fixture(scope="module")
def pair(ckpt):
    tcfg, tparams = checkpoint.load_target(ckpt)
    dcfg, dparams = checkpoint.load_draft(ckpt, target_params=tparams)
    return tcfg, tparams, dcfg, dparams


@functools.lru_cache(maxsize=None)
def _greedy():
    return json.loads((FIX / "mtp_greedy.json").read_text())


# ----------------------------------------------------------------------------- reading, the forward


def test_conversion_round_trip_is_byte_exact_with_the_module(ckpt, tmp_path, capsys):
    """PyTorch -> ours -> PyTorch: the target's tensors and the module's ``mtp.0.*`` (kept aside
    by the target's conversion, ``aside.safetensors``) come back byte for byte under their names;
    the module reads from the source checkpoint as an MTP drafter (``load_draft``); ``inspect``
    says which module a V4 checkpoint holds (either format)."""
    from safetensors import safe_open
    bounded.convert_bounded(ckpt, tmp_path / "jax")
    bounded.convert_bounded(tmp_path / "jax", tmp_path / "torch")

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "np") as h:
                out.update({k: (h.get_tensor(k).dtype.str, h.get_tensor(k).tobytes()) for k in h.keys()})
        return out

    src, back = tensors(ckpt), tensors(tmp_path / "torch")
    for d, module in ((ckpt, "mtp"), (tmp_path / "jax", "mtp"), (FIX / "target_dspark", "dspark"), (FIX / "target", None)):
        assert cli.main(["inspect", str(d), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["drafter_module"] == module, d
    cfg, params = checkpoint.load_draft(ckpt)
    assert isinstance(cfg, mtp.DeepseekV4MTPConfig) and cfg.block_size == 1
    assert params["e_proj"].shape == (64, 64) and params["layers"]["wq_a"].shape[0] == 1
    assert sum(k.startswith("mtp.0.") for k in src) == 53
    assert back == src


def test_module_logits_equal_the_reference(pair):
    """Teacher forcing over forward.npz's first sequence (160 tokens, past the window of 16): the
    module's logits at positions 0..158 equal mtp_forward.npz's (kept embedding at position 0;
    vLLM's zeroed one differs there, inside the window only), its block output y too."""
    tcfg, tparams, dcfg, dparams = pair
    ref = np.load(FIX / "mtp_forward.npz")
    ids = jnp.asarray(ref["input_ids"])[None]
    _, x, _ = jax.jit(lambda p, t: v4.forward(p, tcfg, t, taps=(v4.STREAMS,)))(tparams, ids)
    logits, y, _ = jax.jit(lambda p, h, t: mtp.forward(p, dcfg, h, t))(dparams, x[:, :-1], ids[:, 1:])
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(y[0]).reshape(ref["block_output"].shape), ref["block_output"], atol=1e-4,
                               rtol=0)
    assert np.abs(ref["logits_pos0_zeroed"][:16] - ref["logits"][:16]).max() > 1e-3  # the test can tell them apart


# ----------------------------------------------------------------------------- greedy decoding


@pytest.mark.slow  # compiles of the V4 round with the MTP chain (k = 1 static and continuous, k = 2)
def test_greedy_mtp_gives_the_reference_rounds_and_the_target_tokens(pair):
    """MTP-1, the 3 prompts batched: every round's acceptance length is mtp_greedy.json's (its
    drafts: the next test) and the tokens the target's own (equals_target_greedy); also
    continuously batched through 2 slots; MTP-2 (the module re-applied to its own block output;
    no reference rounds) the target's tokens too (MTP-3: the expert-mesh test)."""
    tcfg, tparams, dcfg, dparams = pair
    ref = _greedy()
    prompts = [r["prompt"] for r in ref["mtp_1"]["rows"]]
    run = functools.partial(speculative_generate, tcfg, tparams, max_new_tokens=24, temperature=0.0,
                            max_cache_len=256)
    want = [r["output_ids"] for r in ref["mtp_1"]["rows"]]
    assert want == [r["output_ids"] for r in ref["mtp_3"]["rows"]]
    res = run(dcfg, dparams, prompts, batch_size=3, batching="static")
    assert [list(r.output_ids) for r in res] == want
    for r, row in zip(res, ref["mtp_1"]["rows"]):
        rounds = [x["acceptance_length"] for x in row["rounds"]]
        got = [int(a) for a in r.acceptance_lengths]
        # the engine may run one more round than the reference (whose output is cut at 24 tokens)
        assert got[:len(rounds)] == rounds and len(got) <= len(rounds) + 1, (str(got), str(rounds))
        assert set(r.proposal_lengths) == {1}, r.proposal_lengths
    res = run(dcfg, dparams, prompts, batch_size=2, batching="continuous")
    assert [list(r.output_ids) for r in res] == want
    res = run(dcfg.replace(num_steps=2), dparams, prompts, batch_size=3, batching="static")
    assert [list(r.output_ids) for r in res] == want


@pytest.mark.slow  # a target forward over 84 contexts and one init + propose program per k
def test_the_chain_proposes_the_reference_drafts(pair):
    """Every round of mtp_greedy.json (MTP-1 and MTP-3), its committed tokens c_0..c_m given:
    the chain kind's ``init`` over positions 0..m-1 (target streams x_s with token s+1) then
    ``propose`` gives the round's drafts (MTP-3: steps 2 and 3 fed the module's own output)."""
    from dspark_jax import runtime
    from dspark_jax.draft import kinds
    tcfg, tparams, dcfg, dparams = pair
    ref = _greedy()
    kind = kinds.proposer(dcfg)
    ctx = runtime.Context(dtype=jnp.float32)
    for k, name in ((1, "mtp_1"), (3, "mtp_3")):
        seqs, lens, want = [], [], []
        for row in ref[name]["rows"]:
            tokens = row["prompt"] + row["output_ids"]
            for rnd in row["rounds"]:
                m = rnd["position"] + 1                       # c_m: the round's anchor
                seqs.append(tokens[:m + 1] + [0] * (161 - m))
                lens.append(m)
                want.append(rnd["drafts"])
        ids = jnp.asarray(np.array(seqs, np.int32))
        _, x, _ = jax.jit(lambda p, t: v4.forward(p, tcfg, t, taps=(v4.STREAMS,)))(tparams, ids[:, :-1])
        cfg = dcfg.replace(num_steps=k)

        @jax.jit
        def drafts(dp, x, ids, lens):
            st = kind.init(dp, cfg, x, ids[:, 1:], lens, 256, ctx=ctx)
            return kind.propose(dp, cfg, st, None, lens, jax.random.PRNGKey(0), 0.0, True, ctx=ctx,
                                spans=(None,), span_index=0)[0]

        got = drafts(dparams, x, ids, jnp.asarray(lens, jnp.int32))
        assert np.asarray(got).tolist() == want, name


@pytest.mark.slow  # an 8-device SPMD compile of the continuous engine's round
def test_generate_command_runs_mtp3_on_an_expert_mesh(ckpt, tmp_path):
    """`dspark-jax generate --target D --draft D --draft-steps 3`, continuously batched through 2
    slots on a data=2 x expert=4 mesh (the module's MoE expert-parallel too): the target's tokens,
    3 drafts verified every round, mtp_greedy.json's MTP-3 acceptance lengths."""
    rows = _greedy()["mtp_3"]["rows"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": r["prompt"]}) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    rc = cli.main(["generate", "--target", str(ckpt), "--draft", str(ckpt), "--draft-steps", "3", "--prompts",
                   str(prompts), "--out", str(out), "--max-new-tokens", "24", "--batch-size", "2",
                   "--mesh", "data=2,expert=4", "--stop-token-ids", "--max-cache-len", "256"])
    assert rc in (0, None)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in rows]
    for g, r in zip(got, rows):
        want = [x["acceptance_length"] for x in r["rounds"]]
        assert g["acceptance_lengths"][:len(want)] == want and set(g["proposal_lengths"]) == {3}


# ----------------------------------------------------------------------------- losslessness at T = 1

PROMPT = [1, 6, 2, 5]
N_TOKENS = 3
N = 4000


@functools.lru_cache(maxsize=None)
def tiny_v4_mtp():
    """A vocab-8 V4 target (two sliding-window layers, score-routed MoE) and a random MTP module of
    2 steps (numpy-random params, std 0.3: the two laws differ, drafts are accepted and rejected)."""
    from flax import traverse_util
    tcfg = _small(vocab_size=8, num_hidden_layers=2, layer_types=("sliding_attention",) * 2,
                  mlp_layer_types=("moe", "moe"))
    dcfg = mtp.DeepseekV4MTPConfig(target=tcfg, num_steps=2)
    rng = np.random.default_rng(0)

    def draw(decl):
        return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(
            {p: ((1.0 if s.init == "ones" else 0.0) + 0.3 * rng.standard_normal(s.shape)).astype(np.float32)
             for p, s in decl.items()}))

    tparams = draw(v4.declare(tcfg))
    dparams = {**draw(mtp.module_specs(dcfg)), **mtp.shared_from_target(tparams)}
    return tcfg, tparams, dcfg, dparams


@pytest.mark.slow  # one compile of the 4000-row V4 round per policy
@pytest.mark.parametrize("name", ["full", "fixed:1"])
def test_sampling_at_t1_is_lossless(name):
    tc, tp, dc, dp = tiny_v4_mtp()
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


# ----------------------------------------------------------------------------- training


@pytest.mark.slow  # compiles the module's gradient; 200 steps
def test_training_raises_mtp1_acceptance(pair):
    """Fine-tuning a fresh module on the frozen fixture target (``chain.teacher_forced_loss``: CE
    at position t on the token after next; here the target's own argmax there, what greedy MTP-1
    is verified against) raises its held-out MTP-1 acceptance over the untrained module; the loss
    from online features (the target inside the step) equals the cached features' one. Trained:
    the block, e_proj / h_proj, the norms and hc_head; frozen: the target, its embed / head (the
    module shares them) and the gate bias (selection only; V4 sets it outside backprop)."""
    import optax
    from dspark_jax import params as params_lib
    from dspark_jax.draft import chain
    from dspark_jax.train.optim import merge_params
    tcfg, tparams, dcfg, _ = pair
    rng = np.random.default_rng(0)
    train, held = (jnp.asarray(rng.integers(2, 512, shape), jnp.int32) for shape in ((512, 18), (64, 18)))
    target = jax.jit(lambda t: v4.forward(tparams, tcfg, t, taps=(v4.STREAMS,)))

    def data(tokens):  # features, and the target's argmax for the token after next
        hidden, x, _ = target(tokens)
        return x, jnp.argmax(v4.compute_logits(tparams, tcfg, hidden[:, 1:-1]), axis=-1)

    (x_train, y_train), (x_held, y_held) = data(train), data(held)
    fresh = mtp.init_params(dcfg, jax.random.PRNGKey(1), embed=tparams["embed"], head=tparams["head"])
    trainable, frozen = params_lib.split_frozen(mtp.declare(dcfg), fresh)
    assert sorted(frozen) == ["embed", "head", "moe"] and "layers" in trainable and "e_proj" in trainable

    def loss(tp, x, tokens, labels):
        total, n = chain.teacher_forced_loss(mtp.MODULE, merge_params(tp, frozen), dcfg, x, tokens,
                                             jnp.ones_like(tokens), labels)
        return total / n

    online = jax.jit(lambda tp, tokens: loss(tp, *data(tokens)[:1], tokens, data(tokens)[1]))
    np.testing.assert_allclose(float(online(trainable, held)), float(loss(trainable, x_held, held, y_held)),
                               rtol=1e-6)
    opt = optax.adam(3e-3)

    @jax.jit
    def step(tp, state, i):
        rows = jax.lax.dynamic_slice_in_dim(jnp.arange(512), (i % 16) * 32, 32)
        value, grads = jax.value_and_grad(loss)(tp, x_train[rows], train[rows], y_train[rows])
        updates, state = opt.update(grads, state, tp)
        return optax.apply_updates(tp, updates), state, value

    def acceptance(tp):
        logits, _, _ = mtp.forward(merge_params(tp, frozen), dcfg, x_held[:, :-2], held[:, 1:-1])
        return float(jnp.mean(jnp.argmax(logits, -1) == y_held))

    before, state, tp = acceptance(trainable), opt.init(trainable), trainable
    for i in range(200):
        tp, state, value = step(tp, state, i)
    after = acceptance(tp)
    print(f"held-out MTP-1 acceptance {before:.3f} -> {after:.3f}, train loss {float(value):.3f}")
    assert after > before + 0.05, (before, after)


# ----------------------------------------------------------------------------- bad input


def test_policies_that_read_confidence_are_refused(pair):
    tcfg, tparams, dcfg, dparams = pair
    with pytest.raises(ConfigError, match="deepseek_v4_mtp drafter has no confidence head"):
        speculative_generate(tcfg, tparams, dcfg, dparams, [[1, 2, 3]], policy=ThresholdPolicy(0.5))


def _bad_module(tmp_path, name, change):
    """The fixture's module shard with ``change(tensors)`` applied, as a whole MTP checkpoint."""
    from safetensors.numpy import load_file, save_file
    t = load_file(str(FIX / "target_mtp" / "model-mtp.safetensors"))
    change(t)
    save_file(t, str(tmp_path / f"{name}.safetensors"))
    return write_mtp_checkpoint(tmp_path / name, tmp_path / f"{name}.safetensors")


def _truncate(d: Path) -> Path:
    f = d / "model-00002-of-00002.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) - 1000])
    return d


@pytest.mark.parametrize("case, match", [
    ("dspark-steps", "only a chain drafter (an MTP module) takes steps"),
    ("no-module", "a DeepSeek-V4 checkpoint without a drafter module"),
    ("mis-shaped", "'mtp.0.e_proj.weight' has shape (64, 32)"),
    ("missing", "missing tensor 'mtp.0.hnorm.weight'"),
    ("truncated", "model-00002-of-00002.safetensors"),
    ("zero-steps", "--draft-steps must be a positive int"),
    ("threshold", "has no confidence head"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, ckpt, case, match):
    """`generate` refuses before compiling, in one line with exit code 2."""
    draft, extra = {
        "dspark-steps": lambda: (FIX / "target_dspark", ["--draft-steps", "2"]),
        "no-module": lambda: (FIX / "target", []),
        "mis-shaped": lambda: (_bad_module(tmp_path, case, lambda t: t.update(
            {"mtp.0.e_proj.weight": np.zeros((64, 32), np.float32)})), []),
        "missing": lambda: (_bad_module(tmp_path, case, lambda t: t.pop("mtp.0.hnorm.weight")), []),
        "truncated": lambda: (_truncate(write_mtp_checkpoint(tmp_path / case)), []),
        "zero-steps": lambda: (ckpt, ["--draft-steps", "0"]),
        "threshold": lambda: (ckpt, ["--verify", "threshold"]),
    }[case]()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    rc = cli.main(["generate", "--target", str(FIX / "target"), "--draft", str(draft), "--prompts", str(prompts),
                   "--out", str(tmp_path / "out.jsonl"), "--max-new-tokens", "2", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and match in err, err
