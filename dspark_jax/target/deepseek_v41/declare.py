"""Every DeepSeek-V4.1 parameter, declared once (``params.ParamSpec``), and the checkpoint layouts.

Params tree (kernels ``[in, out]``; L layers, E routed experts)::

    embed [V, H], head [H, V], norm [H]                 (no hc_head: V4.1 collapses with a pre-mix)
    layers/...        every layer, stacked [L, ...]: V4's attention leaves (no per-head q norm is a
                      forward matter), norms, mHC, router weight + bias + bias_vl, shared expert,
                      routed experts [L, E, ...]
    kv_source/...     [Ls, ...] the compressor (wkv, norm) and the indexer's key projection
                      (index_wk, index_k_norm) of ``kv_source_layer_ids``
    gated_source/wgate [Lg, H, D]  the pooling gate of the ratio > 1 sources
    index_source/...  [Li, ...] the indexer's query (wq_b) and head weights (weights_proj)
    engram/...        [Le, ...] wkv, q_weight, k_weight of ``engram_layer_ids``;
    engram_table/{k}  {rows [N_k, d], scale [N_k, d / 32]}: layer k's hash table (sizes differ)

Declared torch names are the upstream (released) ones; transformers' ``save_pretrained`` layout
is them under ``model.`` with ``lm_head.weight`` for ``head.weight`` (``source_names``).
"""

from __future__ import annotations

from dspark_jax.params import ParamSpec
from dspark_jax.target.deepseek_v4.declare import _quant
from dspark_jax.target.deepseek_v41.config import DeepseekV41Config

F32 = "float32"


def declare(cfg: DeepseekV41Config) -> dict[tuple, ParamSpec]:
    """Our path -> ParamSpec for every parameter of ``cfg``'s model (module docstring)."""
    v, h, d, hc, r, e = (cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.hc_mult, cfg.q_lora_rank,
                         cfg.n_routed_experts)
    every = tuple(range(cfg.num_hidden_layers))
    decl = {
        ("embed",): ParamSpec((v, h), ("vocab", "embed"), "embed.weight"),
        ("head",): ParamSpec((h, v), ("embed", "vocab"), "head.weight", transpose=True),
        ("norm",): ParamSpec((h,), (None,), "norm.weight", init="ones", dtype=F32),
    }
    decl.update({("layers", k): s for k, s in block_specs(cfg, every, e, "layers.{i}.").items()})

    def stack(ids, shape, axes, torch, **kw):
        return ParamSpec((len(ids), *shape), ("layers", *axes), "layers.{i}." + torch, layer_ids=tuple(ids), **kw)

    def kernel(ids, n_in, n_out, axes, torch, **kw):
        return stack(ids, (n_in, n_out), axes, torch + ".weight", transpose=True, **kw)

    def norm(ids, n, torch):
        return stack(ids, (n,), (None,), torch + ".weight", init="ones", dtype=F32)

    src, idx, idh = cfg.kv_source_layer_ids, cfg.index_source_layer_ids, cfg.index_head_dim
    if src:
        decl.update({("kv_source", k): s for k, s in {
            "wkv": kernel(src, h, d, ("embed", None), "attn.compressor.wkv"),
            "norm": norm(src, d, "attn.compressor.norm"),
            "index_wk": kernel(src, d, idh, (None, None), "attn.indexer.wk"),
            "index_k_norm": norm(src, idh, "attn.indexer.k_norm")}.items()})
    if cfg.gated_sources:
        decl[("gated_source", "wgate")] = kernel(cfg.gated_sources, h, d, ("embed", None), "attn.compressor.wgate")
    if idx:
        decl[("index_source", "wq_b")] = kernel(idx, r, cfg.index_n_heads * idh, ("rank", None), "attn.indexer.wq_b")
        decl[("index_source", "weights_proj")] = kernel(idx, h, cfg.index_n_heads, ("embed", None),
                                                        "attn.indexer.weights_proj")
    eng = cfg.engram_layer_ids
    if eng:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        decl[("engram", "wkv")] = kernel(eng, cols * cfg.engram_head_dim, h * (hc + 1), (None, None), "engram.wkv")
        decl[("engram", "q_weight")] = stack(eng, (hc, h), (None, None), "engram.q_weight", init="ones", dtype=F32)
        decl[("engram", "k_weight")] = stack(eng, (hc, h), (None, None), "engram.k_weight", init="ones", dtype=F32)
        for k, (i, rows) in enumerate(zip(eng, cfg.engram_num_embeddings)):
            decl[("engram_table", str(k), "rows")] = ParamSpec(
                (rows, cfg.engram_head_dim), (None, None), f"layers.{i}.engram.embed.weight")
            decl[("engram_table", str(k), "scale")] = ParamSpec(
                (rows, max(1, cfg.engram_head_dim // 32)), (None, None), f"layers.{i}.engram.embed.scale",
                init="ones", dtype=F32)
    return decl


def block_specs(cfg, ids: tuple[int, ...], n_experts: int, prefix: str) -> dict[str, ParamSpec]:
    """The leaves of V4.1 blocks ``ids`` (stacked [len(ids), ...]) whose torch names are
    ``prefix`` (with ``{i}``) + the upstream leaf: attention without compressor, MoE of
    ``n_experts`` experts, norms and mHC. The trunk's layers and the DSpark module's stages."""
    h, nh, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    hc, r, g, inter = cfg.hc_mult, cfg.q_lora_rank, cfg.o_groups, cfg.moe_intermediate_size
    mix = (2 + hc) * hc
    fp8, fp_e = _quant(cfg), _quant(cfg, expert=True)
    n = len(ids)

    def stack(shape, axes, torch, **kw):
        return ParamSpec((n, *shape), ("layers", *axes), prefix + torch, layer_ids=tuple(ids), **kw)

    def kernel(n_in, n_out, axes, torch, **kw):
        return stack((n_in, n_out), axes, torch + ".weight", transpose=True, **kw)

    def norm(width, torch):
        return stack((width,), (None,), torch + ".weight", init="ones", dtype=F32)

    out = {
        "attn_norm": norm(h, "attn_norm"), "ffn_norm": norm(h, "ffn_norm"),
        "wq_a": kernel(h, r, ("embed", "rank"), "attn.wq_a", quant=fp8),
        "q_norm": norm(r, "attn.q_norm"),
        "wq_b": kernel(r, nh * d, ("rank", "heads"), "attn.wq_b", quant=fp8),
        "wkv": kernel(h, d, ("embed", None), "attn.wkv", quant=fp8),
        "kv_norm": norm(d, "attn.kv_norm"),
        "wo_a": kernel(nh * d // g, g * cfg.o_lora_rank, (None, "heads"), "attn.wo_a", quant=fp8),
        "wo_b": kernel(g * cfg.o_lora_rank, h, ("heads", "embed"), "attn.wo_b", quant=fp8),
        "attn_sink": stack((nh,), ("heads",), "attn.attn_sink", init="zeros", dtype=F32),
        "gate": kernel(h, n_experts, ("embed", None), "ffn.gate"),
        "gate_bias": stack((n_experts,), (None,), "ffn.gate.bias", init="zeros", dtype=F32),
        "gate_bias_vl": stack((n_experts,), (None,), "ffn.gate.bias_vl", init="zeros", dtype=F32),
        "shared_w1": kernel(h, inter, ("embed", "mlp"), "ffn.shared_experts.w1", quant=fp8),
        "shared_w3": kernel(h, inter, ("embed", "mlp"), "ffn.shared_experts.w3", quant=fp8),
        "shared_w2": kernel(inter, h, ("mlp", "embed"), "ffn.shared_experts.w2", quant=fp8),
    }
    for site in ("attn", "ffn"):
        out[f"hc_{site}_fn"] = stack((mix, hc * h), (None, None), f"hc_{site}_fn", dtype=F32)
        out[f"hc_{site}_base"] = stack((mix,), (None,), f"hc_{site}_base", init="zeros", dtype=F32)
        out[f"hc_{site}_scale"] = stack((3,), (None,), f"hc_{site}_scale", init="ones", dtype=F32)
    for w, (n_in, n_out, axes) in {"w1": (h, inter, ("embed", "mlp")), "w3": (h, inter, ("embed", "mlp")),
                                   "w2": (inter, h, ("mlp", "embed"))}.items():
        out[f"experts_{w}"] = ParamSpec(
            (n, n_experts, n_in, n_out), ("layers", "expert", *axes), prefix + f"ffn.experts.{{e}}.{w}.weight",
            transpose=True, layer_ids=tuple(ids), expert_ids=tuple(range(n_experts)), quant=fp_e)
    return out


# ----------------------------------------------------------------------------- layouts

def to_upstream(name: str) -> str:
    """The upstream name of a stored tensor name (transformers' ``model.`` prefix and ``lm_head``
    removed; upstream names come back unchanged)."""
    if name == "lm_head.weight":
        return "head.weight"
    return name[len("model."):] if name.startswith("model.") else name


def hf_name(name: str) -> str:
    """transformers' name of an upstream tensor name (``mtp.*`` and other non-model names unchanged)."""
    if name == "head.weight":
        return "lm_head.weight"
    if name.startswith(("embed.", "norm.", "layers.")):
        return "model." + name
    return name


def source_names(hf: dict, names) -> dict[str, str]:
    """{declared (upstream) name: stored name} of a checkpoint's tensor ``names`` in either layout."""
    return {to_upstream(n): n for n in names}
