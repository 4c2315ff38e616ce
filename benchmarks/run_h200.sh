#!/usr/bin/env bash
# The H200 runs behind benchmarks/results/, one case per device call (the exact command lines, as gpt-fast keeps them).
#   bash benchmarks/run_h200.sh whole-call OUT [SHAPE...]  whole generate() calls, prefill included, first and warm
#                                             (benchmarks/whole_call.py; SHAPE e.g. 32768x16, default every shape)
#   bash benchmarks/run_h200.sh conversation OUT [ARG...]  a 32k document per row, then follow-up turns, per-turn
#                                             seconds: plain generate(), stock's prompt reuse, stock assisted with it
#                                             (batch 1), Dustin + sparse draft and exact mode with automatic prefix
#                                             reuse (benchmarks/conversation.py; ARGs go to it, e.g. --turns 4)
#   bash benchmarks/run_h200.sh e2e OUT       decode only (prompt replaced by random K/V), 7B + 0.5B, one H200
#   bash benchmarks/run_h200.sh e2e-exact OUT  decode only: classic, the lossless sparse-draft baseline, Dustin + sparse
#                                             draft and exact mode (each also with the selection layers) and the knob,
#                                             7B + 0.5B, 32k, batch 16, replayed from the real pair's per-position
#                                             predictions and knob budgets
#   bash benchmarks/run_h200.sh e2e2 OUT      decode only, 72B + 0.5B over two H200s
#   bash benchmarks/run_h200.sh kernels OUT   tests on the GPU + attention benchmark (both layouts, both timers)
#   bash benchmarks/run_h200.sh attention OUT  the attention headline point (72B layout, 32k, batch 16, CUDA graphs)
#   bash benchmarks/run_h200.sh gpu-tests OUT  the GPU tests of the decode loop (tests/test_gpu.py, test_graphs.py)
#   bash benchmarks/run_h200.sh tests2 OUT    the GPU tests that need two devices (a target split over both)
# Acceptance replay: teacher-forced traces of the real Qwen2.5-Coder 1.5B/0.5B pair (CPU, 4k and 8k windows of a
# held-out book; benchmarks/traces/README.md): every method's per-step accepted drafts on the SAME text. Free-running
# traces cannot compare methods: their texts diverge after a few tokens.
set -u
what=${1:?whole-call|conversation|e2e|e2e-exact|e2e2|kernels|attention|gpu-tests|tests2}; out=${2:?OUT dir}; shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . -e ./lab 2>&1 | tail -2
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$out/env.txt" 2>&1
pair=benchmarks/traces/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct_teacher-forced
trace=(--trace-dense "${pair}"_ctx{4096,8192}_g4_dense.json --trace-dustin "${pair}"_ctx{4096,8192}_g4_dustin_b512.json
       --trace-dustin-sparse-draft "${pair}"_ctx{4096,8192}_g4_dustin-sparse-draft_b512.json)
case $what in
  kernels)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -6 | tee "$out/gpu_tests.txt"
    for layout in qwen2.5-7b qwen2.5-72b; do
      timeout 200 python3 benchmarks/attention.py --layouts $layout --out "$out/attention_$layout.json" > "$out/attention_$layout.txt" 2>&1
      tail -14 "$out/attention_$layout.txt" | cut -c1-160
    done
    timeout 60 python3 benchmarks/attention.py --timer cudagraph --layouts qwen2.5-72b --contexts 32768 --batches 16 \
      --budgets 512 --out "$out/attention_cudagraph.json" > "$out/attention_cudagraph.txt" 2>&1
    tail -4 "$out/attention_cudagraph.txt" | cut -c1-200 ;;
  attention)  # the headline point, CUDA-graph timing (attention_h200.json); the dense kernel moves ~4% between runs
    timeout 100 python3 benchmarks/attention.py --timer cudagraph --layouts qwen2.5-72b --contexts 32768 --batches 16 \
      --budgets 512 --out "$out/attention_h200.json" 2>&1 | tee "$out/attention_h200.txt" | tail -2 | head -1 ;;
  whole-call)  # issue #36: what a user times; SHAPES from the arguments (whole_call.py's --shapes)
    name=whole_call_h200${1:+_$(echo "$*" | tr ' ' '_')}
    timeout 580 python3 benchmarks/whole_call.py ${1:+--shapes "$@"} --out "$out/$name.json" 2>&1 \
      | tee "$out/$name.txt" | grep -v '^{' | tail -60 ;;
  conversation)  # issue #51 point 4: 32k x 1 then 32k x 16, turn 0 + 3 follow-ups of 256 new tokens each;
    # estimated ~8 minutes of device time on one H200 (32k x 16: plain generate() ~28 s a turn, the rest less)
    timeout 580 python3 benchmarks/conversation.py --out "$out/conversation_h200.json" "$@" 2>&1 \
      | tee "$out/conversation.txt" | grep -v '^{' | tail -60 ;;
  gpu-tests)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_graphs.py 2>&1 | tail -8 \
      | tee "$out/gpu_tests.txt" ;;
  e2e)
    timeout 560 python3 benchmarks/e2e.py --devices 1 "${trace[@]}" --out "$out/e2e_h200.json" "$@" 2>&1 \
      | tee "$out/e2e.txt" | grep -v '^{' | tail -45 ;;
  e2e2)
    timeout 560 python3 benchmarks/e2e.py --pair 72b --batches 8 --contexts 32768 "${trace[@]}" \
      --out "$out/e2e_h200x2.json" "$@" 2>&1 | tee "$out/e2e2.txt" | grep -v '^{' | tail -30 ;;
  e2e-exact)  # every method in one process, ratios vs classic (spec_dense) and spec_sparse_draft: the 4k and 8k
    # walks' predictions and the knob's budgets recorded there at KNOB_TARGET (default 0.95)
    predictions=(benchmarks/traces/*_predictions_*_ctx{4096,8192}_*.json)
    knob=(benchmarks/traces/*_knob_*_ctx{4096,8192}_*.json)
    timeout 560 python3 benchmarks/e2e.py --devices 1 --contexts 32768 --batches 16 \
      --methods spec_dense spec_sparse_draft dustin_sparse_draft dustin_select dustin_exact dustin_exact_select \
      dustin_knob \
      --predictions "${predictions[@]}" \
      --knob-traces "${knob[@]}" --knob-target "${KNOB_TARGET:-0.95}" --out "$out/e2e_h200_exact.json" "$@" 2>&1 \
      | tee "$out/e2e_exact.txt" | grep -v '^{' | tail -40 ;;
  tests2)  # a split target: one graph per device, every launch on its tensors' device, greedy tokens unchanged
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ -k "two_gpus or two_devices" 2>&1 | tail -3 \
      | tee "$out/gpu_tests_two.txt" ;;
esac
