#!/usr/bin/env bash
# One call on a lent GPU / TPU host (< 8 minutes), JSON to OUTDIR:
#   bash benchmarks/accelerator.sh OUTDIR            # Qwen3-4B-shaped bf16 target, B = 1, 8, 32, 64
#   bash benchmarks/accelerator.sh --small OUTDIR    # tiny shapes, runs on CPU in < 1 minute
# Needs only the installed package (python with jax and dspark_jax); PYTHON overrides the interpreter.
# See benchmarks/accelerator.py for what is measured.
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
exec "${PYTHON:-python}" "$here/accelerator.py" "${small[@]}" --out "$out"
