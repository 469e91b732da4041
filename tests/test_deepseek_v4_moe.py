"""DeepSeek-V4 MoE dispatch: the sorted (sparse) dispatch equals the dense reference, with hash and
score routing, in float32 and bfloat16, on one device and expert-parallel on 8 simulated devices."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dspark_jax import presets, sharding
from dspark_jax.target.deepseek_v4 import model, moe
from test_deepseek_v4 import _random_params, _rel, _small

W = ("experts_w1", "experts_w3", "experts_w2")
W_AXES = {"experts_w1": ("expert", "embed", "mlp"), "experts_w3": ("expert", "embed", "mlp"),
          "experts_w2": ("expert", "mlp", "embed")}


def _layer(routing: str, dtype, experts=8, k=3, tokens=(2, 24), seed=0):
    """(cfg, expert weights, x [B,S,H], combine [B,S,E]) of one MoE layer of a small random model."""
    cfg = _small(n_routed_experts=experts, num_experts_per_tok=k)
    p = _random_params(cfg, seed)
    lp = jax.tree.map(lambda a: a[1], p["layers"])
    rng = np.random.default_rng(seed + 1)
    x = jnp.asarray(rng.standard_normal((*tokens, cfg.hidden_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, tokens), jnp.int32)
    if routing == "hash":  # tid2eid rows may repeat an expert: a summed weight, as in dense
        table = jnp.asarray(rng.integers(0, experts, (cfg.vocab_size, k)), jnp.int32).at[0].set(1)
        combine = model.route(cfg, lp, x, ids.at[0, :4].set(0), table, None)
    else:
        combine = model.route(cfg, lp, x, ids, None, p["moe"]["bias"][0])
    return cfg, [lp[w].astype(dtype) for w in W], x.astype(dtype), combine


def _close(out, ref, dtype):
    tol = 2e-6 if dtype == jnp.float32 else 3e-2  # bfloat16: another summation order
    assert _rel(out, np.asarray(ref, np.float32)) < tol


@pytest.mark.parametrize("routing", ["hash", "score"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sorted_dispatch_equals_dense(routing, dtype):
    cfg, ws, x, combine = _layer(routing, dtype)
    ref = jax.jit(functools.partial(moe.dense, cfg))(x, combine, *ws)
    variants = (("blocks", None), ("blocks", 8), ("ragged", None)) if dtype == jnp.float32 else (("blocks", None),)
    for impl, block in variants:
        out = jax.jit(functools.partial(moe.sorted_dispatch, cfg, impl=impl, block=block))(x, combine, *ws)
        assert out.dtype == ref.dtype
        _close(out, ref, dtype)


def test_blocks_cover_skewed_and_empty_experts():
    """Every token on the same k experts (all others empty): one expert spans many blocks."""
    cfg, ws, x, _ = _layer("score", jnp.float32, experts=16, k=2)
    combine = jnp.zeros((*x.shape[:2], 16)).at[..., 5].set(0.7).at[..., 11].set(0.8)
    ref = moe.dense(cfg, x, combine, *ws)
    for block in (8, 16):
        _close(moe.sorted_dispatch(cfg, x, combine, *ws, impl="blocks", block=block), ref, jnp.float32)


def test_dispatch_is_chosen_by_size():
    tiny = _small(n_routed_experts=8, num_experts_per_tok=3)
    flash = presets.TARGETS[presets.V4_FLASH]
    assert moe.choose(48, tiny) == moe.DENSE
    assert moe.choose(4096, flash) == moe.SORTED and moe.choose(8, flash) == moe.SORTED
    assert moe.choose(4096, _small(n_routed_experts=4, num_experts_per_tok=4)) == moe.DENSE  # k == E
    assert moe.block_rows(4096 * 6, 256) == 128 and moe.block_rows(8 * 6, 256) == 8
    cfg, ws, x, combine = _layer("score", jnp.float32)
    with pytest.raises(ValueError, match="dispatch"):
        moe.routed(cfg, x, combine, *ws, dispatch="capacity")


MESHES = ("expert=4,tensor=2", "expert=8", "data=2,expert=4", "fsdp=2,expert=2,tensor=2")


def test_expert_parallel_dispatch_equals_one_device():
    """Both dispatches under shard_map / sharding constraints on 8 simulated devices (the expert
    weights placed by their declared axes) equal the one-device dense output."""
    cfg, ws, x, combine = _layer("score", jnp.float32, tokens=(4, 12))
    ref = np.asarray(moe.dense(cfg, x, combine, *ws))
    for spec in MESHES:
        mesh = sharding.make_mesh(spec)
        ctx = types.SimpleNamespace(mesh=mesh)
        placed = [jax.device_put(w, NamedSharding(mesh, sharding.logical_to_spec(W_AXES[n], mesh=mesh,
                                                                                  shape=w.shape)))
                  for n, w in zip(W, ws)]
        assert placed[0].sharding.spec[0] == "expert"
        for dispatch in moe.DISPATCHES:
            out = jax.jit(functools.partial(moe.routed, cfg, ctx=ctx, dispatch=dispatch))(x, combine, *placed)
            _close(out, ref, jnp.float32)

