"""`dspark-jax data regenerate`: on-policy training data from a chat dataset and the target.

``add_parser(data_subparsers)`` adds the ``regenerate`` subcommand to the ``data`` command's
subparsers (``commands/data.py``); ``main(argv)`` runs it standalone
(``python -m dspark_jax.commands.data_regenerate ...``).
"""

from __future__ import annotations

import argparse
import sys

from dspark_jax.commands.common import add_decode_flags

HELP = "regenerate the assistant turns of a chat dataset with the target (on-policy training data)"
DESCRIPTION = """\
Regenerate the assistant turns of a chat dataset with the target model itself (the paper's
on-policy training data) and write training JSONL that `train` reads as token data.

Input (--data, one JSON object per line; --format auto detects it from the first row):
ShareGPT {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}, the reference's
{"conversations": [{"role", "content"}]}, {"messages": [{"role", "content"}]}, the reference's
prompt files {"turns": ["..."]} (first turn), single prompts {"prompt"|"text"|"question"|
"instruction": "..."}. Each reply is generated after the REAL history: the target's chat
template with the generation prompt (--thinking: enable_thinking), or the plain text of a
single prompt with --raw-prompt (base LMs such as the embedded default target).
--turns last (default): the last assistant turn of each row (or one reply to a trailing user
message); --turns all: every assistant turn.

Output rows: id, turn, input_ids (prompt + reply), loss_mask (0 prompt, 1 reply incl. the stop
token), messages (history + the new reply), finish_reason (stop|length), prompt_tokens,
generated_tokens, source (file:line). Temperature, top-p, max tokens and stop ids default to
the target's generation_config.json. Deterministic by --seed whatever --slots/--mesh;
resumable: rerun the same command after an interruption (rows are journaled in OUT.partial).
The summary (rows, tokens, truncations, finish reasons, tokens/s) is written to
OUT.summary.json and printed.
"""


def add_parser(data_subparsers) -> argparse.ArgumentParser:
    """Add ``regenerate`` to the ``data`` command's subparsers (sets ``func``)."""
    p = data_subparsers.add_parser("regenerate", help=HELP, description=DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="DIR", help="target checkpoint directory")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="chat dataset")
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="output training JSONL (refused if it exists, unless --force)")
    p.add_argument("--draft", metavar="DIR", default=None,
                   help="drafter: generate speculatively (lossless; needs --top-p 1)")
    p.add_argument("--format", dest="fmt", default="auto",
                   choices=("auto", "sharegpt", "deepspec", "messages", "turns", "prompt"),
                   help="input format (default: detected from the first row)")
    p.add_argument("--turns", choices=("last", "all"), default="last",
                   help="regenerate the last assistant turn (default) or every one")
    add_decode_flags(p, ("max_new_tokens", "temperature", "seed", "stop_token_ids", "raw_prompt",
                         "thinking", "mesh"),
                     defaults={"max_new_tokens": None, "temperature": None},
                     helps={"max_new_tokens": "new tokens per reply (default: generation_config."
                                              "json's max_new_tokens, else 512)",
                            "temperature": "sampling temperature, 0 = greedy (default: "
                                           "generation_config.json, else 1)",
                            "raw_prompt": "use the single user prompt as plain text (base LMs) "
                                          "instead of the chat template"})
    p.add_argument("--top-p", dest="top_p", type=float, default=None,
                   help="nucleus sampling (default: generation_config.json, else 1 = off)")
    p.add_argument("--slots", "--batch-size", dest="slots", type=int, default=8,
                   help="concurrent requests (continuous-batching slots, default 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="cast weights (default: as stored)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="fixed KV-cache capacity (default: from the longest prompt)")
    p.add_argument("--force", action="store_true",
                   help="overwrite OUT; discard a journal written with other arguments")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from dspark_jax.pipelines.regenerate import regenerate

    summary = regenerate(args.target, args.data, args.out, fmt=args.fmt, turns=args.turns,
                         thinking=args.thinking, raw_prompt=args.raw_prompt,
                         temperature=args.temperature, top_p=args.top_p,
                         max_new_tokens=args.max_new_tokens, stop_token_ids=args.stop_token_ids,
                         seed=args.seed, slots=args.slots, mesh=args.mesh, draft=args.draft,
                         dtype=args.dtype, max_cache_len=args.max_cache_len, force=args.force,
                         progress=args.progress, log=lambda s: print(s, file=sys.stderr))
    from dspark_jax.fileio import dumps
    print(dumps(summary))
    return 0


def main(argv=None) -> int:
    """Standalone entry: ``main(["regenerate", "--target", ...])`` or without the leading
    ``regenerate``. Bad input: one line on stderr, exit code 2."""
    from dspark_jax.errors import DSparkError

    parser = argparse.ArgumentParser(prog="dspark-jax data")
    add_parser(parser.add_subparsers(dest="data_command", metavar="COMMAND"))
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "regenerate":
        argv = ["regenerate"] + argv
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DSparkError as e:
        print(f"dspark-jax data regenerate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
