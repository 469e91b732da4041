"""Eagle3 drafters in DeepSpec's format (fixtures eagle3_{qwen3,gemma4}_tiny from shared/golden):
the TTT training forward against DeepSpec's ``compute_eagle3_loss``, conversion both ways,
``inspect``, and bad input refused in one line."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES
from dspark_jax import cli
from dspark_jax.convert import checkpoint
from dspark_jax.draft.eagle3 import model, ttt
from dspark_jax.errors import ConfigError

FAMILIES = ("qwen3", "gemma4")


def fixture(fam):
    return FIXTURES / f"eagle3_{fam}_tiny"


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request):
    """(family, draft config, draft params, train_forward.npz as a dict)."""
    cfg, params = checkpoint.load_draft(fixture(request.param) / "draft")
    with np.load(fixture(request.param) / "train_forward.npz") as z:
        return request.param, cfg, params, dict(z)


def test_train_forward_matches_deepspec(reference):
    fam, cfg, p, z = reference
    ids, feats = jnp.asarray(z["input_ids"], jnp.int32), jnp.asarray(z["target_hidden_states"])
    lens = jnp.asarray(z["attention_mask"].sum(1), jnp.int32)
    def both(p, ids, feats, last, mask, lens):  # one compiled program: the forward and the loss
        hidden = ttt.ttt_hidden(p, cfg, ids, feats, lens)
        return (ttt.TTTForward(model.logits(p, cfg, hidden), hidden),
                ttt.hidden_sums(p, cfg, hidden, last, mask, lens))
    out, sums = jax.jit(both)(p, ids, feats, jnp.asarray(z["target_last_hidden_states"]),
                              jnp.asarray(z["loss_mask"]), lens)
    assert np.abs(np.asarray(out.logits) - z["draft_logits"]).max() < 1e-4
    # the hidden state each step hands the next (Gemma4's final-norm weights ~12 amplify f32 noise)
    assert np.abs(np.asarray(out.hidden) - z["draft_hidden_states"]).max() < (1e-4 if fam == "qwen3" else 3e-4)
    np.testing.assert_array_equal(np.asarray(ttt.position_masks(jnp.asarray(z["loss_mask"]), lens, 7)),
                                  z["position_mask"])
    loss, m = ttt.finalize(sums, float(z["loss_normalizer"]))
    assert abs(float(loss) - float(z["loss"])) < 1e-4
    per = lambda key: np.array([float(m[f"{key}@{k}"]) for k in range(7)])
    np.testing.assert_allclose(per("step_loss"), z["step_loss"], atol=1e-4)
    np.testing.assert_allclose(per("accuracy"), z["accuracy"], atol=1e-6)
    np.testing.assert_allclose(per("accept_rate"), z["accept_rate"], atol=1e-4)
    np.testing.assert_allclose(np.asarray(sums["valid"]), z["valid_tokens"])
    assert abs(float(m["tau_greedy"]) - float(z["tau_greedy"])) < 1e-5
    assert abs(float(m["tau_probabilistic"]) - float(z["tau_probabilistic"])) < 1e-4


@pytest.mark.parametrize("fam", FAMILIES)
def test_convert_round_trip_bit_exact(fam, tmp_path, capsys):
    src = fixture(fam) / "draft"
    assert cli.main(["convert", str(src), str(tmp_path / "jax")]) == 0
    assert cli.main(["convert", str(tmp_path / "jax"), str(tmp_path / "pt")]) == 0
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "pt" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k
    h1, h2 = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "pt"))
    assert {k: h1[k] for k in h1 if k != "transformers_version"} == \
        {k: h2[k] for k in h1 if k != "transformers_version"}


def test_inspect_names_the_kind_and_refuses_eagle_format_engines(capsys):
    assert cli.main(["inspect", str(fixture("qwen3") / "draft")]) == 0
    out = capsys.readouterr().out
    assert "eagle3 drafter, family qwen3 (Qwen3Eagle3Model)" in out and "ttt_length 7" in out
    assert "deepspec    loadable" in out
    assert "vllm        NOT loadable" in out and "q/k norms" in out and "full 512-token vocabulary" in out


@pytest.mark.parametrize("field,value,expected", [
    ("ttt_length", 0, "ttt_length must be an int >= 1"),
    ("target_layer_ids", [0, 1, 2, 3, 9], "target_layer_ids [9] do not exist"),
    ("target_layer_ids", [0, 1, 2, 3], "exactly 5 target layers"),
])
def test_bad_config_one_line_exit_2(field, value, expected, tmp_path, capsys):
    d = tmp_path / "draft"
    shutil.copytree(fixture("qwen3") / "draft", d)
    hf = json.loads((d / "config.json").read_text())
    hf[field] = value
    (d / "config.json").write_text(json.dumps(hf))
    capsys.readouterr()
    assert cli.main(["inspect", str(d)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and expected in err[0], err


def test_drafter_for_another_target_refused():
    from dspark_jax.config import TargetConfig
    cfg, _ = checkpoint.load_draft(fixture("qwen3") / "draft")
    wider = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="hidden_size 64 != target 128"):
        cfg.check_compatible(wider)
    with pytest.raises(ConfigError, match="tappable layers of a 4-layer target"):
        cfg.check_compatible(wider.__class__(**{**wider.__dict__, "hidden_size": 64, "num_hidden_layers": 4}))


def _train_config(tmp_path, **fields) -> str:
    (tmp_path / "d.jsonl").write_text('{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}\n')
    base = dict(target=str(fixture("qwen3") / "target"), data=str(tmp_path / "d.jsonl"),
                output_dir=str(tmp_path / "run"), max_length=8, batch_size=1, steps=1, num_devices=1, mesh="data=1")
    (tmp_path / "c.py").write_text(f"CONFIG = {dict(base, **fields)!r}\n")
    return str(tmp_path / "c.py")


@pytest.mark.parametrize("fields,expected", [
    (dict(draft_init=str(fixture("qwen3") / "draft"), target=str(FIXTURES.parent.parent / "dspark_jax/assets/default_target")),
     "Eagle3 drafter and target do not fit together: vocab_size 512 != target 264; hidden_size 64 != target 128"),
    (dict(draft=dict(kind="eagle3", ttt_length=0)), "ttt_length must be an int >= 1, got 0"),
    (dict(draft=dict(kind="eagle3", target_layer_ids=(0, 1, 2, 3, 5))), "target_layer_ids [5] do not exist"),
    (dict(draft=dict(kind="eagle3"), target=str(FIXTURES.parent.parent / "dspark_jax/assets/default_target")),
     "a 4-layer target has only 3 tappable"),
    (dict(draft=dict(kind="medusa")), "no registered 'medusa' drafter family reads 'qwen3' targets"),
])
def test_train_refuses_bad_eagle3_in_one_line(fields, expected, tmp_path, capsys):
    config = _train_config(tmp_path, **fields)
    capsys.readouterr()
    assert cli.main(["train", "--config", config]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("target,extra,expected", [
    (FIXTURES.parent.parent / "dspark_jax/assets/default_target", [],
     "Eagle3 drafter and target do not fit together: vocab_size 512 != target 264"),
    (fixture("qwen3") / "target", ["--verify", "threshold"], "the qwen3_eagle3 drafter has no confidence head"),
    (fixture("qwen3") / "target", ["--draft-steps", "0"], "--draft-steps must be a positive int"),
])
def test_generate_refuses_in_one_line(target, extra, expected, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    argv = ["generate", "--target", str(target), "--draft", str(fixture("qwen3") / "draft"),
            "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"), *extra]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("name,target,taps", [
    ("eagle3_qwen3_4b", "Qwen/Qwen3-4B", (1, 9, 17, 25, 33)), ("eagle3_qwen3_8b", "Qwen/Qwen3-8B", (1, 9, 17, 25, 33)),
    ("eagle3_qwen3_14b", "Qwen/Qwen3-14B", (1, 10, 19, 28, 37)),
    ("eagle3_gemma4_12b", "google/gemma-4-12B-it", (5, 17, 29, 41, 46))])
def test_released_configs_build_the_deepspec_shape(name, target, taps):
    from dspark_jax import families, presets
    from dspark_jax.train.config import load_config
    cfg = load_config(FIXTURES.parent.parent / "configs" / f"{name}.py")
    draft = cfg.draft_config(presets.TARGETS[target])
    assert families.for_config(draft).name.endswith("_eagle3")
    assert draft.target_layer_ids == taps and draft.ttt_length == 7 and draft.step_loss_decay == 0.8
    decl = families.declare(draft)
    h = draft.hidden_size
    assert decl[("fc",)].shape == (5 * h, h) and decl[("layers", "q_proj")].shape[:2] == (1, 2 * h)
    assert {p for p, s in decl.items() if s.frozen} >= {("embed_tokens",), ("lm_head",)}
