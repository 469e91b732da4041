"""Sharded forward passes on 8 simulated CPU devices equal the unsharded result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dspark_jax import sharding
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.errors import ConfigError
from dspark_jax.draft import model as draft_model
from dspark_jax.target import qwen3
from dspark_jax.train import batch as batch_lib

TARGET = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=8, rope_theta=1e4)
DRAFT = DraftConfig.for_target(TARGET, num_hidden_layers=2, target_layer_ids=(0, 2), block_size=4,
                               mask_token_id=127, num_anchors=6, markov_rank=16, markov_head_type="rnn")
MESHES = ["data=8", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2", "data=4,tensor=2"]


def test_rules_map_logical_axes():
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
    assert sharding.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert sharding.logical_to_spec(("layers", "embed", "mlp")) == P(None, "fsdp", "tensor")
    # an axis that does not divide the mesh axis falls back to replication
    assert sharding.logical_to_spec(("embed", "mlp"), shape=(6, 3), mesh=mesh) == P("fsdp", None)
    with pytest.raises(ConfigError, match="needs 16 devices"):
        sharding.make_mesh("data=4,fsdp=4")
    with pytest.raises(ConfigError, match="unknown mesh axes"):
        sharding.make_mesh("pipeline=2")
    assert sharding.make_mesh("tensor=2,data=-1").shape == {"data": 4, "fsdp": 1, "tensor": 2}


@pytest.fixture(scope="module")
def setup():
    assert jax.device_count() >= 8, "tests/conftest.py should provide 8 CPU devices"
    rng = jax.random.PRNGKey(0)
    tparams = qwen3.init_params(TARGET, rng)
    dparams = draft_model.init_params(DRAFT, jax.random.PRNGKey(1))
    ids = jax.random.randint(jax.random.PRNGKey(2), (8, 24), 0, TARGET.vocab_size)
    loss_mask = jnp.ones((8, 24)).at[:, :5].set(0)
    anchors, keep = batch_lib.sample_anchors(jax.random.PRNGKey(3), loss_mask, DRAFT.num_anchors)
    return tparams, dparams, ids, loss_mask, anchors, keep


def run(tparams, dparams, ids, loss_mask, anchors, keep):
    hidden, taps, _ = qwen3.forward(tparams, TARGET, ids, tap_layer_ids=DRAFT.target_layer_ids)
    fwd = draft_model.training_forward(dparams, DRAFT, ids, taps, loss_mask, anchors, keep, hidden)
    return qwen3.compute_logits(tparams, hidden), fwd.draft_logits, fwd.confidence_logits


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_sharded_equals_unsharded(setup, mesh_spec):
    tparams, dparams, ids, loss_mask, anchors, keep = setup
    expected = jax.jit(run)(*setup)
    mesh = sharding.make_mesh(mesh_spec)
    tp = sharding.shard_params(tparams, qwen3.param_axes(TARGET), mesh)
    dp = sharding.shard_params(dparams, draft_model.param_axes(DRAFT), mesh)
    data = [jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)) for x in (ids, loss_mask, anchors, keep)]
    # Really sharded: the batch is split, and with fsdp/tensor axes so is some weight.
    assert not data[0].sharding.is_fully_replicated
    if mesh.shape["fsdp"] * mesh.shape["tensor"] > 1:
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(dp))
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(tp))
    got = jax.jit(run)(tp, dp, *data)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=2e-5, rtol=0)
