"""`dspark-jax bench`: aggregate throughput vs per-user speed, measured and projected."""

from __future__ import annotations

import argparse
import sys

HELP = "throughput vs per-user-speed frontier of AR and drafters x policies (measured / projected)"
DESCRIPTION = """\
Serve a request stream through the continuous engine for the target alone (curve "ar") and for
every drafter x verification policy (curve "<drafter>/<policy>") at each concurrency C (C slots,
all requests queued at t = 0, greedy), and report per point: aggregate tokens/s, per-user
tokens/s (mean, p50, p90: a request's tokens / (its finish - its slot start)), tau (tokens per
round per request), the mean verification budget (tokens sent to the target per request per
verify step, 1 for AR) and TTFT (from arrival, queueing included), plus the XLA compilations of
the timed runs (0: everything compiled in the warm-up).

Measured mode (no --round-table) also measures what a projection reads (round table of each
drafter at the concurrencies, AR steps/s, per-request host seconds) and logs each drafter's
rounds under full verification, then projects the same curves from them: the projection is
checked against the measurement (target: within 15% throughput at every C). Projected mode
(--round-table [+ --logs]) runs no model: the engine's slot loop is replayed on the table's clock
with the logged acceptance; every projected row names its cost and acceptance source.

Outputs under --out: bench.json (rows with drafter, verify, concurrency, throughput,
per_user_tokens_per_second, tau, verification_budget, source = measured | projected), table.txt,
frontier.png (paper Fig. 7), budget.png (Fig. 8), round_tables/ and logs/ (measured mode).
The SLA report reads each curve's fitted frontier (Pareto points, log-log interpolation): the
throughput at each --sla per-user speed and the per-user speed at the baseline's throughputs,
relative to --baseline. CPU numbers on a shared machine are noisy: read them as such.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="DIR",
                   help="target checkpoint directory (projected mode: or a preset name)")
    p.add_argument("--draft", action="append", default=[], metavar="[NAME=]DIR",
                   help="drafter directory (repeatable; any kind the decode round serves); the "
                        "curve is named NAME, else the directory's name (its parent's for a "
                        "generic 'export'); none: AR only")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help="prompts ({'prompt_ids': [...]} or {'text': ...} lines, text "
                          "encoded raw)")
    src.add_argument("--datasets", metavar="NAMES",
                     help="comma-separated eval dataset names (default: eval's default datasets)")
    p.add_argument("--verify", default="full", metavar="LIST",
                   help="comma-separated policies: full, fixed:K, threshold[:C], scheduler (plans "
                        "with the round table), scheduler-async[:D] (measured mode only: a token "
                        "table is measured for it) (default full)")
    p.add_argument("--concurrency", default="1,2,4,8", metavar="LIST",
                   help="comma-separated concurrencies (slots), each >= 1 (default 1,2,4,8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="budget per request (default 64)")
    p.add_argument("--sla", default=None, metavar="LIST",
                   help="per-user speeds (tok/s) at which the SLA report reads throughput")
    p.add_argument("--baseline", default="ar", metavar="NAME",
                   help="curve the SLA report compares with: ar (default) or <drafter>/<policy>")
    p.add_argument("--round-table", action="append", default=[], metavar="FILE",
                   help="projected mode: the cost of a round at (slots, width) and of an AR step "
                        "(profile-sps --draft, plan --round-table, or a bench's round_tables/), "
                        "one per --draft in order (AR only: one file with ar_rps)")
    p.add_argument("--logs", action="append", default=[], metavar="FILE",
                   help="projected mode: logged rounds of real decoding under --verify full (a "
                        "bench's logs/, or generate / eval result JSONL), one per --draft")
    p.add_argument("--acceptance", metavar="FILE",
                   help="projected mode, instead of --logs: a per-position conditional acceptance "
                        "profile ({'source': ..., 'drafters': {NAME: {'conditional_acceptance': "
                        "[c1..cG], 'confidence_head': bool}}}); --draft then names its drafters; "
                        "rows carry the profile's source as their acceptance source")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the rounds drawn from --acceptance (default 0)")
    p.add_argument("--compare", metavar="BENCH.json",
                   help="projected mode: a measured bench.json whose rows are set beside the "
                        "projection (table, figures, and the per-concurrency agreement)")
    p.add_argument("--requests-per-slot", type=int, default=2,
                   help="requests per slot in a stream (default 2)")
    p.add_argument("--min-requests", type=int, default=8,
                   help="least requests per stream (default 8)")
    p.add_argument("--max-prompts", type=int, default=16, help="distinct prompts used (default 16)")
    p.add_argument("--max-prompt-tokens", type=int, default=64,
                   help="a prompt keeps its last N tokens (default 64)")
    p.add_argument("--quick", action="store_true", help="shortest cost profiling (tests, smoke)")
    p.add_argument("--out", metavar="DIR", help="output directory (refused if it holds a bench)")
    p.add_argument("--force", action="store_true", help="overwrite a bench in --out")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark_jax.pipelines.bench import bench

    bench(args.target, args.draft, prompts=args.prompts, datasets=args.datasets,
          verify=args.verify, concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
          sla=args.sla, baseline=args.baseline, round_tables=args.round_table, logs=args.logs,
          out=args.out, force=args.force, requests_per_slot=args.requests_per_slot,
          min_requests=args.min_requests, max_prompts=args.max_prompts,
          max_prompt_tokens=args.max_prompt_tokens, quick=args.quick, compare=args.compare,
          acceptance=args.acceptance, seed=args.seed, printer=lambda s: print(s, flush=True))
    if args.out:
        print(f"wrote {args.out}/bench.json, table.txt, frontier.png, budget.png", file=sys.stderr)
    return 0
