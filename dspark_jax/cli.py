"""`dspark-jax` console script: one subcommand per module in ``dspark_jax.commands``.

Each command module exposes ``register(subparsers)`` which adds its parser and
sets ``func`` (called with the parsed args; returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dspark_jax.errors import DSparkError, os_error_line

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
    from dspark_jax import interrupt
    from dspark_jax.costs.hardware import quiet_cpu_host, set_gpu_flags

    quiet_cpu_host()  # libtpu installed on a host without a TPU: JAX stays on the CPU
    set_gpu_flags()  # the XLA:GPU flags our programs are compiled with (hardware.GPU_XLA_FLAGS)
    command = "?"
    try:
        with interrupt.sigint_recorded():  # from the start: imports run JAX's gc callbacks too
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "func", None):
                parser.print_help()
                return 2
            command = " ".join(filter(None, (args.command, getattr(args, "data_command", None))))
            code = int(args.func(args) or 0)
            if interrupt.requested():  # a Ctrl-C that a callback swallowed: still interrupted
                raise KeyboardInterrupt
            return code
    except KeyboardInterrupt:
        _end_progress_bars()
        print("interrupted", file=sys.stderr)
        return 130
    except DSparkError as e:
        _end_progress_bars()
        print(f"dspark-jax {command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the environment refused (read-only or missing path, full disk): one line
        _end_progress_bars()
        print(f"dspark-jax {command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2


def _end_progress_bars() -> None:
    """Close the progress bars an error left open, so the message starts on a clean line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
