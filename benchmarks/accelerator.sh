#!/usr/bin/env bash
# One call on a lent GPU / TPU host (< 8 minutes), JSON to OUTDIR:
#   bash benchmarks/accelerator.sh OUTDIR            # Qwen3-4B-shaped bf16 target, B = 1, 8, 32, 64
#   bash benchmarks/accelerator.sh --small OUTDIR    # tiny shapes, runs on CPU in < 1 minute
# Needs only the installed package (python with jax and dspark_jax); PYTHON overrides the interpreter.
# See benchmarks/accelerator.py for what is measured. Without --small the same call then runs the
# measured frontier (`dspark-jax bench`, OUTDIR/bench/: bench.json, frontier.png, budget.png) of
# the embedded target with BENCH_DRAFTS (space-separated [NAME=]DIR), or, when unset, the drafters
# of a quick demo trained first (OUTDIR/demo); BENCH_SECONDS bounds it (default 240).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
small=()
out=""
for arg in "$@"; do
  case "$arg" in
    --small) small=(--small) ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    -*) echo "accelerator.sh: unknown option $arg (usage: accelerator.sh [--small] OUTDIR)" >&2; exit 2 ;;
    *) out="$arg" ;;
  esac
done
if [ -z "$out" ]; then
  echo "accelerator.sh: missing OUTDIR (usage: accelerator.sh [--small] OUTDIR)" >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONPATH="$(cd "$here/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python}"
"$py" "$here/accelerator.py" "${small[@]}" --out "$out"
if [ "${#small[@]}" -eq 0 ]; then
  drafts=()
  if [ -n "${BENCH_DRAFTS:-}" ]; then
    for d in $BENCH_DRAFTS; do drafts+=(--draft "$d"); done
  else
    "$py" -m dspark_jax.cli demo --quick --out "$out/demo" >"$out/demo.log" 2>&1 || true
    for k in dspark dflash; do
      [ -d "$out/demo/train/$k/export" ] && drafts+=(--draft "$k=$out/demo/train/$k/export")
    done
  fi
  timeout "${BENCH_SECONDS:-240}" "$py" -m dspark_jax.cli bench \
    --target "$here/../dspark_jax/assets/default_target" "${drafts[@]}" \
    --verify full,fixed:1,scheduler --concurrency 1,4,16,64 --max-new-tokens 64 \
    --sla 100,200 --out "$out/bench" --force || echo "accelerator.sh: bench did not finish" >&2
fi
