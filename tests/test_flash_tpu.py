"""The TPU flash-decoding kernel (``dspark_jax.kernels.flash_tpu``): its partials in Pallas interpret mode
against the XLA attention path, and a TPU-compiled decode round reading the stacked cache in place."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import nn
from dspark_jax.costs import hardware, hlo_cost
from dspark_jax.kernels import flash_tpu


@pytest.mark.parametrize("nq, span, capacity, tile", [(1, 300, 384, 128), (3, 130, 136, None)])
def test_kernel_matches_xla_attention(nq, span, capacity, tile):
    """Interpret mode: layer 1 of a 3-layer stack (other layers hold different values), a span not a
    multiple of the tile (three tiles, the last one partly past the span and past the capacity;
    or one tile padded past both), a row with nothing visible in the cache and one hole in another's
    mask. The partials merged with the block's own keys give ``nn.attention``'s XLA joint softmax."""
    b, layers, hkv, g, d, k_new = 2, 3, 2, 4, 16, 2
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    qg = jax.random.normal(keys[0], (b, nq, hkv, g, d))
    k_all = jax.random.normal(keys[1], (layers, b, hkv, capacity, d))
    v_all = jax.random.normal(keys[2], (layers, b, hkv, capacity, d))
    k, v = (jax.random.normal(kk, (b, k_new, hkv, d)) for kk in keys[3:5])
    lengths = jnp.array([span - 7, 0])
    visible = jnp.broadcast_to(jnp.arange(span) < lengths[:, None, None], (b, nq, span)).at[0, -1, 5].set(False)
    mask = jnp.ones((b, nq, k_new), bool).at[1].set(False)  # row 1 sees nothing at all: zeros
    scale = d ** -0.5
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)

    o, m, l = flash_tpu.cache_partials(qg, k_all, v_all, jnp.int32(1), visible, scale, interpret=True, tile=tile)
    assert o.shape == (b, hkv, g, nq, d) and m.shape == l.shape == (b, hkv, g, nq)
    assert np.all(np.asarray(m[1]) == nn.NEG_INF) and np.all(np.asarray(l[1]) == 0) and np.all(np.asarray(o[1]) == 0)
    got = nn._merge_block((o, m, l), scores, mask, v, scale)
    want = nn._joint_stacked_xla(qg, scores, mask, v, k_all, v_all, visible, jnp.int32(1), scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got[1]) == 0)
    other = nn._joint_stacked_xla(qg, scores, mask, v, k_all, v_all, visible, jnp.int32(2), scale)
    assert not np.allclose(np.asarray(got[0]), np.asarray(other[0]), atol=1e-3)  # the layer index matters


def test_tpu_round_reads_the_stacked_cache_in_place(monkeypatch):
    """The tiny fixture's speculative round compiled by libtpu for a v5e 2x2 mesh (data=2, tensor=2:
    one row and one KV head per chip): the target attention is the kernel, per shard (no
    all-gather of the cache), with no copy of a layer's or the whole cache; ``hlo_cost`` charges the
    kernel its cost estimate (a layer's K / V span, not the stack operand). CPU programs keep the
    XLA path (``flash_tpu.applies``)."""
    if not hardware.has_extra("tpu"):
        pytest.skip('libtpu not installed (pip install -e ".[tpu]")')
    from dspark_jax import sharding
    from dspark_jax.convert.checkpoint import load_draft, load_target
    from dspark_jax.pipelines import plan as plan_lib
    from tests.conftest import TINY

    tcfg, dcfg = load_target(TINY / "target")[0], load_draft(TINY / "draft")[0]
    tcfg = dataclasses.replace(tcfg, head_dim=128)  # lane-wide heads (``applies``); abstract params
    assert flash_tpu.applies("tpu", 5, 128, jnp.bfloat16, jnp.bfloat16)
    assert not flash_tpu.applies("cpu", 5, 128, jnp.bfloat16, jnp.bfloat16)
    assert not flash_tpu.applies("tpu", 5, 16, jnp.bfloat16, jnp.bfloat16)
    assert not flash_tpu.applies("tpu", 5, 128, jnp.float32, jnp.bfloat16)
    texts = []
    step_cost = hlo_cost.step_cost
    monkeypatch.setattr(plan_lib.hlo_cost, "step_cost", lambda text: texts.append(text) or step_cost(text))
    mesh = sharding.make_mesh("data=2,tensor=2", hardware.compile_devices(hardware.parse("tpu-v5e:2x2")))
    capacity = 256
    plan_lib.plan_decode_round(dcfg, tcfg, mesh, batch=2, max_len=capacity, spans=(capacity,))
    comps, _, by_name = hlo_cost.parse(texts[-1])
    kernels = [i for i in by_name.values() if flash_tpu.KERNEL_NAME in i.name]
    assert kernels and all(hlo_cost.tpu_kernel_cost(i) is not None for i in kernels)
    stack = (tcfg.num_hidden_layers, 1, 1, capacity, tcfg.head_dim)  # per chip
    for ins in kernels:  # the whole stacks are operands; the estimate charges one layer's K and V
        assert [hlo_cost._dims_of(by_name, o) for o in ins.operands[2:4]] == [list(stack)] * 2
        layer_kv = 2 * capacity * tcfg.head_dim * 2
        assert layer_kv <= hlo_cost.tpu_kernel_cost(ins)[1] < 2 * layer_kv
    copies = [i for i in by_name.values() if i.op in ("copy", "copy-start", "all-gather", "all-gather-start")
              and hlo_cost._dims_of(by_name, i.name)[-2:] == [capacity, tcfg.head_dim]]
    assert not copies, [c.name for c in copies]
