"""Compulsory-bytes bound of a speculative round against the AR step, per chip.

    export PYTHONPATH=$PWD JAX_PLATFORMS=cpu
    python benchmarks/results/hw_tables/bound.py benchmarks/results/hw_tables/*/round_cost_compiled.json
    # a CUDA row (h200:*) needs the CUDA venv: /work/venvs/hw-cuda/bin/python ... (rows of the
    # other platform are skipped, so run it once per venv)

For each row of a ``round_cost.py --compile-only`` JSON (one preset, one B, one ``--hardware``):
the bytes one chip must read at least once per step, with every parameter placed as
``plan_decode_round`` places it (``families.abstract_params`` with ``sharded.decode_rules`` on
the same compile-only ``tensor=N`` mesh; each leaf counted at its per-device shard shape, so a
tensor-sharded weight counts 1/N, a replicated one in full):

- AR = target weights read + target KV read, where target weights = every target parameter but
  an untied ``embed_tokens`` (gathered: B rows, not the table; when tied it is the LM head and
  counts), KV = the decode state's whole target cache (``kv_cache_bytes`` of the JSON, per
  device; attention runs over the whole ``--cache-len`` span; Gemma4's sliding layers hold
  a ring of window - 1 + max extend slots (1024 for the AR step, 1031 for the round), so that
  is what counts; its full layers store K and V although k = v, and both count);
- round = AR + drafter weights (layers, fc, norms, Markov ``markov_w2`` [r, V], confidence head,
  its LM-head copy; not ``embed_tokens`` nor ``markov_w1`` [V, r]: both are row gathers) +
  the drafter's context K/V cache (``draft_context_cache_bytes``, per device).

round_bound = round / AR: the round's time over the AR step's if both were memory-bound at
compulsory traffic (activations, logits and scatters ignored). Writes ``bound.json`` beside
this file (rows merged over runs) and prints a markdown table.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import families, presets, sharding
from dspark_jax.costs import hardware
from dspark_jax.decode import programs, sharded

GATHERED = {"target": {"embed_tokens"}, "draft": {"embed_tokens", "markov_w1"}}


def per_device_bytes(abs_tree, skip: set[str]) -> int:
    """Sum over leaves of per-device shard bytes, leaves whose last key is in ``skip`` left out."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(abs_tree):
        name = getattr(path[-1], "key", str(path[-1]))
        if name in skip:
            continue
        total += math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return int(total)


def bound_row(row: dict, mesh) -> dict:
    tcfg = presets.resolve_target(row["size"])
    dcfg = presets.released_drafter(row["size"], kind="dspark")
    rules = programs.build_decode(mesh, sharded.decode_rules(tcfg)).rules
    t_abs, _ = families.abstract_params(tcfg, mesh, jnp.bfloat16, rules)
    d_abs, _ = families.abstract_params(dcfg, mesh, jnp.bfloat16, rules)
    tied = bool(getattr(tcfg, "tie_word_embeddings", False))
    target_w = per_device_bytes(t_abs, set() if tied else GATHERED["target"])
    draft_w = per_device_bytes(d_abs, GATHERED["draft"])
    kv, kv_round = row["ar_step"]["kv_cache_bytes"], row["round"]["kv_cache_bytes"]  # Gemma4 round: ring + G
    ctx = row["round"]["draft_context_cache_bytes"]
    ar, rnd = target_w + kv, target_w + kv_round + draft_w + ctx
    chip = hardware.parse(row["hardware"]).chip
    return {"size": row["size"], "batch": row["batch"], "hardware": row["hardware"], "tensor": mesh.shape["tensor"],
            "target_weights_read": target_w, "target_kv_read": kv, "target_kv_read_round": kv_round, "draft_weights_read": draft_w,
            "draft_context_kv_read": ctx, "ar_bytes": ar, "round_bytes": rnd, "round_bound": rnd / ar,
            "ar_bound_ms": ar / chip.bandwidth * 1e3, "round_bound_ms": rnd / chip.bandwidth * 1e3,
            "compiled_step_round_over_ar": row["step_round_over_ar"],
            "compiled_ar_gb": row["ar_step"]["step_bytes"] / 1e9, "compiled_round_gb": row["round"]["step_bytes"] / 1e9}


def main(paths: list[str]) -> int:
    out_path = Path(__file__).with_name("bound.json")
    merged = {(r["size"], r["batch"], r["hardware"]): r
              for r in (json.loads(out_path.read_text())["rows"] if out_path.exists() else [])}
    meshes = {}
    for p in paths:
        if Path(p).parent.name.startswith("experiment_"):  # uncommitted-code experiments: README text only
            continue
        for row in json.loads(Path(p).read_text())["rows"]:
            hw = hardware.parse(row["hardware"])
            if not hardware.has_extra(hw.chip.platform):
                print(f"skip {row['hardware']} ({p}): no {hw.chip.platform} extra in this venv", file=sys.stderr)
                continue
            if row["hardware"] not in meshes:
                devices = hardware.compile_devices(hw)
                meshes[row["hardware"]] = sharding.make_mesh(f"tensor={len(devices)}", devices)
            r = bound_row(row, meshes[row["hardware"]])
            merged[(r["size"], r["batch"], r["hardware"])] = r
    rows = sorted(merged.values(), key=lambda r: (r["hardware"], r["size"], r["batch"]))
    out_path.write_text(json.dumps({"rows": rows}, indent=1))
    print("| hardware | size | B | target W GB | target KV GB | drafter W GB | drafter ctx KV GB "
          "| AR GB | round GB | round_bound | compiled round/AR | compiled / compulsory AR, round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hardware']} | {r['size']} | {r['batch']} | {r['target_weights_read'] / 1e9:.2f} "
              f"| {r['target_kv_read'] / 1e9:.3f} | {r['draft_weights_read'] / 1e9:.2f} "
              f"| {r['draft_context_kv_read'] / 1e9:.3f} | {r['ar_bytes'] / 1e9:.2f} | {r['round_bytes'] / 1e9:.2f} "
              f"| {r['round_bound']:.2f} | {r['compiled_step_round_over_ar']:.2f} "
              f"| {r['compiled_ar_gb'] * 1e9 / r['ar_bytes']:.2f}, {r['compiled_round_gb'] * 1e9 / r['round_bytes']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
