"""Eagle3 in the trainer: a fresh drafter (``draft.kind = "eagle3"``) trained online on sequences
sampled from the eagle3_qwen3_tiny target learns (TTT accuracy and expected accepted length rise)
and exports a loadable DeepSpec-format checkpoint sharing the target's embedding and head. (The
embedded default target has 4 layers: too few for Eagle3's 5 distinct taps.)"""

from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES
from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.data.sample import sample_sequences, write_jsonl
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.loop import train

TARGET = FIXTURES / "eagle3_qwen3_tiny" / "target"


@pytest.mark.slow
def test_short_eagle3_run_learns_and_exports(tmp_path: Path):
    tcfg, tparams = load_target(TARGET)
    write_jsonl(tmp_path / "seqs.jsonl", sample_sequences(tparams, tcfg, 64, 32, seed=4))
    cfg = TrainConfig(target=str(TARGET), data=str(tmp_path / "seqs.jsonl"), output_dir=str(tmp_path / "run"),
                      draft=dict(kind="eagle3", ttt_length=2), max_length=32, batch_size=16, steps=16,
                      optimizer=dict(learning_rate=1e-2, warmup_ratio=0.05), compute_dtype="float32",
                      checkpoint=dict(every=0), progress=False, num_devices=1, mesh="data=1")
    summary = train(cfg, fast_compile=True)
    hist = summary["history"]
    series = lambda key: np.array([float(r[key]) for r in hist])
    loss, acc, tau = series("loss"), series("accuracy@0"), series("tau_probabilistic")
    assert loss[-4:].mean() < loss[:4].mean() - 0.03, loss
    assert acc[-4:].mean() > acc[:4].mean() + 0.03, acc
    assert tau[-4:].mean() > tau[:4].mean() + 0.01, tau
    dcfg, params = load_draft(summary["export"])
    assert type(dcfg).__name__ == "Qwen3Eagle3Config" and dcfg.ttt_length == 2
    assert dcfg.target_layer_ids == (0, 1, 2, 3, 4)
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]), np.asarray(tparams["embed_tokens"]))
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(tparams["lm_head"]))
