"""DeepSeek-V4 conversion one tensor at a time (convert/bounded.py), `--to torch --quantize fp8`,
`inspect` of a V4 checkpoint, and bad input refused in one line (exit 2)."""

from __future__ import annotations

import json
import shutil
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from dspark_jax import cli
from dspark_jax.convert import bounded, checkpoint, quant
from dspark_jax.params import Quant
from test_deepseek_v4 import FIX, _hf
from test_deepseek_v4_quant import _write_quantized, jax_leaves

torch = pytest.importorskip("torch")


def _tensors(path) -> dict[str, tuple]:
    """Every tensor of a one-file safetensors directory: (dtype, shape, raw bytes)."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                for k in f.keys() for t in (f.get_tensor(k),)}


# ----------------------------------------------------------------------------- bounded conversion


@pytest.mark.parametrize("layout", ("target", "target_hf"))
def test_bounded_round_trip_is_byte_exact(layout, tmp_path):
    """PyTorch -> ours -> PyTorch one tensor at a time: our params equal the whole-model loader's
    bit for bit, and the tensors written back are the source's bytes under upstream names."""
    from dspark_jax.target.deepseek_v4 import source_names
    bounded.convert_bounded(FIX / layout, tmp_path / "jax")
    bounded.convert_bounded(tmp_path / "jax", tmp_path / "torch")
    _, want = checkpoint.load_target(FIX / layout)
    _, got = checkpoint.load_target(tmp_path / "jax")
    for path, leaf in jax_leaves(want).items():
        a, b = np.asarray(jax_leaves(got)[path]), np.asarray(leaf)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    src = _tensors(FIX / layout)
    assert {d: src[s] for d, s in source_names(_hf(layout), list(src)).items()} == _tensors(tmp_path / "torch")


def test_a_jax_checkpoint_saved_whole_converts_back(tmp_path):
    """A dspark-jax checkpoint written by ``save_target`` (orbax's own save: one chunk per leaf, as
    training writes them) converts back to the source's bytes too."""
    cfg, params = checkpoint.load_target(FIX / "target")
    checkpoint.save_target(tmp_path / "jax", cfg, params, format="jax")
    bounded.convert_bounded(tmp_path / "jax", tmp_path / "torch")
    assert _tensors(tmp_path / "torch") == _tensors(FIX / "target")


def _wide_checkpoint(path):
    """The fixture's architecture with experts of width 512 (19 MB of 21 MB in experts, one
    expert's weight 128 KB), random weights, written with safetensors."""
    from dspark_jax import families
    from dspark_jax import params as params_lib
    from dspark_jax.convert import safetensors_io
    from dspark_jax.target import deepseek_v4 as v4
    cfg = v4.DeepseekV4Config.from_hf({**_hf("target"), "moe_intermediate_size": 512})
    specs = families.declare(cfg)
    rng = np.random.default_rng(0)
    ints = {n for n, d in params_lib.fixed_dtypes(specs).items() if np.issubdtype(np.dtype(d), np.integer)}
    tensors = {n: (np.zeros(shape, np.int64) if n in ints else rng.standard_normal(shape, np.float32))
               for n, shape in params_lib.torch_shapes(specs).items()}
    path.mkdir()
    safetensors_io.write_tensors(path, tensors)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    return (path / "model.safetensors").stat().st_size


def test_bounded_conversion_peak_host_allocations(tmp_path):
    """Host allocations (tracemalloc: numpy buffers and Python objects) while converting a 21 MB
    checkpoint torch -> jax -> torch stay under a budget of 1/8 of it; loading the whole model
    holds more than the checkpoint (so the measure can fail)."""
    size = _wide_checkpoint(tmp_path / "wide")
    budget = size // 8
    bounded.convert_bounded(FIX / "target", tmp_path / "warm")  # imports and first-use caches outside the count
    stats = {}
    tracemalloc.start()
    bounded.convert_bounded(tmp_path / "wide", tmp_path / "jax", stats=stats)
    bounded.convert_bounded(tmp_path / "jax", tmp_path / "torch", stats=stats)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    loaded = checkpoint.load_target(tmp_path / "wide")  # the whole model in memory
    whole = tracemalloc.get_traced_memory()[1]
    del loaded
    tracemalloc.stop()
    print(f"checkpoint {size} B: bounded peak {peak} B (largest unit {stats['peak_unit_bytes']} B), whole-model load {whole} B")
    assert 512 * 64 * 4 <= stats["peak_unit_bytes"] <= bounded.WRITES_IN_FLIGHT * 512 * 64 * 4
    assert peak < budget < size < whole
    assert _tensors(tmp_path / "torch") == _tensors(tmp_path / "wide")


def test_bounded_conversion_of_a_quantized_sharded_checkpoint(tmp_path):
    """FP8 / MXFP4 dequantized unit by unit equal the whole-model loader, through a sharded
    torch output (--max-shard-size) and --dtype bfloat16."""
    _write_quantized(tmp_path / "q")
    assert bounded.convert_bounded(tmp_path / "q", tmp_path / "t", to="torch", max_shard_size="300KB") == "torch"
    assert (tmp_path / "t" / "model.safetensors.index.json").is_file()
    _, want = checkpoint.load_target(tmp_path / "q")
    _, got = checkpoint.load_target(tmp_path / "t")
    for path, leaf in jax_leaves(want).items():
        np.testing.assert_array_equal(np.asarray(jax_leaves(got)[path]), np.asarray(leaf), err_msg=path)
    bounded.convert_bounded(tmp_path / "q", tmp_path / "bf16", dtype="bfloat16")
    _, low = checkpoint.load_target(tmp_path / "bf16")
    assert low["layers"]["experts_w1"].dtype == ml_dtypes.bfloat16 and low["norm"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(low["layers"]["wq_a"]),  # FP8 values are exact in bf16
                                  np.asarray(want["layers"]["wq_a"]).astype(ml_dtypes.bfloat16))


# ----------------------------------------------------------------------------- quantize


def test_fp8_quantize_hand_computed():
    """Block amax 10 -> scale 2**-5 (ue8m0 122): 320 = 0x7A, 96 = 0x6C, -16 = 0xD8. Block amax 57.5 ->
    2**-3 (124), the smallest scale at which 460 still rounds to 448 (0x7E) without overflow; 8 = 0x50."""
    q = Quant("fp8", (1, 4))
    w = np.array([[10.0, 3.0, -0.5, 0.0, 57.5, 1.0, -2.0, 0.0]], np.float32)
    data, scale = quant.quantize(w, q)
    assert scale.view(np.uint8).tolist() == [[122, 124]]
    assert data.view(np.uint8).tolist() == [[0x7A, 0x6C, 0xD8, 0x00, 0x7E, 0x50, 0xD8, 0x00]]
    np.testing.assert_array_equal(quant.dequantize(data, scale, q), [[10, 3, -0.5, 0, 56, 1, -2, 0]])


def test_mxfp4_quantize_hand_computed():
    """Block amax 6.5 -> scale 2**0 (127), 6.5 -> 6 (code 7), -0.25 -> -0 (tie to the lower code,
    sign bit: 8): byte 0x87; -3 (code 5 | 8 = 0xD) and 1 (code 2): 0x2D. Block amax 0.75 -> 2**-3
    (124): 0.75 x 8 = 6 (code 7), -0.375 x 8 = -3 (0xD): 0xD7."""
    q = Quant("fp4", (1, 32))
    w = np.zeros((1, 64), np.float32)
    w[0, :4] = [6.5, -0.25, -3.0, 1.0]
    w[0, 32:34] = [0.75, -0.375]
    data, scale = quant.quantize(w, q)
    assert scale.view(np.uint8).tolist() == [[127, 124]]
    assert data.view(np.uint8)[0, :2].tolist() == [0x87, 0x2D] and data.view(np.uint8)[0, 16] == 0xD7
    assert np.count_nonzero(data) == 3
    back = quant.dequantize(data, scale, q)
    np.testing.assert_array_equal(back[0, :4], [6.0, -0.0, -3.0, 1.0])
    np.testing.assert_array_equal(back[0, 32:34], [0.75, -0.375])


@pytest.mark.parametrize("fmt, block, shape", [("fp8", (128, 128), (300, 200)), ("fp8", (2, 3), (5, 7)),
                                               ("fp4", (1, 32), (7, 96))])
def test_requantizing_dequantized_values_is_byte_exact(fmt, block, shape):
    """The scale chosen is the smallest that fits, so quantize(dequantize(q)) == q byte for byte
    (wide dynamic range, blocks of zeros and partial edge blocks included)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-20, 20, shape)).astype(np.float32)
    w[:2, :block[1]] = 0.0
    q = Quant(fmt, block)
    data, scale = quant.quantize(w, q)
    again, scale2 = quant.quantize(quant.dequantize(data, scale, q), q)
    assert scale2.tobytes() == scale.tobytes() and again.tobytes() == data.tobytes()


def test_quantize_fp8_writes_the_released_format_back_byte_exact(tmp_path, capsys):
    """A quantized checkpoint (FP8 weights, MXFP4 experts) -> torch --quantize fp8 is byte-exact; and
    through our (dequantized) format and back too, the expert dtype given on the command line."""
    _write_quantized(tmp_path / "q")
    src = _tensors(tmp_path / "q")
    assert cli.main(["convert", str(tmp_path / "q"), str(tmp_path / "t"), "--to", "torch", "--quantize", "fp8"]) == 0
    assert _tensors(tmp_path / "t") == src
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    assert hf["expert_dtype"] == "fp4" and hf["quantization_config"]["weight_block_size"] == [128, 128]
    assert cli.main(["convert", str(tmp_path / "q"), str(tmp_path / "jax")]) == 0
    assert cli.main(["convert", str(tmp_path / "jax"), str(tmp_path / "t2"), "--quantize", "fp8",
                     "--expert-dtype", "fp4"]) == 0
    assert _tensors(tmp_path / "t2") == src
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "jax"), str(tmp_path / "t3"), "--to", "jax", "--quantize", "fp8"]) == 2
    assert "--to torch" in capsys.readouterr().err


def test_dequantization_equals_transformers_on_cpu():
    """transformers' own FP8 / FP4 dequantization op (integrations/finegrained_fp8.py
    ``Fp8Dequantize``, the one its DeepSeek-V4 loading runs) gives our values on CPU for whole
    128x128 blocks and MXFP4 [1, 32] blocks. (Loading a quantized V4 through from_pretrained
    needs accelerate, which is not a dependency here; and transformers derives the block from
    the shape / scale-grid ratio, so tensors with partial edge blocks are not comparable.)"""
    pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    op = Fp8Dequantize(None)
    rng = np.random.default_rng(2)
    for q, shape in ((Quant("fp8", (128, 128)), (256, 384)), (Quant("fp4", (1, 32)), (8, 128))):
        w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-6, 6, shape)).astype(np.float32)
        data, scale = quant.quantize(w, q)
        tdata = torch.from_numpy(data.view(np.uint8).copy())
        tdata = tdata.view(torch.float8_e4m3fn) if q.fmt == "fp8" else tdata.view(torch.int8)
        tscale = torch.from_numpy(scale.view(np.uint8).copy()).view(torch.float8_e8m0fnu)
        theirs = op._dequantize_one(tdata, tscale, output_dtype=torch.float32).numpy()
        np.testing.assert_array_equal(quant.dequantize(data, scale, q), theirs, err_msg=q.fmt)


# ----------------------------------------------------------------------------- inspect


def test_inspect_describes_a_quantized_v4_checkpoint_with_mtp(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    _write_quantized(tmp_path / "q")
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    tensors.update({"mtp.0.main_proj.weight": torch.zeros(64, 192), "mtp.2.norm.weight": torch.ones(64)})
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    assert cli.main(["inspect", str(tmp_path / "q"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "deepseek_v4" and info["layers"] == 6
    assert info["attention"] == {"sliding_attention": [0, 5], "compressed_sparse_attention": [1, 3],
                                 "heavily_compressed_attention": [2, 4]}
    assert info["moe"]["routed_experts"] == 8 and info["moe"]["top_k"] == 2 and info["moe"]["hash_layers"] == [0, 1]
    # 6 layers x (wq_a, wq_b, wkv, wo_a, wo_b + 3 shared) FP8; 6 x 8 experts x 3 MXFP4
    assert info["quantized"] == {"fp4 1x32": 144, "fp8 128x128": 48} and info["scale_dtypes"] == ["float8_e8m0fnu"]
    assert info["aside"] == {"tensors": 2, "bytes": 64 * 192 * 4 + 64 * 4, "mtp_stages": [0, 2]}
    n = info["params"]
    assert n["routed_experts"] == 6 * 8 * 3 * 64 * 32 and n["embedding_and_head"] == 2 * 512 * 64
    assert n["active_per_token"] == n["total"] - n["routed_experts"] * 6 // 8
    assert cli.main(["inspect", str(tmp_path / "q")]) == 0
    text = capsys.readouterr().out
    for line in ("compressed_sparse_attention: 2 layers [1, 3]", "top-2", "48 fp8 128x128",
                 "144 fp4 1x32", "2 mtp.* tensors", "DSpark stages [0, 2]"):
        assert line in text, text
    assert "DSpark module: none" in text  # mtp.* tensors without dspark_* keys
    assert cli.main(["inspect", str(FIX / "target_dspark"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dspark"] == {
        "present": True, "block_size": 5, "target_layer_ids": [3, 4, 5], "stages": 3, "markov_rank": 16,
        "heads": 4, "window": 16, "noise_token_id": 511, "experts": "8 routed (top 2) + 1 shared"}


# ----------------------------------------------------------------------------- bad input


def _variant(tmp_path, name, *, tensors=None, **config):
    """The fixture with some tensors replaced and config fields changed."""
    from safetensors.numpy import load_file, save_file
    d = tmp_path / name
    shutil.copytree(FIX / "target", d)
    if tensors:
        t = load_file(str(d / "model.safetensors"))
        t.update(tensors)
        save_file(t, str(d / "model.safetensors"))
    hf = json.loads((d / "config.json").read_text())
    hf.update(config)
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.mark.parametrize("case, match", [
    ("tid2eid-shape", "'layers.1.ffn.gate.tid2eid' has shape (512, 3)"),
    ("tid2eid-rank", "'layers.0.ffn.gate.tid2eid' has shape (1024,)"),
    ("layer-type", "attention type 'linear_attention' is not implemented"),
    ("compress-ratio", "compress_ratios entry 16"),
    ("expert-dtype", "unknown expert_dtype 'nf4'"),
    ("scale-blocks", "scale 'layers.3.ffn.experts.5.w2.scale' has shape (64, 2), expected (64, 1)"),
])
def test_bad_v4_input_is_one_line_exit_2(tmp_path, capsys, case, match):
    """convert (also --to torch --quantize fp8) and inspect refuse before reading any tensor data,
    naming the tensor / field, in one line with exit code 2 (cli.main is the console script's body)."""
    make = {
        "tid2eid-shape": lambda: _variant(tmp_path, case, tensors={"layers.1.ffn.gate.tid2eid": np.zeros((512, 3), np.int64)}),
        "tid2eid-rank": lambda: _variant(tmp_path, case, tensors={"layers.0.ffn.gate.tid2eid": np.zeros(1024, np.int64)}),
        "layer-type": lambda: _variant(tmp_path, case, layer_types=["sliding_attention"] * 5 + ["linear_attention"],
                                       compress_rates={"compressed_sparse_attention": 4}),
        "compress-ratio": lambda: _variant(tmp_path, case, compress_ratios=[0, 4, 16, 4, 128, 0]),
        "expert-dtype": lambda: _variant(tmp_path, case, expert_dtype="nf4"),
        "scale-blocks": lambda: (_write_quantized(tmp_path / case, bad_scale="layers.3.ffn.experts.5.w2.scale"),
                                 tmp_path / case)[1],
    }
    src = make[case]()
    for command in (["convert", str(src), str(tmp_path / "out")], ["inspect", str(src)],
                    ["convert", str(src), str(tmp_path / "out"), "--to", "torch", "--quantize", "fp8"]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and match in err, err
    assert not (tmp_path / "out").exists()
