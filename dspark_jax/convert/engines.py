"""What each serving engine loads, as data: load rules, config transforms and sidecar files.

Every rule names the engine file it was read from (the engines' public repositories, read
2026-11). A rule is a predicate over ``DraftFacts`` (the
family-independent facts of a drafter config) that returns ``None`` when the engine can load
the drafter, else one line saying why not.

Engines: ``deepspec`` (the PyTorch reference), ``vllm``, ``sglang``, ``sglang-jax``; trainers
(exports back, convert/foreign.py layouts): ``speculators``, ``specforge``. ``CHECKED`` names
the releases whose own loaders tests/test_interop_*.py run; each rule says whether it was
checked against one (``Rule.checked``) or read from the source.
Families: ``qwen3`` and ``gemma4`` (``draft.gemma4.Gemma4DraftConfig``; its family is read from
``architectures`` and ``attention_k_eq_v`` from its text config). Both are tested against
checkers written from the engines' loaders (tests/test_serving.py).

DeepSeek-V4's own DSpark module (``mtp.*`` inside the V4 checkpoint) has its own rules over
the exported checkpoint (``engines_v4``); ``export`` writes what these rules accept.

``serving_warnings(draft_cfg, engines)`` is what `train` prints at start-up (config key
``serve_engines``); ``check(draft_cfg, engine)`` is what `export` / `inspect` refuse on;
``export_config(hf, draft_cfg, engine)`` rewrites a drafter's config.json for an engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from dspark_jax.errors import ConfigError

ENGINES = ("deepspec", "vllm", "sglang", "sglang-jax")
# Other trainers an export can go back to (convert/foreign.py writes their layout).
TRAINERS = ("speculators", "specforge")
TARGETS = ENGINES + TRAINERS

# The engine releases whose own loaders tests/test_interop_*.py drive (pinned in
# .ci/interop-requirements.txt); a rule with ``checked=CHECKED[engine]`` is asserted against
# that running code, the others are as read from the engine's source (``checked="read"``).
# CHECKED_FAMILIES: the drafter families run through each (other families' rules stay as read).
CHECKED = {"vllm": "vllm 0.33.0", "speculators": "speculators 0.9.0", "specforge": "specforge 0.2.0"}
CHECKED_FAMILIES = {"vllm": ("qwen3", "gemma4"), "speculators": ("qwen3",), "specforge": ("qwen3",)}

# architectures[0] each engine selects its DSpark drafter class by, per family.
ARCHITECTURES: dict[str, dict[str, str]] = {
    # DeepSpec deepspec/modeling/dspark/{qwen3,gemma4}/config.py (our own save format).
    "deepspec": {"qwen3": "Qwen3DSparkModel", "gemma4": "Gemma4DSparkModel"},
    # vllm/model_executor/models/qwen3_dspark.py (Qwen3DSparkForCausalLM) and
    # gemma4_dspark.py (Gemma4DSparkForCausalLM), registered in models/registry.py under the
    # architecture names "Qwen3DSparkModel" / "Gemma4DSparkModel".
    "vllm": {"qwen3": "Qwen3DSparkModel", "gemma4": "Gemma4DSparkModel"},
    # python/sglang/srt/models/dspark.py: EntryClass = [Qwen3DSparkModel], a DFlashDraftModel
    # (Qwen3 layers) backbone; no Gemma4 DSpark class anywhere in python/sglang/srt/models/.
    "sglang": {"qwen3": "Qwen3DSparkModel"},
    # python/sgl_jax/srt/models/dspark.py: EntryClass = Qwen3DSparkModel (DFlashDraftModel
    # backbone); no Gemma4 DSpark class in python/sgl_jax/srt/models/ (gemma4_mtp.py is MTP).
    "sglang-jax": {"qwen3": "Qwen3DSparkModel"},
    # speculators src/speculators/models/dspark/core.py and SpecForge
    # specforge/modeling/draft/dspark.py: DSparkDraftModel over a Qwen3 backbone only.
    "speculators": {"qwen3": "DSparkDraftModel"},
    "specforge": {"qwen3": "DSparkDraftModel"},
}


@dataclasses.dataclass(frozen=True)
class DraftFacts:
    """The facts of a drafter the engines' loaders look at (any family)."""

    family: str
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    vocab_size: int
    attention_k_eq_v: bool | None = None  # Gemma4 only; None = unknown

    @property
    def head(self) -> str:
        """'vanilla' | 'gated' | 'rnn' | 'dflash' (markov_rank 0)."""
        return self.markov_head_type if self.markov_rank > 0 else "dflash"


def family_of(cfg) -> str:
    """'qwen3' / 'gemma4' from a drafter config (``cfg.family`` if it has one)."""
    fam = getattr(cfg, "family", None)
    if fam:
        return str(fam).lower()
    arch = (cfg.to_hf().get("architectures") or [""])[0] if hasattr(cfg, "to_hf") else ""
    return "gemma4" if arch.lower().startswith("gemma4") else "qwen3"


def facts(cfg) -> DraftFacts:
    """DraftFacts of a drafter config object (DraftConfig or a family's equivalent)."""
    return DraftFacts(
        family=family_of(cfg),
        markov_rank=int(cfg.markov_rank),
        markov_head_type=str(getattr(cfg, "markov_head_type", "vanilla")),
        enable_confidence_head=bool(cfg.enable_confidence_head),
        confidence_head_with_markov=bool(getattr(cfg, "confidence_head_with_markov", False)),
        target_layer_ids=tuple(int(i) for i in cfg.target_layer_ids),
        num_target_layers=int(cfg.num_target_layers),
        block_size=int(cfg.block_size),
        mask_token_id=int(cfg.mask_token_id),
        vocab_size=int(cfg.vocab_size),
        attention_k_eq_v=_k_eq_v(cfg),
    )


def _k_eq_v(cfg) -> bool | None:
    """``attention_k_eq_v`` of a Gemma4 drafter (on its text config), else None."""
    text = getattr(cfg, "text", None)
    value = getattr(text, "attention_k_eq_v", getattr(cfg, "attention_k_eq_v", None))
    return None if value is None else bool(value)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One load rule of one engine: ``test(facts)`` -> None (ok) or the reason it fails."""

    engine: str
    name: str
    source: str
    test: Callable[[DraftFacts], str | None]
    families: tuple[str, ...] = ("qwen3", "gemma4")
    severity: str = "error"  # "error": the engine refuses; "warning": loads but degrades
    checked: str = "read"  # the engine version whose own loader ran it (see CHECKED), else "read"


def _family_supported(engine: str) -> Callable[[DraftFacts], str | None]:
    def test(f: DraftFacts):
        if f.family not in ARCHITECTURES[engine]:
            return (f"{engine} has no {f.family} DSpark drafter class "
                    f"(supported: {sorted(ARCHITECTURES[engine])})")
        return None
    return test


def _markov_rank_positive(engine: str, why: str):
    def test(f: DraftFacts):
        return None if f.markov_rank > 0 else f"{engine} needs markov_rank > 0 ({why}); this is a DFlash twin"
    return test


def _vanilla_only(engine: str):
    def test(f: DraftFacts):
        if f.markov_rank > 0 and f.markov_head_type != "vanilla":
            extra = f"markov_head.{'gate_proj' if f.markov_head_type == 'gated' else 'joint_proj'}.*"
            if engine == "vllm" and f.family == "gemma4":
                return (f"vllm's Gemma4 DSpark loader builds only the vanilla Markov head and silently "
                        f"skips the {f.markov_head_type} head's {extra}: it would draft with a wrong head")
            return (f"{engine} loads only the vanilla Markov head; the {f.markov_head_type} head's "
                    f"extra tensors ({extra}) are refused")
        return None
    return test


def _no_embedding_tap(engine: str):
    def test(f: DraftFacts):
        if -1 in f.target_layer_ids:
            return (f"{engine} cannot tap target layer id -1 (the embedding output): it captures the "
                    "residual stream at id+1 and adds a residual that does not exist before layer 0")
        return None
    return test


def _capture_in_range(engine: str):
    def test(f: DraftFacts):
        bad = [i for i in f.target_layer_ids if not 0 <= i <= f.num_target_layers - 2]
        if bad:
            return (f"{engine} captures target layer id+1, so every id must be in "
                    f"[0, {f.num_target_layers - 2}]; got {bad}")
        return None
    return test


def _capture_in_range_or_embedding(engine: str, last: int = 2):
    """ids in [-1, N - last]: capture point id + 1, 0 being the embedding output."""
    def test(f: DraftFacts):
        bad = [i for i in f.target_layer_ids if not -1 <= i <= f.num_target_layers - last]
        if bad:
            return (f"{engine} captures target layer id+1, so every id must be in "
                    f"[-1, {f.num_target_layers - last}]; got {bad}")
        return None
    return test


def _needs_confidence_head(f: DraftFacts):
    if not f.enable_confidence_head:
        return ("sglang builds the confidence head whatever enable_confidence_head says and refuses a "
                "checkpoint without confidence_head.proj.* (unless its static verify mode is chosen)")
    return None


def _mask_in_vocab(f: DraftFacts):
    if not 0 <= f.mask_token_id < f.vocab_size:
        return f"sglang needs mask_token_id < target vocab ({f.mask_token_id} >= {f.vocab_size})"
    return None


def _gemma4_k_eq_v(f: DraftFacts):
    if f.family == "gemma4" and f.attention_k_eq_v is False:
        return ("vllm's Gemma4 DSpark loader requires k = v on every layer (attention_k_eq_v: true); "
                "its fused context-KV precompute asserts it")
    return None


def _vllm_drops_missing_confidence(f: DraftFacts):
    if not f.enable_confidence_head:
        return "vllm runs without a confidence head: adaptive verification / STS are unavailable"
    return None


def _vllm_empty_markov(f: DraftFacts):
    if f.markov_rank == 0:
        return ("vllm builds its DSpark Markov head with rank 0 (empty markov_w1/w2, zero bias): "
                "it drafts as DFlash")
    return None


def _ignored_confidence(engine: str):
    def test(f: DraftFacts):
        if f.enable_confidence_head:
            return f"{engine} ignores the confidence head (greedy, fixed-width verification)"
        return None
    return test


RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- deepspec (reference)
    Rule("deepspec", "family", "deepspec/modeling/dspark/{qwen3,gemma4}/modeling.py",
         _family_supported("deepspec")),
    # ---------------------------------------------------------------- vLLM
    Rule("vllm", "family", "vllm/model_executor/models/qwen3_dspark.py, gemma4_dspark.py",
         _family_supported("vllm"), checked=CHECKED["vllm"]),
    # Qwen3DSparkModel.__init__ builds DSparkMarkovHead(vocab, draft_vocab, markov_rank)
    # unconditionally: with rank 0 its markov_w1/w2 are empty (V x 0) and load_weights accepts
    # a checkpoint without them (vllm 0.33.0, run): a zero bias, so it drafts as DFlash.
    Rule("vllm", "markov-rank-0", "vllm/model_executor/models/qwen3_dspark.py (Qwen3DSparkModel, "
         "load_weights)", _vllm_empty_markov, families=("qwen3",), severity="warning",
         checked=CHECKED["vllm"]),
    # gemma4_dspark.py Gemma4DSparkModel.__init__ builds the head too (read, not run).
    Rule("vllm", "markov_rank>0", "vllm/model_executor/models/gemma4_dspark.py (Gemma4DSparkModel)",
         _markov_rank_positive("vllm", "the DSpark model always builds markov_head.markov_w1/w2"),
         families=("gemma4",)),
    # Qwen3DSparkForCausalLM.load_weights -> AutoWeightsLoader: any tensor without a module
    # (markov_head.gate_proj.*, markov_head.joint_proj.*) raises. Gemma4DSparkForCausalLM.
    # load_weights loads only names it has a parameter for and skips the rest silently.
    Rule("vllm", "vanilla-markov", "vllm/model_executor/models/qwen3_dspark.py (load_weights); "
         "gemma4_dspark.py (Gemma4DSparkForCausalLM.load_weights)", _vanilla_only("vllm"),
         checked=CHECKED["vllm"]),
    # Aux hidden states are captured at id+1 (eagle3_utils.get_eagle3_aux_layers_from_config);
    # qwen2.py Qwen2Model.forward (Qwen3's) captures point 0 before the first layer and
    # EagleModelMixin._maybe_add_hidden_state returns the embedding when the residual is None,
    # so -1 (the embedding output) is served; points 1..N follow each layer, so id <= N-1.
    # (Read as "no -1" from older sources; vllm 0.33.0's running code serves it.)
    Rule("vllm", "capture-in-range", "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py "
         "(get_eagle3_aux_layers_from_config); vllm/model_executor/models/interfaces.py "
         "(_maybe_add_hidden_state)", _capture_in_range_or_embedding("vllm", last=1),
         families=("qwen3",), checked=CHECKED["vllm"]),
    # Gemma4DSparkAttention: use_k_eq_v = full_attention layer and config.attention_k_eq_v;
    # Gemma4DSparkModel._build_fused_kv_buffers asserts every layer uses k = v.
    Rule("vllm", "gemma4-k-eq-v", "vllm/model_executor/models/gemma4_dspark.py "
         "(Gemma4DSparkAttention, _build_fused_kv_buffers)", _gemma4_k_eq_v, families=("gemma4",)),
    # (Gemma4DSparkForCausalLM.load_weights once skipped confidence_head.*; vllm 0.33.0 loads it:
    # run, tests/test_interop_vllm.py.)
    # load_weights: confidence_head optional -> set to None when absent.
    Rule("vllm", "confidence-optional", "vllm/model_executor/models/qwen3_dspark.py (load_weights)",
         _vllm_drops_missing_confidence, families=("qwen3",), severity="warning",
         checked=CHECKED["vllm"]),
    # ---------------------------------------------------------------- SGLang
    Rule("sglang", "family", "python/sglang/srt/models/dspark.py (EntryClass)",
         _family_supported("sglang")),
    # DSparkDraftMixin.__init__ / build_markov_head and dspark_config.resolve_runtime_config.
    Rule("sglang", "markov_rank>0", "python/sglang/srt/models/dspark.py (build_markov_head); "
         "speculative/dspark_components/dspark_config.py (resolve_runtime_config)",
         _markov_rank_positive("sglang", "the DFlash twin is not a DSPARK checkpoint")),
    # dflash_utils.DFlashDraftConfig.resolve_target_layer_ids rejects ids < 0; models/qwen3.py
    # set_dflash_layers_to_capture captures at id+1 and its forward appends
    # hidden_states + residual (None before layer 0).
    Rule("sglang", "no-layer-id-minus-1", "python/sglang/srt/speculative/dflash_utils.py "
         "(resolve_target_layer_ids)", _no_embedding_tap("sglang")),
    Rule("sglang", "capture-in-range", "python/sglang/srt/models/qwen3.py "
         "(set_dflash_layers_to_capture, id+1)", _capture_in_range("sglang")),
    # build_confidence_head ignores enable_confidence_head; _load_confidence_weights raises on
    # missing confidence_head.* tensors.
    Rule("sglang", "confidence-head-present", "python/sglang/srt/models/dspark.py "
         "(build_confidence_head, _load_confidence_weights)", _needs_confidence_head),
    Rule("sglang", "mask-in-vocab", "python/sglang/srt/speculative/dspark_components/dspark_config.py "
         "(resolve_runtime_config)", _mask_in_vocab),
    # ---------------------------------------------------------------- sglang-jax
    Rule("sglang-jax", "family", "python/sgl_jax/srt/models/dspark.py (EntryClass)",
         _family_supported("sglang-jax")),
    Rule("sglang-jax", "markov_rank>0", "python/sgl_jax/srt/models/dspark.py (DSparkDraftModel.__init__)",
         _markov_rank_positive("sglang-jax", "its DSpark worker runs the vanilla Markov head")),
    Rule("sglang-jax", "vanilla-markov", "python/sgl_jax/srt/models/dspark.py (DSparkDraftModel.__init__: "
         "markov_head_type must be 'vanilla')", _vanilla_only("sglang-jax")),
    # python/sgl_jax/srt/models/qwen3.py: set_dflash_layers_to_capture captures at id+1 and
    # handles a None residual (so -1, the embedding output, works); a capture point >= N is
    # never reached (features silently missing), so ids must be <= N-2.
    Rule("sglang-jax", "capture-in-range", "python/sgl_jax/srt/models/qwen3.py "
         "(set_dflash_layers_to_capture, forward)", _capture_in_range_or_embedding("sglang-jax")),
    # python/sgl_jax/srt/speculative/dflash_util.py parse_dflash_draft_config: block_size > 1.
    Rule("sglang-jax", "block_size>1", "python/sgl_jax/srt/speculative/dflash_util.py "
         "(parse_dflash_draft_config)", lambda f: None if f.block_size > 1 else
         f"sglang-jax needs block_size > 1, got {f.block_size}"),
    Rule("sglang-jax", "confidence-ignored", "python/sgl_jax/srt/speculative/dspark_worker.py "
         "(SERVING.md)", _ignored_confidence("sglang-jax"), severity="warning"),
    # ---------------------------------------------------------------- trainers (run: interop tests)
    Rule("speculators", "family", "src/speculators/models/dspark/core.py (DSparkDraftModel: Qwen3 layers)",
         _family_supported("speculators"), checked=CHECKED["speculators"]),
    Rule("specforge", "family", "specforge/modeling/draft/dspark.py (DSparkDraftModel: Qwen3 layers)",
         _family_supported("specforge"), checked=CHECKED["specforge"]),
)


def _engine(engine: str) -> str:
    if engine not in TARGETS:
        raise ConfigError(f"engine {engine!r} is unknown; expected one of {list(TARGETS)}")
    return engine


def rules_for(engine: str, family: str | None = None) -> list[Rule]:
    """The rules of ``engine`` (those that apply to ``family`` when given)."""
    _engine(engine)
    return [r for r in RULES if r.engine == engine and (family is None or family in r.families)]


def violations(cfg, engine: str, severity: str = "error") -> list[tuple[Rule, str]]:
    """(rule, reason) for every ``severity`` rule of ``engine`` that ``cfg`` breaks."""
    f = cfg if isinstance(cfg, DraftFacts) else facts(cfg)
    out = []
    for rule in rules_for(engine, f.family):
        if rule.severity != severity:
            continue
        why = rule.test(f)
        if why:
            out.append((rule, why))
    return out


def checked_against(engine: str, family: str | None = None) -> list[str]:
    """The engine versions whose running code checked ``engine``'s rules (for ``family``)."""
    if family is not None and family not in CHECKED_FAMILIES.get(engine, ()):
        return []
    return sorted({r.checked for r in rules_for(engine, family) if r.checked != "read"})


def check(cfg, engine: str) -> str | None:
    """None when ``engine`` loads this drafter, else one line naming the first violated rule."""
    bad = violations(cfg, engine)
    if not bad:
        return None
    rule, why = bad[0]
    return f"{engine} rule '{rule.name}' ({rule.source}): {why}"


def serving_warnings(draft_cfg, engines: Sequence[str]) -> list[str]:
    """Start-up warnings for `train`: one line per engine rule the configured drafter breaks.

    ``engines`` is the train config's ``serve_engines`` (e.g. ["vllm", "sglang"]); [] -> [].
    """
    out = []
    for engine in engines:
        for rule, why in violations(draft_cfg, engine, "error"):
            out.append(f"cannot be served by {engine}: {why} [rule '{rule.name}', {rule.source}]")
        for rule, why in violations(draft_cfg, engine, "warning"):
            out.append(f"{engine} will load it with a limitation: {why} [{rule.source}]")
    return out


# --------------------------------------------------------------------------- export transforms

# Keys a speculators-format config carries; SGLang refuses a config with
# speculators_model_type == "dspark" (python/sglang/srt/models/dspark.py, DSparkDraftMixin).
_FOREIGN_KEYS = ("speculators_model_type", "speculators_config", "speculators_version",
                 "transformer_layer_config")


def export_config(hf: Mapping[str, Any], cfg, engine: str) -> dict:
    """``hf`` (the drafter's config.json dict) rewritten so ``engine`` loads it unchanged.

    * architectures = [the engine's class name for this family];
    * target_layer_ids (our convention: decoder-layer outputs) is kept, and mirrored into
      ``dflash_config.target_layer_ids`` / ``dflash_config.mask_token_id`` (vLLM
      vllm/config/speculative.py and SGLang dflash_utils.parse_dflash_draft_config read it
      there first, both in the same convention, +1 internally);
    * ``n_predict`` = block_size: vLLM takes the number of speculative tokens from it
      (vllm/config/speculative.py), DSpark drafts block_size tokens per step (sample from anchor);
    * speculators keys are dropped (SGLang refuses speculators_model_type == "dspark").
    """
    _engine(engine)
    f = facts(cfg)
    out = {k: v for k, v in hf.items() if k not in _FOREIGN_KEYS}
    arch = ARCHITECTURES[engine].get(f.family)
    if arch is None:
        raise ConfigError(_family_supported(engine)(f))
    out["architectures"] = [arch]
    out["target_layer_ids"] = list(f.target_layer_ids)
    out["block_size"] = f.block_size
    out["mask_token_id"] = f.mask_token_id
    if engine != "deepspec":
        dflash = dict(out.get("dflash_config") or {})
        dflash.update({"target_layer_ids": list(f.target_layer_ids), "mask_token_id": f.mask_token_id,
                       "block_size": f.block_size})
        out["dflash_config"] = dflash
        out["n_predict"] = f.block_size
        # qwen3_dspark.py: layer_types full_attention makes the drafter non-causal.
        out.setdefault("layer_types", ["full_attention"] * int(out.get("num_hidden_layers", 1)))
    return out


# --------------------------------------------------------------------------- SGLang sidecars

STS_FILE = "dspark_sts.json"
SPS_FILE = "dspark_sps.json"


def sts_sidecar(temperatures: Sequence[float], report: Mapping | None = None) -> dict:
    """SGLang's STS calibration JSON (dspark_components/dspark_sts.py DSparkStsCalibration):
    temperatures (all > 0), dataset, num_samples, ece_before / ece_after (per position)."""
    temps = [float(t) for t in temperatures]
    if not temps or any(t <= 0 for t in temps):
        raise ConfigError(f"STS temperatures must be a non-empty list of numbers > 0, got {temps}")
    report = dict(report or {})

    def per_position(which):
        block = ((report.get("heldout") or {}).get(which) or {}).get("positions") or []
        return [float(p["ece"]) for p in block if isinstance(p, dict) and "ece" in p]

    return {"temperatures": temps, "dataset": str(report.get("logs") or report.get("dataset") or ""),
            "num_samples": int(report.get("rounds") or report.get("num_samples") or 0),
            "ece_before": per_position("before"), "ece_after": per_position("after")}


def sps_sidecar(table: Mapping, block_size: int) -> dict:
    """SGLang's SPS cost table (dspark_components/dspark_sps.py SpsCostTable) from our
    profile-sps JSON {batch_sizes, sps}: a verify step of B requests holds B * (gamma + 1)
    tokens (dspark_config.resolve_runtime_config: verify_num_draft_tokens = gamma + 1)."""
    try:
        sizes = [int(b) for b in table["batch_sizes"]]
        sps = [float(s) for s in table["sps"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"SPS table needs lists 'batch_sizes' and 'sps' ({e})") from None
    if not sizes or len(sizes) != len(sps):
        raise ConfigError(f"SPS table: batch_sizes ({len(sizes)}) and sps ({len(sps)}) must be "
                          "non-empty and of equal length")
    pairs = sorted(zip(sizes, sps))
    tokens = [b * (block_size + 1) for b, _ in pairs]
    if tokens != sorted(set(tokens)) or tokens[0] < 1:
        raise ConfigError(f"SPS table: batch_sizes must be distinct positive ints, got {sizes}")
    return {"sample_batch_tokens": tokens, "sample_steps_per_sec": [s for _, s in pairs],
            "max_batch_tokens": tokens[-1]}
