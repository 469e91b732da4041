"""`dspark-jax bench`: the replay clock, the frontier / SLA reading, bad input, and a smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.decode.policies import FixedPolicy, FullPolicy
from dspark_jax.errors import InputError
from dspark_jax.pipelines import bench_project as P

FIXTURE = Path(__file__).parent / "fixtures" / "dspark_qwen3_tiny"


def _costs(rps_ar=100.0, round_rps=((50.0, 40.0),), widths=(2, 4), request=None, batch=(1,)):
    obj = {"batch_sizes": list(batch), "widths": list(widths), "rps": [list(r) for r in round_rps],
           "ar_rps": [rps_ar] * len(batch)}
    if request is not None:
        obj["request_seconds"] = obj["ar_request_seconds"] = [request] * len(batch)
    return P.costs_from_json(obj, "test table")


def _log(accepted, g, length):
    rec = {"output_ids": [0] * length, "confidence_logits": [[0.0] * g for _ in accepted],
           "accepted_drafts": list(accepted), "proposal_lengths": [g] * len(accepted)}
    return P.request_log(rec, g, "test")


def test_ar_replay_is_the_engine_clock():
    # 4 requests of 5 tokens through 2 slots: the first token comes from the prefill, then 4
    # steps per wave, 2 waves; a request pays 0.01 s on entry.
    costs = _costs(rps_ar=100.0, request=0.01, batch=(1, 2), round_rps=((50.0, 40.0),) * 2)
    s = P.project([5, 5, 5, 5], 2, costs)
    assert s.seconds == pytest.approx(2 * (2 * 0.01 + 4 / 100.0))
    row = P.served_row(s, speculative=False)
    assert row["throughput"] == pytest.approx(20 / s.seconds)
    assert row["per_user_tokens_per_second"] == pytest.approx(
        np.mean([5 / 0.05, 5 / 0.06, 5 / 0.05, 5 / 0.06]))
    assert row["tau"] == 1.0 and row["verification_budget"] == 1.0


def test_speculative_replay_charges_the_policy_width():
    # G = 3, every round accepts 2 drafts: full verification (width 4) emits 3 per round at
    # 40 rounds/s; fixed:1 (width 2) emits 2 per round at 50 rounds/s.
    log = _log([2] * 10, 3, 13)
    full = P.served_row(P.project([log], 1, _costs(), policy=FullPolicy(), block_size=3), True)
    assert full["tau"] == pytest.approx(3.0) and full["verification_budget"] == 4.0
    assert full["seconds"] == pytest.approx(4 / 40.0)  # 12 tokens after the prefill
    one = P.served_row(P.project([log], 1, _costs(), policy=FixedPolicy(1), block_size=3), True)
    assert one["tau"] == pytest.approx(2.0) and one["verification_budget"] == 2.0
    assert one["seconds"] == pytest.approx(6 / 50.0)


def test_logs_of_another_drafter_or_policy_are_refused():
    rec = {"output_ids": [1, 2], "confidence_logits": [[0.0] * 4], "accepted_drafts": [1],
           "proposal_lengths": [4]}
    with pytest.raises(InputError, match="another drafter"):
        P.request_log(rec, 7, "f:1")
    with pytest.raises(InputError, match="verify full"):
        P.request_log(dict(rec, proposal_lengths=[2]), 4, "f:1")


def test_frontier_and_sla_read_between_points():
    base = [dict(per_user_tokens_per_second=x, throughput=y) for x, y in ((100, 100), (50, 400))]
    fast = [dict(per_user_tokens_per_second=x, throughput=y) for x, y in ((200, 200), (100, 800))]
    front = P.frontier([(1, 1), (2, 0.5), (0.5, 0.5)])
    assert front.tolist() == [[1.0, 1.0], [2.0, 0.5]]   # (0.5, 0.5) is dominated
    rep = P.sla_report({"ar": base, "x": fast}, "ar", [100.0, 75.0])
    sla = rep["curves"]["x"]["sla"]
    assert sla[0]["throughput"] == pytest.approx(800) and sla[0]["gain"] == pytest.approx(7.0)
    assert sla[1]["throughput"] is None            # below x's slowest point: not extrapolated
    matched = {m["throughput"]: m for m in rep["curves"]["x"]["matched"]}
    assert matched[400.0]["per_user"] == pytest.approx(
        np.exp(np.interp(np.log(400), np.log([200, 800]), np.log([200, 100]))))


def _write(path: Path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def _run(argv, capsys):
    code = cli.main(["bench"] + argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("extra, needle", [
    (["--verify", "full,bogus"], "unknown verification policy"),
    (["--concurrency", "0,2"], "--concurrency"),
    (["--baseline", "nope"], "--baseline"),
])
def test_bad_flags_one_line_exit_2(extra, needle, capsys):
    code, err = _run(["--target", str(FIXTURE / "target"), "--draft", str(FIXTURE / "draft")]
                     + extra, capsys)
    assert code == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("argv, needle", [
    (["--rates", "h200:8"], "--rates charges a --round-table"),
    (["--round-table", "x.json"], "give --hardware"),
    (["--round-table", "x.json", "--rates", "h200:1", "--draft-steps", "0"], "--draft-steps"),
])
def test_plan_round_table_flags_one_line_exit_2(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["plan", "--target", "deepseek-ai/DeepSeek-V4-Flash", "--kind", "mtp", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_bad_round_tables_and_logs_one_line_exit_2(tmp_path, capsys):
    target, draft = str(FIXTURE / "target"), str(FIXTURE / "draft")
    good = {"batch_sizes": [1], "widths": [1, 2, 4, 8], "rps": [[4.0, 3.0, 2.0, 1.0]],
            "block_size": 7,
            "model": {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 512}}
    log = {"drafter": "x", "draft_fingerprint": "0123456789abcdef", "output_ids": [1],
           "confidence_logits": [[0.0] * 7], "accepted_drafts": [0], "proposal_lengths": [7]}
    logs = tmp_path / "logs.jsonl"
    logs.write_text(json.dumps(log) + "\n")
    cases = [
        (dict(good, model=dict(good["model"], hidden_size=4096)), "another target"),
        (dict(good, widths=[1, 2, 4]), "width set"),
        (good, "logs of another drafter"),
    ]
    for i, (table, needle) in enumerate(cases):
        code, err = _run(["--target", target, "--draft", draft, "--round-table",
                          _write(tmp_path / f"t{i}.json", table), "--logs", str(logs)], capsys)
        assert code == 2 and len(err) == 1 and needle in err[0], err


def test_acceptance_profile_projects_named_drafters(tmp_path, capsys):
    """--acceptance: rounds drawn from per-position conditional acceptance (tau near its
    expectation), curves named by the profile, its source on every row; a drafter without a
    confidence head gets no confidence-reading policy; a bad profile is one line, exit 2."""
    from dspark_jax.pipelines import bench_acceptance as A

    prof = {"source": "test numbers", "drafters": {
        "blk": {"conditional_acceptance": [0.9, 0.8, 0.5]},
        "one": {"conditional_acceptance": [0.7], "confidence_head": False}}}
    logs = A.synthetic_logs(A.read_profiles(_write(tmp_path / "p.json", prof))["blk"], 64, 400)
    drawn = np.mean([1 + a for lg in logs for a in lg.accepted])
    assert drawn == pytest.approx(1 + 0.9 + 0.72 + 0.36, abs=0.05)
    assert all(lg.length == 400 and lg.starts[-1] < 400 for lg in logs)
    tables = [_write(tmp_path / f"{n}.json", {"batch_sizes": [1, 4], "widths": w, "block_size": g,
                                               "rps": [[100.0] * len(w), [50.0] * len(w)],
                                               "ar_rps": [200.0, 150.0]})
              for n, w, g in (("blk", [1, 2, 4], 3), ("one", [1, 2], 1))]
    argv = ["--target", str(FIXTURE / "target"), "--draft", "blk", "--draft", "one",
            "--acceptance", str(tmp_path / "p.json"), "--verify", "full,scheduler",
            "--concurrency", "1,4", "--max-new-tokens", "32", "--baseline", "one/full"]
    code = cli.main(["bench", *argv, "--round-table", tables[0], "--round-table", tables[1],
                     "--out", str(tmp_path / "o")])
    assert code == 0 and "test numbers" in capsys.readouterr().out
    rows = json.loads((tmp_path / "o" / "bench.json").read_text())["rows"]
    assert {r["curve"] for r in rows} == {"ar", "blk/full", "blk/scheduler", "one/full"}
    for r in rows:
        assert r["source"] == "projected" and "round table" in r["cost_source"]
        if r["drafter"] != "ar":
            assert "test numbers" in r["acceptance_source"]
    one = [r for r in rows if r["curve"] == "one/full"]
    assert all(r["verification_budget"] == 2.0 and 1.5 < r["tau"] < 1.9 for r in one)
    prof["drafters"]["blk"]["conditional_acceptance"] = [0.9, 1.2]
    code, err = _run(["--target", str(FIXTURE / "target"), "--draft", "blk", "--acceptance",
                      _write(tmp_path / "bad.json", prof), "--round-table", tables[0]], capsys)
    assert code == 2 and len(err) == 1 and "conditional_acceptance" in err[0], err
    code, err = _run(["--target", str(FIXTURE / "target"), "--draft", "nope", "--acceptance",
                      str(tmp_path / "p.json"), "--round-table", tables[0]], capsys)
    assert code == 2 and len(err) == 1 and "profile" in err[0], err


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One measured bench of the tiny pair: AR and full verification at C = 1, 2."""
    from dspark_jax.pipelines.bench import bench

    tmp = tmp_path_factory.mktemp("bench")
    prompts = json.loads((FIXTURE / "decode_greedy.json").read_text())["prompts"][:4]
    (tmp / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    lines = []
    report = bench(FIXTURE / "target", [f"tiny={FIXTURE / 'draft'}"], prompts=tmp / "p.jsonl",
                   verify="full", concurrency="1,2", max_new_tokens=8, min_requests=4,
                   requests_per_slot=2, quick=True, out=tmp / "out", printer=lines.append)
    return tmp, report, lines


@pytest.mark.slow
def test_smoke_measured_and_projected(smoke, capsys):
    tmp, report, lines = smoke
    rows = report["rows"]
    keys = {(r["curve"], r["source"], r["concurrency"]) for r in rows}
    assert keys == {(c, s, n) for c in ("ar", "tiny/full") for s in ("measured", "projected")
                    for n in (1, 2)}
    for r in rows:
        assert r["throughput"] > 0 and r["per_user_tokens_per_second"] > 0
        assert r["drafter"] in ("ar", "tiny") and r["verify"] in (None, "full")
        if r["source"] == "measured":
            assert r["timed_compiles"] == 0
        else:
            assert "round table" in r["cost_source"] and r["acceptance_source"]
    spec = [r for r in rows if r["curve"] == "tiny/full"]
    assert all(r["verification_budget"] == 8.0 and 1.0 <= r["tau"] <= 8.0 for r in spec)
    out = tmp / "out"
    for name in ("bench.json", "table.txt", "frontier.png", "budget.png",
                 "round_tables/tiny.json", "logs/tiny.jsonl"):
        assert (out / name).is_file(), name
    assert len(report["agreement"]) == 4
    # Projected mode from the files the measured run wrote: no model runs, same replay.
    code = cli.main(["bench", "--target", str(FIXTURE / "target"),
                     "--draft", f"tiny={FIXTURE / 'draft'}",
                     "--round-table", str(out / "round_tables/tiny.json"),
                     "--logs", str(out / "logs/tiny.jsonl"), "--concurrency", "1,2",
                     "--min-requests", "4",
                     "--compare", str(out / "bench.json"), "--out", str(tmp / "proj")])
    assert code == 0
    proj = json.loads((tmp / "proj" / "bench.json").read_text())
    assert proj["mode"] == "projected" and len(proj["agreement"]) == 4
    again = {(r["curve"], r["concurrency"]): r["throughput"] for r in proj["rows"]
             if r["source"] == "projected"}
    first = {(r["curve"], r["concurrency"]): r["throughput"] for r in rows
             if r["source"] == "projected"}
    assert again == pytest.approx(first)
    # A second run into the same --out is refused without --force.
    code = cli.main(["bench", "--target", str(FIXTURE / "target"), "--round-table",
                     str(out / "round_tables/ar.json"), "--out", str(tmp / "proj")])
    assert code == 2 and "already holds a bench" in capsys.readouterr().err


@pytest.mark.slow
def test_round_table_compiled_for_a_chip_feeds_the_projection():
    """plan --round-table's table (tiny pair, one CPU device, H200's roofline numbers): one AR
    step and one round per width, rounds/s = 1 / max(bytes / bandwidth, flops / peak); wider
    rounds never cost less, and the projection reads it."""
    import jax
    import jax.numpy as jnp

    from dspark_jax import sharding
    from dspark_jax.convert.checkpoint import load_draft, load_target
    from dspark_jax.costs import hardware
    from dspark_jax.pipelines.plan_rounds import compiled_round_table

    tc, _ = load_target(FIXTURE / "target")
    dc, _ = load_draft(FIXTURE / "draft")
    dc = dc.replace(block_size=3)  # widths 1, 2, 4: three round programs
    mesh = sharding.make_mesh("data=1", jax.devices()[:1])
    hw = hardware.parse("h200:1")
    table = compiled_round_table(dc, tc, mesh, hw, [2], max_len=64, dtype=jnp.float32,
                                 cpu_compiled=True, log=lambda s: None)
    assert table["widths"] == [1, 2, 4] and table["block_size"] == 3
    assert "XLA:CPU" in table["source"] and table["device"].startswith("h200 rates")
    rps = table["rps"][0]
    assert all(a >= b for a, b in zip(rps, rps[1:])) and table["ar_rps"][0] > rps[-1]
    progs = table["programs"]
    assert [p["width"] for p in progs] == [None, 1, 2, 4]
    for p, r in zip(progs[1:], rps):
        want = max(p["step_bytes"] / hw.chip.bandwidth, p["step_flops"] / hw.chip.peak_flops)
        assert 1.0 / r == pytest.approx(want)
    costs = P.costs_from_json(table, "compiled")
    served = P.project([_log([3] * 2, 3, 9)], 2, costs, policy=FullPolicy(), block_size=3)
    assert served.seconds == pytest.approx(2 / rps[-1])


def test_analytic_costs_count_weights_touched_experts_and_cache():
    """costs.analytic: dense weights read once and 2 x params x tokens FLOPs; a vocab table reads
    its tokens' rows; routed experts split over the expert axis, read where tokens route
    (1 - (1 - k/E)^T); a V4-Flash round costs more than its AR step and grows with B."""
    from dspark_jax import presets
    from dspark_jax.costs import analytic
    from dspark_jax.params import ParamSpec

    specs = {("w",): ParamSpec((8, 4), ("embed", "mlp"), "w"),
             ("emb",): ParamSpec((100, 8), ("vocab", "embed"), "emb"),
             ("ex",): ParamSpec((4, 8, 8), ("expert", "embed", "mlp"), "ex")}
    flops, nbytes = analytic.weights_cost(specs, 3, experts=4, top_k=2, expert_shards=2)
    touched = 1 - 0.5 ** 3
    assert nbytes == pytest.approx(2 * (32 + 3 * 8 + 256 / 2 * touched))
    assert flops == pytest.approx(2 * 32 * 3 + 2 * 64 * 2 * 3 / 2)
    assert analytic.resident_bytes(specs, 2) == pytest.approx(2 * (32 + 800 + 128))
    tc = presets.resolve_target(presets.V4_FLASH)
    mtp = presets.v4_mtp_drafter(presets.V4_FLASH)
    cost = {(b, d is None): analytic.program_cost(tc, d, batch=b, width=1 if d is None else 2,
                                                  max_len=256, expert_shards=8)
            for b in (1, 64) for d in (None, mtp)}
    for b in (1, 64):
        assert cost[(b, False)]["step_bytes"] > cost[(b, True)]["step_bytes"]
    assert cost[(64, True)]["step_bytes"] > 2 * cost[(1, True)]["step_bytes"]
    assert cost[(64, True)]["cache_bytes"] == pytest.approx(64 * cost[(1, True)]["cache_bytes"])
