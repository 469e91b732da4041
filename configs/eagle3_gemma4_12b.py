"""Eagle3 drafter for Gemma4-12B: one Gemma4 full-attention layer (k = v, sandwich norms,
layer_scalar, softcapped logits), taps [5, 17, 29, 41, 46] of 48, TTT over 7 steps (decay 0.8).

Released-drafter shape (DeepSpec's eagle3_gemma4_12b_ttt7: ``Gemma4Eagle3Model``). Training
recipe of the paper's comparison (as configs/dspark_gemma4_12b.py): AdamW lr 6e-4, 4% warm-up
then cosine, clip 1.0, global batch 512 sequences of up to 4096 tokens, 10 epochs, bf16 compute
over fp32 masters. E.g.::

    dspark-jax train --config configs/eagle3_gemma4_12b.py target=/ckpt/gemma-4-12B-it \
        data=/data/train.jsonl tokenizer=/ckpt/gemma-4-12B-it

Plan it first (no weights needed)::

    dspark-jax plan --config configs/eagle3_gemma4_12b.py --modes online
"""

from dspark_jax.presets import GEMMA4_12B
from dspark_jax.presets import MESH_PLANS as _PLANS
from dspark_jax.presets import released_train_config

CONFIG = released_train_config(GEMMA4_12B, kind="eagle3")

MESH_PLANS = _PLANS[GEMMA4_12B]
