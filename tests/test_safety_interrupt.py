"""Ctrl-C is clean (issue 27): SIGINT during training ends at the next step boundary with
"interrupted" and exit code 130 (never inside XLA/orbax work, which crashed the demo), that step is
checkpointed (issue 36) beside those written so far, and a rerun resumes from it (that a resume equals an
uninterrupted run is tests/test_train_resume.py's check)."""

import json
import os
import signal

import numpy as np

from dspark_jax import cli
from dspark_jax.train import loop
from train_tiny import TARGET


def _config(tmp_path, out):
    rng = np.random.default_rng(0)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"input_ids": rng.integers(1, 500, 24).tolist()}) + "\n"
                                for _ in range(16)))
    cfg = dict(target=str(TARGET), data=str(data), output_dir=str(out), max_length=24, batch_size=8, steps=4,
               compute_dtype="float32", progress=False, num_devices=1, mesh="data=1", export_format="none",
               checkpoint=dict(every=3, async_save=True),
               draft=dict(num_hidden_layers=1, target_layer_ids=(0, 2, 4), mask_token_id=511, num_anchors=2))
    path = tmp_path / f"{out.name}.py"
    path.write_text(f"CONFIG = {cfg!r}\n")
    return path


def test_sigint_in_training_stops_between_steps_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(loop.FAST_COMPILE_ENV, "1")
    save = loop._save

    def save_then_interrupt(run, mgr, step, *a, **kw):
        save(run, mgr, step, *a, **kw)
        if step == 2 and not kw.get("now"):
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: lands while the loop runs

    monkeypatch.setattr(loop, "_save", save_then_interrupt)
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(["train", "--config", str(_config(tmp_path, out))]) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["interrupted"], err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # stopped at the boundary after step 2
    # checkpoints every 3 steps: none was due, yet the step Ctrl-C stopped at is saved
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored

    monkeypatch.setattr(loop, "_save", save)
    assert cli.main(["train", "--config", str(_config(tmp_path, out))]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and summary["final"]["step"] == 4


def test_ctrl_c_in_cache_leaves_nothing_and_the_rerun_writes_it(tmp_path, capsys, monkeypatch):
    from dspark_jax.data import cache as cache_lib

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6]}) + "\n" for _ in range(4)))
    argv = ["cache", "--target", str(TARGET), "--data", str(data), "--out", str(tmp_path / "c"), "--layer-ids",
            "0,2", "--batch-size", "2", "--max-length", "8", "--quiet"]
    save = np.save

    def interrupted_save(*a, **kw):  # Ctrl-C while the first array is written
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_lib.np, "save", interrupted_save)
    capsys.readouterr()
    assert cli.main(argv) == 130
    assert [line for line in capsys.readouterr().err.splitlines() if line.strip()][-1] == "interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # no --out, no temporary
    monkeypatch.setattr(cache_lib.np, "save", save)
    assert cli.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "data.jsonl"]
    assert cache_lib.FeatureCache(tmp_path / "c").manifest["num_tokens"] == 24
