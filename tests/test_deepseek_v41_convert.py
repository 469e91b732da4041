"""DeepSeek-V4.1 checkpoints at the command line: ``inspect`` describes one (CSA2 sources, Engram
layers, the DSpark module with attention-input taps), and bad input is refused in one line with
exit code 2 before any tensor data is read (config without ``text_config``, compress ratios of the
wrong length, a wrong-shaped Engram or CSA2 tensor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import cli, families

FIX = Path(__file__).parent / "fixtures" / "deepseek_v41_tiny"


def test_inspect_describes_a_v41_checkpoint_with_its_dspark_module(capsys):
    assert cli.main(["inspect", str(FIX / "target_dspark"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "deepseek_v41" and info["engram_layer_ids"] == [1, 4]
    assert info["csa2"]["kv_source_layer_ids"] == [2, 4, 5] and info["compress_ratios"] == [0, 0, 2, 2, 2, 1, 1, 1]
    assert info["aside"]["mtp_stages"] == [0, 1, 2]
    assert info["dspark"]["taps"] == "attention inputs" and info["dspark"]["target_layer_ids"] == [5, 6, 7]
    assert info["dspark"]["experts"] == "4 routed (top 3) + 1 shared"


def _variant(tmp_path, name, *, tensors=None, edit=None):
    from safetensors.numpy import load_file, save_file
    d = tmp_path / name
    shutil.copytree(FIX / "target", d)
    if tensors:
        t = load_file(str(d / "model.safetensors"))
        t.update(tensors)
        save_file(t, str(d / "model.safetensors"))
    hf = json.loads((d / "config.json").read_text())
    if edit:
        edit(hf)
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.mark.parametrize("case, match", [
    ("no-text-config", "field 'text_config' is missing"),
    ("ratios-length", "compress_ratios has 9 entries"),
    ("engram-shape", "'layers.1.engram.embed.weight' has shape (100, 32)"),
    ("csa2-shape", "'layers.4.attn.compressor.wgate.weight' has shape (16, 64)"),
])
def test_bad_v41_input_is_one_line_exit_2(tmp_path, capsys, case, match):
    f32 = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    make = {
        "no-text-config": lambda: _variant(tmp_path, case, edit=lambda h: h.pop("text_config")),
        "ratios-length": lambda: _variant(tmp_path, case, edit=lambda h: h["text_config"].update(
            compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0])),
        "engram-shape": lambda: _variant(tmp_path, case, tensors={"layers.1.engram.embed.weight": f32(100, 32)}),
        "csa2-shape": lambda: _variant(tmp_path, case, tensors={"layers.4.attn.compressor.wgate.weight": f32(16, 64)}),
    }
    src = make[case]()
    for command in (["convert", str(src), str(tmp_path / "out")], ["inspect", str(src)]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and match in err, err
    assert not (tmp_path / "out").exists()


def test_v41_flash_preset_parameter_counts():
    """DeepSeek-V4.1-Flash from the declarations: the Engram tables hold 196.6 B rows (transformers'
    docstring: "~196B of the released checkpoint's 763B parameters"), trunk + DSpark module ~763 B
    without the tables' FP8 block scales; 384 experts of width 2304 on 40 layers."""
    from dspark_jax import presets
    from dspark_jax.convert import describe
    from dspark_jax.draft import deepseek_v41 as dv41
    cfg = presets.TARGETS[presets.V41_FLASH]
    specs = families.declare(cfg)
    rows = sum(int(np.prod(s.shape)) for p, s in specs.items() if p[0] == "engram_table" and p[-1] == "rows")
    scales = sum(int(np.prod(s.shape)) for p, s in specs.items() if p[0] == "engram_table" and p[-1] == "scale")
    assert rows == (384006168 + 384016682) * 256
    counts = describe._param_counts(cfg)
    assert counts["routed_experts"] == 40 * 384 * 3 * 5120 * 2304
    assert counts["embedding_and_head"] == 2 * 129280 * 5120
    module = dv41.DeepseekV41DSparkConfig.from_hf(cfg.to_hf())
    assert module.target_layer_ids == (("attn_in", 37), ("attn_in", 38), ("attn_in", 39))
    stage = sum(int(np.prod(s.shape)) for s in dv41.module_specs(module).values())
    assert 762e9 < counts["total"] - scales + stage < 764e9
