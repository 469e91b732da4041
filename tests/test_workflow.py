"""The README's Workflow commands, in order, on a fresh directory with small sizes.

Each command is the README's (same flags, same relative paths) plus size overrides; they run
in-process through the console entry points. The multi-process launcher example is covered by
tests/test_train_parallel.py and `plan` by tests/test_plan.py (full-size compiles are minutes).
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_jax import cli
from dspark_jax.data import sample as sample_mod

REPO = Path(__file__).resolve().parents[1]
SMALL = ["steps=2", "batch_size=4", "progress=False", "checkpoint.every=1", "mesh=data=1", "num_devices=1"]


@pytest.mark.slow
def test_readme_workflow(tmp_path, monkeypatch, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(REPO / "tests" / "fixtures")
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "tiny.py", tmp_path / "configs" / "tiny.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSPARK_FAST_COMPILE", "1")
    tiny = "tests/fixtures/dspark_qwen3_tiny"

    def run(*argv):
        t0 = time.time()
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        with capsys.disabled():
            print(f"\n{time.time() - t0:6.1f}s  dspark-jax {' '.join(argv[:3])}")
        assert code == 0, (argv, err[-3000:])
        assert "Traceback" not in err
        return out, err

    # 1. convert, both ways
    run("convert", f"{tiny}/draft", "runs/draft_jax")
    run("convert", "runs/draft_jax", "runs/draft_torch", "--to", "torch", "--max-shard-size", "2GB")
    # 2. generate
    Path("prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": [1, 2, 3, i]}) + "\n" for i in range(4, 8)))
    run("generate", "--target", f"{tiny}/target", "--draft", f"{tiny}/draft", "--prompts", "prompts.jsonl",
        "--out", "out.jsonl", "--max-new-tokens", "24", "--temperature", "0", "--batch-size", "8",
        "--verify", "threshold", "--confidence-threshold", "0.5")
    assert len(Path("out.jsonl").read_text().splitlines()) == 4
    # 3. train: data, online, cache, train from the cache
    assert sample_mod.main(["--target", f"{tiny}/target", "--out", "runs/tiny_data.jsonl",
                            "--num", "16", "--length", "32"]) == 0
    out, _ = run("train", "--config", "configs/tiny.py", *SMALL)
    assert json.loads(out)["final"]["step"] == 2
    _, err = run("train", "--config", "configs/tiny.py", *SMALL)  # rerun: finished, nothing changes
    assert "finished" in err
    run("cache", "--config", "configs/tiny.py", "--out", "runs/tiny_cache", "--quiet")
    out, _ = run("train", "--config", "configs/tiny.py", "features=cache", "cache_dir=runs/tiny_cache",
                 "output_dir=runs/tiny_from_cache", *SMALL)
    assert json.loads(out)["final"]["step"] == 2
    for name in ("run.json", "metrics.jsonl", "summary.json", "export/config.json"):
        assert (tmp_path / "runs/tiny_from_cache" / name).is_file(), name
    # 4. calibrate the decode logs, profile SPS, schedule
    run("calibrate", "--logs", "out.jsonl", "--out", "runs/sts", "--draft", f"{tiny}/draft", "--write-draft",
        "--holdout", "0.5")
    assert (tmp_path / "runs/sts/sts.json").is_file()
    run("profile-sps", "--target", f"{tiny}/target", "--out", "sps.json", "--batch-sizes", "1,2,4,8",
        "--warmup", "1", "--iters", "1", "--min-seconds", "0", "--repeats", "1", "--cache-length", "16")
    run("generate", "--target", f"{tiny}/target", "--draft", "runs/sts/draft", "--prompts", "prompts.jsonl",
        "--out", "sched.jsonl", "--max-new-tokens", "8", "--verify", "scheduler", "--sps", "sps.json")
    assert len(Path("sched.jsonl").read_text().splitlines()) == 4


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
    env = {k: v for k, v in __import__("os").environ.items()}
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
