"""`dspark-jax demo`: the whole DSpark story on the embedded default target, on a laptop CPU."""

from __future__ import annotations

import argparse
import json

from dspark_jax.commands.common import add_decode_flags

HELP = "train DSpark and DFlash drafters on the embedded default target and compare them"
DESCRIPTION = """\
The first command to run. With the embedded default target (a tiny byte-level Qwen3 LM trained
on the Python standard library; no download), the demo
  1. sample:  cuts prompts from the standard library's TRAIN files and lets the target continue
              them (drafters learn the target's own outputs; loss only on the continuation),
  2. train:   trains a DSpark drafter (Markov head + confidence head) and a DFlash drafter
              (markov_rank 0) with the same data, steps, batch, learning rate and seed,
  3. decode:  decodes held-out prompts (standard-library files the target never saw) three ways:
              autoregressive, DFlash, DSpark -- same prompts, max_new_tokens and temperature:
              temperature 1.0 (the paper's setting) and again greedy, both lossless,
  4. report:  prints two tables (tau, accept_rate@k, verify_rate, tokens/s, speedup over
              autoregressive, degenerate outputs and whitespace share, target row included)
              and three sample continuations with each round's accepted draft span marked,
              and saves report.json, table.txt, acceptance.png, reliability_<drafter>.png and
              TensorBoard scalars under --out.
Finished stages are reused (an interrupted demo resumes); --stage runs one stage alone (re-run
it with --force). A finished demo is not overwritten without --force. The default run takes a
few minutes on 2 idle CPU cores (206 s of CPU time); --quick runs every stage at tiny sizes
with meaningless numbers (77 s of CPU time, mostly compilation).
The report lists the equivalent `dspark-jax train` / `dspark-jax eval` commands.
"""


def register(subparsers) -> None:
    from dspark_jax.pipelines.demo import DemoConfig, STAGES

    d = DemoConfig()
    p = subparsers.add_parser("demo", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default runs/demo, or runs/demo-quick with --quick)")
    p.add_argument("--stage", default="all", choices=("all",) + STAGES,
                   help="run one stage only (its inputs must exist); default: all, resuming")
    p.add_argument("--force", action="store_true",
                   help="replace a finished demo (with --stage: re-run that stage)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, every stage, meaningless numbers (77 s of CPU time; for tests "
                        "and smoke checks)")
    p.add_argument("--target", default="", metavar="DIR",
                   help="target checkpoint directory with a tokenizer (default: the embedded default)")
    p.add_argument("--steps", type=int, default=None, help=f"training steps per drafter (default {d.steps})")
    p.add_argument("--num-train-prompts", type=int, default=None,
                   help=f"training prompts sampled (default {d.num_train_prompts})")
    p.add_argument("--num-eval-prompts", type=int, default=None,
                   help=f"held-out prompts decoded (default {d.num_eval_prompts})")
    add_decode_flags(p, ("max_new_tokens", "temperature", "seed"),
                     defaults={"max_new_tokens": None, "temperature": None, "seed": None},
                     helps={"max_new_tokens": f"new tokens per held-out prompt (default {d.max_new_tokens})",
                            "temperature": "temperature of the headline table; 0 = greedy only (default 1.0; a greedy "
                                           "table follows)",
                            "seed": "seed of data, init and decoding (default 0)"})
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def config_from_args(args):
    from dspark_jax.pipelines.demo import DemoConfig, quick_config

    changes = {k: v for k, v in (("steps", args.steps), ("num_train_prompts", args.num_train_prompts),
                                 ("num_eval_prompts", args.num_eval_prompts),
                                 ("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature),
                                 ("seed", args.seed)) if v is not None}
    if args.target:
        changes["target"] = args.target
    if args.quick:
        return quick_config(args.out or "runs/demo-quick", **changes)
    return DemoConfig(out=args.out or "runs/demo", **changes)


def run(args) -> int:
    from dspark_jax.fileio import check_output
    from dspark_jax.pipelines.demo import CONFIG_FILE, run_demo

    cfg = config_from_args(args)
    # a file, an input inside, or an unwritable parent; demo.json decides the rest
    check_output(cfg.out, force=True, kind="dir", reuse=True, marker=(CONFIG_FILE,), inputs={"--target": args.target})
    info = run_demo(cfg, stage=args.stage, force=args.force, progress=not args.no_progress)
    report = info.get("report")
    if report:
        print("reproduce stage by stage:")
        for name, cmd in report["commands"].items():
            print(f"  {name}: {cmd}")
    print(json.dumps({"out": cfg.out, "stages": [k for k in info if not k.endswith("_seconds") and k != "wall_s"],
                      "stage_seconds": {k[:-8]: round(v, 1) for k, v in info.items() if k.endswith("_seconds")},
                      "wall_s": round(info["wall_s"], 1)}))
    return 0
