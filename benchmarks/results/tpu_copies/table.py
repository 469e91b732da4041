"""Before / after table of the round_cost --compile-only JSONs in this folder (per chip, per step).

    python benchmarks/results/tpu_copies/table.py before_v5e after_v5e [before_v5p after_v5p]

ideal = the docs' compulsory-bytes ratio: (target + the drafter's own weights (its copies of the
target's embedding / LM head left out) + state) / (target + state), each as placed on one chip."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(name):
    return json.loads((HERE / name / "round_cost_compiled.json").read_text())["rows"]


def main(argv):
    print("| run | chip | B | round GB | AR GB | round / AR ms | **round/AR** | ideal | temporaries round / AR GiB | compile s round / AR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in argv:
        for r in rows(name):
            rd, ar = r["round"], r["ar_step"]
            own = rd["draft_bytes"] - _embed_head(r)
            ideal = (rd["target_bytes"] + own + rd["state_bytes"]) / (ar["target_bytes"] + ar["state_bytes"])
            print(f"| {name} | {r['hardware']} | {r['batch']} | {rd['step_bytes'] / 1e9:.2f} | {ar['step_bytes'] / 1e9:.2f} | "
                  f"{rd['step_projected']['seconds'] * 1e3:.2f} / {ar['step_projected']['seconds'] * 1e3:.2f} | "
                  f"**{r['step_round_over_ar']:.2f}** | {ideal:.2f} | {rd['temp_bytes'] / 2**30:.2f} / {ar['temp_bytes'] / 2**30:.2f} | "
                  f"{rd['compile_seconds']:.0f} / {ar['compile_seconds']:.0f} |")


def _embed_head(r):
    """Per-chip bytes of the drafter's copies of the target's embedding and LM head (vocab-sharded
    over the chips): 2 x V x H x 2 bytes / chips (Qwen3-8B: V = 151936, H = 4096)."""
    chips = {"tpu-v5e:2x4": 8, "tpu-v5p:2x2x1": 4}[r["hardware"]]
    return 2 * 151936 * 4096 * 2 / chips


if __name__ == "__main__":
    main(sys.argv[1:])
