#!/usr/bin/env bash
# What each fused path buys, measured on one GPU in one process (benchmarks/surgery.py: every path off in turn,
# interleaved with all on, decode step and whole call at 7B + 0.5B, 32k x 16). About 6 minutes of an H100 or H200.
#   bash benchmarks/surgery.sh OUT [ARGS...]    ARGS go to surgery.py (e.g. --variants layers mlps none
#                                               --call-variants none, or --shape 8192x16 for a shorter run)
set -euo pipefail
out=${1:?OUT dir}; shift
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$root:$root/lab"  # this checkout's dustin_hf and lab, whatever is installed
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import kernels; print('kernels', kernels.__version__)" 2>&1 | tail -1 || true; } > "$out/env.txt" 2>&1
timeout 560 python3 "$root/benchmarks/surgery.py" --out "$out/surgery.json" "$@" 2>&1 | tee "$out/surgery.txt" \
  | grep -v '^{' | tail -40
tail -1 "$out/surgery.txt"
