"""Tiny run on the Gemma4 fixture target (vocab 512, hidden 64, 6 layers: 2 of every 3 sliding,
window 16) for tests and smoke checks; the Gemma4 twin of configs/tiny.py.

Make data first (sequences sampled from the target itself):
    .venv/bin/python -m dspark_jax.data.sample --target tests/fixtures/dspark_gemma4_tiny/target \
        --out runs/tiny_gemma4_data.jsonl --num 512 --length 64
Then: dspark-jax train --config configs/tiny_gemma4.py output_dir=runs/tiny_gemma4
(add draft_init=tests/fixtures/dspark_gemma4_tiny/draft to start from the reference drafter).
"""

CONFIG = dict(
    target="../tests/fixtures/dspark_gemma4_tiny/target",
    data="../runs/tiny_gemma4_data.jsonl",
    output_dir="../runs/tiny_gemma4",
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
