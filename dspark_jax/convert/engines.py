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
the exported checkpoint (``V4_RULES`` / ``v4_check``: vLLM and SGLang, read from their V4 loaders).

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
    mask_token_id: int | None
    vocab_size: int
    attention_k_eq_v: bool | None = None  # Gemma4 only; None = unknown
    kind: str = "dspark"  # the drafter kind (``Family.draft_kind``): "dspark" (DSpark / DFlash) or "eagle3"

    @property
    def head(self) -> str:
        """'vanilla' | 'gated' | 'rnn' | 'dflash' (markov_rank 0) | the kind of a non-DSpark drafter."""
        if self.kind != "dspark":
            return self.kind
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
        mask_token_id=None if getattr(cfg, "mask_token_id", None) is None else int(cfg.mask_token_id),
        vocab_size=int(cfg.vocab_size),
        attention_k_eq_v=_k_eq_v(cfg),
        kind=str(getattr(cfg, "kind", "dspark")),
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
    kinds: tuple[str, ...] = ("dspark",)  # the drafter kinds (``DraftFacts.kind``) it applies to


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


# Where each engine builds its Eagle3 drafter (the EAGLE / SpecForge layout).
EAGLE3_LOADERS = {
    "vllm": "vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM)",
    "sglang": "python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3)",
    "sglang-jax": "python/sgl_jax/srt/models (its Llama Eagle3 model)",
    "speculators": "src/speculators/models/eagle3 (Eagle3 speculator)",
    "specforge": "specforge/modeling/draft/llama3_eagle.py (LlamaForCausalLMEagle3)",
}


def _deepspec_eagle3(engine: str) -> Callable[[DraftFacts], str | None]:
    def test(f: DraftFacts):
        return (f"{engine} loads Eagle3 drafters only in the EAGLE/SpecForge format (midlayer.*, Llama "
                "attention without q/k norms, a reduced d2t/t2d vocabulary); this DeepSpec-format drafter "
                f"has per-head q/k norms{' and Gemma4 layers' if f.family == 'gemma4' else ''} and a "
                f"full {f.vocab_size}-token vocabulary")
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
    # ---------------------------------------------------------------- Eagle3 in DeepSpec's format
    # DeepSpec's own evaluator (deepspec/eval/eagle3/evaluator.py) loads it: no deepspec rule.
    # The serving engines and trainers build EAGLE / SpecForge-format Eagle3 drafters only.
    *(Rule(engine, "eagle3-format", source, _deepspec_eagle3(engine), kinds=("eagle3",))
      for engine, source in EAGLE3_LOADERS.items()),
)


def _engine(engine: str) -> str:
    if engine not in TARGETS:
        raise ConfigError(f"engine {engine!r} is unknown; expected one of {list(TARGETS)}")
    return engine


def rules_for(engine: str, family: str | None = None, kind: str | None = None) -> list[Rule]:
    """The rules of ``engine`` (those that apply to ``family`` / drafter ``kind`` when given)."""
    _engine(engine)
    return [r for r in RULES if r.engine == engine and (family is None or family in r.families)
            and (kind is None or kind in r.kinds)]


def violations(cfg, engine: str, severity: str = "error") -> list[tuple[Rule, str]]:
    """(rule, reason) for every ``severity`` rule of ``engine`` that ``cfg`` breaks."""
    f = cfg if isinstance(cfg, DraftFacts) else facts(cfg)
    out = []
    for rule in rules_for(engine, f.family, f.kind):
        if rule.severity != severity:
            continue
        why = rule.test(f)
        if why:
            out.append((rule, why))
    return out


def checked_against(engine: str, family: str | None = None, kind: str | None = None) -> list[str]:
    """The engine versions whose running code checked ``engine``'s rules (for ``family`` / ``kind``)."""
    if family is not None and family not in CHECKED_FAMILIES.get(engine, ()):
        return []
    return sorted({r.checked for r in rules_for(engine, family, kind) if r.checked != "read"})


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


# --------------------------------------------------------------------------- export

def _read_sps(path) -> dict:
    import json
    from pathlib import Path

    from dspark_jax.errors import InputError
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"--sps {str(p)!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise InputError(f"--sps {str(p)!r}: cannot parse JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"--sps {str(p)!r}: expected a JSON object with batch_sizes and sps")
    return data


def export_draft(src, dst, engine: str, *, force: bool = False, sps=None, target=None) -> dict:
    """Write drafter ``src`` (either format) to ``dst`` as ``engine`` loads it; returns a summary.

    A DeepSeek-V4 DSpark module (``src`` a V4 checkpoint with the ``dspark_*`` keys, or a module
    directory with ``target`` the V4 checkpoint) is written into the target's checkpoint
    (``convert.dspark_v4.export``, checked against ``V4_RULES``).

    Refuses (ConfigError naming the violated rule; nothing written) what ``engine`` cannot load.
    Writes config.json (engine transforms), model.safetensors (mode 0644), the tokenizer files
    found beside ``src``, and for SGLang-family engines the STS sidecar (when ``src`` carries
    extras['sts_temperatures']) and the SPS sidecar (when ``sps`` names a profile-sps JSON).
    """
    import json
    import os
    import shutil
    from pathlib import Path

    import jax
    import numpy as np

    from dspark_jax.convert import checkpoint, foreign, mapping, safetensors_io

    _engine(engine)
    src = Path(src)
    from dspark_jax.convert import dspark_v4
    if dspark_v4.holds_module(src):
        return dspark_v4.export(src, dst, engine, target=target, force=force,
                                sps=_read_sps(sps) if sps is not None else None)
    if target is not None:
        raise ConfigError("--target is only for a DeepSeek-V4 DSpark module (written into its target)")
    cfg, params = checkpoint.load_draft(src)
    why = check(cfg, engine)
    if why:
        raise ConfigError(f"{src}: cannot export for {why}")
    extras = checkpoint.read_extras(src)
    temps = checkpoint.sts_temperatures(src)
    if temps is not None and len(temps) != cfg.block_size:
        raise ConfigError(f"{src}: extras['sts_temperatures'] has {len(temps)} entries, block_size "
                          f"is {cfg.block_size}")
    sps_table = sps_sidecar(_read_sps(sps), cfg.block_size) if sps is not None else None
    sts = sts_sidecar(temps, extras.get("sts_report")) if temps is not None else None
    host = jax.tree.map(np.asarray, params)
    tensors = mapping.draft_to_torch(cfg, host)
    if engine in TRAINERS:  # back to another trainer: its own config layout and tensor names
        tensors = foreign.foreign_tensors(tensors, engine)
        hf = foreign.foreign_config(cfg.to_hf(), engine)
    else:
        hf = export_config(cfg.to_hf(), cfg, engine)
    dtype = next(iter({np.dtype(t.dtype).name for t in tensors.values()}))
    hf["dtype"] = hf["torch_dtype"] = dtype
    if extras:  # as checkpoint.save_draft does: STS temperatures survive a re-export / inspect
        hf["dspark_jax"] = {"extras": dict(extras)}
    sidecars = []
    with checkpoint.atomic_dir(dst, force=force) as tmp:
        safetensors_io.write_tensors(tmp, tensors)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if sts is not None:
            (tmp / STS_FILE).write_text(json.dumps(sts, indent=1) + "\n")
            sidecars.append(STS_FILE)
        if sps_table is not None:
            (tmp / SPS_FILE).write_text(json.dumps(sps_table, indent=1) + "\n")
            sidecars.append(SPS_FILE)
        for name in checkpoint.SIDECAR_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
    nbytes = sum(t.nbytes for t in tensors.values())
    return {"event": "export", "engine": engine, "src": str(src), "dst": str(dst),
            "architecture": hf["architectures"][0], "tensors": len(tensors), "bytes": int(nbytes),
            "dtype": dtype, "sidecars": sidecars,
            "warnings": [w for w in serving_warnings(cfg, [engine]) if "limitation" in w]}


# --------------------------------------------------------------------------- DeepSeek-V4's own module
#
# V4's DSpark module is not a separate drafter checkpoint: the engines read it from the target's
# own checkpoint (``mtp.{s}.*`` tensors + the ``dspark_*`` config keys; DEEPSEEK_V4.md). Its load
# rules are therefore predicates over the exported checkpoint itself (config.json + tensor names).

V4_SOURCES = {
    "vllm": "vllm/models/deepseek_v4/nvidia/dspark.py",
    "sglang": "python/sglang/srt/models/deepseek_v4_dspark.py",
}


@dataclasses.dataclass(frozen=True)
class V4Facts:
    """What the engines' V4 DSpark loaders look at in a V4 checkpoint: ``hf`` (its config.json)
    and ``tensors`` (stored tensor name -> dtype name)."""

    hf: Mapping[str, Any]
    tensors: Mapping[str, str]

    @property
    def stages(self) -> int:
        return len(self.hf.get("dspark_target_layer_ids") or ())

    def stored(self, suffix: str, stage: int | None = None) -> bool:
        """Whether ``mtp.{stage}.{suffix}`` (the last stage when None) is stored."""
        s = self.stages - 1 if stage is None else stage
        return f"mtp.{s}.{suffix}" in self.tensors


def v4_facts(hf: Mapping[str, Any], tensors: Mapping[str, Any]) -> V4Facts:
    """V4Facts of a config dict and ``{name: dtype or dtype name}`` (safetensors header infos work)."""
    return V4Facts(dict(hf), {n: str(getattr(t, "dtype", t)) for n, t in tensors.items()})


def _v4_keys(f: V4Facts):
    missing = [k for k in ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank",
                           "dspark_noise_token_id") if f.hf.get(k) is None]
    if missing:
        return f"config.json has no {missing[0]!r}: the checkpoint carries no DSpark module for the engine"
    if (f.hf.get("architectures") or [None])[0] != "DeepseekV4ForCausalLM":
        return f"architectures {f.hf.get('architectures')!r} is not ['DeepseekV4ForCausalLM']"
    return None


def _v4_vllm_stage_count(f: V4Facts):
    want = f.hf.get("n_mtp_layers") or 3
    if f.stages != want:
        return (f"vllm builds n_mtp_layers (default 3) = {want} draft layers, the module has "
                f"{f.stages} (one per dspark_target_layer_ids entry); set n_mtp_layers")
    return None


def _v4_sliding_stages(f: V4Facts):
    n = int(f.hf.get("num_hidden_layers") or 0)
    ratios = list(f.hf.get("compress_ratios") or ())
    if len(ratios) != n + f.stages or any(ratios[n:]):
        return (f"compress_ratios must have {n} + {f.stages} entries, the draft layers' "
                f"(layers.{n}..) 0; got {ratios}")
    return None


_FLOATS = ("float32", "float16", "bfloat16")


def _v4_module_storage(f: V4Facts):
    """The module's tensors load with the model's one quantization config: each stored as the
    target's own layers store the same tensor (FP8 / MXFP4 ones with their ``.scale``), and with a
    quantization_config the module's main_proj FP8 with its scale."""
    if f.hf.get("quantization_config") and "mtp.0.main_proj.scale" not in f.tensors:
        return ("the checkpoint is quantized (quantization_config) so the module's linears load as "
                "FP8 with block scales; mtp.0.main_proj is stored unquantized (no mtp.0.main_proj.scale)")
    target: dict[str, set] = {}
    for name, dtype in f.tensors.items():
        if name.startswith("layers."):
            target.setdefault(name.split(".", 2)[2], set()).add(dtype)
    for name, dtype in sorted(f.tensors.items()):
        if not name.startswith("mtp."):
            continue
        want = target.get(name.split(".", 2)[2])
        if want and dtype not in want:
            return (f"{name} is stored {dtype} but the target's layers store that tensor as "
                    f"{'/'.join(sorted(want))}: the module's layers load with the target's quantization")
        scale = name[:-len(".weight")] + ".scale" if name.endswith(".weight") else None
        if scale and dtype not in _FLOATS and scale not in f.tensors:
            return f"{name} is stored {dtype} without its block scale {scale}"
    return None


def _v4_markov(f: V4Facts):
    rank = int(f.hf.get("dspark_markov_rank") or 0)
    if rank <= 0:
        return f"dspark_markov_rank must be > 0 (the V4 module always has its Markov head), got {rank}"
    if not (f.stored("markov_head.markov_w1.weight") and f.stored("markov_head.markov_w2.weight")):
        return f"mtp.{f.stages - 1}.markov_head.markov_w1 / markov_w2 are not stored"
    return None


def _v4_confidence_present(engine: str):
    def test(f: V4Facts):
        if not f.stored("confidence_head.proj.weight"):
            if engine == "vllm":
                return "vllm drops the confidence head when confidence_head.* is absent: no adaptive verification"
            return ("sglang builds the confidence head and refuses a checkpoint without "
                    "confidence_head.* (unless ragged verify mode is static)")
        return None
    return test


def _v4_confidence_with_markov(f: V4Facts):
    if f.hf.get("confidence_head_with_markov") is False:
        return ("confidence_head_with_markov: false makes sglang build an [H] confidence head; V4's "
                "module stores [H + markov_rank] (proj over [h ; markov_w1[x_prev]])")
    return None


def _v4_noise_in_vocab(f: V4Facts):
    noise, vocab = f.hf.get("dspark_noise_token_id"), f.hf.get("vocab_size")
    if noise is None or vocab is None or not 0 <= int(noise) < int(vocab):
        return f"dspark_noise_token_id {noise} must be in [0, vocab_size {vocab})"
    return None


def _v4_layer_ids(f: V4Facts):
    ids = f.hf.get("dspark_target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        return f"dspark_target_layer_ids must be a non-empty list of ints, got {ids!r}"
    return None


V4_RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- vLLM (method "dspark")
    # The draft defaults to the target checkpoint; DSparkDeepseekV4ForCausalLM reads the target's
    # config (dspark_* keys) and load_weights keeps only mtp.* names (_remap_dspark_name).
    Rule("vllm", "dspark-keys", V4_SOURCES["vllm"] + " (DSparkDeepseekV4Model.__init__: "
         "config.dspark_target_layer_ids, dspark_markov_rank)", _v4_keys, families=("deepseek_v4",)),
    Rule("vllm", "stage-count", V4_SOURCES["vllm"] + " (DSparkDeepseekV4Model.__init__: "
         "num_dspark_layers = n_mtp_layers or 3)", _v4_vllm_stage_count, families=("deepseek_v4",)),
    # the draft layers are DeepseekV4DecoderLayer(prefix layers.{num_hidden_layers + i}): their
    # compress ratio is compress_ratios[num_hidden_layers + i] (sliding only: the context ring)
    Rule("vllm", "sliding-stages", V4_SOURCES["vllm"] + " (DSparkDeepseekV4Model.__init__: "
         "layers.{num_hidden_layers + i})", _v4_sliding_stages, families=("deepseek_v4",)),
    # main_proj = ReplicatedLinear(..., quant_config=vllm_config.quant_config); the layers'
    # linears and experts take the checkpoint's quantization too (load_weights: ".scale" suffixes)
    Rule("vllm", "module-storage", V4_SOURCES["vllm"] + " (main_proj ReplicatedLinear quant_config; "
         "DeepseekV4DecoderLayer quant_config; load_weights .scale)", _v4_module_storage, families=("deepseek_v4",)),
    Rule("vllm", "markov-head", V4_SOURCES["vllm"] + " (DSparkMarkovHead(vocab, draft_vocab, "
         "dspark_markov_rank))", _v4_markov, families=("deepseek_v4",)),
    # load_weights: confidence_head set to None when no confidence_head.* tensor was loaded
    Rule("vllm", "confidence-optional", V4_SOURCES["vllm"] + " (load_weights)",
         _v4_confidence_present("vllm"), families=("deepseek_v4",), severity="warning"),
    # ---------------------------------------------------------------- SGLang (DSPARK)
    # dspark_config.checkpoint_bundles_dspark_draft: the dspark_* keys mark the bundled module
    Rule("sglang", "dspark-keys", "python/sglang/srt/speculative/dspark_components/dspark_config.py "
         "(checkpoint_bundles_dspark_draft)", _v4_keys, families=("deepseek_v4",)),
    Rule("sglang", "layer-ids", "python/sglang/srt/speculative/dspark_components/dspark_config.py "
         "(parse_dspark_draft_config: dspark_target_layer_ids a non-empty list of ints)",
         _v4_layer_ids, families=("deepseek_v4",)),
    # DeepseekV4ForCausalLMDSpark.__init__: require_markov(); DSparkV4MarkovHead rank > 0
    Rule("sglang", "markov-head", V4_SOURCES["sglang"] + " (DeepseekV4ForCausalLMDSpark.__init__ "
         "require_markov, DSparkV4MarkovHead)", _v4_markov, families=("deepseek_v4",)),
    Rule("sglang", "confidence-head-present", V4_SOURCES["sglang"] + " (_assert_confidence_head_loaded)",
         _v4_confidence_present("sglang"), families=("deepseek_v4",)),
    Rule("sglang", "confidence-with-markov", V4_SOURCES["sglang"] + " (build_dspark_v4_confidence_head)",
         _v4_confidence_with_markov, families=("deepseek_v4",)),
    Rule("sglang", "noise-in-vocab", "python/sglang/srt/speculative/dspark_components/dspark_config.py "
         "(resolve_runtime_config: mask_token_id < target vocab)", _v4_noise_in_vocab,
         families=("deepseek_v4",)),
)


def v4_violations(f: V4Facts, engine: str, severity: str = "error") -> list[tuple[Rule, str]]:
    """(rule, reason) for every ``severity`` V4 DSpark rule of ``engine`` the checkpoint breaks."""
    if engine not in V4_SOURCES:
        raise ConfigError(f"DeepSeek-V4's DSpark module is served by {sorted(V4_SOURCES)}, not {engine!r}")
    return [(r, why) for r in V4_RULES if r.engine == engine and r.severity == severity
            for why in [r.test(f)] if why]


def v4_check(f: V4Facts, engine: str) -> str | None:
    """None when ``engine`` loads the V4 checkpoint's DSpark module, else the first rule it breaks."""
    bad = v4_violations(f, engine)
    if not bad:
        return None
    rule, why = bad[0]
    return f"{engine} rule '{rule.name}' ({rule.source}): {why}"
