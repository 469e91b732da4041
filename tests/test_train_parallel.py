"""Loss trajectories are the same on 1 device, 4 data-parallel devices, a (data=2, fsdp=2) mesh
with gradient accumulation, and 2 processes x 2 devices through launch/local.py (gloo)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.data.sample import sample_sequences, write_jsonl
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.loop import FAST_COMPILE_ENV, train
from train_tiny import REPO, TARGET
from train_tiny import tiny_config as _tiny


def tiny_config(tmp, data, **kw) -> TrainConfig:
    return _tiny(tmp / "run", data=str(data), **kw)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    cfg, params = load_target(TARGET)
    path = tmp_path_factory.mktemp("data") / "seqs.jsonl"
    write_jsonl(path, sample_sequences(params, cfg, 32, 32, seed=1))
    return path


def losses(summary):
    return np.array([r["loss"] for r in summary["history"]])


@pytest.fixture(scope="module")
def single(data_file, tmp_path_factory):
    return train(tiny_config(tmp_path_factory.mktemp("one"), data_file), fast_compile=True)


def test_data_parallel_and_fsdp_match_single_device(single, data_file, tmp_path):
    ref = losses(single)
    assert len(ref) == 3 and np.all(np.isfinite(ref))
    assert ref[-1] < ref[0]  # it trains
    dp = train(tiny_config(tmp_path / "dp", data_file, num_devices=4, mesh="data=4"), fast_compile=True)
    np.testing.assert_allclose(losses(dp), ref, atol=1e-5, rtol=0)
    assert [r["data"] for r in dp["history"]] == [r["data"] for r in single["history"]]
    fsdp = train(tiny_config(tmp_path / "fsdp", data_file, num_devices=4, mesh="data=2,fsdp=2", grad_accum=2),
                 fast_compile=True)
    np.testing.assert_allclose(losses(fsdp), ref, atol=1e-5, rtol=0)
    for name in ("ce_loss", "l1_loss", "confidence_loss", "expected_accept_length"):
        np.testing.assert_allclose([r[name] for r in fsdp["history"]],
                                   [r[name] for r in single["history"]], atol=1e-5)


def test_two_processes_over_gloo_match_single_device(single, data_file, tmp_path):
    cfg = tiny_config(tmp_path, data_file, num_devices=0, mesh="data=2,fsdp=2", grad_accum=2,
                      checkpoint=dict(every=2), export_format="torch")
    cfg_file = tmp_path / "cfg.py"
    d = cfg.to_dict()
    cfg_file.write_text(f"CONFIG = {d!r}\n")
    env = dict(os.environ, **{FAST_COMPILE_ENV: "1"})
    cmd = [sys.executable, str(REPO / "launch/local.py"), "-n", "2", "-m", "2", "--log-dir", str(tmp_path / "logs"),
           "--", sys.executable, "-m", "dspark_jax.cli", "train", "--config", str(cfg_file),
           "--matmul-precision", "highest"]
    proc = subprocess.run(cmd, env=env, timeout=300)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, logs
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in rows], losses(single), atol=1e-5, rtol=0)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["num_devices"] == 4
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    dcfg, params = load_draft(tmp_path / "run" / "export")  # gathered from both processes
    assert dcfg.markov_rank == 16 and params["fc"].shape == (192, 64)
