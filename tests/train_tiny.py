"""Shared tiny training setup of the train tests: the fixture target, a one-layer drafter, and a
TrainConfig for a few float32 steps on one device."""

from pathlib import Path

from dspark_jax.train.config import SECTIONS, TrainConfig

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "tests/fixtures/dspark_qwen3_tiny/target"
DRAFT = dict(num_hidden_layers=1, target_layer_ids=(0, 2, 4), mask_token_id=511, num_anchors=4,
             markov_rank=16)
BASE = dict(target=str(TARGET), draft=DRAFT, max_length=32, batch_size=8, steps=3, compute_dtype="float32",
            export_format="none", progress=False, num_devices=1, mesh="data=1",
            optimizer=dict(learning_rate=3e-3, warmup_ratio=0.0), checkpoint=dict(every=0))


def tiny_config(output_dir, **kw) -> TrainConfig:
    """BASE with ``kw``; a section given as a dict (optimizer=dict(...)) updates BASE's section."""
    cfg = dict(BASE, output_dir=str(output_dir))
    for k, v in kw.items():
        cfg[k] = dict(cfg.get(k, {}), **v) if k in SECTIONS and isinstance(v, dict) else v
    return TrainConfig(**cfg)
