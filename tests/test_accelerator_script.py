"""benchmarks/accelerator.sh --small runs end to end on CPU and writes the JSON it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~60 s: every section of the accelerator script, in subprocesses
def test_accelerator_small(tmp_path):
    out = tmp_path / "acc"
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/accelerator.sh"), "--small", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((out / "accelerator.json").read_text())
    assert report["small"] is True and report["device"]["platform"] == "cpu"
    sections = report["sections"]
    assert set(sections) == {"matmul", "decode", "sps", "train"}
    assert sections["matmul"]["flops_per_s"] > 0
    rows = sections["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ar_step_s"] > 0 and r["round_s"] > 0
        assert r["round_over_ar"] == r["round_s"] / r["ar_step_s"]
        assert r["hlo_ops"]["round"] > r["hlo_ops"]["ar_step"] > 0
        assert r["compiles_timed"] == 0
    table = sections["sps"]["table"]
    assert table["batch_sizes"] == [1, 2] and all(s > 0 for s in table["sps"])
    train = sections["train"]
    assert train["tokens_per_s"] > 0 and train["model_flops"] > 0 and train["hlo_flops"] > 0
    assert train["options"] == {"remat": "dots", "loss_chunk": 8, "compute_dtype": "bfloat16"}
    assert train["mfu"] is None  # no known peak for a CPU; measured against the matmul instead
    assert train["fraction_of_measured_matmul_peak"] > 0 and train["mode"] == "online"
    assert train["compiles_timed"] == 0 and report["compiles_timed"] == 0
    for name in ("matmul", "decode", "sps", "train"):  # each section is also written on its own
        assert json.loads((out / f"accelerator_{name}.json").read_text()) == json.loads(json.dumps(sections[name]))


def test_accelerator_usage_error(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/accelerator.sh"), "--bogus", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/accelerator.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "missing OUTDIR" in proc.stderr
