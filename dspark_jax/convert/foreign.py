"""Import DSpark drafters trained by other trainers: SpecForge and the `speculators` format.

Both are mapped onto the reference layout (config.json fields of ``Qwen3DSparkModel`` and
its tensor names, SPEC section 11) and then go through the one drafter loader path,
``mapping.draft_from_torch``. Layouts read from the trainers' code (2026-11 snapshots):

SpecForge (sgl-project/SpecForge)
  * config: specforge/modeling/draft/dflash.py (DFlashDraftModel: a Qwen3Config with
    ``num_target_layers``, ``block_size`` and a ``dflash_config`` dict holding
    ``target_layer_ids`` (default ``build_target_layer_ids``), ``mask_token_id``,
    ``projector_type``) and specforge/modeling/draft/dspark.py (DSparkDraftModel:
    ``dflash_config.projector_type == "dspark"``, ``markov_rank``, ``markov_head_type``,
    ``enable_confidence_head`` (default: ``confidence_head_alpha > 0``),
    ``confidence_head_with_markov`` (default false)); architectures ["DSparkDraftModel"].
  * layer ids: ``extract_context_feature`` reads ``hidden_states[id + 1]`` (the output of
    decoder layer ``id``): our convention, copied as is.
  * tensors: ``layers.{i}.*`` (Qwen3 names), ``norm``, ``fc``, ``hidden_norm``,
    ``markov_head.markov_w1/markov_w2`` (+ ``gate_proj`` / ``joint_proj`` with bias),
    ``confidence_head.proj.{weight,bias}``; older checkpoints nest the heads under
    ``logit_head.`` (``normalize_draft_head_checkpoint_keys``). No ``embed_tokens`` /
    ``lm_head``: the target's are used, so the target checkpoint is needed.

speculators (vllm-project/speculators)
  * config: src/speculators/models/dspark/config.py (DSparkSpeculatorConfig, registered
    "dspark") over src/speculators/models/dflash/config.py: ``speculators_model_type``,
    ``transformer_layer_config`` (the drafter's Qwen3 config), ``draft_vocab_size``,
    ``block_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``sample_from_anchor``,
    ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
    ``confidence_head_with_markov``.
  * layer ids: ``aux_hidden_state_layer_ids`` are capture points *before* a layer; their
    DFlash converter writes ``aux = target_layer_id + 1``
    (src/speculators/convert/dflash/converter.py), so ours = aux - 1.
  * tensors: src/speculators/models/dflash/core.py (``layers``, ``norm``, ``fc``,
    ``hidden_norm``, ``verifier_norm`` (not saved), ``embed_tokens`` (may be absent),
    ``lm_head``, ``t2d``/``d2t`` for reduced vocabularies) and
    src/speculators/models/dspark/model_definitions.py (``markov_head.*`` as SpecForge,
    ``confidence_head.proj.*``).
  * ``sample_from_anchor`` false trains slot j to predict anchor+j (SGLang's
    models/dspark.py refuses that convention); only ``true`` (the DSpark default, DeepSpec's
    convention) is imported. Reduced draft vocabularies (t2d/d2t) are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dspark_jax.config import DraftConfig
from dspark_jax.convert.formats import read_json_object
from dspark_jax.errors import CheckpointError, ConfigError

FORMATS = ("specforge", "speculators")
_QWEN3_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                 "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings",
                 "attention_bias", "hidden_act", "model_type")
_DROP_PREFIXES = ("rotary_emb.", "verifier_norm.", "verifier_lm_head.", "t2d", "d2t")


def _read_config(path: Path) -> dict:
    return read_json_object(path / "config.json", "config.json")


def detect(path) -> str | None:
    """'specforge' / 'speculators' for a foreign DSpark checkpoint directory, else None."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return None
    hf = _read_config(p)
    if hf.get("speculators_model_type") is not None:
        return "speculators"
    arch = hf.get("architectures") or []
    if "DSparkDraftModel" in arch and isinstance(hf.get("dflash_config"), dict):
        return "specforge"
    return None


def _need(d: Mapping, key: str, where: str):
    if d.get(key) is None:
        raise ConfigError(f"{where}: required field {key!r} is missing")
    return d[key]


def _specforge_build_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's default tap layers (specforge/modeling/draft/dflash.py build_target_layer_ids):
    one layer for a 1-layer drafter, else evenly from 1 to N-3 (one per drafter layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def reference_config(hf: Mapping[str, Any], fmt: str, *, num_target_layers: int | None = None,
                     where: str = "config.json") -> dict:
    """A foreign config.json dict -> the reference Qwen3DSparkModel config dict."""
    if fmt == "specforge":
        dc = dict(hf.get("dflash_config") or {})
        if dc.get("projector_type", "dspark") != "dspark":
            raise ConfigError(f"{where}: dflash_config.projector_type is {dc.get('projector_type')!r}, "
                              "not 'dspark'")
        base = {k: hf[k] for k in _QWEN3_FIELDS if k in hf}
        n_target = int(num_target_layers or _need(hf, "num_target_layers", where))
        ids = dc.get("target_layer_ids") or _specforge_build_layer_ids(n_target, int(base["num_hidden_layers"]))
        rank = int(dc.get("markov_rank", 0) or 0)
        conf = bool(dc.get("enable_confidence_head", float(dc.get("confidence_head_alpha", 0) or 0) > 0))
        out = {**base, "num_target_layers": n_target, "target_layer_ids": [int(i) for i in ids],
               "block_size": int(_need(hf, "block_size", where)),
               "mask_token_id": int(_need(dc, "mask_token_id", f"{where} dflash_config")),
               "num_anchors": int(hf.get("num_anchors", 512)), "markov_rank": rank,
               "enable_confidence_head": conf}
        if rank > 0:
            out["markov_head_type"] = str(dc.get("markov_head_type", "vanilla")).lower()
        if conf:
            out["confidence_head_with_markov"] = bool(dc.get("confidence_head_with_markov", False))
    elif fmt == "speculators":
        if hf.get("speculators_model_type") != "dspark":
            raise ConfigError(f"{where}: speculators_model_type is {hf.get('speculators_model_type')!r}, "
                              "not 'dspark'")
        tl = dict(_need(hf, "transformer_layer_config", where))
        base = {k: tl[k] for k in _QWEN3_FIELDS if k in tl}
        if tl.get("model_type", "qwen3") != "qwen3":
            raise ConfigError(f"{where}: transformer_layer_config.model_type {tl.get('model_type')!r} "
                              "is not supported (only qwen3)")
        vocab = int(_need(tl, "vocab_size", f"{where} transformer_layer_config"))
        if int(hf.get("draft_vocab_size", vocab)) != vocab:
            raise ConfigError(f"{where}: draft_vocab_size {hf['draft_vocab_size']} != vocab_size {vocab}: "
                              "reduced draft vocabularies (t2d/d2t) are not supported")
        if hf.get("target_hidden_size") not in (None, base.get("hidden_size")):
            raise ConfigError(f"{where}: target_hidden_size {hf['target_hidden_size']} != hidden_size "
                              f"{base.get('hidden_size')} is not supported")
        if hf.get("sample_from_anchor", True) is not True:
            raise ConfigError(f"{where}: sample_from_anchor=false (slot j predicts anchor+j) is not "
                              "DSpark's convention; only sample_from_anchor=true checkpoints import")
        aux = [int(i) for i in _need(hf, "aux_hidden_state_layer_ids", where)]
        n_target = num_target_layers or hf.get("num_target_layers")
        if n_target is None:
            raise ConfigError(f"{where}: the target's layer count is not stored in a speculators "
                              "config; pass the target checkpoint (--target) or --num-target-layers")
        rank = int(hf.get("markov_rank", 256))
        conf = bool(hf.get("enable_confidence_head", True))
        out = {**base, "num_target_layers": int(n_target), "target_layer_ids": [i - 1 for i in aux],
               "block_size": int(_need(hf, "block_size", where)),
               "mask_token_id": int(_need(hf, "mask_token_id", where)),
               "num_anchors": int(hf.get("num_anchors", 512)), "markov_rank": rank,
               "enable_confidence_head": conf}
        if rank > 0:
            out["markov_head_type"] = str(hf.get("markov_head_type", "vanilla")).lower()
        if conf:
            out["confidence_head_with_markov"] = bool(hf.get("confidence_head_with_markov", True))
    else:
        raise ConfigError(f"foreign format {fmt!r} is unknown; expected one of {list(FORMATS)}")
    out["architectures"] = ["Qwen3DSparkModel"]
    out["model_type"] = "qwen3"
    return out


def reference_tensors(tensors: Mapping[str, np.ndarray], fmt: str,
                      target: Mapping[str, np.ndarray] | None = None, *, where: str = "checkpoint"
                      ) -> dict[str, np.ndarray]:
    """Foreign tensor names -> reference names; embed_tokens / lm_head from ``target``
    (a Qwen3ForCausalLM state dict) when the drafter does not store them."""
    out = {}
    for name, t in tensors.items():
        if name.startswith(_DROP_PREFIXES):
            continue
        if name.startswith("logit_head."):  # SpecForge normalize_draft_head_checkpoint_keys
            name = name[len("logit_head."):]
        if name.startswith("model.") and fmt == "specforge":
            name = name[len("model."):]
        out[name] = t
    for ours, theirs in (("embed_tokens.weight", "model.embed_tokens.weight"),
                         ("lm_head.weight", "lm_head.weight")):
        if ours in out:
            continue
        if target is None:
            raise CheckpointError(f"{where}: {fmt} drafter has no {ours!r} (the target's is used when "
                                  "serving); pass the target checkpoint (--target) to take it from there")
        src = target.get(theirs)
        if src is None and ours == "lm_head.weight":
            src = target.get("model.embed_tokens.weight")  # tied target
        if src is None:
            raise CheckpointError(f"{where}: target has no {theirs!r} to supply {ours!r}")
        out[ours] = src
    return out


def load_foreign(path, fmt: str | None = None, *, target=None, num_target_layers: int | None = None
                 ) -> tuple[DraftConfig, dict, dict]:
    """(config, params with numpy leaves, reference hf dict) of a SpecForge / speculators drafter.

    ``target``: a Qwen3 target checkpoint directory (HF format) supplying embed_tokens /
    lm_head and, for speculators, the target's layer count.
    """
    from dspark_jax.convert import mapping, safetensors_io

    p = Path(path)
    fmt = fmt or detect(p)
    if fmt not in FORMATS:
        raise CheckpointError(f"{p}: not a SpecForge or speculators DSpark checkpoint "
                              "(no DSparkDraftModel + dflash_config, no speculators_model_type)")
    hf = _read_config(p)
    target_tensors = None
    if target is not None:
        tp = Path(target)
        thf = _read_config(tp)
        from dspark_jax import families
        try:  # a config naming another family is refused; a bare one (layer count only) is read as before
            t_family = families.for_hf(thf, str(tp / "config.json"))
        except families.UnknownArchitectureError:
            t_family = families.FAMILIES["qwen3"]
        if t_family.kind != "target" or t_family.name != families.FAMILIES["qwen3_dspark"].pairs_with:
            raise ConfigError(f"{tp / 'config.json'}: --target is a {t_family.name} {t_family.kind} "
                              f"({(thf.get('architectures') or ['?'])[0]}); {fmt} drafters are DSpark "
                              "drafters of Qwen3 targets (drafter family 'qwen3_dspark' reads 'qwen3' targets)")
        num_target_layers = num_target_layers or int(thf.get("text_config", thf)["num_hidden_layers"])
        target_tensors = safetensors_io.TensorReader(tp)
    ref_hf = reference_config(hf, fmt, num_target_layers=num_target_layers, where=str(p / "config.json"))
    cfg = DraftConfig.from_hf(ref_hf)
    reader = safetensors_io.TensorReader(p)
    tensors = reader.read_all()
    needed = {}
    if target_tensors is not None:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in target_tensors.infos:
                needed[name] = target_tensors.get(name)
    ref = reference_tensors(tensors, fmt, needed if target_tensors is not None else None,
                            where=str(p))
    dtypes = {np.dtype(t.dtype) for k, t in ref.items()}
    if len(dtypes) > 1:  # target embeddings in another dtype than the drafter: follow the drafter
        want = np.dtype(tensors[next(k for k in tensors if k.startswith("fc"))].dtype)
        ref = {k: (t if np.dtype(t.dtype) == want else t.astype(want)) for k, t in ref.items()}
    return cfg, mapping.draft_from_torch(cfg, ref), ref_hf


# --------------------------------------------------------------------------- exports back

def foreign_config(ref_hf: Mapping[str, Any], fmt: str) -> dict:
    """The reference Qwen3DSparkModel config dict -> the config.json ``fmt``'s own loader reads
    (the inverse of ``reference_config``; layouts as in the module docstring).

    specforge: the Qwen3 fields, ``num_target_layers``, ``block_size`` and the ``dflash_config``
    block SpecForge's DSparkDraftModel builds both heads from (projector_type "dspark", GQA
    attention_mode as its constructor requires). speculators: DSparkSpeculatorConfig's fields
    (``transformer_layer_config``, aux ids = ours + 1, ``sample_from_anchor`` true) and a
    ``speculators_config`` whose verifier has no path (its loader then keeps the embed_tokens /
    lm_head written beside); ``num_target_layers`` is kept so the import needs no --target.
    """
    base = {k: ref_hf[k] for k in _QWEN3_FIELDS if k in ref_hf}
    base["layer_types"] = list(ref_hf.get("layer_types") or ["full_attention"] * int(base["num_hidden_layers"]))
    rank = int(ref_hf.get("markov_rank", 0) or 0)
    conf = bool(ref_hf.get("enable_confidence_head", False))
    heads = {"markov_rank": rank, "markov_head_type": str(ref_hf.get("markov_head_type", "vanilla")),
             "enable_confidence_head": conf,
             "confidence_head_with_markov": bool(conf and ref_hf.get("confidence_head_with_markov", False))}
    ids = [int(i) for i in ref_hf["target_layer_ids"]]
    common = {"num_target_layers": int(ref_hf["num_target_layers"]), "block_size": int(ref_hf["block_size"]),
              "num_anchors": int(ref_hf.get("num_anchors", 512)), "dtype": ref_hf.get("dtype", "float32")}
    if fmt == "specforge":
        kv, q = int(base["num_key_value_heads"]), int(base["num_attention_heads"])
        return {**base, **common, "architectures": ["DSparkDraftModel"],
                "dflash_config": {"target_layer_ids": ids, "mask_token_id": int(ref_hf["mask_token_id"]),
                                  "projector_type": "dspark", "attention_mode": "mha" if kv == q else "gqa",
                                  **heads}}
    if fmt == "speculators":
        block = common["block_size"]
        tl = {**base, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "tie_word_embeddings": False}
        return {**common, **heads, "architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
                "speculators_version": "0.9.0", "transformer_layer_config": tl,
                "draft_vocab_size": int(base["vocab_size"]), "aux_hidden_state_layer_ids": [i + 1 for i in ids],
                "mask_token_id": int(ref_hf["mask_token_id"]), "sample_from_anchor": True,
                "sliding_window_non_causal": False, "target_hidden_size": None, "tie_word_embeddings": False,
                "speculators_config": {
                    "algorithm": "dspark", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block,
                                          "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                    "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": None}}}
    raise ConfigError(f"foreign format {fmt!r} is unknown; expected one of {list(FORMATS)}")


def foreign_tensors(tensors: Mapping[str, np.ndarray], fmt: str) -> dict[str, np.ndarray]:
    """Reference tensor names -> ``fmt``'s: the same names (both trainers use the reference's);
    SpecForge has no embed_tokens / lm_head (the target's are used: import with --target)."""
    if fmt not in FORMATS:
        raise ConfigError(f"foreign format {fmt!r} is unknown; expected one of {list(FORMATS)}")
    drop = ("embed_tokens.weight", "lm_head.weight") if fmt == "specforge" else ()
    return {k: t for k, t in tensors.items() if k not in drop}
