"""What the engines' DeepSeek-V4 DSpark loaders accept, as data: rules over an exported V4 checkpoint.

V4's DSpark module is not a separate drafter checkpoint: the engines read it from the target's own
checkpoint (``mtp.{s}.*`` tensors + the ``dspark_*`` config keys; DEEPSEEK_V4.md). Its load rules
are therefore predicates over that checkpoint (``V4Facts``: config.json + stored tensor names and
dtypes), each naming the vLLM / SGLang file it was read from (``engines.Rule``). ``v4_check`` is
what ``export`` refuses on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dspark_jax.convert.engines import Rule
from dspark_jax.errors import ConfigError

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
