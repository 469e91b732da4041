"""`dspark-jax plan`: compile full-size train/decode programs on a simulated mesh, print memory."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from dspark_jax.config import RELEASED_KINDS


def register(sub) -> None:
    p = sub.add_parser(
        "plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="plan memory and collectives of a full-size run by compiling it on a simulated mesh",
        description=(
            "Build abstract params and optimizer state (jax.eval_shape: nothing full-size is\n"
            "allocated), lower and compile the sharded train step (online and/or cache mode)\n"
            "and the decode round on a mesh of simulated CPU devices (or, with --hardware, of\n"
            "compile-only TPU/GPU devices: the accelerator's own compiler), and print parameter\n"
            "counts, per-device bytes (params, optimizer state, activations from\n"
            "compiled.memory_analysis()) and the collectives in each compiled program. A target\n"
            "with no released drafter (DeepSeek-V4) plans its forward as online training runs it\n"
            "(--modes forward) and, once its family has a decode cache, its autoregressive step.\n\n"
            "example:\n"
            "  dspark-jax plan --config configs/dspark_qwen3_4b.py --mesh data=1,fsdp=8 --modes online\n"
            "  dspark-jax plan --target Qwen/Qwen3-8B --kind dspark --mesh fsdp=8 --modes decode\n"
            "  dspark-jax plan --config configs/dspark_gemma4_12b.py --mesh data=1,fsdp=8 --modes online\n"
            "  dspark-jax plan --target google/gemma-4-12B-it --kind dspark --mesh fsdp=8 --modes online\n"
            "  dspark-jax plan --target deepseek-ai/DeepSeek-V4-Flash --mesh expert=8 --modes forward\n"
            "  dspark-jax plan --config configs/dspark_deepseek_v4_flash.py --mesh fsdp=8,expert=8 --modes online\n"
            "  dspark-jax plan --config configs/dspark_qwen3_4b.py --hardware tpu-v5e:2x4   # pip install -e \".[tpu]\"\n"
            "  dspark-jax plan --config configs/dspark_qwen3_8b.py --hardware h200:8        # pip install -e \".[cuda]\"\n"
            "  dspark-jax plan --target deepseek-ai/DeepSeek-V4-Flash --kind mtp --rates h200:8 --analytic \\\n"
            "      --mesh data=1,expert=8 --round-table mtp1.json --decode-batches 1,8,64   # no compile"))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="training config file (configs/<name>.py); its target may be a "
                                      "checkpoint dir or a preset name such as Qwen/Qwen3-4B")
    src.add_argument("--target", help="a target preset name (Qwen/Qwen3-4B, -8B, -14B, google/gemma-4-12B-it, "
                                      "deepseek-ai/DeepSeek-V4-Flash, -Pro; not a checkpoint "
                                      "directory: give that as a config's target with --config); the "
                                      "drafter is the released shape (--kind); DeepSeek-V4 has none yet")
    p.add_argument("--kind", default="dspark", choices=list(RELEASED_KINDS) + ["mtp"],
                   help="released drafter shape with --target (default: dspark); mtp: a "
                        "DeepSeek-V4 preset's MTP module, --draft-steps drafts per round")
    p.add_argument("--draft-steps", type=int, default=1, metavar="K",
                   help="with --kind mtp: drafts per round (MTP-K, default 1)")
    p.add_argument("--mesh", default=None, help="mesh axes, e.g. data=2,fsdp=4,tensor=1; a mixture-of-experts "
                                                "target (DeepSeek-V4) may add expert=N (expert parallelism) "
                                                "(default: the config's mesh, else fsdp=<devices>)")
    p.add_argument("--devices", type=int, default=None,
                   help="simulated CPU devices (default: the mesh's size, else 8)")
    p.add_argument("--hardware", default=None, metavar="CHIP:GRID",
                   help="compile for real accelerators instead of simulated CPU devices (compile-only, no "
                        "accelerator needed): tpu-v5e:2x4, tpu-v5p:2x2x4, tpu-v6e:2x4, tpu-v4:2x2x2, h100:8, "
                        "h200:8, h200:1, ...; per-device memory then comes from the TPU/GPU compiler and is "
                        "checked against the chip's HBM, and each program's flops / bytes per run (loop bodies x "
                        "trip counts) give its roofline time on the chip; train steps add tokens/s per chip and "
                        "MFU. TPU needs the tpu extra (libtpu), GPU the cuda extra")
    p.add_argument("--modes", default=None,
                   help="comma list of programs: online, cache (train step), decode (round; the "
                        "autoregressive step without a drafter), forward (the target's forward as online "
                        "training runs it: features of the drafter's target layers and the last hidden) "
                        "(default: online,cache,decode; without a drafter forward, and decode where the "
                        "target's family has a decode cache)")
    p.add_argument("--seq-len", type=int, default=None, help="training sequence length (default: config max_length or 4096)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per micro-step, global (default: one per data/fsdp shard)")
    p.add_argument("--decode-batch", type=int, default=8, help="requests per decode round (default 8)")
    p.add_argument("--decode-len", type=int, default=4096, help="decode KV-cache capacity (default 4096)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    p.add_argument("--remat", default=None, choices=["none", "dots", "full"],
                   help="rematerialise draft layers in the backward pass: dots keeps only weight-matmul "
                        "outputs, full keeps nothing (default: the config's remat, else none)")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="compute the vocabulary-sized heads and loss this many anchors at a time; 0 = all "
                        "at once (default: the config's loss_chunk, else 0)")
    p.add_argument("--shard-activations", default=None, action=argparse.BooleanOptionalAction,
                   help="pin train-step activations batch-sharded so fsdp weights are all-gathered "
                        "instead of whole-batch activations all-reduced (default: the config's value, else off)")
    p.add_argument("--round-table", default=None, metavar="FILE",
                   help="with --hardware and a drafter: instead of --modes, compile the AR step and the "
                        "decode round at every verification width for each --decode-batches slot count "
                        "and write a round table (rounds/s = 1 / max(bytes / bandwidth, flops / peak) "
                        "per program on one chip; projected) that `bench --round-table` reads")
    p.add_argument("--no-ar-step", dest="ar_step", action="store_false",
                   help="with --round-table: leave the AR step out (another drafter's table of the "
                        "same target carries it; bench's AR curve reads the first table's)")
    p.add_argument("--analytic", action="store_true",
                   help="with --round-table --rates: compile nothing; each program's per-device "
                        "bytes and flops from the declared shapes (costs/analytic.py: weights, "
                        "routed experts touched on the --mesh's expert axis, KV cache), for a "
                        "mixture-of-experts target whose CPU-compiled counts are not usable")
    p.add_argument("--rates", default=None, metavar="CHIP:GRID",
                   help="with --round-table and no --hardware (no compiler plugin for the chip "
                        "here): compile on simulated CPU devices (--mesh) and charge each "
                        "program's XLA:CPU flops / bytes at CHIP's peak / bandwidth; the table's "
                        "cost source says so")
    p.add_argument("--decode-batches", default="1,8,64", metavar="LIST",
                   help="slot counts of --round-table (default 1,8,64)")
    p.add_argument("--json", dest="json_out", default=None, metavar="FILE",
                   help="also write the plan as JSON to this file (refused if it exists unless --force)")
    p.add_argument("--force", action="store_true", help="overwrite the --json file")
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    return f"{n / 2**30:8.2f} GiB" if n >= 2**30 else f"{n / 2**20:8.1f} MiB"


# Host memory one simulated device costs a plan: measured 2.4 MiB (peak RSS, Qwen3-4B decode round,
# 512 devices vs 8, still growing when stopped); the bound counts 4 MiB.
PLAN_BYTES_PER_DEVICE = 4 << 20


def _use_devices(args) -> None:
    """Simulate ``args.devices`` CPU devices (default: the --mesh's size, else 8)."""
    import jax

    from dspark_jax import sharding
    from dspark_jax.errors import InputError

    sizes = sharding.parse_mesh_spec(args.mesh) if args.mesh else {}
    bad = {k: v for k, v in sizes.items() if v < 1 and v != -1}
    if bad:
        raise InputError(f"--mesh {args.mesh!r}: axis {next(iter(bad))}={next(iter(bad.values()))} must be >= 1 "
                         "(or -1: the remaining devices)")
    if args.devices is None:
        args.devices = math.prod(sizes.values()) if sizes and -1 not in sizes.values() else 8
    if args.devices < 1:
        raise InputError("--devices must be >= 1")
    from dspark_jax.decode.memory import GIB, check_fits
    check_fits("--devices", args.devices, PLAN_BYTES_PER_DEVICE, fixed=GIB,
               what="simulated CPU devices, each with its programs' per-device state")
    try:
        jax.config.update("jax_num_cpu_devices", args.devices)
    except Exception:  # backend already initialised (e.g. inside tests): use what is there
        pass


def _configs(args):
    """(train config, target config, drafter config, mesh spec) from --config or --target/--kind;
    the train config carries --seq-len and the memory flags."""
    from dspark_jax import presets
    from dspark_jax.errors import InputError
    from dspark_jax.train.config import MemoryConfig, TrainConfig, load_config

    if args.config:
        tcfg = load_config(args.config)
        target_cfg = presets.resolve_target(tcfg.target)
        draft_cfg = tcfg.draft_config(target_cfg)
        mesh_spec = args.mesh or tcfg.mesh
    else:
        from dspark_jax.errors import ConfigError
        if args.target not in presets.TARGETS:
            raise InputError(f"--target {args.target!r} is not a preset name ({', '.join(presets.TARGETS)}); "
                             "for a checkpoint directory write a train config with that target and "
                             "pass --config")
        target_cfg = presets.resolve_target(args.target)
        try:
            draft_cfg = (presets.v4_mtp_drafter(args.target, args.draft_steps) if args.kind == "mtp"
                         else presets.released_drafter(args.target, kind=args.kind))
        except ConfigError:  # no drafter for this target yet (DeepSeek-V4): its forward / AR step only
            draft_cfg = None
        mesh_spec = args.mesh
        tcfg = TrainConfig(target=args.target, data="<plan>", max_length=4096)
    memory = dataclasses.asdict(tcfg.memory)
    memory.update({k: getattr(args, k) for k in memory if getattr(args, k) is not None})
    if memory["loss_chunk"] < 0:
        raise InputError("--loss-chunk must be >= 0")
    tcfg = tcfg.replace(max_length=args.seq_len or tcfg.max_length, compute_dtype=args.dtype,
                        memory=MemoryConfig(**memory))
    return tcfg, target_cfg, draft_cfg, mesh_spec


def _mesh(args, mesh_spec, devices=None):
    """The mesh over ``devices`` (compile-only accelerator devices) or the simulated CPU devices."""
    import jax

    from dspark_jax import sharding
    from dspark_jax.errors import InputError

    if devices is not None:
        return sharding.make_mesh(mesh_spec or f"fsdp={len(devices)}", devices)
    if not args.mesh and mesh_spec:  # the config's mesh decides the device count
        sizes = sharding.parse_mesh_spec(mesh_spec)
        if -1 not in sizes.values():
            args.devices = math.prod(sizes.values())
    if len(jax.devices()) < args.devices:
        raise InputError(f"{args.devices} devices requested but only {len(jax.devices())} exist "
                         "(the backend was initialised before --devices could apply)")
    devices = jax.devices()[: args.devices]
    return sharding.make_mesh(mesh_spec or f"fsdp={len(devices)}", devices)


def _projection(plan, mode, hw, tcfg, target_cfg, draft_cfg, micro: int, devices: int) -> dict:
    """The compiled program's roofline on ``hw``'s chip; a train step's with tokens/s per chip and MFU
    (analytic model flops of the micro-batch's sequences, spread over the chips)."""
    from dspark_jax.costs import flops
    from dspark_jax.pipelines import plan as plan_lib

    if mode not in ("online", "cache"):
        return plan_lib.projected(plan, hw.chip)
    per_seq = flops.model_flops(target_cfg, draft_cfg, tcfg.max_length, online=mode == "online")
    return plan_lib.projected(plan, hw.chip, tokens=micro * tcfg.max_length / devices,
                              model_flops=per_seq * micro / devices)


def _print_program(plan, sizes: dict, hw=None, proj=None) -> None:
    print(f"\n[{plan.name}] compiled in {plan.compile_seconds:.1f}s; per device:")
    for key, value in sizes.items():
        print(f"  {key:<22}{_mib(value)}")
    print(f"  {'arguments':<22}{_mib(plan.argument_bytes)}\n  {'outputs':<22}{_mib(plan.output_bytes)}")
    print(f"  {'temporaries':<22}{_mib(plan.temp_bytes)}  (activations, workspace)")
    if plan.upcast_bytes:
        print(f"  {'  bf16->f32 copies':<22}{_mib(plan.upcast_bytes)}  (XLA:CPU upcasts of bf16 weights/caches "
              "inside the temporaries, summed, not all live at once; not made on GPU/TPU)")
    print(f"  {'donated (aliased)':<22}{_mib(plan.alias_bytes)}\n  {'peak estimate':<22}{_mib(plan.peak_bytes)}")
    if hw is not None:
        from dspark_jax.costs import hardware
        verdict = "fits" if hardware.fits(plan.peak_bytes, hw.chip) else "DOES NOT FIT"
        print(f"  {verdict} in {hw.chip.name}'s {_mib(hw.chip.hbm_bytes).strip()} of HBM")
    if proj is not None:
        print(f"  per run (loops x trips): {plan.step_flops / 1e12:.2f} TFLOP, {plan.step_bytes / 1e9:.1f} GB -> "
              f"{proj['seconds'] * 1e3:.1f} ms on {hw.chip.name} ({proj['bound']}-bound; collectives not charged)")
        if "mfu" in proj:
            print(f"  {proj['tokens_per_s']:,.0f} tokens/s per chip, MFU {proj['mfu'] * 100:.1f}% "
                  f"(model {proj['model_flops'] / 1e12:.2f} TFLOP per chip; compiled/model flops "
                  f"{proj['compiled_over_model_flops']:.2f})")
    coll = ", ".join(f"{op} x{c['count']} ({_mib(c['bytes']).strip()})" for op, c in plan.collectives.items())
    print(f"  collectives: {coll or 'none'}")


def _check_args(args) -> None:
    """Flag values and the --json path, before anything is built."""
    from dspark_jax.errors import InputError
    from dspark_jax.fileio import check_output

    for flag, value in (("--decode-batch", args.decode_batch), ("--decode-len", args.decode_len),
                        ("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    if args.json_out:
        check_output(args.json_out, force=args.force, flag="--json",
                     inputs={"--config": args.config})
    if args.rates and (args.hardware or not args.round_table):
        raise InputError("--rates charges a --round-table compiled on simulated CPU devices: give "
                         "--round-table and no --hardware")
    if args.analytic and not args.rates:
        raise InputError("--analytic charges a --round-table at a chip's rates: give --rates CHIP:GRID")
    if args.draft_steps < 1:
        raise InputError(f"--draft-steps must be >= 1, got {args.draft_steps}")
    if args.round_table:
        if not args.hardware and not args.rates:
            raise InputError("--round-table compiles for a chip: give --hardware CHIP:GRID (or "
                             "--rates CHIP:GRID to charge CPU-compiled programs at its rates)")
        if args.kind is None and args.config is None:
            raise InputError("--round-table needs a drafter (--kind or a --config with one)")
        check_output(args.round_table, force=args.force, flag="--round-table",
                     inputs={"--config": args.config})
        from dspark_jax.pipelines.bench_inputs import parse_ints
        parse_ints(args.decode_batches, "--decode-batches")


def _modes(args, draft_cfg, target_cfg) -> list[str]:
    """The --modes list (its default depends on the drafter and the target family's runtime);
    InputError for unknown programs or train-step modes without a drafter."""
    from dspark_jax import families
    from dspark_jax.errors import InputError

    if args.modes is None:
        has_cache = families.for_config(target_cfg).runtime is not None
        modes = ["online", "cache", "decode"] if draft_cfg is not None else ["forward"] + ["decode"] * has_cache
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"online", "cache", "decode", "forward"}
    if unknown:
        raise InputError(f"--modes: unknown programs {sorted(unknown)}")
    if draft_cfg is None and {"online", "cache"} & set(modes):
        raise InputError(f"--modes online / cache train a drafter; {args.target} has no released drafter yet "
                         "(plan forward, decode)")
    return modes


def _taps(args, target_cfg) -> tuple[int, ...]:
    """The layers a drafter reads from a --target preset without a drafter config (its in-checkpoint
    DSpark module's for DeepSeek-V4), else the last layer."""
    from dspark_jax import presets
    return presets.target_layer_ids(args.target) or (target_cfg.num_hidden_layers - 1,)


def _round_table(args, hw, mesh, draft_cfg, target_cfg, dtype) -> int:
    """``--round-table``: the compiled round table (``pipelines.plan_rounds``), written atomically."""
    from dspark_jax.pipelines.bench_inputs import parse_ints
    from dspark_jax.pipelines.plan_rounds import compiled_round_table

    table = compiled_round_table(draft_cfg, target_cfg, mesh, hw,
                                 parse_ints(args.decode_batches, "--decode-batches"),
                                 max_len=args.decode_len, dtype=dtype, cpu_compiled=bool(args.rates),
                                 ar=args.ar_step,
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
    return _write_round_table(args, table)


def _write_round_table(args, table: dict) -> int:
    """Write ``table`` to --round-table atomically and print its summary line (JSON)."""
    import json

    from dspark_jax.fileio import write_json

    write_json(args.round_table, table, force=args.force)
    print(json.dumps({"out": args.round_table, "batch_sizes": table["batch_sizes"],
                      "widths": table["widths"], "rps": table["rps"], "ar_rps": table["ar_rps"]}))
    return 0


def _analytic_table(args, hw) -> int:
    """``--round-table --rates --analytic``: the table from declared shapes (``pipelines.plan_rounds
    .analytic_round_table``) on the --mesh's expert axis, written atomically; nothing compiled."""
    from dspark_jax import sharding
    from dspark_jax.errors import InputError
    from dspark_jax.pipelines.bench_inputs import parse_ints
    from dspark_jax.pipelines.plan_rounds import analytic_round_table

    _, target_cfg, draft_cfg, mesh_spec = _configs(args)
    if draft_cfg is None:
        raise InputError("--round-table needs a drafter (--kind or a --config with one)")
    sizes = sharding.parse_mesh_spec(mesh_spec) if mesh_spec else {}
    if any(v != 1 for k, v in sizes.items() if k != "expert"):
        raise InputError(f"--analytic models an expert-parallel mesh (expert=N, other axes 1), "
                         f"got --mesh {mesh_spec!r}")
    table = analytic_round_table(draft_cfg, target_cfg, hw,
                                 parse_ints(args.decode_batches, "--decode-batches"),
                                 max_len=args.decode_len, expert_shards=sizes.get("expert", 1),
                                 ar=args.ar_step, log=lambda s: print(s, file=sys.stderr, flush=True))
    return _write_round_table(args, table)


def run(args) -> int:
    from dspark_jax.errors import InputError

    _check_args(args)
    hw = devices = None
    if args.rates:
        from dspark_jax.costs import hardware
        hw = hardware.parse(args.rates)
    if args.analytic:
        return _analytic_table(args, hw)
    if args.hardware:
        from dspark_jax.costs import hardware
        hw = hardware.parse(args.hardware)
        if args.devices is not None:
            raise InputError("--devices simulates CPU devices; --hardware brings its own: give one of them")
        devices = hardware.compile_devices(hw)
    else:
        _use_devices(args)
    from dspark_jax.pipelines import plan as plan_lib

    tcfg, target_cfg, draft_cfg, mesh_spec = _configs(args)
    if hw is not None and mesh_spec and not args.mesh:
        from dspark_jax import sharding
        sizes = sharding.parse_mesh_spec(mesh_spec)
        if -1 not in sizes.values() and math.prod(sizes.values()) != hw.num_devices:
            mesh_spec = None  # the config's mesh is for another device count: fsdp over the chips
    mesh = _mesh(args, mesh_spec, devices)
    if args.round_table:
        return _round_table(args, hw, mesh, draft_cfg, target_cfg, plan_lib.compute_dtype(tcfg))
    modes = _modes(args, draft_cfg, target_cfg)
    micro = args.micro_batch or mesh.shape["data"] * mesh.shape["fsdp"]
    report = plan_lib.target_param_report(target_cfg)
    if draft_cfg is not None:
        report.update(plan_lib.param_report(draft_cfg, target_cfg))
    report = {"mesh": dict(mesh.shape), "devices": mesh.size,
              "hardware": hw.to_json() if hw is not None else "simulated cpu",
              "seq_len": tcfg.max_length, "micro_batch": micro,
              "memory_options": dataclasses.asdict(tcfg.memory), **report, "programs": {}}
    mem = report["memory_options"]
    where = f"{hw.spec} compile-only ({mesh.devices.flat[0].device_kind})" if hw else "simulated CPU"
    print(f"mesh {dict(mesh.shape)} on {mesh.size} {where} devices; compute {args.dtype}; "
          f"remat {mem['remat']}, loss_chunk {mem['loss_chunk']}, shard_activations {mem['shard_activations']}")
    active = report["target_active_params"]
    print(f"target params {report['target_params']:,}"
          + (f" ({active:,} active per token)" if active != report["target_params"] else ""),
          end="; " if draft_cfg is not None else "\n")
    if draft_cfg is not None:
        print(f"drafter params {report['draft_params']:,} "
              f"(trainable {report['draft_trainable_params']:,}; frozen (embed, head, declared buffers) "
              f"{report['draft_params'] - report['draft_trainable_params']:,}); "
              f"from the reference tensor shapes {report['draft_params_from_reference_shapes']:,}")
    for mode in modes:
        print(f"compiling {mode} ...", file=sys.stderr, flush=True)
        if mode == "forward":
            taps = draft_cfg.target_layer_ids if draft_cfg is not None else _taps(args, target_cfg)
            plan, sizes = plan_lib.plan_target_forward(target_cfg, mesh, batch=micro, seq_len=tcfg.max_length,
                                                       taps=taps, dtype=plan_lib.compute_dtype(tcfg))
        elif mode == "decode":
            plan, sizes = plan_lib.plan_decode_round(draft_cfg, target_cfg, mesh, batch=args.decode_batch,
                                                     max_len=args.decode_len,
                                                     dtype=plan_lib.compute_dtype(tcfg))
        else:
            step_cfg = tcfg.replace(features=mode, cache_dir=tcfg.cache_dir or "<plan>",
                                    data=tcfg.data or "<plan>", batch_size=micro, grad_accum=1)
            plan, sizes = plan_lib.plan_train_step(draft_cfg, target_cfg, step_cfg, mesh)
        report["programs"][mode] = dict(plan.to_json(), **sizes)
        if hw is not None:
            report["programs"][mode]["fits"] = hardware.fits(plan.peak_bytes, hw.chip)
            report["programs"][mode]["projected"] = _projection(plan, mode, hw, tcfg, target_cfg, draft_cfg,
                                                                 micro, mesh.size)
        _print_program(plan, sizes, hw, report["programs"][mode].get("projected"))
    if args.json_out:
        from dspark_jax.fileio import write_json
        write_json(args.json_out, report, force=args.force)
        print(f"wrote {args.json_out}")
    return 0
