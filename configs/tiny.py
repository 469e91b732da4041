"""Tiny run on the fixture target (vocab 512, hidden 64, 6 layers) for tests and smoke checks.

Make data first (sequences sampled from the target itself):
    .venv/bin/python -m dspark_jax.data.sample --target tests/fixtures/dspark_qwen3_tiny/target \
        --out runs/tiny_data.jsonl --num 512 --length 64
Then: dspark-jax train --config configs/tiny.py output_dir=runs/tiny
"""

CONFIG = dict(
    target="../tests/fixtures/dspark_qwen3_tiny/target",
    data="../runs/tiny_data.jsonl",
    output_dir="../runs/tiny",
    draft=dict(num_hidden_layers=2, block_size=7, target_layer_ids=(0, 2, 4), mask_token_id=511,
               num_anchors=8, markov_rank=64, markov_head_type="vanilla"),
    features="online",
    max_length=64,
    batch_size=16,
    grad_accum=1,
    steps=300,
    optimizer=dict(learning_rate=3e-3, warmup_ratio=0.04),
    compute_dtype="float32",
    mesh="data=-1",
    checkpoint=dict(every=100, keep=2),
    seed=0,
)
