"""`dspark-jax train --config configs/<name>.py [key=value ...]`: train a DSpark drafter."""

from __future__ import annotations

import os
import sys


def maybe_initialize_distributed() -> None:
    """Call ``jax.distributed.initialize`` when the environment describes a multi-process run.

    Local/gloo runs (launch/local.py) set DSPARK_COORDINATOR_ADDRESS, DSPARK_NUM_PROCESSES,
    DSPARK_PROCESS_ID (CPU collectives then go over gloo). TPU pods and SLURM set
    DSPARK_DISTRIBUTED=auto so JAX detects the cluster itself.
    """
    import jax
    addr = os.environ.get("DSPARK_COORDINATOR_ADDRESS")
    if addr:
        if os.environ.get("JAX_PLATFORMS", "") in ("cpu", "") or jax.config.jax_platforms == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=addr,
                                   num_processes=int(os.environ["DSPARK_NUM_PROCESSES"]),
                                   process_id=int(os.environ["DSPARK_PROCESS_ID"]))
    elif os.environ.get("DSPARK_DISTRIBUTED") == "auto":
        jax.distributed.initialize()


def run(args) -> int:
    maybe_initialize_distributed()
    import jax
    from dspark_jax.train.config import load_config
    from dspark_jax.train.loop import train
    if args.matmul_precision:
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, force_resume=args.force_resume)
    if summary.get("finished"):
        if jax.process_index() == 0:
            print(f"dspark-jax train: {summary['message']}", file=sys.stderr)
        return 0
    if jax.process_index() == 0:
        printable = {k: v for k, v in summary.items() if k not in ("history", "params")}
        from dspark_jax.fileio import dumps
        print(dumps(printable, indent=1))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a DSpark drafter (sharded, resumable, multi-host)",
        description="Train a DSpark drafter against a frozen target. The config file defines "
                    "CONFIG = dict(...) of TrainConfig fields (see dspark_jax/train/config.py); "
                    "key=value arguments override them, with dotted paths for nested fields (draft.<field>, "
                    "optimizer.<field>, loss.<field>, checkpoint.<field>, memory.<field>). "
                    "Target features come from a cache (features=cache cache_dir=...) written by "
                    "`dspark-jax cache`, or are computed online by the frozen target inside the step. "
                    "Runs resume from the newest checkpoint in output_dir; run.json there records what "
                    "defines the run (data file path/size/sha256 or the cache manifest, feature mode, "
                    "optimizer, loss, drafter and target identity, steps) and a rerun that differs is "
                    "refused naming the fields (--force-resume accepts it). Rerunning a finished run "
                    "reports it finished and changes nothing. Multi-process: see launch/.")
    p.add_argument("--config", required=True, help="python config file, e.g. configs/tiny.py")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides, e.g. steps=100 mesh=data=2,fsdp=2 draft.markov_rank=0 "
                        "optimizer.learning_rate=1e-3 (steps=0, the default: train `epochs` passes "
                        "over the data)")
    p.add_argument("--force-resume", action="store_true",
                   help="resume output_dir's run even if its run.json differs from this config "
                        "(data, feature mode, optimizer/loss settings, drafter, target, steps)")
    p.add_argument("--matmul-precision", default=None, choices=["default", "high", "highest"],
                   help="jax_default_matmul_precision for the run")
    p.set_defaults(func=run)
