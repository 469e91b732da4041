"""Exports for serving engines: each engine's load rules, checked by an independent checker.

The checkers below are written from the engines' own loader code (file named on each
checker), not from dspark_jax/convert/engines.py; the test asserts the two agree for every
head type x engine, that a hand-broken export fails each checker rule, and that weight files
are 0644.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open

from dspark_jax.cli import main as cli_main
from dspark_jax.config import DraftConfig
from dspark_jax.convert import checkpoint, engines, export, mapping, safetensors_io
from dspark_jax.draft import model
from dspark_jax.errors import ConfigError

TINY = Path(__file__).parent / "fixtures" / "dspark_qwen3_tiny"
HEADS = ("vanilla", "gated", "rnn", "dflash", "no_confidence")
QWEN3_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight")


class Refused(AssertionError):
    pass


def need(cond, why):
    if not cond:
        raise Refused(why)


# --------------------------------------------------------------------------- export reading

def read_export(d: Path):
    hf = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), framework="np") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return hf, shapes


def tapped_ids(hf):
    """The engines' resolution: dflash_config.target_layer_ids first, then target_layer_ids."""
    return list((hf.get("dflash_config") or {}).get("target_layer_ids", hf.get("target_layer_ids")))


def check_files_readable(d: Path):
    for f in d.iterdir():
        need(stat.S_IMODE(f.stat().st_mode) & 0o044 == 0o044, f"{f.name} is not world-readable")


def check_backbone(hf, shapes, engine):
    h, n_layers = hf["hidden_size"], hf["num_hidden_layers"]
    for k in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        need(k in shapes, f"{engine}: missing {k}")
    need(shapes["fc.weight"] == (h, len(tapped_ids(hf)) * h), f"{engine}: fc.weight shape")
    for i in range(n_layers):
        for s in QWEN3_LAYER:
            need(f"layers.{i}.{s}" in shapes, f"{engine}: missing layers.{i}.{s}")


def checker_vllm(d: Path):
    """vllm/model_executor/models/qwen3_dspark.py (Qwen3DSparkModel, load_weights via
    AutoWeightsLoader: unknown tensors raise), vllm/config/speculative.py (architecture,
    tapped layers +1, n_predict), eagle3_utils.py (aux capture at id+1; point 0 is the embedding, so -1 is served)."""
    check_files_readable(d)
    hf, shapes = read_export(d)
    need("Qwen3DSparkModel" in hf.get("architectures", []), "vllm: architectures lacks Qwen3DSparkModel")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "mask_token_id", "markov_rank"):
        need(k in hf, f"vllm: config lacks {k}")
    need(hf.get("n_predict") == hf["block_size"], "vllm: n_predict missing (num_speculative_tokens)")
    aux = [i + 1 for i in tapped_ids(hf)]  # point 0 (id -1) is the embedding (vllm 0.33.0, run)
    need(0 <= min(aux) and max(aux) <= hf["num_target_layers"], "vllm: aux capture point out of range")
    v, h, r = hf["vocab_size"], hf["hidden_size"], hf["markov_rank"]
    need(r >= 0, "vllm: DSparkMarkovHead is always built (rank 0: empty, vllm 0.33.0 run)")
    check_backbone(hf, shapes, "vllm")
    if r > 0:
        need(shapes.get("markov_head.markov_w1.weight") == (v, r), "vllm: markov_w1 missing/wrong shape")
        need(shapes.get("markov_head.markov_w2.weight") == (v, r), "vllm: markov_w2 missing/wrong shape")
    else:
        need(not any(k.startswith("markov_head.") for k in shapes), "vllm: markov tensors for an empty head")
    allowed = {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
               "markov_head.markov_w2.weight", "embed_tokens.weight", "lm_head.weight", "d2t", "t2d",
               "confidence_head.proj.weight", "confidence_head.proj.bias"}
    allowed |= {f"layers.{i}.{s}" for i in range(hf["num_hidden_layers"]) for s in QWEN3_LAYER}
    extra = sorted(set(shapes) - allowed)
    need(not extra, f"vllm: no module for tensors {extra}")
    if hf.get("enable_confidence_head") and "confidence_head.proj.weight" in shapes:
        dim = h + (r if hf.get("confidence_head_with_markov") else 0)
        need(shapes["confidence_head.proj.weight"] == (1, dim), "vllm: confidence head input dim")
        need(shapes.get("confidence_head.proj.bias") == (1,), "vllm: confidence head built with bias")


def checker_sglang(d: Path):
    """python/sglang/srt/models/dspark.py (EntryClass, DSparkDraftMixin, build_markov_head,
    build_confidence_head, load_weights), speculative/dspark_components/dspark_config.py,
    dflash_utils.py (resolve_target_layer_ids), models/qwen3.py (capture at id+1),
    dspark_sts.py / dspark_sps.py (sidecar JSON)."""
    check_files_readable(d)
    hf, shapes = read_export(d)
    need(hf.get("architectures", [None])[0] == "Qwen3DSparkModel", "sglang: architectures[0]")
    need(hf.get("speculators_model_type") != "dspark", "sglang: speculators convention refused")
    r = int(hf.get("markov_rank", 0))
    need(r > 0, "sglang: markov_rank must be > 0")
    head = hf.get("markov_head_type")
    need(head in ("vanilla", "gated", "rnn"), "sglang: markov_head_type required")
    need(hf.get("mask_token_id") is not None and hf["mask_token_id"] < hf["vocab_size"],
         "sglang: mask_token_id must be < target vocab")
    n = hf["num_target_layers"]
    need(all(0 <= i <= n - 2 for i in tapped_ids(hf)), "sglang: layer id outside [0, N-2]")
    check_backbone(hf, shapes, "sglang")
    v, h = hf["vocab_size"], hf["hidden_size"]
    want = {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
    if head == "gated":
        want.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
    if head == "rnn":
        want.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + h),
                     "markov_head.joint_proj.bias": (3 * r,)})
    markov = {k: s for k, s in shapes.items() if k.startswith("markov_head.")}
    need(markov == want, f"sglang: markov tensors {sorted(markov)} != {sorted(want)}")
    with_markov = hf.get("confidence_head_with_markov", r > 0)
    dim = h + (r if with_markov else 0)
    need(shapes.get("confidence_head.proj.weight") == (1, dim), "sglang: confidence_head.proj.weight missing")
    need(shapes.get("confidence_head.proj.bias") == (1,), "sglang: confidence_head.proj.bias missing")
    if (d / engines.STS_FILE).exists():
        sts = json.loads((d / engines.STS_FILE).read_text())
        need(set(sts) <= {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}, "sts keys")
        need(sts["temperatures"] and all(t > 0 for t in sts["temperatures"]), "sts temperatures > 0")
    if (d / engines.SPS_FILE).exists():
        sps = json.loads((d / engines.SPS_FILE).read_text())
        bt = sps["sample_batch_tokens"]
        need(bt == sorted(set(bt)) and len(bt) == len(sps["sample_steps_per_sec"]), "sps probes")
        need(sps["max_batch_tokens"] >= bt[-1], "sps max_batch_tokens")


def checker_sglang_jax(d: Path):
    """python/sgl_jax/srt/models/dspark.py + speculative/dspark_worker.py (sglang-jax PR #1632,
    per SERVING.md): Qwen3DSparkModel, vanilla Markov head only; models/qwen3.py
    set_dflash_layers_to_capture (id+1, None residual handled: -1 works, capture point < N);
    speculative/dflash_util.py (block_size > 1)."""
    check_files_readable(d)
    hf, shapes = read_export(d)
    need(hf.get("architectures", [None])[0] == "Qwen3DSparkModel", "sglang-jax: architectures[0]")
    need(int(hf.get("markov_rank", 0)) > 0, "sglang-jax: markov_rank > 0")
    n = hf["num_target_layers"]
    need(all(-1 <= i <= n - 2 for i in tapped_ids(hf)), "sglang-jax: capture point id+1 >= N")
    need(hf["block_size"] > 1, "sglang-jax: block_size must be > 1")
    check_backbone(hf, shapes, "sglang-jax")
    markov = {k for k in shapes if k.startswith("markov_head.")}
    need(markov == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"},
         f"sglang-jax: vanilla Markov head only, got {sorted(markov)}")


def checker_deepspec(d: Path):
    """DeepSpec deepspec/modeling/dspark/qwen3/modeling.py from_pretrained, via the independent
    strict-state-dict stand-in tests/torch_dspark.py."""
    pytest.importorskip("torch")
    from torch_dspark import TorchDSpark

    check_files_readable(d)
    try:
        TorchDSpark.from_pretrained(d)
    except (AssertionError, RuntimeError, KeyError) as e:
        raise Refused(f"deepspec: {e}") from None


CHECKERS = {"deepspec": checker_deepspec, "vllm": checker_vllm, "sglang": checker_sglang,
            "sglang-jax": checker_sglang_jax}


# --------------------------------------------------------------------------- drafters

def head_config(base: DraftConfig, head: str) -> DraftConfig:
    if head in ("gated", "rnn"):
        return base.replace(markov_head_type=head)
    if head == "dflash":
        return base.replace(markov_rank=0, confidence_head_with_markov=False)
    if head == "no_confidence":
        return base.replace(enable_confidence_head=False)
    return base


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


def naive_export(src: Path, dst: Path, engine: str):
    """What an export without the engine check would write (transforms applied)."""
    cfg, params = checkpoint.load_draft(src)
    dst.mkdir()
    safetensors_io.write_tensors(dst, mapping.draft_to_torch(cfg, jax.tree.map(np.asarray, params)))
    (dst / "config.json").write_text(json.dumps(engines.export_config(cfg.to_hf(), cfg, engine)))


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

def _edit_config(d, **changes):
    hf = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    (d / "config.json").write_text(json.dumps(hf))


def _edit_tensors(d, drop=(), add=None):
    from safetensors.numpy import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    for k in drop:
        t.pop(k)
    t.update(add or {})
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(d / "model.safetensors", 0o644)


def _ids(d, ids):
    hf = json.loads((d / "config.json").read_text())
    _edit_config(d, target_layer_ids=ids, dflash_config={**hf.get("dflash_config", {}), "target_layer_ids": ids})


BREAKS = {
    "vllm": {
        "architecture": lambda d: _edit_config(d, architectures=["LlamaForCausalLM"]),
        "config field": lambda d: _edit_config(d, mask_token_id=None),
        "n_predict": lambda d: _edit_config(d, n_predict=None),
        "layer id N": lambda d: _ids(d, [0, 2, 6]),
        "markov_rank 0": lambda d: _edit_config(d, markov_rank=0),
        "missing markov tensor": lambda d: _edit_tensors(d, drop=["markov_head.markov_w1.weight"]),
        "extra tensor": lambda d: _edit_tensors(d, add={"markov_head.gate_proj.weight": np.zeros((64, 128), np.float32)}),
        "confidence dim": lambda d: _edit_config(d, confidence_head_with_markov=False),
        "confidence bias": lambda d: _edit_tensors(d, drop=["confidence_head.proj.bias"]),
        "backbone tensor": lambda d: _edit_tensors(d, drop=["layers.1.mlp.up_proj.weight"]),
        "mode 0600": lambda d: os.chmod(d / "model.safetensors", 0o600),
    },
    "sglang": {
        "architecture": lambda d: _edit_config(d, architectures=["DSparkDraftModel"]),
        "speculators": lambda d: _edit_config(d, speculators_model_type="dspark"),
        "markov_rank 0": lambda d: _edit_config(d, markov_rank=0),
        "head type": lambda d: _edit_config(d, markov_head_type=None),
        "mask token": lambda d: _edit_config(d, mask_token_id=512),
        "layer id -1": lambda d: _ids(d, [-1, 2, 4]),
        "layer id N-1": lambda d: _ids(d, [0, 2, 5]),
        "confidence missing": lambda d: _edit_tensors(d, drop=["confidence_head.proj.weight"]),
        "gated tensors missing": lambda d: _edit_config(d, markov_head_type="gated"),
        "backbone tensor": lambda d: _edit_tensors(d, drop=["fc.weight"]),
        "bad sts": lambda d: (d / engines.STS_FILE).write_text(json.dumps({"temperatures": [0.0]})),
        "bad sps": lambda d: (d / engines.SPS_FILE).write_text(json.dumps(
            {"sample_batch_tokens": [8, 4], "sample_steps_per_sec": [1.0, 2.0], "max_batch_tokens": 8})),
        "mode 0600": lambda d: os.chmod(d / "config.json", 0o600),
    },
    "sglang-jax": {
        "architecture": lambda d: _edit_config(d, architectures=["Gemma4DSparkModel"]),
        "markov_rank 0": lambda d: _edit_config(d, markov_rank=0),
        "layer id N-1": lambda d: _ids(d, [0, 2, 5]),
        "block size 1": lambda d: _edit_config(d, block_size=1, n_predict=1),
        "gated tensors": lambda d: _edit_tensors(d, add={"markov_head.gate_proj.bias": np.zeros((64,), np.float32)}),
        "backbone tensor": lambda d: _edit_tensors(d, drop=["norm.weight"]),
        "mode 0600": lambda d: os.chmod(d / "model.safetensors", 0o600),
    },
    "deepspec": {
        "architecture": lambda d: _edit_config(d, architectures=["Qwen3ForCausalLM"]),
        "missing tensor": lambda d: _edit_tensors(d, drop=["hidden_norm.weight"]),
        "extra tensor": lambda d: _edit_tensors(d, add={"d2t": np.zeros((4,), np.float32)}),
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


def test_gemma4_rules_are_data():
    """Gemma4 rules recorded from vLLM's gemma4_dspark.py apply only to the gemma4 family."""
    f = engines.DraftFacts(family="gemma4", markov_rank=64, markov_head_type="vanilla",
                           enable_confidence_head=True, confidence_head_with_markov=True,
                           target_layer_ids=(0, 2), num_target_layers=6, block_size=7, mask_token_id=1,
                           vocab_size=10, attention_k_eq_v=False)
    assert "k = v" in engines.check(f, "vllm")
    assert "no gemma4" in engines.check(f, "sglang")
    assert engines.check(f, "deepspec") is None
    assert engines.violations(f, "vllm", "warning") == []  # vllm 0.33.0 loads its confidence head
    assert engines.ARCHITECTURES["vllm"]["gemma4"] == "Gemma4DSparkModel"


# =========================================================================== Gemma4 drafters
#
# The Gemma4 checkers are written from the engines' Gemma4 DSpark loaders:
#   vLLM  vllm/model_executor/models/gemma4_dspark.py (Gemma4DSparkAttention, Gemma4DSparkModel,
#         Gemma4DSparkForCausalLM.load_weights), gemma4_mtp.py (Gemma4MTPDecoderLayer: tensors,
#         rope_parameters[layer_type]), vllm/transformers_utils/configs/gemma4.py
#         (gemma4_layer_config: global_head_dim / num_global_key_value_heads on full layers),
#         models/gemma4.py (Gemma4Model.forward: aux capture 0 = scaled embedding, residual None),
#         models/registry.py ("Gemma4DSparkModel" -> Gemma4DSparkForCausalLM);
#   SGLang python/sglang/srt/models/dspark.py (EntryClass = [Qwen3DSparkModel] only);
#   sglang-jax python/sgl_jax/srt/models/dspark.py (EntryClass = Qwen3DSparkModel only);
#   DeepSpec deepspec/modeling/dspark/gemma4/{config,modeling}.py (Gemma4DSparkModel, strict
#         state dict; names as our fixture tests/fixtures/dspark_gemma4_tiny/draft written by it).

G4 = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny" / "draft"
G4_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
            "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight", "layer_scalar")


def g4_expected(hf):
    """Every tensor (name -> torch shape) a Gemma4DSparkModel state dict holds for config ``hf``."""
    v, h, n = hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"]
    d = hf.get("global_head_dim") or hf["head_dim"]
    kv = (hf.get("num_global_key_value_heads") or hf["num_key_value_heads"]) if hf.get("attention_k_eq_v") \
        else hf["num_key_value_heads"]
    nq, inter, r = hf["num_attention_heads"], hf["intermediate_size"], int(hf.get("markov_rank", 0))
    out = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "fc.weight": (h, len(tapped_ids(hf)) * h),
           "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(n):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                    p + "self_attn.o_proj.weight": (h, nq * d), p + "self_attn.q_norm.weight": (d,),
                    p + "self_attn.k_norm.weight": (d,), p + "mlp.gate_proj.weight": (inter, h),
                    p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
                    p + "layer_scalar": (1,)})
        out.update({p + f"{k}.weight": (h,) for k in ("input_layernorm", "post_attention_layernorm",
                                                     "pre_feedforward_layernorm", "post_feedforward_layernorm")})
        if not hf.get("attention_k_eq_v"):
            out[p + "self_attn.v_proj.weight"] = (kv * d, h)
    if r > 0:
        out.update({"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)})
        head = hf.get("markov_head_type", "vanilla")
        if head == "gated":
            out.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
        if head == "rnn":
            out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + h), "markov_head.joint_proj.bias": (3 * r,)})
    if hf.get("enable_confidence_head"):
        dim = h + (r if hf.get("confidence_head_with_markov") else 0)
        out.update({"confidence_head.proj.weight": (1, dim), "confidence_head.proj.bias": (1,)})
    return out


def checker_vllm_gemma4(d: Path):
    """vllm gemma4_dspark.py: Gemma4DSparkForCausalLM over a self-contained checkpoint (own
    embed_tokens / lm_head: dspark_shares_target_embeddings = False); load_weights loads
    confidence_head.* when present (0.33.0) and silently ignores names without a parameter, and vLLM's default loader
    then refuses parameters left unloaded; DSparkMarkovHead always built (markov_rank > 0);
    _build_fused_kv_buffers asserts attention_k_eq_v on every (full_attention) layer; rope from
    rope_parameters['full_attention'] (gemma4_mtp.py); logits softcapped by
    final_logit_softcapping; target layer ids from dspark_target_layer_ids or target_layer_ids
    (+1; gemma4.py captures index 0 before the first layer, so -1 is fine, up to N-1)."""
    check_files_readable(d)
    hf, shapes = read_export(d)
    need(hf.get("architectures", [None])[0] == "Gemma4DSparkModel", "vllm: architectures[0] for Gemma4")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "mask_token_id", "markov_rank", "rms_norm_eps",
              "max_position_embeddings", "final_logit_softcapping", "hidden_activation"):
        need(hf.get(k) is not None, f"vllm: config lacks {k}")
    need(hf["hidden_activation"] == "gelu_pytorch_tanh", "vllm: Gemma4MLP needs gelu_pytorch_tanh")
    need(hf.get("n_predict") == hf["block_size"], "vllm: n_predict missing (num_speculative_tokens)")
    need(int(hf["markov_rank"]) > 0, "vllm: DSparkMarkovHead is always built (markov_rank > 0)")
    lt = hf.get("layer_types") or []
    need(len(lt) == hf["num_hidden_layers"] and set(lt) == {"full_attention"},
         "vllm: layer_types must list full_attention for every drafter layer")
    need(hf.get("attention_k_eq_v") is True, "vllm: _build_fused_kv_buffers asserts attention_k_eq_v")
    rope = (hf.get("rope_parameters") or {}).get("full_attention") or {}
    need("rope_theta" in rope and "partial_rotary_factor" in rope,
         "vllm: rope_parameters['full_attention'] (theta, partial_rotary_factor) missing")
    n = hf["num_target_layers"]
    ids = list(hf.get("dspark_target_layer_ids") or hf["target_layer_ids"])
    need(ids == tapped_ids(hf), "vllm: dflash_config / target_layer_ids disagree")
    need(all(-1 <= i <= n - 1 for i in ids), "vllm: capture point id+1 outside [0, N]")
    # DSparkMarkovHead is the vanilla head whatever markov_head_type says
    want = {k: s for k, s in g4_expected({**hf, "markov_head_type": "vanilla"}).items()
            if not k.startswith("confidence_head.")}
    missing = sorted(set(want) - set(shapes))
    need(not missing, f"vllm: parameters not initialized from checkpoint: {missing}")
    bad = sorted(k for k in want if shapes[k] != want[k])
    need(not bad, f"vllm: wrong shapes {bad}")
    ignored = sorted(k for k in set(shapes) - set(want) if not k.startswith("confidence_head."))
    need(not ignored, f"vllm: tensors silently skipped by load_weights (wrong drafter): {ignored}")


def checker_deepspec_gemma4(d: Path):
    """DeepSpec deepspec/modeling/dspark/gemma4/modeling.py Gemma4DSparkModel.from_pretrained:
    architectures[0] 'Gemma4DSparkModel', strict state dict (every tensor of g4_expected, no other)."""
    check_files_readable(d)
    hf, shapes = read_export(d)
    need(hf.get("architectures", [None])[0] == "Gemma4DSparkModel", "deepspec: architectures[0]")
    want = g4_expected(hf)
    need(set(shapes) == set(want), f"deepspec: state dict keys differ: "
         f"missing {sorted(set(want) - set(shapes))}, unexpected {sorted(set(shapes) - set(want))}")
    need(all(shapes[k] == want[k] for k in want), "deepspec: tensor shape mismatch")


def checker_for(d: Path, engine: str):
    hf = json.loads((d / "config.json").read_text())
    if hf.get("architectures", [None])[0] == "Gemma4DSparkModel" or hf.get("target_model_type", "").startswith("gemma4"):
        return {"vllm": checker_vllm_gemma4, "deepspec": checker_deepspec_gemma4}.get(engine, CHECKERS[engine])
    return CHECKERS[engine]


@pytest.fixture(scope="module")
def g4_base():
    from dspark_jax.draft.gemma4 import Gemma4DraftConfig
    return Gemma4DraftConfig.from_hf(json.loads((G4 / "config.json").read_text()))


def g4_head_config(base, head):
    return base.replace(target_layer_ids=(-1, 2, 4)) if head == "tap_minus_1" else head_config(base, head)


@pytest.fixture(scope="module")
def g4_drafters(tmp_path_factory, g4_base):
    from dspark_jax import families
    root = tmp_path_factory.mktemp("g4")
    out = {}
    for i, head in enumerate(HEADS + ("tap_minus_1",)):
        cfg = g4_head_config(g4_base, head)
        params = families.init_params(cfg, jax.random.key(100 + i))
        out[head] = checkpoint.save_draft(root / head, cfg, params, format="torch")
    return out


@pytest.mark.parametrize("engine", engines.ENGINES)
@pytest.mark.parametrize("head", HEADS + ("tap_minus_1",))
def test_gemma4_export_passes_checker_or_is_refused(tmp_path, g4_drafters, engine, head):
    src = g4_drafters[head]
    cfg, _ = checkpoint.load_draft(src)
    assert engines.facts(cfg).family == "gemma4"
    reason = engines.check(cfg, engine)
    dst = tmp_path / "out"
    if reason is None:
        export.export_draft(src, dst, engine)
        checker_for(dst, engine)(dst)
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in dst.iterdir())
    else:
        with pytest.raises(ConfigError, match=f"{engine} rule"):
            export.export_draft(src, dst, engine)
        assert not dst.exists()
        if engine in ("sglang", "sglang-jax"):  # no Gemma4 class: export_config itself refuses
            with pytest.raises(ConfigError, match="no gemma4"):
                engines.export_config(cfg.to_hf(), cfg, engine)
            return
        naive_export(src, tmp_path / "naive", engine)
        with pytest.raises(Refused):
            checker_for(tmp_path / "naive", engine)(tmp_path / "naive")


G4_EXPECTED = {("vllm", "gated"), ("vllm", "rnn"), ("vllm", "dflash")} | {
    (e, h) for e in ("sglang", "sglang-jax") for h in HEADS + ("tap_minus_1",)}


def test_gemma4_refusal_matrix(g4_base):
    got = {(e, h) for h in HEADS + ("tap_minus_1",) for e in engines.ENGINES
           if engines.check(g4_head_config(g4_base, h), e)}
    assert got == G4_EXPECTED
    assert "silently skips" in engines.check(g4_head_config(g4_base, "gated"), "vllm")
    # the k = v rule, from the drafter's own config
    no_kv = g4_base.replace(text=g4_base.text.replace(attention_k_eq_v=False))
    assert "attention_k_eq_v" in engines.check(no_kv, "vllm") and engines.check(no_kv, "deepspec") is None
    w = engines.serving_warnings(g4_base, ["vllm", "sglang"])
    assert not any("vllm" in x for x in w) and any("no gemma4" in x for x in w)  # vllm 0.33.0 loads it all


G4_BREAKS = {
    "vllm": {
        "architecture": lambda d: _edit_config(d, architectures=["Qwen3DSparkModel"]),
        "k_eq_v off": lambda d: _edit_config(d, attention_k_eq_v=False),
        "layer_types": lambda d: _edit_config(d, layer_types=["sliding_attention", "full_attention"]),
        "rope full_attention": lambda d: _edit_config(d, rope_parameters={"rope_theta": 10000.0}),
        "softcap": lambda d: _edit_config(d, final_logit_softcapping=None),
        "n_predict": lambda d: _edit_config(d, n_predict=None),
        "markov_rank 0": lambda d: _edit_config(d, markov_rank=0),
        "layer id N": lambda d: _ids(d, [0, 2, 6]),
        "own lm_head": lambda d: _edit_tensors(d, drop=["lm_head.weight"]),
        "own embed_tokens": lambda d: _edit_tensors(d, drop=["embed_tokens.weight"]),
        "layer_scalar": lambda d: _edit_tensors(d, drop=["layers.0.layer_scalar"]),
        "k_proj shape": lambda d: _edit_tensors(d, add={"layers.1.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}),
        "gated tensors skipped": lambda d: _edit_tensors(d, add={"markov_head.gate_proj.bias": np.zeros((64,), np.float32)}),
        "mode 0600": lambda d: os.chmod(d / "model.safetensors", 0o600),
    },
    "deepspec": {
        "architecture": lambda d: _edit_config(d, architectures=["Gemma4ForCausalLM"]),
        "missing confidence": lambda d: _edit_tensors(d, drop=["confidence_head.proj.bias"]),
        "extra v_proj under k=v": lambda d: _edit_tensors(d, add={"layers.0.self_attn.v_proj.weight": np.zeros((32, 64), np.float32)}),
        "mode 0600": lambda d: os.chmod(d / "config.json", 0o600),
    },
}


@pytest.fixture(scope="module")
def g4_good_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("g4good")
    out = {}
    for engine in G4_BREAKS:
        out[engine] = root / engine
        export.export_draft(G4, out[engine], engine)
        checker_for(out[engine], engine)(out[engine])
    return out


@pytest.mark.parametrize("engine,rule", [(e, r) for e, rs in G4_BREAKS.items() for r in rs])
def test_gemma4_hand_broken_export_fails_checker(tmp_path, g4_good_exports, engine, rule):
    d = tmp_path / "broken"
    shutil.copytree(g4_good_exports[engine], d)
    checker_for(d, engine)(d)
    G4_BREAKS[engine][rule](d)
    with pytest.raises(Refused):
        checker_for(d, engine)(d)


def test_gemma4_export_reloads_and_cli(tmp_path, g4_good_exports, g4_drafters, capsys):
    d = g4_good_exports["vllm"]
    hf = json.loads((d / "config.json").read_text())
    assert hf["architectures"] == ["Gemma4DSparkModel"] and hf["n_predict"] == 7
    assert hf["dflash_config"]["target_layer_ids"] == hf["target_layer_ids"] == [0, 2, 4]
    cfg, params = checkpoint.load_draft(d)
    ref_cfg, ref = checkpoint.load_draft(G4)
    assert cfg == ref_cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rc = cli_main(["export", str(G4), str(tmp_path / "s"), "--engine", "sglang"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no gemma4" in err[0] and not (tmp_path / "s").exists()
    assert cli_main(["export", str(G4), str(tmp_path / "v"), "--engine", "vllm"]) == 0
    assert "note:" not in capsys.readouterr().out  # vllm 0.33.0 loads the confidence head too
    assert cli_main(["inspect", str(g4_drafters["gated"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "gemma4" and info["architecture"] == "Gemma4DSparkModel" and info["head"] == "gated"
    assert info["tensors"] == 37 and info["engines"]["deepspec"]["loadable"]
    assert not info["engines"]["vllm"]["loadable"] and "silently skips" in info["engines"]["vllm"]["why_not"]
    assert info["engines"]["vllm"]["checked"] == [engines.CHECKED["vllm"]]
    assert info["engines"]["speculators"]["checked"] == ["read"]  # only Qwen3 drafters run there
    assert cli_main(["inspect", str(G4)]) == 0
    text = capsys.readouterr().out
    assert "family gemma4 (Gemma4DSparkModel)" in text and len(text.splitlines()) <= 24
