"""Same-process A/B of one tuning value on the end-to-end decoding benchmark.

Builds the 7B + 0.5B models of ``e2e.py`` (or ``--pair``'s target, ``--target-layers`` of it) once
(random bf16 weights, one GPU), then runs the speculative method ``--method`` at ``--context`` and
``--batch`` once per value of the tuning field (a dotted path of :class:`dustin_hf.runtime.tuning.Tuning`),
alternating the values for ``--rounds`` rounds, so every value sees the same models, allocator state and
clocks. Small changes (~0.5%) sit below the run-to-run
spread of separate runs (and far below the spread between machines), which is why a launch heuristic is
judged this way. Acceptance is replayed from the teacher-forced sparse-draft traces (as ``run_h200.sh
e2e``); all compute is real.

The attribute must be read when the decoder runs (a module global a function looks up at call time, not a
default argument bound at import): each run captures its CUDA graphs afresh, so a new value takes effect.

    python benchmarks/ab_toggle.py dustin_hf.kernels.triton_verify._SPARSE_PROGRAMS_PER_SM 1 2 --rounds 2
    python benchmarks/ab_toggle.py dustin_hf.runtime.fused._SKINNY_ROWS 16 32 --out ab.json

Prints one line per run and a final JSON line (tokens/s per value, in run order).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import torch

import e2e
from replay import CountReplay

TRACE = ("benchmarks/traces/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct_teacher-forced_ctx{}_g4_"
         "dustin-sparse-draft_b512.json")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a Tuning field's dotted path, e.g. kernels.verify.sparse_programs_per_sm "
                                     "(dustin_hf.runtime.tuning.Tuning.paths() lists them)")
    parser.add_argument("values", nargs="+", help="Python literals to alternate, e.g. 16 32")
    parser.add_argument("--rounds", type=int, default=2, help="times each value runs (default 2)")
    parser.add_argument("--method", default="dustin_sparse_draft", choices=("spec_dense", "dustin",
                                                                             "dustin_sparse_draft"))
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--pair", default="7b", choices=("7b", "32b", "72b"), help="target size (draft: 0.5b)")
    parser.add_argument("--target-layers", type=int, default=None, metavar="N",
                        help="only N of the target's decoder layers (a proxy, e.g. 72b's 40 of 80 on one GPU: one "
                             "of two pipeline stages); the JSON's pair says so")
    parser.add_argument("--out", help="save the runs as JSON (with command, GPU and versions)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from dustin_hf.runtime.tuning import Tuning

    try:
        values = {text: Tuning().with_value(args.path, ast.literal_eval(text)) for text in args.values}
    except (ValueError, SyntaxError) as error:
        raise SystemExit(f"values must be Python literals valid for {args.path}: {error}") from None

    replay = CountReplay.load([TRACE.format(4096), TRACE.format(8192)], e2e.GAMMA)
    method = e2e.Sources(None, {args.method: replay}, None, None, e2e.BUDGET, e2e.BUDGET).method(args.method,
                                                                                             args.context)
    devices = [torch.device("cuda:0")]
    target = e2e.build_model(args.pair, devices, torch.bfloat16, args.target_layers)
    draft = e2e.build_model("0.5b", devices, torch.bfloat16)
    import dustin_hf

    dustin_hf.patch(target)
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for text, tuning in values.items():
            row = e2e.run_speculative(target, draft, args.batch, args.context, method, torch.bfloat16, tuning=tuning)
            runs.setdefault(text, []).append(round(row["tokens_per_s"], 1))
            failed = {part: graphs["failed"] for part, graphs in row.get("graphs", {}).items() if graphs["failed"]}
            print(f"{args.path} = {text}: {row['tokens_per_s']:.1f} tok/s "
                  f"(steady {row.get('steady_tokens_per_s', float('nan')):.1f})"
                  + (f"; CUDA graphs that failed to capture: {failed}" if failed else ""), flush=True)
    result = dict(command=" ".join(["python3", *sys.argv]), gpu=torch.cuda.get_device_name(0),
                  versions=e2e._versions(), method=args.method, context=args.context, batch=args.batch,
                  pair=f"{e2e.pair_name(args.pair, args.target_layers)} + 0.5b", acceptance=replay.source,
                  tokens_per_s=runs)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(runs))
    return result


if __name__ == "__main__":
    main()
