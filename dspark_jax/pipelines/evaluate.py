"""Evaluation of a drafter on prompt datasets: decode, per-dataset metrics, JSON / TensorBoard / PNG.

``evaluate(...)`` decodes the first turn of each prompt of each dataset (reference JSONL
format, see ``dspark_jax.data.eval_datasets``) with lossless speculative decoding and
reports, per dataset: tau (mean acceptance length per round, bonus
included), mean proposal length, verify_rate, accept_rate@k (prefix survival),
conditional acceptance at k, tokens/s; with a confidence head also ECE / AUROC / Brier per
block position (``dspark_jax.pipelines.calibrate.position_metrics``) and a reliability diagram.
With ``baseline=True`` the target also decodes alone and the speedup is reported.

Prompt text -> ids: ``tokenizer.encode_prompt`` (the chat template by default, plain text
with ``options.raw_prompt``), the same as ``generate``.

The decoding helpers here (``timed_decode``, ``decode_summary``, ``plot_acceptance``) are
shared with the demo (``dspark_jax.pipelines.demo``). Timing excludes compilation: each mode first
decodes one warm-up batch of the same shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dspark_jax.decode.settings import DecodeOptions, resolve
from dspark_jax.errors import InputError
from dspark_jax.fileio import atomic_open, dumps, iter_jsonl, json_safe, mark_dir, write_json

RESULT_FILE = "eval.json"


# --------------------------------------------------------------------------- decoding


def timed_decode(target_cfg, target_params, prompts: Sequence[Sequence[int]], *, draft_cfg=None,
                 draft_params=None, max_new_tokens: int = 128, temperature: float = 0.0,
                 policy=None, batch_size: int = 1, seed: int = 0,
                 stop_token_ids: Sequence[int] = (), confidence_temperatures=None,
                 warmup: bool = True, progress: Callable[[int], None] | None = None,
                 batching: str = "static", mesh=None) -> list:
    """Decode ``prompts`` speculatively (with a drafter) or autoregressively (``draft_cfg=None``).

    The cache capacity is fixed from all prompts, and with ``warmup`` one batch holding the
    longest prompt is decoded first with identical shapes, so the timed run (the returned
    ``decode.Result`` list, one per prompt) does not include compilation.
    """
    from dspark_jax.decode import autoregressive_generate, speculative_generate
    from dspark_jax.decode.requests import validate_prompts
    from dspark_jax.decode.shapes import plan_shapes, warmup_prompts
    from dspark_jax.decode.sharded import make_decode_mesh

    prompts = validate_prompts(list(prompts), target_cfg.vocab_size)
    if draft_cfg is None:
        slack, max_pos = 1, target_cfg.max_position_embeddings
    else:
        slack = draft_cfg.block_size
        max_pos = min(target_cfg.max_position_embeddings, draft_cfg.max_position_embeddings)
    _, cache_len = plan_shapes(prompts, max_new_tokens, slack, max_pos, None)

    mesh = make_decode_mesh(mesh) if isinstance(mesh, str) or mesh is None else mesh

    def run(ps, prog):
        common = dict(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size,
                      seed=seed, stop_token_ids=list(stop_token_ids), max_cache_len=cache_len,
                      progress=prog, batching=batching, mesh=mesh)
        if draft_cfg is None:
            return autoregressive_generate(target_cfg, target_params, ps, **common)
        return speculative_generate(target_cfg, target_params, draft_cfg, draft_params, ps,
                                    policy=policy, confidence_temperatures=confidence_temperatures,
                                    **common)

    if warmup:  # continuous: one prompt per bucket compiles every prefill shape and the chunk
        run([max(prompts, key=len)] if batching == "static"
            else [prompts[i] for i in warmup_prompts(prompts, cache_len)], None)
    return run(prompts, progress)


def results_rounds(results):
    """``calibrate.Rounds`` of speculative results that carry confidence logits (None otherwise)."""
    from dspark_jax.pipelines.calibrate import rounds_from_records

    records = [r.to_json() for r in results if r.confidence_logits]
    if not records:
        return None
    return rounds_from_records(records, where="decode results")


def decode_summary(results, block_size: int | None = None, *, calibration: bool = True,
                   tokenizer=None) -> dict:
    """``decode.summarize`` plus ``degeneracy`` (``dspark_jax.degeneracy.summarize`` of the
    outputs: how many are loops, whitespace share of generated tokens; ``tokenizer`` decides
    which ids are whitespace, None = byte ids) and, when the results carry confidences,
    ``calibration``: per-position n / accept_rate / mean_conf / ece / brier / auroc /
    cond_auroc (raw confidences, no STS) and their count-weighted summary. NaN -> null."""
    from dspark_jax import degeneracy
    from dspark_jax.pipelines.calibrate import position_metrics, summary as calib_summary
    from dspark_jax.decode import summarize

    out = summarize(results, block_size)
    out["degeneracy"] = degeneracy.summarize([r.output_ids for r in results], tokenizer=tokenizer)
    rounds = results_rounds(results) if calibration else None
    if rounds is not None:
        per_pos = position_metrics(rounds)
        out["calibration"] = {"per_position": per_pos, "summary": calib_summary(per_pos)}
    return json_safe(out)


# --------------------------------------------------------------------------- outputs


def write_json_atomic(path, data) -> Path:
    """Write ``data`` as indented JSON via a temp file next to ``path`` and a rename."""
    return write_json(path, data, indent=1)  # strict JSON: NaN -> null


def write_results_jsonl(path, results, extra: Sequence[Mapping] | None = None) -> Path:
    """One line per ``Result`` (``Result.to_json()`` plus the matching ``extra`` fields), atomically."""
    with atomic_open(path) as f:
        for i, r in enumerate(results):
            line = dict(extra[i]) if extra is not None else {}
            line.update(r.to_json())
            f.write(dumps(line) + "\n")
    return Path(path)


def read_results_jsonl(path) -> list:
    """``Result`` list from a file written by ``write_results_jsonl``."""
    import dataclasses

    from dspark_jax.decode import Result

    names = {f.name for f in dataclasses.fields(Result)}
    out = []
    for where, rec in iter_jsonl(path, "decode results"):
        missing = names - set(rec) if isinstance(rec, dict) else names
        if missing:
            raise InputError(f"{where}: missing fields {sorted(missing)}")
        out.append(Result(**{k: rec[k] for k in names}))
    return out


def plot_acceptance(curves: Mapping[str, Mapping[str, Sequence]], path, title: str = "", *,
                    temperature: float, results: Mapping[str, Sequence] | None = None) -> Path:
    """PNG with two panels over block positions k = 1..G: accept_rate@k (prefix survival) and
    conditional acceptance, one line per label. ``curves``: {label: decode_summary dict}.

    The title ends with the decode ``temperature``. Degenerate outputs (loops, whose drafts the
    target accepts whole) inflate both curves: each label says how many of its outputs are
    degenerate, and with ``results`` ({label: Result list}) the curves over the other outputs
    are drawn dashed beside them. The legend sits below the panels, off the data."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dspark_jax import degeneracy
    from dspark_jax.decode import summarize

    def draw(summ, label, color=None, **style):
        lines = []
        for ax, key in zip(axes, ("accept_rate", "conditional_accept")):
            vals = [np.nan if v is None else v for v in summ.get(key, [])]
            if vals:
                lines += ax.plot(np.arange(1, len(vals) + 1), vals, marker="o", color=color,
                                 label=label, **style)
        return lines

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for label, summ in curves.items():
        d = summ.get("degeneracy") or {}
        loops = (f", {d['num_degenerate']}/{d['num_outputs']} outputs degenerate"
                 if d.get("num_degenerate") else "")
        lines = draw(summ, f"{label} (tau {summ['tau']:.2f}{loops})")
        clean = [r for r in (results or {}).get(label, ()) if not degeneracy.is_degenerate(r.output_ids)]
        if lines and loops and clean:
            rest = summarize(clean)
            draw(rest, f"{label} without the degenerate outputs (tau {rest['tau']:.2f}, "
                       f"{len(clean)} outputs)", lines[0].get_color(), ls="--", mfc="none")
    for ax, name in zip(axes, ("accept_rate@k (prefix survival)", "conditional acceptance at k")):
        ax.set_xlabel("block position k")
        ax.set_ylabel(name)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=1, frameon=False)
    fig.suptitle(f"{title}, temperature {temperature:g}" if title else f"temperature {temperature:g}")
    fig.tight_layout(rect=(0, 0.06 + 0.045 * len(labels), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reliability(results, path, title: str = "") -> Path | None:
    """Reliability diagram (raw confidences and STS, held out when there are enough rounds:
    ``calibrate.reliability_plot``) of results with a confidence head; None when they carry
    no confidences."""
    from dspark_jax.pipelines.calibrate import reliability_plot

    rounds = results_rounds(results)
    if rounds is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    reliability_plot(rounds, path, title=title)
    return path


DEGENERACY_NOTE = ("degen = outputs whose distinct-4-gram ratio is below 0.3 (loops; a high tau on them "
                   "is inflated); ws = share of generated tokens that are whitespace")
DEGENERATE_WARN_FRACTION = 0.1


def format_table(rows: Mapping[str, Mapping[str, Any]], *, max_k: int | None = None,
                 baseline: str | None = None) -> str:
    """Plain-text table, one row per label: tau, proposal, verify_rate, accept_rate@1..K,
    tokens/s, (when ``baseline`` names a row) speedup over it and (when the rows carry
    ``degeneracy``) degenerate outputs / outputs and the whitespace share of tokens."""
    k = max_k if max_k is not None else max((len(r.get("accept_rate") or []) for r in rows.values()), default=0)
    degen = any(r.get("degeneracy") for r in rows.values())
    head = ["", "tau", "prop", "verify"] + [f"acc@{i + 1}" for i in range(k)] + ["tok/s"]
    if baseline:
        head.append("speedup")
    if degen:
        head += ["degen", "ws"]
    lines = []
    base_tps = rows[baseline]["tokens_per_second"] if baseline in rows else None
    for label, r in rows.items():
        acc = list(r.get("accept_rate") or []) + [None] * k
        cells = [label, f"{r['tau']:.3f}", f"{r['mean_proposal']:.2f}", f"{r['verify_rate']:.3f}"]
        cells += ["-" if a is None else f"{a:.3f}" for a in acc[:k]]
        cells.append(f"{r['tokens_per_second']:.1f}")
        if baseline:
            cells.append(f"{r['tokens_per_second'] / base_tps:.2f}x" if base_tps else "-")
        if degen:
            d = r.get("degeneracy")
            cells += ([f"{d['num_degenerate']}/{d['num_outputs']}", f"{100 * d['whitespace_fraction']:.0f}%"]
                      if d else ["-", "-"])
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head)] + [fmt(c) for c in lines])


def tensorboard_scalars(log_dir, scalars: Mapping[str, Mapping[str, Any]]) -> Path:
    """TensorBoard events: ``{group}/{metric}`` scalars at step 0 and per-position curves
    (``{group}/accept_rate``, ``conditional_accept``, calibration ``ece``/``auroc``/``brier``)
    with the 1-based position as the step."""
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(str(log_dir))
    try:
        for group, s in scalars.items():
            for key in ("tau", "mean_proposal", "verify_rate", "tokens_per_second", "speedup"):
                if s.get(key) is not None:
                    writer.add_scalar(f"{group}/{key}", float(s[key]), 0)
            for key in ("accept_rate", "conditional_accept"):
                for k, v in enumerate(s.get(key) or [], 1):
                    if v is not None:
                        writer.add_scalar(f"{group}/{key}", float(v), k)
            for pos in (s.get("calibration") or {}).get("per_position", []):
                for key in ("ece", "auroc", "brier"):
                    if pos.get(key) is not None:
                        writer.add_scalar(f"{group}/{key}", float(pos[key]), pos["position"])
    finally:
        writer.close()
    return Path(log_dir)


# --------------------------------------------------------------------------- the eval run


def _decode_dataset(name, prompts, pair, options, settings, *, baseline: bool, progress: bool,
                    tokenizer=None):
    """(decode_summary (+ autoregressive/speedup with ``baseline``), results) of one dataset."""
    from tqdm import tqdm

    tcfg, tparams, dcfg, dparams = pair
    with tqdm(total=len(prompts), desc=f"eval {name}", unit="prompt", disable=not progress) as bar:
        results = timed_decode(tcfg, tparams, prompts, draft_cfg=dcfg, draft_params=dparams,
                               progress=bar.update, batching=options.batching, mesh=options.mesh,
                               **settings.decode_kwargs(options))
    summ = decode_summary(results, dcfg.block_size, tokenizer=tokenizer)
    if baseline:
        with tqdm(total=len(prompts), desc=f"autoregressive {name}", unit="prompt",
                  disable=not progress) as bar:
            ar = timed_decode(tcfg, tparams, prompts, progress=bar.update,
                              batching=options.batching, mesh=options.mesh,
                              **settings.decode_kwargs(options, speculative=False))
        ar_summ = decode_summary(ar)
        summ["autoregressive"] = {k: ar_summ[k] for k in ("output_tokens", "seconds", "tokens_per_second")}
        summ["speedup"] = (summ["tokens_per_second"] / ar_summ["tokens_per_second"]
                           if ar_summ["tokens_per_second"] else None)
    return summ, results


def degeneracy_warnings(summaries: Mapping[str, Mapping], threshold: float = DEGENERATE_WARN_FRACTION) -> list[str]:
    """One warning per dataset whose share of degenerate outputs (loops) is >= ``threshold``."""
    from dspark_jax.degeneracy import format_summary

    out = []
    for name, s in summaries.items():
        d = s.get("degeneracy")
        if d and d["num_outputs"] and d["degenerate_fraction"] >= threshold:
            out.append(f"warning: {name}: {format_summary(d)}: the outputs are mostly loops, so tau and "
                       "the acceptance rates measure how well the drafter predicts a loop; use prompts "
                       "this target can continue")
    return out


def degeneracy_totals(summaries: Mapping[str, Mapping]) -> dict:
    """Degenerate outputs over all datasets: {"num_degenerate", "num_outputs", "datasets_warned"}."""
    ds = [s["degeneracy"] for s in summaries.values() if s.get("degeneracy")]
    warned = [n for n, s in summaries.items() if s.get("degeneracy") and s["degeneracy"]["num_outputs"]
              and s["degeneracy"]["degenerate_fraction"] >= DEGENERATE_WARN_FRACTION]
    return {"num_degenerate": sum(d["num_degenerate"] for d in ds),
            "num_outputs": sum(d["num_outputs"] for d in ds), "datasets_warned": warned}


def _print_report(summaries: Mapping[str, Mapping], printer) -> None:
    """The table, then per dataset the confidence metrics per position and the speedup, then
    the degenerate-output count and a warning per degenerate dataset."""
    printer(format_table(dict(summaries)))
    for name, s in summaries.items():
        cal = s.get("calibration")
        if cal:
            pp = cal["per_position"]
            fmt = lambda key: " ".join("-" if p[key] is None else f"{p[key]:.3f}" for p in pp)
            printer(f"{name} confidence per position: ECE {fmt('ece')} | AUROC {fmt('auroc')} | "
                    f"Brier {fmt('brier')}")
        if s.get("speedup") is not None:
            printer(f"{name} speedup over autoregressive: {s['speedup']:.2f}x")
    tot = degeneracy_totals(summaries)
    if tot["num_outputs"]:
        printer(f"degenerate outputs: {tot['num_degenerate']}/{tot['num_outputs']} ({DEGENERACY_NOTE})")
    for w in degeneracy_warnings(summaries):
        printer(w)


def _write_outputs(out: Path, report: dict, all_results: Mapping, prompts_by_ds: Mapping) -> dict:
    """results/<dataset>.jsonl, PNGs and tb/ under ``out``; returns {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    mark_dir(out, "eval")
    files = {}
    for name, results in all_results.items():
        extra = [{"dataset": name, "index": p.index, "line": p.line} for p in prompts_by_ds[name]]
        write_results_jsonl(out / "results" / f"{name}.jsonl", results, extra)
        temperature = report["config"]["temperature"]
        files[f"acceptance_{name}"] = str(plot_acceptance(
            {name: report["datasets"][name]}, out / f"acceptance_{name}.png", title=name,
            temperature=temperature, results={name: results}))
        rel = plot_reliability(results, out / f"reliability_{name}.png",
                               title=f"{name}: confidence (temperature {temperature:g})")
        if rel is not None:
            files[f"reliability_{name}"] = str(rel)
    tensorboard_scalars(out / "tb", report["datasets"])
    files["tensorboard"] = str(out / "tb")
    return files


EMBEDDED_DEFAULT_DATASETS = ("stdlib-heldout",)


def default_datasets(target) -> list[str]:
    """The datasets ``eval`` uses without ``--datasets``: for the embedded default target the
    packaged prompts it can continue (``EMBEDDED_DEFAULT_DATASETS``: held-out standard-library
    code; not the math word problems or chat prompts, which it answers with loops); any other
    target must name its datasets (InputError)."""
    from dspark_jax.embedded.default import default_target_dir

    try:
        embedded = Path(target).resolve() == Path(default_target_dir()).resolve()
    except OSError:
        embedded = False
    if not embedded:
        raise InputError(f"--datasets is required with --target {str(target)!r} (only the embedded default "
                         f"target has default datasets: {','.join(EMBEDDED_DEFAULT_DATASETS)})")
    return list(EMBEDDED_DEFAULT_DATASETS)


def evaluate(target, draft, datasets=None, *, data_dir=None, max_samples: int | None = None,
             options: DecodeOptions | None = None, baseline: bool = False, out=None,
             force: bool = False, progress: bool = True, printer=print) -> dict:
    """Evaluate drafter ``draft`` (dir) with target ``target`` (dir) on ``datasets``
    ("a,b" or a list of names in ``data_dir``, default the packaged small copies), decoding
    with ``options`` (default ``DecodeOptions()``); ``datasets`` None = ``default_datasets(target)``.

    Returns ``{"config": ..., "datasets": {name: decode_summary (+ "speedup",
    "autoregressive" with baseline)}, "degenerate_outputs": degeneracy_totals, "warnings":
    [one line per dataset whose outputs are >= 10% loops]}``. With ``out`` (a directory, refused if it holds an
    eval unless ``force``) writes ``eval.json``, ``results/<dataset>.jsonl``, TensorBoard
    scalars under ``tb/`` and PNGs ``acceptance_<dataset>.png`` (+ ``reliability_<dataset>.png``
    with a confidence head). All input is checked before any model is loaded or compiled.
    """
    from dspark_jax.convert.checkpoint import load_draft, load_target
    from dspark_jax.data.eval_datasets import load_datasets
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    options = options if options is not None else DecodeOptions()
    out = Path(out) if out is not None else None
    if out is not None and (out / RESULT_FILE).exists() and not force:
        raise InputError(f"--out {str(out)!r} already holds an evaluation ({RESULT_FILE}); "
                         "pass --force to overwrite or choose another directory")
    target, draft = Path(target), Path(draft)
    for flag, d in (("--target", target), ("--draft", draft)):
        if not d.is_dir():
            raise InputError(f"{flag} {str(d)!r} is not a directory")
    from dspark_jax.pairing import check_pair_paths
    check_pair_paths(target, draft)
    if datasets is None:
        datasets = default_datasets(target)
    prompts_by_ds = load_datasets(datasets, data_dir, max_samples=max_samples)
    tokenizer = load_tokenizer(target, required=True)
    settings = resolve(options, target, draft, tokenizer)
    from dspark_jax.decode.settings import check_verify_block
    from dspark_jax.pairing import stored_config
    check_verify_block(options, settings.policy, stored_config(draft, "draft").block_size)
    from dspark_jax.decode.sharded import make_decode_mesh
    make_decode_mesh(options.mesh)  # a mesh needing more devices than exist: ConfigError now
    encoded = {name: [encode_prompt(tokenizer, p.text, raw=options.raw_prompt, thinking=options.thinking)
                      for p in ps]
               for name, ps in prompts_by_ds.items()}

    tcfg, tparams = load_target(target)
    dcfg, dparams = load_draft(draft, target_params=tparams, steps=options.draft_steps)
    dcfg.check_compatible(tcfg)
    config = {"target": str(target), "draft": str(draft), "datasets": list(prompts_by_ds),
              "data_dir": str(data_dir) if data_dir is not None else "(packaged)",
              "max_samples": max_samples, "max_new_tokens": options.max_new_tokens,
              "temperature": options.temperature, "verify": options.verify,
              "thinking": options.thinking, "raw_prompt": options.raw_prompt,
              "batch_size": options.batch_size, "seed": options.seed,
              "batching": options.batching, "mesh": options.mesh,
              "stop_token_ids": settings.stop_ids,
              "block_size": dcfg.block_size, "markov_rank": dcfg.markov_rank,
              "confidence_head": dcfg.enable_confidence_head}
    report: dict[str, Any] = {"config": config, "datasets": {}}
    all_results = {}
    for name, prompts in encoded.items():
        pair = (tcfg, tparams, dcfg, dparams)
        report["datasets"][name], all_results[name] = _decode_dataset(
            name, prompts, pair, options, settings, baseline=baseline, progress=progress,
            tokenizer=tokenizer)
    report["degenerate_outputs"] = degeneracy_totals(report["datasets"])
    report["warnings"] = degeneracy_warnings(report["datasets"])
    _print_report(report["datasets"], printer)
    import jax
    if out is not None and jax.process_index() == 0:  # multi-process: process 0 writes
        report["files"] = _write_outputs(out, report, all_results, prompts_by_ds)
        write_json_atomic(out / RESULT_FILE, report)
    return json_safe(report)
