#!/usr/bin/env bash
# One device call: environment, install, the whole test suite (GPU tests included), the attention benchmark.
# Usage on the GPU machine: bash benchmarks/gpu_checks.sh OUT_DIR [attention-benchmark args...]
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [benchmark args]}; shift
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers, sys; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import inspect; from torch.nn.attention import varlen; print('varlen_attn', inspect.signature(varlen.varlen_attn))" || true
} 2>&1 | tee "$out/env.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
PYTHONUNBUFFERED=1 timeout 240 python3 -m pytest -q -x tests/ -p no:cacheprovider 2>&1 | tail -25 | tee "$out/tests.txt"
PYTHONUNBUFFERED=1 timeout 330 python3 benchmarks/attention.py --out "$out/attention_h200.json" "$@" 2>&1 | tee "$out/attention.txt" | tail -60
