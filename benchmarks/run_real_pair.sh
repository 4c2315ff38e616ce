#!/usr/bin/env bash
# The real Qwen2.5-Coder pair on the GPU machine, one case per device call (docs/real_pair_on_gpu.md):
#   bash benchmarks/run_real_pair.sh receive NN            a chunk carried in .weights/chunks/NN into the store
#   bash benchmarks/run_real_pair.sh join OUT              check + rebuild + convert the pair (carry .whl: gguf),
#                                                          then long_context.py's check against the CPU conversion
#   bash benchmarks/run_real_pair.sh study OUT ARGS...     long_context.py ARGS (results kept on the machine in
#                                                          $STUDY across calls, a copy under OUT)
#   bash benchmarks/run_real_pair.sh e2e OUT TRACES...     e2e.py at 7B / 32k / 16 replaying the given prediction traces
# Everything stays on the machine between calls (a fresh machine is bare: start again with receive 00).
set -u
what=${1:?receive|join|study|e2e}; shift
store=/root/dustin_weights
export DUSTIN_HF_HOME=/root/dustin_home PYTHONUNBUFFERED=1 STUDY=${STUDY:-/root/study}
site() {  # the carried wheels (gguf), and the checkout installed without touching the image's packages
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
  export PYTHONPATH=/tmp/site
  python3 -c "import dustin_hf, dustin_lab" 2>/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation -e . -e ./lab 2>&1 | tail -2
}
case $what in
  receive)
    python3 lab/dustin_lab/transfer.py receive ".weights/chunks/${1:?NN}" "$store" ;;
  join)
    out=${1:?OUT}; mkdir -p "$out"; site
    start=$SECONDS
    python3 -m dustin_lab.transfer join "$store" --convert "$DUSTIN_HF_HOME/models" || exit 1
    echo "join + convert: $((SECONDS - start)) s"
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$out/env.txt" 2>&1
    cat "$out/env.txt"
    python3 benchmarks/long_context.py --phases check --check-reference benchmarks/results/real_pair_check_cpu.json \
      --out "$STUDY" --quiet 2>&1 | grep -v Warning | tail -3
    cp "$STUDY"/check.json "$out/" ;;
  study)
    out=${1:?OUT}; shift; mkdir -p "$out"; site
    python3 benchmarks/long_context.py --out "$STUDY" --quiet "$@" 2>&1 | grep -v -i warn | tee -a "$out/study.txt"
    tar czf "$out/study.tgz" -C "$STUDY" . ; ls "$STUDY" ;;  # every phase file and trace so far (8 files come back)
  e2e)
    out=${1:?OUT}; shift; mkdir -p "$out"; site
    timeout 560 python3 benchmarks/e2e.py --devices 1 --contexts 32768 --batches 16 \
      --methods spec_dense dustin_sparse_draft dustin_exact --predictions "$@" --out "$out/e2e_32k.json" 2>&1 \
      | tee "$out/e2e.txt" | grep -v '^{' | tail -30 ;;
esac
