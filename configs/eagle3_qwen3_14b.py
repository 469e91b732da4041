"""Eagle3 drafter for Qwen3-14B: one decoder layer, 5 taps, TTT over 7 steps (step loss decay 0.8).

Released-drafter shape (DeepSpec's eagle3_qwen3_14b_ttt7: ``Qwen3Eagle3Model``, the DSpark taps,
embedding and LM head copied from the target and frozen). Training recipe of the paper's
comparison (same data, taps and schedule as the DSpark / DFlash drafters): AdamW lr 6e-4, 4%
warm-up then cosine, clip 1.0, global batch 512 sequences of up to 4096 tokens, 10 epochs, bf16
compute over fp32 masters; the loss is DeepSpec's soft cross-entropy against the target's
distribution at each TTT step (dspark_jax/draft/eagle3/ttt.py). DeepSpec trains Eagle3 from a
feature cache only; here ``features`` may be "online" or "cache". E.g.::

    dspark-jax train --config configs/eagle3_qwen3_14b.py target=/ckpt/Qwen3-14B data=/data/train.jsonl \
        tokenizer=/ckpt/Qwen3-14B

Plan it first (no weights needed)::

    dspark-jax plan --config configs/eagle3_qwen3_14b.py
"""

from dspark_jax.presets import MESH_PLANS as _PLANS
from dspark_jax.presets import released_train_config

CONFIG = released_train_config("Qwen/Qwen3-14B", kind="eagle3")

MESH_PLANS = _PLANS["Qwen/Qwen3-14B"]
