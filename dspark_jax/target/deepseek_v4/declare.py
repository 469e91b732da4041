"""Every DeepSeek-V4 parameter, declared once (``params.ParamSpec``), and the checkpoint layouts.

Params tree (kernels ``[in, out]``; L = layers, E = routed experts)::

    embed [V, H], head [H, V], norm [H], hc_head/{fn [4, 4H], base [4], scale [1]}
    layers/...   every layer, stacked [L, ...]: attention (wq_a, q_norm, wq_b, wkv, kv_norm, wo_a,
                 wo_b, attn_sink), norms, mHC (hc_attn_*, hc_ffn_*), router weight, shared
                 expert, routed experts [L, E, ...]
    hash/tid2eid [Lh, V, k] int32            the hash-routed layers (``mlp_layer_types``)
    moe/bias [Lm, E] float32                 the score-routed layers' selection bias
    csa/...  [Lc, ...]                       CSA layers' compressor + Lightning Indexer
    hca/...  [La, ...]                       HCA layers' compressor

Declared torch names are the upstream (released) names; ``hf_names`` maps them to transformers'
names, so a checkpoint in either layout reads (``FAMILY.source_names``). The FP8 / MXFP4
companions (``Quant``) are declared where the released checkpoints may store them.
"""

from __future__ import annotations

import re

from dspark_jax.params import ParamSpec, Quant
from dspark_jax.target.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, DeepseekV4Config

F32 = "float32"


def _quant(cfg: DeepseekV4Config, expert: bool = False) -> Quant | None:
    if expert and cfg.expert_dtype == "fp4":
        return Quant("fp4", (1, 32))
    if cfg.quant or (expert and cfg.expert_dtype):
        return Quant("fp8", tuple(cfg.quant_block))
    return None


def declare(cfg: DeepseekV4Config) -> dict[tuple, ParamSpec]:
    """Our path -> ParamSpec for every parameter of ``cfg``'s model (see the module docstring)."""
    v, h, nh, d = cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    hc, r, g, inter, e = cfg.hc_mult, cfg.q_lora_rank, cfg.o_groups, cfg.moe_intermediate_size, cfg.n_routed_experts
    mix = (2 + hc) * hc
    fp8, fp_e = _quant(cfg), _quant(cfg, expert=True)
    experts = tuple(range(e))

    def stack(ids, shape, axes, torch, **kw):
        return ParamSpec((len(ids), *shape), ("layers", *axes), "layers.{i}." + torch, layer_ids=tuple(ids), **kw)

    def kernel(ids, n_in, n_out, axes, torch, **kw):
        return stack(ids, (n_in, n_out), axes, torch + ".weight", transpose=True, **kw)

    def norm(ids, n, torch, **kw):
        return stack(ids, (n,), (None,), torch + ".weight", init="ones", **kw)

    every = tuple(range(cfg.num_hidden_layers))
    decl = {
        ("embed",): ParamSpec((v, h), ("vocab", "embed"), "embed.weight"),
        ("head",): ParamSpec((h, v), ("embed", "vocab"), "head.weight", transpose=True),
        ("norm",): ParamSpec((h,), (None,), "norm.weight", init="ones", dtype=F32),
        ("hc_head", "fn"): ParamSpec((hc, hc * h), (None, None), "hc_head_fn", dtype=F32),
        ("hc_head", "base"): ParamSpec((hc,), (None,), "hc_head_base", init="zeros", dtype=F32),
        ("hc_head", "scale"): ParamSpec((1,), (None,), "hc_head_scale", init="ones", dtype=F32),
    }
    layers = {
        "attn_norm": norm(every, h, "attn_norm", dtype=F32),
        "ffn_norm": norm(every, h, "ffn_norm", dtype=F32),
        "wq_a": kernel(every, h, r, ("embed", "rank"), "attn.wq_a", quant=fp8),
        "q_norm": norm(every, r, "attn.q_norm", dtype=F32),
        "wq_b": kernel(every, r, nh * d, ("rank", "heads"), "attn.wq_b", quant=fp8),
        "wkv": kernel(every, h, d, ("embed", None), "attn.wkv", quant=fp8),
        "kv_norm": norm(every, d, "attn.kv_norm", dtype=F32),
        "wo_a": kernel(every, nh * d // g, g * cfg.o_lora_rank, (None, "heads"), "attn.wo_a", quant=fp8),
        "wo_b": kernel(every, g * cfg.o_lora_rank, h, ("heads", "embed"), "attn.wo_b", quant=fp8),
        "attn_sink": stack(every, (nh,), ("heads",), "attn.attn_sink", init="zeros", dtype=F32),
        "gate": kernel(every, h, e, ("embed", None), "ffn.gate"),
        "shared_w1": kernel(every, h, inter, ("embed", "mlp"), "ffn.shared_experts.w1", quant=fp8),
        "shared_w3": kernel(every, h, inter, ("embed", "mlp"), "ffn.shared_experts.w3", quant=fp8),
        "shared_w2": kernel(every, inter, h, ("mlp", "embed"), "ffn.shared_experts.w2", quant=fp8),
    }
    for name in ("attn", "ffn"):
        layers[f"hc_{name}_fn"] = stack(every, (mix, hc * h), (None, None), f"hc_{name}_fn", dtype=F32)
        layers[f"hc_{name}_base"] = stack(every, (mix,), (None,), f"hc_{name}_base", init="zeros", dtype=F32)
        layers[f"hc_{name}_scale"] = stack(every, (3,), (None,), f"hc_{name}_scale", init="ones", dtype=F32)
    for w, (n_in, n_out, axes) in {"w1": (h, inter, ("embed", "mlp")), "w3": (h, inter, ("embed", "mlp")),
                                   "w2": (inter, h, ("mlp", "embed"))}.items():
        layers[f"experts_{w}"] = ParamSpec(
            (len(every), e, n_in, n_out), ("layers", "expert", *axes), f"layers.{{i}}.ffn.experts.{{e}}.{w}.weight",
            transpose=True, layer_ids=every, expert_ids=experts, quant=fp_e)
    decl.update({("layers", k): s for k, s in layers.items()})

    hashed, scored = cfg.mlp_ids(HASH_MOE), cfg.mlp_ids(MOE)
    if hashed:
        decl[("hash", "tid2eid")] = stack(hashed, (v, cfg.num_experts_per_tok), ("vocab", None), "ffn.gate.tid2eid",
                                          init="zeros", dtype="int32", torch_dtype="int64", bound=e)
    if scored:
        decl[("moe", "bias")] = stack(scored, (e,), (None,), "ffn.gate.bias", init="zeros", dtype=F32)

    def compressor(ids, prefix, width, ratio, overlap):
        n = 2 * width if overlap else width
        return {"wkv": kernel(ids, h, n, ("embed", None), prefix + "wkv"),
                "wgate": kernel(ids, h, n, ("embed", None), prefix + "wgate"),
                "ape": stack(ids, (ratio, n), (None, None), prefix + "ape", init="zeros", dtype=F32),
                "norm": norm(ids, width, prefix + "norm", dtype=F32)}

    csa, hca = cfg.layer_ids(CSA), cfg.layer_ids(HCA)
    if csa:
        group = compressor(csa, "attn.compressor.", d, cfg.csa_ratio, True)
        group.update({f"index_{k}": s for k, s in compressor(
            csa, "attn.indexer.compressor.", cfg.index_head_dim, cfg.csa_ratio, True).items()})
        group["index_wq_b"] = kernel(csa, r, cfg.index_n_heads * cfg.index_head_dim, ("rank", None),
                                     "attn.indexer.wq_b")
        group["index_weights_proj"] = kernel(csa, h, cfg.index_n_heads, ("embed", None),
                                             "attn.indexer.weights_proj")
        decl.update({("csa", k): s for k, s in group.items()})
    if hca:
        decl.update({("hca", k): s for k, s in compressor(hca, "attn.compressor.", d, cfg.hca_ratio, False).items()})
    return decl


# ----------------------------------------------------------------------------- transformers' names

_HF_RULES = (  # (upstream regex, transformers replacement), first match wins
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^head\.weight$", "head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$", r"model.layers.\1.\2_hc.\3"),
    (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.attn\.indexer\.compressor\.", r"model.layers.\1.self_attn.compressor.indexer.@C"),
    (r"^layers\.(\d+)\.attn\.indexer\.wq_b\.", r"model.layers.\1.self_attn.compressor.indexer.q_b_proj."),
    (r"^layers\.(\d+)\.attn\.indexer\.weights_proj\.",
     r"model.layers.\1.self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^layers\.(\d+)\.attn\.compressor\.", r"model.layers.\1.self_attn.compressor.@C"),
    (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn.@A"),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.", r"model.layers.\1.mlp.shared_experts.@S"),
    (r"^layers\.(\d+)\.ffn\.gate\.bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (r"^layers\.(\d+)\.ffn\.", r"model.layers.\1.mlp."),
)
_LEAF = {  # the leaf renames after a marker
    "@C": {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"},
    "@A": {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
           "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj", "attn_sink": "sinks"},
    "@S": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}


def hf_name(name: str) -> str:
    """The transformers name of an upstream tensor name (a ``.scale`` companion becomes
    ``.weight_scale_inv``); names it does not know (``mtp.*``) come back unchanged."""
    if name.endswith(".scale") and not name.startswith("hc_") and ".hc_" not in name:
        return hf_name(name[:-len(".scale")] + ".weight")[:-len(".weight")] + ".weight_scale_inv"
    for pattern, repl in _HF_RULES:
        out, n = re.subn(pattern, repl, name)
        if n:
            for marker, leaves in _LEAF.items():
                if marker in out:
                    head, rest = out.split(marker)
                    leaf, dot, tail = rest.partition(".")
                    out = head + leaves.get(leaf, leaf) + dot + tail
            return out
    return name


def is_hf_layout(hf: dict) -> bool:
    """transformers' ``save_pretrained`` layout (its keys), else the upstream one."""
    return "layer_types" in hf or "compress_rates" in hf or isinstance(
        (hf.get("rope_parameters") or {}).get("compress"), dict)


def source_names(hf: dict, names) -> dict[str, str]:
    """{declared (upstream) name: stored name} of a checkpoint's tensor ``names`` in any layout:
    upstream, transformers' (``model.layers.{i}.self_attn.q_a_proj.weight``, ...) or what
    transformers 5.24's ``save_pretrained`` writes (upstream names under ``model.``, the attention's
    ``kv_norm`` as ``norm``); ``head.weight`` and ``mtp.*`` are the same in all."""
    return {to_upstream(n): n for n in names}


_TOP_LEAVES = ("embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")
_LAYER_LEAVES = tuple(
    [f"hc_{s}_{k}" for s in ("attn", "ffn") for k in ("fn", "base", "scale")]
    + ["attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.q_norm.weight", "attn.kv_norm.weight"]
    + [f"attn.{w}.{k}" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b") for k in ("weight", "scale")]
    + [f"attn.{c}compressor.{w}" for c in ("", "indexer.")
       for w in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
    + ["attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"]
    + ["ffn.gate.weight", "ffn.gate.bias", "ffn.gate.tid2eid"]
    + [f"ffn.shared_experts.{w}.{k}" for w in ("w1", "w2", "w3") for k in ("weight", "scale")]
    + [f"ffn.experts.{{e}}.{w}.{k}" for w in ("w1", "w2", "w3") for k in ("weight", "scale")])


def to_upstream(name: str) -> str:
    """The upstream name of a transformers tensor name (inverse of ``hf_name``; other names unchanged)."""
    if not name.startswith("model."):
        return name
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    e = re.search(r"\.experts\.(\d+)\.", name)
    candidates = ([f"layers.{m.group(1)}." + leaf.replace("{e}", e.group(1) if e else "?") for leaf in _LAYER_LEAVES]
                  if m else _TOP_LEAVES)
    for up in candidates:
        if hf_name(up) == name:
            return up
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", name[len("model."):])
