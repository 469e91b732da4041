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
from dspark_jax.convert import formats
from dspark_jax.convert import bounded, safetensors_io


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


def _aside(source, family) -> tuple[dict, list[str]]:
    """(tensor infos, names of those kept aside) of a validated source: a torch checkpoint's
    ``aside_tensors`` prefixes, a dspark-jax one's ``aside.safetensors``."""
    if isinstance(source, bounded.TorchSource):
        infos = source.reader.infos
        return infos, [n for n in infos if family.aside_tensors and n.startswith(family.aside_tensors)]
    file = source.params_dir.parent / formats.ASIDE_NAME
    infos = safetensors_io.TensorReader._headers(file) if file.is_file() else {}
    return infos, list(infos)


def _stored(source, family) -> dict:
    """Tensor count, dtypes, quantized tensors found (by format and block, with their scales'
    dtypes) and the tensors kept aside, of a validated source (``bounded.open_source``)."""
    infos, aside = _aside(source, family)
    if isinstance(source, bounded.TorchSource):
        dtypes = Counter(np.dtype(i.dtype).name for n, i in infos.items() if n not in aside)
        found = Counter(f"{s.quant.fmt} {'x'.join(map(str, s.quant.block))}" for s in source.stored.values())
        scales = {np.dtype(infos[source.names[s.scale]].dtype).name for s in source.stored.values()}
        n = len(infos)
    else:
        found, scales = {}, set()
        dtypes, n = Counter(d.name for d in source.dtypes.values()), len(source.dtypes)
    stages = sorted({int(n.split(".")[1]) for n in aside if n.split(".")[1].isdigit()})
    nbytes = sum(int(np.prod(infos[n].shape)) * np.dtype(infos[n].dtype).itemsize for n in aside)
    return {"tensors": n, "dtypes": dict(sorted(dtypes.items())), "quantized": dict(sorted(found.items())),
            "scale_dtypes": sorted(scales), "aside": {"tensors": len(aside), "bytes": nbytes, "mtp_stages": stages}}


def describe_target(path) -> dict:
    """JSON-able summary of a target checkpoint directory (either format), validated as conversion
    validates it; reads headers and metadata only."""
    p = Path(path)
    source = bounded.open_source(p, "target")
    cfg, family = source.source_config, families.for_config(source.source_config)
    info = {"path": str(p), "format": formats.detect_format(p), "kind": family.kind, "family": family.name,
            "architecture": (cfg.to_hf().get("architectures") or ["?"])[0],
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "params": _param_counts(cfg), **_stored(source, family)}
    if family.name == "deepseek_v4":
        from dspark_jax.target.deepseek_v4.config import ATTENTION_TYPES, HASH_MOE
        info["attention"] = {t: list(cfg.layer_ids(t)) for t in ATTENTION_TYPES}
        info["compress_ratios"] = list(cfg.compress_ratios)
        info["moe"] = {"routed_experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
                       "shared_experts": 1, "hash_layers": list(cfg.mlp_ids(HASH_MOE)),
                       "expert_width": cfg.moe_intermediate_size}
        info["quantization_config"] = ({"quant_method": cfg.quant, "block": list(cfg.quant_block),
                                        "expert_dtype": cfg.expert_dtype} if cfg.quant else None)
        from dspark_jax.draft import deepseek_v4 as dspark_v4
        module = dspark_v4.describe(source.hf)  # the in-checkpoint DSpark module (mtp.*, dspark_* keys)
        info["dspark"] = module if module["present"] else None
        from dspark_jax.draft import deepseek_v4_mtp
        info["mtp"] = deepseek_v4_mtp.describe(source.hf, _aside(source, family)[1])
        info["drafter_module"] = "dspark" if module["present"] else "mtp" if info["mtp"] else None
    if family.name == "deepseek_v41":
        info["compress_ratios"] = list(cfg.compress_ratios)
        info["csa2"] = {"kv_source_layer_ids": list(cfg.kv_source_layer_ids),
                        "index_source_layer_ids": list(cfg.index_source_layer_ids),
                        "candidate_source_layer_id": cfg.candidate_source_layer_id, "index_topk": cfg.index_topk}
        info["engram_layer_ids"] = list(cfg.engram_layer_ids)
        info["moe"] = {"routed_experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
                       "shared_experts": 1, "hash_layers": [], "expert_width": cfg.moe_intermediate_size}
        info["quantization_config"] = ({"quant_method": cfg.quant, "block": list(cfg.quant_block),
                                        "expert_dtype": cfg.expert_dtype} if cfg.quant else None)
        from dspark_jax.draft import deepseek_v41 as dspark_v41
        module = dspark_v41.describe(source.hf)
        info["dspark"] = module if module["present"] else None
    from dspark_jax.convert import module_io
    info["module"] = module_io.describe_module(p)
    return info
