"""The decode engine measured end to end: a mixed request stream at several concurrencies.

    nice -n 15 python benchmarks/engine.py [--out DIR] [--smoke] [--target DIR --draft DIR]
    python benchmarks/engine.py --target dspark_jax/assets/default_target \
        --draft runs/demo/train/dspark/export --texts runs/demo/data/prompts.jsonl --out DIR

A stream of requests with mixed prompt lengths and output budgets (stop tokens on) is decoded
with AR, fixed:1, fixed:G, threshold and the prefix scheduler, each with static batching
(batches of C requests that run until their slowest row ends) and continuous batching (C slots,
a finished row takes the next request at once), at arrival concurrencies C (default
1,2,4,8,16,32,64; the stream holds ``--requests-per-slot`` x C requests, at least 16).
Default pair: the tiny reference fixture (tests/fixtures/dspark_qwen3_tiny); pass a trained
pair with --target/--draft (e.g. the embedded target and a drafter from ``dspark-jax demo``).
The scheduler's round table (whole rounds/s of the decode program at each slot count and
verification width, ``decode.profile.measure_rounds``) is measured first on the same pair.

Every configuration is warmed up on prompts that cover its compiled shapes (static: one batch
with the longest prompt; continuous: one prompt per prompt bucket), then timed once; the
number of XLA compilations during the timed runs is reported (should be 0).

Reports per (C, method, batching): tokens/s, per-user tokens/s (mean over requests of tokens /
(finish - start)), mean verification budget (drafts verified per round), tau. Writes
DIR/engine.json and DIR/engine.png (Fig. 8 style: throughput, per-user speed and mean
verification budget vs concurrency); a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.monitoring
import numpy as np

from dspark_jax.convert.checkpoint import load_draft, load_target
from dspark_jax.decode import FixedPolicy, ThresholdPolicy, decode_requests, profile, shapes, summarize
from dspark_jax.decode import scheduler as S
from dspark_jax.fileio import write_json
from dspark_jax.costs.compiles import COMPILES

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/dspark_qwen3_tiny"
def make_stream(base_prompts, n: int, vocab: int, max_new: int, seed: int, random_share: float = 0.3):
    """n requests: prompts = a base prompt cut to a random length (>= 2) or, with probability
    ``random_share``, random tokens (lengths 2..3x the longest base prompt); budgets uniform in
    [max_new // 8, max_new]."""
    rng = np.random.default_rng(seed)
    longest = max(len(p) for p in base_prompts)
    prompts, budgets = [], []
    for _ in range(n):
        if rng.random() >= random_share:
            p = base_prompts[int(rng.integers(len(base_prompts)))]
            prompts.append(list(p[:int(rng.integers(2, len(p) + 1))]))
        else:
            prompts.append(rng.integers(0, vocab, size=int(rng.integers(2, 3 * longest))).tolist())
        budgets.append(int(rng.integers(max(1, max_new // 8), max_new + 1)))
    return prompts, budgets


def base_prompts(args, tc):
    """(prompt id lists the stream is cut from, stop ids): --texts tokenized with the target's
    tokenizer, else the token lists of --prompts; stops from --stop-ids or the default."""
    if args.texts:
        from dspark_jax.fileio import iter_jsonl
        from dspark_jax.tokenizer import encode_prompt, load_tokenizer
        tok = load_tokenizer(args.target, required=True)
        base = [encode_prompt(tok, r["text"], raw=True)[-args.max_prompt_tokens:]
                for _, r in iter_jsonl(args.texts, "text prompts")]
        stops = [int(tok.eos_token_id)]
    else:
        d = json.loads(Path(args.prompts).read_text())
        base = d["prompts"]
        # Stop tokens on: a token the fixture's outputs contain now and then.
        stops = [int(d.get("output_ids", [[2] * 21])[0][20])]
    if args.stop_ids:
        stops = [int(x) for x in args.stop_ids.split(",")]
    return base, stops


def run_one(tc, tp, dc, dp, prompts, budgets, *, batching, slots, policy, stops, cache_len):
    """Warm up, then time one decode of the stream; returns (results, stats, compiles)."""
    kw = dict(draft_cfg=dc, draft_params=dp, batching=batching, batch_size=slots, policy=policy,
              stop_token_ids=stops, max_cache_len=cache_len)
    if batching == "static":
        i = int(np.argmax([len(p) for p in prompts]))
        warm = [i]
    else:
        warm = shapes.warmup_prompts(prompts, cache_len)
    wb = [max(budgets)] * len(warm)
    decode_requests(tc, tp, [prompts[i] for i in warm],
                           max_new_tokens=wb if batching == "continuous" else max(budgets), **kw)
    before, st = COMPILES[0], {}
    res = decode_requests(tc, tp, prompts, max_new_tokens=budgets, stats=st, **kw)
    return res, st, COMPILES[0] - before


def per_user(results, batching) -> float:
    if batching == "continuous":
        return float(np.mean([r.tokens_per_second for r in results]))
    return float(np.mean([len(r.output_ids) / r.batch_seconds for r in results]))


def plot(rows, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    keys = sorted({(r["method"], r["batching"]) for r in rows})
    for method, batching in keys:
        sel = sorted((r for r in rows if r["method"] == method and r["batching"] == batching),
                     key=lambda r: r["concurrency"])
        c = [r["concurrency"] for r in sel]
        style = "-" if batching == "continuous" else "--"
        lab = f"{method} ({batching})"
        axes[0].plot(c, [r["tokens_per_second"] for r in sel], style, marker="o", label=lab)
        axes[1].plot(c, [r["per_user_tokens_per_second"] for r in sel], style, marker="o", label=lab)
        axes[2].plot(c, [r["mean_verify_budget"] for r in sel], style, marker="o", label=lab)
    for ax, t in zip(axes, ("throughput (tokens/s)", "per-user tokens/s", "mean verification budget")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(t)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(FIXTURE / "target"))
    ap.add_argument("--draft", default=str(FIXTURE / "draft"))
    ap.add_argument("--prompts", default=str(FIXTURE / "decode_greedy.json"),
                    help="JSON with 'prompts' (token-id lists) the stream is cut from")
    ap.add_argument("--texts", default=None, metavar="JSONL",
                    help="instead of --prompts: text prompts (rows with 'text', e.g. a demo's "
                         "data/prompts.jsonl) tokenized raw with the target's tokenizer, each keeping "
                         "its last --max-prompt-tokens tokens; no random-token prompts then")
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--stop-ids", default=None,
                    help="comma-separated stop token ids (default: a token the fixture's outputs "
                         "contain now and then; with --texts the tokenizer's eos id)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--methods", default="ar,fixed:1,fixed:G,threshold,scheduler")
    ap.add_argument("--batching", default="static,continuous")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, metavar="DIR", help="write DIR/engine.json, DIR/engine.png")
    ap.add_argument("--smoke", action="store_true", help="smallest settings")
    args = ap.parse_args(argv)
    if args.smoke:
        args.concurrency, args.max_new_tokens, args.methods = "2", 8, "ar,scheduler"
        args.requests_per_slot = 2

    tc, tp = load_target(args.target)
    dc, dp = load_draft(args.draft)
    g = dc.block_size
    base, stops = base_prompts(args, tc)
    concs = [int(c) for c in args.concurrency.split(",")]

    t0 = time.perf_counter()
    # The scheduler's cost: whole rounds of the decode program at every slot count run here
    # and every compiled verification width (a round table; decode.profile.measure_rounds).
    sps = profile.measure_rounds(tc, tp, dc, dp, concs, 64, rounds=8, warmup=1,
                                 min_seconds=0.2 if not args.smoke else 0.0,
                                 repeats=20 if not args.smoke else 2)
    print(f"round table: slots {list(sps.batch_sizes)} x widths {list(sps.widths)} in "
          f"{time.perf_counter() - t0:.0f}s", file=sys.stderr)
    policies = {"ar": None, "fixed:1": FixedPolicy(1), "fixed:G": FixedPolicy(g),
                "threshold": ThresholdPolicy(args.threshold), "scheduler": S.make_policy("scheduler", sps)}
    methods = args.methods.split(",")

    rows = []
    print(f"{'C':>3} {'method':>10} {'batching':>10} {'tok/s':>9} {'user tok/s':>10} "
          f"{'budget':>6} {'tau':>5} {'compiles':>8}")
    for c in concs:
        n = max(16, args.requests_per_slot * c)
        prompts, budgets = make_stream(base, n, tc.vocab_size, args.max_new_tokens, args.seed + c,
                                       random_share=0.0 if args.texts else 0.3)
        _, cache_len = shapes.plan_shapes(prompts, args.max_new_tokens, g,
                                        min(tc.max_position_embeddings, dc.max_position_embeddings), None)
        for method in methods:
            for batching in args.batching.split(","):
                spec = method != "ar"
                res, st, compiles = run_one(tc, tp, dc if spec else None, dp if spec else None,
                                            prompts, budgets, batching=batching, slots=c,
                                            policy=policies[method], stops=stops, cache_len=cache_len)
                s = summarize(res, g if spec else None)
                row = {"concurrency": c, "method": method, "batching": batching, "requests": n,
                       "output_tokens": st["output_tokens"], "seconds": st["seconds"],
                       "tokens_per_second": st["tokens_per_second"],
                       "per_user_tokens_per_second": per_user(res, batching),
                       "mean_verify_budget": s["mean_proposal"] if spec else 0.0,
                       "tau": s["tau"], "timed_compiles": compiles}
                if batching == "continuous":
                    row["mean_ttft_s"] = float(np.mean([r.ttft_s for r in res]))
                rows.append(row)
                print(f"{c:>3} {method:>10} {batching:>10} {row['tokens_per_second']:>9.1f} "
                      f"{row['per_user_tokens_per_second']:>10.1f} {row['mean_verify_budget']:>6.2f} "
                      f"{row['tau']:>5.2f} {compiles:>8}", flush=True)

    summary = {}
    for c in concs:
        at = {(r["method"], r["batching"]): r for r in rows if r["concurrency"] == c}
        entry = {}
        for m in methods:
            if (m, "static") in at and (m, "continuous") in at:
                entry[f"continuous_over_static[{m}]"] = (at[(m, "continuous")]["tokens_per_second"]
                                                         / at[(m, "static")]["tokens_per_second"])
        fixed = [at[(m, "continuous")]["tokens_per_second"] for m in ("fixed:1", "fixed:G")
                 if (m, "continuous") in at]
        if fixed and ("scheduler", "continuous") in at:
            entry["scheduler_over_best_fixed"] = at[("scheduler", "continuous")]["tokens_per_second"] / max(fixed)
        summary[c] = entry
    print(json.dumps(summary, indent=1))
    report = {"config": {k: v for k, v in vars(args).items()}, "block_size": g,
              "stop_token_ids": stops, "round_table": sps.to_json(),
              "rows": rows, "summary": {str(k): v for k, v in summary.items()},
              "total_compiles": COMPILES[0], "devices": str(jax.devices()[0])}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "engine.json", report)
        png = plot(rows, out / "engine.png")
        print(f"wrote {out / 'engine.json'}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
