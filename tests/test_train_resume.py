"""Resume after SIGKILL equals an uninterrupted run; a NaN loss stops training cleanly."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.data.sample import sample_sequences, write_jsonl
from dspark_jax.errors import ConfigError
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.loop import FAST_COMPILE_ENV, KILL_AT_STEP_ENV, NonFiniteLossError, train
from train_tiny import TARGET
from train_tiny import tiny_config as _tiny


def tiny_config(tmp, data, **kw) -> TrainConfig:
    base = dict(data=str(data), steps=6, epochs=1, checkpoint=dict(every=2, keep=2, async_save=True),
                export_format="jax")
    for k, v in kw.items():
        base[k] = dict(base.get(k, {}), **v) if isinstance(v, dict) else v
    return _tiny(tmp / "run", **base)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    cfg, params = load_target(TARGET)
    path = tmp_path_factory.mktemp("data") / "seqs.jsonl"
    write_jsonl(path, sample_sequences(params, cfg, 24, 32, seed=2))  # 3 batches/epoch: 6 steps = 2 epochs
    return path


def _run_cli(cfg: TrainConfig, tmp: Path, kill_at_step: int = 0):
    cfg_file = tmp / "cfg.py"
    cfg_file.write_text(f"CONFIG = {cfg.to_dict()!r}\n")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]  # conftest's
    env = dict(os.environ, XLA_FLAGS=" ".join(flags + ["--xla_force_host_platform_device_count=1"]), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"),  # the resumed run reuses the compile
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **{FAST_COMPILE_ENV: "1"})
    env[KILL_AT_STEP_ENV] = str(kill_at_step)
    cmd = [sys.executable, "-m", "dspark_jax.cli", "train", "--config", str(cfg_file),
           "--matmul-precision", "highest"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_resume_after_sigkill_matches_uninterrupted(data_file, tmp_path):
    ref = train(tiny_config(tmp_path / "ref", data_file), fast_compile=True)
    cfg = tiny_config(tmp_path / "killed", data_file)
    first = _run_cli(cfg, tmp_path, kill_at_step=4)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    ckpts = sorted(int(p.name) for p in (Path(cfg.output_dir) / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == [2, 4]
    assert not (Path(cfg.output_dir) / "export").exists()
    # a step the killed run logged after its last checkpoint (and a line cut by the kill):
    # the resume replays step 5, which must then appear once
    with (Path(cfg.output_dir) / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 5, "loss": -1.0}) + "\n" + '{"step": 6, "lo')
    from tensorboardX import SummaryWriter
    with SummaryWriter(str(Path(cfg.output_dir) / "tb")) as w:  # and its TensorBoard event
        w.add_scalar("train/loss", -1.0, 5)
    second = _run_cli(cfg, tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads((Path(cfg.output_dir) / "summary.json").read_text())
    assert summary["resumed_from"] == 4
    _, params = load_draft(Path(cfg.output_dir) / "export")
    flat_ref = dict(_flatten(ref["params"]))
    for name, value in _flatten(params):
        np.testing.assert_allclose(np.asarray(value), flat_ref[name], atol=1e-6, rtol=0, err_msg=name)
    # data order: the last record of every step (the resumed run rewrites steps 5-6)
    rows = {}
    for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = r
    assert [rows[s]["data"] for s in range(1, 7)] == [r["data"] for r in ref["history"]]
    np.testing.assert_allclose([rows[s]["loss"] for s in range(1, 7)], [r["loss"] for r in ref["history"]],
                               atol=1e-6, rtol=0)
    # two epochs: every example seen once per epoch, in a different order
    order = [i for s in range(1, 7) for i in rows[s]["data"]]
    assert sorted(order[:24]) == list(range(24)) == sorted(order[24:]) and order[:24] != order[24:]
    steps = [json.loads(line)["step"] for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step once after SIGKILL + resume
    assert _tb_steps(Path(cfg.output_dir) / "tb", "train/loss") == [1, 2, 3, 4, 5, 6]

    # rerunning the finished run says so and changes nothing on disk (listing, bytes, mtimes)
    before = _snapshot(Path(cfg.output_dir))
    third = _run_cli(cfg, tmp_path)
    assert third.returncode == 0, third.stderr[-2000:]
    assert "finished" in third.stderr
    assert _snapshot(Path(cfg.output_dir)) == before
    # a rerun that differs in what defines the run is refused, naming the fields
    for changed, field in ((dict(optimizer=dict(learning_rate=1e-4)), "optimizer.learning_rate"),
                           (dict(seed=3), "seed")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.") + ".*--force-resume"):
            train(tiny_config(tmp_path / "killed", data_file, **changed), fast_compile=True)
        assert _snapshot(Path(cfg.output_dir)) == before
    other = tmp_path / "other.jsonl"
    other.write_text(Path(data_file).read_text().replace("\n", " \n", 1))  # same records, other bytes
    with pytest.raises(ConfigError, match=r"data\.sha256"):
        train(tiny_config(tmp_path / "killed", other), fast_compile=True)
    # --force-resume accepts the difference (here: the run is finished, so nothing to do)
    done = train(tiny_config(tmp_path / "killed", data_file, seed=3), fast_compile=True, force_resume=True)
    assert done["finished"] and _snapshot(Path(cfg.output_dir)) == before


def _tb_steps(tb: Path, tag: str) -> list[int]:
    """Steps of ``tag`` as TensorBoard shows them: event files in order, a SessionLog START at
    step s (``purge_step``) dropping the events of steps >= s read before it."""
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    steps = []
    for f in sorted(tb.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                steps = [s for s in steps if s < ev.step]
            elif ev.HasField("summary"):
                steps += [ev.step for v in ev.summary.value if v.tag == tag]
    return steps


def _snapshot(root: Path) -> dict:
    import hashlib
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}")
    else:
        yield prefix, np.asarray(tree)


def test_nan_loss_stops_with_clear_message_and_keeps_last_checkpoint(data_file, tmp_path):
    cfg = tiny_config(tmp_path, data_file, optimizer=dict(learning_rate=1e30),
                      checkpoint=dict(every=1, async_save=False))
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss.*step 2.*Last good checkpoint: 1"):
        train(cfg, fast_compile=True)
    ckpt_dir = Path(cfg.output_dir) / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    assert steps == [1]
    with ocp.CheckpointManager(ckpt_dir) as mgr:
        restored = mgr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert int(np.asarray(restored["state"]["step"] if isinstance(restored["state"], dict)
                          else restored["state"].step)) == 1
    assert not (Path(cfg.output_dir) / "export").exists()
