"""`dspark-jax export --engine vllm|sglang` of DeepSeek-V4's DSpark module: the V4 checkpoint with
its ``mtp.*`` tensors and ``dspark_*`` keys replaced by the module, the target's tensors byte for
byte; each engine's V4 load rules (``convert.engines.V4_RULES``, read from its loader) pass on the
export, and every rule has a checkpoint it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dspark_jax.convert import checkpoint, dspark_v4, engines, safetensors_io
from dspark_jax.errors import CheckpointError, ConfigError

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"
SRC = FIX / "target_dspark"


def _facts(path) -> engines.V4Facts:
    return engines.v4_facts(json.loads((Path(path) / "config.json").read_text()),
                            safetensors_io.TensorReader(Path(path)).infos)


def _trained_module():
    """The fixture's module with every float tensor changed (stands in for a trained one)."""
    cfg, params = dspark_v4.load_module(SRC)
    return cfg, jax.tree.map(lambda a: a * 1.5 + 0.01 if a.dtype.kind == "f" else a, params)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export_writes_the_module_into_the_target_checkpoint(tmp_path, engine):
    """A module directory (``save_module``) + --target: DST is the target checkpoint whose mtp.*
    are the module's (bit for bit), the rest of its tensors the source's; the engine's rules pass."""
    from dspark_jax import cli
    cfg, params = _trained_module()
    dspark_v4.save_module(tmp_path / "module", cfg, params)
    dst = tmp_path / engine
    rc = cli.main(["export", str(tmp_path / "module"), str(dst), "--engine", engine, "--target", str(SRC)])
    assert rc in (0, None)
    assert engines.v4_violations(_facts(dst), engine) == []
    got, want = safetensors_io.read_tensors(dst), safetensors_io.read_tensors(SRC)
    assert set(got) == set(want)
    module = dspark_v4.module_tensors(cfg, params)
    for name, t in got.items():
        ref = module[name] if name.startswith("mtp.") else want[name]
        assert t.dtype == ref.dtype and t.tobytes() == ref.tobytes(), name
    assert any(not np.array_equal(module[n], want[n]) for n in module)  # the module did change
    hf = json.loads((dst / "config.json").read_text())
    assert {k: hf[k] for k in dspark_v4.KEYS} == {k: cfg.hf_fields()[k] for k in dspark_v4.KEYS}
    # it decodes as it was exported: load_draft reads the exported module back
    _, back = checkpoint.load_draft(dst)
    np.testing.assert_array_equal(np.asarray(back["main_proj"]), params["main_proj"])


def test_export_refusals(tmp_path):
    cfg, params = _trained_module()
    dspark_v4.save_module(tmp_path / "module", cfg, params)
    with pytest.raises(CheckpointError, match="--target"):
        engines.export_draft(tmp_path / "module", tmp_path / "a", "vllm")
    # a module directory that also holds the target's embedding and head (a train export) is no target
    tensors = {**dspark_v4.module_tensors(cfg, params),
               **{k: v for k, v in safetensors_io.read_tensors(SRC).items() if k in ("embed.weight", "head.weight")}}
    (tmp_path / "with_shared").mkdir()
    safetensors_io.write_tensors(tmp_path / "with_shared", tensors)
    (tmp_path / "with_shared" / "config.json").write_text((tmp_path / "module" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="--target"):
        engines.export_draft(tmp_path / "with_shared", tmp_path / "a", "sglang")
    with pytest.raises(ConfigError, match="served by"):
        engines.export_draft(SRC, tmp_path / "b", "sglang-jax")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # a whole V4 checkpoint exports itself (--target defaults to DRAFT)
    summary = engines.export_draft(SRC, tmp_path / "c", "vllm")
    assert summary["target"] == str(SRC) and summary["warnings"] == []


def _mutated(change):
    f = _facts(SRC)
    hf, tensors = dict(f.hf), dict(f.tensors)
    change(hf, tensors)
    return engines.V4Facts(hf, tensors)


def _drop(name):
    return lambda hf, t: t.pop(name)


def _set(**kv):
    return lambda hf, t: hf.update(kv)


def _two_stages(hf, t, n_mtp=None):
    hf["dspark_target_layer_ids"] = hf["dspark_target_layer_ids"][:2]
    hf["compress_ratios"] = hf["compress_ratios"][:-1]
    if n_mtp is not None:
        hf["n_mtp_layers"] = n_mtp


NEGATIVE = [  # (engine, rule, change): each rule refuses (or warns on) a checkpoint
    ("vllm", "dspark-keys", _set(dspark_block_size=None)),
    ("vllm", "dspark-keys", _set(architectures=["DeepseekV3ForCausalLM"])),
    ("vllm", "stage-count", _two_stages),
    ("vllm", "sliding-stages", lambda hf, t: hf.update(compress_ratios=hf["compress_ratios"][:-1] + [4])),
    ("vllm", "quantized-module", _set(quantization_config={"quant_method": "fp8", "fmt": "e4m3"})),
    ("vllm", "markov-head", _drop("mtp.2.markov_head.markov_w2.weight")),
    ("vllm", "markov-head", _set(dspark_markov_rank=0)),
    ("vllm", "confidence-optional", _drop("mtp.2.confidence_head.proj.weight")),
    ("sglang", "dspark-keys", _set(dspark_noise_token_id=None)),
    ("sglang", "layer-ids", _set(dspark_target_layer_ids=[])),
    ("sglang", "markov-head", _set(dspark_markov_rank=0)),
    ("sglang", "confidence-head-present", _drop("mtp.2.confidence_head.proj.weight")),
    ("sglang", "confidence-with-markov", _set(confidence_head_with_markov=False)),
    ("sglang", "noise-in-vocab", _set(dspark_noise_token_id=512)),
]


@pytest.mark.parametrize("engine, rule, change", NEGATIVE, ids=[f"{e}-{r}-{i}" for i, (e, r, _) in enumerate(NEGATIVE)])
def test_every_v4_rule_refuses_a_checkpoint(engine, rule, change):
    assert engines.v4_violations(_facts(SRC), engine) == []
    r = next(r for r in engines.V4_RULES if r.engine == engine and r.name == rule)
    assert engines.V4_SOURCES[engine].split("/")[-1] in r.source or "dspark_config.py" in r.source
    fired = {x.name for x, _ in engines.v4_violations(_mutated(change), engine, r.severity)}
    assert rule in fired, fired


def test_every_v4_rule_has_a_negative_case():
    covered = {(e, r) for e, r, _ in NEGATIVE}
    assert covered == {(r.engine, r.name) for r in engines.V4_RULES}
    # the stage count is the config's n_mtp_layers when it names one
    named = engines.v4_violations(_mutated(lambda hf, t: _two_stages(hf, t, n_mtp=2)), "vllm")
    assert "stage-count" not in {r.name for r, _ in named}


def test_sts_temperatures_travel_to_sglang(tmp_path):
    """`calibrate --write-draft` of the V4 checkpoint writes a module directory carrying the STS
    temperatures; its SGLang export writes them as SGLang's STS file (vLLM's has none)."""
    from dspark_jax.pipelines.calibrate import _save_draft_with_sts
    temps = [1.1, 1.2, 1.3, 1.4, 1.5]
    _save_draft_with_sts(SRC, tmp_path / "cal", temps)
    assert checkpoint.sts_temperatures(tmp_path / "cal") == temps
    summary = engines.export_draft(tmp_path / "cal", tmp_path / "sg", "sglang", target=SRC)
    assert summary["sidecars"] == [engines.STS_FILE]
    assert json.loads((tmp_path / "sg" / engines.STS_FILE).read_text())["temperatures"] == temps
    engines.export_draft(tmp_path / "cal", tmp_path / "vl", "vllm", target=SRC)
    assert not (tmp_path / "vl" / engines.STS_FILE).exists()
