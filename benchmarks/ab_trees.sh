#!/usr/bin/env bash
# Old tree against new, in one device command (issue #50's speed acceptance: e2e decode and whole call at 32k x 16 and
# 8k x 4, new within 1% of old, both orders). Each tree runs in its own process importing its own dustin_hf, in the
# order old, new, new, old (benchmarks/ab_point.py, the same driver for both); benchmarks/ab_compare.py prints the
# ratios. About 5-6 minutes of an H100 or H200 (the first process compiles the kernels; the others find them
# cached).
#
#   bash benchmarks/ab_trees.sh prepare [OLD] [NEW]   here, in the git checkout: .ab/old and .ab/new, each holding
#                                                      that commit's dustin_hf/ (its patches/ inside, as installed),
#                                                      its benchmarks/*.py and this checkout's ab_point.py
#                                                      (OLD default 858b7c5, NEW default HEAD; commit first)
#   bash benchmarks/ab_trees.sh run OUT [ARGS...]      on the device, with .ab carried (ignored by git); ARGS go to
#                                                      each ab_point.py (e.g. --shapes 8192x4 --call-tokens 32)
#
# The lead's device call: run(command="bash benchmarks/ab_trees.sh run ab_out", carry=[".ab"]), after
# `bash benchmarks/ab_trees.sh prepare` here.
set -euo pipefail
what=${1:?prepare|run}; shift
root=$(cd "$(dirname "$0")/.." && pwd)
case $what in
  prepare)
    old=${1:-858b7c5}; new=${2:-HEAD}
    for pair in "old:$old" "new:$new"; do
      label=${pair%%:*}; commit=${pair#*:}
      dir=$root/.ab/$label
      rm -rf "$dir" && mkdir -p "$dir"
      git -C "$root" archive "$commit" dustin_hf patches benchmarks lab/dustin_lab | tar -x -C "$dir" \
        --exclude='benchmarks/results' --exclude='benchmarks/traces' --exclude='lab/dustin_lab/data'
      mv "$dir/patches" "$dir/dustin_hf/patches"  # where a wheel puts it: found before any installed copy's mapping
      cp "$root/benchmarks/ab_point.py" "$dir/benchmarks/"
      echo "$(git -C "$root" rev-parse --short "$commit")" > "$dir/COMMIT"
      echo ".ab/$label: $commit ($(cat "$dir/COMMIT"))"
    done ;;
  run)
    out=${1:?OUT dir}; shift
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1
    python=$(command -v "${PYTHON:-python3}")  # PYTHON: another interpreter (e.g. a virtual environment's)
    for label in old new; do
      test -f "$root/.ab/$label/benchmarks/ab_point.py" || { echo ".ab/$label missing: run 'prepare' here and carry .ab"; exit 2; }
    done
    files=()
    for i in 1 2 3 4; do
      label=$( [ $i = 1 ] || [ $i = 4 ] && echo old || echo new )
      file=$out/ab_${i}_$label.txt
      echo "== $i: $label ($(cat "$root/.ab/$label/COMMIT"))"
      limit=$( [ $i = 1 ] && echo 170 || echo 130 )  # the first compiles the kernels; 560 s in all, under a device call
      (cd "$root/.ab/$label" && PYTHONPATH="$root/.ab/$label:$root/.ab/$label/lab" timeout $limit "$python" benchmarks/ab_point.py --label "$label" "$@") \
        > "$file" 2>&1 || { echo "run $i ($label) failed:"; tail -20 "$file"; exit 1; }
      grep "^$label: " "$file" | cut -c1-200 || true
      files+=("$file")
    done
    "$python" "$root/benchmarks/ab_compare.py" "${files[@]}" --out "$out/ab_trees.json" \
      --command "bash benchmarks/ab_trees.sh run $out $* (old $(cat "$root/.ab/old/COMMIT"), new $(cat "$root/.ab/new/COMMIT"))" ;;
  *) echo "unknown: $what (prepare|run)"; exit 2 ;;
esac
