"""The embedded default target: shipped checkpoint (format, HF parity, quality) and the pretrain code path."""

import dataclasses
import json
import math
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.convert.checkpoint import load_target
from dspark_jax.embedded import corpus, default, pretrain
from dspark_jax.errors import InputError
from dspark_jax.target import qwen3
from dspark_jax.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def shipped():
    d = default.PACKAGED_DIR
    if not default.is_complete(d):
        pytest.fail(f"the packaged default target is missing from {d}")
    cfg, params = load_target(d)
    meta = json.loads((d / pretrain.METADATA_FILE).read_text())
    return d, cfg, params, meta


def test_shipped_layout(shipped):
    d, cfg, params, meta = shipped
    assert default.default_target_dir(build_if_missing=False) == d
    assert (d / "model.safetensors").stat().st_size <= 10 * 1024 * 1024
    tok = load_tokenizer(d)
    assert isinstance(tok, ByteTokenizer) and cfg.vocab_size == tok.vocab_size
    hf = json.loads((d / "config.json").read_text())
    assert hf["eos_token_id"] == tok.eos_token_id and hf["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg.max_position_embeddings >= 1024
    # provenance: the command and seed that produced it, and the held-out files
    assert meta["command"].startswith("python -m dspark_jax.embedded.pretrain")
    assert meta["pretrain_config"]["seed"] == pretrain.PretrainConfig().seed
    held = meta["data"]["heldout_files"]
    assert held and meta["data"]["num_train_files"] > 10 * len(held) // 2
    assert meta["heldout_bits_per_byte"] < 2.5
    # stage 3 (issue 17): well below the 2.349 of the two-stage checkpoint it continued
    assert meta["heldout_bits_per_byte"] < 1.9 and len(meta["previous_stages"]) == 2


def test_shipped_heldout_split_is_reproducible(shipped):
    _, _, _, meta = shipped
    if (meta["data"]["python_version"] != platform.python_version()
            or meta["data"]["stdlib_dir"] != str(corpus.stdlib_dir())):
        pytest.skip("trained on a different Python's standard library")
    train_files, held = corpus.split_files(corpus.stdlib_files(), meta["pretrain_config"]["heldout_fraction"])
    assert held == meta["data"]["heldout_files"] and not set(train_files) & set(held)


def test_shipped_is_a_real_lm_on_heldout_files(shipped):
    """Re-measure bits/byte on held-out stdlib text: far below the 8 bits of a uniform byte guess."""
    _, cfg, params, meta = shipped
    root = corpus.stdlib_dir()
    files = [f for f in meta["data"]["heldout_files"] if (root / f).is_file()][:40]
    if len(files) < 5:
        pytest.skip("held-out files are not in this Python's standard library")
    stream, _ = corpus.build_stream(root, files, ByteTokenizer())
    windows = jnp.asarray(corpus.eval_windows(stream, 4, 256))
    hidden, _, _ = qwen3.forward(params, cfg, windows[:, :-1])
    logits = qwen3.compute_logits(params, hidden)
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, windows[:, 1:, None], -1)
    bits = float(nll.mean()) / math.log(2)
    assert bits < meta["heldout_bits_per_byte"] + 0.6, bits


def test_shipped_matches_transformers(shipped):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, cfg, params, _ = shipped
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    tok = ByteTokenizer.load(d)
    rows = [tok.chat_prompt("def add(a, b):\n    return a + b\n") + list(b"# done"),
            tok.encode("import os\nimport sys\n\nclass Foo(object):\n    '''Doc \u2603.'''\n", add_bos=True)]
    t = min(map(len, rows))
    ids = np.asarray([r[:t] for r in rows], np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).logits.numpy()
    hidden, _, _ = qwen3.forward(params, cfg, jnp.asarray(ids, jnp.int32))
    ours = np.asarray(qwen3.compute_logits(params, hidden))
    assert ours.shape == ref.shape == (2, t, cfg.vocab_size)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)
    assert np.isfinite(ours).all() and ours.std() > 1.0  # a trained model, not near-uniform logits


def test_shipped_continuations_are_not_loops(shipped):
    """Temperature-1 continuations of held-out prompts are text, not whitespace loops (issue 17)."""
    _, cfg, params, meta = shipped
    m = pretrain.measure_continuations(cfg, params, num_prompts=6, max_new_tokens=64,
                                       temperatures=(1.0,), batch_size=6, num_samples=1)
    s = m["by_temperature"]["1"]
    assert m["num_prompts"] == 6 and s["num_outputs"] == 6
    assert s["num_degenerate"] <= 1 and s["whitespace_fraction"] < 0.5, s
    assert len(s["samples"][0]["continuation"]) > 0
    # the shipped metadata records the same measure on all 50 prompts x 96 tokens
    full = meta["continuations"]["by_temperature"]
    assert full["1"]["num_outputs"] == 50 and full["1"]["degenerate_fraction"] < 0.1


def _fake_stdlib(root):
    rng = np.random.default_rng(1)
    words = ["def", "return", "self", "import", "class", "if", "else", "for", "in", "None", "x", "y"]
    for i in range(24):
        sub = root / ("pkg" if i % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        body = "\n".join(" ".join(rng.choice(words, 6)) for _ in range(30))
        (sub / f"mod{i}.py").write_text(f"# module {i} \u00e9\n{body}\n")
    (root / "test").mkdir()
    (root / "test" / "test_skip.py").write_text("excluded = True\n")
    return root


def test_pretrain_smoke(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    files = corpus.stdlib_files(root)
    assert "test/test_skip.py" not in files and "pkg/mod0.py" in files
    pc = pretrain.PretrainConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=64, steps=4, batch_size=2, seq_len=32,
                                 warmup_steps=1, eval_windows=2, eval_every=2, heldout_fraction=0.2,
                                 peak_lr=1e-2)
    out = tmp_path / "target"
    meta = pretrain.run(out, pc, root=root, progress=False)
    assert default.is_complete(out) and not list(tmp_path.glob(".target.tmp-*"))
    assert out.stat().st_mode & 0o777 == 0o755  # readable when shipped as a package asset
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in out.iterdir())
    cfg, params = load_target(out)
    assert cfg.hidden_size == 32 and cfg.vocab_size == 264
    saved = json.loads((out / pretrain.METADATA_FILE).read_text())
    assert saved["data"]["heldout_files"] == meta["data"]["heldout_files"]
    assert set(saved["data"]["heldout_files"]) <= set(files)
    assert [h["step"] for h in saved["history"]] == [2, 4]
    assert 0 < saved["heldout_bits_per_byte"] < 10 and saved["command"].endswith("--seed 0")
    with pytest.raises(InputError, match="already exists"):
        pretrain.run(out, pc, root=root, progress=False)
    # a second stage continues from the first one's weights and records its history
    stage2 = dataclasses.replace(pc, steps=2, seq_len=48, eval_every=2)
    meta2 = pretrain.run(tmp_path / "stage2", stage2, root=root, progress=False, init_from=out)
    assert meta2["previous_stages"][0]["heldout_bits_per_byte"] == saved["heldout_bits_per_byte"]
    assert meta2["heldout_bits_per_byte"] < 8.0  # started from trained weights, not from scratch
    with pytest.raises(InputError, match="model shape"):
        pretrain.run(tmp_path / "bad", dataclasses.replace(pc, hidden_size=64), root=root,
                     progress=False, init_from=out)
    shutil.rmtree(tmp_path / "stage2")
    # --force replaces atomically (the old directory is gone, the new one complete)
    (out / "stale.txt").write_text("old")
    pretrain.save_checkpoint(out, cfg, params, saved, force=True)
    assert default.is_complete(out) and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib", "target"]


def test_sample_batch_chat_rows():
    tok = ByteTokenizer()
    stream = np.concatenate([[tok.bos_token_id], np.frombuffer(b"abcdefgh" * 40, np.uint8), [tok.eos_token_id]])
    rng = np.random.default_rng(0)
    batch = corpus.sample_batch(rng, stream.astype(np.int32), np.array([0]), tok, 8, 32, chat_fraction=1.0)
    assert batch.shape == (8, 33)
    user, end, assistant = (tok.token_to_id(t) for t in ("<|user|>", "<|end|>", "<|assistant|>"))
    for row in batch:
        assert row[0] == tok.bos_token_id and row[1] == user
        assert (row == end).sum() == 1 and (row == assistant).sum() == 1
        assert np.where(row == assistant)[0][0] == np.where(row == end)[0][0] + 1


def test_schedule_progress_and_short_stage():
    pc = pretrain.PretrainConfig(steps=100, warmup_steps=10, peak_lr=1e-3, seq_len=512, batch_size=8,
                                 short_seq_len=128, short_fraction=0.5, max_minutes=1.0)
    assert pc.progress(10, 0.0) == 0.1 and pc.progress(10, 45.0) == 0.75  # the larger of steps and time
    assert pc.progress(100, 0.0) == 1.0 and pc.progress(1, 600.0) == 1.0
    assert pc.learning_rate(5, 0.0) == pytest.approx(5e-4)  # linear warm-up
    assert pc.learning_rate(11, 0.0) == pytest.approx(1e-3)
    assert pc.learning_rate(50, 1.0) == pytest.approx(5e-5)  # cosine down to 5% of the peak
    assert pc.shape_at(0.2) == (32, 128) and pc.shape_at(0.5) == (8, 512)  # same tokens per step
    assert dataclasses.replace(pc, short_fraction=0.0).shape_at(0.0) == (8, 512)
    with pytest.raises(InputError, match="short_seq_len"):
        pretrain.PretrainConfig(seq_len=64, short_fraction=0.5, short_seq_len=128)
    with pytest.raises(InputError, match="max_minutes"):
        pretrain.PretrainConfig(max_minutes=0)
    stages = pretrain.default_stages()
    assert len(stages) == len(pretrain.STAGE_FLAGS) == 3
    assert len({(s.hidden_size, s.num_hidden_layers, s.intermediate_size) for s in stages}) == 1
    last = stages[-1]
    assert last.short_fraction > 0 and last.seq_len >= 512 and last.max_minutes is None
    assert f"--steps {last.steps}" in pretrain.STAGE_FLAGS[-1]


def test_pretrain_time_bound_and_partial_checkpoints(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    pc = pretrain.PretrainConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=64, steps=6, batch_size=2, seq_len=32,
                                 short_seq_len=16, short_fraction=0.5, warmup_steps=1, eval_windows=2,
                                 eval_every=2, heldout_fraction=0.2, peak_lr=1e-2)
    seen = []
    _, _, meta = pretrain.train(pc, root=root, progress=False,
                                on_eval=lambda cfg, params, m: seen.append((m["steps_done"], m["partial"])))
    assert seen == [(2, True), (4, True)]  # after each evaluation but the last
    assert meta["steps_done"] == 6 and meta["steps_per_shape"] == {"4x16": 3, "2x32": 3}
    assert meta["tokens_seen"] == 6 * 64
    # a time budget ends the run early, after the schedule has annealed
    quick = dataclasses.replace(pc, steps=10_000, max_minutes=1e-6)
    _, _, meta = pretrain.train(quick, root=root, progress=False)
    assert meta["steps_done"] == 1 and meta["history"][-1]["step"] == 1
    # run(checkpoints=True) leaves no partial directory behind once the final one is written
    out = tmp_path / "t"
    pretrain.run(out, pc, root=root, progress=False, checkpoints=True)
    assert default.is_complete(out) and not pretrain.partial_dir(out).exists()


def test_split_is_deterministic_and_disjoint():
    files = [f"m{i}.py" for i in range(200)]
    a = corpus.split_files(files, 0.1)
    train, held = a
    r_train, r_held = corpus.split_files(files[::-1], 0.1)  # membership does not depend on order
    assert set(r_train) == set(train) and set(r_held) == set(held)
    assert set(train) | set(held) == set(files) and not set(train) & set(held)
    assert 5 <= len(held) <= 40
    assert corpus.split_files(files, 0.1) == a


def test_pretrain_cli_help_and_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        pretrain.main(["--help"])
    assert info.value.code == 0
    assert "standard library" in capsys.readouterr().out
    assert pretrain.main(["--out", str(tmp_path / "o"), "--seq-len", "4096"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
