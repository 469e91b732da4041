"""Bad input on the command line: exit code 2, ONE stderr line naming the file/field/line, no
traceback, no partial output, pre-existing files untouched (bytes and mtime).

Each case builds its inputs in a fresh temp dir, snapshots the dir, runs the command in-process
(``dspark_jax.cli.main`` / ``dspark_jax.data.sample.main``) and compares the snapshot. A few cases
also run as a subprocess (the real console entry point).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.data import sample as sample_mod

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests/fixtures/dspark_qwen3_tiny"
TARGET, DRAFT = TINY / "target", TINY / "draft"
BAD_UTF8 = b'{"prompt_ids": [1, 2]}\n{"text": "caf\xe9"}\n'


def snapshot(root: Path) -> dict:
    """{relative path: (kind, sha256, mtime_ns)} of everything under ``root``."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            out[rel] = ("dir", None, None)
        else:
            out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def _w(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def _prompts(d):
    return _w(d / "prompts.jsonl", '{"prompt_ids": [1, 2, 3]}\n')


def _tokens(d, mask=1):
    return _w(d / "data.jsonl", "".join(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [mask] * 6})
                                        + "\n" for _ in range(4)))


def _config(d, **kw):
    cfg = dict(target=str(TARGET), data=str(d / "data.jsonl"), output_dir=str(d / "run"), max_length=16,
               batch_size=2, steps=1, compute_dtype="float32", progress=False, num_devices=1, mesh="data=1",
               draft=dict(num_hidden_layers=1, target_layer_ids=(0, 2, 4), mask_token_id=511, num_anchors=2))
    cfg.update(kw)
    return _w(d / "cfg.py", f"CONFIG = {cfg!r}\n")


def _logs(d, data=None):
    rec = {"confidence_logits": [[0.1, 0.2]], "accepted_drafts": [1], "proposal_lengths": [2]}
    return _w(d / "logs.jsonl", data if data is not None else json.dumps(rec) + "\n")


# (command, case id) -> (setup(d) -> argv, expected substring of the one error line)
def G(*extra):
    return ["generate", "--target", str(TARGET), "--draft", str(DRAFT), *extra]


CASES = {
    # ---- generate
    ("generate", "non-utf8-prompts"): (
        lambda d: G("--prompts", str(_w(d / "p.jsonl", BAD_UTF8)), "--out", str(d / "o.jsonl")), "p.jsonl:2"),
    ("generate", "malformed-line"): (
        lambda d: G("--prompts", str(_w(d / "p.jsonl", '{"prompt_ids": [1]}\n\n{oops\n')),
                    "--out", str(d / "o.jsonl")), "p.jsonl:3"),
    ("generate", "bad-record"): (
        lambda d: G("--prompts", str(_w(d / "p.jsonl", '{"prompt_ids": [1]}\n{"prompt_ids": "x"}\n')),
                    "--out", str(d / "o.jsonl")), "p.jsonl:2"),
    ("generate", "missing-prompts"): (
        lambda d: G("--prompts", str(d / "none.jsonl"), "--out", str(d / "o.jsonl")), "none.jsonl"),
    ("generate", "out-is-dir-force"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str((d / "od").mkdir() or d / "od"), "--force"),
        "is a directory"),
    ("generate", "out-exists"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(_w(d / "o.jsonl", "keep\n"))), "--force"),
    ("generate", "out-parent-is-file"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(_w(d / "f", "x") / "o.jsonl")),
        "not a directory"),
    ("generate", "max-new-tokens-0"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--max-new-tokens", "0"),
        "max_new_tokens"),
    ("generate", "scheduler-without-sps"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--verify", "scheduler"),
        "--sps"),
    ("generate", "bad-policy"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--verify", "fixed:x"),
        "fixed:x"),
    ("generate", "negative-temperature"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--temperature", "-1"),
        "temperature"),
    ("generate", "seed-negative"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--seed", "-1"), "seed"),
    ("generate", "batch-size-beyond-memory"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--batch-size", "100000000"),
        "GiB"),
    ("generate", "max-cache-len-beyond-context"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--max-cache-len", "100000000"),
        "max_position_embeddings"),
    ("generate", "out-parent-missing-unwritable"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", "/proc/nope/o.jsonl"), "not writable"),
    # ---- eval
    ("eval", "out-is-file"): (
        lambda d: ["eval", "--target", str(TARGET), "--draft", str(DRAFT), "--datasets", "gsm8k",
                   "--out", str(_w(d / "eval.out", "keep"))], "is a file"),
    ("eval", "non-utf8-dataset"): (
        lambda d: ["eval", "--target", str(TARGET), "--draft", str(DRAFT), "--datasets", "mine",
                   "--data-dir", str(_w(d / "ds" / "mine.jsonl", b'{"turns": ["a"]}\n{"turns": ["\xff"]}\n').parent)],
        "mine.jsonl:2"),
    ("eval", "max-samples-0"): (
        lambda d: ["eval", "--target", str(TARGET), "--draft", str(DRAFT), "--datasets", "gsm8k",
                   "--max-samples", "0"], "--max-samples"),
    ("eval", "unknown-dataset"): (
        lambda d: ["eval", "--target", str(TARGET), "--draft", str(DRAFT), "--datasets", "nope",
                   "--data-dir", str((d / "ds").mkdir() or d / "ds")], "nope"),
    # ---- profile-sps
    ("profile-sps", "out-is-dir-force"): (
        lambda d: ["profile-sps", "--target", str(TARGET), "--out", str((d / "od").mkdir() or d / "od"),
                   "--force"], "is a directory"),
    ("profile-sps", "out-exists"): (
        lambda d: ["profile-sps", "--target", str(TARGET), "--out", str(_w(d / "s.json", "{}"))], "--force"),
    ("profile-sps", "batch-sizes-0"): (
        lambda d: ["profile-sps", "--target", str(TARGET), "--out", str(d / "s.json"), "--batch-sizes", "0,2"],
        "--batch-sizes"),
    ("profile-sps", "batch-sizes-text"): (
        lambda d: ["profile-sps", "--target", str(TARGET), "--out", str(d / "s.json"), "--batch-sizes", "a"],
        "--batch-sizes"),
    ("profile-sps", "max-batch-0"): (
        lambda d: ["profile-sps", "--target", str(TARGET), "--out", str(d / "s.json"), "--max-batch", "0"],
        "--max-batch"),
    ("profile-sps", "bad-target"): (
        lambda d: ["profile-sps", "--target", str(d / "nowhere"), "--out", str(d / "s.json")], "nowhere"),
    # ---- plan
    ("plan", "decode-batch-0"): (
        lambda d: ["plan", "--target", "Qwen/Qwen3-4B", "--modes", "decode", "--decode-batch", "0"],
        "--decode-batch"),
    ("plan", "decode-len-0"): (
        lambda d: ["plan", "--target", "Qwen/Qwen3-4B", "--modes", "decode", "--decode-len", "0"],
        "--decode-len"),
    ("plan", "json-is-dir"): (
        lambda d: ["plan", "--target", "Qwen/Qwen3-4B", "--modes", "decode", "--json",
                   str((d / "jd").mkdir() or d / "jd")], "is a directory"),
    ("plan", "json-exists"): (
        lambda d: ["plan", "--target", "Qwen/Qwen3-4B", "--modes", "decode", "--json",
                   str(_w(d / "p.json", "{}"))], "--force"),
    ("plan", "target-dir"): (
        lambda d: ["plan", "--target", str(TARGET), "--modes", "decode"], "--config"),
    ("plan", "unknown-mode"): (
        lambda d: ["plan", "--target", "Qwen/Qwen3-4B", "--modes", "bogus"], "bogus"),
    ("plan", "missing-config"): (
        lambda d: ["plan", "--config", str(d / "none.py")], "none.py"),
    # ---- calibrate
    ("calibrate", "non-utf8-logs"): (
        lambda d: ["calibrate", "--logs", str(_logs(d, b'{"a": 1}\n\xfe\n')), "--out", str(d / "sts")],
        "logs.jsonl:2"),
    ("calibrate", "malformed-logs"): (
        lambda d: ["calibrate", "--logs", str(_logs(d, '{"a": \n')), "--out", str(d / "sts")], "logs.jsonl:1"),
    ("calibrate", "out-is-file"): (
        lambda d: ["calibrate", "--logs", str(_logs(d)), "--out", str(_w(d / "sts", "x")), "--force"],
        "is a file"),
    ("calibrate", "out-exists"): (
        lambda d: ["calibrate", "--logs", str(_logs(d)), "--out", str((d / "sts").mkdir() or d / "sts")],
        "--force"),
    ("calibrate", "bins-1"): (
        lambda d: ["calibrate", "--logs", str(_logs(d)), "--out", str(d / "sts"), "--bins", "1"], "--bins"),
    ("calibrate", "holdout-1"): (
        lambda d: ["calibrate", "--logs", str(_logs(d)), "--out", str(d / "sts"), "--holdout", "1.5"],
        "--holdout"),
    ("calibrate", "write-draft-without-draft"): (
        lambda d: ["calibrate", "--logs", str(_logs(d)), "--out", str(d / "sts"), "--write-draft"], "--draft"),
    ("calibrate", "nan-confidence-logit"): (
        lambda d: ["calibrate", "--logs", str(_logs(d, '{"confidence_logits": [[0.1, NaN]], "accepted_drafts": [1], '
                                                       '"proposal_lengths": [2]}\n')), "--out", str(d / "sts")],
        "logs.jsonl:1: confidence logit 1"),
    ("calibrate", "inf-confidence-logit"): (
        lambda d: ["calibrate", "--logs", str(_logs(d, '{"confidence_logits": [-Infinity, 0.2], "accepted": 1, '
                                                       '"proposal": 2}\n')), "--out", str(d / "sts")],
        "logs.jsonl:1: confidence logit 0"),
    # ---- cache
    ("cache", "batch-size-0"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d)), "--out", str(d / "c"),
                   "--layer-ids", "0,2", "--batch-size", "0"], "--batch-size"),
    ("cache", "out-exists"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d)),
                   "--out", str((d / "c").mkdir() or d / "c"), "--layer-ids", "0,2"], "--force"),
    ("cache", "out-is-file"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d)),
                   "--out", str(_w(d / "c", "x")), "--layer-ids", "0,2", "--force"], "is a file"),
    ("cache", "non-utf8-data"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_w(d / "data.jsonl", b'{"input_ids": [1]}\n\x80\n')),
                   "--out", str(d / "c"), "--layer-ids", "0,2"], "data.jsonl:2"),
    ("cache", "token-out-of-vocab"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_w(d / "data.jsonl", '{"input_ids": [1]}\n{"input_ids": [99999]}\n')),
                   "--out", str(d / "c"), "--layer-ids", "0,2"], "data.jsonl:2"),
    ("cache", "no-layer-ids"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d)), "--out", str(d / "c")],
        "--layer-ids"),
    ("cache", "bad-layer-id"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d)), "--out", str(d / "c"),
                   "--layer-ids", "0,99"], "99"),
    # ---- convert
    ("convert", "dst-is-src"): (
        lambda d: ["convert", str(_copy_draft(d)), str(d / "src"), "--force"], "src"),
    ("convert", "dst-parent-of-src"): (
        lambda d: ["convert", str(_copy_draft(d)), str(d), "--force"], "contains the input SRC"),
    ("convert", "dst-exists"): (
        lambda d: ["convert", str(_copy_draft(d)), str((d / "dst").mkdir() or d / "dst")], "--force"),
    ("convert", "dst-is-file"): (
        lambda d: ["convert", str(_copy_draft(d)), str(_w(d / "dst", "x")), "--force"], "is a file"),
    ("convert", "src-missing"): (
        lambda d: ["convert", str(d / "nowhere"), str(d / "dst")], "nowhere"),
    # ---- train
    ("train", "non-numeric-override"): (
        lambda d: ["train", "--config", str(_config(d)), "optimizer.learning_rate=abc"],
        "optimizer.learning_rate"),
    ("train", "unknown-override"): (
        lambda d: ["train", "--config", str(_config(d)), "optimizer.lr=1"], "optimizer.lr"),
    ("train", "missing-config"): (lambda d: ["train", "--config", str(d / "none.py")], "none.py"),
    ("train", "non-utf8-data"): (
        lambda d: ["train", "--config", str(_config(d)), f"data={_w(d / 'data.jsonl', BAD_UTF8.replace(b'prompt_ids', b'input_ids'))}"],
        "data.jsonl:2"),
    ("train", "all-zero-loss-mask"): (
        lambda d: (_tokens(d, mask=0), ["train", "--config", str(_config(d))])[1], "loss_mask"),
    ("train", "bad-record-line"): (
        lambda d: (_w(d / "data.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [1], "loss_mask": [1, 1]}\n'),
                   ["train", "--config", str(_config(d))])[1], "data.jsonl:2"),
    ("train", "max-length-1"): (
        lambda d: (_tokens(d), ["train", "--config", str(_config(d)), "max_length=1"])[1], "max_length"),
    ("train", "loss-mask-2"): (
        lambda d: (_tokens(d, mask=2), ["train", "--config", str(_config(d))])[1], "data.jsonl:1: 'loss_mask' value 2"),
    ("train", "loss-mask-half"): (
        lambda d: (_tokens(d, mask=0.5), ["train", "--config", str(_config(d))])[1], "not 0 or 1"),
    ("cache", "max-length-negative"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d)), "--out", str(d / "c"),
                   "--layer-ids", "0,2", "--max-length", "-3"], "--max-length"),
    ("train", "output-dir-is-file"): (
        lambda d: (_tokens(d), ["train", "--config", str(_config(d, output_dir=str(_w(d / "run", "x"))))])[1],
        "is a file"),
    # ---- demo
    ("demo", "out-is-file"): (lambda d: ["demo", "--quick", "--out", str(_w(d / "demo", "x"))], "is a file"),
    ("demo", "target-missing"): (
        lambda d: ["demo", "--quick", "--out", str(d / "demo"), "--target", str(d / "nowhere")], "nowhere"),
    # ---- inputs are sacred: an output that is, contains or lies inside an input is refused even
    # with --force, naming both (issue 27); the snapshot shows the input untouched
    ("cache", "out-is-target-force"): (
        lambda d: ["cache", "--target", str(_copy(d, TARGET, "t")), "--data", str(_tokens(d)), "--out", str(d / "t"),
                   "--layer-ids", "0,2", "--force"], "is the input --target"),
    ("cache", "out-contains-data-force"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d / "c")), "--out", str(d / "c"),
                   "--layer-ids", "0,2", "--force"], "contains the input --data"),
    ("export", "dst-contains-draft-force"): (
        lambda d: ["export", str(_copy(d / "p", DRAFT, "d")), str(d / "p"), "--engine", "deepspec", "--force"],
        "contains the input DRAFT"),
    ("export", "dst-is-draft-force"): (
        lambda d: ["export", str(_copy(d, DRAFT, "d")), str(d / "d"), "--engine", "deepspec", "--force"],
        "is the input DRAFT"),
    ("calibrate", "out-contains-logs-force"): (
        lambda d: ["calibrate", "--logs", str(_logs(d / "x")), "--out", str(d / "x"), "--force"],
        "contains the input --logs"),
    ("calibrate", "out-contains-draft-force"): (
        lambda d: ["calibrate", "--logs", str(_logs(d)), "--out", str(d / "x"), "--draft", str(_copy(d / "x", DRAFT, "d")),
                   "--write-draft", "--force"], "contains the input --draft"),
    ("profile-sps", "out-inside-target-force"): (
        lambda d: ["profile-sps", "--target", str(_copy(d, TARGET, "t")), "--out", str(d / "t" / "config.json"),
                   "--force"], "lies inside the input --target"),
    ("generate", "out-is-prompts-force"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "prompts.jsonl"), "--force"),
        "is the input --prompts"),
    ("generate", "out-is-prompts-symlink-force"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(_symlink(d / "o.jsonl", d / "prompts.jsonl")),
                    "--force"), "is the input --prompts"),
    ("eval", "out-inside-draft"): (
        lambda d: ["eval", "--target", str(TARGET), "--draft", str(_copy(d, DRAFT, "d")), "--datasets", "gsm8k",
                   "--out", str(d / "d" / "ev")], "lies inside the input --draft"),
    ("convert", "dst-inside-src-force"): (
        lambda d: ["convert", str(_copy_draft(d)), str(d / "src" / "sub"), "--force"], "lies inside the input SRC"),
    ("train", "output-dir-is-data-dir"): (
        lambda d: (_tokens(d / "run"), ["train", "--config", str(_config(d, data=str(d / "run" / "data.jsonl")))])[1],
        "contains the input data"),
    ("train", "export-dir-is-target"): (
        lambda d: (_tokens(d), ["train", "--config", str(_config(d, export_dir=str(TARGET)))])[1],
        "export_dir"),
    ("train", "output-dir-foreign"): (
        lambda d: (_tokens(d), _w(d / "run" / "notes.txt", "mine"), _w(d / "run" / "metrics.jsonl", "{}\n"),
                   ["train", "--config", str(_config(d))])[3], "not one of ours"),
    ("data-regenerate", "out-is-data-force"): (
        lambda d: ["data", "regenerate", "--target", str(TARGET), "--data", str(_w(d / "chat.jsonl", '{"prompt": "hi"}\n')),
                   "--out", str(d / "chat.jsonl"), "--force"], "is the input --data"),
    ("demo", "out-contains-target"): (
        lambda d: ["demo", "--quick", "--out", str(d), "--target", str(_copy(d, TARGET, "t"))],
        "contains the input --target"),
    ("data-regenerate", "journal-is-data"): (
        lambda d: ["data", "regenerate", "--target", str(TARGET), "--data",
                   str(_w(d / "o.jsonl.partial", '{"prompt": "hi"}\n')), "--out", str(d / "o.jsonl")],
        "(its journal o.jsonl.partial)"),
    ("data-inspect", "json-is-file-force"): (
        lambda d: ["data", "inspect", str(_tokens(d)), "--json", str(d / "data.jsonl"), "--force"],
        "is the input FILE"),
    ("sample", "out-inside-target-force"): (
        lambda d: ["--target", str(_copy(d, TARGET, "t")), "--out", str(d / "t" / "s.jsonl"), "--force"],
        "lies inside the input --target"),
    # ---- non-finite models and numbers, truncated files, unwritable destinations (issue 27)
    ("generate", "truncated-target-weights"): (
        lambda d: ["generate", "--target", str(_truncated(d, TARGET, "t")), "--prompts", str(_prompts(d)),
                   "--out", str(d / "o.jsonl")], "model.safetensors"),
    ("generate", "temperature-nan"): (
        lambda d: G("--prompts", str(_prompts(d)), "--out", str(d / "o.jsonl"), "--temperature", "nan"),
        "temperature"),
    ("calibrate", "holdout-nan"): (
        lambda d: ["calibrate", "--logs", str(_logs(d)), "--out", str(d / "sts"), "--holdout", "nan"], "--holdout"),
    ("profile-sps", "min-seconds-nan"): (
        lambda d: ["profile-sps", "--target", str(TARGET), "--out", str(d / "s.json"), "--min-seconds", "nan"],
        "--min-seconds"),
    ("convert", "inf-weight"): (
        lambda d: ["convert", str(_nan_model(d, DRAFT, "src", np.inf)), str(d / "dst")], "--allow-nonfinite"),
    ("export", "dst-unwritable"): (
        lambda d: ["export", str(DRAFT), "/proc/nope/d", "--engine", "deepspec"], "not writable"),
    ("train", "output-dir-unwritable"): (
        lambda d: (_tokens(d), ["train", "--config", str(_config(d, output_dir="/proc/nope/run"))])[1],
        "not writable"),
    ("cache", "out-unwritable"): (
        lambda d: ["cache", "--target", str(TARGET), "--data", str(_tokens(d)), "--out", "/proc/nope/c",
                   "--layer-ids", "0,2"], "not writable"),
    # ---- data.sample (python -m dspark_jax.data.sample)
    ("sample", "bad-target"): (lambda d: ["--target", str(d / "nowhere"), "--out", str(d / "s.jsonl")], "nowhere"),
    ("sample", "num-0"): (lambda d: ["--target", str(TARGET), "--out", str(d / "s.jsonl"), "--num", "0"], "--num"),
    ("sample", "length-1"): (
        lambda d: ["--target", str(TARGET), "--out", str(d / "s.jsonl"), "--length", "1"], "--length"),
    ("sample", "length-beyond-context"): (
        lambda d: ["--target", str(TARGET), "--out", str(d / "s.jsonl"), "--length", "100000"],
        "max_position_embeddings"),
    ("sample", "negative-temperature"): (
        lambda d: ["--target", str(TARGET), "--out", str(d / "s.jsonl"), "--temperature", "-0.5"],
        "--temperature"),
    ("sample", "out-exists"): (
        lambda d: ["--target", str(TARGET), "--out", str(_w(d / "s.jsonl", "keep\n"))], "--force"),
    ("sample", "out-is-dir"): (
        lambda d: ["--target", str(TARGET), "--out", str((d / "sd").mkdir() or d / "sd"), "--force"],
        "is a directory"),
}


def _copy(d: Path, src: Path, name: str) -> Path:
    import shutil
    shutil.copytree(src, d / name)
    return d / name


def _nan_model(d: Path, src: Path, name: str, value=float("nan")) -> Path:
    """A copy of the checkpoint ``src`` with ``value`` in every float tensor."""
    from safetensors.numpy import load_file, save_file
    out = _copy(d, src, name)
    tensors = {k: np.full_like(v, value) if v.dtype.kind == "f" else v
               for k, v in load_file(out / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors")
    return out


def _truncated(d: Path, src: Path, name: str) -> Path:
    out = _copy(d, src, name)
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return out


def _symlink(link: Path, to: Path) -> Path:
    link.symlink_to(to)
    return link


def _copy_draft(d: Path) -> Path:
    import shutil
    src = d / "src"
    shutil.copytree(DRAFT, src)
    return src


def _main(command):
    return sample_mod.main if command == "sample" else cli.main


@pytest.mark.parametrize("command,case", sorted(CASES), ids=[f"{c}-{k}" for c, k in sorted(CASES)])
def test_bad_input_one_line_exit_2(command, case, tmp_path, capsys):
    setup, expected = CASES[(command, case)]
    argv = setup(tmp_path)
    before = snapshot(tmp_path)
    capsys.readouterr()
    code = _main(command)(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err[-3000:])
    assert "Traceback" not in err + out
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert snapshot(tmp_path) == before  # no partial output, inputs untouched


def test_every_command_has_cases():
    commands = {c for c, _ in CASES}
    assert commands >= {"generate", "eval", "profile-sps", "plan", "calibrate", "cache", "convert", "train",
                        "demo", "sample"}


@pytest.mark.parametrize("argv,expected", [
    (["-m", "dspark_jax.cli", "plan", "--target", "Qwen/Qwen3-4B", "--decode-batch", "0"], "--decode-batch"),
    (["-m", "dspark_jax.data.sample", "--target", str(TARGET), "--out", "{d}/s.jsonl", "--num", "0"], "--num"),
    (["-m", "dspark_jax.cli", "generate", "--target", str(TARGET), "--prompts", "{d}/p.jsonl", "--out", "{d}/o.jsonl"],
     "p.jsonl:2"),
], ids=["plan", "sample", "generate-utf8"])
def test_subprocess_one_line(argv, expected, tmp_path):
    _w(tmp_path / "p.jsonl", BAD_UTF8)
    before = snapshot(tmp_path)
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(lines) == 1 and expected in lines[0], r.stderr
    assert snapshot(tmp_path) == before


def test_plan_help_is_honest(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "not a checkpoint directory" in text


def test_train_help_documents_force_resume(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--force-resume" in capsys.readouterr().out


# ---------------------------------------------------------------------------- warnings


def test_advisories():
    from dspark_jax.decode.policies import parse_policy
    from dspark_jax.decode.tables import SPSTable
    from dspark_jax.decode.settings import DecodeOptions, advisories

    o = DecodeOptions(verify="full", confidence_threshold=0.3)
    assert any("--confidence-threshold" in m for m in advisories(o, parse_policy("full")))
    o = DecodeOptions(verify="fixed:99")
    assert any("clamped" in m for m in advisories(o, parse_policy("fixed:99"), block_size=7))
    assert advisories(o, parse_policy("fixed:99")) == []
    # SPS(B) falling faster than 1/B: one more verified token lowers throughput -> never pays
    flat = SPSTable(batch_sizes=(1, 2, 4, 8), sps=(100.0, 40.0, 20.0, 10.0))
    o = DecodeOptions(verify="scheduler", sps_table="t.json")
    msgs = advisories(o, parse_policy("scheduler", sps_table=flat))
    assert any("never pays" in m and "profile-sps" in m for m in msgs), msgs
    good = SPSTable(batch_sizes=(1, 2, 4, 8), sps=(100.0, 99.0, 98.0, 97.0))
    assert advisories(o, parse_policy("scheduler", sps_table=good)) == []


def test_non_finite_weights_refused_by_convert_unless_allowed(tmp_path, capsys):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = _copy_draft(tmp_path)
    tensors = load_file(src / "model.safetensors")
    name = sorted(k for k, v in tensors.items() if v.dtype.kind == "f")[0]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[0] = np.nan
    save_file(tensors, src / "model.safetensors")
    capsys.readouterr()
    assert cli.main(["convert", str(src), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "confidence_head/bias" in err[0] and "--allow-nonfinite" in err[0], err
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst.tmp-*"))
    assert cli.main(["convert", str(src), str(tmp_path / "dst"), "--allow-nonfinite"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "NaN" in err


def test_local_launcher_echoes_process_0_and_tails_the_failure(tmp_path):
    code = ("import os, sys; i = os.environ['DSPARK_PROCESS_ID']; print('hello from', i, flush=True); "
            "sys.exit(3 if i == '1' else 0)")
    r = subprocess.run([sys.executable, str(REPO / "launch/local.py"), "-n", "2", "--log-dir", str(tmp_path / "logs"),
                        "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3
    assert "hello from 0" in r.stdout and "hello from 1" not in r.stdout
    assert "process 1 failed first (exit code 3)" in r.stderr and "| hello from 1" in r.stderr
    assert (tmp_path / "logs/process_1.log").read_text() == "hello from 1\n"


def test_nan_target_is_an_error_not_a_result(tmp_path, capsys):
    """A target with NaN weights: found by the decode (its logits), after the progress bar started,
    so the error is the LAST line; exit 2, no traceback, no output file, inputs untouched."""
    argv = ["generate", "--target", str(_nan_model(tmp_path, TARGET, "t")), "--prompts", str(_prompts(tmp_path)),
            "--out", str(tmp_path / "o.jsonl")]
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not finite" in err.strip().splitlines()[-1], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv,expected", [
    (["-n", "0", "--", sys.executable, "-c", "pass"], "--processes must be >= 1"),
    (["-n", "2", "--", "no-such-binary-xyz"], "'no-such-binary-xyz' not found"),
], ids=["n-0", "missing-binary"])
def test_local_launcher_refuses_in_one_line(argv, expected, tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "launch/local.py"), *argv], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    errors = [line for line in r.stderr.splitlines() if "error:" in line]  # after argparse's usage
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and expected in errors[0] and r.stderr.strip().endswith(errors[0]), r.stderr
