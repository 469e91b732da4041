"""Architectures of released targets and drafters, for planning without weights.

``TARGETS`` are the public Qwen3 configs (config.json on the Hub) and the Gemma4-12B text
decoder (SPEC section 13); ``released_drafter(name)`` gives the DSpark/DFlash drafter configs of
the released checkpoints (SPEC sections 1 and 13; DeepSpec configs), in the drafter family that
reads the target (``families.drafter_family``). ``resolve_target`` reads a checkpoint directory
when one exists (any registered family) and falls back to a preset name.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_jax import families
from dspark_jax.config import RELEASED_KINDS as KINDS
from dspark_jax.config import TargetConfig
from dspark_jax.errors import ConfigError
from dspark_jax.target import deepseek_v4, deepseek_v41, gemma4

_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=40960, num_key_value_heads=8)

GEMMA4_12B = "google/gemma-4-12B-it"
V4_FLASH, V4_PRO = "deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Pro"
V41_FLASH = "deepseek-ai/DeepSeek-V4.1-Flash"


def _v41_flash() -> "deepseek_v41.DeepseekV41Config":
    """DeepSeek-V4.1-Flash (transformers main's ``DeepseekV41TextConfig`` defaults, which name the
    released checkpoint; DEEPSEEK_V4.md "DeepSeek-V4.1"). No tokenizer here: its Engram token map
    is absent, so it plans shapes and counts parameters but does not run."""
    return deepseek_v41.DeepseekV41Config(
        vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=40,
        num_attention_heads=64, head_dim=512, q_lora_rank=1280, qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20, kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36), candidate_source_layer_id=20,
        candidate_topk_blocks=2048, candidate_block_size=8, n_routed_experts=384, num_experts_per_tok=6,
        index_n_heads=32, index_head_dim=128, index_topk=512, sliding_window=128, yarn=(16.0, 65536, 32.0, 1.0),
        engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682), engram_max_ngram_size=4,
        engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_compressed_vocab_size=99092,
        extra=(("dspark_block_size", "5"), ("dspark_markov_rank", "256"), ("dspark_n_routed_experts", "128"),
               ("dspark_noise_token_id", "128799"), ("dspark_num_experts_per_tok", "3"),
               ("dspark_target_layer_ids", "[37, 38, 39]")))


def _v4(n_layers: int, **sizes) -> "deepseek_v4.DeepseekV4Config":
    """A released DeepSeek-V4 shape (DEEPSEEK_V4.md "Sizes"); the per-layer CSA / HCA mix is
    transformers' default (2 HCA layers, then CSA / HCA alternating): it moves only the small
    compressor / indexer tensors, not the parameter count's bulk (experts, attention)."""
    from dspark_jax.target.deepseek_v4 import config as v4c
    types = [v4c.HCA] * 2 + [v4c.CSA if i % 2 else v4c.HCA for i in range(n_layers - 2)]
    return deepseek_v4.DeepseekV4Config(
        vocab_size=129280, num_hidden_layers=n_layers, head_dim=512, qk_rope_head_dim=64,
        layer_types=tuple(types), mlp_layer_types=(v4c.HASH_MOE,) * 3 + (v4c.MOE,) * (n_layers - 3),
        num_experts_per_tok=6, index_n_heads=64, index_head_dim=128, sliding_window=128,
        yarn=(16.0, 65536, 32.0, 1.0), max_position_embeddings=1048576, **sizes)

TARGETS: dict[str, object] = {
    "Qwen/Qwen3-4B": TargetConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                  num_attention_heads=32, tie_word_embeddings=True, **_QWEN3_COMMON),
    "Qwen/Qwen3-8B": TargetConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                  num_attention_heads=32, tie_word_embeddings=False, **_QWEN3_COMMON),
    "Qwen/Qwen3-14B": TargetConfig(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                   num_attention_heads=40, tie_word_embeddings=False, **_QWEN3_COMMON),
    # Gemma4-12B text decoder (SPEC 13): 48 layers, 5 sliding (window 1024, head 256, 8 KV heads,
    # rope 1e4) : 1 full (global head 512, 1 KV head, k = v, proportional rope 1e6 / 0.25), tied
    # head, softcap 30. intermediate_size 15360 is not in SPEC: the 12B Gemma MLP width
    # (hidden 3840 x 4); it only enters the drafter through its MLPs.
    GEMMA4_12B: gemma4.Gemma4TargetConfig(
        vocab_size=262144, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=tuple(gemma4.FULL if (i + 1) % 6 == 0 else gemma4.SLIDING for i in range(48)),
        sliding_window=1024, sliding_rope_theta=1e4, full_rope_theta=1e6, full_rope_type="proportional",
        partial_rotary_factor=0.25, final_logit_softcapping=30.0, tie_word_embeddings=True,
        max_position_embeddings=131072, model_type="gemma4_unified_text"),
    # DeepSeek-V4 (conversion / plan of the forward; no drafter preset yet: its DSpark module is
    # the next issue)
    V4_FLASH: _v4(43, hidden_size=4096, num_attention_heads=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
                  n_routed_experts=256, moe_intermediate_size=2048, routed_scaling_factor=1.5, index_topk=512),
    V4_PRO: _v4(61, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
                n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5, index_topk=1024),
    V41_FLASH: _v41_flash(),
}

# Qwen3 reserves ids past the tokenizer's 151669 used tokens; the reference uses 151669 as MASK.
QWEN3_MASK_TOKEN_ID = 151669

# Gemma4's released drafter uses token 4 as MASK (SPEC 13).
GEMMA4_MASK_TOKEN_ID = 4

_LAYER_IDS = {"Qwen/Qwen3-4B": (1, 9, 17, 25, 33), "Qwen/Qwen3-8B": (1, 9, 17, 25, 33),
              "Qwen/Qwen3-14B": (1, 10, 19, 28, 37), GEMMA4_12B: (5, 17, 29, 41, 46)}
# the layers DeepSeek-V4's in-checkpoint DSpark module reads (``dspark_target_layer_ids``, DEEPSEEK_V4.md)
_V4_DSPARK_LAYER_IDS = {V4_FLASH: (40, 41, 42), V4_PRO: (58, 59, 60)}

_MASK_TOKEN_IDS = {GEMMA4_12B: GEMMA4_MASK_TOKEN_ID}


def target_layer_ids(target: str) -> tuple[int, ...] | None:
    """The target layers the released drafter of preset ``target`` reads (None: no preset)."""
    return _LAYER_IDS.get(target) or _V4_DSPARK_LAYER_IDS.get(target)


def v4_mtp_drafter(target: str, steps: int = 1):
    """DeepSeek-V4's in-checkpoint MTP module (``mtp.0.*``) on preset ``target`` as a chain
    drafter of ``steps`` drafts per round (MTP-k; the production baseline is MTP-1)."""
    from dspark_jax.draft.deepseek_v4_mtp import DeepseekV4MTPConfig

    if target not in _V4_DSPARK_LAYER_IDS:
        raise ConfigError(f"an MTP module exists for DeepSeek-V4 presets only "
                          f"({', '.join(_V4_DSPARK_LAYER_IDS)}), not {target!r}")
    return DeepseekV4MTPConfig(target=TARGETS[target], num_steps=steps)


def mask_token_id(target: str) -> int:
    """MASK id of the released drafters of preset ``target``."""
    return _MASK_TOKEN_IDS.get(target, QWEN3_MASK_TOKEN_ID)


def resolve_target(target: str):
    """Target config (any registered family) from a checkpoint dir's config.json, else from a
    preset name (e.g. "Qwen/Qwen3-8B", "google/gemma-4-12B-it")."""
    path = Path(target)
    if (path / "config.json").is_file():
        hf = json.loads((path / "config.json").read_text())
        family = families.for_hf(hf, str(path / "config.json"))
        if family.kind != "target":
            raise ConfigError(f"{path / 'config.json'}: architectures {hf.get('architectures')!r} is a "
                              f"{family.kind}, not a target")
        return family.config_from_hf(hf, path)
    if target in TARGETS:
        return TARGETS[target]
    raise ConfigError(f"target {target!r} is neither a checkpoint directory with config.json nor one "
                      f"of the presets {sorted(TARGETS)}")


def released_drafter(target: str, *, kind: str = "dspark", block_size: int = 7,
                     num_layers: int = 5):
    """The drafter shape of the released checkpoints for a preset target.

    kind "dspark": vanilla Markov head of rank 256 and a confidence head with
    Markov features; kind "dflash": no Markov head, no confidence head; kind "eagle3": DeepSpec's
    Eagle3 (one layer, the same five taps, ``ttt_length`` = ``block_size``, step loss decay 0.8).
    """
    if target not in _LAYER_IDS:
        raise ConfigError(f"no released drafter for {target!r}; presets: {sorted(_LAYER_IDS)}")
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r} must be one of {KINDS}")
    if kind == "eagle3":
        return families.drafter_family(TARGETS[target], kind).config_cls.for_target(
            TARGETS[target], target_layer_ids=_LAYER_IDS[target], ttt_length=block_size, step_loss_decay=0.8)
    head = (dict(markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
                 confidence_head_with_markov=True) if kind == "dspark"
            else dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False))
    config_cls = families.drafter_family(TARGETS[target]).config_cls  # DraftConfig, Gemma4DraftConfig
    return config_cls.for_target(TARGETS[target], num_hidden_layers=num_layers, block_size=block_size,
                                 target_layer_ids=_LAYER_IDS[target], mask_token_id=mask_token_id(target),
                                 num_anchors=512, **head)


# Meshes checked with `dspark-jax plan` for each released target (docs/scaling.md).
MESH_PLANS: dict[str, dict[str, str]] = {
    "Qwen/Qwen3-4B": {"8xH100/H200 (one node)": "data=4,fsdp=2", "TPU v5p-64 (32 chips)": "data=16,fsdp=2",
                      "TPU v6e-64": "data=32,fsdp=2"},
    "Qwen/Qwen3-8B": {"8xH100/H200 (one node)": "data=2,fsdp=4", "TPU v5p-64 (32 chips)": "data=8,fsdp=4",
                      "TPU v6e-64": "data=16,fsdp=4"},
    "Qwen/Qwen3-14B": {"8xH100/H200 (one node)": "data=1,fsdp=8", "TPU v5p-64 (32 chips)": "data=4,fsdp=8",
                       "TPU v6e-64": "data=8,fsdp=8"},
    # Gemma4-12B: 262144-token vocabulary (a 1B-parameter embedding, LM head and Markov tables):
    # fully sharded like the 14B. Planned on 8 simulated devices (tests/test_gemma4_plan.py).
    GEMMA4_12B: {"8xH100/H200 (one node)": "data=1,fsdp=8", "TPU v5p-64 (32 chips)": "data=4,fsdp=8",
                 "TPU v6e-64": "data=8,fsdp=8"},
}


def released_train_config(target: str, *, kind: str = "dspark", block_size: int = 7, num_layers: int = 5,
                          target_layer_ids: tuple[int, ...] | None = None, **overrides) -> dict:
    """TrainConfig fields of the paper's recipe for a released drafter shape on 8 devices.

    AdamW lr 6e-4, 4% warm-up then cosine, clip 1.0, global batch 512 sequences of up to 4096
    tokens (one per device per micro-step: grad_accum 64 on 8 devices), 10 epochs, bf16 compute
    over fp32 masters; DFlash trains with CE only. The memory options (remat, chunked loss,
    activation sharding) change no numerics. ``overrides`` replace any top-level field (a
    section such as ``optimizer`` as a whole dict).
    """
    draft = released_drafter(target, kind=kind, block_size=block_size, num_layers=num_layers)
    fields = ("num_hidden_layers", "block_size", "target_layer_ids", "mask_token_id", "num_anchors",
              "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
    if kind == "eagle3":  # a TTT-trained chain: its own keys, the trainer's draft.kind picks its family
        fields = ("target_layer_ids", "ttt_length", "step_loss_decay")
    draft_fields = {f: getattr(draft, f) for f in fields}
    if kind == "eagle3":
        draft_fields["kind"] = kind
    if target_layer_ids is not None:
        draft_fields["target_layer_ids"] = tuple(target_layer_ids)
    short = target.split("/")[-1].lower().replace("-", "_")
    cfg = dict(
        target=target, data="train.jsonl", data_format="chat", tokenizer=target,
        output_dir=f"runs/{kind}_{short}", features="online", draft=draft_fields,
        max_length=4096, batch_size=512, grad_accum=64, epochs=10, compute_dtype="bfloat16",
        optimizer=dict(learning_rate=6e-4, warmup_ratio=0.04, grad_clip=1.0),
        memory=dict(remat="dots", loss_chunk=64, shard_activations=True),
        mesh=MESH_PLANS[target]["8xH100/H200 (one node)"],
        checkpoint=dict(every=3000, keep=3), seed=42,
    )
    if kind == "dflash":
        cfg["loss"] = dict(ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0)
    cfg.update(overrides)
    return cfg
