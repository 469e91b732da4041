"""Verification policies vs concurrency: fixed l=1 (MTP-1), fixed l=G, static threshold,
the prefix scheduler (Algorithm 1) and its async variant (paper Fig. 8 style).

What is real and what is simulated:
- SPS(B) is measured on this machine with the real jitted verification forward of the
  fixture target (``dspark_jax.decode.profile``), B = 1 .. 64*(G+1) tokens.
- Per-round confidences and accepted-draft counts are real outputs of the fixture drafter:
  the target's greedy continuations (tests/fixtures/.../decode_greedy.json) are replayed and
  every position of them is used as an anchor. At temperature 0 teacher forcing gives the
  exact acceptance (drafts on an accepted prefix equal the target tokens); confidences past
  the first rejection use teacher-forced (not drafted) previous tokens.
- The SPS curve is measured with many interleaved passes (fastest chunk per size) and
  fitted (--fit, default convex: non-decreasing convex piecewise-linear latency 1/SPS, see
  dspark_jax.decode.scheduler); raw values are kept in sps.json meta. The scheduler plans
  with the fitted curve, and the simulated clock is the fitted curve too (our best estimate
  of the hardware); every result is also reported under the raw measured clock
  (``throughput_measured_clock``) as a robustness check.
- STS temperatures are fitted on half of the rounds (``--split rounds``, fixture default) or
  of the requests (``--split requests``, default with --target: no prompt on both sides);
  only the other half feeds the simulation (no test-set tuning).
- The serving loop is simulated: every round, each of R concurrent requests draws one
  held-out round; the policy picks l_r from the calibrated confidences; the round emits
  sum_r (1 + min(accepted_r, l_r)) tokens and costs 1 / SPS(sum_r (1 + l_r)) seconds
  (target verification only; drafting cost is not modelled).
- Diagnostics (JSON ``diagnostics``, stderr): per concurrency, every fixed l = 0..G under the
  same draws (best one = ``best fixed``), the scheduler's mean chosen lengths per position and
  the throughput the model *predicts* (calibrated confidences) vs realises for the scheduler
  and the best fixed l. One diagnostic-only row, ``scheduler (oracle-calibrated)``, feeds the
  scheduler the held-out rounds' own per-position conditional acceptance rates (uses the
  evaluation half: an upper reference for a calibrated head, not a result); and
  ``scheduler (fit-half rates, diagnostic)`` the same rates measured on the *fit* half (no
  test-set use, but it ignores the drafter's per-round confidences: a static SPS-aware length).

Usage: .venv/bin/python benchmarks/schedule.py --out benchmarks/results/schedule [--rounds 300]
Any target/drafter pair: --target DIR --draft DIR [--dataset stdlib-heldout --max-samples N]:
prompts of the dataset are encoded with the target's tokenizer and the target's greedy
continuations (--max-new-tokens) are generated with the real decode loop, then replayed.
Writes OUT/sps.json, OUT/schedule.json, OUT/schedule.png. --smoke: smallest settings (seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_jax.pipelines import calibrate as C  # noqa: E402
from dspark_jax.convert import checkpoint  # noqa: E402
from dspark_jax.decode import policies, profile  # noqa: E402
from dspark_jax.decode import scheduler as S, tables  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402
from dspark_jax.commands.common import add_decode_flags  # noqa: E402
from dspark_jax.errors import InputError  # noqa: E402
from dspark_jax.target import qwen3  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "dspark_qwen3_tiny"


def replay_rounds(tcfg, tparams, dcfg, dparams, pairs, *, return_groups: bool = False):
    """Real (confidence logits [N, G], accepted drafts [N]) for every anchor of greedy continuations.

    ``pairs``: (prompt ids, greedy output ids) per request. Each prompt+output sequence is run
    through the target once (taps) and the drafter is teacher-forced at every anchor from the
    last prompt token to the last position with G tokens after it. With ``return_groups``
    also returns the request index of every round ([N] int).
    """
    g = dcfg.block_size
    logits, acc, groups = [], [], []
    for i, (prompt, outp) in enumerate(pairs):
        seq = np.asarray(list(prompt) + list(outp), np.int32)[None]
        s = seq.shape[1]
        if s - g <= len(prompt) - 1:
            continue  # continuation shorter than one block: no anchor
        hidden, taps, _ = qwen3.forward(tparams, tcfg, jnp.asarray(seq), tap_layer_ids=dcfg.target_layer_ids)
        anchors = np.arange(len(prompt) - 1, s - g)[None]
        fwd = draft_model.training_forward(dparams, dcfg, jnp.asarray(seq), taps, jnp.ones((1, s), jnp.int32),
                                           jnp.asarray(anchors), jnp.ones(anchors.shape, bool))
        match = np.asarray(jnp.argmax(fwd.draft_logits, -1) == fwd.target_ids)[0]   # [N, G]
        acc.append(np.cumprod(match, axis=1).sum(axis=1))
        logits.append(np.asarray(fwd.confidence_logits)[0])
        groups.append(np.full(anchors.shape[1], i))
    if not acc:
        raise InputError("no drafter rounds: every greedy continuation is shorter than one block "
                         f"(block_size {g}); raise --max-new-tokens")
    logits, acc = np.concatenate(logits), np.concatenate(acc)
    rounds = C.Rounds(logits.astype(np.float64), acc.astype(np.int64), np.full(len(acc), g))
    return (rounds, np.concatenate(groups)) if return_groups else rounds


def split_by_request(rounds: C.Rounds, groups: np.ndarray, seed: int = 0) -> tuple[C.Rounds, C.Rounds]:
    """(fit, held-out): a seeded half of the *requests* with all their rounds on each side, so
    the held-out rounds share no prompt with the rounds STS is fitted on."""
    ids = np.unique(groups)
    if len(ids) < 2:
        raise InputError(f"only {len(ids)} request(s) with rounds: too few to split by request")
    held_ids = np.random.default_rng(seed).permutation(ids)[: len(ids) // 2]
    held = np.isin(groups, held_ids)
    return rounds.take(np.flatnonzero(~held)), rounds.take(np.flatnonzero(held))


def drafter_rounds(fixture: Path, max_prompts: int | None = None) -> C.Rounds:
    """Rounds of the fixture drafter on the fixture's stored greedy continuations (the first
    ``max_prompts`` of them, default all)."""
    tcfg, tparams = checkpoint.load_target(fixture / "target")
    dcfg, dparams = checkpoint.load_draft(fixture / "draft")
    dec = json.loads((fixture / "decode_greedy.json").read_text())
    pairs = list(zip(dec["prompts"], dec["output_ids"]))[:max_prompts]
    return replay_rounds(tcfg, tparams, dcfg, dparams, pairs)


def dataset_rounds(target_dir, draft_dir, dataset: str, max_samples: int | None, max_new_tokens: int,
                   batch_size: int = 8, raw_prompt: bool = False) -> tuple[C.Rounds, dict]:
    """Rounds of any target/drafter pair on a prompt dataset (text -> ids via the target's
    tokenizer); the target's greedy continuations (up to ``max_new_tokens``, cut at its stop
    tokens) are generated here with the real decode loop, then replayed as in the fixture mode."""
    from dspark_jax.data import eval_datasets
    from dspark_jax.decode import autoregressive_generate
    from dspark_jax.decode.settings import DecodeOptions, resolve
    from dspark_jax.tokenizer import encode_prompt, load_tokenizer

    tcfg, tparams = checkpoint.load_target(target_dir)
    dcfg, dparams = checkpoint.load_draft(draft_dir)
    dcfg.check_compatible(tcfg)
    tok = load_tokenizer(target_dir, required=True)
    texts = eval_datasets.load_prompts(dataset, max_samples=max_samples)
    options = DecodeOptions(max_new_tokens=max_new_tokens, batch_size=batch_size, raw_prompt=raw_prompt)
    prompts = [encode_prompt(tok, t, raw=options.raw_prompt) for t in texts]
    stops = resolve(options, target_dir, tokenizer=tok).stop_ids
    t0 = time.time()
    res = autoregressive_generate(tcfg, tparams, prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                                       batch_size=batch_size, stop_token_ids=stops)
    outs = [r.output_ids for r in res]
    print(f"greedy continuations: {len(prompts)} prompts, mean {np.mean([len(o) for o in outs]):.1f} new "
          f"tokens ({time.time() - t0:.1f}s)", file=sys.stderr)
    info = {"target": str(target_dir), "draft": str(draft_dir), "dataset": dataset, "prompts": len(prompts),
            "mean_prompt_tokens": float(np.mean([len(p) for p in prompts])),
            "mean_new_tokens": float(np.mean([len(o) for o in outs])), "max_new_tokens": max_new_tokens,
            "stop_token_ids": stops}
    rounds, groups = replay_rounds(tcfg, tparams, dcfg, dparams, zip(prompts, outs), return_groups=True)
    return rounds, groups, info


def simulate(policy, conf_all, accepted, clocks, concurrency: int, n_rounds: int, seed: int):
    """Realised throughput of ``policy`` under each clock in ``clocks`` (name -> SPSTable).

    conf_all [N, G] float32 confidences fed to the policy; accepted [N] true accepted drafts.
    Same ``seed`` = same drawn rounds for every policy (common random numbers).
    """
    rng = np.random.default_rng(seed)
    g = conf_all.shape[1]
    apply = jax.jit(lambda s, c, a: policy(s, c, a))
    state = policy.init_state(concurrency, g)
    active = jnp.ones((concurrency,), bool)
    tokens, predicted, budget = 0.0, 0.0, 0.0
    seconds = {k: 0.0 for k in clocks}
    per_pos = np.zeros(g)
    for _ in range(n_rounds):
        idx = rng.integers(0, len(accepted), concurrency)
        lengths, state = apply(state, jnp.asarray(conf_all[idx]), active)
        lengths = np.asarray(lengths)
        tokens += float(np.sum(1 + np.minimum(accepted[idx], lengths)))
        a = np.cumprod(conf_all[idx].astype(np.float64), axis=1)
        predicted += float(concurrency + np.sum(np.where(np.arange(g)[None] < lengths[:, None], a, 0.0)))
        b = int(np.sum(1 + lengths))
        for k, t in clocks.items():
            seconds[k] += 1.0 / float(t(b))
        budget += float(np.mean(lengths))
        per_pos += np.mean(np.arange(1, g + 1)[None] <= lengths[:, None], axis=0)
    main_clock = next(iter(clocks))
    out = {"throughput": tokens / seconds[main_clock], "per_user": tokens / seconds[main_clock] / concurrency,
           "budget": budget / n_rounds, "tokens_per_round_per_user": tokens / n_rounds / concurrency,
           "predicted_throughput": predicted / seconds[main_clock],
           "verified_fraction_per_position": (per_pos / n_rounds).round(4).tolist()}
    for k in list(clocks)[1:]:
        out[f"throughput_{k}_clock"] = tokens / seconds[k]
    return out


def fixed_sweep(conf_all, accepted, clocks, concurrency: int, n_rounds: int, seed: int):
    """Every fixed l = 0..G on the same draws as :func:`simulate` (numpy; no policy call)."""
    g = conf_all.shape[1]
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.integers(0, len(accepted), concurrency) for _ in range(n_rounds)])
    a = np.cumprod(conf_all[idx].astype(np.float64), axis=2)          # [rounds, R, G]
    out = []
    for l in range(g + 1):
        tokens = float(np.sum(1 + np.minimum(accepted[idx], l)))
        predicted = float(np.sum(1 + a[:, :, :l].sum(-1)))
        row = {"l": l}
        for k, t in clocks.items():
            sec = n_rounds / float(t(concurrency * (1 + l)))
            row[f"throughput_{k}_clock"] = tokens / sec
            if k == next(iter(clocks)):
                row["throughput"], row["predicted_throughput"] = tokens / sec, predicted / sec
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "schedule"))
    ap.add_argument("--rounds", type=int, default=300, help="simulated rounds per (policy, concurrency)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--cache-length", type=int, default=64)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--fit", choices=tables.FITS, default=tables.DEFAULT_FIT,
                    help="SPS fit the scheduler plans with and the simulated clock uses (default convex)")
    ap.add_argument("--raw-sps", action="store_true", help="same as --fit none")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved timing passes per size")
    ap.add_argument("--sps", default=None, help="reuse an SPS table (refitted from its raw values)")
    ap.add_argument("--target", default=None,
                    help="target checkpoint dir (default: the tiny reference fixture's target); with "
                         "--draft, the rounds come from the target's greedy continuations of --dataset")
    ap.add_argument("--draft", default=None, help="drafter checkpoint dir (default: the fixture drafter)")
    ap.add_argument("--dataset", default="stdlib-heldout",
                    help="prompt dataset (dspark_jax.data.eval_datasets) for --target/--draft mode")
    ap.add_argument("--max-samples", type=int, default=None, help="at most N prompts of --dataset")
    ap.add_argument("--split", choices=("rounds", "requests"), default=None,
                    help="STS fit/held-out halves: a random half of the rounds (fixture default) or of "
                         "the requests, all rounds of a prompt on one side (default with --target)")
    add_decode_flags(ap, ("max_new_tokens", "raw_prompt"), defaults={"max_new_tokens": 96})
    ap.add_argument("--smoke", action="store_true",
                    help="smallest settings (seconds): 1 concurrency level, few rounds, 2 SPS sizes")
    args = ap.parse_args(argv)
    if args.smoke:  # a few seconds: 2 fixture prompts, 1 concurrency level, 5 rounds, 1 pass
        args.rounds, args.concurrency, args.repeats = 5, "1", 1
        args.max_samples = args.max_samples or 2
    if (args.target is None) != (args.draft is None):
        ap.error("--target and --draft go together (neither = the tiny reference fixture)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]

    t0 = time.time()
    if args.target is None:
        rounds, source = drafter_rounds(FIXTURE, 2 if args.smoke else None), {"target": "tests/fixtures/dspark_qwen3_tiny/target",
                                                   "draft": "tests/fixtures/dspark_qwen3_tiny/draft",
                                                   "prompts": "decode_greedy.json (fixture)"}
        target_dir = FIXTURE / "target"
        label = "tiny fixture drafter"
    else:
        rounds, groups, source = dataset_rounds(args.target, args.draft, args.dataset, args.max_samples,
                                                args.max_new_tokens, raw_prompt=args.raw_prompt)
        target_dir = Path(args.target)
        label = f"drafter {args.draft} + target {Path(args.target).name} on {args.dataset}"
    g = rounds.block_size
    split = args.split or ("rounds" if args.target is None else "requests")
    if split == "requests" and args.target is None:
        ap.error("--split requests needs --target/--draft (the fixture rounds carry no request ids)")
    if split == "rounds":
        fit, held = C.split_rounds(rounds, 0.5, seed=0)
    else:
        fit, held = split_by_request(rounds, groups, seed=0)
    source["sts_split"] = split
    temps = C.fit_sts(fit)
    cal = {"temperatures": temps.tolist(),
           "heldout_ece_before": C.summary(C.position_metrics(held))["ece"],
           "heldout_ece_after": C.summary(C.position_metrics(held, temps))["ece"],
           "heldout_brier_before": C.summary(C.position_metrics(held))["brier"],
           "heldout_brier_after": C.summary(C.position_metrics(held, temps))["brier"],
           "heldout_auroc_per_position_before": [m["auroc"] for m in C.position_metrics(held)],
           "heldout_auroc_per_position_after": [m["auroc"] for m in C.position_metrics(held, temps)],
           "fit_rounds": fit.num_rounds, "heldout_rounds": held.num_rounds,
           "mean_accepted": float(rounds.accepted.mean()), "rounds": rounds.num_rounds}
    print(f"drafter rounds: {rounds.num_rounds}, mean accepted {cal['mean_accepted']:.2f}, "
          f"held-out ECE {cal['heldout_ece_before']:.3f} -> {cal['heldout_ece_after']:.3f}", file=sys.stderr)

    fit_name = "none" if args.raw_sps else args.fit
    if args.sps:
        table = tables.SPSTable.load(args.sps, fit=fit_name)
    else:
        tcfg, tparams = checkpoint.load_target(target_dir)
        sizes = profile.default_batch_sizes(max(levels) * (g + 1), dense_up_to=16, growth=1.3)
        if args.smoke:
            sizes = sorted({1, g + 1})
        table = profile.measure_sps(tcfg, tparams, sizes, args.cache_length, iters=3, min_seconds=0.02,
                                    repeats=args.repeats, fit=fit_name,
                                    meta={"target": source["target"]},
                                    progress=lambda b, s: print(f"  SPS({b}) = {s:.1f}", file=sys.stderr))
        table.save(out / "sps.json", force=True)
    clocks = {"fitted": table, "measured": table.fitted("none")}

    conf_held = C.sigmoid(held.logits / np.asarray(temps)).astype(np.float32)
    surv = held.survived()
    prev = np.concatenate([np.ones((held.num_rounds, 1), bool), surv[:, :-1]], axis=1)
    rates = np.array([surv[prev[:, k], k].mean() if prev[:, k].any() else 0.0 for k in range(g)])
    conf_oracle = np.broadcast_to(rates.astype(np.float32), conf_held.shape).copy()
    fs, fp = fit.survived(), np.concatenate([np.ones((fit.num_rounds, 1), bool), fit.survived()[:, :-1]], axis=1)
    fit_rates = np.array([fs[fp[:, k], k].mean() if fp[:, k].any() else 0.0 for k in range(g)])
    conf_fitrates = np.broadcast_to(fit_rates.astype(np.float32), conf_held.shape).copy()
    cal["fit_half_conditional_acceptance"] = fit_rates.tolist()
    cal["heldout_conditional_acceptance"] = rates.tolist()
    cal["heldout_mean_calibrated_confidence"] = [float(conf_held[prev[:, k], k].mean()) for k in range(g)]

    pols = {
        "fixed l=1 (MTP-1)": (policies.FixedPolicy(1), conf_held),
        f"fixed l={g}": (policies.FixedPolicy(g), conf_held),
        f"threshold {args.threshold}": (policies.ThresholdPolicy(args.threshold), conf_held),
        "scheduler": (S.PrefixScheduler(table), conf_held),
        "scheduler-async": (S.AsyncPrefixScheduler(table, delay=2), conf_held),
        "scheduler (oracle-calibrated, diagnostic)": (S.PrefixScheduler(table), conf_oracle),
        "scheduler (fit-half rates, diagnostic)": (S.PrefixScheduler(table), conf_fitrates),
    }
    results = {name: [] for name in pols}
    diagnostics = []
    for r in levels:
        for name, (pol, conf) in pols.items():
            res = simulate(pol, conf, held.accepted, clocks, r, args.rounds, seed=r)
            results[name].append({"concurrency": r, **res})
        sweep = fixed_sweep(conf_held, held.accepted, clocks, r, args.rounds, seed=r)
        best = max(sweep, key=lambda x: x["throughput"])
        sch = results["scheduler"][-1]
        diagnostics.append({"concurrency": r, "fixed_sweep": sweep, "best_fixed_l": best["l"],
                            "best_fixed_throughput": best["throughput"],
                            "best_fixed_predicted": best["predicted_throughput"],
                            "scheduler_throughput": sch["throughput"],
                            "scheduler_predicted": sch["predicted_throughput"],
                            "scheduler_verified_fraction_per_position": sch["verified_fraction_per_position"]})
        line = "  ".join(f"{n.split(' (')[0] if 'diagnostic' not in n else n.split('(')[1].split(',')[0]}: {results[n][-1]['throughput']:.0f}"
                         for n in pols)
        print(f"R={r:>3}  tokens/s  {line}", file=sys.stderr)
        print(f"       best fixed l={best['l']}: realised {best['throughput']:.0f} (model predicts "
              f"{best['predicted_throughput']:.0f}); scheduler realised {sch['throughput']:.0f} (model "
              f"predicts {sch['predicted_throughput']:.0f}), mean l {sch['budget']:.2f}, verified fraction "
              f"per position {sch['verified_fraction_per_position']}", file=sys.stderr)

    main_fixed = [n for n in pols if n.startswith(("fixed", "threshold"))]
    summary = []
    for i, r in enumerate(levels):
        row = {"concurrency": r}
        for n in pols:
            if "diagnostic" not in n:
                row[n] = {"tokens_per_s": round(results[n][i]["throughput"], 1),
                          "mean_budget": round(results[n][i]["budget"], 3)}
        best_n = max(main_fixed, key=lambda n: results[n][i]["throughput"])
        row["best_fixed_policy"] = best_n
        for n in ("scheduler", "scheduler-async"):
            row[f"{n}_vs_best_fixed_policy"] = round(results[n][i]["throughput"]
                                                     / results[best_n][i]["throughput"], 4)
            row[f"{n}_vs_best_fixed_l_0..G"] = round(results[n][i]["throughput"]
                                                     / diagnostics[i]["best_fixed_throughput"], 4)
        summary.append(row)
        print(f"R={r:>3}  " + "  ".join(f"{n.split(' (')[0]}: {row[n]['tokens_per_s']:.0f} tok/s l={row[n]['mean_budget']:.2f}"
                                       for n in pols if "diagnostic" not in n), file=sys.stderr)
    report_head = {"summary": summary}

    report = {**report_head, "mode": "simulated rounds, real SPS table + real drafter confidences/acceptances "
                      "(teacher-forced greedy replay of the " + ("fixture)" if args.target is None else
                                                                 "target's greedy continuations)"),
              "source": source,
              "device": table.meta.get("device"), "sps_table": table.to_json(), "calibration": cal,
              "block_size": g, "rounds_per_point": args.rounds, "concurrency": levels,
              "sps_fit": fit_name, "results": results, "diagnostics": diagnostics,
              "seconds": time.time() - t0}
    (out / "schedule.json").write_text(json.dumps(report, indent=1) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 4, figsize=(19, 4.2))
    for name in pols:
        xs = [p["concurrency"] for p in results[name]]
        style = {"ls": ":", "alpha": 0.6} if "diagnostic" in name else {}
        ax[0].plot(xs, [p["throughput"] for p in results[name]], marker="o", label=name, **style)
        ax[1].plot(xs, [p["per_user"] for p in results[name]], marker="o", label=name, **style)
        ax[2].plot(xs, [p["budget"] for p in results[name]], marker="o", label=name, **style)
    xs = [d["concurrency"] for d in diagnostics]
    ax[0].plot(xs, [d["best_fixed_throughput"] for d in diagnostics], ls="--", color="k", alpha=0.5,
               label="best fixed l in 0..G (per level)")
    bs = np.arange(1, table.max_batch + 1)
    ax[3].plot(bs, 1e3 * table.latency(bs), color="k", label=f"fit: {fit_name}")
    ax[3].scatter(table.batch_sizes, 1e3 / np.asarray(table.meta.get("raw_sps", table.sps)), s=8,
                  color="tab:gray", label="measured")
    ax[3].set_yscale("log")
    ax[3].legend(fontsize=8)
    for a, title in zip(ax, ["throughput (tokens/s, all requests)", "per-user tokens/s",
                             "mean verification budget l per request", "verification latency 1/SPS(B) (ms)"]):
        a.set_title(title, fontsize=10)
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
    for a in ax[:3]:
        a.set_xlabel("concurrent requests")
    ax[1].set_yscale("log")
    ax[3].set_xlabel("verification tokens B")
    ax[0].legend(fontsize=8)
    fig.suptitle(f"{label} (block {g}) on {table.meta.get('device')}; simulated serving rounds")
    fig.tight_layout()
    fig.savefig(out / "schedule.png", dpi=110)
    print(json.dumps({"out": str(out), "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    from dspark_jax.errors import DSparkError
    try:
        sys.exit(main())
    except DSparkError as e:  # bad input: one clean line, exit 2 (as the CLI does)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
