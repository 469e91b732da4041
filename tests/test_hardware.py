"""--hardware: compile-only TPU / GPU targets (spec parsing, chip facts, the TPU compile of the
tiny fixture's train step and decode round through `dspark-jax plan`)."""

import json
import os

import pytest

from dspark_jax.costs import hardware
from dspark_jax.errors import InputError


def test_parse_specs():
    hw = hardware.parse("tpu-v5e:2x4")
    assert (hw.chip.name, hw.shape, hw.num_devices, hw.chip.platform) == ("tpu-v5e", (2, 4), 8, "tpu")
    assert hardware.parse("tpu-v5p:2x2x4").num_devices == 16
    assert hardware.parse("h200:8").shape == (8,) and hardware.parse("H100:2x8").num_devices == 16
    assert hardware.parse("h200:1").chip.hbm_bytes > 130 * 2**30
    for bad, needle in (("tpu-v9:2x2", "unknown chip"), ("tpu-v5e", "grid"), ("tpu-v5e:2x2x2", "2 dims"),
                        ("h200:0", "grid"), ("tpu-v5p:4x4", "3 dims")):
        with pytest.raises(InputError, match=needle):
            hardware.parse(bad)


def test_projection_and_fit():
    chip = hardware.CHIPS["tpu-v5e"]
    p = hardware.project(197e12, 819e9 * 2, chip)  # 1 s of compute, 2 s of memory traffic
    assert p["seconds"] == pytest.approx(2.0) and p["bound"] == "memory"
    assert hardware.fits(16 * 2**30, chip) and not hardware.fits(16 * 2**30 + 1, chip)


def test_gpu_gemm_cost_parser():
    """cuBLAS gemm custom calls: 2 x output elements x contracted size, operands + result bytes
    (XLA's cost analysis says 0 for both)."""
    line = ('  %custom-call.3 = (bf16[8,12288]{1,0}, s8[4194304]{0}) custom-call(bf16[8,4096]{1,0} %p0, '
            'bf16[4096,12288]{1,0} %p1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":'
            '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
            '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')
    cost = hardware._gpu_gemm_cost(line)
    assert cost["flops"] == 2 * 8 * 12288 * 4096
    assert cost["bytes"] == 2 * (8 * 4096 + 4096 * 12288 + 8 * 12288)  # the s8 workspace left out
    named = line.replace("bf16[8,4096]{1,0} %p0", "%p0") + "\n  %p0 = bf16[8,4096]{1,0} parameter(0)"
    assert hardware._gpu_gemm_cost(named) == cost  # an operand printed without its shape
    assert hardware._gpu_gemm_cost(line.replace("__cublas", "__other")) == {"flops": 0.0, "bytes": 0.0}


def test_missing_extra_is_one_line(monkeypatch):
    monkeypatch.setattr(hardware, "has_extra", lambda platform: False)
    with pytest.raises(InputError, match=r'pip install -e "\.\[cuda\]"'):
        hardware.compile_devices(hardware.parse("h200:8"))
    with pytest.raises(InputError, match=r'pip install -e "\.\[tpu\]"'):
        hardware.compile_devices(hardware.parse("tpu-v5e:2x2"))


def test_plan_compiles_tiny_fixture_for_tpu(tmp_path, tiny_dir):
    """The tiny fixture's online train step and decode round compiled by the TPU compiler (libtpu,
    compile-only devices) on a v5e 2x2 mesh: both compile, fit the chip, no XLA:CPU upcasts.
    CI installs the tpu extra: there a missing libtpu fails; elsewhere it skips."""
    if not hardware.has_extra("tpu"):
        if os.environ.get("CI"):
            pytest.fail('libtpu is not installed in CI: .ci/run must pip install -e ".[test,tpu]"')
        pytest.skip('libtpu not installed (pip install -e ".[tpu]")')
    from dspark_jax import cli
    config = tmp_path / "tiny_plan.py"
    config.write_text(
        f"CONFIG = dict(target={str(tiny_dir / 'target')!r}, data='x.jsonl', max_length=64, mesh='data=2,fsdp=2',\n"
        "              draft=dict(num_hidden_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=511,\n"
        "                         num_anchors=4, markov_rank=8))\n")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(config), "--hardware", "tpu-v5e:2x2", "--modes", "online,decode",
                     "--decode-len", "128", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["hardware"]["chip"] == "tpu-v5e" and report["devices"] == 4
    assert report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    for mode in ("online", "decode"):
        prog = report["programs"][mode]
        assert prog["platform"] == "tpu" and prog["fits"] and prog["upcast_bytes"] == 0
        assert 0 < prog["peak_bytes"] < 2**30 and prog["argument_bytes"] > 0
    assert report["programs"]["decode"]["alias_bytes"] > 0  # the decode state is donated on TPU too
    online = report["programs"]["online"]  # loops counted per trip: at least the body-once count
    assert online["step_flops"] >= online["flops"] > 0 and online["step_bytes"] > 0
    proj = online["projected"]
    assert proj["tokens"] == 64 and proj["tokens_per_s"] > 0 and 0 < proj["mfu"] < 1


def test_gpu_cache_attention_forms_match_the_dots():
    """The scores form GPU decode uses to read a head-major [B, Hkv, S, D] cache in place
    (nn.cache_scores under CUDA) computes what the dot does (checked here, on CPU, directly), and
    cache_values is the attention-weighted sum of each head's own values."""
    import jax
    import numpy as np

    from dspark_jax import nn
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    qg = jax.random.normal(k1, (2, 5, 2, 3, 16))
    k = jax.random.normal(k2, (2, 2, 40, 16))
    np.testing.assert_allclose(nn._scores_in_place(qg, k), nn._scores_dot(qg, k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nn._scores_dot(qg, k)[1, 0, 2, 3], np.asarray(k[1, 0]) @ np.asarray(qg[1, 3, 0, 2]),
                               rtol=1e-5, atol=1e-5)
    probs = jax.nn.softmax(jax.random.normal(k3, (2, 2, 3, 5, 40)), axis=-1)
    v = jax.random.normal(k4, (2, 2, 40, 16))
    out = nn.cache_values(probs, v)
    assert nn.cache_scores(qg, k).shape == (2, 2, 3, 5, 40) and out.shape == (2, 5, 2, 3, 16)
    np.testing.assert_allclose(out[1, 3, 0, 2], np.asarray(probs[1, 0, 2, 3]) @ np.asarray(v[1, 0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nn._values_in_place(probs, v), nn._values_dot(probs, v), rtol=1e-5, atol=1e-5)
    stacked = jax.random.normal(k1, (4, 2, 3))
    assert all(np.array_equal(a, stacked[i]) for i in range(4) for a in nn.layer_slices((stacked,), i))


def test_gpu_flags_keep_the_users(monkeypatch):
    """set_gpu_flags adds the project's XLA:GPU flags to XLA_FLAGS, never over a user's own value."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_dot_merger_threshold_mb=7 --other=1")
    hardware.set_gpu_flags(("--xla_gpu_enable_triton_gemm=false",))
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == ["--xla_gpu_dot_merger_threshold_mb=7", "--other=1", "--xla_gpu_enable_triton_gemm=false"]
    monkeypatch.delenv("XLA_FLAGS")
    hardware.set_gpu_flags()
    assert os.environ["XLA_FLAGS"].split() == list(hardware.GPU_XLA_FLAGS)


def test_gpu_one_row_projection_matches_the_dot():
    """The one-row products of GPU decode (nn.dense under CUDA: padded to two rows; the LM head
    in f32, the k / v projections in bf16) compute what the dot does (checked here, on CPU,
    directly), and so does x @ kernel, which nn.dense replaces in the projections."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax import nn
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (32, 50), jnp.bfloat16)
    for out_dtype in (jnp.float32, None):
        out = nn._dot_two_rows(x, w, out_dtype)
        assert out.shape == (1, 1, 50) and out.dtype == (out_dtype or jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(nn._dot(x, w, out_dtype), np.float32),
                                   rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(nn.project_f32(x, w), nn._dot(x, w, jnp.float32))
    np.testing.assert_array_equal(nn.dense(x, w), x @ w)


def test_round_cost_compile_only_for_tpu(tmp_path):
    """benchmarks/round_cost.py --compile-only: the tiny fixture's AR step and round compiled for
    one TPU v5e chip, memory and cost from that compiler, JSON written (libtpu as above)."""
    import subprocess
    import sys
    from pathlib import Path
    if not hardware.has_extra("tpu"):
        if os.environ.get("CI"):
            pytest.fail('libtpu is not installed in CI: .ci/run must pip install -e ".[test,tpu]"')
        pytest.skip('libtpu not installed (pip install -e ".[tpu]")')
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks/round_cost.py"), "--compile-only", "--smoke",
                           "--hardware", "tpu-v5e:1x1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((tmp_path / "round_cost_compiled.json").read_text())["rows"][0]
    for name in ("ar_step", "round"):
        prog = row[name]
        assert prog["platform"] == "tpu" and prog["fits"] and prog["flops"] > 0 and prog["bytes_accessed"] > 0
        assert prog["largest"] and prog["projected"]["seconds"] > 0
        assert set(prog["copies"]) == {"cache", "cache_layer", "weight"}  # copies marked per kind
    assert row["round"]["flops"] > row["ar_step"]["flops"]  # the round also drafts and verifies G+1 tokens
    assert row["round"]["step_flops"] > row["ar_step"]["step_flops"] > 0 and row["step_round_over_ar"] > 0
