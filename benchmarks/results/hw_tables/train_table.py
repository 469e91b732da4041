"""Markdown table of the compiled train steps in ``train/`` (``dspark_jax.cli plan --json``).

    python benchmarks/results/hw_tables/train_table.py

Per run = loops x trip counts (``step_flops`` / ``step_bytes``), per chip; projected ms =
max(flops / peak, bytes / HBM bandwidth) (collectives not charged); tokens/s per chip and MFU
(model flops / (projected s x peak)) from the plan's ``projected``.
"""

import json
from pathlib import Path

HERE = Path(__file__).parent / "train"


def main() -> None:
    print("| config | hardware | mesh | seq x micro-batch | step TFLOP | step GB | projected ms (bound) "
          "| tokens/s per chip | MFU | compiled / model flops | temporaries GiB | peak GiB (fits) | compile s (wall, loaded host) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(HERE.glob("*.json")):
        d = json.loads(path.read_text())
        for mode, p in d["programs"].items():
            pr = p["projected"]
            mesh = ",".join(f"{k}={v}" for k, v in d["mesh"].items())
            print(f"| {path.stem.split('_v5p')[0]} {mode} | {d['hardware']['spec']} | {mesh} | {d['seq_len']} x {d['micro_batch']} "
                  f"| {p['step_flops'] / 1e12:.2f} | {p['step_bytes'] / 1e9:.1f} | {pr['seconds'] * 1e3:.1f} ({pr['bound']}) "
                  f"| {pr['tokens_per_s']:,.0f} | {pr['mfu'] * 100:.1f}% | {pr['compiled_over_model_flops']:.2f} "
                  f"| {p['temp_bytes'] / 2**30:.2f} | {p['peak_bytes'] / 2**30:.2f} ({'yes' if p['fits'] else 'NO'}) "
                  f"| {p['compile_seconds']:.0f} |")


if __name__ == "__main__":
    main()
