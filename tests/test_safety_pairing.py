"""A drafter and a target that do not pair are refused before any weight is read or program
compiled (issue 36), at every entry point that pairs them: one line naming both and their families."""

import json
from pathlib import Path

import pytest

from dspark_jax import cli

F = Path(__file__).resolve().parents[1] / "tests/fixtures"
QWEN, QWEN_DRAFT = str(F / "dspark_qwen3_tiny/target"), str(F / "dspark_qwen3_tiny/draft")
GEMMA_DRAFT, V4_DSPARK = str(F / "dspark_gemma4_tiny/draft"), str(F / "deepseek_v4_tiny/target_dspark")


def _train(d, draft):
    (d / "data.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [1] * 4}) + "\n")
    cfg = dict(target=QWEN, data=str(d / "data.jsonl"), output_dir=str(d / "run"), max_length=16, batch_size=1,
               steps=1, progress=False, num_devices=1, mesh="data=1", draft_init=draft)
    (d / "cfg.py").write_text(f"CONFIG = {cfg!r}\n")
    return ["train", "--config", str(d / "cfg.py")]


def _logs(d):
    (d / "logs.jsonl").write_text(json.dumps({"confidence_logits": [[0.1, 0.2]], "accepted_drafts": [1],
                                              "proposal_lengths": [2]}) + "\n")
    return str(d / "logs.jsonl")


ENTRY = {
    "generate": lambda d, x: ["generate", "--target", QWEN, "--draft", x, "--prompts", str(d / "p.jsonl"),
                              "--out", str(d / "o.jsonl")],
    "eval": lambda d, x: ["eval", "--target", QWEN, "--draft", x, "--out", str(d / "e")],
    "train-draft-init": _train,
    "profile-sps": lambda d, x: ["profile-sps", "--target", QWEN, "--draft", x, "--out", str(d / "s.json")],
    "calibrate": lambda d, x: ["calibrate", "--logs", _logs(d), "--out", str(d / "c"), "--target", QWEN,
                               "--draft", x, "--write-draft"],
    "export": lambda d, x: ["export", x, str(d / "x"), "--engine", "vllm", "--target", QWEN],
}


@pytest.mark.parametrize("draft,family", [(V4_DSPARK, "deepseek_v4_dspark"), (GEMMA_DRAFT, "gemma4_dspark")],
                         ids=["v4-module", "gemma4-drafter"])
@pytest.mark.parametrize("entry", list(ENTRY))
def test_mismatched_pair_refused_naming_both(entry, draft, family, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main(ENTRY[entry](tmp_path, draft)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert draft in err[0] and QWEN in err[0] and family in err[0] and "qwen3" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("logs.jsonl", "data.jsonl", "cfg.py")) == before


def test_a_target_given_as_the_drafter_is_named(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    assert cli.main(ENTRY["generate"](tmp_path, QWEN)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a drafter for --target" in err[0], err
