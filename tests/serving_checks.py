"""Independent checkers of serving exports, written from the engines' own loader code (the file
named on each checker), not from dspark_jax/convert/engines.py, and the drafters and hand edits
the export tests share (tests/test_serving.py for Qwen3, tests/test_serving_gemma4.py).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open

from dspark_jax.config import DraftConfig
from dspark_jax.convert import checkpoint, engines, mapping, safetensors_io


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


def head_config(base: DraftConfig, head: str) -> DraftConfig:
    if head in ("gated", "rnn"):
        return base.replace(markov_head_type=head)
    if head == "dflash":
        return base.replace(markov_rank=0, confidence_head_with_markov=False)
    if head == "no_confidence":
        return base.replace(enable_confidence_head=False)
    return base


def naive_export(src: Path, dst: Path, engine: str):
    """What an export without the engine check would write (transforms applied)."""
    cfg, params = checkpoint.load_draft(src)
    dst.mkdir()
    safetensors_io.write_tensors(dst, mapping.draft_to_torch(cfg, jax.tree.map(np.asarray, params)))
    (dst / "config.json").write_text(json.dumps(engines.export_config(cfg.to_hf(), cfg, engine)))


def edit_config(d, **changes):
    hf = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    (d / "config.json").write_text(json.dumps(hf))


def edit_tensors(d, drop=(), add=None):
    from safetensors.numpy import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    for k in drop:
        t.pop(k)
    t.update(add or {})
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(d / "model.safetensors", 0o644)


def set_tap_ids(d, ids):
    hf = json.loads((d / "config.json").read_text())
    edit_config(d, target_layer_ids=ids, dflash_config={**hf.get("dflash_config", {}), "target_layer_ids": ids})
