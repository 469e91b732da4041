"""Drafter parity with the PyTorch reference fixture (shared/golden/dspark_qwen3_tiny)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax.config import DraftConfig, LossConfig
from dspark_jax.convert import mapping
from dspark_jax.draft import model
from dspark_jax.train import loss as loss_lib


@pytest.fixture(scope="module")
def reference(tiny_dir):
    cfg = DraftConfig.from_hf(json.loads((tiny_dir / "draft" / "config.json").read_text()))
    params = jax.tree.map(jnp.asarray, mapping.draft_from_torch(
        cfg, load_file(str(tiny_dir / "draft" / "model.safetensors"))))
    data = dict(np.load(tiny_dir / "train_forward.npz"))
    fwd = model.training_forward(
        params, cfg, jnp.asarray(data["input_ids"]), jnp.asarray(data["target_hidden_states"]),
        jnp.asarray(data["loss_mask"]), jnp.asarray(data["anchor_positions"]),
        jnp.asarray(data["block_keep_mask"]), jnp.asarray(data["target_last_hidden_states"]))
    return cfg, params, data, fwd


@pytest.mark.parametrize("name", ["draft_logits", "confidence_logits", "aligned_target_logits"])
def test_float_outputs_match(reference, name):
    _, _, data, fwd = reference
    np.testing.assert_allclose(np.asarray(getattr(fwd, name)), data[name], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["target_ids", "eval_mask"])
def test_integer_outputs_match(reference, name):
    _, _, data, fwd = reference
    np.testing.assert_array_equal(np.asarray(getattr(fwd, name)), data[name])


def test_loss_terms_match(reference):
    _, _, data, fwd = reference
    _, terms = loss_lib.dspark_loss(fwd, LossConfig())
    for key in ("ce_loss", "l1_loss", "confidence_loss"):
        np.testing.assert_allclose(float(terms[key]), float(data[key]), rtol=1e-5)
    expected = 0.1 * data["ce_loss"] + 0.9 * data["l1_loss"] + 1.0 * data["confidence_loss"]
    np.testing.assert_allclose(float(terms["loss"]), expected, rtol=1e-5)


def test_fixture_exercises_markov_and_masking(reference):
    """Guard against a vacuous fixture: the Markov bias and the keep mask matter."""
    cfg, params, data, fwd = reference
    no_markov = cfg.replace(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    p = {k: v for k, v in params.items() if k not in ("markov_head", "confidence_head")}
    base = model.training_forward(p, no_markov, jnp.asarray(data["input_ids"]),
                                  jnp.asarray(data["target_hidden_states"]), jnp.asarray(data["loss_mask"]),
                                  jnp.asarray(data["anchor_positions"]), jnp.asarray(data["block_keep_mask"]))
    assert np.abs(np.asarray(base.draft_logits) - data["draft_logits"]).max() > 1e-2
    assert not data["block_keep_mask"].all() and data["eval_mask"].any()


def test_block_attention_sees_only_earlier_context(reference):
    """Changing context rows at/after an anchor must not change that block's logits."""
    cfg, params, data, fwd = reference
    hs = np.array(data["target_hidden_states"])
    anchor = int(data["anchor_positions"][0, 2])
    hs[0, anchor:] += 5.0
    out = model.training_forward(params, cfg, jnp.asarray(data["input_ids"]), jnp.asarray(hs),
                                 jnp.asarray(data["loss_mask"]), jnp.asarray(data["anchor_positions"]),
                                 jnp.asarray(data["block_keep_mask"]))
    a = np.asarray(out.draft_logits)[0]
    b = np.asarray(fwd.draft_logits)[0]
    np.testing.assert_allclose(a[:3], b[:3], atol=1e-5)     # anchors <= this one
    assert np.abs(a[3] - b[3]).max() > 1e-3                  # a later anchor sees the change
