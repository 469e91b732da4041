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


@pytest.mark.slow  # each a subprocess that imports jax and compiles its programs (10-60 s)
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_smoke(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    # one CPU device, as a user runs them (the session's quicker-compile flags kept: conftest)
    env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.rglob("*.json")), f"{script.name} wrote no JSON under --out"


def test_engine_stream_from_text_prompts(tmp_path):
    """benchmarks/engine.py --texts: prompts tokenized raw by the target's tokenizer, cut to their
    last --max-prompt-tokens tokens; stops = the tokenizer's eos unless --stop-ids."""
    import argparse
    import importlib.util
    import json

    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.embedded.default import PACKAGED_DIR
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    spec = importlib.util.spec_from_file_location("engine_bench", ROOT / "benchmarks/engine.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    texts = tmp_path / "p.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("def f(x):\n", "import os\n" * 30)))
    tc, _ = load_target(PACKAGED_DIR)
    tok = load_tokenizer(PACKAGED_DIR)
    args = argparse.Namespace(texts=str(texts), target=str(PACKAGED_DIR), max_prompt_tokens=16,
                              stop_ids=None, prompts=None)
    base, stops = bench.base_prompts(args, tc)
    assert base[0] == encode_prompt(tok, "def f(x):\n", raw=True)
    assert base[1] == encode_prompt(tok, "import os\n" * 30, raw=True)[-16:]
    assert stops == [tok.eos_token_id]
    args.stop_ids = "10,35"
    assert bench.base_prompts(args, tc)[1] == [10, 35]
    prompts, budgets = bench.make_stream(base, 20, tc.vocab_size, 8, 0, random_share=0.0)
    assert all(any(p == b[:len(p)] for b in base) for p in prompts) and max(budgets) <= 8
