"""`dspark-jax calibrate`: fit STS confidence temperatures on decode logs (Sequential Temperature Scaling)."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit per-position confidence temperatures (STS) on decode logs",
        description=(
            "Sequential Temperature Scaling: from decode logs (raw confidence logits per round, "
            "accepted drafts, proposal length) fit one temperature per block position, left to "
            "right, minimising the ECE of the cumulative confidence against observed prefix "
            "acceptance. Positions that were not verified are ignored. A random part of the "
            "rounds is held out and ECE / AUROC / Brier per position are reported on it before "
            "and after. Writes OUT/sts.json and OUT/reliability.png (and OUT/draft with "
            "--write-draft). Logs: JSONL of `generate` results (per-round lists "
            "confidence_logits, accepted_drafts, proposal_lengths) or one round per line "
            "({confidence_logits: [G], accepted: n, proposal: l})."),
    )
    p.add_argument("--logs", required=True, help="decode log JSONL (from `dspark-jax generate`)")
    p.add_argument("--out", required=True, help="output directory (created; refused if it exists)")
    p.add_argument("--holdout", type=float, default=0.3,
                   help="fraction of rounds held out for the reported metrics (default 0.3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fit/held-out split")
    p.add_argument("--bins", type=int, default=15, help="ECE / reliability bins (default 15)")
    p.add_argument("--refit-all", action="store_true",
                   help="after reporting held-out metrics, refit the saved temperatures on all rounds")
    p.add_argument("--draft", help="drafter directory the logs came from (needed for --write-draft)")
    p.add_argument("--target", help="target directory the logs were decoded with: --draft is checked "
                                    "to be its drafter before anything is written")
    p.add_argument("--write-draft", action="store_true",
                   help="also write OUT/draft: a copy of --draft with the temperatures saved in its "
                        "extras (sts_temperatures), which `generate` applies")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark_jax.errors import InputError
    from dspark_jax.pipelines import calibrate as C

    if args.bins < 2:
        raise InputError(f"--bins must be >= 2, got {args.bins}")
    if args.write_draft and not args.draft:
        raise InputError("--write-draft needs --draft DIR (the drafter to save the temperatures with)")
    from dspark_jax.fileio import check_output, dumps

    out = check_output(args.out, force=args.force, kind="dir",
                       inputs={"--logs": args.logs, "--draft": args.draft, "--target": args.target})
    if args.target:
        if not args.draft:
            raise InputError("--target is checked against --draft: give --draft DIR too")
        from dspark_jax.pairing import check_pair_paths
        check_pair_paths(args.target, args.draft)
    if not 0 < args.holdout < 1:
        raise InputError(f"--holdout must be in (0, 1), got {args.holdout}")
    report = C.run_sts(args.logs, out, draft=args.draft, holdout=args.holdout, seed=args.seed,
                       bins=args.bins, refit_all=args.refit_all, write_draft=args.write_draft,
                       force=args.force)
    temps = report["temperatures"]

    b, a = report["heldout"]["before"], report["heldout"]["after"]
    print(f"STS on {report['fit_rounds']} rounds, metrics on {report['heldout_rounds']} held-out rounds",
          file=sys.stderr)
    print("pos      n   ECE before->after   Brier before->after   AUROC(cum) before->after  AUROC(cond)",
          file=sys.stderr)
    for pb, pa, t in zip(b["positions"], a["positions"], temps):
        print(f"{pb['position']:>3} {pb['n']:>6}   {100 * pb['ece']:6.2f}% -> {100 * pa['ece']:5.2f}%"
              f"   {pb['brier']:.4f} -> {pa['brier']:.4f}   {pb['auroc']:.4f} -> {pa['auroc']:.4f}"
              f"   {pa['cond_auroc']:.4f}   t={t:.3f}", file=sys.stderr)
    print(dumps({"out": str(out), "temperatures": report["temperatures"],
                      "heldout_ece_before": b["summary"]["ece"], "heldout_ece_after": a["summary"]["ece"]}))
    return 0
