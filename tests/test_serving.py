"""Exports for serving engines: each engine's load rules, checked by an independent checker.

The checkers (tests/serving_checks.py) are written from the engines' own loader code (file named
on each checker), not from dspark_jax/convert/engines.py; the test asserts the two agree for every
head type x engine, that a hand-broken export fails each checker rule, and that weight files
are 0644.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import jax
import numpy as np
import pytest

from dspark_jax.cli import main as cli_main
from dspark_jax.config import DraftConfig
from dspark_jax.convert import checkpoint, engines, export, safetensors_io
from dspark_jax.draft import model
from dspark_jax.errors import ConfigError
from tests.serving_checks import (CHECKERS, HEADS, TINY, Refused, edit_config, edit_tensors,
                                  head_config, naive_export, set_tap_ids)


@pytest.fixture(scope="module")
def base_cfg():
    return DraftConfig.from_hf(json.loads((TINY / "draft" / "config.json").read_text()))


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, base_cfg):
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for i, head in enumerate(HEADS + ("tap_minus_1",)):
        cfg = head_config(base_cfg, head) if head != "tap_minus_1" else base_cfg.replace(target_layer_ids=(-1, 2, 4))
        params = model.init_params(cfg, jax.random.key(i))
        out[head] = checkpoint.save_draft(root / head, cfg, params, format="jax")
    return out


@pytest.mark.parametrize("engine", engines.ENGINES)
@pytest.mark.parametrize("head", HEADS + ("tap_minus_1",))
def test_export_passes_checker_or_is_refused(tmp_path, drafters, engine, head):
    src = drafters[head]
    cfg, _ = checkpoint.load_draft(src)
    reason = engines.check(cfg, engine)
    dst = tmp_path / "out"
    if reason is None:
        export.export_draft(src, dst, engine)
        CHECKERS[engine](dst)  # the engine's loader rules accept it
    else:
        with pytest.raises(ConfigError, match=f"{engine} rule"):
            export.export_draft(src, dst, engine)
        assert not dst.exists()
        naive_export(src, tmp_path / "naive", engine)
        with pytest.raises(Refused):  # and the engine's loader would indeed refuse it
            CHECKERS[engine](tmp_path / "naive")


EXPECTED = {  # (engine, head) pairs refused, from the engines' code (see the checkers)
    ("vllm", "gated"), ("vllm", "rnn"),
    ("sglang", "dflash"), ("sglang", "no_confidence"), ("sglang", "tap_minus_1"),
    ("sglang-jax", "gated"), ("sglang-jax", "rnn"), ("sglang-jax", "dflash"),
}


def test_refusal_matrix(base_cfg):
    got = set()
    for head in HEADS + ("tap_minus_1",):
        cfg = head_config(base_cfg, head) if head != "tap_minus_1" else base_cfg.replace(target_layer_ids=(-1, 2, 4))
        for engine in engines.ENGINES:
            if engines.check(cfg, engine):
                got.add((engine, head))
    assert got == EXPECTED


# --------------------------------------------------------------------------- negative cases


BREAKS = {
    "vllm": {
        "architecture": lambda d: edit_config(d, architectures=["LlamaForCausalLM"]),
        "config field": lambda d: edit_config(d, mask_token_id=None),
        "n_predict": lambda d: edit_config(d, n_predict=None),
        "layer id N": lambda d: set_tap_ids(d, [0, 2, 6]),
        "markov_rank 0": lambda d: edit_config(d, markov_rank=0),
        "missing markov tensor": lambda d: edit_tensors(d, drop=["markov_head.markov_w1.weight"]),
        "extra tensor": lambda d: edit_tensors(d, add={"markov_head.gate_proj.weight": np.zeros((64, 128), np.float32)}),
        "confidence dim": lambda d: edit_config(d, confidence_head_with_markov=False),
        "confidence bias": lambda d: edit_tensors(d, drop=["confidence_head.proj.bias"]),
        "backbone tensor": lambda d: edit_tensors(d, drop=["layers.1.mlp.up_proj.weight"]),
        "mode 0600": lambda d: os.chmod(d / "model.safetensors", 0o600),
    },
    "sglang": {
        "architecture": lambda d: edit_config(d, architectures=["DSparkDraftModel"]),
        "speculators": lambda d: edit_config(d, speculators_model_type="dspark"),
        "markov_rank 0": lambda d: edit_config(d, markov_rank=0),
        "head type": lambda d: edit_config(d, markov_head_type=None),
        "mask token": lambda d: edit_config(d, mask_token_id=512),
        "layer id -1": lambda d: set_tap_ids(d, [-1, 2, 4]),
        "layer id N-1": lambda d: set_tap_ids(d, [0, 2, 5]),
        "confidence missing": lambda d: edit_tensors(d, drop=["confidence_head.proj.weight"]),
        "gated tensors missing": lambda d: edit_config(d, markov_head_type="gated"),
        "backbone tensor": lambda d: edit_tensors(d, drop=["fc.weight"]),
        "bad sts": lambda d: (d / engines.STS_FILE).write_text(json.dumps({"temperatures": [0.0]})),
        "bad sps": lambda d: (d / engines.SPS_FILE).write_text(json.dumps(
            {"sample_batch_tokens": [8, 4], "sample_steps_per_sec": [1.0, 2.0], "max_batch_tokens": 8})),
        "mode 0600": lambda d: os.chmod(d / "config.json", 0o600),
    },
    "sglang-jax": {
        "architecture": lambda d: edit_config(d, architectures=["Gemma4DSparkModel"]),
        "markov_rank 0": lambda d: edit_config(d, markov_rank=0),
        "layer id N-1": lambda d: set_tap_ids(d, [0, 2, 5]),
        "block size 1": lambda d: edit_config(d, block_size=1, n_predict=1),
        "gated tensors": lambda d: edit_tensors(d, add={"markov_head.gate_proj.bias": np.zeros((64,), np.float32)}),
        "backbone tensor": lambda d: edit_tensors(d, drop=["norm.weight"]),
        "mode 0600": lambda d: os.chmod(d / "model.safetensors", 0o600),
    },
    "deepspec": {
        "architecture": lambda d: edit_config(d, architectures=["Qwen3ForCausalLM"]),
        "missing tensor": lambda d: edit_tensors(d, drop=["hidden_norm.weight"]),
        "extra tensor": lambda d: edit_tensors(d, add={"d2t": np.zeros((4,), np.float32)}),
        "mode 0600": lambda d: os.chmod(d / "model.safetensors", 0o600),
    },
}


@pytest.fixture(scope="module")
def good_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    sps = root / "sps.json"
    sps.write_text(json.dumps({"batch_sizes": [1, 2, 8], "sps": [40.0, 38.0, 20.0]}))
    src = root / "draft"
    cfg, params = checkpoint.load_draft(TINY / "draft")
    checkpoint.save_draft(src, cfg, params, format="jax", extras={"sts_temperatures": [1.1] * cfg.block_size})
    out = {}
    for engine in engines.ENGINES:
        out[engine] = root / engine
        export.export_draft(src, out[engine], engine, sps=sps)
        CHECKERS[engine](out[engine])
    return out


@pytest.mark.parametrize("engine,rule", [(e, r) for e, rs in BREAKS.items() for r in rs])
def test_hand_broken_export_fails_checker(tmp_path, good_exports, engine, rule):
    d = tmp_path / "broken"
    shutil.copytree(good_exports[engine], d)
    CHECKERS[engine](d)
    BREAKS[engine][rule](d)
    with pytest.raises(Refused):
        CHECKERS[engine](d)


# --------------------------------------------------------------------------- files and sidecars

def test_weight_files_are_world_readable(tmp_path, good_exports):
    for d in good_exports.values():
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    cfg, params = checkpoint.load_draft(TINY / "draft")
    checkpoint.save_draft(tmp_path / "t", cfg, params, format="torch")
    assert stat.S_IMODE((tmp_path / "t" / "model.safetensors").stat().st_mode) == 0o644
    names = safetensors_io.write_tensors(tmp_path, {"a": np.zeros((4, 4), np.float32)}, max_shard_size=40)
    for n in names:
        assert stat.S_IMODE((tmp_path / n).stat().st_mode) & 0o644 == 0o644


def test_sidecars_and_config_transforms(good_exports):
    d = good_exports["sglang"]
    hf = json.loads((d / "config.json").read_text())
    assert hf["dflash_config"]["target_layer_ids"] == hf["target_layer_ids"] == [0, 2, 4]
    assert hf["n_predict"] == hf["block_size"] == 7
    sts = json.loads((d / engines.STS_FILE).read_text())
    assert sts["temperatures"] == [1.1] * 7 and set(sts) == {"temperatures", "dataset", "num_samples",
                                                              "ece_before", "ece_after"}
    sps = json.loads((d / engines.SPS_FILE).read_text())
    assert sps == {"sample_batch_tokens": [8, 16, 64], "sample_steps_per_sec": [40.0, 38.0, 20.0],
                   "max_batch_tokens": 64}
    # the export reloads through our own loader, bit-exactly
    cfg, params = checkpoint.load_draft(d)
    ref_cfg, ref = checkpoint.load_draft(TINY / "draft")
    assert cfg == ref_cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- CLI

def test_cli_export_refuses_with_one_line(tmp_path, drafters, capsys):
    rc = cli_main(["export", str(drafters["gated"]), str(tmp_path / "x"), "--engine", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "vanilla-markov" in err[0], err
    assert not (tmp_path / "x").exists()
    rc = cli_main(["export", str(TINY / "draft"), str(tmp_path / "y"), "--engine", "vllm"])
    assert rc == 0 and (tmp_path / "y" / "model.safetensors").is_file()
    rc = cli_main(["export", str(TINY / "draft"), str(tmp_path / "y"), "--engine", "vllm"])
    assert rc == 2  # exists, no --force
    assert cli_main(["export", str(TINY / "draft"), str(tmp_path / "y"), "--engine", "sglang", "--force"]) == 0


def test_cli_inspect(drafters, capsys):
    assert cli_main(["inspect", str(drafters["gated"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "qwen3" and info["head"] == "gated" and info["block_size"] == 7
    assert info["target_layer_ids"] == [0, 2, 4] and info["tensors"] == 33
    assert info["engines"]["sglang"]["loadable"] and not info["engines"]["vllm"]["loadable"]
    assert "vanilla-markov" in info["engines"]["vllm"]["why_not"]
    assert info["engines"]["vllm"]["checked"] == [engines.CHECKED["vllm"]]
    assert info["engines"]["sglang"]["checked"] == ["read"]
    assert cli_main(["inspect", str(drafters["dflash"])]) == 0
    text = capsys.readouterr().out
    assert "head dflash" in text and "NOT loadable" in text and len(text.splitlines()) <= 24
    assert f"[{engines.CHECKED['vllm']}]" in text and "[rules read from its source]" in text


# --------------------------------------------------------------------------- train warnings

def test_serving_warnings(base_cfg):
    assert engines.serving_warnings(base_cfg, []) == []
    assert engines.serving_warnings(base_cfg, ["vllm", "sglang"]) == []
    w = engines.serving_warnings(base_cfg.replace(target_layer_ids=(-1, 2, 4), markov_head_type="rnn"),
                                 ["vllm", "sglang"])
    assert not any("vllm" in x and "-1" in x for x in w) and any("sglang" in x and "-1" in x for x in w)
    assert any("vllm" in x and "rnn" in x for x in w)
    w = engines.serving_warnings(base_cfg.replace(markov_rank=0, confidence_head_with_markov=False), ["sglang"])
    assert any("DFlash twin" in x for x in w)
    with pytest.raises(ConfigError, match="unknown"):
        engines.serving_warnings(base_cfg, ["tgi"])
