"""Every benchmarks/*.py runs with its smallest settings (--smoke) and writes JSON under --out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# accelerator.py runs through its driver script in tests/test_accelerator_script.py
# (`accelerator.sh --small`), so it is not run a second time here.
COVERED_ELSEWHERE = {"accelerator.py"}
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py")
                    if not p.name.startswith("_") and p.name not in COVERED_ELSEWHERE)


def test_benchmarks_found():
    assert BENCHMARKS, "no benchmarks/*.py"


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_smoke(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs them
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.rglob("*.json")), f"{script.name} wrote no JSON under --out"
