"""What a target checkpoint holds, read from its config and tensor headers only (no weights).

``describe_target(path)``: family, architecture, layers, parameter counts from the family's
declaration (total, embedding + head, routed experts, active per token), the stored dtypes and
quantized tensors found (FP8 / MXFP4 with their scales), tensors kept aside (``mtp.*``) and, for
DeepSeek-V4, the layers by attention type and the MoE routing (experts, top-k, hash layers).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.convert import checkpoint as ckpt
from dspark_jax.convert import quant, safetensors_io


def _param_counts(config) -> dict:
    """Parameter counts from the declaration (integer tables such as ``tid2eid`` are not
    parameters): total, embed + head, routed experts, active per token."""
    specs = {k: s for k, s in families.declare(config).items()
             if not (s.dtype and np.issubdtype(np.dtype(s.dtype), np.integer))}
    count = {path: int(np.prod(s.shape)) for path, s in specs.items()}
    total = sum(count.values())
    embed = sum(n for path, n in count.items() if path[-1] in ("embed", "head", "embed_tokens", "lm_head"))
    routed = sum(n for path, n in count.items() if specs[path].expert_ids is not None)
    out = {"total": total, "embedding_and_head": embed, "routed_experts": routed}
    n_experts, top_k = getattr(config, "n_routed_experts", None), getattr(config, "num_experts_per_tok", None)
    if routed and n_experts and top_k:
        out["active_per_token"] = total - routed + routed * top_k // n_experts
    return out


def _stored(p: Path, family, hf: dict) -> dict:
    """Dtypes, quantized tensors and aside tensors of a torch-format directory (headers only)."""
    from dspark_jax.convert import bounded
    bounded.open_source(p, family.kind)  # the same header checks as conversion: refused alike
    infos = safetensors_io.TensorReader(p).infos
    aside = [n for n in infos if family.aside_tensors and n.startswith(family.aside_tensors)]
    cfg = family.config_from_hf(hf)
    declared = families.for_config(cfg).stored_names(hf, infos)
    quantized = params_lib.quantized(families.declare(cfg))
    found = Counter()
    scales = set()
    for name, q in quantized.items():
        stored = declared.get(name)
        if stored is None or quant._is_float(infos[stored].dtype):
            continue
        found[f"{q.fmt} {'x'.join(map(str, q.block))}"] += 1
        scales.add(np.dtype(infos[declared[q.scale_name(name)]].dtype).name if q.scale_name(name) in declared
                   else "missing")
    dtypes = Counter(np.dtype(i.dtype).name for n, i in infos.items() if n not in aside)
    return {"tensors": len(infos), "dtypes": dict(sorted(dtypes.items())),
            "quantized": dict(sorted(found.items())), "scale_dtypes": sorted(scales),
            "aside": _aside_summary(infos, aside)}


def _aside_summary(infos, names) -> dict:
    stages = sorted({int(n.split(".")[1]) for n in names if n.split(".")[1].isdigit()})
    nbytes = sum(int(np.prod(infos[n].shape)) * np.dtype(infos[n].dtype).itemsize for n in names)
    return {"tensors": len(names), "bytes": nbytes, "mtp_stages": stages}


def describe_target(path) -> dict:
    """JSON-able summary of a target checkpoint directory (either format); reads headers only."""
    p = Path(path)
    fmt = ckpt.detect_format(p)
    if fmt == "jax":
        hf = ckpt._read_meta(p)["config"]
    else:
        hf = ckpt.read_json_object(p / "config.json", "config.json")
    family = families.for_hf(hf, str(p))
    cfg = family.config_from_hf(hf)
    info = {"path": str(p), "format": fmt, "kind": family.kind, "family": family.name,
            "architecture": (hf.get("architectures") or ["?"])[0],
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "params": _param_counts(cfg)}
    if fmt == "torch":
        info.update(_stored(p, family, hf))
    else:
        import orbax.checkpoint as ocp
        from dspark_jax.convert import bounded
        bounded.open_source(p, family.kind)
        with ocp.StandardCheckpointer() as ckptr:
            leaves = ckpt._flat(ckptr.metadata((p / ckpt.PARAMS_DIR).absolute()).item_metadata.tree)
        aside = p / ckpt.ASIDE_NAME
        infos = safetensors_io.TensorReader._headers(aside) if aside.is_file() else {}
        info.update({"tensors": len(leaves),
                     "dtypes": dict(sorted(Counter(np.dtype(x.dtype).name for x in leaves.values()).items())),
                     "quantized": {}, "scale_dtypes": [], "aside": _aside_summary(infos, list(infos))})
    if family.name == "deepseek_v4":
        from dspark_jax.target.deepseek_v4.config import ATTENTION_TYPES, HASH_MOE
        info["attention"] = {t: list(cfg.layer_ids(t)) for t in ATTENTION_TYPES}
        info["compress_ratios"] = list(cfg.compress_ratios)
        info["moe"] = {"routed_experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
                       "shared_experts": 1, "hash_layers": list(cfg.mlp_ids(HASH_MOE)),
                       "expert_width": cfg.moe_intermediate_size}
        info["quantization_config"] = ({"quant_method": cfg.quant, "block": list(cfg.quant_block),
                                        "expert_dtype": cfg.expert_dtype} if cfg.quant else None)
        info["dspark"] = {k: v for k, v in hf.items() if k.startswith("dspark_") and k != "dspark_jax"}
    return info
