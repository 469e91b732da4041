"""Counts a user passes are bounded by the memory they need, before the first allocation that
grows with them (issue 36): one line naming the flag, the most that fits and the GiB asked for."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.decode import memory

TINY = Path(__file__).resolve().parents[1] / "tests/fixtures/dspark_qwen3_tiny"
TARGET, DRAFT = str(TINY / "target"), str(TINY / "draft")
HUGE = str(10 ** 7)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": [1, 2, i]}) + "\n" for i in range(8)))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"input_ids": [1, 2, 3, 4, 5], "loss_mask": [1] * 5})
                                              + "\n" for _ in range(3)))
    return tmp_path


@pytest.mark.parametrize("argv,flag", [
    (lambda d: ["generate", "--target", TARGET, "--draft", DRAFT, "--prompts", str(d / "p.jsonl"),
                "--out", str(d / "o.jsonl"), "--batch-size", HUGE], "--batch-size"),
    (lambda d: ["generate", "--target", TARGET, "--prompts", str(d / "p.jsonl"), "--out", str(d / "o.jsonl"),
                "--batch-size", HUGE, "--batching", "static"], "--batch-size"),
    (lambda d: ["profile-sps", "--target", TARGET, "--draft", DRAFT, "--out", str(d / "s.json"),
                "--max-batch", HUGE], "--max-batch"),
    (lambda d: ["profile-sps", "--target", TARGET, "--out", str(d / "s.json"), "--batch-sizes", f"1,{HUGE}"],
     "--batch-sizes"),
], ids=["generate", "generate-autoregressive-static", "profile-sps-rounds", "profile-sps"])
def test_counts_beyond_memory_are_refused_before_allocation(argv, flag, files, capsys):
    assert cli.main(argv(files)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    m = re.search(rf"{flag} {HUGE} needs about ([\d.]+) GiB .* has ([\d.]+) GiB: at most {flag} (\d+)", err[0])
    assert m and float(m[1]) > float(m[2]) and 0 < int(m[3]) < int(HUGE), err
    assert not any(files.glob("o.jsonl")) and not any(files.glob("s.json"))


def test_cache_batch_is_bounded_by_the_data_and_memory(files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "c"
    argv = ["cache", "--target", TARGET, "--data", str(files / "d.jsonl"), "--max-length", "8",
            "--layer-ids", "0,2,4", "--quiet"]
    assert cli.main(argv + ["--out", str(out), "--batch-size", HUGE]) == 0  # 3 rows: a batch of 3, not 10^7
    assert json.loads(capsys.readouterr().out)["num_records"] == 3
    monkeypatch.setattr(memory, "capacity", lambda mesh=None: (1 << 20, "this host (available now)"))
    assert cli.main(argv + ["--out", str(tmp_path / "c2"), "--batch-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"--batch-size 3 needs about .* at most --batch-size 0", err[0]), err


def test_check_fits_names_the_largest_value():
    from dspark_jax.errors import InputError
    have, _ = memory.capacity()
    memory.check_fits("--n", 1, 1.0)
    with pytest.raises(InputError, match=rf"--n 4 needs about .* at most --n {int((have - 10) // (have / 3))}"):
        memory.check_fits("--n", 4, have / 3, fixed=10)


def test_non_finite_features_are_refused():
    from dspark_jax.data.cache import _check_finite
    from dspark_jax.errors import CheckpointError
    taps, last = np.zeros((2, 3, 4)), np.zeros((2, 3, 2))
    _check_finite(taps, last, [5, 6])
    last[1, 2, 0] = np.nan
    with pytest.raises(CheckpointError, match="not finite .*record 6"):
        _check_finite(taps, last, [5, 6])


@pytest.mark.parametrize("args,expect", [
    (["--devices", HUGE], rf"--devices {HUGE} needs about [\d.]+ GiB .* at most --devices \d+"),
    (["--mesh", "fsdp=0"], r"--mesh 'fsdp=0': axis fsdp=0 must be >= 1"),
])
def test_plan_devices_and_mesh_checked_before_devices_exist(args, expect, capsys):
    assert cli.main(["plan", "--target", "Qwen/Qwen3-4B", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(expect, err[0]), err
