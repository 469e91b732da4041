"""The largest HBM byte consumers of one run of a compiled module, loops counted per trip.

Reads an optimised HLO dump (``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"``, file
``*after_optimizations.txt``) with ``dspark_jax.costs.hlo_cost``'s accounting (each top-level
instruction's bytes as ``step_cost`` charges them, a while body x its trip count, a conditional's
costliest branch) and prints the total and the instructions with the most bytes x trips: their
bytes per run, trips, op, result shape, operand shapes and JAX source (op_name metadata).

    python benchmarks/results/tpu_copies/hlo_top.py FILE [--top N] [--group]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from dspark_jax.costs import hlo_cost as hc  # noqa: E402


def walk(comp, comps, by_name, mult, out, memo):
    """Append (bytes x mult, mult, instr) of every charged top-level instruction of ``comp``."""
    for ins in comps.get(comp, []):
        op = ins.op
        if op == "while":
            n = hc.trip_count(ins, comps, by_name)
            walk(ins.callee("body"), comps, by_name, mult * n, out, memo)
        elif op == "conditional":
            costs = [(hc.computation_cost(b, comps, by_name, memo)[1], b) for b in hc.branches_of(ins)]
            if costs:
                walk(max(costs)[1], comps, by_name, mult, out, memo)
        elif op == "call" or (op.endswith("-start") and ins.callee("calls")):
            walk(ins.callee("to_apply") or ins.callee("calls"), comps, by_name, mult, out, memo)
        elif (b := hc.instr_bytes(ins, comps, by_name)) is not None:
            out.append((b * mult, mult, ins))


def source(ins) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    text = Path(args.file).read_text()
    comps, entry, by_name = hc.parse(text)
    rows = []
    walk(entry, comps, by_name, 1, rows, {})
    total = sum(r[0] for r in rows)
    print(f"{args.file}: {total / 1e9:.3f} GB per run (hlo_cost.step_cost: {hc.step_cost(text)['bytes'] / 1e9:.3f})")
    groups = collections.defaultdict(lambda: [0.0, 0])
    for b, m, ins in rows:
        key = (ins.op, re.sub(r"[.\d]+$", "", ins.name), ins.type.split("{")[0])
        groups[key][0] += b
        groups[key][1] += m
    print("grouped (op, name stem, shape): GB, runs")
    for key, (b, m) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {b / 1e9:8.3f} GB  x{m:<4} {key[0]:<14} {key[1]:<36} {key[2]}")
    print("largest instructions (bytes x trips):")
    for b, m, ins in sorted(rows, key=lambda r: -r[0])[:args.top]:
        ops = ", ".join(by_name[o].type.split("{")[0] for o in ins.operands if o in by_name)
        print(f"  {b / 1e9:8.3f} GB x{m:<3} {ins.op:<10} {ins.name:<40} -> {ins.type.split('{')[0]:<28} "
              f"<- {ops[:160]}\n        {source(ins)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
