"""The README's command blocks as a test, and what a new user meets first (fast --help, messages).

``test_readme_commands`` parses every ```bash block of README.md (continuation lines joined,
comments dropped), runs each command in order in a fresh directory laid out like a clone
(tests/fixtures, configs, dspark_jax/assets), in-process through the console entry points, and
checks that they write under runs/ only. The long commands get their smallest settings
(``SMALLEST``: appended flags or overrides, argparse's last value wins); two are skipped
with the test that covers them (``SKIPPED``). A README command that breaks fails this test.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from dspark_jax import cli
from dspark_jax.data import sample as sample_mod

REPO = Path(__file__).resolve().parents[1]
SMALL_TRAIN = ["steps=2", "batch_size=4", "progress=False", "checkpoint.every=1", "mesh=data=1",
               "num_devices=1"]
# command prefix -> arguments appended (the smallest settings that still run every stage)
SMALLEST = {
    # the demo: its report stage, on a copy of the session's quick demo (conftest: quick_demo_run;
    # tests/test_demo.py runs every stage of it)
    ("demo",): ["--quick", "--out", "runs/demo", "--stage", "report", "--force", "--no-progress"],
    ("train",): SMALL_TRAIN,
    ("cache",): ["--quiet"],
    ("generate",): ["--max-new-tokens", "8"],
    ("eval",): ["--max-samples", "2", "--max-new-tokens", "8", "--no-progress"],
    ("data", "regenerate"): ["--max-new-tokens", "4", "--no-progress"],
    ("profile-sps",): ["--batch-sizes", "1,2", "--warmup", "0", "--iters", "1", "--min-seconds", "0",
                       "--repeats", "1", "--cache-length", "16"],
    ("dspark_jax.data.sample",): ["--num", "16", "--length", "32"],
}
SKIPPED = {  # command prefix -> the test that runs it instead
    ("plan",): "tests/test_plan.py (full-size compiles take minutes)",
    ("launch/local.py",): "tests/test_train_parallel.py (several processes)",
}
SETUP = ("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest")
SECTIONS_SKIPPED = ("Serving your drafter",)  # serving engines are not installed here


def readme_commands(text: str) -> list[tuple[str, str]]:
    """(section, command) of every ```bash block, in order: continuations joined, comments and
    the setup steps (venv, pip, pytest) dropped, `a && b` split."""
    out, section, block = [], "", None
    for line in text.splitlines():
        if block is None and line.startswith("#"):
            section = line.lstrip("# ").strip()
        elif block is None and line == "```bash":
            block = []
        elif block is not None and line.startswith("```"):
            if section not in SECTIONS_SKIPPED:
                for cmd in "\n".join(block).replace("\\\n", " ").splitlines():
                    cmd = cmd.strip()
                    if not cmd or cmd.startswith("#"):
                        continue
                    parts = [cmd] if cmd.startswith("mkdir") else cmd.split(" && ")
                    out += [(section, c.strip()) for c in parts if not c.strip().startswith(SETUP)]
            block = None
        elif block is not None:
            block.append(line)
    return out


def _run_one(command: str, capsys) -> str:
    """Run one README command in the current directory; returns what was done (for the log)."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words or words[0] not in ("dspark-jax", "python"):
        subprocess.run(command, shell=True, check=True, executable="/bin/bash")
        return "shell"
    if "XLA_FLAGS" in env:  # this process has 8 simulated devices (conftest): enough for the command
        need = int(re.search(r"device_count=(\d+)", env["XLA_FLAGS"]).group(1))
        assert need <= len(jax.devices()), command
    argv = words[1:]
    if words[0] == "python":
        assert argv[:2] == ["-m", "dspark_jax.data.sample"] or argv[0] == "launch/local.py", command
        argv = argv[1:] if argv[0] == "-m" else argv
    for prefix, why in SKIPPED.items():
        if tuple(argv[:len(prefix)]) == prefix:
            return f"skipped: {why}"
    for prefix, extra in SMALLEST.items():
        if tuple(argv[:len(prefix)]) == prefix:
            argv = argv + extra
    if argv[0] == "dspark_jax.data.sample":
        code = sample_mod.main(argv[1:])
    else:
        code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, (command, err[-3000:])
    assert "Traceback" not in err, (command, err[-3000:])
    return "ran"


@pytest.mark.slow
def test_readme_commands(tmp_path, monkeypatch, capsys, quick_demo_run):
    """Every README command runs as written (smallest settings for the long ones) on a directory
    laid out like a fresh clone, and writes under runs/ only."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(REPO / "tests" / "fixtures")
    (tmp_path / "dspark_jax").mkdir()
    (tmp_path / "dspark_jax" / "assets").symlink_to(REPO / "dspark_jax" / "assets")
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSPARK_FAST_COMPILE", "1")
    before = sorted(p.name for p in tmp_path.iterdir())
    shutil.copytree(quick_demo_run[0].out, tmp_path / "runs" / "demo")
    commands = readme_commands((REPO / "README.md").read_text())
    assert len(commands) >= 30, commands
    ran = 0
    for section, command in commands:
        t0 = time.time()
        what = _run_one(command, capsys)
        ran += what == "ran"
        with capsys.disabled():
            print(f"\n{time.time() - t0:6.1f}s  [{section}] {what}: {command[:90]}")
    assert ran >= 25
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["runs"]), "wrote outside runs/"
    assert len(Path("runs/out.jsonl").read_text().splitlines()) == 8
    for path in ("runs/tiny_from_cache/summary.json", "runs/tiny_gemma4_from_cache/summary.json",
                 "runs/sts/sts.json", "runs/demo/report.json", "runs/eval/eval.json",
                 "runs/eval_code/eval.json", "runs/regen.jsonl", "runs/sched.jsonl", "runs/out_mesh.jsonl"):
        assert Path(path).is_file(), path
    assert json.loads(Path("runs/tiny_from_cache/summary.json").read_text())["final"]["step"] == 2


HEAVY = ("jax", "jaxlib", "chex", "flax", "optax", "orbax", "torch", "transformers", "matplotlib")
PARSE_ONLY = """
import contextlib, io, json, sys
from dspark_jax import cli
parser = cli.build_parser()
codes = {}
for argv in ARGVS:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            codes[" ".join(argv)] = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_help_and_argument_errors_import_no_jax():
    """`dspark-jax COMMAND --help` and argparse errors answer before jax (4+ s of imports) is loaded:
    importing the CLI and parsing every subcommand's --help (and a bad flag) imports none of HEAVY.
    A fresh interpreter: this test process has jax loaded already (conftest)."""
    parser = cli.build_parser()
    commands = [[name] for name in parser._subparsers._group_actions[0].choices]
    commands += [["data", "inspect"], ["data", "regenerate"]]
    argvs = [c + ["--help"] for c in commands] + [["generate", "--no-such-flag"], ["--help"]]
    code = f"ARGVS = {argvs!r}\nHEAVY = {HEAVY!r}\n" + PARSE_ONLY
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"parsing imported {result['heavy']}"
    assert len(result["codes"]) == len(argvs)
    assert all(c == 0 for a, c in result["codes"].items() if a.endswith("--help")), result["codes"]
    assert result["codes"]["generate --no-such-flag"] == 2


TINY = REPO / "tests/fixtures/dspark_qwen3_tiny"


def _pickle_target(tmp_path):
    d = tmp_path / "pickled"
    shutil.copytree(TINY / "target", d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "pytorch_model.bin").write_bytes(b"not read")
    return ["--target", str(d)]


# (argv after the command's fixed part, words the one-line message must hold)
MESSAGES = {
    "threshold range": (["--verify", "threshold", "--confidence-threshold", "2"],
                        ["--confidence-threshold must be in [0, 1]", "got 2.0"]),
    "threshold spec": (["--verify", "threshold:x"], ["--verify threshold:x", "[0, 1]", "threshold:0.5"]),
    "draft is a file": (["--draft", str(TINY / "draft/config.json")], ["is a file", "pass its directory"]),
    "too few devices": (["--mesh", "data=16"], ["needs 16 devices but 8",
                                               "XLA_FLAGS=--xla_force_host_platform_device_count=16",
                                               "launch/local.py"]),
    "batch vs data axis": (["--mesh", "data=2,tensor=2"],
                           ["--batch-size 1 is not a multiple", "pass e.g. --batch-size 2"]),
    "pickle": (_pickle_target, ["pickles", "dspark-jax convert", "--allow-pickle", "and use OUT"]),
}


@pytest.mark.parametrize("case", list(MESSAGES))
def test_messages_name_the_flag_range_and_fix(case, tmp_path, capsys):
    """A newcomer's first mistakes get one line naming the flag, its range and the fix."""
    extra, words = MESSAGES[case]
    extra = extra(tmp_path) if callable(extra) else extra
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    argv = ["generate", "--target", str(TINY / "target"), "--draft", str(TINY / "draft"),
            "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")]
    assert cli.main(argv + extra) == 2
    err = capsys.readouterr().err
    # one line, on a clean line of its own (after any progress bar the error closed)
    line = err.rstrip("\n").rpartition("\n")[2]
    assert line.startswith("dspark-jax generate: error: ") and "Traceback" not in err, err
    err = line
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "o.jsonl").exists()


def test_small_parsing_and_prefix_fixes(tmp_path, capsys):
    """--layer-ids -1,2 is a value; data regenerate's errors carry its name; an error closes an
    open progress bar first, so the message starts on a clean line."""
    from tqdm import tqdm

    args = cli.build_parser().parse_args(["cache", "--layer-ids", "-1,2"])
    assert args.layer_ids == [-1, 2]
    assert cli.main(["data", "regenerate", "--target", str(tmp_path / "nope"), "--data", "x.jsonl",
                     "--out", str(tmp_path / "r.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("dspark-jax data regenerate: error: --target")
    bar = tqdm(total=3, desc="half done")
    bar.update(1)
    cli._end_progress_bars()
    print("dspark-jax x: error: y", file=sys.stderr)
    err = capsys.readouterr().err
    assert "half done" in err and "\ndspark-jax x: error: y\n" in err
