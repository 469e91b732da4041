"""`dspark-jax data SUBCOMMAND`: look at (and make) training data.

``inspect FILE``: token and loss-mask statistics and a sample with the trained spans marked.
``regenerate``: on-policy training data (``dspark_jax.commands.data_regenerate``). Each
subcommand module exposes ``add_parser(subparsers)``.
"""

from __future__ import annotations

import argparse


def run_inspect(args) -> int:
    import json
    import sys
    from pathlib import Path

    from dspark_jax.data.inspect import inspect_data, report
    from dspark_jax.errors import InputError, require_positive_int
    from dspark_jax.fileio import check_output, write_json
    from dspark_jax.tokenizer import load_tokenizer

    if args.rows < 0:
        raise InputError(f"--rows must be >= 0, got {args.rows}")
    if args.max_length is not None:
        require_positive_int(args.max_length, "--max-length")
    if args.json:
        check_output(args.json, force=args.force, flag="--json",
                     inputs={"FILE": args.file, "--tokenizer": args.tokenizer, "--target": args.target})
    tokenizer = None
    if args.tokenizer or args.target:
        source = args.tokenizer or args.target
        if not Path(source).is_dir():
            flag = "--tokenizer" if args.tokenizer else "--target"
            raise InputError(f"{flag} {str(source)!r} does not exist or is not a directory")
        # --tokenizer must hold one; a --target without one still reads token-id data (the ids
        # are shown as numbers), chat rows then need a tokenizer (one line from inspect_data)
        tokenizer = load_tokenizer(source, required=bool(args.tokenizer))
    info = inspect_data(args.file, tokenizer=tokenizer, fmt=args.format, thinking=args.thinking,
                        max_length=args.max_length, sample_rows=args.rows)
    print(report(info, color=sys.stdout.isatty()))
    if args.json:
        write_json(args.json, info, force=args.force)
        print(json.dumps({"json": str(args.json)}))
    return 0


def add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect", help="token and loss-mask statistics of a training file, with a marked sample",
        description="Read a training file the way `train` does (tokens JSONL with loss_mask, or chat "
                    "JSONL rendered with a tokenizer's chat template) and print: rows, tokens, trained "
                    "tokens (loss_mask > 0) and their share, row-length percentiles, rows with no "
                    "trained token, rows longer than --max-length, and the first --rows rows with "
                    "the trained spans marked (green on a terminal, else within « »).")
    p.add_argument("file", metavar="FILE", help="JSONL training data")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (HF or dspark byte tokenizer)")
    tok.add_argument("--target", metavar="DIR", help="target checkpoint directory: use its tokenizer")
    p.add_argument("--format", default="auto", choices=("auto", "tokens", "chat"),
                   help="row format (default: from the first row)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="enable_thinking for the chat template (default: the template's default), "
                        "as train's chat_thinking")
    p.add_argument("--rows", type=int, default=3, help="rows to show (default 3; 0: none)")
    p.add_argument("--max-length", type=int, default=None,
                   help="count the rows longer than this (train cuts them) and the trained tokens lost")
    p.add_argument("--json", metavar="OUT", help="also write the statistics and sample as JSON")
    p.add_argument("--force", action="store_true", help="overwrite --json OUT")
    p.set_defaults(func=run_inspect)


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="inspect and regenerate training data",
                              description="Training-data tools. See `dspark-jax data SUBCOMMAND -h`.")
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    add_inspect(sub)
    from dspark_jax.commands import data_regenerate
    data_regenerate.add_parser(sub)

    def no_subcommand(args) -> int:
        p.print_help()
        return 2
    p.set_defaults(func=no_subcommand)
