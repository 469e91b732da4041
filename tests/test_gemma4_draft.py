"""Gemma4 DSpark drafter: training forward and loss terms against the reference fixture."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax import params as params_lib
from dspark_jax.config import LossConfig
from dspark_jax.draft import gemma4
from dspark_jax.errors import ConfigError
from dspark_jax.target import gemma4 as target_gemma4
from dspark_jax.train import loss as loss_lib

FIXTURE = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny"


@pytest.fixture(scope="module")
def reference():
    cfg, params = gemma4.load_params(FIXTURE / "draft")
    params = jax.tree.map(jnp.asarray, params)
    data = dict(np.load(FIXTURE / "train_forward.npz"))
    args = [jnp.asarray(data[k]) for k in ("input_ids", "target_hidden_states", "loss_mask", "anchor_positions",
                                           "block_keep_mask", "target_last_hidden_states")]
    fwd = jax.jit(lambda p, *a: gemma4.training_forward(p, cfg, *a))(params, *args)
    return cfg, params, data, fwd


@pytest.mark.parametrize("name", ["draft_logits", "confidence_logits", "aligned_target_logits"])
def test_float_outputs_match(reference, name):
    _, _, data, fwd = reference
    got, ref = np.asarray(getattr(fwd, name)), data[name]
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max()), np.abs(got - ref).max()


@pytest.mark.parametrize("name", ["target_ids", "eval_mask"])
def test_integer_outputs_match(reference, name):
    _, _, data, fwd = reference
    np.testing.assert_array_equal(np.asarray(getattr(fwd, name)), data[name])


def test_loss_terms_match(reference):
    _, _, data, fwd = reference
    _, terms = loss_lib.dspark_loss(fwd, LossConfig())
    for key in ("ce_loss", "l1_loss", "confidence_loss"):
        np.testing.assert_allclose(float(terms[key]), float(data[key]), rtol=1e-4)


def test_fixture_exercises_softcap_and_markov(reference):
    """Guard against a vacuous fixture: the cap bites and the bias is added after it."""
    cfg, params, data, fwd = reference
    assert np.abs(data["aligned_target_logits"]).max() > 15.0          # nonlinear part of tanh * 30
    uncapped = cfg.replace(text=cfg.text.replace(final_logit_softcapping=None))
    args = [jnp.asarray(data[k]) for k in ("input_ids", "target_hidden_states", "loss_mask", "anchor_positions",
                                           "block_keep_mask", "target_last_hidden_states")]
    other = gemma4.training_forward(params, uncapped, *args)
    assert np.abs(np.asarray(other.aligned_target_logits) - data["aligned_target_logits"]).max() > 1.0
    no_markov = cfg.replace(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    p = {k: v for k, v in params.items() if k not in ("markov_head", "confidence_head")}
    base = gemma4.training_forward(p, no_markov, *args)
    bias = np.asarray(fwd.draft_logits) - np.asarray(base.draft_logits)
    assert np.abs(bias).max() > 1e-2 and np.abs(np.asarray(base.draft_logits)).max() <= 30.0
    # the bias sits outside the cap: one bias table row per previous token, whatever h is
    w1, w2 = np.asarray(params["markov_head"]["markov_w1"]), np.asarray(params["markov_head"]["markov_w2"])
    prev = np.concatenate([np.take_along_axis(data["input_ids"], data["anchor_positions"], 1)[..., None],
                           data["target_ids"][..., :-1]], axis=-1)
    np.testing.assert_allclose(bias, w1[prev] @ w2, atol=1e-4)


def test_declaration_matches_checkpoint_and_config_round_trip():
    hf = json.loads((FIXTURE / "draft" / "config.json").read_text())
    cfg = gemma4.Gemma4DraftConfig.from_hf(hf)
    state = load_file(str(FIXTURE / "draft" / "model.safetensors"))
    shapes = params_lib.torch_shapes(gemma4.declare(cfg))
    assert shapes == {k: v.shape for k, v in state.items()}
    assert params_lib.frozen_paths(gemma4.declare(cfg)) == (("embed_tokens",), ("lm_head",), ("layers", "layer_scalar"))
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers) == (32, 1, 2)
    assert gemma4.Gemma4DraftConfig.from_hf(cfg.to_hf()) == cfg
    target = target_gemma4.Gemma4TargetConfig.from_hf(json.loads((FIXTURE / "target" / "config.json").read_text()))
    cfg.check_compatible(target)
    built = gemma4.Gemma4DraftConfig.for_target(target, 2, target_layer_ids=(0, 2, 4), block_size=7,
                                                mask_token_id=511, num_anchors=8, markov_rank=64)
    assert built.replace(target_model_type=cfg.target_model_type).text == cfg.text
    with pytest.raises(ConfigError, match="final decoder layer"):
        gemma4.Gemma4DraftConfig.from_hf({**hf, "target_layer_ids": [0, 5]})
    with pytest.raises(ConfigError, match="Gemma4DSparkModel"):
        gemma4.Gemma4DraftConfig.from_hf({**hf, "architectures": ["Qwen3DSparkModel"]})
    params = gemma4.init_params(cfg, jax.random.PRNGKey(0))
    axes = gemma4.param_axes(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple))


def test_sharded_training_forward_and_family_mismatch(reference):
    from dspark_jax import sharding
    from dspark_jax.config import TargetConfig

    cfg, params, data, fwd = reference
    mesh = sharding.make_mesh("data=1,fsdp=2,tensor=4")
    sharded = sharding.shard_params(params, gemma4.param_axes(cfg), mesh)
    args = [jax.device_put(jnp.asarray(data[k]), sharding.batch_sharding(mesh, data[k].ndim))
            for k in ("input_ids", "target_hidden_states", "loss_mask", "anchor_positions", "block_keep_mask",
                      "target_last_hidden_states")]
    out = jax.jit(lambda p, *a: gemma4.training_forward(p, cfg, *a))(sharded, *args)
    np.testing.assert_allclose(np.asarray(out.draft_logits), np.asarray(fwd.draft_logits), atol=1e-4)
    qwen = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="Gemma4 target"):
        cfg.check_compatible(qwen)


def test_registry_and_convert_round_trip(tmp_path):
    """Both families are registered: convert loads the fixture and writes it back byte-equal."""
    from dspark_jax import families
    from dspark_jax.convert import checkpoint

    for kind, load, save in (("target", checkpoint.load_target, checkpoint.save_target),
                             ("draft", checkpoint.load_draft, checkpoint.save_draft)):
        cfg, params = load(FIXTURE / kind)
        assert families.for_config(cfg).name == {"target": "gemma4", "draft": "gemma4_dspark"}[kind]
        save(tmp_path / kind, cfg, params)
        a, b = load_file(str(FIXTURE / kind / "model.safetensors")), load_file(str(tmp_path / kind / "model.safetensors"))
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a), kind
        assert load(tmp_path / kind)[0] == cfg
    tcfg, _ = checkpoint.load_target(FIXTURE / "target")
    dcfg, _ = checkpoint.load_draft(FIXTURE / "draft")
    families.check_pair(dcfg, tcfg)
    hf = json.loads((FIXTURE / "draft" / "config.json").read_text())
    del hf["architectures"]
    assert families.for_hf(hf).name == "gemma4_dspark"
    del hf["target_layer_ids"]
    assert families.for_hf(hf).name == "gemma4"
    qwen_target = families.by_name("qwen3").config_cls(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="gemma4"):
        families.check_pair(dcfg, qwen_target)
