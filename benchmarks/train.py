"""Train-step throughput on this machine: tokens/s and step time, cache vs online features.

    .venv/bin/python benchmarks/train.py [--sizes tiny,mid] [--steps 5] [--out bench_train.json]

"tiny" is the fixture target (hidden 64, 6 layers, vocab 512; drafter 1 layer); "mid" is a
random Qwen3-shaped target (hidden 512, 8 layers, vocab 8192; drafter 2 layers). Only the jitted
train step is timed (after one compile step); in cache mode the target features are precomputed,
so the difference is the cost of running the frozen target inside the step.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_jax.config import DraftConfig, TargetConfig  # noqa: E402
from dspark_jax.convert.checkpoint import load_target  # noqa: E402
from dspark_jax.draft import model as draft_model  # noqa: E402
from dspark_jax.fileio import write_json  # noqa: E402
from dspark_jax.target import qwen3  # noqa: E402
from dspark_jax.target.features import target_features  # noqa: E402
from dspark_jax.train import optim, step as step_lib  # noqa: E402
from dspark_jax.train.config import TrainConfig  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "tests/fixtures/dspark_qwen3_tiny/target"


def setup(size: str):
    if size == "tiny":
        tcfg, tparams = load_target(TINY)
        dkw = dict(num_hidden_layers=1, target_layer_ids=(0, 2, 4), mask_token_id=511, num_anchors=16,
                   markov_rank=64)
        batch, seq = 16, 128
    elif size == "mid":
        tcfg = TargetConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_theta=1e6)
        tparams = qwen3.init_params(tcfg, jax.random.PRNGKey(0))
        dkw = dict(num_hidden_layers=2, target_layer_ids=(1, 3, 5), mask_token_id=8191, num_anchors=64,
                   markov_rank=128)
        batch, seq = 8, 512
    else:
        raise SystemExit(f"unknown size {size!r}")
    return tcfg, tparams, DraftConfig.for_target(tcfg, **dkw), batch, seq


def bench(size: str, mode: str, steps: int, dtype: str) -> dict:
    tcfg, tparams, dcfg, b, s = setup(size)
    cfg = TrainConfig(target="x", data="x", batch_size=b, max_length=s, steps=1000, compute_dtype=dtype)
    compute = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    params = draft_model.init_params(dcfg, jax.random.PRNGKey(1), embed_tokens=tparams["embed_tokens"],
                                     lm_head=qwen3.lm_head_kernel(tparams))
    opt, sched = optim.make_optimizer(cfg.optimizer, cfg.steps)
    trainable, frozen = optim.split_params(params)
    state = step_lib.init_state(trainable, opt, 0)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, tcfg.vocab_size - 1, (1, b, s)), jnp.int32)
    batch = {"input_ids": ids, "loss_mask": jnp.ones((1, b, s), jnp.float32)}
    if mode == "cache":
        feats, last = jax.jit(lambda p, t: target_features(p, tcfg, dcfg.target_layer_ids, t)[:2])(tparams, ids[0])
        batch["features"], batch["last_hidden"] = feats[None], last[None]
    fn = step_lib.build_train_step(dcfg, cfg.loss, opt, sched,
                                   target_cfg=tcfg if mode == "online" else None, compute_dtype=compute)
    jstep = jax.jit(fn, donate_argnums=(0,))
    tp = tparams if mode == "online" else None
    t0 = time.perf_counter()
    state, m = jstep(state, frozen, tp, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = jstep(state, frozen, tp, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    return {"size": size, "mode": mode, "compute_dtype": dtype, "batch": b, "seq_len": s,
            "num_anchors": dcfg.num_anchors, "block_size": dcfg.block_size,
            "target": {"hidden": tcfg.hidden_size, "layers": tcfg.num_hidden_layers, "vocab": tcfg.vocab_size},
            "draft_layers": dcfg.num_hidden_layers, "first_step_s": compile_s, "step_s_median": step_s,
            "step_s_all": times, "tokens_per_s": b * s / step_s, "loss": float(m["loss"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--modes", default="cache,online")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, metavar="DIR", help="write DIR/train.json as well as to stdout")
    ap.add_argument("--smoke", action="store_true", help="smallest settings (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.modes, args.steps = "tiny", "cache", 1
    results = [bench(size, mode, args.steps, args.dtype)
               for size in args.sizes.split(",") for mode in args.modes.split(",")]
    report = {"benchmark": "train_step", "backend": jax.default_backend(), "devices": jax.device_count(),
              "machine": platform.machine(), "jax": jax.__version__, "results": results}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        write_json(Path(args.out) / "train.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
