"""DeepSeek-V4 checkpoint formats: FP8 (e4m3, ue8m0 block scales) and MXFP4 experts dequantized on
load, hand-computed cases, and bad checkpoints refused in one line (exit 2)."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.convert import checkpoint, formats, quant
from dspark_jax.params import Quant
from test_deepseek_v4 import FIX


def test_mxfp4_hand_computed():
    """Byte 0x9A = low nibble 0xA (sign, code 2: -1.0) then high 0x9 (sign, code 1: -0.5); byte
    0x71 = 0.5 then 6.0. Scales per 32 values: 2**(128-127) = 2 and 2**(125-127) = 0.25."""
    packed = np.zeros((1, 32), np.uint8)
    packed[0, 0], packed[0, 1] = 0x9A, 0x71
    packed[0, 16], packed[0, 31] = 0x8F, 0x0B  # second block: -6 then -0; -1.5 then 0 (x 0.25)
    scale = np.array([[128, 125]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    out = quant.dequantize(packed.view(np.int8), scale, Quant("fp4", (1, 32)))
    assert out.shape == (1, 64)
    np.testing.assert_array_equal(out[0, :4], [-2.0, -1.0, 1.0, 12.0])
    np.testing.assert_array_equal(out[0, 32:34], [-1.5, -0.0])
    np.testing.assert_array_equal(out[0, 62:64], [-0.375, 0.0])
    assert np.count_nonzero(out) == 6


def test_fp8_hand_computed_with_partial_blocks():
    """e4m3 0x3C = 1.5, 0xA8 = -0.25; a [3, 3] tensor in (2, 2) blocks has 2 x 2 scales
    (edge blocks partial): 2**-1, 2**3 / 2**0, 2**-3."""
    w = np.array([[0x3C, 0xA8, 0x3C], [0x00, 0x3C, 0xA8], [0xA8, 0x3C, 0x3C]], np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale = np.array([[126, 130], [127, 124]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    out = quant.dequantize(w, scale, Quant("fp8", (2, 2)))
    np.testing.assert_array_equal(out, [[0.75, -0.125, 12.0], [0.0, 0.75, -2.0], [-0.25, 1.5, 0.1875]])


@pytest.mark.parametrize("fmt, block", [("fp8", (128, 128)), ("fp8", (2, 3)), ("fp4", (1, 32))])
def test_quantize_round_trips_through_dequantize(fmt, block):
    w = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32) * np.float32(3.0)
    q = Quant(fmt, block)
    data, scale = quant.quantize(w, q)
    assert scale.shape == q.scale_shape(w.shape) and data.shape == (5, 32 if fmt == "fp4" else 64)
    back = quant.dequantize(data, scale, q)
    step = 0.5 if fmt == "fp4" else 2.0 ** -3  # relative spacing of the format near its block max
    assert np.abs(back - w).max() <= step * np.abs(w).max()
    again, scale2 = quant.quantize(back, q)  # representable values are fixed points
    np.testing.assert_array_equal(quant.dequantize(again, scale2, q), back)


def _write_quantized(dst, *, bad_scale: str | None = None, expert_dtype: str = "fp4"):
    """The fixture's upstream checkpoint with its FP8 weights and MXFP4 experts quantized (as the
    released checkpoints store them), through torch's safetensors writer."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    from safetensors.torch import save_file
    tensors = load_file(str(FIX / "target" / "model.safetensors"))
    out, expected = {}, {}
    for name, t in tensors.items():
        expert = ".ffn.experts." in name
        fp8 = any(f".{w}.weight" in name for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")) and ".attn." in name \
            and ".indexer." not in name and ".compressor." not in name or ".shared_experts." in name
        if not (expert or fp8):
            out[name] = torch.from_numpy(t)
            continue
        q = Quant("fp4", (1, 32)) if expert and expert_dtype == "fp4" else Quant("fp8", (128, 128))
        data, scale = quant.quantize(t, q)
        expected[name] = quant.dequantize(data, scale, q)
        sname = name[:-len(".weight")] + ".scale"
        if sname == bad_scale:
            scale = np.concatenate([scale, scale], axis=-1)
        out[name] = (torch.from_numpy(data.view(np.uint8).copy()).view(torch.float8_e4m3fn) if q.fmt == "fp8"
                     else torch.from_numpy(data.copy()))
        out[sname] = torch.from_numpy(scale.view(np.uint8).copy()).view(torch.float8_e8m0fnu)
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    hf = json.loads((FIX / "target" / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "weight_block_size": [128, 128]}
    hf["expert_dtype"] = expert_dtype
    (dst / "config.json").write_text(json.dumps(hf))
    return expected


def test_quantized_checkpoint_dequantizes_on_load(tmp_path):
    from flax import traverse_util

    from dspark_jax import families
    from dspark_jax import params as params_lib
    expected = _write_quantized(tmp_path / "q")
    assert len(expected) == 6 * (5 + 3 + 3 * 8)
    cfg, params = checkpoint.load_target(tmp_path / "q")
    assert cfg.quant is None and cfg.expert_dtype is None  # the loaded model is unquantized
    tensors = params_lib.to_torch(families.declare(cfg), traverse_util.unflatten_dict(
        {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}))
    for name, want in expected.items():
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)
    plain = checkpoint.load_target(FIX / "target")[1]
    assert np.array_equal(np.asarray(params["head"]), np.asarray(plain["head"]))  # bf16/f32 tensors untouched
    err = np.abs(np.asarray(params["layers"]["experts_w1"]) - np.asarray(plain["layers"]["experts_w1"])).max()
    assert 0 < err <= 0.5 * np.abs(np.asarray(plain["layers"]["experts_w1"])).max()
    checkpoint.convert(tmp_path / "q", tmp_path / "jax")  # converts (dequantized) through the CLI's path
    assert "quantization_config" not in json.loads((tmp_path / "jax" / "dspark_jax.json").read_text())["config"]


def _copy_fixture(dst, **config_changes):
    shutil.copytree(FIX / "target", dst)
    hf = json.loads((dst / "config.json").read_text())
    hf.update(config_changes)
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def _convert_fails(src, dst, capsys, match: str):
    assert cli.main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and match in err, err
    assert not dst.exists()


def test_bad_checkpoints_are_one_line_exit_2(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file
    # a truncated tid2eid
    bad = _copy_fixture(tmp_path / "tid")
    t = load_file(str(bad / "model.safetensors"))
    t["layers.0.ffn.gate.tid2eid"] = t["layers.0.ffn.gate.tid2eid"][:-1]
    save_file(t, str(bad / "model.safetensors"))
    _convert_fails(bad, tmp_path / "o1", capsys, "layers.0.ffn.gate.tid2eid")
    # a tid2eid naming an expert that does not exist (8 experts)
    t["layers.0.ffn.gate.tid2eid"] = np.full((512, 2), 8, np.int64)
    save_file(t, str(bad / "model.safetensors"))
    _convert_fails(bad, tmp_path / "o1", capsys, "[0, 8)")
    # a tid2eid of floats
    t["layers.0.ffn.gate.tid2eid"] = np.zeros((512, 2), np.float32)
    save_file(t, str(bad / "model.safetensors"))
    _convert_fails(bad, tmp_path / "o1", capsys, "tid2eid")
    # a scale tensor of the wrong block count
    _write_quantized(tmp_path / "scale", bad_scale="layers.2.attn.wo_a.scale")
    _convert_fails(tmp_path / "scale", tmp_path / "o2", capsys, "layers.2.attn.wo_a.scale")
    # an unknown expert_dtype, an attention type we don't implement
    _convert_fails(_copy_fixture(tmp_path / "ed", expert_dtype="int4"), tmp_path / "o3", capsys, "expert_dtype")
    _convert_fails(_copy_fixture(tmp_path / "at", compress_ratios=[0, 4, 128, 16, 128, 0]), tmp_path / "o4",
                   capsys, "compress_ratios")


def test_mtp_tensors_are_kept_aside_byte_for_byte(tmp_path, capsys):
    """``mtp.*`` (the in-checkpoint DSpark module, read by the next issue) is not part of the target
    model; conversion keeps it, unchanged (float8 included), in aside.safetensors both ways."""
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.numpy import load_file
    from safetensors.torch import save_file
    src = tmp_path / "src"
    shutil.copytree(FIX / "target", src)
    tensors = {k: torch.from_numpy(v) for k, v in load_file(str(src / "model.safetensors")).items()}
    mtp = {"mtp.0.main_proj.weight": torch.randn(64, 192).to(torch.float8_e4m3fn),
           "mtp.0.main_proj.scale": torch.ones(1, 2).to(torch.float8_e8m0fnu),
           "mtp.2.markov_head.markov_w1": torch.randn(512, 16)}
    save_file({**tensors, **mtp}, str(src / "model.safetensors"))
    assert cli.main(["convert", str(src), str(tmp_path / "jax")]) == 0
    assert "mtp." in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "jax"), str(tmp_path / "torch"), "--to", "torch"]) == 0
    for out in ("jax", "torch"):
        with safe_open(str(tmp_path / out / formats.ASIDE_NAME), "pt") as f:
            assert sorted(f.keys()) == sorted(mtp)
            for k, v in mtp.items():
                assert f.get_tensor(k).dtype == v.dtype and torch.equal(f.get_tensor(k).view(torch.uint8),
                                                                         v.view(torch.uint8)), k
    checkpoint.load_target(tmp_path / "torch")  # the target itself is unaffected


def test_stream_load_dequantizes_onto_an_expert_mesh(tmp_path):
    """convert/streaming.py reads a quantized V4 checkpoint slice by slice onto an expert=4 x
    tensor=2 mesh (each device's experts only), equal to the whole-checkpoint loader; the
    transformers layout streams too."""
    from dspark_jax import sharding
    from dspark_jax.convert import streaming
    from dspark_jax.target.deepseek_v4 import DeepseekV4Config
    _write_quantized(tmp_path / "q")
    _, want = checkpoint.load_target(tmp_path / "q")
    mesh = sharding.make_mesh("expert=4,tensor=2")
    cfg = DeepseekV4Config.from_hf(json.loads((tmp_path / "q" / "config.json").read_text()))
    got = streaming.stream_load(tmp_path / "q", cfg, mesh)
    assert got["layers"]["experts_w2"].sharding.spec[1] == "expert"
    for path, leaf in jax_leaves(got).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(jax_leaves(want)[path]), err_msg=path)
    hf_cfg, hf_want = checkpoint.load_target(FIX / "target_hf")
    hf_got = streaming.stream_load(FIX / "target_hf", hf_cfg, mesh)
    for path, leaf in jax_leaves(hf_got).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(jax_leaves(hf_want)[path]), err_msg=path)


def jax_leaves(tree) -> dict:
    from flax import traverse_util
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}
