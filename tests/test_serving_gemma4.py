"""Gemma4 drafters' exports: the rules recorded from the engines' Gemma4 DSpark loaders, checked by
checkers written from those loaders (named below), a hand-broken export per rule, reload + CLI.
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

from dspark_jax.cli import main as cli_main
from dspark_jax.convert import checkpoint, engines, export
from dspark_jax.errors import ConfigError
from tests.serving_checks import (CHECKERS, HEADS, Refused, check_files_readable, edit_config,
                                  edit_tensors, head_config, naive_export, need, read_export,
                                  set_tap_ids, tapped_ids)


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
        "architecture": lambda d: edit_config(d, architectures=["Qwen3DSparkModel"]),
        "k_eq_v off": lambda d: edit_config(d, attention_k_eq_v=False),
        "layer_types": lambda d: edit_config(d, layer_types=["sliding_attention", "full_attention"]),
        "rope full_attention": lambda d: edit_config(d, rope_parameters={"rope_theta": 10000.0}),
        "softcap": lambda d: edit_config(d, final_logit_softcapping=None),
        "n_predict": lambda d: edit_config(d, n_predict=None),
        "markov_rank 0": lambda d: edit_config(d, markov_rank=0),
        "layer id N": lambda d: set_tap_ids(d, [0, 2, 6]),
        "own lm_head": lambda d: edit_tensors(d, drop=["lm_head.weight"]),
        "own embed_tokens": lambda d: edit_tensors(d, drop=["embed_tokens.weight"]),
        "layer_scalar": lambda d: edit_tensors(d, drop=["layers.0.layer_scalar"]),
        "k_proj shape": lambda d: edit_tensors(d, add={"layers.1.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}),
        "gated tensors skipped": lambda d: edit_tensors(d, add={"markov_head.gate_proj.bias": np.zeros((64,), np.float32)}),
        "mode 0600": lambda d: os.chmod(d / "model.safetensors", 0o600),
    },
    "deepspec": {
        "architecture": lambda d: edit_config(d, architectures=["Gemma4ForCausalLM"]),
        "missing confidence": lambda d: edit_tensors(d, drop=["confidence_head.proj.bias"]),
        "extra v_proj under k=v": lambda d: edit_tensors(d, add={"layers.0.self_attn.v_proj.weight": np.zeros((32, 64), np.float32)}),
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
