"""Architectures of released targets and drafters, for planning without weights.

``TARGETS`` are the public Qwen3 configs (config.json on the Hub);
``released_drafter(name)`` gives the DSpark/DFlash drafter configs of the
released checkpoints (SPEC section 1; DeepSpec configs). ``resolve_target``
reads a checkpoint directory when one exists and falls back to a preset name.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.errors import ConfigError

_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=40960, num_key_value_heads=8)

TARGETS: dict[str, TargetConfig] = {
    "Qwen/Qwen3-4B": TargetConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                  num_attention_heads=32, tie_word_embeddings=True, **_QWEN3_COMMON),
    "Qwen/Qwen3-8B": TargetConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                  num_attention_heads=32, tie_word_embeddings=False, **_QWEN3_COMMON),
    "Qwen/Qwen3-14B": TargetConfig(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                   num_attention_heads=40, tie_word_embeddings=False, **_QWEN3_COMMON),
}

# Qwen3 reserves ids past the tokenizer's 151669 used tokens; the reference uses 151669 as MASK.
QWEN3_MASK_TOKEN_ID = 151669

_LAYER_IDS = {"Qwen/Qwen3-4B": (1, 9, 17, 25, 33), "Qwen/Qwen3-8B": (1, 9, 17, 25, 33),
              "Qwen/Qwen3-14B": (1, 10, 19, 28, 37)}


def resolve_target(target: str) -> TargetConfig:
    """TargetConfig from a checkpoint dir's config.json, else from a preset name (e.g. "Qwen/Qwen3-8B")."""
    path = Path(target)
    if (path / "config.json").is_file():
        return TargetConfig.from_hf(json.loads((path / "config.json").read_text()))
    if target in TARGETS:
        return TARGETS[target]
    raise ConfigError(f"target {target!r} is neither a checkpoint directory with config.json nor one "
                      f"of the presets {sorted(TARGETS)}")


def released_drafter(target: str, *, kind: str = "dspark", block_size: int = 7,
                     num_layers: int = 5) -> DraftConfig:
    """The drafter shape of the released checkpoints for a preset target.

    kind "dspark": vanilla Markov head of rank 256 and a confidence head with
    Markov features; kind "dflash": no Markov head, no confidence head.
    """
    if target not in _LAYER_IDS:
        raise ConfigError(f"no released drafter for {target!r}; presets: {sorted(_LAYER_IDS)}")
    if kind not in ("dspark", "dflash"):
        raise ConfigError(f"kind={kind!r} must be 'dspark' or 'dflash'")
    head = (dict(markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
                 confidence_head_with_markov=True) if kind == "dspark"
            else dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False))
    return DraftConfig.for_target(TARGETS[target], num_hidden_layers=num_layers, block_size=block_size,
                                  target_layer_ids=_LAYER_IDS[target], mask_token_id=QWEN3_MASK_TOKEN_ID,
                                  num_anchors=512, **head)
