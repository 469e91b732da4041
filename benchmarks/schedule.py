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
- STS temperatures are fitted on half of the rounds; the other half feeds the simulation.
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
Writes OUT/sps.json, OUT/schedule.json, OUT/schedule.png.
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

from dspark_jax import calibrate as C  # noqa: E402
from dspark_jax.convert import checkpoint  # noqa: E402
from dspark_jax.decode import policies, profile  # noqa: E402
from dspark_jax.decode import scheduler as S  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402
from dspark_jax.target import qwen3  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "dspark_qwen3_tiny"


def drafter_rounds(fixture: Path) -> C.Rounds:
    """Real (confidence logits, accepted drafts) for every anchor of the greedy continuations."""
    tcfg, tparams = checkpoint.load_target(fixture / "target")
    dcfg, dparams = checkpoint.load_draft(fixture / "draft")
    dec = json.loads((fixture / "decode_greedy.json").read_text())
    g = dcfg.block_size
    logits, acc = [], []
    for prompt, outp in zip(dec["prompts"], dec["output_ids"]):
        seq = np.asarray(prompt + outp, np.int32)[None]
        s = seq.shape[1]
        hidden, taps, _ = qwen3.forward(tparams, tcfg, jnp.asarray(seq), tap_layer_ids=dcfg.target_layer_ids)
        anchors = np.arange(len(prompt) - 1, s - g)[None]
        fwd = draft_model.training_forward(dparams, dcfg, jnp.asarray(seq), taps, jnp.ones((1, s), jnp.int32),
                                           jnp.asarray(anchors), jnp.ones(anchors.shape, bool))
        match = np.asarray(jnp.argmax(fwd.draft_logits, -1) == fwd.target_ids)[0]   # [N, G]
        acc.append(np.cumprod(match, axis=1).sum(axis=1))
        logits.append(np.asarray(fwd.confidence_logits)[0])
    logits, acc = np.concatenate(logits), np.concatenate(acc)
    return C.Rounds(logits.astype(np.float64), acc.astype(np.int64), np.full(len(acc), g))


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
    ap.add_argument("--fit", choices=S.FITS, default=S.DEFAULT_FIT,
                    help="SPS fit the scheduler plans with and the simulated clock uses (default convex)")
    ap.add_argument("--raw-sps", action="store_true", help="same as --fit none")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved timing passes per size")
    ap.add_argument("--sps", default=None, help="reuse an SPS table (refitted from its raw values)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]

    t0 = time.time()
    rounds = drafter_rounds(FIXTURE)
    g = rounds.block_size
    fit, held = C.split_rounds(rounds, 0.5, seed=0)
    temps = C.fit_sts(fit)
    cal = {"temperatures": temps.tolist(),
           "heldout_ece_before": C.summary(C.position_metrics(held))["ece"],
           "heldout_ece_after": C.summary(C.position_metrics(held, temps))["ece"],
           "mean_accepted": float(rounds.accepted.mean()), "rounds": rounds.num_rounds}
    print(f"drafter rounds: {rounds.num_rounds}, mean accepted {cal['mean_accepted']:.2f}, "
          f"held-out ECE {cal['heldout_ece_before']:.3f} -> {cal['heldout_ece_after']:.3f}", file=sys.stderr)

    fit_name = "none" if args.raw_sps else args.fit
    if args.sps:
        table = S.SPSTable.load(args.sps, fit=fit_name)
    else:
        tcfg, tparams = checkpoint.load_target(FIXTURE / "target")
        sizes = profile.default_batch_sizes(max(levels) * (g + 1), dense_up_to=16, growth=1.3)
        table = profile.measure_sps(tcfg, tparams, sizes, args.cache_length, iters=3, min_seconds=0.02,
                                    repeats=args.repeats, fit=fit_name,
                                    meta={"target": "tests/fixtures/dspark_qwen3_tiny/target"},
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

    report = {"mode": "simulated rounds, real SPS table + real drafter confidences/acceptances "
                      "(teacher-forced greedy replay of the fixture)",
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
    fig.suptitle(f"tiny fixture drafter (block {g}) on {table.meta.get('device')}; simulated serving rounds")
    fig.tight_layout()
    fig.savefig(out / "schedule.png", dpi=110)
    print(json.dumps({"out": str(out), "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
