"""The selection layer of ``selection="verify"`` for a calibrated profile: each layer's gain on the calibration books.

``dustin-hf calibrate`` writes the layer with the rest of a new profile; this adds it to an existing one without
searching the scoring heads again. It collects verification steps from the profile's calibration books (or loads
them), scores every target layer with :func:`dustin_hf.search.selection_layer_gains` against the profile's own
scoring heads (the recovery that layer's choice adds over Dustin's set on the layers after it), prints the table
and one JSON line, and with ``--write`` records the best layer in the profile (``config.selection_layers`` and a
``selection_layers`` section with every gain and this command).

    python benchmarks/select_layer_cpu.py --books mobydick paradise_lost --steps-per-book 12 \\
        --save-features ~/.cache/dustin_hf/select_features.pt --write
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
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
    parser.add_argument("--steps-per-book", type=int, default=12)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--features", help="load collected steps from here instead of collecting")
    parser.add_argument("--save-features", help="keep the collected steps here")
    parser.add_argument("--write", action="store_true", help="record the best layer in the profile")
    args = parser.parse_args(argv)

    from dustin_hf.research.profiles import read_profile
    from dustin_hf.search import Choice, StepFeatures, selection_layer_gains

    torch.set_grad_enabled(False)
    config, fraction, profile = read_profile(args.profile)
    started = time.perf_counter()
    if args.features:
        features = StepFeatures.load(Path(args.features).expanduser())
    else:
        from dustin_hf.research.calibrate import collect_features
        from dustin_hf.research.models import fetch_pair
        from dustin_hf.research.pair import load_pair
        from dustin_hf.research.settings import CalibrationSettings

        pair = load_pair(*fetch_pair(progress=True), "cpu", "float32")
        settings = CalibrationSettings(books=tuple(args.books), context=args.context,
                                       steps_per_book=args.steps_per_book, budgets=tuple(args.budgets))
        features = collect_features(pair, settings, deadline=float("inf"))
        if args.save_features:
            features.save(Path(args.save_features).expanduser())
    choice = Choice(config.target_layer, config.target_heads, tuple(zip(config.draft_layers, config.draft_heads)),
                    fraction or 0.0, config.sink_tokens, config.recent_tokens)
    gains = selection_layer_gains(features, choice, args.budgets, config)
    best = max(gains, key=gains.get)
    print(f"{'layer':>5} {'gain':>8}")
    for layer, gain in sorted(gains.items(), key=lambda kv: -kv[1]):
        print(f"{layer:5d} {gain:8.4f}{'  <- chosen' if layer == best else ''}")
    section = {"chosen": [best], "gain": {str(layer): round(g, 6) for layer, g in gains.items()},
               "budgets": args.budgets, "steps": len(features.seqlens),
               "books": sorted({s.get("book") for s in features.sources}),
               "command": shlex.join(["python", "benchmarks/select_layer_cpu.py", *sys.argv[1:]]),
               "seconds": round(time.perf_counter() - started, 1)}
    if args.write:
        profile["config"]["selection_layers"] = [best]
        profile["selection_layers"] = section
        Path(args.profile).write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps(section))
    return section


if __name__ == "__main__":
    main()
