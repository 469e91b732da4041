"""dspark_jax.kernels.flash: the flash-decoding kernel (Pallas interpret mode on CPU) against the XLA path of
``nn.attention`` / the drafter's block attention; its CUDA compile where the CUDA plugin is installed."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import nn
from dspark_jax.costs import hardware, hlo_cost
from dspark_jax.kernels import flash, partials
from dspark_jax.draft import backbone


@pytest.fixture
def interpreted(monkeypatch):
    """The CUDA branches' kernel run in Pallas interpret mode (any backend)."""
    monkeypatch.setattr(flash, "cache_partials", functools.partial(flash.cache_partials, interpret=True))


def _inputs(seed, b, nq, hkv, g, d, length, span, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, nq, hkv * g, d), dtype)
    k, v = (jax.random.normal(key, (b, nq, hkv, d), dtype) for key in ks[1:3])
    k_pre, v_pre = (jax.random.normal(key, (b, hkv, length, d), dtype) for key in ks[3:5])
    # ragged: row i sees cache slots < its length (row 0: none), the block causally
    lengths = np.linspace(0, span, b).astype(int)
    pre_mask = jnp.asarray(np.arange(span)[None, None, :] < lengths[:, None, None]).repeat(nq, axis=1)
    mask = jnp.tril(jnp.ones((nq, nq), bool))[None].repeat(b, axis=0)
    return q, k, v, mask, k_pre, v_pre, pre_mask


CASES = [  # (dtype, b, Q, Hkv, G, D, L, S, programs)
    (jnp.float32, 3, 7, 2, 4, 32, 96, 77, 3),   # drafter-like Q, span < L, a partial last tile
    (jnp.float32, 2, 8, 1, 4, 16, 64, 64, None),
    (jnp.float32, 2, 1, 2, 1, 32, 80, 70, 2),   # the AR step: Q = 1, G = 1
    (jnp.bfloat16, 3, 8, 2, 4, 64, 128, 100, 2),
]


@pytest.mark.parametrize("dtype,b,nq,hkv,g,d,length,span,programs", CASES)
def test_kernel_matches_xla(interpreted, monkeypatch, dtype, b, nq, hkv, g, d, length, span, programs):
    q, k, v, mask, k_pre, v_pre, pre_mask = _inputs(0, b, nq, hkv, g, d, length, span, dtype)
    if programs is not None:
        monkeypatch.setattr(flash, "cache_partials", functools.partial(flash.cache_partials, programs=programs))
    ref = nn.attention(q, k, v, mask, prefix=(k_pre, v_pre, pre_mask))        # CPU: the XLA path
    qg = q.reshape(b, nq, hkv, g, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    out = nn._joint_flash(qg, scores, mask, v, k_pre, v_pre, pre_mask, scale=d ** -0.5).reshape(ref.shape)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


def test_partials_and_empty_rows(interpreted):
    """m, l, o are the softmax partials over the visible cache slots; a row that sees nothing in
    the cache has m = NEG_INF, l = o = 0, and nothing anywhere gives zeros after ``merge``."""
    b, nq, hkv, g, d, length, span = 2, 3, 1, 2, 16, 40, 33
    q, k, v, mask, k_pre, v_pre, _ = _inputs(1, b, nq, hkv, g, d, length, span, jnp.float32)
    vis = jax.random.bernoulli(jax.random.PRNGKey(2), 0.5, (b, nq, span)).at[1, 2].set(False)
    qg = q.reshape(b, nq, hkv, g, d)
    o, m, l = flash.cache_partials(qg, k_pre, v_pre, vis, 0.3, programs=3)
    s = jnp.einsum("bqhgd,bhkd->bhgqk", qg, k_pre[:, :, :span]) * 0.3
    vis_b = vis[:, None, None]
    m_ref = jnp.max(jnp.where(vis_b, s, nn.NEG_INF), axis=-1)
    p = jnp.where(vis_b, jnp.exp(s - m_ref[..., None]), 0.0)
    np.testing.assert_allclose(m, m_ref, rtol=1e-6)
    np.testing.assert_allclose(l, p.sum(-1), rtol=1e-5)
    np.testing.assert_allclose(o, jnp.einsum("bhgqk,bhkd->bhgqd", p, v_pre[:, :, :span]), rtol=1e-5, atol=1e-5)
    assert np.all(m[1, :, :, 2] == np.float32(nn.NEG_INF)) and not np.any(l[1, :, :, 2]) and not np.any(o[1, :, :, 2])
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    block_vis = jnp.ones((b, 1, 1, nq, nq), bool).at[1, :, :, 2].set(False)
    out, probs = partials.merge(o, m, l, scores, block_vis, 0.3)
    assert not np.any(out[1, :, :, 2]) and not np.any(probs[1, :, :, 2])
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(probs))
    empty = flash.cache_partials(qg, k_pre, v_pre, vis[..., :0], 0.3)             # S = 0: no kernel call
    assert float(empty[1].max()) == np.float32(nn.NEG_INF) and not np.any(empty[0]) and not np.any(empty[2])


def test_drafter_block_attention(interpreted):
    """backbone's CUDA path (context from the kernel) against its XLA path, N = 2 blocks of G = 3."""
    n, g, b, hkv, r, d, s = 2, 3, 2, 2, 2, 32, 50
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    q, k_blk, v_blk = (jax.random.normal(key, (b, n, g, h, d)) for key, h in zip(ks[:3], (hkv * r, hkv, hkv)))
    k_ctx, v_ctx = (jax.random.normal(key, (b, hkv, s, d)) for key in ks[3:])
    ctx_mask = jnp.arange(s)[None, None, :] < jnp.array([[0, 20], [45, 50]])[:, :n, None]
    visible = backbone.block_visibility(ctx_mask, jnp.array([[True, True], [True, False]])[:, :n], g)
    ref = backbone._block_attention(q, k_blk, v_blk, k_ctx, v_ctx, visible)        # CPU: the XLA path
    q6 = q.reshape(b, n, g, hkv, r, d)
    s_blk = jnp.einsum("bngjrd,bnkjd->bjrngk", q6, k_blk, preferred_element_type=jnp.float32)
    out = backbone._joint_flash(q6, s_blk, v_blk, k_ctx, v_ctx, visible, scale=d ** -0.5)
    np.testing.assert_allclose(out.reshape(ref.shape), ref, atol=1e-5, rtol=1e-5)


def test_dispatch_gradient_is_the_xla_paths():
    """The kernel path is differentiated as the XLA path (the kernel has no backward)."""
    xla = lambda x, y: jnp.sum(jnp.sin(x) * y)
    kernel = lambda x, y: jnp.sum(jnp.sin(x) * y) + 0.0 * jnp.sum(x)  # same values, its own (unused) grad
    x, y = jnp.arange(4.0), jnp.ones(4)
    with jax.default_device(jax.devices("cpu")[0]):
        assert np.allclose(jax.grad(lambda x: partials.dispatch(xla, kernel, x, y))(x), np.cos(x))


def test_applies(monkeypatch):
    monkeypatch.setattr(flash, "cuda_installed", lambda: False)  # a CPU-only JAX: never the kernel
    assert not flash.applies(8, 128, 4)
    monkeypatch.setattr(flash, "cuda_installed", lambda: True)
    assert flash.applies(1, 128, 4) and flash.applies(8, 128, 4) and flash.applies(16, 128, 4)
    assert not flash.applies(nn.SMALL_QUERY + 1, 128, 1)       # prefill / training: the dot
    assert not flash.applies(8, 512, 4) and not flash.applies(16, 128, 8)   # D or rows too large
    assert not flash.applies(8, 96, 4)                                       # a tile of 64 x 96: not a power of 2


def test_plan_covers_the_span():
    for b, hkv, span, d in [(1, 8, 4096, 128), (8, 8, 4096, 128), (64, 8, 4096, 128), (1, 2, 5, 64), (3, 4, 1000, 256)]:
        block_k, chunk, splits = flash.plan(b, hkv, span, d)
        assert chunk % block_k == 0 and (splits - 1) * chunk < span <= splits * chunk
        assert b * hkv * splits >= min(flash.TARGET_PROGRAMS // 2, b * hkv * -(-span // block_k))


def _compiled_attention(b: int, sharding, nq=8, hkv=2, g=4, d=128, length=512) -> str:
    """The compiled HLO text of ``nn.attention`` with a cache prefix, bf16 operands on ``sharding``."""
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    args = (spec((b, nq, hkv * g, d)), spec((b, nq, hkv, d)), spec((b, nq, hkv, d)), spec((b, nq, nq), jnp.bool_),
            spec((b, hkv, length, d)), spec((b, hkv, length, d)), spec((b, nq, length), jnp.bool_))
    fn = jax.jit(lambda q, k, v, m, kp, vp, pm: nn.attention(q, k, v, m, prefix=(kp, vp, pm)))
    return fn.lower(*args).compile().as_text()


@pytest.mark.skipif(not hardware.has_extra("cuda"), reason='CUDA plugin not installed (pip install -e ".[cuda]")')
def test_compiles_for_h200_and_hlo_cost_counts_it():
    """The kernel compiles for a compile-only H200 into one Triton custom call; ``hlo_cost`` counts
    its operands + result as bytes and its two matmuls as flops."""
    from jax.sharding import SingleDeviceSharding
    sh = SingleDeviceSharding(hardware.compile_devices(hardware.parse("h200:1"))[0])
    b, nq, hkv, g, d, length = 2, 8, 2, 4, 128, 512
    text = _compiled_attention(b, sh)
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1 and f'name = "{flash.KERNEL_NAME}"' in calls[0]
    _, _, splits = flash.plan(b, hkv, length, d)
    rows = 32                                                       # Q * G = 32 query rows per (b, h)
    kernel_bytes = (2 * b * hkv * rows * d + 2 * 2 * b * hkv * length * d + b * nq * length
                    + 4 * b * hkv * splits * rows * (d + 2))
    cost = hlo_cost.step_cost(text)
    assert cost["flops"] >= 4 * b * hkv * rows * length * d
    assert cost["bytes"] >= kernel_bytes
    comps, _, by_name = hlo_cost.parse(text)
    call = next(i for i in by_name.values() if i.op == "custom-call" and "__gpu$xla.gpu.triton" in i.attrs)
    assert hlo_cost.matmul_flops(call, by_name) == 4 * b * hkv * rows * length * d


@pytest.mark.skipif(not hardware.has_extra("cuda"), reason='CUDA plugin not installed (pip install -e ".[cuda]")')
def test_partitioned_over_a_batch_sharded_mesh():
    """On two H200s with the batch sharded, each device runs the kernel on its own rows: no
    all-gather of the cache (XLA would replicate an unpartitioned custom call's operands)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array(hardware.compile_devices(hardware.parse("h200:2"))), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    text = _compiled_attention(4, rows)
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1 and "bf16[2,2,512,128]" in calls[0] and "all-gather" not in text


# A Triton custom call as XLA:GPU prints it (the compiled IR blob cut short).
TRITON_HLO = """HloModule jit_f, entry_computation_layout={(bf16[2,2,32,128]{3,2,1,0}, bf16[2,2,512,128]{3,2,1,0}, bf16[2,2,512,128]{3,2,1,0}, pred[2,8,512]{2,1,0})->(f32[2,2,4,32,128]{4,3,2,1,0}, f32[2,2,4,32]{3,2,1,0}, f32[2,2,4,32]{3,2,1,0})}

ENTRY %main.1 (q.1: bf16[2,2,32,128], k.1: bf16[2,2,512,128], v.1: bf16[2,2,512,128], vis.1: pred[2,8,512]) -> (f32[2,2,4,32,128], f32[2,2,4,32], f32[2,2,4,32]) {
  %q.1 = bf16[2,2,32,128]{3,2,1,0} parameter(0)
  %k.1 = bf16[2,2,512,128]{3,2,1,0} parameter(1)
  %v.1 = bf16[2,2,512,128]{3,2,1,0} parameter(2)
  %vis.1 = pred[2,8,512]{2,1,0} parameter(3)
  ROOT %pallas_call.4 = (f32[2,2,4,32,128]{4,3,2,1,0}, f32[2,2,4,32]{3,2,1,0}, f32[2,2,4,32]{3,2,1,0}) custom-call(%q.1, %k.1, %v.1, %vis.1), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, backend_config={debug = false, grid_x = 2 : i32, grid_y = 2 : i32, grid_z = 4 : i32, ir = "ML\\EFR\\0DMLIR23.0.0git\\00(name = \\"x\\")", name = "NAME", num_ctas = 1 : i32, num_stages = 2 : i32, num_warps = 4 : i32}
}
"""


def test_hlo_cost_reads_a_triton_call():
    """Text fixture: bytes = operands + results; flops = 2 * 2 * B * Hkv * Rp * S * D for the
    flash kernel by name, none for another Triton kernel."""
    operands = 2 * (2 * 2 * 32 * 128) + 2 * 2 * (2 * 2 * 512 * 128) + 2 * 8 * 512
    results = 4 * (2 * 2 * 4 * 32 * 128 + 2 * 2 * 2 * 4 * 32)
    ours = hlo_cost.step_cost(TRITON_HLO.replace("NAME", flash.KERNEL_NAME))
    assert ours == {"flops": 4.0 * 2 * 2 * 32 * 512 * 128, "bytes": operands + results}
    other = hlo_cost.step_cost(TRITON_HLO.replace("NAME", "someone_elses_kernel"))
    assert other == {"flops": 0.0, "bytes": operands + results}
    assert re.search(r'\bname = "', TRITON_HLO)
