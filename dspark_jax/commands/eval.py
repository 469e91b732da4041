"""`dspark-jax eval`: acceptance and confidence metrics of a drafter on prompt datasets."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.commands.common import add_decode_flags, decode_options

HELP = "evaluate a drafter on benchmark prompt files (tau, acceptance, calibration)"
DESCRIPTION = """\
Decode the first turn of every prompt of each dataset with lossless speculative decoding and
report, per dataset: tau (mean acceptance length per round, bonus included), proposal length,
verify_rate, accept_rate@k (prefix survival), conditional acceptance at k, tokens/s, and with a
confidence head ECE / AUROC / Brier per block position. A table goes to stdout; with --out,
eval.json, per-prompt results (results/<dataset>.jsonl, usable by `dspark-jax calibrate`),
TensorBoard scalars (tb/) and PNGs (acceptance_<dataset>.png, reliability_<dataset>.png).

Datasets are NAME.jsonl files in --data-dir in the reference format, one {"turns": ["..."]}
object per line (first turn used); without --data-dir the small copies packaged with dspark-jax
are used (gsm8k, humaneval, math500, mbpp, mt-bench, stdlib-heldout). The prompt is built with
the target's tokenizer and its chat template (thinking off unless --thinking), or as plain
text with --raw-prompt (the byte tokenizer: <|bos|> + text), exactly as `generate` does.
Without --target the embedded default target is used.

Example:
  dspark-jax eval --draft runs/demo/train/dspark/export --datasets stdlib-heldout --raw-prompt --baseline
  (the demo trains on plain standard-library text, hence --raw-prompt)
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, metavar="DIR",
                   help="target checkpoint directory with a tokenizer (default: the embedded default)")
    p.add_argument("--draft", required=True, metavar="DIR", help="drafter checkpoint directory")
    p.add_argument("--datasets", default=None, metavar="NAME[,NAME]",
                   help="dataset names (NAME.jsonl in --data-dir), comma-separated (default with the "
                        "embedded target: stdlib-heldout; required with any other --target)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="directory of NAME.jsonl prompt files (default: the packaged small copies)")
    p.add_argument("--max-samples", type=int, default=None, metavar="N",
                   help="first N prompts of each dataset (default: all)")
    add_decode_flags(p)
    p.add_argument("--baseline", action="store_true",
                   help="also decode autoregressively and report the speedup")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write eval.json, results/, tb/ and PNGs here (refused if it holds an eval)")
    p.add_argument("--force", action="store_true", help="overwrite an evaluation in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    options = decode_options(args)  # flag errors before the heavy imports
    from dspark_jax.commands.train import maybe_initialize_distributed
    from dspark_jax.fileio import check_output
    from dspark_jax.pipelines.evaluate import evaluate

    maybe_initialize_distributed()  # under launch/ (multi-process --mesh); no-op otherwise

    if args.out:  # a folder of ours is reused (the pipeline refuses one holding an eval without --force)
        check_output(args.out, force=True, kind="dir", reuse=True, marker=("eval.json",),
                     inputs={"--target": args.target, "--draft": args.draft, "--data-dir": args.data_dir})

    target = args.target
    if target is None:
        from dspark_jax.embedded.default import default_target_dir
        target = default_target_dir()
    evaluate(target, args.draft, args.datasets, data_dir=args.data_dir, max_samples=args.max_samples,
             options=options, baseline=args.baseline, out=args.out, force=args.force,
             progress=not args.no_progress, printer=lambda s: print(s, file=sys.stdout))
    if args.out:
        print(f"wrote {args.out}/eval.json")
    return 0
