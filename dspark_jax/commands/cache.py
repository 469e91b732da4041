"""`dspark-jax cache`: write the target-feature cache that `train features=cache` reads."""

from __future__ import annotations

import json


def run(args) -> int:
    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.data import cache as cache_lib
    from dspark_jax.data import chat, sources
    from dspark_jax.errors import InputError
    from dspark_jax.fileio import check_output
    from dspark_jax.tokenizer import load_tokenizer
    from dspark_jax.train.config import load_config

    if args.config:
        cfg = load_config(args.config, args.overrides)
        target, data, max_length, overlong = cfg.target, cfg.data, cfg.max_length, cfg.overlong
        fmt, tokenizer, thinking = cfg.data_format, cfg.tokenizer or cfg.target, cfg.chat_thinking
        out = args.out or cfg.cache_dir
    else:
        target, data, max_length, overlong = args.target, args.data, args.max_length, args.overlong
        fmt, tokenizer, out, thinking = args.data_format, args.tokenizer or target, args.out, None
    if not (target and data and out):
        raise InputError("cache needs a target, data and an output directory (--config or "
                         "--target/--data/--out)")
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if max_length < 2:
        raise InputError(f"{'--max-length' if not args.config else 'max_length'} must be >= 2, got {max_length}")
    check_output(out, force=args.force, kind="dir", flag="--out" if args.out or not args.config else "cache_dir",
                 inputs={"--target": target, "--data": data, "--tokenizer": tokenizer, "--config": args.config})
    tcfg, tparams = load_target(target)
    layer_ids = args.layer_ids
    if layer_ids is None:
        if not args.config:
            raise InputError("--layer-ids is required without --config")
        layer_ids = cfg.draft_config(tcfg).target_layer_ids
    if fmt == "chat":
        seqs = chat.read_chat_jsonl(data, load_tokenizer(tokenizer, required=True), max_length, overlong,
                                    thinking=thinking, vocab_size=tcfg.vocab_size)
    else:
        seqs = sources.read_token_jsonl(data, max_length, tcfg.vocab_size, overlong)
    manifest = cache_lib.write_cache(out, tcfg, tparams, layer_ids, seqs, batch_size=args.batch_size,
                                     dtype=args.dtype, force=args.force, progress=not args.quiet)
    print(json.dumps({k: manifest[k] for k in ("layer_ids", "num_records", "num_tokens", "feature_dtype")}
                     | {"cache_dir": str(out), "target_sha256": manifest["target"]["sha256"]}))
    return 0


def _layer_ids(text: str) -> list[int]:
    import argparse
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "cache", help="write a target-feature cache for training",
        description="Run the frozen target over tokenized data and store, per token, the raw outputs "
                    "of the drafter's target layers and the final normed hidden state, in sharded "
                    ".npy files (memory-mapped by training) with index.npy and manifest.json "
                    "(shapes, dtypes, layer ids, target sha256). Either --config (a train config: "
                    "its target, data, max_length and drafter layer ids) or explicit flags.")
    p.add_argument("--config", help="train config file; its cache_dir is the default output")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="train-config overrides")
    p.add_argument("--target", help="target checkpoint directory")
    p.add_argument("--data", help="JSONL data ({'input_ids','loss_mask'} or {'messages'})")
    p.add_argument("--data-format", default="tokens", choices=["tokens", "chat"])
    p.add_argument("--tokenizer", default="", help="tokenizer directory for chat data (default: the target's)")
    p.add_argument("--out", help="output cache directory")
    p.add_argument("--layer-ids", type=_layer_ids, default=None,
                   help="comma-separated target layer ids (default: the config's drafter)")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--overlong", default="truncate", choices=["truncate", "refuse"])
    p.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="stored dtype")
    p.add_argument("--force", action="store_true", help="replace an existing cache")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
