"""hlo_cost.step_cost: matmul flops and bytes of compiled HLO with every loop body counted per trip,
checked against the analytic count and against the fully unrolled program."""

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.costs import hardware, hlo_cost

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

FMHA = ('%fmha = (bf16[2,32,512,128]{{3,1,2,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), '
        'custom_call_target="__cudnn$fmhaSoftmax{kind}", backend_config={{"cudnn_fmha_backend_config": '
        '{{"fmha_scale": 0.088, "intermediate_tensor_shape": {{"element_type": "BF16", '
        '"dimensions": ["2", "32", "512", "512"], "tuple_shapes": []}}, "mask_type": "{mask}"}}}}')


@pytest.mark.parametrize("kind,mask,factor", [("", "CAUSAL", 0.5), ("", "NO_MASK", 1.0),
                                              ("Backward", "CAUSAL", 1.25)])
def test_cudnn_fused_attention_flops(kind, mask, factor):
    """A cuDNN flash-attention call (how GPU training / prefill run causal attention,
    nn.causal_fused) counts its two products over the scores it keeps on chip: 4 * B*H*Sq*Skv * D,
    half of it causal, 2.5x for the backward."""
    module = ("HloModule m\n\nENTRY %main (q: bf16[2,512,32,128], k: bf16[2,512,8,128], v: bf16[2,512,8,128]) "
              "-> bf16[2,32,512,128] {\n  %q = bf16[2,512,32,128]{3,2,1,0} parameter(0)\n"
              "  %k = bf16[2,512,8,128]{3,2,1,0} parameter(1)\n  %v = bf16[2,512,8,128]{3,2,1,0} parameter(2)\n  "
              + FMHA.format(kind=kind, mask=mask) + "\n  ROOT %out = bf16[2,32,512,128]{3,1,2,0} get-tuple-element(%fmha), index=0\n}\n")
    cost = hlo_cost.step_cost(module)
    assert cost["flops"] == 4 * 2 * 32 * 512 * 512 * 128 * factor
    # bytes: q, k, v read and the output written once; the [512, 512] scores never
    assert cost["bytes"] == 2 * (2 * 512 * 32 * 128 * 2 + 2 * 2 * 512 * 8 * 128)


def test_gpu_causal_attention_is_fused_where_cuda_is_installed():
    """With the CUDA plugin installed (the benchmark venv of docs/performance.md), a bf16 Qwen3
    forward compiled for a compile-only H200 runs its causal attention as cuDNN flash attention:
    no [T, T] score buffer, the flops counted. (CI has no CUDA plugin: skipped there.)"""
    pytest.importorskip("jax_plugins.xla_cuda12")
    from dspark_jax import nn
    from dspark_jax.target import qwen3
    import test_target_parity as ttp
    if not nn._has_cudnn():
        pytest.skip("no cuDNN in this jaxlib")
    cfg = ttp.to_jax(ttp.build_hf(0, **ttp.CONFIGS[0]))[0]
    cfg = cfg.__class__(**{**cfg.__dict__, "head_dim": 64})
    hw = hardware.parse("h200:1")
    mesh = jax.sharding.Mesh(hardware.compile_devices(hw), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=sh),
                          jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.PRNGKey(0))))
    tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=sh)
    text = jax.jit(lambda p, t: qwen3.forward(p, cfg, t)[0]).lower(params, tokens).compile().as_text()
    assert "__cudnn$fmha" in text and "256,256]" not in text
    assert hlo_cost.step_cost(text)["flops"] > 0
