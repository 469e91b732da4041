"""``dspark-jax bench``: the throughput vs per-user-speed frontier, measured and projected.

Curves: ``ar`` (the target alone) and every (drafter, verification policy). Measured mode serves
a request stream per (curve, concurrency C) through the continuous engine (greedy; C slots;
max(requests-per-slot x C, min-requests) requests cycling through the prompts, all queued at
t = 0), after a warm-up that compiles every shape (the timed runs' compile counts are reported).
It also measures the costs projected mode reads (``bench_measure.profile_costs``: the round
table, AR steps/s and per-request host seconds at each C) and logs every drafter's rounds under
full verification, then projects the same curves from them: the side-by-side is the check of
the projection. Projected mode (``round_tables`` + ``logs``) runs nothing but the replay
(``bench_project``) and labels every number with its cost and acceptance sources.

Outputs under ``out``: bench.json (rows, SLA report, agreement, sources), table.txt,
frontier.png (Fig. 7), budget.png (Fig. 8), round_tables/<drafter>.json and logs/<drafter>.jsonl
(measured mode: reusable by a later projected run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from dspark_jax.errors import DSparkError, InputError
from dspark_jax.fileio import check_not_input, dumps, iter_jsonl, write_json, write_text
from dspark_jax.pipelines import bench_inputs as I
from dspark_jax.pipelines import bench_project as P
from dspark_jax.pipelines import bench_report as R

RESULT_FILE = "bench.json"
TOLERANCE = 0.15  # the projection's target agreement with a measurement (throughput)


def read_logs(path, drafter: I.Drafter, block_size: int) -> list[P.RequestLog]:
    """RequestLogs of ``drafter`` from a bench log or generate / eval results (JSONL); a line
    naming another drafter (its ``draft_fingerprint``) is refused."""
    out = []
    for where, rec in iter_jsonl(path, "--logs"):
        if not isinstance(rec, dict):
            raise InputError(f"{where}: expected a JSON object")
        fp = rec.get("draft_fingerprint")
        if fp is not None and fp != drafter.fingerprint:
            raise InputError(f"{where}: logs of another drafter ({rec.get('drafter', fp)!r}, "
                             f"fingerprint {fp}; {drafter.name!r} is {drafter.fingerprint})")
        out.append(P.request_log(rec, block_size, where))
    if not out:
        raise InputError(f"--logs {str(path)!r}: no rounds")
    return out


def measured_rows(path, curves, concurrencies) -> list[dict]:
    """The measured rows of a bench.json (``--compare``) for ``curves`` x ``concurrencies``."""
    obj = I.read_json(path, "--compare")
    rows = obj.get("rows")
    if not isinstance(rows, list):
        raise InputError(f"--compare {str(path)!r}: not a bench.json (no 'rows')")
    out = [r for r in rows if isinstance(r, dict) and r.get("source") == "measured"
           and r.get("curve") in curves and r.get("concurrency") in concurrencies]
    if not out:
        raise InputError(f"--compare {str(path)!r}: no measured row for these curves and "
                         "concurrencies")
    return out


def _project_curves(curves, requests, logs, costs_of, concurrencies, per_slot, minimum,
                    acceptance_of, ar_lengths, policy_of) -> list[dict]:
    """Projected rows of every curve at every concurrency."""
    rows = []
    for curve, drafter, spec in curves:
        costs = costs_of(drafter)
        for c in concurrencies:
            idx = requests(c)
            if drafter is None:
                if costs.ar is None:
                    continue
                served = P.project([ar_lengths[i % len(ar_lengths)] for i in idx], c, costs)
            else:
                lg = logs[drafter.name]
                served = P.project([lg[i % len(lg)] for i in idx], c, costs,
                                   policy=policy_of(drafter, spec),
                                   block_size=lg[0].logits.shape[1], temps=drafter_temps(drafter))
            row = dict(curve=curve, drafter=drafter.name if drafter else I.AR,
                       verify=spec if drafter else None, concurrency=c, source="projected",
                       requests=len(idx), **P.served_row(served, drafter is not None),
                       cost_source=costs.describe(),
                       acceptance_source=acceptance_of(drafter))
            rows.append(row)
    return rows


def drafter_temps(drafter: I.Drafter):
    """The drafter's STS temperatures (None: a profile drafter, whose confidences are the profile)."""
    from dspark_jax.convert.formats import sts_temperatures
    return None if drafter.path is None else sts_temperatures(drafter.path)


def bench(target, drafts: Sequence[str] = (), *, prompts=None, datasets=None, verify: str = "full",
          concurrency: str = "1,2,4,8", max_new_tokens: int = 64, sla: str | None = None,
          baseline: str = I.AR, round_tables: Sequence[str] = (), logs: Sequence[str] = (),
          out=None, force: bool = False, requests_per_slot: int = 2, min_requests: int = 8,
          max_prompts: int = 16, max_prompt_tokens: int = 64, quick: bool = False,
          compare=None, acceptance=None, seed: int = 0, printer: Callable[[str], None] = print) -> dict:
    """Run the bench (measured, or projected when ``round_tables`` are given); returns the report
    (what bench.json holds). Every input is checked before a model is loaded or compiled."""
    from dspark_jax.convert.formats import read_json_object

    from dspark_jax.pipelines import bench_acceptance as A

    if acceptance is not None and (logs or not round_tables):
        raise InputError("--acceptance replaces --logs in projected mode: give --round-table and "
                         "no --logs")
    profiles = A.read_profiles(acceptance) if acceptance is not None else {}
    drafters = I.parse_drafters(drafts, list(profiles) if acceptance is not None else None)
    specs = I.parse_verify(verify)
    concs = I.parse_ints(concurrency, "--concurrency")
    slas = I.parse_floats(sla, "--sla")
    skipped = {d.name: A.skipped_policies(profiles[d.name], specs) for d in drafters
               if d.name in profiles}
    curves = [(I.AR, None, None)] + [(f"{d.name}/{v}", d, v) for d in drafters for v in specs
                                     if v not in skipped.get(d.name, ())]
    I.check_baseline(baseline, [c for c, _, _ in curves])
    for flag, v in (("--max-new-tokens", max_new_tokens),
                    ("--requests-per-slot", requests_per_slot), ("--min-requests", min_requests),
                    ("--max-prompts", max_prompts), ("--max-prompt-tokens", max_prompt_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{flag} must be an int >= 1, got {v!r}")
    projected_only = bool(round_tables)
    if logs and not projected_only:
        raise InputError("--logs replays logged rounds in projected mode: give --round-table too")
    beside = []
    if compare is not None:
        if not projected_only:
            raise InputError("--compare sets a measurement beside a projection: "
                             "give --round-table too")
        beside = measured_rows(compare, [c for c, _, _ in curves], concs)
    target_name = str(target)
    target = Path(target)
    if not target.is_dir() and not projected_only:
        raise InputError(f"--target {str(target)!r} is not a directory")
    from dspark_jax.presets import resolve_target
    try:
        tcfg = resolve_target(target_name)  # projected mode: a preset name serves (no weights read)
    except DSparkError as e:
        raise InputError(f"--target: {e}") from None
    blocks = {d.name: profiles[d.name].block_size if d.path is None else
              int(read_json_object(d.path / "config.json", "--draft config.json")
                  .get("block_size", 0)) for d in drafters}
    tables, logged = {}, {}
    if projected_only:
        files = I.pair_files(round_tables, drafters, "--round-table")
        for i, f in enumerate(files):
            d = drafters[i] if drafters else None
            obj = I.read_json(f, "--round-table")
            I.check_round_table(obj, f, tcfg, blocks.get(d.name) if d else None, d)
            tables[d.name if d else I.AR] = (obj, P.costs_from_json(obj, f"round table {f}"))
        if drafters and acceptance is not None:
            for d in drafters:
                prof = profiles[d.name]
                logged[d.name] = (A.synthetic_logs(prof, max_prompts, max_new_tokens, seed),
                                  A.describe(prof, max_prompts, max_new_tokens, seed))
        elif drafters:
            for d, f in zip(drafters, I.pair_files(logs, drafters, "--logs")):
                logged[d.name] = (read_logs(f, d, blocks[d.name]), f"logs {f}")
    if out is not None:
        out = Path(out)
        check_not_input(out, {"--target": target,
                              "--draft": [d.path for d in drafters if d.path is not None],
                              "--round-table": list(round_tables), "--logs": list(logs),
                              "--compare": compare})
        if (out / RESULT_FILE).exists() and not force:
            raise InputError(f"--out {str(out)!r} already holds a bench ({RESULT_FILE}); pass "
                             "--force to overwrite or choose another directory")
        if out.exists() and not out.is_dir():
            raise InputError(f"--out {str(out)!r} is a file; give a directory path")


    rows: list[dict] = []
    meta: dict = {"target": str(target), "drafters": {d.name: {"path": str(d.path) if d.path else None,
                  "fingerprint": d.fingerprint} for d in drafters},
                  "verify": specs, "concurrency": concs, "max_new_tokens": max_new_tokens,
                  "temperature": 0.0, "requests_per_slot": requests_per_slot,
                  "min_requests": min_requests}
    if acceptance is not None:
        meta["acceptance"] = {"file": str(acceptance), "seed": seed,
                              "skipped_policies": {k: v for k, v in skipped.items() if v}}
    if not projected_only:
        from dspark_jax.pipelines import bench_runs
        measured = bench_runs.measure(target, drafters, specs, concs, curves, max_new_tokens,
                                      requests_per_slot, min_requests, prompts, datasets,
                                      max_prompts, max_prompt_tokens, quick, printer, out)
        rows += measured["rows"]
        meta.update(measured["meta"])
        tables = {k: (v, P.costs_from_json(v, f"round table measured here ({k})"))
                  for k, v in measured["tables"].items()}
        logged = {k: (v, "logs of this run (full verification)")
                  for k, v in measured["logs"].items()}
        ar_lengths = measured["ar_lengths"]
    else:
        first = next(iter(logged.values()), None)
        ar_lengths = [lg.length for lg in first[0]] if first else [max_new_tokens]
    n_prompts = len(ar_lengths)

    def requests(c):
        from dspark_jax.pipelines.bench_measure import stream_requests
        return stream_requests(range(n_prompts), c, requests_per_slot, min_requests)

    def costs_of(d):
        return tables[d.name if d else (next(iter(tables)) if I.AR not in tables else I.AR)][1]

    token_tables: dict = {}

    def policy_of(d, spec):
        return P.policy_for(spec, tables[d.name][0], token_tables.get(d.name))

    if any(s.startswith("scheduler-async") for s in specs):
        if projected_only:
            raise InputError("--verify scheduler-async plans with a token SPS table, which a round "
                             "table does not hold: project it from a measured run")
        token_tables.update(measured["token_tables"])
    rows += _project_curves(
        curves, requests, {k: v[0] for k, v in logged.items()}, costs_of, concs, requests_per_slot,
        min_requests, lambda d: "(AR: one token per step)" if d is None else logged[d.name][1],
        ar_lengths, policy_of)
    rows = beside + rows
    return _finish(rows, curves, baseline, slas, meta, projected_only, out, force, printer)


def _finish(rows, curves, baseline, slas, meta, projected_only, out, force, printer) -> dict:
    """Table, SLA report (from measured rows, else projected), agreement, files."""
    lines = R.table(rows) + R.source_lines(rows)
    for line in lines:
        printer(line)
    reports = {}
    for source in ("measured", "projected"):
        by_curve = {c: [r for r in rows if r["curve"] == c and r["source"] == source]
                    for c, _, _ in curves}
        by_curve = {c: v for c, v in by_curve.items() if v}
        if baseline in by_curve:
            rep = P.sla_report(by_curve, baseline, slas)
            rep["source"] = source
            reports[source] = rep
            for line in R.sla_lines(rep):
                printer(line)
    pairs = R.agreement(rows)
    if pairs:
        printer(f"projection vs measurement (throughput; target within {100 * TOLERANCE:.0f}%):")
        for line in R.agreement_lines(pairs, TOLERANCE):
            printer(line)
    report = {"config": meta, "mode": "projected" if projected_only else "measured+projected",
              "rows": rows, "sla": reports, "agreement": pairs,
              "agreement_within_tolerance": all(abs(a["diff"]) <= TOLERANCE for a in pairs)
              if pairs else None}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        title = (f"{Path(meta['target']).name}: "
                 + ("projected" if projected_only else "measured (solid) and projected (dashed)")
                 + f", max_new_tokens {meta['max_new_tokens']}")
        files = {"table": str(write_text(out / "table.txt",
                                         "\n".join(lines) + "\n"))}
        for name, fn in (("frontier", R.plot_frontier), ("budget", R.plot_budget)):
            p = fn(rows, out / f"{name}.png", title)
            if p is not None:
                files[name] = str(p)
        report["files"] = files
        write_json(out / RESULT_FILE, json.loads(dumps(report)))
    return report
