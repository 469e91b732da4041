"""Gemma4 (``Gemma4ForCausalLM``, ``Gemma4UnifiedForCausalLM`` and the text model of their multimodal
wrappers) as a target family: config, declaration, forward, cache.

``config``: ``Gemma4TargetConfig`` from either config.json layout; ``model``: the declaration (one
stack per head shape: sliding / full layers), the shared math the Gemma4 drafter reuses, the
``Gemma4Cache`` (full layers by position, sliding layers in a ring) and the forward. Registered in
``families._BUILTIN`` with its runtime record (``dspark_jax.runtime``).
"""

from __future__ import annotations

from typing import Any, Mapping

from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.errors import CheckpointError
from dspark_jax.params import ParamSpec
from dspark_jax.target.gemma4 import config, model
from dspark_jax.target.gemma4.config import (FULL, MODEL_TYPES, MULTIMODAL, MULTIMODAL_PREFIX, SLIDING,
                                             TEXT_ARCHITECTURES, TEXT_PREFIX, Gemma4TargetConfig,
                                             checkpoint_prefix, gemma4_text_fields, gemma4_text_kwargs)
from dspark_jax.target.gemma4.model import (STACKS, Gemma4Cache, compute_logits, declare, embed, forward,
                                            forward_pure, group_rope, init_cache, init_params,
                                            layer_declaration, lm_head_kernel, param_axes, project_qkv,
                                            ring_slots, rms_norm, rope_cos_sin, sandwich, softcap)

__all__ = ["FULL", "MODEL_TYPES", "SLIDING", "STACKS", "FAMILY", "Gemma4Cache", "Gemma4TargetConfig",
           "checkpoint_prefix", "compute_logits", "config", "declare", "embed", "forward", "forward_pure",
           "gemma4_text_fields", "gemma4_text_kwargs", "group_rope", "init_cache", "init_params",
           "layer_declaration", "lm_head_kernel", "load_params", "model", "param_axes", "project_qkv",
           "read_state", "ring_slots", "rms_norm", "rope_cos_sin", "sandwich", "softcap"]


def _tied_head(cfg: Gemma4TargetConfig) -> tuple[str, str] | None:
    return ("lm_head.weight", "model.embed_tokens.weight") if cfg.tie_word_embeddings else None


def _source_prefixes(hf: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """A multimodal checkpoint stores the text model under ``model.language_model.``."""
    return ((MULTIMODAL_PREFIX, TEXT_PREFIX),) if checkpoint_prefix(hf) == MULTIMODAL_PREFIX else ()


# Registered in families.py. A multimodal (``*ForConditionalGeneration``) checkpoint reads as its
# text model: weights under MULTIMODAL_PREFIX, vision/audio towers ignored; it is written back as
# the text CausalLM.
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
FAMILY = params_lib.Family(
    name="gemma4", kind="target", architectures=tuple(TEXT_ARCHITECTURES.values()) + tuple(MULTIMODAL.values()),
    model_types=MODEL_TYPES + tuple(MULTIMODAL), config_cls=Gemma4TargetConfig, declare=declare,
    forward=__name__, tied_head=_tied_head, ignored_tensors=TOWERS, source_prefixes=_source_prefixes,
    runtime=runtime.TargetRuntime(
        init_cache=init_cache, forward=forward_pure, logits=compute_logits,
        feature_dim=lambda cfg, taps: runtime.concat_features(cfg.hidden_size, taps),
        replicable=frozenset({"kv_heads"}),  # 1 KV head in full layers: stays replicated
        per_layer=True, stacks=STACKS))      # per-layer buffers on GPUs (params.for_platform)


def read_state(directory, decl: Mapping[tuple, ParamSpec], ignore: tuple[str, ...] = ()) -> dict:
    """Torch-named numpy tensors of ``directory/*.safetensors`` that ``decl`` declares, checked
    for presence and shape (CheckpointError); others must start with an ``ignore`` prefix.

    TODO(merge): the convert package's loader (families + mapping.check_tensors) replaces this.
    """
    from pathlib import Path

    from safetensors.numpy import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    expected = params_lib.torch_shapes(decl)
    for name, shape in expected.items():
        if name not in state:
            raise CheckpointError(f"{directory}: tensor {name!r} is missing")
        if tuple(state[name].shape) != tuple(shape):
            raise CheckpointError(f"{directory}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                                  f"expected {tuple(shape)}")
    extra = [k for k in state if k not in expected and not k.startswith(ignore or ("\0",))]
    if extra:
        raise CheckpointError(f"{directory}: unexpected tensor {extra[0]!r} for this config")
    return {k: state[k] for k in expected}


def load_params(directory, cfg: Gemma4TargetConfig | None = None, prefix: str | None = None):
    """(config, numpy params) of a Hugging Face Gemma4 checkpoint directory (text or multimodal layout)."""
    import json
    from pathlib import Path

    path = Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    cfg = cfg or Gemma4TargetConfig.from_hf(hf)
    prefix = prefix or checkpoint_prefix(hf)
    decl = declare(cfg, prefix)
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    if prefix == MULTIMODAL_PREFIX:
        ignore += ("model.vision", "model.audio", "model.embed_vision", "model.embed_audio")
    return cfg, params_lib.from_torch(decl, read_state(directory, decl, ignore))
