"""Gemma4 training: online and from a feature cache on the tiny fixture pair, the declared-frozen
leaves (layer_scalar) untouched, and family mismatches refused before anything compiles."""


import jax
import numpy as np
import pytest

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.cli import main as cli_main
from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.data.sample import sample_sequences, write_jsonl
from dspark_jax.errors import ConfigError
from dspark_jax.train import optim
from dspark_jax.train.loop import train as _train
from train_tiny import REPO
from train_tiny import tiny_config as _tiny

FIXTURE = REPO / "tests/fixtures/dspark_gemma4_tiny"
QWEN3 = REPO / "tests/fixtures/dspark_qwen3_tiny"
G4 = dict(target=str(FIXTURE / "target"), draft_init=str(FIXTURE / "draft"), draft={}, steps=4,
          batch_size=4, optimizer=dict(learning_rate=3e-3, warmup_ratio=0.0))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    cfg, params = load_target(FIXTURE / "target")
    path = tmp_path_factory.mktemp("g4data") / "seqs.jsonl"
    seqs = sample_sequences(params, cfg, 4, 32, seed=3)
    write_jsonl(path, [s[: 20 + 4 * i] for i, s in enumerate(seqs)])  # ragged 20..32, past the window 16
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, data_file):
    out = tmp_path_factory.mktemp("g4cache") / "feats"
    rc = cli_main(["cache", "--target", str(FIXTURE / "target"), "--data", str(data_file), "--out", str(out),
                   "--layer-ids", "0,2,4", "--max-length", "32", "--batch-size", "4", "--quiet"])
    assert rc == 0
    return out


def test_frozen_leaves_are_the_declarations(tmp_path):
    cfg, params = load_draft(FIXTURE / "draft")
    trainable, frozen = optim.split_params(params, cfg)
    assert set(frozen) == {"embed_tokens", "lm_head", "layers"} and set(frozen["layers"]) == {"layer_scalar"}
    assert "layer_scalar" not in trainable["layers"] and "q_proj" in trainable["layers"]
    flat = lambda t: set(params_lib.traverse_util.flatten_dict(t))
    assert flat(frozen) == set(params_lib.frozen_paths(families.declare(cfg)))
    merged = optim.merge_params(trainable, frozen)
    assert jax.tree.structure(merged) == jax.tree.structure(params)


def test_online_and_cache_training_agree_and_learn(data_file, cache_dir, tmp_path):
    online = _train(_tiny(tmp_path / "on", data=str(data_file), **G4), fast_compile=True)
    cached = _train(_tiny(tmp_path / "ca", features="cache", cache_dir=str(cache_dir), **G4), fast_compile=True)
    a = [r["loss"] for r in online["history"]]
    b = [r["loss"] for r in cached["history"]]
    print("gemma4 online losses", a, "cache losses", b)
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    assert a[-1] < a[0]
    _, init = load_draft(FIXTURE / "draft")
    trained = online["params"]
    np.testing.assert_array_equal(np.asarray(trained["layers"]["layer_scalar"]),
                                  np.asarray(init["layers"]["layer_scalar"]))
    assert not np.array_equal(np.asarray(trained["fc"]), np.asarray(init["fc"]))


@pytest.mark.parametrize("target,draft", [(QWEN3 / "target", FIXTURE / "draft"),
                                          (FIXTURE / "target", QWEN3 / "draft")])
def test_family_mismatch_is_refused_before_compiling(target, draft, tmp_path, monkeypatch):
    from dspark_jax.train import loop
    monkeypatch.setattr(loop, "build_program", lambda *a, **k: pytest.fail("compiled"))
    cfg = _tiny(tmp_path / "x", data=str(tmp_path / "none.jsonl"), **dict(G4, target=str(target),
                                                                          draft_init=str(draft)))
    with pytest.raises(ConfigError, match="drafter family"):
        _train(cfg, fast_compile=True)


def test_fresh_gemma4_drafter_shares_the_targets_embedding(tmp_path):
    """Without draft_init the drafter is the Gemma4 family's, built on the target's shape."""
    from dspark_jax.draft.gemma4 import Gemma4DraftConfig
    from dspark_jax.target import gemma4
    from dspark_jax.train.config import load_config
    from dspark_jax.train.loop import load_drafter
    cfg = load_config(REPO / "configs" / "tiny_gemma4.py")
    tcfg, tparams = load_target(cfg.target)
    dcfg, params = load_drafter(cfg, tcfg, tparams)
    assert isinstance(dcfg, Gemma4DraftConfig) and dcfg.target_layer_ids == (0, 2, 4)
    assert dcfg.head_dim == tcfg.global_head_dim and "v_proj" not in params["layers"]
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(gemma4.lm_head_kernel(tparams)))
    np.testing.assert_array_equal(np.asarray(params["layers"]["layer_scalar"]), 1.0)


def test_family_level_compute_logits_is_one_signature():
    """``families.compute_logits(cfg, params, hidden)`` for every target and drafter family."""
    import jax.numpy as jnp
    from dspark_jax.draft import gemma4 as draft_gemma4
    from dspark_jax.draft import model as draft_model
    from dspark_jax.target import gemma4, qwen3
    h = jnp.linspace(-3.0, 3.0, 2 * 64).reshape(2, 64)
    for path, logits_of in ((QWEN3 / "target", lambda c, p: qwen3.compute_logits(p, h)),
                            (FIXTURE / "target", lambda c, p: gemma4.compute_logits(p, c, h))):
        cfg, params = load_target(path)
        np.testing.assert_array_equal(families.compute_logits(cfg, params, h), logits_of(cfg, params))
    for path, logits_of in ((QWEN3 / "draft", lambda c, p: draft_model.compute_logits(p, h)),
                            (FIXTURE / "draft", lambda c, p: draft_gemma4.compute_logits(p, c, h))):
        cfg, params = load_draft(path)
        np.testing.assert_array_equal(families.compute_logits(cfg, params, h), logits_of(cfg, params))
    assert float(jnp.abs(families.compute_logits(*load_target(FIXTURE / "target"), h * 100)).max()) <= 30.0
