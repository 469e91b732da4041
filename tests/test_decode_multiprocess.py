"""Decoding under ``jax.distributed``: 2 processes x 2 CPU devices (launch/local.py, gloo) give the
reference fixture's greedy tokens and acceptance lengths token for token — speculative static
(device loop with data across the processes, host loop with tensor across them), continuous
batching (reversed arrival order, tensor across the processes), the autoregressive baseline
(static and continuous, data across), and `dspark-jax generate --mesh data=2,tensor=2` (speculative
continuous; its env-configured jax.distributed; process 0 writes --out). Single-process meshes
cover the other combinations (test_engine, test_sharding). The worker: decode_multiprocess_worker.py.
"""

import json
import os
import subprocess
import sys

import pytest
from train_tiny import REPO

TINY = REPO / "tests/fixtures/dspark_qwen3_tiny"
RUNS = ["data2_tensor2/spec/static-device-loop", "tensor2_across_processes/spec/static-host-loop",
        "tensor2_across_processes/spec/continuous", "data2_tensor2/ar/static", "data2_tensor2/ar/continuous"]


@pytest.mark.slow  # ~55-160 s on 2 shared CPU cores (two processes compile every program)
def test_two_processes_decode_the_reference_tokens(tmp_path):
    ref = json.loads((TINY / "decode_greedy.json").read_text())
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                                                    for p in ref["prompts"]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(REPO / "launch/local.py"), "-n", "2", "-m", "2", "--log-dir",
           str(tmp_path / "logs"), "--", sys.executable, str(REPO / "tests/decode_multiprocess_worker.py"),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, timeout=600, stdout=subprocess.DEVNULL)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, logs
    got = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in (0, 1)]
    assert got[0] == got[1]  # both processes read back the same (gathered) results
    assert sorted(got[0]) == sorted(RUNS)
    for run, res in got[0].items():
        assert res["output_ids"] == ref["output_ids"], f"{run}: tokens differ from the reference"
        if "/spec/" in run:
            assert res["acceptance_lengths"] == ref["acceptance_lengths"], f"{run}: acceptance lengths"
    lines = [json.loads(line) for line in (tmp_path / "generate.jsonl").read_text().splitlines()]
    assert [x["output_ids"] for x in lines] == ref["output_ids"]
    assert [x["acceptance_lengths"] for x in lines] == ref["acceptance_lengths"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generate.jsonl", "logs", "process_0.json",
                                                          "process_1.json", "prompts.jsonl"]
