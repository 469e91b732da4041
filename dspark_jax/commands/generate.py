"""`dspark-jax generate`: speculative decoding of a JSONL prompt file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark_jax.fileio import atomic_open

HELP = "speculative decoding of JSONL prompts with a target and a DSpark drafter"
DESCRIPTION = """\
Generate with lossless speculative decoding (SPEC section 8): the drafter proposes a block of
block_size tokens, a policy picks how many each request verifies, and the target accepts them
by rejection sampling, so outputs follow the target's distribution exactly (greedy at T=0).

Input: one JSON object per line, {"prompt_ids": [...]} or {"text": "..."} (text needs a
tokenizer in the target directory); other fields are copied to the output. Output: one line
per prompt with output_ids (new tokens only), acceptance_lengths and proposal_lengths per
round, accepted_drafts, confidence_logits per round (raw, for `calibrate`), and "text" when a
tokenizer is present. A summary (tau, verify_rate, accept_rate@k, conditional acceptance,
tokens/s) is printed at the end as JSON. Without --draft, the target decodes alone
(autoregressive baseline). --target/--draft accept PyTorch (HF) and dspark-jax directories.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="DIR", help="target checkpoint directory")
    p.add_argument("--draft", metavar="DIR", help="drafter checkpoint directory (omit: autoregressive)")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="input prompts")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file (atomic write)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--verify", default="full", metavar="POLICY",
                   help="verification policy: full | threshold | fixed:K | scheduler | "
                        "scheduler-async (default full)")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="threshold C for --verify threshold (default 0.5)")
    p.add_argument("--confidence-temperatures", type=float, nargs="+", default=None, metavar="T",
                   help="STS temperatures t_1..t_G applied as sigmoid(logit_k / t_k) (default: the "
                        "drafter's saved extras['sts_temperatures'] from `calibrate`, else none)")
    p.add_argument("--sps", default=None, metavar="FILE", help="SPS table for scheduler policies")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together (default 1)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (runs are reproducible)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None, metavar="ID",
                   help="stop tokens (default: eos_token_id of the target's generation_config.json, "
                        "else config.json, else its tokenizer; give the flag with no ids for none)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="cast weights (default: as stored)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="fixed KV-cache capacity (default: from the longest prompt)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from dspark_jax.convert.checkpoint import default_stop_ids, load_draft, load_target, sts_temperatures
    from dspark_jax.data.prompts import read_prompts
    from dspark_jax.decode import autoregressive_generate, parse_policy, speculative_generate, summarize
    from dspark_jax.errors import InputError
    from dspark_jax.tokenizer import load_tokenizer

    out = Path(args.out)
    if out.exists() and not args.force:
        raise InputError(f"--out {str(out)!r} exists; pass --force to overwrite")
    target_dir = Path(args.target)
    tokenizer = load_tokenizer(target_dir) if target_dir.is_dir() else None
    encode = None
    if tokenizer is not None:
        encode = getattr(tokenizer, "chat_prompt", None) or (lambda t: tokenizer.encode(t))
    records = read_prompts(args.prompts, encode,
                           tokenizer_hint=f" (none found in {str(target_dir)!r})")
    prompts = [ids for _, ids in records]
    stops = (default_stop_ids(target_dir, tokenizer) if args.stop_token_ids is None
             else list(args.stop_token_ids))

    tcfg, tparams = load_target(target_dir, args.dtype)
    bar = tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr)
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  batch_size=args.batch_size, seed=args.seed, stop_token_ids=stops,
                  max_cache_len=args.max_cache_len, progress=bar.update)
    block = None
    if args.draft:
        dcfg, dparams = load_draft(args.draft, args.dtype)
        block = dcfg.block_size
        policy = parse_policy(args.verify, confidence_threshold=args.confidence_threshold,
                              sps_table=args.sps)
        conf_temps = sts_temperatures(args.draft, args.confidence_temperatures)
        if conf_temps is not None and args.confidence_temperatures is None:
            print(f"generate: STS temperatures from the drafter's extras: {conf_temps}", file=sys.stderr)
        results = speculative_generate(tcfg, tparams, dcfg, dparams, prompts, policy=policy,
                                       confidence_temperatures=conf_temps, **common)
    else:
        results = autoregressive_generate(tcfg, tparams, prompts, **common)
    bar.close()

    with atomic_open(out) as f:
        for (rec, ids), res in zip(records, results):
            line = {k: v for k, v in rec.items()}
            line.update(output_ids=res.output_ids, acceptance_lengths=res.acceptance_lengths,
                        proposal_lengths=res.proposal_lengths,
                        accepted_drafts=res.accepted_drafts,
                        confidence_logits=res.confidence_logits)
            if tokenizer is not None:
                line["output_text"] = tokenizer.decode(res.output_ids)
            f.write(json.dumps(line) + "\n")
    summary = summarize(results, block)
    summary["mode"] = "speculative" if args.draft else "autoregressive"
    summary["verify"] = args.verify if args.draft else None
    print(json.dumps(summary))
    return 0
