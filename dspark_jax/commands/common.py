"""Flags shared by several commands (and the benchmarks): one definition of the decode flags."""

from __future__ import annotations

import argparse

from dspark_jax.decode.settings import DecodeOptions, options_from

_D = DecodeOptions()

# name -> (flag, argparse keyword arguments). Defaults are DecodeOptions' (or None: "as configured").
DECODE_FLAGS = {
    "max_new_tokens": ("--max-new-tokens", dict(
        type=int, default=_D.max_new_tokens, help=f"new tokens per prompt (default {_D.max_new_tokens})")),
    "temperature": ("--temperature", dict(
        type=float, default=_D.temperature,
        help=f"sampling temperature; 0 = greedy (default {_D.temperature:g})")),
    "verify": ("--verify", dict(
        default=_D.verify, metavar="POLICY",
        help="verification policy: full | threshold[:C] | fixed:K | scheduler | scheduler-async "
             "(default full)")),
    "confidence_threshold": ("--confidence-threshold", dict(
        type=float, default=None, help="threshold C for --verify threshold (default 0.5)")),
    "confidence_temperatures": ("--confidence-temperatures", dict(
        type=float, nargs="+", default=None, metavar="T",
        help="STS temperatures t_1..t_G applied as sigmoid(logit_k / t_k) (default: the drafter's "
             "saved extras['sts_temperatures'] from `calibrate`, else none)")),
    "sps_table": ("--sps", dict(default=None, metavar="FILE", help="SPS table for scheduler policies")),
    "batch_size": ("--batch-size", dict(
        type=int, default=_D.batch_size, help="requests decoded together (default 1)")),
    "seed": ("--seed", dict(type=int, default=_D.seed, help="PRNG seed (runs are reproducible)")),
    "stop_token_ids": ("--stop-token-ids", dict(
        type=int, nargs="*", default=None, metavar="ID",
        help="stop tokens (default: eos_token_id of the target's generation_config.json, else "
             "config.json, else its tokenizer; give the flag with no ids for none)")),
    "raw_prompt": ("--raw-prompt", dict(
        action="store_true",
        help="encode text prompts as plain text (byte tokenizer: <|bos|> + text) instead of the "
             "tokenizer's chat template (the default)")),
    "batching": ("--batching", dict(
        choices=("continuous", "static"), default=_D.batching,
        help="continuous (default): a finished request's slot takes the next one at once; "
             "static: fixed batches of --batch-size that run until their slowest row ends")),
    "mesh": ("--mesh", dict(
        default=None, metavar="SPEC",
        help="shard decoding over devices, e.g. tensor=2 or data=2,tensor=2 (default: one device)")),
    "draft_steps": ("--draft-steps", dict(
        type=int, default=None, metavar="K",
        help="drafts per round of a chain drafter (DeepSeek-V4's MTP module: MTP-K, the module "
             "re-applied to its own output; default 1); a block drafter's round is its checkpoint's")),
    "thinking": ("--thinking", dict(
        action=argparse.BooleanOptionalAction, default=False,
        help="enable_thinking in the chat template (default off)")),
}


def add_decode_flags(parser, names=None, *, defaults: dict | None = None,
                     helps: dict | None = None) -> None:
    """Add the decode flags ``names`` (default: all) to ``parser``; ``defaults`` / ``helps``
    override some defaults and help texts (e.g. None where a config supplies the value)."""
    for name in names or DECODE_FLAGS:
        flag, kw = DECODE_FLAGS[name]
        kw = dict(kw, dest=name)
        if defaults and name in defaults:
            kw["default"] = defaults[name]
        if helps and name in helps:
            kw["help"] = helps[name]
        parser.add_argument(flag, **kw)


def decode_options(args, names=None) -> DecodeOptions:
    """DecodeOptions from parsed ``args`` (flags added by ``add_decode_flags``)."""
    return options_from(vars(args), names)
