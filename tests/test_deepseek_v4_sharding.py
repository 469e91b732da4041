"""DeepSeek-V4 with expert parallelism: the forward on 8 simulated devices (conftest) equals one device."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dspark_jax import params as params_lib
from dspark_jax import sharding
from dspark_jax.errors import ConfigError
from dspark_jax.target import deepseek_v4 as v4
from dspark_jax.target import qwen3
from dspark_jax.target.deepseek_v4 import moe
from test_deepseek_v4 import _random_params, _small


def test_expert_axis_is_parsed_validated_and_ruled():
    assert sharding.parse_mesh_spec("expert=4,tensor=2") == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 2}
    assert sharding.parse_mesh_spec("data=2") == {"data": 2, "fsdp": 1, "tensor": 1}  # no expert axis
    mesh = sharding.make_mesh("data=2,expert=-1")
    assert mesh.axis_names == sharding.EXPERT_MESH_AXES and mesh.shape["expert"] == 4
    assert sharding.logical_to_spec(("layers", "expert", "embed", "mlp"), mesh=mesh, shape=(2, 8, 4, 4)) == \
        P(None, "expert", "fsdp", "tensor")
    plain = sharding.make_mesh("data=8")
    assert sharding.logical_to_spec(("layers", "expert", "embed", "mlp"), mesh=plain, shape=(2, 8, 4, 4)) == \
        P(None, None, "fsdp", "tensor")
    from dspark_jax.config import TargetConfig
    qcfg = TargetConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match="expert"):
        params_lib.shardings(qwen3.declare(qcfg), sharding.make_mesh("expert=2,data=4"))


@pytest.mark.slow
def test_expert_parallel_forward_equals_one_device(monkeypatch):
    """The one-device forward (dense MoE dispatch, the reference) equals the forward on each mesh
    with the sorted dispatch that real sizes use (forced here; moe.py), expert-parallel under
    shard_map (tests/test_deepseek_v4_moe.py checks both dispatches layer by layer)."""
    cfg = _small(n_routed_experts=8, num_experts_per_tok=3, num_hidden_layers=2,
                 layer_types=("compressed_sparse_attention", "heavily_compressed_attention"),
                 mlp_layer_types=("hash_moe", "moe"))
    params = _random_params(cfg, seed=3)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)

    def run(p, t, mesh=None):
        hidden, _, _ = v4.forward(p, cfg, t, None, ctx=types.SimpleNamespace(mesh=mesh))
        return v4.compute_logits(p, cfg, hidden)

    assert moe.choose(tokens.size, cfg) == moe.DENSE
    one = np.asarray(jax.jit(run)(params, tokens))
    monkeypatch.setattr(moe, "DENSE_MAX", 0)
    specs = v4.declare(cfg)
    for spec in ("expert=4,tensor=2", "expert=8", "data=2,expert=4"):
        mesh = sharding.make_mesh(spec)
        sh = params_lib.shardings(specs, mesh)
        placed = jax.tree.map(jax.device_put, params, sh)
        experts = placed["layers"]["experts_w1"].sharding.spec
        assert experts[1] == "expert", (spec, experts)
        t = jax.device_put(tokens, NamedSharding(mesh, sharding.logical_to_spec(("batch", None), mesh=mesh,
                                                                                  shape=tokens.shape)))
        out = np.asarray(jax.jit(functools.partial(run, mesh=mesh))(placed, t))  # EP constraints in the MoE
        np.testing.assert_allclose(out, one, rtol=0, atol=2e-5 * np.abs(one).max(), err_msg=spec)
