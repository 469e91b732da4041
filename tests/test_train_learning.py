"""Learning check: on sequences sampled from the fixture target, a short run lowers the loss and
raises the expected accepted length (a longer run and the DFlash comparison are in the report)."""

from pathlib import Path

import numpy as np

from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.data.sample import sample_sequences, write_jsonl
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.loop import train

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "tests/fixtures/dspark_qwen3_tiny/target"


def test_short_run_learns_and_exports(tmp_path):
    tcfg, tparams = load_target(TARGET)
    data = tmp_path / "seqs.jsonl"
    write_jsonl(data, sample_sequences(tparams, tcfg, 128, 32, seed=4))
    cfg = TrainConfig(target=str(TARGET), data=str(data), output_dir=str(tmp_path / "run"),
                      draft=dict(num_hidden_layers=1, target_layer_ids=(0, 2, 4), mask_token_id=511,
                                 num_anchors=8, markov_rank=64),
                      max_length=32, batch_size=16, steps=40,
                      optimizer=dict(learning_rate=1e-2, warmup_ratio=0.05),
                      compute_dtype="float32", checkpoint=dict(every=0), progress=False, num_devices=1,
                      mesh="data=1")
    summary = train(cfg, fast_compile=True)
    hist = summary["history"]
    loss = np.array([r["loss"] for r in hist])
    tau = np.array([r["expected_accept_length"] for r in hist])
    l1 = np.array([r["l1_loss"] for r in hist])
    assert loss[-5:].mean() < 0.8 * loss[:5].mean(), loss
    assert l1[-5:].mean() < l1[:5].mean() - 0.02, l1
    assert tau[-5:].mean() > tau[:5].mean() + 0.2, tau
    assert 1.0 <= tau.min() and tau.max() <= 1 + 7
    # the export is a loadable PyTorch-format drafter with the target's frozen embedding/head
    dcfg, params = load_draft(summary["export"])
    assert dcfg.markov_rank == 64 and dcfg.num_hidden_layers == 1
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]), np.asarray(tparams["embed_tokens"]))
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(tparams["lm_head"]))
    np.testing.assert_allclose(np.asarray(params["fc"]), np.asarray(summary["params"]["fc"]), atol=0)
