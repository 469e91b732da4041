"""`dspark-jax` console script: one subcommand per module in ``dspark_jax.commands``.

Each command module exposes ``register(subparsers)`` which adds its parser and
sets ``func`` (called with the parsed args; returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dspark_jax.errors import DSparkError

# Subcommand modules, in the order --help lists them.
COMMANDS = (
    "demo", "convert", "generate", "train", "cache", "eval", "calibrate", "profile_sps", "plan",
    "export", "inspect", "data",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark-jax",
        description="DSpark speculative-decoding drafters in JAX: convert PyTorch checkpoints, "
                    "train, generate, evaluate, calibrate and schedule verification.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        # A missing command module is a broken install: let the ImportError surface.
        importlib.import_module(f"dspark_jax.commands.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    from dspark_jax.hardware import quiet_cpu_host
    quiet_cpu_host()  # libtpu installed on a host without a TPU: JAX stays on the CPU
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except DSparkError as e:
        print(f"dspark-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
