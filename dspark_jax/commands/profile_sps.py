"""`dspark-jax profile-sps`: measure the target's verification steps/s SPS(B) for the scheduler."""

from __future__ import annotations

import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "profile-sps",
        help="measure target verification steps per second vs verification tokens (SPS table)",
        description=(
            "Time the jitted target verification forward (KV-cache extend at --cache-length plus "
            "the LM head) for B = 1..--max-batch verification tokens and write the SPS(B) table "
            "(JSON: batch_sizes, sps, device, model, cache length, date) that `generate --verify "
            "scheduler --sps FILE` reads. Between measured sizes the table is interpolated. With "
            "--draft, time whole speculative rounds of the decode program instead (slot counts "
            "--batch-sizes, default powers of two up to --max-batch, at every verification width): "
            "the round table the scheduler plans with."),
    )
    p.add_argument("--target", required=True, help="target model directory (HF or dspark-jax format)")
    p.add_argument("--draft", default=None,
                   help="drafter directory: measure whole decode rounds (a round table: rounds/s at "
                        "each slot count in --batch-sizes and each verification width), the cost "
                        "the scheduler's width-aware objective reads; without it, the target's "
                        "verify forward alone (a token table)")
    p.add_argument("--widths", default=None,
                   help="with --draft: comma-separated verification widths (default: 1, 2, 4, .., "
                        "block+1, the decode program's default)")
    p.add_argument("--rounds", type=int, default=16, help="with --draft: rounds per timed chunk")
    p.add_argument("--out", required=True, help="output JSON file (refused if it exists)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="largest verification batch in tokens (default 64; use concurrency*(block+1))")
    p.add_argument("--cache-length", type=int, default=512,
                   help="positions already in each row's KV cache (default 512)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated sizes to measure (default: 1..16, then x1.25 steps to max)")
    p.add_argument("--layout", choices=("rows", "block"), default="rows",
                   help="rows: B requests x 1 token (default); block: 1 request x B tokens")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls per size (default 2; >= 0: the call that compiles is never timed)")
    p.add_argument("--iters", type=int, default=5, help="minimum timed calls per size")
    p.add_argument("--min-seconds", type=float, default=0.2, help="minimum timed seconds per size")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed chunks per size, in round-robin passes over all sizes; the fastest counts")
    p.add_argument("--monotone", action="store_true",
                   help="store the non-increasing (isotonic) fit of the measurements (raw kept in meta)")
    p.add_argument("--fit", choices=("none", "monotone", "linear", "convex"), default="convex",
                   help="curve stored from the measurements (raw always kept in meta.raw_sps): "
                        "convex (default) = non-decreasing convex piecewise-linear latency 1/SPS, "
                        "the roofline shape, on which the scheduler's early stop is exact; "
                        "linear = latency a + b*B; monotone = isotonic SPS; none = raw")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="cast the target params (default: as stored)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="measure on the decode mesh, e.g. tensor=2 (default: one device)")
    p.set_defaults(func=run)


def run(args) -> int:

    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from dspark_jax.convert import checkpoint
    from dspark_jax.decode import profile
    from dspark_jax.errors import InputError

    from dspark_jax.fileio import check_output

    out = check_output(args.out, force=args.force, inputs={"--target": args.target, "--draft": args.draft})
    for flag, value in (("--max-batch", args.max_batch), ("--cache-length", args.cache_length),
                        ("--iters", args.iters), ("--repeats", args.repeats)):
        if value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise InputError(f"--warmup must be >= 0 (untimed calls per size), got {args.warmup}")
    if not args.min_seconds >= 0:
        raise InputError(f"--min-seconds must be >= 0, got {args.min_seconds}")
    if args.batch_sizes:
        try:
            sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
        except ValueError:
            raise InputError(f"--batch-sizes must be comma-separated ints, got {args.batch_sizes!r}") from None
        if not sizes or min(sizes) < 1:
            raise InputError(f"--batch-sizes must be ints >= 1, got {args.batch_sizes!r}")
    else:
        sizes = profile.default_batch_sizes(args.max_batch)
    from dspark_jax.decode.sharded import make_decode_mesh
    mesh = make_decode_mesh(args.mesh)
    if args.draft is not None:
        return _run_rounds(args, out, mesh)
    cfg, params = checkpoint.load_target(args.target)
    if args.dtype:
        dt = jnp.dtype(args.dtype)
        params = jax.tree.map(lambda a: a.astype(dt), params)
    _check_memory(args, cfg, params, None, None, sizes, mesh)
    bar = tqdm(total=len(sizes), desc="profile-sps", unit="size", file=sys.stderr)

    def progress(b, sps):
        bar.set_postfix(B=b, sps=f"{sps:.1f}")
        bar.update(1)

    table = profile.measure_sps(cfg, params, sizes, args.cache_length, layout=args.layout,
                                warmup=args.warmup, iters=args.iters, min_seconds=args.min_seconds,
                                repeats=args.repeats, monotone=args.monotone, fit=args.fit,
                                meta={"target": str(args.target), "mesh": args.mesh},
                                progress=progress, mesh=mesh)
    bar.close()
    table.save(out, force=args.force)
    print(json.dumps({"out": str(out), "device": table.meta["device"],
                      "batch_sizes": list(table.batch_sizes),
                      "sps": [round(s, 3) for s in table.sps]}))
    return 0


def _check_memory(args, tcfg, tparams, dcfg, dparams, sizes, mesh) -> None:
    """The largest batch's decode state must fit (``decode.memory``), before it is allocated."""
    from dspark_jax.decode.memory import check_decode_memory
    check_decode_memory(tcfg, tparams, dcfg, dparams, max(sizes), args.cache_length, mesh,
                        flag="--batch-sizes" if args.batch_sizes else "--max-batch", length_flags="--cache-length")


def _parse_ints(text: str, flag: str) -> list[int]:
    from dspark_jax.errors import InputError
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} must be comma-separated ints, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise InputError(f"{flag} must be ints >= 1, got {text!r}")
    return vals


def _run_rounds(args, out, mesh) -> int:
    """``--draft``: the round table of the decode program (``profile.measure_rounds``)."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from dspark_jax.convert import checkpoint
    from dspark_jax.decode import profile

    sizes = (_parse_ints(args.batch_sizes, "--batch-sizes") if args.batch_sizes
             else profile.default_round_batches(args.max_batch))
    widths = _parse_ints(args.widths, "--widths") if args.widths else None
    from dspark_jax.pairing import check_pair_paths
    check_pair_paths(args.target, args.draft)
    tcfg, tparams = checkpoint.load_target(args.target)
    dcfg, dparams = checkpoint.load_draft(args.draft, target_params=tparams)
    if args.dtype:
        dt = jnp.dtype(args.dtype)
        tparams = jax.tree.map(lambda a: a.astype(dt), tparams)
        dparams = jax.tree.map(lambda a: a.astype(dt), dparams)
    _check_memory(args, tcfg, tparams, dcfg, dparams, sizes, mesh)
    bar = tqdm(desc="profile-sps rounds", unit="shape", file=sys.stderr)

    def progress(b, w, rps):
        bar.set_postfix(B=b, w=w, rps=f"{rps:.1f}")
        bar.update(1)

    table = profile.measure_rounds(tcfg, tparams, dcfg, dparams, sizes, args.cache_length,
                                   widths=widths, rounds=args.rounds, warmup=args.warmup,
                                   min_seconds=args.min_seconds, repeats=args.repeats, mesh=mesh,
                                   meta={"target": str(args.target), "draft": str(args.draft),
                                         "mesh": args.mesh}, progress=progress)
    bar.close()
    table.save(out, force=args.force)
    print(json.dumps({"out": str(out), "device": table.meta["device"],
                      "batch_sizes": list(table.batch_sizes), "widths": list(table.widths),
                      "rps": [[round(v, 2) for v in row] for row in table.rps]}))
    return 0
