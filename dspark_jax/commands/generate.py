"""`dspark-jax generate`: speculative decoding of a JSONL prompt file."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.commands.common import add_decode_flags, decode_options

HELP = "speculative decoding of JSONL prompts with a target and a DSpark drafter"
DESCRIPTION = """\
Generate with lossless speculative decoding: the drafter proposes a block of
block_size tokens, a policy picks how many each request verifies, and the target accepts them
by rejection sampling, so outputs follow the target's distribution exactly (greedy at T=0).

Input: one JSON object per line, {"prompt_ids": [...]} or {"text": "..."} (text needs a
tokenizer in the target directory and is encoded with its chat template, or as plain text
with --raw-prompt); other fields are copied to the output. Output: one line
per prompt with output_ids (new tokens only), acceptance_lengths and proposal_lengths per
round, accepted_drafts, confidence_logits per round (raw, for `calibrate`), and "text" when a
tokenizer is present. A summary (tau, verify_rate, accept_rate@k, conditional acceptance,
tokens/s) is printed at the end as JSON. Without --draft, the target decodes alone
(autoregressive baseline). --target/--draft accept PyTorch (HF) and dspark-jax directories.
Under launch/ (several processes), --mesh spans every process's devices; process 0 writes --out.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="DIR", help="target checkpoint directory")
    p.add_argument("--draft", metavar="DIR", help="drafter checkpoint directory (omit: autoregressive)")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="input prompts")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file (atomic write)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    add_decode_flags(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="cast weights (default: as stored)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="fixed KV-cache capacity (default: from the longest prompt)")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark_jax.commands.train import maybe_initialize_distributed
    from dspark_jax.pipelines.generate import generate

    maybe_initialize_distributed()  # under launch/ (multi-process --mesh); no-op otherwise

    summary = generate(args.target, args.prompts, args.out, draft=args.draft,
                       options=decode_options(args), dtype=args.dtype,
                       max_cache_len=args.max_cache_len, force=args.force,
                       log=lambda s: print(s, file=sys.stderr))
    from dspark_jax.fileio import dumps
    print(dumps(summary))
    return 0
