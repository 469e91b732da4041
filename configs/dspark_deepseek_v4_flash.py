"""DeepSeek-V4-Flash's own DSpark module (mtp.0..2 inside the V4 checkpoint): block 5, one stage per
tapped layer (40, 41, 42) of 43, vanilla Markov head of rank 256, confidence head on [h ; W1[x_prev]],
noise token 128799 (DEEPSEEK_V4.md, "The DSpark module inside the checkpoint").

The module shares the target's embedding and head (never trained here: frozen, not copied); its
stages are V4 blocks (sliding window, score-routed MoE with the target's expert geometry: the
router and experts train, the gate bias stays the checkpoint's, V4's balance term is set outside
backprop). Features are online: the stream mean of each tapped layer's output from the target's
own forward. Start from the released module with draft_init (the V4 checkpoint itself)::

    dspark-jax train --config configs/dspark_deepseek_v4_flash.py target=/ckpt/DeepSeek-V4-Flash \
        draft_init=/ckpt/DeepSeek-V4-Flash data=/data/train.jsonl tokenizer=/ckpt/DeepSeek-V4-Flash

Export the trained module back into the checkpoint the engines serve::

    dspark-jax export runs/dspark_deepseek_v4_flash/export /ckpt/DeepSeek-V4-Flash-DSpark-ft \
        --engine vllm --target /ckpt/DeepSeek-V4-Flash
"""

from dspark_jax.presets import V4_FLASH

CONFIG = dict(
    target=V4_FLASH, data="train.jsonl", data_format="chat", tokenizer=V4_FLASH,
    output_dir="runs/dspark_deepseek_v4_flash", features="online",
    draft=dict(target_layer_ids=(40, 41, 42), block_size=5, markov_rank=256, mask_token_id=128799,
               num_anchors=512),
    max_length=4096, batch_size=512, grad_accum=64, epochs=10, compute_dtype="bfloat16",
    optimizer=dict(learning_rate=6e-4, warmup_ratio=0.04, grad_clip=1.0),
    memory=dict(remat="dots", loss_chunk=64, shard_activations=True),
    mesh="data=1,expert=8", checkpoint=dict(every=3000, keep=3), seed=42,
)
