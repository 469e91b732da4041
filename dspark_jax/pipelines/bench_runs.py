"""``bench``'s measured mode: profile the costs, log the rounds, serve every (curve, C) stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from dspark_jax.errors import InputError
from dspark_jax.fileio import dumps, write_json, write_text
from dspark_jax.pipelines import bench_inputs as I
from dspark_jax.pipelines import bench_project as P
from dspark_jax.pipelines import bench_measure as M


def measure(target: Path, drafters: Sequence[I.Drafter], specs, concs, curves, max_new: int,
            per_slot: int, minimum: int, prompts_file, datasets, max_prompts: int,
            max_prompt_tokens: int, quick: bool, printer: Callable[[str], None], out) -> dict:
    """Measured rows of every curve and concurrency, the round tables measured here ({name:
    JSON}, ``ar`` for the AR-only costs), the drafters' full-verification logs ({name:
    RequestLogs}), AR output lengths per prompt and token tables for scheduler-async."""
    import jax

    from dspark_jax.convert.checkpoint import default_stop_ids, load_draft, load_target
    from dspark_jax.convert.formats import sts_temperatures
    from dspark_jax.decode import engine, profile
    from dspark_jax.decode.policies import FullPolicy
    from dspark_jax.pipelines.bench_project import policy_for

    prompts, prompt_source = load_prompts(target, prompts_file, datasets, max_prompts,
                                          max_prompt_tokens)
    stops = default_stop_ids(target)
    tc, tp = load_target(target)
    pairs = {}
    for d in drafters:
        dc, dp = load_draft(d.path, target_params=tp)
        pairs[d.name] = ((tc, tp, dc, dp), sts_temperatures(d.path))
    printer(f"bench: {len(prompts)} prompts ({prompt_source}); profiling costs at C = {concs}")
    ar = M.ar_costs((tc, tp), prompts, concs, max_new)
    tables = {I.AR: M.ar_table(tc, concs, ar)}
    if out is not None:
        (Path(out) / "round_tables").mkdir(parents=True, exist_ok=True)
        write_json(Path(out) / "round_tables" / f"{I.AR}.json", tables[I.AR])
    logs, token_tables = {}, {}
    for d in drafters:
        pair, temps = pairs[d.name]
        obj = M.round_table(pair, prompts, concs, max_new, quick=quick,
                            meta={"target": str(target), "draft": str(d.path)})
        obj.update(ar, draft_fingerprint=d.fingerprint, source="measured here by dspark-jax bench")
        tables[d.name] = obj
        if out is not None:
            write_json(Path(out) / "round_tables" / f"{d.name}.json", obj)
        res = engine.serve(*pair, prompts, max_new_tokens=max_new, policy=FullPolicy(),
                           slots=min(max(concs), len(prompts)), stop_token_ids=stops,
                           confidence_temperatures=temps)
        log_path = Path(out) / "logs" / f"{d.name}.jsonl" if out is not None else None
        logs[d.name] = write_logs(log_path, d, res, pair[2].block_size)
        if any(s.startswith("scheduler-async") for s in specs):
            g = pair[2].block_size
            token_tables[d.name] = profile.measure_sps(
                tc, tp, profile.default_batch_sizes(max(concs) * (g + 1)), 64,
                repeats=1 if quick else 3, min_seconds=0.0 if quick else 0.1)
    rows, ar_lengths = [], {}
    for curve, d, spec in curves:
        pair, temps = pairs[d.name] if d else ((tc, tp, None, None), None)
        policy = policy_for(spec, tables[d.name], token_tables.get(d.name)) if d else None
        for c in concs:
            idx = M.stream_requests(prompts, c, per_slot, minimum)
            res, st = M.serve_point(pair, [prompts[i] for i in idx], policy=policy, slots=c,
                                    max_new=max_new, stops=stops, temps=temps,
                                    repeats=1 if quick else 2)
            if d is None:
                ar_lengths.update({i: len(r.output_ids) for i, r in zip(idx, res)})
            row = dict(curve=curve, drafter=d.name if d else I.AR, verify=spec, concurrency=c,
                       source="measured", requests=len(idx),
                       **M.measured_row(res, st, d is not None))
            rows.append(row)
            printer(f"  {curve} C={c}: {row['throughput']:.1f} tok/s, "
                    f"{row['per_user_tokens_per_second']:.1f} tok/s/user, "
                    f"{row['timed_compiles']} compiles after warm-up")
    dev = jax.devices()[0]
    meta = {"prompts": prompt_source, "num_prompts": len(prompts), "stop_token_ids": stops,
            "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
            "devices": jax.device_count()}
    lengths = [ar_lengths.get(i, max_new) for i in range(len(prompts))]
    return dict(rows=rows, meta=meta, tables=tables, logs=logs, ar_lengths=lengths,
                token_tables=token_tables)


def load_prompts(target, prompts_file, datasets, max_prompts: int, max_prompt_tokens: int):
    """(prompt id lists, description): --prompts JSONL or --datasets (default: eval's default
    datasets of the target), each prompt keeping its last ``max_prompt_tokens`` tokens."""
    from dspark_jax.data.prompts import read_prompts
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(Path(target))
    encode = None if tok is None else (lambda t: encode_prompt(tok, t, raw=True))
    if prompts_file:
        ids = [p for _, p in read_prompts(prompts_file, encode)]
        source = f"prompts {prompts_file}"
    else:
        from dspark_jax.data.eval_datasets import load_datasets
        from dspark_jax.pipelines.evaluate import default_datasets

        names = datasets or default_datasets(target)
        if tok is None:
            raise InputError(f"--datasets needs a tokenizer in --target {str(target)!r}; "
                             "give --prompts")
        ds = load_datasets(names, max_samples=max_prompts)
        ids = [encode(p.text) for ps in ds.values() for p in ps]
        source = f"datasets {','.join(ds)}"
    ids = [p[-max_prompt_tokens:] for p in ids if p][:max_prompts]
    if not ids:
        raise InputError("no prompts")
    return ids, source


def write_logs(path: Path | None, drafter: I.Drafter, results,
               block_size: int) -> list[P.RequestLog]:
    """Write ``results`` (full verification) as a bench log and return their RequestLogs."""
    lines = []
    for r in results:
        lines.append(dumps(dict(drafter=drafter.name, draft_fingerprint=drafter.fingerprint,
                                output_ids=r.output_ids, confidence_logits=r.confidence_logits,
                                accepted_drafts=r.accepted_drafts,
                                proposal_lengths=r.proposal_lengths)) + "\n")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, "".join(lines))
    return [P.request_log(json.loads(line), block_size, f"{path}:{i + 1}")
            for i, line in enumerate(lines)]


