"""How well the quality knob's estimate tracks the true recovery, and which estimator tracks it best.

Features (per step: the true per-position weights and every head's history and lookahead attention) come
from one of two places: ``--collect`` samples steps from book windows as calibration does
(:func:`dustin_lab.calibrate.collect_features`, one dense step at each of ``--steps-per-book``
positions; the profile's own books keep the held-out texts clean), or ``--walks`` reads what
``benchmarks/knob_cpu.py --features`` wrote along its teacher-forced walks. Then
:func:`dustin_lab.estimators.study` scores each estimator as a proxy of the fixed fill's recovery and as
the knob's order and stop (see there), per text and pooled.

    python benchmarks/knob_estimator.py --collect mobydick paradise_lost --context 4096 --steps-per-book 24 \\
        --save /tmp/knob_calibration_features.pt --out /tmp/knob_estimator_calibration.json
    python benchmarks/knob_estimator.py --walks /tmp/dustin_hf_knob/features/* --out benchmarks/results/knob_estimator_cpu.json

``--orders`` runs :func:`dustin_lab.estimators.order_study` instead (the library's estimate only): the knob's
order against the paper's fixed fill at a ladder of budgets, each split by the estimate and by the truth.

    python benchmarks/knob_estimator.py --load /tmp/knob_calibration_features_8k.pt --orders \
        --out benchmarks/results/knob_order_cpu_8k.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dustin_hf.config import resolve
from dustin_lab.estimators import Estimator, library_estimator, order_study, study
from dustin_lab.knob import load_features
from dustin_hf.profiles import config_for_budget, read_profile

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "qwen2.5-coder-1.5b+0.5b.json"
TARGETS = [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98]
BUDGETS = [256, 512, 1024, 2048]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--collect", nargs="+", metavar="BOOK", help="sample steps from these books' windows")
    source.add_argument("--walks", nargs="+", metavar="DIR", help="feature folders of knob_cpu.py --features")
    source.add_argument("--load", help="features saved by an earlier --collect --save")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps-per-book", type=int, default=24)
    parser.add_argument("--min-position", type=int, default=2048)
    parser.add_argument("--save", help="with --collect: keep the features here")
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--targets", type=float, nargs="+", default=TARGETS)
    parser.add_argument("--budgets", type=int, nargs="+", default=BUDGETS)
    parser.add_argument("--floor", type=int, default=512, help="the knob's floor (its budget)")
    parser.add_argument("--ceiling", type=int, default=2048, help="the knob's ceiling (max_budget)")
    parser.add_argument("--orders", action="store_true", help="the order study (order_study) instead of the estimators")
    parser.add_argument("--ladder", type=int, nargs="+", help="with --orders: the rungs (default floor..ceiling by 128)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    config, fraction, _ = read_profile(args.profile)
    knob = config_for_budget(config, fraction, args.floor).replace(min_recovery=0.9, max_budget=args.ceiling)
    machine, pair_names = None, None
    if args.collect:
        steps, machine, pair_names = _collect(args)
    elif args.load:
        steps = _from_step_features(torch.load(args.load))
    else:
        steps = {Path(d).name: load_features(d) for d in args.walks}
    t_cfg, d_cfg = _text_configs()
    resolved = resolve(knob, t_cfg, d_cfg)
    if args.orders:
        study_report = order_study(steps, resolved, args.targets, args.ladder)
    else:
        study_report = study(steps, resolved, _estimators(resolved, t_cfg, d_cfg), args.targets, args.budgets)
    report = {"command": shlex.join(["python", "benchmarks/knob_estimator.py", *sys.argv[1:]]), "machine": machine,
              "model_pair": pair_names, "profile": str(Path(args.profile).name), "floor": args.floor,
              "ceiling": args.ceiling, "texts": {t: {"steps": len(s), "contexts": sorted({x["at"] for x in s})[::8]}
                                                 for t, s in steps.items()},
              **study_report}
    report["seconds"] = time.perf_counter() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    (_print_orders if args.orders else _print)(report, args)
    return report


def _text_configs():
    from transformers import AutoConfig

    from dustin_lab.models import fetch_pair

    target, draft = fetch_pair(progress=False)
    return AutoConfig.from_pretrained(target).get_text_config(), AutoConfig.from_pretrained(draft).get_text_config()


def _estimators(cfg, t_cfg, d_cfg) -> dict[str, Estimator]:
    """The library's recipe and the alternatives worth trying: each signal alone, other mixes, flatter masses,
    more heads (the target's whole scoring layer, its neighbours, every layer; the draft's scoring layers whole)."""
    library = library_estimator(cfg)
    every_target_head = tuple(range(t_cfg.num_attention_heads))
    every_draft_head = tuple(range(d_cfg.num_attention_heads))
    whole_layer = ((cfg.target_layer, every_target_head),)
    around = tuple((layer, every_target_head) for layer in (cfg.target_layer - 1, cfg.target_layer, cfg.target_layer + 1))
    out = {
        "library (scoring heads, 1:1)": library,
        "history only": Estimator(library.target, ()),
        "lookahead only": Estimator((), library.draft),
        "1:3 history:lookahead": Estimator(library.target, library.draft, draft_weight=0.75),
        "3:1 history:lookahead": Estimator(library.target, library.draft, draft_weight=0.25),
        "power 0.75": Estimator(library.target, library.draft, power=0.75),
        "power 0.5": Estimator(library.target, library.draft, power=0.5),
        "whole target scoring layer": Estimator(whole_layer, library.draft),
        "target layers l-1..l+1": Estimator(around, library.draft),
        "whole draft scoring layers": Estimator(library.target, tuple((l, every_draft_head) for l in cfg.draft_layers)),
        "every target layer (bound)": Estimator(tuple((l, every_target_head) for l in range(t_cfg.num_hidden_layers)),
                                                library.draft),
    }
    return out


def _collect(args):
    from dataclasses import replace

    from dustin_lab.calibrate import collect_features
    from dustin_lab.models import fetch_pair
    from dustin_lab.pair import describe_machine, load_pair
    from dustin_lab.settings import CalibrationSettings

    torch.set_grad_enabled(False)
    pair = load_pair(*fetch_pair(progress=True), "cpu", "float32")
    settings = replace(CalibrationSettings(), books=tuple(args.collect), context=args.context,
                       steps_per_book=args.steps_per_book, min_position=args.min_position)
    features = collect_features(pair, settings, deadline=time.perf_counter() + 1e9)
    if args.save:
        torch.save({"seqlens": features.seqlens, "weights": features.weights, "target": features.target,
                    "draft": features.draft, "sources": features.sources}, args.save)
    names = pair.describe()
    return (_from_step_features(vars(features)), describe_machine(pair.device),
            {"target": names["target"]["name"], "draft": names["draft"]["name"], "dtype": names["dtype"]})


def _from_step_features(data: dict) -> dict[str, list[dict]]:
    """Calibration's padded features (``StepFeatures``' fields) as per-text lists of steps."""
    steps: dict[str, list[dict]] = {}
    for i, (at, source) in enumerate(zip(data["seqlens"], data["sources"])):
        weights = data["weights"][i, :, :at].float()
        steps.setdefault(source["book"], []).append({
            "step": i, "at": at, "truth": weights.mean(dim=0), "layer_truth": weights.half(),
            "history": data["target"][i, :, :, :at].half(), "draft": data["draft"][i, :, :, :at].half()})
    return steps


def _print(report: dict, args) -> None:
    print(f"{'estimator':<32} " + " ".join(f"{'r@' + str(b):>7}" for b in args.budgets) + "  "
          + " ".join(f"{'t' + str(t):>13}" for t in args.targets))
    for name, e in report["estimators"].items():
        proxy = " ".join(f"{_f(e['proxy'][str(b)]['pooled']['pearson']):>7}" for b in args.budgets)
        knob = " ".join(f"{e['knob'][str(t)]['pooled']['mean_read']:>6.0f}/{e['knob'][str(t)]['pooled']['mean_truth']:.3f}"
                        for t in args.targets)
        print(f"{name:<32} {proxy}  {knob}")
    print("fixed fill: " + ", ".join(f"{b}: {v['mean_truth']:.3f}" for b, v in report["fixed_fill"].items()))


def _print_orders(report: dict, args) -> None:
    names = ("library_knob", "ladder_knob", "oracle_ladder", "oracle_library", "ladder_knob_no_fallback")
    print(f"{'target':>7} " + " ".join(f"{n + ' read/full/mean/p10':>36}" for n in names))
    for t in args.targets:
        cells = []
        for n in names:
            p = report[n][str(t)]["pooled"]
            cells.append(f"{p['mean_read']:>8.0f} {p['read_in_full']:>3} {p['mean_truth']:.3f} {p['p10_truth']:.3f}")
        print(f"{t:>7} " + " ".join(f"{c:>36}" for c in cells))
    for read, curves in report["at_read"].items():
        print(f"at mean read {read}: " + ", ".join(f"{n} {_f(v['mean_truth'])}/{_f(v['p10_truth'])}" for n, v in curves.items()))


def _f(value):
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
