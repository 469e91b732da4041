"""DeepSeek-V4.1 config: the released composite config.json (a nested ``text_config``) or
transformers' flat ``deepseek_v41_text`` layout.

Layers carry ``compress_ratios`` (0: sliding window only; 2 / 1: CSA2, a shared compressed KV).
Only ``kv_source_layer_ids`` own a compressor; a compressed layer reads the entries of the last
source at or before it (same ratio). ``index_source_layer_ids`` own an indexer; a compressed
layer keeps the selection of the last index source at or before it, which must be at or after
its KV source (the selection indexes that source's entries). ``candidate_source_layer_id``
(-1: none) also keeps the best ``candidate_topk_blocks`` blocks of ``candidate_block_size``
entries, inside which later index sources choose. What we do not implement is a ConfigError
naming the field; a config without a text model (vision only, or no ``text_config``) too.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from dspark_jax.errors import ConfigError

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE, TEXT_MODEL_TYPE = "deepseek_v41", "deepseek_v41_text"
EXPERT_DTYPES = ("fp8", "fp4")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
_TOP_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


class TokenMap:
    """The Engram's tokenizer-derived id map (token id -> compressed id), hashable in O(1) so a
    config holding it stays a cheap jit static."""

    def __init__(self, ids):
        self.ids = tuple(int(i) for i in ids)
        self._hash = hash(self.ids)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, TokenMap) and self._hash == other._hash and self.ids == other.ids

    def __len__(self):
        return len(self.ids)

    def __repr__(self):
        return f"TokenMap({len(self.ids)} ids -> {max(self.ids, default=-1) + 1})"


@dataclasses.dataclass(frozen=True)
class DeepseekV41Config:
    """A DeepSeek-V4.1 text decoder (``DeepseekV41ForCausalLM``; see the module docstring).

    ``qat``: the reference's fake quantizers (window K=V to FP8, compressed entries and indexer
    q / keys to FP4) run in every forward, as transformers' V4.1 does; False replaces them by the
    identity (the golden ``_noqat`` files). ``engram_token_map``: the compressed ids of the
    tokenizer (``engram.token_map``), read from the checkpoint directory's tokenizer.json.
    ``quant``: the checkpoint stores FP8 weights (e4m3, ``quant_block`` ue8m0 scales) and routed
    experts in ``expert_dtype``.
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
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 1
    candidate_block_size: int = 1
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: tuple[float, int, float, float] | None = None
    max_position_embeddings: int = 1048576
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 3
    engram_vocab_size: int = 0
    engram_n_heads: int = 1
    engram_head_dim: int = 32
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    engram_token_map: TokenMap | None = None
    qat: bool = True
    bos_token_id: int | None = 0
    eos_token_id: Any = 1
    pad_token_id: int | None = 2
    image_token_id: int | None = None
    quant: str | None = None
    quant_block: tuple[int, int] = (32, 32)
    expert_dtype: str | None = None
    num_nextn_predict_layers: int = 3
    extra: tuple[tuple[str, str], ...] = ()  # (key, JSON value) written back (dspark_*, image ids)

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "o_groups",
                     "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "index_n_heads",
                     "index_head_dim", "index_topk", "sliding_window", "hc_mult", "hc_sinkhorn_iters",
                     "candidate_topk_blocks", "candidate_block_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     f"config.json: field {name!r} must be a positive int, got {value!r}")
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        _require(len(ratios) == n, f"config.json: compress_ratios has {len(ratios)} entries for "
                                   f"num_hidden_layers={n}")
        _require(all(r >= 0 for r in ratios), f"config.json: compress_ratios {list(ratios)} has a negative entry")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            _require(list(ids) == sorted(set(ids)) and all(0 <= i < n for i in ids),
                     f"config.json: {name} {list(ids)} must be increasing layer ids below {n}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            bad = [i for i in getattr(self, name) if ratios[i] == 0]
            _require(not bad, f"config.json: {name} names layer {bad[0] if bad else ''} whose compress ratio is 0")
        for i, r in enumerate(ratios):
            if r == 0:
                continue
            src, isrc = self.kv_source(i), self.index_source(i)
            _require(src is not None and ratios[src] == r,
                     f"config.json: layer {i} (compress ratio {r}) has no KV source of that ratio at or before "
                     f"it in kv_source_layer_ids {list(self.kv_source_layer_ids)}")
            _require(isrc is not None and isrc >= src,
                     f"config.json: layer {i} has no index source between its KV source {src} and itself "
                     f"(index_source_layer_ids {list(self.index_source_layer_ids)})")
        c = self.candidate_source_layer_id
        _require(c == -1 or c in self.index_source_layer_ids,
                 f"config.json: candidate_source_layer_id {c} is not an index source")
        _require(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim),
                 f"config.json: qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim")
        _require((self.num_attention_heads * self.head_dim) % self.o_groups == 0,
                 f"config.json: o_groups={self.o_groups} does not divide heads x head_dim")
        _require(1 < self.num_experts_per_tok <= self.n_routed_experts,
                 "config.json: num_experts_per_tok must be in 2 .. n_routed_experts")
        _require(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
                 f"config.json: engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                 f"{len(self.engram_layer_ids)} engram_layer_ids")
        if self.engram_layer_ids:
            _require(self.engram_max_ngram_size >= 2 and self.engram_vocab_size > 0
                     and self.engram_compressed_vocab_size > 0,
                     "config.json: engram_max_ngram_size (>= 2), engram_vocab_size and "
                     "engram_compressed_vocab_size must be set when engram_layer_ids is not empty")
        if self.engram_token_map is not None:
            _require(len(self.engram_token_map) == self.vocab_size,
                     f"tokenizer.json: the Engram token map has {len(self.engram_token_map)} ids for "
                     f"vocab_size {self.vocab_size}")
        _require(self.quant in (None, "fp8"), f"config.json: quantization_config {self.quant!r} is not "
                                              "supported (fp8 e4m3 with ue8m0 scales)")
        _require(self.expert_dtype in (None, *EXPERT_DTYPES),
                 f"config.json: unknown expert_dtype {self.expert_dtype!r}; known {EXPERT_DTYPES}")

    # -------------------------------------------------------------------- derived
    def kv_source(self, i: int) -> int | None:
        """The KV source whose entries layer ``i`` attends (the last one at or before it)."""
        found = [s for s in self.kv_source_layer_ids if s <= i]
        return found[-1] if found else None

    def index_source(self, i: int) -> int | None:
        """The index source whose selection layer ``i`` uses (the last one at or before it)."""
        found = [s for s in self.index_source_layer_ids if s <= i]
        return found[-1] if found else None

    @property
    def gated_sources(self) -> tuple[int, ...]:
        """KV sources that pool (ratio > 1: a softmax gate ``wgate``)."""
        return tuple(i for i in self.kv_source_layer_ids if self.compress_ratios[i] > 1)

    def extra_value(self, key: str, default=None):
        return next((json.loads(v) for k, v in self.extra if k == key), default)

    # -------------------------------------------------------------------- reading
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "DeepseekV41Config":
        """From the released composite config.json (``text_config``) or transformers' flat one."""
        if isinstance(hf.get("text_config"), Mapping):
            text = dict(hf["text_config"])
            _require(text.get("model_type", TEXT_MODEL_TYPE) == TEXT_MODEL_TYPE,
                     f"config.json: text_config.model_type {text.get('model_type')!r} is not {TEXT_MODEL_TYPE!r}")
            top = {k: hf[k] for k in _TOP_KEYS if k in hf}
            qc = hf.get("quantization_config") or text.get("quantization_config") or {}
        elif hf.get("model_type") == TEXT_MODEL_TYPE:
            text, top, qc = dict(hf), {}, hf.get("quantization_config") or {}
        elif "vision_config" in hf:
            raise ConfigError("config.json: a vision-only DeepSeek-V4.1 config (no 'text_config'); "
                              "only the text model is implemented")
        else:
            raise ConfigError("config.json: field 'text_config' is missing (a DeepSeek-V4.1 config nests its "
                              f"text model there; model_type {hf.get('model_type')!r})")
        return cls._from_text({**text, **top}, qc)

    @classmethod
    def _from_text(cls, t: dict, qc: Mapping[str, Any]) -> "DeepseekV41Config":
        def get(key, default=None):
            return t[key] if t.get(key) is not None else default

        _require(get("scoring_func", "sqrtsoftplus") == "sqrtsoftplus",
                 f"config.json: scoring_func {t.get('scoring_func')!r} is not implemented (sqrtsoftplus)")
        for key, want in (("n_shared_experts", 1), ("num_key_value_heads", 1), ("gate_temp", 1.0)):
            _require(get(key, want) == want, f"config.json: {key}={t.get(key)} is not implemented ({want})")
        _require(get("norm_topk_prob", True) is True, "config.json: norm_topk_prob=false is not implemented")
        _require(get("hidden_act", "silu") == "silu",
                 f"config.json: hidden_act {t.get('hidden_act')!r} is not implemented (silu)")
        _require(not get("tie_word_embeddings", False), "config.json: tie_word_embeddings=true is not implemented")
        _require(not get("attention_bias", False), "config.json: attention_bias=true is not implemented")
        n = get("num_hidden_layers")
        _require(isinstance(n, int) and n > 0, "config.json: field 'num_hidden_layers' is missing or not a positive int")
        ratios = get("compress_ratios")
        _require(isinstance(ratios, list), "config.json: field 'compress_ratios' is missing")
        stages = get("num_nextn_predict_layers", 0)
        _require(len(ratios) in (n, n + stages) and not any(ratios[n:]),
                 f"config.json: compress_ratios has {len(ratios)} entries; expected num_hidden_layers={n} "
                 f"(+ one 0 per DSpark stage: {n + stages})")
        head_dim = get("head_dim")
        _require(isinstance(head_dim, int), "config.json: field 'head_dim' is missing")
        rope_dim = get("qk_rope_head_dim")
        rp = get("rope_parameters") or {}
        if rope_dim is None:
            factor = float((rp.get("main") or {}).get("partial_rotary_factor", get("partial_rotary_factor", 0.125)))
            rope_dim = int(head_dim * factor)
        rope_theta, compress_theta = float(get("rope_theta", 10000.0)), float(get("compress_rope_theta", 160000.0))
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            rope_theta = float(rp["main"].get("rope_theta", rope_theta))
            compress_theta = float(rp["compress"].get("rope_theta", compress_theta))
            compress = rp["compress"]
        else:
            compress = dict(get("rope_scaling") or {})
        kind = compress.get("rope_type", compress.get("type", "default"))
        _require(kind in ("default", "yarn"), f"config.json: rope_type {kind!r} is not implemented (default, yarn)")
        yarn = None
        if kind == "yarn":
            _require(float(compress.get("attention_factor", 1.0)) == 1.0,
                     "config.json: YaRN attention_factor != 1 is not what V4.1 does")
            _require("factor" in compress and "original_max_position_embeddings" in compress,
                     "config.json: YaRN rope needs 'factor' and 'original_max_position_embeddings'")
            yarn = (float(compress["factor"]), int(compress["original_max_position_embeddings"]),
                    float(compress.get("beta_fast") or 32.0), float(compress.get("beta_slow") or 1.0))
        quant, block = None, (32, 32)
        if qc:
            quant = qc.get("quant_method")
            _require(quant == "fp8", f"config.json: quantization_config.quant_method {quant!r} is not implemented (fp8)")
            _require(qc.get("fmt", "e4m3") == "e4m3" and qc.get("scale_fmt", "ue8m0") == "ue8m0",
                     "config.json: quantization_config fmt / scale_fmt other than e4m3 / ue8m0 is not implemented")
            block = tuple(int(b) for b in qc.get("weight_block_size", (32, 32)))
        expert_dtype = get("expert_dtype", qc.get("expert_dtype") if qc else None)
        if quant and expert_dtype is None:
            expert_dtype = "fp4"
        token_map = get("engram_token_map")
        extra = tuple(sorted((k, json.dumps(v)) for k, v in t.items() if k.startswith("dspark_")))
        if len(ratios) > n:
            extra += (("compress_ratios", json.dumps(ratios)),)
        ints = lambda key, default: int(get(key, default))
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
            moe_intermediate_size=get("moe_intermediate_size"), num_hidden_layers=n,
            num_attention_heads=get("num_attention_heads"), head_dim=head_dim, q_lora_rank=get("q_lora_rank"),
            qk_rope_head_dim=int(rope_dim), o_groups=get("o_groups"), o_lora_rank=get("o_lora_rank"),
            compress_ratios=ratios[:n], kv_source_layer_ids=get("kv_source_layer_ids", ()),
            index_source_layer_ids=get("index_source_layer_ids", ()),
            n_routed_experts=get("n_routed_experts"), num_experts_per_tok=get("num_experts_per_tok"),
            index_n_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"), index_topk=get("index_topk"),
            sliding_window=get("sliding_window"), candidate_source_layer_id=ints("candidate_source_layer_id", -1),
            candidate_topk_blocks=ints("candidate_topk_blocks", 1), candidate_block_size=ints("candidate_block_size", 1),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(get("swiglu_limit", 10.0)), hc_mult=get("hc_mult", 4),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", 20), hc_eps=float(get("hc_eps", 1e-6)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-20)), rope_theta=rope_theta,
            compress_rope_theta=compress_theta, yarn=yarn,
            max_position_embeddings=get("max_position_embeddings", 1048576),
            engram_layer_ids=get("engram_layer_ids", ()), engram_num_embeddings=get("engram_num_embeddings", ()),
            engram_max_ngram_size=ints("engram_max_ngram_size", 3), engram_vocab_size=ints("engram_vocab_size", 0),
            engram_n_heads=ints("engram_n_heads", 1), engram_head_dim=ints("engram_head_dim", 32),
            engram_pad_token_id=ints("engram_pad_token_id", get("engram_pad_id", 2)),
            engram_compressed_vocab_size=ints("engram_compressed_vocab_size", 0),
            engram_token_map=TokenMap(token_map) if token_map is not None else None,
            qat=bool(get("dspark_jax_qat", True)),
            bos_token_id=get("bos_token_id", 0), eos_token_id=get("eos_token_id", 1),
            pad_token_id=get("pad_token_id", 2), image_token_id=get("image_token_id"), quant=quant, quant_block=block, expert_dtype=expert_dtype,
            num_nextn_predict_layers=stages, extra=extra)

    def dequantized(self) -> "DeepseekV41Config":
        """The same model stored unquantized (what conversion writes)."""
        return dataclasses.replace(self, quant=None, expert_dtype=None)

    def quantized(self, expert_dtype: str = "fp4") -> "DeepseekV41Config":
        """The same model stored as the released checkpoints are: FP8 (e4m3, 32x32 ue8m0 blocks) and
        routed experts in ``expert_dtype``."""
        _require(expert_dtype in EXPERT_DTYPES, f"expert_dtype {expert_dtype!r} is unknown; known {EXPERT_DTYPES}")
        return dataclasses.replace(self, quant="fp8", quant_block=(32, 32), expert_dtype=expert_dtype)

    def to_hf(self) -> dict[str, Any]:
        """The released (composite) config.json: top-level ids, a nested ``text_config``."""
        text = {
            "model_type": TEXT_MODEL_TYPE, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "q_lora_rank": self.q_lora_rank,
            "o_lora_rank": self.o_lora_rank, "o_groups": self.o_groups, "hidden_act": "silu",
            "swiglu_limit": self.swiglu_limit, "rms_norm_eps": self.rms_norm_eps, "attention_bias": False,
            "max_position_embeddings": self.max_position_embeddings, "rope_theta": self.rope_theta,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": 1,
            "num_experts_per_tok": self.num_experts_per_tok, "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": self.routed_scaling_factor,
            "sliding_window": self.sliding_window, "compress_ratios": list(self.compress_ratios),
            "compress_rope_theta": self.compress_rope_theta, "kv_source_layer_ids": list(self.kv_source_layer_ids),
            "index_source_layer_ids": list(self.index_source_layer_ids), "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "candidate_source_layer_id": self.candidate_source_layer_id,
            "candidate_topk_blocks": self.candidate_topk_blocks, "candidate_block_size": self.candidate_block_size,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "engram_layer_ids": list(self.engram_layer_ids), "engram_num_embeddings": list(self.engram_num_embeddings),
            "engram_max_ngram_size": self.engram_max_ngram_size, "engram_vocab_size": self.engram_vocab_size,
            "engram_n_heads": self.engram_n_heads, "engram_head_dim": self.engram_head_dim,
            "engram_pad_token_id": self.engram_pad_token_id,
            "engram_compressed_vocab_size": self.engram_compressed_vocab_size,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }
        if self.yarn is not None:
            text["rope_scaling"] = dict(zip(_YARN_KEYS, self.yarn), rope_type="yarn")
        if not self.qat:
            text["dspark_jax_qat"] = False
        extra = {k: json.loads(v) for k, v in self.extra}
        top = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "bos_token_id": self.bos_token_id,
               "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}
        if self.image_token_id is not None:
            top["image_token_id"] = self.image_token_id
        text.update(extra)
        top["text_config"] = text
        if self.quant:
            top["quantization_config"] = {"quant_method": self.quant, "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": list(self.quant_block),
                                          "expert_dtype": self.expert_dtype}
        return top
