"""One-call accelerator check: decode round vs AR step, an SPS table, the online train step.

    bash benchmarks/accelerator.sh OUTDIR            # one GPU / TPU host, < 8 minutes
    bash benchmarks/accelerator.sh --small OUTDIR    # tiny shapes, CPU, < 1 minute
    python benchmarks/accelerator.py [--small|--smoke] --out OUTDIR

Sections (``--sections``; each writes its own JSON as soon as it is done, then ``accelerator.json`` holds
everything; a section that would start after ``--budget-s`` is skipped and says so):

0. ``matmul``: achieved FLOP/s of one large square ``jnp.dot`` in the run's dtype (the
   measured peak that the train step's FLOP/s is compared with; CPUs have no PEAKS entry).
1. ``decode``: a Qwen3-4B-shaped random target in bf16 (presets ``Qwen/Qwen3-4B``) with the
   released 4B drafter shape (5 layers, block 7): the shipped AR step and speculative round
   (greedy, FullPolicy, prompt ``--prompt-len``, cache for ``--max-new-tokens``), compiled
   once, timed interleaved (median of passes), at B = 1, 8, 32, 64.
2. ``sps``: ``dspark_jax.decode.profile.measure_sps`` (target verification steps per
   second, "rows" layout) at B = 1..64, the table the scheduler policy reads.
3. ``train``: the online train step (frozen target inside the step) with the production
   memory options (bf16 compute over fp32 masters, remat "dots", loss_chunk 64), one
   sequence of ``--train-seq`` tokens per micro-step: tokens/s and MFU (analytic model
   FLOPs, ``roofline.model_flops``, over the chip's peak from ``PEAKS``; None when the chip
   is unknown), plus the compiled program's own FLOPs (HFU, remat recompute included).

``train_cache`` (not in the default list): the same step in cache mode (features precomputed).
``--shape mid --dtype float32 --sections matmul,train,train_cache``: the CPU training-speed
measurement of docs/performance.md (round_cost's 162M target).

``--small``: the target is hidden 128 / 4 layers / vocab 1024 (drafter 1 layer, block 5),
B = 1, 2, SPS at 1, 2, train sequence 64 tokens, numpy-initialised params and fast (low
optimisation) CPU compiles of the timed programs.
Compile counts are reported per section (timed calls must compile nothing).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import round_cost  # noqa: E402  (shipped-program adapter + timing)
import roofline  # noqa: E402  (model FLOPs)

from dspark_jax.config import DraftConfig, TargetConfig  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402
from dspark_jax.target import qwen3  # noqa: E402
from dspark_jax.costs.compiles import COMPILES

# device_kind substring -> peak dense bf16 FLOP/s per chip (for MFU)
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "TPU v5 lite": 197e12,
         "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6": 918e12, "TPU v4": 275e12}
def device_info() -> dict:
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", "")
    peak = next((v for k, v in PEAKS.items() if k.lower() in kind.lower()), None)
    return {"platform": d.platform, "device_kind": kind, "num_devices": jax.device_count(),
            "peak_bf16_flops": peak, "host": platform.node(), "jax": jax.__version__}


def models(shape: str):
    """(tcfg, dcfg) of the run: Qwen3-4B shape with its released drafter, round_cost's mid, or tiny."""
    if shape == "mid":
        tkw, dkw = round_cost.SIZES["mid"]
        tcfg = TargetConfig(**tkw)
        return tcfg, DraftConfig.for_target(tcfg, **dkw)
    if shape == "small":
        tcfg = TargetConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            max_position_embeddings=4096)
        dcfg = DraftConfig.for_target(tcfg, num_hidden_layers=1, block_size=5, target_layer_ids=(0, 2),
                                      mask_token_id=1023, num_anchors=16, markov_rank=16)
        return tcfg, dcfg
    from dspark_jax.presets import TARGETS, released_drafter
    return TARGETS["Qwen/Qwen3-4B"], released_drafter("Qwen/Qwen3-4B")


def random_params(tcfg, dcfg, small: bool, dtype=jnp.bfloat16):
    """Random target + drafter params: made on the device (jitted init, no host copies), or with
    numpy for the small shapes (no compile)."""
    if small:
        key = jax.random.PRNGKey(0)
        tp = round_cost.random_like(jax.eval_shape(lambda k: qwen3.init_params(tcfg, k), key), 0, dtype)
        dshape = jax.eval_shape(lambda k: draft_model.init_params(dcfg, k), key)
        dp = round_cost.random_like({k: v for k, v in dshape.items() if k not in draft_model.FROZEN_KEYS}, 1, dtype)
        dp["embed_tokens"], dp["lm_head"] = tp["embed_tokens"], qwen3.lm_head_kernel(tp)
        return tp, dp
    tp = jax.jit(lambda k: qwen3.init_params(tcfg, k, dtype))(jax.random.PRNGKey(0))
    dp = jax.jit(lambda k, e, h: draft_model.init_params(dcfg, k, dtype, embed_tokens=e, lm_head=h))(
        jax.random.PRNGKey(1), tp["embed_tokens"], qwen3.lm_head_kernel(tp))
    return tp, dp


def bench_decode(tcfg, dcfg, tp, dp, batches, prompt_len, max_new, repeats, min_seconds,
                 compiler_options=None) -> list[dict]:
    rows = []
    for b in batches:
        before = COMPILES[0]
        t0 = time.perf_counter()
        # spans="prompt": compile the span the shipped default reads at prompt_len (and the
        # capacity), not all four: the timed kernels are the shipped ones, the lent clock is spared
        a = round_cost.decode_programs(tcfg, tp, dcfg, dp, b, prompt_len, max_new, spans="prompt")
        progs = round_cost.shipped_programs(a, compiler_options=compiler_options)
        build_s = time.perf_counter() - t0
        compiles_build = COMPILES[0] - before
        before = COMPILES[0]
        times = round_cost.time_programs(progs, repeats, min_seconds, warmup=1)
        ar, rnd = times["ar_step"]["median_s"], times["round"]["median_s"]
        rows.append({"batch": b, "cache_len": a["max_len"], "span": a["span"], "ar_step_s": ar, "round_s": rnd,
                     "round_over_ar": rnd / ar, "ar_tokens_per_s": b / ar,
                     "hlo_ops": {k: p.hlo_ops for k, p in progs.items()},
                     "build_s": build_s, "compiles_build": compiles_build,
                     "compiles_timed": COMPILES[0] - before})
        print(f"decode B={b:>3}: AR step {ar * 1e3:8.3f} ms  round {rnd * 1e3:8.3f} ms  "
              f"round/AR {rnd / ar:5.2f}  (build {build_s:.0f} s, compiles {compiles_build}/"
              f"{rows[-1]['compiles_timed']})", flush=True)
        del progs, a
    return rows


def bench_sps(tcfg, tp, batches, cache_length) -> dict:
    from dspark_jax.decode.profile import measure_sps
    before = COMPILES[0]
    t0 = time.perf_counter()
    table = measure_sps(tcfg, tp, batches, cache_length, layout="rows", warmup=2, iters=3,
                        min_seconds=0.05, repeats=2, fit="none")
    out = {"table": table.to_json(), "seconds": time.perf_counter() - t0, "compiles": COMPILES[0] - before}
    print("sps: " + "  ".join(f"B={b}:{s:.1f}" for b, s in zip(table.batch_sizes, table.sps)), flush=True)
    return out


def matmul_fn(n: int, dtype, repeats: int):
    """A function returning the best FLOP/s of ``repeats`` timed n x n @ n x n ``jnp.dot`` calls."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32), dtype)
    dot = jax.jit(jnp.dot).lower(a, a).compile()
    jax.block_until_ready(dot(a, a))

    def measure():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(dot(a, a))
            best = min(best, time.perf_counter() - t0)
        return 2 * n ** 3 / best
    return measure


def matmul_peak(n: int, dtype, repeats: int = 5) -> dict:
    """Achieved FLOP/s of one large square ``jnp.dot`` (n x n @ n x n in ``dtype``): best of ``repeats``."""
    flops = matmul_fn(n, dtype, repeats)()
    out = {"n": n, "dtype": str(np.dtype(dtype)), "seconds": 2 * n ** 3 / flops, "flops_per_s": flops}
    print(f"matmul {n}x{n} {out['dtype']}: {flops / 1e9:.1f} GFLOP/s", flush=True)
    return out


def bench_train(tcfg, dcfg, tp, seq, steps, options, peak, compiler_options=None, mode="online",
                batch_rows=1, compute_dtype=jnp.bfloat16, measured_peak=None, paired_matmul=None) -> dict:
    """One train step's speed. ``paired_matmul`` (a function -> FLOP/s) is measured right before
    every timed step, and each step's achieved FLOP/s is divided by it (a noisy, shared machine:
    the pair sees the same load); the median of those ratios is ``paired_fraction_of_matmul``."""
    from dspark_jax.train import optim, step as step_lib
    from dspark_jax.train.config import TrainConfig

    cfg = TrainConfig(target="x", data="x", batch_size=1, max_length=seq, steps=1000)
    opt, sched = optim.make_optimizer(cfg.optimizer, cfg.steps)
    fn = step_lib.build_train_step(dcfg, cfg.loss, opt, sched,
                                   target_cfg=tcfg if mode == "online" else None,
                                   compute_dtype=compute_dtype, remat=options["remat"],
                                   loss_chunk=options["loss_chunk"])
    params = jax.jit(lambda k, e, h: draft_model.init_params(dcfg, k, jnp.float32, embed_tokens=e, lm_head=h))(
        jax.random.PRNGKey(2), tp["embed_tokens"], qwen3.lm_head_kernel(tp))
    trainable, frozen = optim.split_params(params)
    frozen = jax.tree.map(lambda x: x.astype(tp["embed_tokens"].dtype), frozen)
    state = step_lib.init_state(trainable, opt, 0)
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(0, tcfg.vocab_size - 1, (1, batch_rows, seq)), jnp.int32),
             "loss_mask": jnp.ones((1, batch_rows, seq), jnp.float32)}
    if mode == "cache":  # precomputed target features, as `dspark-jax cache` stores them
        from dspark_jax.data.online import target_features
        feats, last = jax.jit(lambda p, t: target_features(p, tcfg, dcfg.target_layer_ids, t, compute_dtype))(
            tp, batch["input_ids"][0])
        batch["features"], batch["last_hidden"] = feats[None], last[None]
    tp = tp if mode == "online" else None
    before = COMPILES[0]
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=(0,)).lower(state, frozen, tp, batch).compile(compiler_options)
    compile_s = time.perf_counter() - t0
    ca = compiled.cost_analysis()
    ca = (ca[0] if isinstance(ca, (list, tuple)) else ca) or {}
    hlo_flops = float(ca.get("flops", 0.0))
    state, m = compiled(state, frozen, tp, batch)
    jax.block_until_ready(m)
    compiles_build = COMPILES[0] - before
    before = COMPILES[0]
    times, mm = [], []
    for _ in range(steps):
        if paired_matmul is not None:
            mm.append(paired_matmul())
        t0 = time.perf_counter()
        state, m = compiled(state, frozen, tp, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    mf = roofline.model_flops(tcfg, dcfg, seq, online=mode == "online") * batch_rows
    tokens = seq * batch_rows
    out = {"mode": mode, "seq_len": seq, "sequences_per_step": batch_rows,
           "options": dict(options, compute_dtype=str(np.dtype(compute_dtype))),
           "compile_s": compile_s, "step_s_median": step_s, "step_s_all": times, "tokens_per_s": tokens / step_s,
           "model_flops": mf, "hlo_flops": hlo_flops, "achieved_model_flops_per_s": mf / step_s,
           "mfu": (mf / step_s / peak) if peak else None,
           "hfu": (hlo_flops / step_s / peak) if peak and hlo_flops else None,
           "fraction_of_measured_matmul_peak": (mf / step_s / measured_peak) if measured_peak else None,
           "hlo_fraction_of_measured_matmul_peak": (hlo_flops / step_s / measured_peak) if measured_peak else None,
           "paired_matmul_flops_per_s": mm or None,
           "paired_fraction_of_matmul": (float(np.median([mf / t / f for t, f in zip(times, mm)])) if mm else None),
           "loss": float(m["loss"]), "compiles_build": compiles_build, "compiles_timed": COMPILES[0] - before}
    mfu = f"{out['mfu'] * 100:.1f}%" if out["mfu"] is not None else "n/a (unknown peak)"
    print(f"train {mode}: {step_s * 1e3:.1f} ms/step, {tokens / step_s:.0f} tokens/s, model {mf / step_s / 1e12:.3f} "
          f"TFLOP/s, MFU {mfu}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the JSON files")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU, < 1 minute)")
    ap.add_argument("--smoke", action="store_true", help="same as --small")
    ap.add_argument("--sections", default="matmul,decode,sps,train",
                    help="comma list of matmul,decode,sps,train,train_cache")
    ap.add_argument("--shape", default=None, choices=["qwen3-4b", "mid", "small"],
                    help="target shape (default qwen3-4b; small with --small; mid = round_cost's 162M)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="params / compute dtype (float32 for CPU FLOP/s measurements)")
    ap.add_argument("--train-seq", type=int, default=0, help="tokens per train sequence (0: shape default)")
    ap.add_argument("--train-batch", type=int, default=1, help="sequences per train step")
    ap.add_argument("--matmul-n", type=int, default=0, help="matmul size (0: shape default)")
    ap.add_argument("--paired-matmul", action="store_true",
                    help="measure the matmul right before every timed train step (shared machines)")
    ap.add_argument("--remat", default=None, choices=["none", "dots", "full"], help="override the train option")
    ap.add_argument("--loss-chunk", type=int, default=None, help="override the train option (0: no chunking)")
    ap.add_argument("--train-steps", type=int, default=0, help="timed train steps (0: shape default)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip sections that would start later")
    args = ap.parse_args(argv)
    small = args.small or args.smoke
    shape = args.shape or ("small" if small else "qwen3-4b")
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    fast = None
    if shape == "small":
        batches, sps_batches, prompt_len, max_new, seq, steps, repeats = [1, 2], [1, 2], 16, 32, 64, 2, 2
        min_seconds, options, mm_n = 0.01, {"remat": "dots", "loss_chunk": 8}, 512
        if jax.default_backend() == "cpu":  # CPU smoke runs: quick compiles
            from dspark_jax.train.program import FAST_COMPILE_OPTIONS as fast
    elif shape == "mid":
        batches, sps_batches, prompt_len, max_new, seq, steps, repeats = [1, 8, 32], [1, 2, 4, 8, 16, 32], \
            128, 256, 512, 3, 3
        min_seconds, options, mm_n = 0.2, {"remat": "dots", "loss_chunk": 16}, 2048
    else:
        batches, sps_batches, prompt_len, max_new, seq, steps, repeats = [1, 8, 32, 64], [1, 2, 4, 8, 16, 32, 64], \
            512, 512, 4096, 5, 5
        min_seconds, options, mm_n = 0.1, {"remat": "dots", "loss_chunk": 64}, 8192
    seq = args.train_seq or seq
    steps = args.train_steps or steps
    if args.remat is not None:
        options = dict(options, remat=args.remat)
    if args.loss_chunk is not None:
        options = dict(options, loss_chunk=args.loss_chunk)
    mm_n = args.matmul_n or mm_n
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    info = device_info()
    tcfg, dcfg = models(shape)
    report = {"benchmark": "accelerator", "small": small, "shape": shape,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": info,
              "target": {"shape": shape, "hidden": tcfg.hidden_size, "layers": tcfg.num_hidden_layers,
                         "vocab": tcfg.vocab_size, "dtype": args.dtype},
              "draft": {"layers": dcfg.num_hidden_layers, "block_size": dcfg.block_size,
                        "markov_rank": dcfg.markov_rank}, "sections": {}}
    print(f"device: {info['platform']} {info['device_kind']} (peak {info['peak_bf16_flops']}), shape {shape}",
          flush=True)
    t0 = time.perf_counter()
    tp, dp = random_params(tcfg, dcfg, shape != "qwen3-4b", dtype)
    jax.block_until_ready((tp, dp))
    report["init_s"] = time.perf_counter() - t0
    measured_peak = None
    for name in args.sections.split(","):
        if time.perf_counter() - start > args.budget_s:
            report["sections"][name] = {"skipped": f"time budget {args.budget_s:.0f} s spent"}
            continue
        if name == "matmul":
            res = matmul_peak(mm_n, dtype)
            measured_peak = res["flops_per_s"]
        elif name == "decode":
            res = {"prompt_len": prompt_len, "max_new_tokens": max_new, "greedy": True, "policy": "full",
                   "rows": bench_decode(tcfg, dcfg, tp, dp, batches, prompt_len, max_new, repeats, min_seconds,
                                        fast)}
        elif name == "sps":
            res = bench_sps(tcfg, tp, sps_batches, prompt_len)
        elif name in ("train", "train_cache"):
            res = bench_train(tcfg, dcfg, tp, seq, steps, options, info["peak_bf16_flops"], fast,
                              mode="online" if name == "train" else "cache", batch_rows=args.train_batch,
                              compute_dtype=dtype, measured_peak=measured_peak,
                              paired_matmul=matmul_fn(mm_n, dtype, 3) if args.paired_matmul else None)
        else:
            raise SystemExit(f"unknown section {name!r}")
        report["sections"][name] = res
        round_cost.write_json(out / f"accelerator_{name}.json", res)
    report["total_s"] = time.perf_counter() - start
    report["total_compiles"] = COMPILES[0]
    report["compiles_timed"] = sum(r.get("compiles_timed", 0) for s in report["sections"].values()
                                   for r in ([s] + s.get("rows", []) if isinstance(s, dict) else []))
    round_cost.write_json(out / "accelerator.json", report)
    print(f"wrote {out / 'accelerator.json'} in {report['total_s']:.0f} s "
          f"(compiles {COMPILES[0]}, during timing {report['compiles_timed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
