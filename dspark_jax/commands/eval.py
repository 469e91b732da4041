"""`dspark-jax eval`: acceptance and confidence metrics of a drafter on prompt datasets."""

from __future__ import annotations

import argparse
import sys

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
the target's tokenizer: a Hugging Face tokenizer applies its chat template (thinking off unless
--thinking); the embedded default's byte tokenizer encodes the plain text. Without --target the
embedded default target is used.

Example:
  dspark-jax eval --draft runs/demo/train/dspark/export --datasets stdlib-heldout --baseline
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, metavar="DIR",
                   help="target checkpoint directory with a tokenizer (default: the embedded default)")
    p.add_argument("--draft", required=True, metavar="DIR", help="drafter checkpoint directory")
    p.add_argument("--datasets", required=True, metavar="NAME[,NAME]",
                   help="dataset names (NAME.jsonl in --data-dir), comma-separated")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="directory of NAME.jsonl prompt files (default: the packaged small copies)")
    p.add_argument("--max-samples", type=int, default=None, metavar="N",
                   help="first N prompts of each dataset (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--verify", default="full", metavar="POLICY",
                   help="verification policy: full | threshold[:C] | fixed:K | scheduler | "
                        "scheduler-async (default full)")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="threshold C for --verify threshold (default 0.5)")
    p.add_argument("--confidence-temperatures", type=float, nargs="+", default=None, metavar="T",
                   help="STS temperatures t_1..t_G (from `dspark-jax calibrate`)")
    p.add_argument("--sps", default=None, metavar="FILE", help="SPS table for scheduler policies")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="enable_thinking in the chat template (default off)")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together (default 1)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (runs are reproducible)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None, metavar="ID",
                   help="stop tokens (default: the target's eos_token_id; the flag alone: none)")
    p.add_argument("--baseline", action="store_true",
                   help="also decode autoregressively and report the speedup")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write eval.json, results/, tb/ and PNGs here (refused if it holds an eval)")
    p.add_argument("--force", action="store_true", help="overwrite an evaluation in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark_jax.pipelines.evaluate import evaluate

    target = args.target
    if target is None:
        from dspark_jax.embedded.default import default_target_dir
        target = default_target_dir()
    evaluate(target, args.draft, args.datasets, data_dir=args.data_dir, max_samples=args.max_samples,
             max_new_tokens=args.max_new_tokens, temperature=args.temperature, verify=args.verify,
             confidence_threshold=args.confidence_threshold, sps_table=args.sps,
             confidence_temperatures=args.confidence_temperatures, thinking=args.thinking,
             batch_size=args.batch_size, seed=args.seed, stop_token_ids=args.stop_token_ids,
             baseline=args.baseline, out=args.out, force=args.force, progress=not args.no_progress,
             printer=lambda s: print(s, file=sys.stdout))
    if args.out:
        print(f"wrote {args.out}/eval.json")
    return 0
