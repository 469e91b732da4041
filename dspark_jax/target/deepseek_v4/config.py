"""DeepSeek-V4 config: read from the released (upstream) config.json keys or transformers' keys.

Upstream keys: ``compress_ratios`` (per layer 0 / 4 / 128), ``num_hash_layers``, ``qk_rope_head_dim``,
``rope_scaling`` (YaRN of the compressed branches), ``compress_rope_theta``, ``expert_dtype``,
``quantization_config``. transformers' keys: ``layer_types``, ``mlp_layer_types``,
``compress_rates``, ``partial_rotary_factor``, ``rope_parameters`` {main, compress}. Whatever the
model does that we do not implement (another scoring function, more shared experts, an attention
type or rope type we do not know, ...) is a ConfigError naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from dspark_jax.errors import ConfigError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
ARCHITECTURE = "DeepseekV4ForCausalLM"
EXPERT_DTYPES = ("fp8", "fp4")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """A DeepSeek-V4 decoder (``DeepseekV4ForCausalLM``).

    ``layer_types[i]``: sliding window only, + CSA (ratio ``csa_ratio``, overlapping windows and
    a Lightning Indexer keeping ``index_topk`` entries) or + HCA (ratio ``hca_ratio``).
    ``mlp_layer_types[i]``: ``hash_moe`` (frozen ``tid2eid`` routing) or ``moe``.
    ``yarn``: the compressed branches' YaRN (factor, original_max_position_embeddings, beta_fast,
    beta_slow), applied with attention factor 1 (no magnitude scaling); ``None``: plain rotary.
    ``quant``: the checkpoint's weights are FP8 (e4m3, ``quant_block`` ue8m0 block scales) and the
    routed experts ``expert_dtype`` ("fp8" or "fp4" = MXFP4); conversion dequantizes them.
    """

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    csa_ratio: int = 4
    hca_ratio: int = 128
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: tuple[float, int, float, float] | None = None
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_id: Any = 1
    quant: str | None = None
    quant_block: tuple[int, int] = (128, 128)
    expert_dtype: str | None = None
    num_nextn_predict_layers: int = 1
    extra: tuple[tuple[str, str], ...] = ()  # (key, JSON value) kept for writing back (dspark_*)

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "o_groups",
                     "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "index_n_heads",
                     "index_head_dim", "index_topk", "sliding_window", "csa_ratio", "hca_ratio",
                     "hc_mult", "hc_sinkhorn_iters"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     f"config.json: field {name!r} must be a positive int, got {value!r}")
        n = self.num_hidden_layers
        _require(len(self.layer_types) == n,
                 f"config.json: {len(self.layer_types)} attention layer types for num_hidden_layers={n}")
        _require(len(self.mlp_layer_types) == n,
                 f"config.json: {len(self.mlp_layer_types)} mlp layer types for num_hidden_layers={n}")
        bad = [t for t in self.layer_types if t not in ATTENTION_TYPES]
        _require(not bad, f"config.json: attention type {bad[0] if bad else ''!r} is not implemented; "
                          f"known {ATTENTION_TYPES}")
        bad = [t for t in self.mlp_layer_types if t not in (HASH_MOE, MOE)]
        _require(not bad, f"config.json: mlp layer type {bad[0] if bad else ''!r} is not implemented; "
                          f"known {(HASH_MOE, MOE)}")
        _require(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.head_dim,
                 f"config.json: qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim")
        _require((self.num_attention_heads * self.head_dim) % self.o_groups == 0,
                 f"config.json: o_groups={self.o_groups} does not divide heads x head_dim")
        _require(self.num_experts_per_tok <= self.n_routed_experts,
                 "config.json: num_experts_per_tok exceeds n_routed_experts")
        _require(self.quant in (None, "fp8"), f"config.json: quantization_config {self.quant!r} is not "
                                              "supported (fp8 e4m3 with ue8m0 scales)")
        _require(self.expert_dtype in (None, *EXPERT_DTYPES),
                 f"config.json: unknown expert_dtype {self.expert_dtype!r}; known {EXPERT_DTYPES}")

    # -------------------------------------------------------------------- derived
    def layer_ids(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

    def mlp_ids(self, mlp_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == mlp_type)

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        ratio = {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}
        return tuple(ratio[t] for t in self.layer_types)

    # -------------------------------------------------------------------- reading
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DeepseekV4Config":
        """From either layout's config.json (see the module docstring)."""
        def get(key, default=None):
            return hf.get(key, default) if hf.get(key) is not None else default

        _require(get("scoring_func", "sqrtsoftplus") == "sqrtsoftplus",
                 f"config.json: scoring_func {hf.get('scoring_func')!r} is not implemented (sqrtsoftplus)")
        _require(get("n_shared_experts", 1) == 1,
                 f"config.json: n_shared_experts={hf.get('n_shared_experts')} is not implemented (1)")
        _require(get("num_key_value_heads", 1) == 1,
                 f"config.json: num_key_value_heads={hf.get('num_key_value_heads')} is not implemented (1)")
        _require(get("norm_topk_prob", True) is True, "config.json: norm_topk_prob=false is not implemented")
        _require(get("hidden_act", "silu") == "silu",
                 f"config.json: hidden_act {hf.get('hidden_act')!r} is not implemented (silu)")
        _require(not get("tie_word_embeddings", False), "config.json: tie_word_embeddings=true is not implemented")
        for key in ("attention_bias", "mlp_bias"):
            _require(not get(key, False), f"config.json: {key}=true is not implemented")
        _require(get("topk_method", "noaux_tc") in ("noaux_tc",) and not get("n_group"),
                 "config.json: grouped expert routing (n_group/topk_group) is not implemented")
        n = get("num_hidden_layers")
        _require(isinstance(n, int) and n > 0,
                 "config.json: field 'num_hidden_layers' is missing or not a positive int")
        rates = dict(get("compress_rates") or {})
        csa_ratio = int(rates.get(CSA, get("compress_rate_csa", 4)))
        hca_ratio = int(rates.get(HCA, get("compress_rate_hca", 128)))
        if get("layer_types") is not None:
            layer_types = list(hf["layer_types"])
        elif get("compress_ratios") is not None:
            by_ratio = {0: SLIDING, csa_ratio: CSA, hca_ratio: HCA}
            ratios = list(hf["compress_ratios"])
            _require(len(ratios) >= n, f"config.json: compress_ratios has {len(ratios)} entries, "
                                       f"num_hidden_layers is {n}")
            bad = [r for r in ratios if r not in by_ratio]
            _require(not bad, f"config.json: compress_ratios entry {bad[0] if bad else ''} names an attention "
                              f"type we don't implement (0, {csa_ratio} = CSA, {hca_ratio} = HCA)")
            layer_types = [by_ratio[r] for r in ratios]
        else:
            raise ConfigError("config.json: neither 'layer_types' nor 'compress_ratios' is given")
        layer_types = layer_types[:n]  # upstream appends one 0 per DSpark stage (mtp.*)
        if get("mlp_layer_types") is not None:
            mlp_types = list(hf["mlp_layer_types"])[:n]
        else:
            n_hash = int(get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        head_dim = get("head_dim")
        _require(isinstance(head_dim, int), "config.json: field 'head_dim' is missing")
        rope_dim = get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * float(get("partial_rotary_factor", 64 / 512)))
        rope_theta, compress_theta = float(get("rope_theta", 10000.0)), float(get("compress_rope_theta", 160000.0))
        rp = get("rope_parameters") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main, compress = rp["main"], rp["compress"]
            _require(main.get("rope_type", "default") == "default",
                     f"config.json: rope_parameters.main.rope_type {main.get('rope_type')!r} is not implemented")
            rope_theta = float(main.get("rope_theta", rope_theta))
            compress_theta = float(compress.get("rope_theta", compress_theta))
        else:
            compress = dict(get("rope_scaling") or {})
        compress_type = compress.get("rope_type", compress.get("type", "default"))
        _require(compress_type in ("default", "yarn"),
                 f"config.json: compressed-branch rope_type {compress_type!r} is not implemented (default, yarn)")
        yarn = None
        if compress_type == "yarn":
            _require(float(compress.get("attention_factor", 1.0)) == 1.0,
                     "config.json: YaRN attention_factor != 1 is not what V4 does")
            _require("factor" in compress and "original_max_position_embeddings" in compress,
                     "config.json: YaRN rope needs 'factor' and 'original_max_position_embeddings'")
            yarn = (float(compress["factor"]), int(compress["original_max_position_embeddings"]),
                    float(compress.get("beta_fast") or 32.0), float(compress.get("beta_slow") or 1.0))
        qc = get("quantization_config") or {}
        quant, block = None, (128, 128)
        if qc:
            quant = qc.get("quant_method")
            _require(quant == "fp8", f"config.json: quantization_config.quant_method {quant!r} is not "
                                     "implemented (fp8)")
            _require(qc.get("fmt", "e4m3") == "e4m3" and qc.get("scale_fmt", "ue8m0") == "ue8m0",
                     f"config.json: quantization_config fmt {qc.get('fmt')!r} / scale_fmt "
                     f"{qc.get('scale_fmt')!r} is not implemented (e4m3 / ue8m0)")
            block = tuple(int(b) for b in qc.get("weight_block_size", (128, 128)))
        expert_dtype = get("expert_dtype", qc.get("expert_dtype"))
        if quant and expert_dtype is None:
            expert_dtype = "fp8"
        extra = tuple((k, json.dumps(v)) for k, v in hf.items() if k.startswith("dspark_"))
        if len(hf.get("compress_ratios") or ()) > n:  # DSpark stages' ratios: written back as read
            extra += (("compress_ratios", json.dumps(hf["compress_ratios"])),)
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
            moe_intermediate_size=get("moe_intermediate_size"), num_hidden_layers=n,
            num_attention_heads=get("num_attention_heads"), head_dim=head_dim,
            q_lora_rank=get("q_lora_rank"), qk_rope_head_dim=int(rope_dim),
            o_groups=get("o_groups"), o_lora_rank=get("o_lora_rank"),
            layer_types=layer_types, mlp_layer_types=mlp_types,
            n_routed_experts=get("n_routed_experts"), num_experts_per_tok=get("num_experts_per_tok"),
            index_n_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"),
            index_topk=get("index_topk"), sliding_window=get("sliding_window"),
            csa_ratio=csa_ratio, hca_ratio=hca_ratio,
            routed_scaling_factor=float(get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(get("swiglu_limit", 10.0)), hc_mult=get("hc_mult", 4),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", 20), hc_eps=float(get("hc_eps", 1e-6)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            compress_rope_theta=compress_theta, yarn=yarn,
            max_position_embeddings=get("max_position_embeddings", 1048576),
            bos_token_id=get("bos_token_id", 0), eos_token_id=get("eos_token_id", 1),
            quant=quant, quant_block=block, expert_dtype=expert_dtype,
            num_nextn_predict_layers=get("num_nextn_predict_layers", 1), extra=extra)

    def dequantized(self) -> "DeepseekV4Config":
        """The same model stored unquantized (what conversion writes)."""
        return dataclasses.replace(self, quant=None, expert_dtype=None)

    def quantized(self, expert_dtype: str = "fp4") -> "DeepseekV4Config":
        """The same model stored as the released checkpoints are: FP8 weights (e4m3, 128x128
        ue8m0 block scales) and routed experts in ``expert_dtype`` ("fp4" = MXFP4, or "fp8")."""
        _require(expert_dtype in EXPERT_DTYPES,
                 f"expert_dtype {expert_dtype!r} is unknown; known {EXPERT_DTYPES}")
        return dataclasses.replace(self, quant="fp8", quant_block=(128, 128), expert_dtype=expert_dtype)

    def to_hf(self) -> dict[str, Any]:
        """The upstream config.json keys (the layout ``--to torch`` writes)."""
        hf = {
            "architectures": [ARCHITECTURE], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": 1,
            "head_dim": self.head_dim, "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim, "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank, "compress_ratios": list(self.compress_ratios),
            "num_hash_layers": len(self.mlp_ids(HASH_MOE)),
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": 1,
            "num_experts_per_tok": self.num_experts_per_tok, "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True, "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit, "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "sliding_window": self.sliding_window, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            # transformers' own keys of the same facts: cleared, so a config written over a
            # transformers-layout config.json is in the upstream layout only
            "layer_types": None, "mlp_layer_types": None, "compress_rates": None,
            "rope_parameters": None, "partial_rotary_factor": None,
        }
        n_hash = hf["num_hash_layers"]
        if self.mlp_layer_types != (HASH_MOE,) * n_hash + (MOE,) * (self.num_hidden_layers - n_hash):
            hf["mlp_layer_types"] = list(self.mlp_layer_types)
        if (self.csa_ratio, self.hca_ratio) != (4, 128):  # transformers maps only 0 / 4 / 128 ratios
            hf["compress_rates"] = {CSA: self.csa_ratio, HCA: self.hca_ratio}
            hf["layer_types"] = list(self.layer_types)
        if self.yarn is not None:
            hf["rope_scaling"] = dict(zip(_YARN_KEYS, self.yarn), rope_type="yarn")
        if self.quant:
            hf["quantization_config"] = {"quant_method": self.quant, "fmt": "e4m3", "scale_fmt": "ue8m0",
                                         "weight_block_size": list(self.quant_block)}
            hf["expert_dtype"] = self.expert_dtype
        hf.update({k: json.loads(v) for k, v in self.extra})
        return hf
