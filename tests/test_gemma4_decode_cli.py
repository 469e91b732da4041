"""The CLI on the Gemma4 pair (tests/fixtures/dspark_gemma4_tiny): `generate` with every verify
policy (the scheduler's SPS table from `profile-sps` on that target), `calibrate` on the generate
log, and `eval` of a tiny prompt file (the target copy gets a byte tokenizer padded to its vocab)."""

import json
import shutil
import warnings
from pathlib import Path

import pytest

from dspark_jax import cli

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
FIXTURE = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny"
TOKENIZER = Path(cli.__file__).parent / "assets" / "default_target" / "dspark_tokenizer.json"
MAX_NEW = 12


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma4_cli")
    prompts = [[2, 5, 9, 14, 3], list(range(20, 40)), [7, 8, 9, 10, 11, 12, 200, 45, 6, 7, 8, 9]]
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    rc = cli.main(["profile-sps", "--target", str(FIXTURE / "target"), "--out", str(d / "sps.json"),
                   "--max-batch", "8", "--batch-sizes", "1,4,8", "--cache-length", "32",
                   "--warmup", "1", "--iters", "1", "--repeats", "1", "--min-seconds", "0"])
    assert rc == 0
    return d


@pytest.mark.parametrize("verify", ["full", "threshold", "fixed:3", "scheduler"])
def test_generate_each_policy(work, verify, capsys):
    out = work / f"gen_{verify.replace(':', '')}.jsonl"
    rc = cli.main(["generate", "--target", str(FIXTURE / "target"), "--draft", str(FIXTURE / "draft"),
                   "--prompts", str(work / "prompts.jsonl"), "--out", str(out), "--verify", verify,
                   "--sps", str(work / "sps.json"), "--max-new-tokens", str(MAX_NEW),
                   "--batch-size", "2", "--stop-token-ids"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["output_ids"]) == MAX_NEW for r in rows)
    assert all(sum(r["acceptance_lengths"]) >= MAX_NEW for r in rows)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tau"] >= 1.0
    if verify == "fixed:3":
        assert all(p == 3 for r in rows for p in r["proposal_lengths"])
    if verify == "full":
        assert all(p == 7 for r in rows for p in r["proposal_lengths"])


def test_calibrate_on_generate_log(work):
    log = work / "gen_full.jsonl"
    if not log.exists():
        pytest.skip("needs test_generate_each_policy[full]")
    rc = cli.main(["calibrate", "--logs", str(log), "--out", str(work / "cal"),
                   "--draft", str(FIXTURE / "draft"), "--write-draft"])
    assert rc == 0
    sts = json.loads((work / "cal" / "sts.json").read_text())
    assert len(sts["temperatures"]) == 7
    assert (work / "cal" / "draft").is_dir()


def test_eval_tiny_prompt_file(work, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(FIXTURE / "target", target)
    tok = json.loads(TOKENIZER.read_text())  # 264 byte-tokenizer ids; the target emits up to 511
    tok["special_tokens"].update({f"<|extra{i}|>": i for i in range(tok["vocab_size"], 512)})
    tok["vocab_size"] = 512
    (target / "dspark_tokenizer.json").write_text(json.dumps(tok))
    data = tmp_path / "data"
    data.mkdir()
    (data / "tiny.jsonl").write_text('{"turns": ["hello there"]}\n{"turns": ["abc def ghi jkl mno"]}\n')
    rc = cli.main(["eval", "--target", str(target), "--draft", str(FIXTURE / "draft"),
                   "--datasets", "tiny", "--data-dir", str(data), "--raw-prompt",
                   "--max-new-tokens", "8", "--no-progress", "--out", str(tmp_path / "ev")])
    assert rc == 0
    assert len((tmp_path / "ev" / "results" / "tiny.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "ev" / "eval.json").exists()
