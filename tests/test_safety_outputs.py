"""Inputs are sacred and outputs are never half-written (issue 27): the shared output check
(``fileio.check_output``) and the removal of temporaries an interrupted run left behind."""

import os

import pytest

from dspark_jax.errors import InputError
from dspark_jax.fileio import atomic_dir, atomic_open, check_output, remove_stale_temps


def test_output_that_is_contains_or_lies_inside_an_input_is_refused_even_with_force(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.json").write_text("{}")
    for out, how in ((src, "is"), (tmp_path, "contains"), (src / "sub" / "new.json", "lies inside"),
                     (src / "sub" / "f.json", "lies inside")):
        with pytest.raises(InputError, match=rf"--out .* {how} the input --src .*src'"):
            check_output(out, force=True, kind="dir" if out.is_dir() else "file", inputs={"--src": src})
    link = tmp_path / "link"
    link.symlink_to(src / "sub" / "f.json")
    with pytest.raises(InputError, match="is the input --file"):
        check_output(link, force=True, inputs={"--file": src / "sub" / "f.json"})
    assert check_output(tmp_path / "other", kind="dir", inputs={"--src": src, "--none": None}) == tmp_path / "other"


def test_run_directory_is_absent_empty_or_ours(tmp_path):
    run = tmp_path / "run"
    assert check_output(run, kind="dir", marker="run.json")  # absent
    run.mkdir()
    assert check_output(run, kind="dir", marker="run.json")  # empty
    (run / "run.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert check_output(run, kind="dir", marker="run.json")  # ours
    (run / "run.json").unlink()
    with pytest.raises(InputError, match="without run.json .*not one of ours.*metrics.jsonl"):
        check_output(run, kind="dir", marker="run.json", force=True)


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path, capsys):
    dst = tmp_path / "out"
    dead = tmp_path / ".out.tmp-999999999-0badc0de"  # beyond pid_max: no such process
    legacy = tmp_path / ".out.tmp-0badc0de"  # older versions: no pid
    live = tmp_path / f".out.tmp-{os.getpid()}-0badc0de"
    other = tmp_path / ".outer.tmp-999999999-0badc0de"
    for d in (dead, legacy, live, other):
        d.mkdir()
        (d / "part.npy").write_bytes(b"x")
    (tmp_path / ".out.tmp-999999999-file").write_text("torn")
    with atomic_dir(dst) as tmp:
        (tmp / "a").write_text("a")
    assert not dead.exists() and not legacy.exists() and not (tmp_path / ".out.tmp-999999999-file").exists()
    assert live.exists() and other.exists() and (dst / "a").read_text() == "a"
    err = capsys.readouterr().err
    assert err.count("incomplete output of an interrupted earlier run") == 3
    (tmp_path / ".f.json.tmp-999999999-abc").write_text("torn")
    with atomic_open(tmp_path / "f.json") as f:
        f.write("{}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".f.json")) == []
    assert remove_stale_temps(tmp_path / "nowhere" / "x") == []
