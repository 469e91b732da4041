"""Markdown table of the compiled decode rows in this folder (and ``bound.json``'s round_bound).

    python benchmarks/results/hw_tables/table.py [RUN ...]   # RUN: folders here (default: all)

Per step = hlo_cost's loops x trip counts (``step_bytes`` / ``step_projected`` of
``round_cost.py --compile-only``), per chip; projected ms = max(flops / peak, bytes / HBM
bandwidth) for the chip of ``--hardware``.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(runs: list[str]) -> None:
    bounds = {}
    if (HERE / "bound.json").exists():
        bounds = {(r["size"], r["batch"], r["hardware"]): r for r in json.loads((HERE / "bound.json").read_text())["rows"]}
    print("| hardware | target + DSpark | B | AR GB/step | round GB/step | AR ms | round ms | round/AR "
          "| round_bound | compulsory GB AR / round | temporaries GiB AR / round | peak GiB round (fits) | compile CPU s AR / round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    paths = [HERE / r / "round_cost_compiled.json" for r in runs] or sorted(HERE.glob("*/round_cost_compiled.json"))
    for path in paths:
        if path.parent.name.startswith("experiment_"):  # uncommitted-code experiments: README text only
            continue
        for r in json.loads(path.read_text())["rows"]:
            a, d = r["ar_step"], r["round"]
            b = bounds.get((r["size"], r["batch"], r["hardware"]))
            bound = f"{b['round_bound']:.2f} | {b['ar_bytes'] / 1e9:.2f} / {b['round_bytes'] / 1e9:.2f}" if b else "- | -"
            print(f"| {r['hardware']} | {r['size']} | {r['batch']} | {a['step_bytes'] / 1e9:.2f} | {d['step_bytes'] / 1e9:.2f} "
                  f"| {a['step_projected']['seconds'] * 1e3:.2f} | {d['step_projected']['seconds'] * 1e3:.2f} "
                  f"| {r['step_round_over_ar']:.2f} | {bound} "
                  f"| {a['temp_bytes'] / 2**30:.2f} / {d['temp_bytes'] / 2**30:.2f} "
                  f"| {d['peak_bytes'] / 2**30:.2f} ({'yes' if d['fits'] else 'NO'}) "
                  f"| {a['cpu_seconds']:.0f} / {d['cpu_seconds']:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
