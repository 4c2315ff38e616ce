#!/usr/bin/env bash
# The exact commands behind profiles/qwen2.5-coder-1.5b+0.5b.json and benchmarks/results/fidelity_cpu*.json
# (CPU, 2 cores, float32; the offline Qwen2.5-Coder 1.5B/0.5B pair is fetched on first use). Logs go to
# benchmarks/results/raw/ (not tracked).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results/raw

# 1. Calibration: ~25 min (2 books x 4096 tokens, 16 steps each; budgets 256/512/1024; heads, m, then windows).
dustin-hf calibrate --books mobydick,paradise_lost --context 4096 --steps-per-book 16 --min-position 2048 \
  --budgets 256,512,1024 --profile-budget 512 --time-limit 1800 --save-features ~/.cache/dustin_hf/calibration_features_v2.pt \
  --out profiles/qwen2.5-coder-1.5b+0.5b.json \
  2>&1 | tee benchmarks/results/raw/calibrate_cpu.log

# 2. Fidelity: a few hours on 2 cores (held-out book emma; needles in Pride and Prejudice).
dustin-hf eval --profile profiles/qwen2.5-coder-1.5b+0.5b.json --books emma --contexts 4096,8192 \
  --budgets 128,256,512,1024 --ppl-tokens 256 --new-tokens 48 --needle-books prideprejudice \
  --needle-contexts 4096,8192 --needle-depths 0.1,0.5,0.9 --out benchmarks/results/fidelity_cpu.json \
  --traces-dir benchmarks/results/raw/traces 2>&1 | tee benchmarks/results/raw/fidelity_cpu.log

# 3. The guarded profile is the calibrated one with "dense_layers": [0, 1, 26, 27] added by hand (its
#    dense_layers_note says why those four); its fidelity at budget 512:
dustin-hf eval --profile profiles/qwen2.5-coder-1.5b+0.5b-guarded.json --books emma --contexts 4096,8192 \
  --budgets 512 --ppl-tokens 256 --new-tokens 48 --needle-books prideprejudice \
  --needle-contexts 4096,8192 --needle-depths 0.1,0.5,0.9 --out benchmarks/results/fidelity_cpu_guarded.json \
  --traces-dir benchmarks/results/raw/traces_guarded 2>&1 | tee benchmarks/results/raw/fidelity_cpu_guarded.log
