"""The one output rule (issue 36): every writing command refuses, before any work, an output path
that is not new, a regular file or a folder dspark-jax wrote: a folder of other files, the working
directory, a device node, a FIFO, a symlink, a socket. Exit 2, one stderr line naming the path and
what it is, nothing changed on disk (bytes, mtimes, file types). ``--force`` is passed in every case:
it must not help. Each case runs the command in-process; the refusal comes before any model load.
"""

import hashlib
import json
import os
import re
import socket
import stat
from pathlib import Path

import pytest

from dspark_jax import cli
from dspark_jax.errors import InputError
from dspark_jax.fileio import OUTPUT_MARKER, atomic_dir, check_replaceable

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests/fixtures/dspark_qwen3_tiny"
TARGET, DRAFT = str(TINY / "target"), str(TINY / "draft")


def _inputs(d: Path) -> dict:
    """Small valid inputs of every command, in ``d``."""
    (d / "prompts.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    (d / "data.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [1] * 4}) + "\n")
    (d / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (d / "logs.jsonl").write_text(json.dumps({"confidence_logits": [[0.1, 0.2]], "accepted_drafts": [1],
                                              "proposal_lengths": [2]}) + "\n")
    return {k: str(d / f"{k}.jsonl") for k in ("prompts", "data", "chat", "logs")}


def _train(d: Path, out: str) -> list[str]:
    cfg = dict(target=TARGET, data=str(d / "data.jsonl"), output_dir=out, max_length=16, batch_size=2, steps=1,
               compute_dtype="float32", progress=False, num_devices=1, mesh="data=1",
               draft=dict(num_hidden_layers=1, target_layer_ids=(0, 2, 4), mask_token_id=511, num_anchors=2))
    (d / "cfg.py").write_text(f"CONFIG = {cfg!r}\n")
    return ["train", "--config", str(d / "cfg.py")]


# command -> argv(d, inputs, out); --force is appended to those that have it
COMMANDS = {
    "convert": lambda d, i, o: ["convert", DRAFT, o],
    "export": lambda d, i, o: ["export", DRAFT, o, "--engine", "vllm"],
    "cache": lambda d, i, o: ["cache", "--target", TARGET, "--data", i["data"], "--out", o, "--max-length", "8"],
    "generate": lambda d, i, o: ["generate", "--target", TARGET, "--draft", DRAFT, "--prompts", i["prompts"],
                                 "--out", o],
    "eval": lambda d, i, o: ["eval", "--target", TARGET, "--draft", DRAFT, "--out", o],
    "calibrate": lambda d, i, o: ["calibrate", "--logs", i["logs"], "--out", o],
    "train": lambda d, i, o: _train(d, o),
    "demo": lambda d, i, o: ["demo", "--quick", "--out", o, "--no-progress"],
    "plan": lambda d, i, o: ["plan", "--target", "Qwen/Qwen3-4B", "--json", o],
    "profile-sps": lambda d, i, o: ["profile-sps", "--target", TARGET, "--draft", DRAFT, "--out", o],
    "data regenerate": lambda d, i, o: ["data", "regenerate", "--target", TARGET, "--data", i["chat"], "--out", o],
    "data inspect": lambda d, i, o: ["data", "inspect", i["data"], "--json", o],
}
NO_FORCE = {"train"}


def _bad(kind: str, d: Path) -> Path:
    """An output path of ``kind`` under ``d`` (``cwd``: ``d`` itself, the test chdirs there)."""
    if kind == "cwd":
        return d
    p = d / "victim"
    if kind == "other-files-folder":
        p.mkdir()
        (p / "notes.txt").write_text("mine")
        (p / "src").mkdir()
        (p / "src" / "a.py").write_text("print(1)")
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "symlink":
        (d / "real.jsonl").write_text("keep\n")
        p.symlink_to(d / "real.jsonl")
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    return p


WORDS = {"other-files-folder": "(folder of other files|is a directory)", "cwd": "working directory",
         "device": "character device", "fifo": "FIFO", "symlink": "symbolic link", "socket": "socket"}


def snapshot(root: Path) -> dict:
    """{relative path: (file type, sha256 of a regular file, mtime_ns)}, links not followed."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), digest, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("kind", list(WORDS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_writing_command_refuses_what_it_did_not_write(command, kind, tmp_path, monkeypatch, capsys):
    d, src = tmp_path / "work", tmp_path / "in"
    d.mkdir()
    src.mkdir()
    (d / "notes.txt").write_text("the user's")
    inputs = _inputs(src)
    out = _bad(kind, d)
    monkeypatch.chdir(d)
    argv = COMMANDS[command](src, inputs, str(out)) + ([] if command in NO_FORCE else ["--force"])
    before = snapshot(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert str(out) in err[0], err
    assert re.search(WORDS[kind], err[0]), err
    assert snapshot(tmp_path) == before


def test_force_replaces_only_a_folder_of_ours_with_nothing_foreign(tmp_path):
    dst = tmp_path / "dst"
    with atomic_dir(dst, what="test") as t:
        (t / "a.bin").write_bytes(b"1")
    assert json.loads((dst / OUTPUT_MARKER).read_text())["entries"] == ["a.bin"]
    with pytest.raises(InputError, match="destination exists.*--force"):
        check_replaceable(dst, kind="dir")
    with atomic_dir(dst, force=True) as t:  # ours, nothing foreign: replaced
        (t / "b.bin").write_bytes(b"2")
    assert sorted(p.name for p in dst.iterdir()) == [OUTPUT_MARKER, "b.bin"]
    (dst / "notes.txt").write_text("the user's")
    with pytest.raises(InputError, match=r"did not write \(notes.txt\)"):
        with atomic_dir(dst, force=True):
            pass
    assert (dst / "notes.txt").read_text() == "the user's"
    (dst / OUTPUT_MARKER).unlink()
    with pytest.raises(InputError, match="folder of other files"):
        check_replaceable(dst, kind="dir", force=True)
    # the parent of the working directory, even one of ours, is never replaced
    (dst / "notes.txt").unlink()
    (dst / "sub").mkdir()
    os.chdir(dst / "sub")
    try:
        with pytest.raises(InputError, match="holding the working directory"):
            check_replaceable(dst, kind="dir", force=True)
    finally:
        os.chdir(tmp_path)
