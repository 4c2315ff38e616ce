"""The selection layers of ``selection="verify"`` for a calibrated profile, by teacher-forced agreement with dense.

Walks the profile's calibration books (not the held-out texts) teacher-forced with every candidate layer set of
:func:`dustin_lab.select_calibration.selection_candidates` (or ``--candidates``) beside dense verification
and Dustin's own set, at the profile's budget; prints each candidate's pooled top-1 agreement with dense and
perplexity ratio, then one JSON line; with ``--write`` records the best in the profile (``config.selection_layers``
and a ``selection_layers`` section with every candidate's figures and this command).

    python benchmarks/select_layer_cpu.py --books mobydick paradise_lost --tokens 151 --write
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "qwen2.5-coder-1.5b+0.5b.json"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--books", nargs="+", default=["mobydick", "paradise_lost"], help="calibration books")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=151, help="teacher-forced tokens walked per book")
    parser.add_argument("--candidates", nargs="+", default=None, metavar="LAYERS",
                        help="comma-separated layer sets (default: the library's grid)")
    parser.add_argument("--write", action="store_true", help="record the best in the profile")
    args = parser.parse_args(argv)

    from dustin_lab.models import fetch_pair
    from dustin_lab.pair import describe_machine, load_pair
    from dustin_hf.profiles import read_profile
    from dustin_lab.select_calibration import calibrate_selection_layers

    torch.set_grad_enabled(False)
    config, _, profile = read_profile(args.profile)
    pair = load_pair(*fetch_pair(progress=True), "cpu", "float32")
    candidates = [tuple(int(v) for v in c.split(",")) for c in args.candidates] if args.candidates else None
    report = calibrate_selection_layers(pair, config.replace(min_context=1024), tuple(args.books), args.context,
                                        args.tokens, candidates=candidates)
    print(f"{'method':16s} {'top-1':>6s} {'ppl ratio':>9s}")
    for name, row in sorted(report["pooled"].items(), key=lambda kv: -kv[1]["top1_agreement"]):
        print(f"{name:16s} {row['top1_agreement']:6.3f} {row['ppl_ratio']:9.4f}")
    report.update(command=shlex.join(["python", "benchmarks/select_layer_cpu.py", *sys.argv[1:]]),
                  machine=describe_machine(pair.device))
    if args.write:
        profile["config"]["selection_layers"] = report["chosen"]
        profile["selection_layers"] = report
        Path(args.profile).write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps({"chosen": report["chosen"], "seconds": round(report["seconds"])}))
    return report


if __name__ == "__main__":
    main()
