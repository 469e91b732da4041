"""`dspark-jax export --engine vllm|sglang` of DeepSeek-V4's DSpark module: the V4 checkpoint with
its ``mtp.*`` tensors and ``dspark_*`` keys replaced by the module, the target's tensors byte for
byte; each engine's V4 load rules (``convert.engines.V4_RULES``, read from its loader) pass on the
export, and every rule has a checkpoint it refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dspark_jax.convert import checkpoint, dspark_v4, engines, engines_v4, export, formats, quant, safetensors_io
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.params import Quant

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"
SRC = FIX / "target_dspark"


def _facts(path) -> engines_v4.V4Facts:
    return engines_v4.v4_facts(json.loads((Path(path) / "config.json").read_text()),
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
    assert engines_v4.v4_violations(_facts(dst), engine) == []
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
        export.export_draft(tmp_path / "module", tmp_path / "a", "vllm")
    # a module directory that also holds the target's embedding and head (a train export) is no target
    tensors = {**dspark_v4.module_tensors(cfg, params),
               **{k: v for k, v in safetensors_io.read_tensors(SRC).items() if k in ("embed.weight", "head.weight")}}
    (tmp_path / "with_shared").mkdir()
    safetensors_io.write_tensors(tmp_path / "with_shared", tensors)
    (tmp_path / "with_shared" / "config.json").write_text((tmp_path / "module" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="--target"):
        export.export_draft(tmp_path / "with_shared", tmp_path / "a", "sglang")
    with pytest.raises(ConfigError, match="served by"):
        export.export_draft(SRC, tmp_path / "b", "sglang-jax")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # a whole V4 checkpoint exports itself (--target defaults to DRAFT)
    summary = export.export_draft(SRC, tmp_path / "c", "vllm")
    assert summary["target"] == str(SRC) and summary["warnings"] == []


def _mutated(change):
    f = _facts(SRC)
    hf, tensors = dict(f.hf), dict(f.tensors)
    change(hf, tensors)
    return engines_v4.V4Facts(hf, tensors)


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
    ("vllm", "module-storage", _set(quantization_config={"quant_method": "fp8", "fmt": "e4m3"})),
    ("vllm", "module-storage", lambda hf, t: t.update({n: "int8" for n in t if n.startswith("layers.")
                                                       and ".ffn.experts." in n})),
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
    assert engines_v4.v4_violations(_facts(SRC), engine) == []
    r = next(r for r in engines_v4.V4_RULES if r.engine == engine and r.name == rule)
    assert engines_v4.V4_SOURCES[engine].split("/")[-1] in r.source or "dspark_config.py" in r.source
    fired = {x.name for x, _ in engines_v4.v4_violations(_mutated(change), engine, r.severity)}
    assert rule in fired, fired


def test_every_v4_rule_has_a_negative_case():
    covered = {(e, r) for e, r, _ in NEGATIVE}
    assert covered == {(r.engine, r.name) for r in engines_v4.V4_RULES}
    # the stage count is the config's n_mtp_layers when it names one
    named = engines_v4.v4_violations(_mutated(lambda hf, t: _two_stages(hf, t, n_mtp=2)), "vllm")
    assert "stage-count" not in {r.name for r, _ in named}


def test_sts_and_sps_files_travel_to_sglang(tmp_path, capsys):
    """`calibrate --write-draft` of the V4 checkpoint writes a module directory carrying the STS
    temperatures; its SGLang export (`export --sps` of a profile-sps table) writes them as SGLang's
    STS file and the table as its SPS file (a verify step of B requests = B * (block + 1) tokens);
    vLLM's export has neither (a note says --sps was not written); a bad table is refused."""
    from dspark_jax import cli
    from dspark_jax.pipelines.calibrate import _save_draft_with_sts
    temps = [1.1, 1.2, 1.3, 1.4, 1.5]
    _save_draft_with_sts(SRC, tmp_path / "cal", temps)
    assert formats.sts_temperatures(tmp_path / "cal") == temps
    (tmp_path / "sps.json").write_text(json.dumps({"batch_sizes": [4, 1, 2], "sps": [20.0, 40.0, 38.0]}))
    args = ["--target", str(SRC), "--sps", str(tmp_path / "sps.json")]
    assert cli.main(["export", str(tmp_path / "cal"), str(tmp_path / "sg"), "--engine", "sglang", *args]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["sidecars"] == [engines.SPS_FILE, engines.STS_FILE] and summary["warnings"] == []
    assert json.loads((tmp_path / "sg" / engines.STS_FILE).read_text())["temperatures"] == temps
    assert json.loads((tmp_path / "sg" / engines.SPS_FILE).read_text()) == {
        "sample_batch_tokens": [6, 12, 24], "sample_steps_per_sec": [40.0, 38.0, 20.0], "max_batch_tokens": 24}
    summary = export.export_draft(tmp_path / "cal", tmp_path / "vl", "vllm", target=SRC, sps=tmp_path / "sps.json")
    assert summary["sidecars"] == [] and "--sps is not written" in summary["warnings"][0]
    assert not (tmp_path / "vl" / engines.STS_FILE).exists() and not (tmp_path / "vl" / engines.SPS_FILE).exists()
    (tmp_path / "bad.json").write_text(json.dumps({"batch_sizes": [1, 2], "sps": [1.0]}))
    with pytest.raises(ConfigError, match="equal length"):
        export.export_draft(tmp_path / "cal", tmp_path / "bad", "sglang", target=SRC, sps=tmp_path / "bad.json")
    assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------- into an FP8 / MXFP4 target


def export_into_fp8(tmp_path, engine="vllm"):
    """(the trained module's (cfg, params), the FP8 target (the fixture's, FP8 e4m3 weights in
    128x128 blocks and MXFP4 experts: test_deepseek_v4_quant's writer), the export, its summary)."""
    from test_deepseek_v4_quant import _write_quantized
    _write_quantized(tmp_path / "q")
    cfg, params = _trained_module()
    dspark_v4.save_module(tmp_path / "module", cfg, params)
    summary = export.export_draft(tmp_path / "module", tmp_path / engine, engine, target=tmp_path / "q")
    return (cfg, params), tmp_path / "q", tmp_path / engine, summary


def test_export_into_an_fp8_target_stores_the_module_as_its_layers(tmp_path):
    """Every mtp.* tensor is stored as the target stores the same tensor of its own layers (FP8 +
    ue8m0 128x128 scales for the attention / shared-expert linears and main_proj, MXFP4 + [1, 32]
    scales for the routed experts, float for the rest); dequantized it is the module within the
    format's rounding; the target's tensors are byte for byte the FP8 checkpoint's; both engines'
    rules pass; the module reads back (dequantized) as written."""
    (cfg, params), q, dst, summary = export_into_fp8(tmp_path)
    assert summary["stored_dtypes"]["float8_e4m3fn"] > 0 and summary["stored_dtypes"]["int8"] > 0
    for engine in ("vllm", "sglang"):
        assert engines_v4.v4_violations(_facts(dst), engine) == [], engine
    got, target = safetensors_io.read_tensors(dst), safetensors_io.read_tensors(q)
    assert all(got[n].dtype == t.dtype and got[n].tobytes() == t.tobytes() for n, t in target.items())
    module, fmts = dspark_v4.module_tensors(cfg, params), {}
    for name, w in module.items():
        role = "attn.wq_a.weight" if name == "mtp.0.main_proj.weight" else name.split(".", 2)[2]
        like = target.get(f"layers.3.{role}")
        stored = got[name]
        if stored.dtype in (quant.FP8, np.dtype(np.int8)):
            assert like is not None and like.dtype == stored.dtype, name
            qf = Quant("fp8", (128, 128)) if stored.dtype == quant.FP8 else Quant("fp4", (1, 32))
            back = quant.dequantize(stored, got[qf.scale_name(name)], qf)
            step = 2.0 ** -3 if qf.fmt == "fp8" else 0.5   # the format's spacing near its block max
            assert np.abs(back - w).max() <= step * np.abs(w).max(), name
            fmts[qf.fmt] = fmts.get(qf.fmt, 0) + 1
        else:
            assert like is None or like.dtype == stored.dtype, name
            assert stored.tobytes() == w.tobytes(), name
    n_exp = cfg.target.n_routed_experts * 3 * cfg.num_hidden_layers
    assert fmts == {"fp8": 1 + 8 * cfg.num_hidden_layers, "fp4": n_exp}   # main_proj + 5 attn + 3 shared
    hf = json.loads((dst / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == [128, 128] and hf["expert_dtype"] == "fp4"
    _, back = dspark_v4.load_module(dst)
    w1 = module["mtp.1.ffn.experts.2.w1.weight"]
    np.testing.assert_allclose(np.asarray(back["layers"]["experts_w1"][1, 2]).T, w1,
                               atol=0.5 * np.abs(w1).max())


def test_fp8_export_refusals(tmp_path):
    """A target whose layers store one tensor in two formats has no format to match (refused
    before writing); a checkpoint whose config says FP8 over float layers is refused with vLLM's
    rule (its layers would load as FP8)."""
    from test_deepseek_v4_quant import _write_quantized
    _write_quantized(tmp_path / "q")
    infos = dict(safetensors_io.TensorReader(tmp_path / "q").infos)
    name = "layers.2.ffn.experts.5.w1.weight"
    infos[name] = dataclasses.replace(infos[name], dtype=np.dtype(np.float32))
    with pytest.raises(CheckpointError, match="more than one format"):
        dspark_v4.storage_plan(tmp_path / "q", infos, ["mtp.0.ffn.experts.5.w1.weight"])
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "model.safetensors").symlink_to((SRC / "model.safetensors").resolve())
    hf = json.loads((SRC / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "weight_block_size": [128, 128]}
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="module-storage"):
        export.export_draft(tmp_path / "cfg", tmp_path / "out", "vllm")
    assert not (tmp_path / "out").exists()
