"""The demo pipeline end to end in its quick mode (one shared run), resume/refusal, stage errors."""

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.pipelines.demo import (DRAFTERS, MODES, DemoConfig, quick_config, run_demo, stage_done,
                             train_prompt_texts)
from dspark_jax.errors import ConfigError, InputError


@pytest.fixture(scope="module")
def quick_demo(quick_demo_run):
    return quick_demo_run  # conftest: one run per session, the README test reuses it


def test_quick_demo_outputs(quick_demo):
    cfg, info, logs = quick_demo
    out = Path(cfg.out)
    assert set(info) >= {"sample", "train", "decode", "report"}
    report = json.loads((out / "report.json").read_text())
    table = report["table"]
    assert list(table) == list(MODES)
    ar = table["autoregressive"]
    assert ar["tau"] == 1.0 and ar["mean_proposal"] == 0.0 and ar["speedup"] == pytest.approx(1.0)
    g = cfg.block_size
    for m in DRAFTERS:
        row = table[m]
        assert 1.0 <= row["tau"] <= g + 1
        assert row["mean_proposal"] == g  # the full policy verifies every draft token
        assert 0 < row["verify_rate"] <= 1
        assert row["verify_rate"] == pytest.approx(row["tau"] / (g + 1))
        assert len(row["accept_rate"]) == g
        rates = [r for r in row["accept_rate"] if r is not None]
        assert all(0 <= r <= 1 for r in rates)
        assert all(a >= b - 1e-12 for a, b in zip(rates, rates[1:]))  # prefix survival is monotone
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0
        # lossless: the same output lengths as the target alone (exactly so when greedy)
        assert report["table_greedy"][m]["output_tokens"] == report["table_greedy"]["autoregressive"]["output_tokens"]
        # both drafters have a confidence head: calibration metrics per position
        cal = report["details"][m]["calibration"]["per_position"]
        assert [p["position"] for p in cal] == list(range(1, g + 1))
    # greedy speculative decoding is lossless: identical outputs to the target alone
    assert report["outputs_equal_to_autoregressive"] == {"dspark": 1.0, "dflash": 1.0}
    assert report["outputs_equal_to_autoregressive_table"] == "greedy"
    text = (out / "table.txt").read_text()
    for m in MODES:
        assert m in text
    assert "speedup" in text and any("speedup" in line for line in logs)
    for name in ("acceptance.png", "reliability_dspark.png", "reliability_dflash.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    # the same budget for both drafters; DFlash has no Markov head
    runs = {m: json.loads((out / "train" / m / "run.json").read_text()) for m in DRAFTERS}
    assert runs["dflash"]["draft"]["markov_rank"] == 0 and runs["dspark"]["draft"]["markov_rank"] == cfg.markov_rank
    same = ("steps", "batch_size", "optimizer", "seed", "data", "max_length")
    assert all(runs["dspark"]["train"][k] == runs["dflash"]["train"][k] for k in same)
    assert "dspark-jax train --config" in report["commands"]["train_dspark"]
    assert "dspark-jax eval" in report["commands"]["eval_dspark"]


def test_training_data_is_target_continuations_of_train_split(quick_demo):
    cfg, _, _ = quick_demo
    out = Path(cfg.out)
    rows = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == len(prompts) == cfg.num_train_prompts
    for row, p in zip(rows, prompts):
        n_prompt = 1 + len(p["text"].encode())  # <|bos|> + bytes
        assert row["input_ids"][1:n_prompt] == list(p["text"].encode())
        assert row["loss_mask"] == [0] * n_prompt + [1] * cfg.continuation_tokens
    from dspark_jax.data.eval_datasets import load_dataset
    from dspark_jax.embedded import corpus, pretrain
    _, heldout = corpus.split_files(corpus.stdlib_files(), pretrain.PretrainConfig().heldout_fraction)
    used = {p["source"].rsplit(":", 1)[0] for p in prompts}
    assert used and not used & set(heldout)
    # the decoded prompts are the held-out ones
    held = load_dataset("stdlib-heldout")
    lines = (Path(__file__).resolve().parents[1] / "dspark_jax/assets/eval_datasets/stdlib-heldout.jsonl")
    held_files = {json.loads(x)["source"].rsplit(":", 1)[0] for x in lines.read_text().splitlines()}
    assert held_files <= set(heldout) and len(held) >= cfg.num_eval_prompts


def test_train_prompts_never_use_heldout_files():
    from dspark_jax.embedded import corpus, pretrain
    _, heldout = corpus.split_files(corpus.stdlib_files(), pretrain.PretrainConfig().heldout_fraction)
    texts = train_prompt_texts(40, min_bytes=16, max_bytes=64, seed=3)
    assert len(texts) == 40
    assert all(16 <= len(t["text"].encode()) <= 64 for t in texts)
    assert not {t["source"].rsplit(":", 1)[0] for t in texts} & set(heldout)
    assert texts == train_prompt_texts(40, min_bytes=16, max_bytes=64, seed=3)


def test_finished_demo_is_refused_and_stages_resume(quick_demo, capsys):
    cfg, _, _ = quick_demo
    with pytest.raises(InputError, match="finished demo"):
        run_demo(cfg, progress=False, log=lambda s: None)
    with pytest.raises(InputError, match="different configuration"):
        run_demo(cfg.replace(steps=cfg.steps + 1), stage="report", progress=False, log=lambda s: None)
    assert cli.main(["demo", "--quick", "--out", cfg.out, "--no-progress"]) == 2
    assert "finished demo" in capsys.readouterr().err
    # one stage alone: the report is rebuilt from the decode outputs (no compilation)
    before = json.loads((Path(cfg.out) / "report.json").read_text())
    logs = []
    info = run_demo(cfg, stage="report", force=True, progress=False, log=logs.append)
    after = info["report"]
    assert after["table"]["dspark"]["tau"] == before["table"]["dspark"]["tau"]
    # finished stages are skipped when asked again without --force
    info = run_demo(cfg, stage="train", progress=False, log=logs.append)
    assert "train" not in info and any("done already" in s for s in logs)
    # resuming with other target weights is refused
    demo_json = Path(cfg.out) / "demo.json"
    saved = demo_json.read_text()
    demo_json.write_text(json.dumps(dict(json.loads(saved), target_sha256="0" * 64)))
    try:
        with pytest.raises(InputError, match="different target weights"):
            run_demo(cfg, stage="report", progress=False, log=logs.append)
    finally:
        demo_json.write_text(saved)


def test_stage_needs_its_inputs(tmp_path):
    cfg = quick_config(str(tmp_path / "fresh"))
    with pytest.raises(InputError, match="--stage sample"):
        run_demo(cfg, stage="train", progress=False, log=lambda s: None)
    with pytest.raises(InputError, match="--stage train"):
        run_demo(cfg, stage="decode", progress=False, log=lambda s: None)
    assert not stage_done(cfg, "sample")
    with pytest.raises(InputError, match="unknown demo stage"):
        run_demo(cfg, stage="bogus", progress=False)
    other = tmp_path / "not_a_demo"
    other.mkdir()
    (other / "x.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a demo directory"):
        run_demo(quick_config(str(other)), progress=False)
    assert (other / "x.txt").read_text() == "keep me"


def test_config_validation():
    with pytest.raises(ConfigError, match="max_length"):
        DemoConfig(max_length=64)
    with pytest.raises(ConfigError, match="markov_rank"):
        DemoConfig(markov_rank=0)
    with pytest.raises(ConfigError, match="steps"):
        DemoConfig(steps=0)
    assert np.isclose(DemoConfig().temperature, 1.0)  # the paper's setting is the headline
    assert DemoConfig().greedy_table


def test_report_has_both_tables_degeneracy_and_samples(quick_demo):
    cfg, _, logs = quick_demo
    out = Path(cfg.out)
    report = json.loads((out / "report.json").read_text())
    assert report["temperature"] == 1.0 and cfg.temperature == 1.0
    for key in ("table", "table_greedy"):
        assert list(report[key]) == list(MODES)
        for m in MODES:  # the target's own row too: an inflated tau shows next to its outputs
            row = report[key][m]
            assert 0 <= row["degenerate_fraction"] <= 1 and 0 <= row["whitespace_fraction"] <= 1
            assert row["num_degenerate"] == round(row["degenerate_fraction"] * row["requests"])
    assert report["table_greedy"]["autoregressive"]["tau"] == 1.0
    assert (out / "decode" / "greedy" / "dspark.jsonl").is_file()
    assert report["dspark_tau_over_dflash_tau"] == pytest.approx(
        report["table"]["dspark"]["tau"] / report["table"]["dflash"]["tau"])
    text = (out / "table.txt").read_text()
    assert "temperature 1 (headline" in text and "temperature 0 (greedy" in text
    assert "degen" in text and " ws" in text and "distinct-4-gram" in text
    # three continuations, each round's accepted draft span marked
    from dspark_jax.pipelines.demo_report import SPAN_CLOSE, SPAN_OPEN
    samples = report["samples"]
    assert len(samples) == cfg.num_samples == 3
    for smp in samples:
        assert smp["prompt"] and smp["mode"] == "dspark"
        spans = sum(bool(r["accepted"]) for r in smp["rounds"])
        assert smp["marked"].count(SPAN_OPEN) == smp["marked"].count(SPAN_CLOSE) == spans
        assert 1 <= len(smp["rounds"]) <= len(smp["acceptance_lengths"])
        plain = smp["marked"].replace(SPAN_OPEN, "").replace(SPAN_CLOSE, "")
        assert plain == smp["text"]
        assert smp["marked"] in text and smp["marked"] in "\n".join(logs)


def test_round_spans_mark_accepted_drafts_and_bonus():
    from dspark_jax.decode import Result
    from dspark_jax.pipelines.demo_report import round_spans

    ids = list(b"abcdefgh")
    # prefill token 'a'; round 1 accepts 2 drafts 'bc' + bonus 'd'; round 2 none + bonus 'e';
    # round 3 accepts 'fgh' + bonus, cut at max_new_tokens (8)
    r = Result(ids, [3, 1, 4], [4, 4, 4], [2, 0, 3], None, 5, 0, 0.1)
    spans = round_spans(r, lambda t: bytes(t).decode())
    assert spans["first"] == "a"
    assert spans["rounds"] == [{"accepted": "bc", "bonus": "d"}, {"accepted": "", "bonus": "e"},
                               {"accepted": "fgh", "bonus": ""}]
    assert spans["marked"] == "a\u27e6bc\u27e7de\u27e6fgh\u27e7"
