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
- The SPS curve used is the isotonic (non-increasing) fit of the measurements unless
  --raw-sps (this 2-core shared CPU is noisy; raw values are kept in sps.json meta).
- STS temperatures are fitted on half of the rounds; the other half feeds the simulation.
- The serving loop is simulated: every round, each of R concurrent requests draws one
  held-out round; the policy picks l_r from the calibrated confidences; the round emits
  sum_r (1 + min(accepted_r, l_r)) tokens and costs 1 / SPS(sum_r (1 + l_r)) seconds
  (target verification only; drafting cost is not modelled).

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


def simulate(policy, rounds: C.Rounds, temps, table: S.SPSTable, concurrency: int, n_rounds: int, seed: int):
    rng = np.random.default_rng(seed)
    g = rounds.block_size
    conf_all = C.sigmoid(rounds.logits / np.asarray(temps)).astype(np.float32)
    apply = jax.jit(lambda s, c, a: policy(s, c, a))
    state = policy.init_state(concurrency, g)
    active = jnp.ones((concurrency,), bool)
    tokens = seconds = budget = 0.0
    for _ in range(n_rounds):
        idx = rng.integers(0, rounds.num_rounds, concurrency)
        lengths, state = apply(state, jnp.asarray(conf_all[idx]), active)
        lengths = np.asarray(lengths)
        tokens += float(np.sum(1 + np.minimum(rounds.accepted[idx], lengths)))
        seconds += 1.0 / float(table(int(np.sum(1 + lengths))))
        budget += float(np.mean(lengths))
    return {"throughput": tokens / seconds, "per_user": tokens / seconds / concurrency,
            "budget": budget / n_rounds, "tokens_per_round_per_user": tokens / n_rounds / concurrency}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "schedule"))
    ap.add_argument("--rounds", type=int, default=300, help="simulated rounds per (policy, concurrency)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--cache-length", type=int, default=64)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--raw-sps", action="store_true",
                    help="use the raw (jagged, noisy) measurements instead of their isotonic fit")
    ap.add_argument("--sps", default=None, help="reuse an SPS table instead of measuring one")
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

    if args.sps:
        table = S.SPSTable.load(args.sps)
    else:
        tcfg, tparams = checkpoint.load_target(FIXTURE / "target")
        sizes = profile.default_batch_sizes(max(levels) * (g + 1), dense_up_to=16, growth=1.3)
        table = profile.measure_sps(tcfg, tparams, sizes, args.cache_length, iters=5, min_seconds=0.1,
                                    repeats=3, monotone=not args.raw_sps,
                                    meta={"target": "tests/fixtures/dspark_qwen3_tiny/target"},
                                    progress=lambda b, s: print(f"  SPS({b}) = {s:.1f}", file=sys.stderr))
        table.save(out / "sps.json", force=True)

    pols = {
        "fixed l=1 (MTP-1)": policies.FixedPolicy(1),
        f"fixed l={g}": policies.FixedPolicy(g),
        f"threshold {args.threshold}": policies.ThresholdPolicy(args.threshold),
        "scheduler": S.PrefixScheduler(table),
        "scheduler-async": S.AsyncPrefixScheduler(table, delay=2),
    }
    results = {name: [] for name in pols}
    for r in levels:
        for name, pol in pols.items():
            res = simulate(pol, held, temps, table, r, args.rounds, seed=r)
            results[name].append({"concurrency": r, **res})
        line = "  ".join(f"{n}: {results[n][-1]['throughput']:.0f}" for n in pols)
        print(f"R={r:>3}  tokens/s  {line}", file=sys.stderr)

    report = {"mode": "simulated rounds, real SPS table + real drafter confidences/acceptances "
                      "(teacher-forced greedy replay of the fixture)",
              "device": table.meta.get("device"), "sps_table": table.to_json(), "calibration": cal,
              "block_size": g, "rounds_per_point": args.rounds, "concurrency": levels,
              "results": results, "seconds": time.time() - t0}
    (out / "schedule.json").write_text(json.dumps(report, indent=1) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 4, figsize=(19, 4.2))
    for name in pols:
        xs = [p["concurrency"] for p in results[name]]
        ax[0].plot(xs, [p["throughput"] for p in results[name]], marker="o", label=name)
        ax[1].plot(xs, [p["per_user"] for p in results[name]], marker="o", label=name)
        ax[2].plot(xs, [p["budget"] for p in results[name]], marker="o", label=name)
    bs = np.arange(1, table.max_batch + 1)
    ax[3].plot(bs, table(bs), color="k")
    ax[3].scatter(table.batch_sizes, table.meta.get("raw_sps", table.sps), s=8, color="tab:gray")
    for a, title in zip(ax, ["throughput (tokens/s, all requests)", "per-user tokens/s",
                             "mean verification budget l per request", "measured SPS(B)"]):
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
