"""DFlash (markov_rank 0, no confidence head, CE only) drafter for Gemma4-12B: block 7, 5 layers.

Released-drafter shape (DeepSpec dspark_gemma4_12b_block7; SPEC section 13): Gemma4 layers
(hidden 3840, 16 heads, global head 512, 1 KV head with k = v, proportional rotary, sandwich
norms, layer_scalar), target_layer_ids [5, 17, 29, 41, 46] of 48, mask_token_id 4, softcapped
logits (30). Training recipe of the paper: AdamW lr 6e-4, 4% warm-up then cosine, clip 1.0,
global batch 512 sequences of up to 4096 tokens, 10 epochs, bf16 compute over fp32 masters.

Point ``target`` at a local copy of the Hugging Face checkpoint (the text
``Gemma4UnifiedForCausalLM`` or the multimodal ``*ForConditionalGeneration`` one: its text
weights are read, the vision/audio towers ignored) and ``data`` at a JSONL of training
conversations, e.g.::

    dspark-jax train --config configs/dflash_gemma4_12b.py target=/ckpt/gemma-4-12B-it \
        data=/data/train.jsonl tokenizer=/ckpt/gemma-4-12B-it mesh=data=1,fsdp=8

Plan it first (no weights needed)::

    dspark-jax plan --config configs/dflash_gemma4_12b.py --mesh data=1,fsdp=8 --modes online
"""

from dspark_jax.presets import GEMMA4_12B
from dspark_jax.presets import MESH_PLANS as _PLANS
from dspark_jax.presets import released_train_config

CONFIG = released_train_config(GEMMA4_12B, kind="dflash")

# Meshes for `dspark-jax plan`. Keep one sequence per device per micro-step:
# grad_accum = 512 / number of devices.
MESH_PLANS = _PLANS[GEMMA4_12B]
