"""DeepSeek-V4's own DSpark module learns on a tiny V4 pair: a few hundred steps of the real train
step lower the loss and raise the acceptance length of real speculative decoding.

    .venv/bin/python benchmarks/v4_dspark_train.py [--steps 300] [--out DIR] [--smoke]

Pair: tests/fixtures/deepseek_v4_tiny/target_dspark (a 6-layer V4 target, vocab 512, hidden 64,
CSA / HCA / sliding layers, 8 routed experts top-2) with a fresh module on its layers 3, 4, 5
(three V4 stages, block 5, Markov rank 16, confidence head; ``draft=`` of a train config, random
init: the untrained module).
Data: the target's own text: ``--train`` sequences of ``--length`` tokens, each a random first
token continued greedily by the target (``data.sample.sample_sequences``, temperature 0), the
loss on every token after the first. Held-out: the same from first tokens not in the training set.
Train: ``train.loop.train`` (online features: the frozen target runs inside the jitted step),
AdamW, float32, one device. Then the same run in cache mode (``dspark-jax cache`` of the same
data): online features equal cached features, so the two runs' losses agree step by step.
Eval: ``decode.api.speculative_generate``, greedy (T = 0), full verification: the untrained and
the trained module on ``--prompt`` tokens of each training / held-out sequence, ``--new`` new
tokens; tau = mean tokens per round (accepted drafts + the bonus token; 1.0 = no draft accepted).
Greedy speculative output equals the target's greedy continuation, checked on every prompt.

Writes DIR/v4_dspark_train.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_jax import cli  # noqa: E402
from dspark_jax.convert.checkpoint import load_draft, load_target  # noqa: E402
from dspark_jax.data.sample import sample_sequences, write_jsonl  # noqa: E402
from dspark_jax.decode.api import speculative_generate  # noqa: E402
from dspark_jax.fileio import write_json  # noqa: E402
from dspark_jax.train.config import TrainConfig  # noqa: E402
from dspark_jax.train.loop import load_drafter, train  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "tests/fixtures/deepseek_v4_tiny/target_dspark"
LAYERS = (3, 4, 5)


def texts(tparams, tcfg, n_train: int, n_held: int, length: int, seed: int):
    """(training sequences [n_train, length], held-out [n_held, length]): greedy continuations
    of distinct random first tokens, none of the held-out first tokens among the training ones."""
    pool = sample_sequences(tparams, tcfg, 4 * (n_train + n_held), length, seed=seed, temperature=0.0)
    _, first = np.unique(pool[:, 0], return_index=True)
    distinct = pool[np.sort(first)]
    if len(distinct) < n_train + n_held:
        raise SystemExit(f"only {len(distinct)} distinct first tokens; ask for fewer sequences")
    return distinct[:n_train], distinct[n_train:n_train + n_held]


def tau(tcfg, tparams, dcfg, dparams, seqs: np.ndarray, prompt: int, new: int) -> dict:
    """Greedy speculative decoding of each sequence's first ``prompt`` tokens: mean tokens per
    round, rounds, and whether every output is the target's own continuation (``seqs``)."""
    res = speculative_generate(tcfg, tparams, dcfg, dparams, [list(map(int, s[:prompt])) for s in seqs],
                               max_new_tokens=new, temperature=0.0, batch_size=len(seqs),
                               cache_spans=(256,), max_cache_len=256)
    acc = [a for r in res for a in r.acceptance_lengths]
    exact = all(list(r.output_ids) == [int(t) for t in s[prompt:prompt + new]] for r, s in zip(res, seqs))
    return {"tau": float(np.mean(acc)), "rounds": len(acc), "target_tokens": exact}


def run(args) -> dict:
    tcfg, tparams = load_target(PAIR)
    train_seqs, held = texts(tparams, tcfg, args.train, args.held, args.length, args.seed)
    work = Path(tempfile.mkdtemp(prefix="v4_dspark_train_"))
    data = work / "train.jsonl"
    write_jsonl(data, train_seqs)
    base = dict(target=str(PAIR), data=str(data),
                draft=dict(target_layer_ids=LAYERS, block_size=5, markov_rank=16, mask_token_id=tcfg.vocab_size - 1,
                           num_anchors=args.anchors),
                max_length=args.length, batch_size=args.batch, steps=args.steps, compute_dtype="float32",
                optimizer=dict(learning_rate=args.lr, warmup_ratio=0.05), checkpoint=dict(every=0),
                progress=False, num_devices=1, mesh="data=1", export_format="torch", seed=args.seed)
    online_cfg = TrainConfig(output_dir=str(work / "online"), **base)
    dcfg0, dparams0 = load_drafter(online_cfg, tcfg, tparams)     # the untrained module (the run's start)

    t0 = time.perf_counter()
    online = train(online_cfg, fast_compile=args.fast_compile)
    online_s = time.perf_counter() - t0
    online_vs_cache = None
    if not args.smoke:  # the cache leg: tests/test_deepseek_v4_dspark_train.py runs the same in CI
        assert cli.main(["cache", "--target", str(PAIR), "--data", str(data), "--out", str(work / "cache"),
                         "--layer-ids", ",".join(map(str, LAYERS)), "--max-length", str(args.length),
                         "--batch-size", str(args.batch), "--quiet"]) == 0
        cached = train(TrainConfig(output_dir=str(work / "cached"), features="cache", cache_dir=str(work / "cache"),
                                   **dict(base, export_format="none")), fast_compile=args.fast_compile)
        diff = np.abs(np.array([r["loss"] for r in online["history"]])
                      - np.array([r["loss"] for r in cached["history"]]))
        online_vs_cache = {"steps": len(diff), "max_abs_loss_diff": float(np.max(diff)),
                           "max_abs_loss_diff_first_10": float(np.max(diff[:10]))}
    dcfg1, dparams1 = load_draft(online["export"], target_params=tparams)

    hist = online["history"]
    k = max(1, min(10, len(hist) // 10))
    loss = lambda rows, key: float(np.mean([r[key] for r in rows]))  # noqa: E731
    evals = {}
    modules = (("untrained", (dcfg0, dparams0)), ("trained", (dcfg1, dparams1)))
    for name, (dc, dp) in modules[1:] if args.smoke else modules:  # smoke: one module's decode programs
        for split, seqs in (("train", train_seqs[:args.held]), ("held_out", held)):
            evals[f"{name}/{split}"] = tau(tcfg, tparams, dc, dp, seqs, args.prompt, args.new)
    return {
        "benchmark": "v4_dspark_train", "platform": platform.platform(), "pair": str(PAIR.name),
        "settings": {k2: v for k2, v in vars(args).items() if k2 != "out"},
        "distinct_tokens_per_sequence": float(np.mean([len(set(s)) for s in train_seqs])),
        "loss": {"first": loss(hist[:k], "loss"), "last": loss(hist[-k:], "loss"), "averaged_steps": k},
        "ce_loss": {"first": loss(hist[:k], "ce_loss"), "last": loss(hist[-k:], "ce_loss")},
        "expected_accept_length": {"first": loss(hist[:k], "expected_accept_length"),
                                   "last": loss(hist[-k:], "expected_accept_length")},
        "online_vs_cache": online_vs_cache,
        "online_train_seconds": online_s, "decode": evals,
    }


def table(r: dict) -> str:
    lines = ["| module | prompts | tau (tokens / round) | rounds | output = target's |", "|---|---|---|---|---|"]
    for key, e in r["decode"].items():
        name, split = key.split("/")
        lines.append(f"| {name} | {split} | {e['tau']:.3f} | {e['rounds']} | {e['target_tokens']} |")
    lo, ea, oc = r["loss"], r["expected_accept_length"], r["online_vs_cache"]
    versus = ("not run (--smoke)" if oc is None else f"max |loss diff| {oc['max_abs_loss_diff_first_10']:.2e} "
              f"(first 10 steps), {oc['max_abs_loss_diff']:.2e} (all {oc['steps']})")
    lines.append(f"\nloss {lo['first']:.3f} -> {lo['last']:.3f} (mean of the first / last {lo['averaged_steps']} "
                 f"steps); training-batch expected acceptance {ea['first']:.3f} -> {ea['last']:.3f}; "
                 f"online vs cache: {versus}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--train", type=int, default=64, help="training sequences (default 64)")
    p.add_argument("--held", type=int, default=16, help="held-out sequences, and training ones decoded (default 16)")
    p.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128: one HCA window)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens per decoded sequence (default 8)")
    p.add_argument("--new", type=int, default=64, help="new tokens per decoded sequence (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fast-compile", action="store_true",
                   help="compile the train steps at XLA's low optimisation level (quicker compile, slower steps)")
    p.add_argument("--smoke", action="store_true", help="tiny settings (CI): 3 steps, 8 sequences, 16 new tokens, the trained module's decode only, no cache-mode run")
    p.add_argument("--out", default=".", help="directory for v4_dspark_train.json (default .)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.train, args.held, args.batch, args.new, args.fast_compile = 3, 8, 4, 4, 16, True
    out = Path(args.out) / "v4_dspark_train.json"
    if not Path(args.out).is_dir():
        print(f"--out {args.out}: not a directory", file=sys.stderr)
        return 2
    result = run(args)
    write_json(out, result, indent=1, force=True)
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
