"""hlo_cost.step_cost: matmul flops and bytes of compiled HLO with every loop body counted per trip,
checked against the analytic count and against the fully unrolled program."""

import jax
import jax.numpy as jnp
import pytest

from dspark_jax import hardware, hlo_cost

L, INNER, H, B = 3, 2, 64, 4


def _nested_scan(ws, x):
    """Per layer: a dynamic slice of the stacked weight, then ``INNER`` matmuls with it."""
    def layer(h, w):
        h, _ = jax.lax.scan(lambda h2, _: (jnp.tanh(h2 @ w), None), h, None, length=INNER)
        return h, None
    return jax.lax.scan(layer, x, ws)[0]


def _args(sharding=None):
    return (jax.ShapeDtypeStruct((L, H, H), jnp.float32, sharding=sharding),
            jax.ShapeDtypeStruct((B, H), jnp.float32, sharding=sharding))


def _check(compile_fn):
    scanned = hlo_cost.step_cost(compile_fn().as_text())
    with hardware.unrolled_loops():
        unrolled = hlo_cost.step_cost(compile_fn().as_text())
    assert scanned["flops"] == unrolled["flops"] == 2 * B * H * H * L * INNER
    # bytes: each layer's weight slice is read once per use, never the whole stack per layer
    assert 0 < scanned["bytes"] < 4 * L * INNER * (H * H + 2 * B * H) * 4
    return scanned


def test_cpu_loops_counted_per_trip():
    _check(lambda: jax.jit(_nested_scan).lower(*_args()).compile())


def test_tpu_loops_counted_per_trip():
    """XLA:TPU leaves no known_trip_count on its while loops: the count comes from the condition."""
    if not hardware.has_extra("tpu"):
        pytest.skip('libtpu not installed (pip install -e ".[tpu]")')
    from jax.sharding import NamedSharding, PartitionSpec
    from dspark_jax import sharding
    devices = hardware.compile_devices(hardware.parse("tpu-v5e:1x1"))
    rep = NamedSharding(sharding.make_mesh("tensor=1", devices), PartitionSpec())
    _check(lambda: jax.jit(_nested_scan).lower(*_args(rep)).compile())


def test_in_place_update_and_slice_bytes():
    """A dynamic-update-slice of a donated buffer writes the update only; a dynamic slice reads the slice."""
    cache, row, i = (jax.ShapeDtypeStruct((4096, 1024), jnp.float32), jax.ShapeDtypeStruct((1, 1024), jnp.float32),
                     jax.ShapeDtypeStruct((), jnp.int32))
    update = jax.jit(lambda c, r, i: jax.lax.dynamic_update_slice(c, r, (i, 0)), donate_argnums=0)
    read = jax.jit(lambda c, i: jax.lax.dynamic_slice(c, (i, 0), (1, 1024)) * 2)
    for compiled in (update.lower(cache, row, i).compile(), read.lower(cache, i).compile()):
        assert 2 * 4096 <= hlo_cost.step_cost(compiled.as_text())["bytes"] < 4 * 4096  # not the 16 MiB cache


def test_async_pairs_cost_their_synchronous_op():
    """XLA:TPU's async slice / copy: charged once, at the -done (read + write of the result), not
    the -start's tuple type that repeats the whole operand."""
    text = """HloModule m

ENTRY %main (p: bf16[256,1024]) -> (bf16[256,256], bf16[256,1024]) {
  %p = bf16[256,1024]{1,0} parameter(0)
  %slice-start = ((bf16[256,1024]{1,0}), bf16[256,256]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:256], [0:256]}
  %slice-done = bf16[256,256]{1,0:S(1)} slice-done(%slice-start)
  %copy-start = (bf16[256,1024]{1,0:S(1)}, bf16[256,1024]{1,0}, u32[]{:S(2)}) copy-start(%p)
  %copy-done = bf16[256,1024]{1,0:S(1)} copy-done(%copy-start)
  ROOT %t = (bf16[256,256]{1,0}, bf16[256,1024]{1,0}) tuple(%slice-done, %copy-done)
}
"""
    assert hlo_cost.step_cost(text)["bytes"] == 2 * 256 * 256 * 2 + 2 * 256 * 1024 * 2
