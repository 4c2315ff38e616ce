"""The quality knob on the real pair (CPU, float32): quality against positions read, fixed budgets beside targets.

For each text and context, one ``dustin-hf eval`` unit (:func:`dustin_lab.evaluation.evaluate`: one
prefill, then the teacher-forced walk with dense verification, the fixed budgets and the knob's targets; no
continuations or needles, which the walk's same-text comparison replaces). Each unit's report goes to
``--scratch`` as soon as it is done, so an interrupted run resumes where it stopped; with ``--features`` the
walk's probe also writes the estimator features of every step there (:class:`~dustin_lab.knob.EstimatorFeatures`,
read by ``benchmarks/knob_estimator.py``). Then the units are merged into one report (the summary recomputed
over all of them) and its plot. The knob traces the GPU benchmark replays come from ``benchmarks/agreement_cpu.py
--targets`` (the sparse draft, as the benchmark's ``dustin_knob``), not from here.

    python benchmarks/knob_cpu.py --texts emma prideprejudice stdlib:typing --contexts 4096 8192 \\
        --budgets 512 1024 2048 --targets 0.8 0.9 0.95 --features --out benchmarks/results/knob_cpu.json
    python benchmarks/knob_cpu.py ... --merge-only                         # merge the finished units again
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dustin_lab.evaluation import evaluate, summarize
from dustin_lab.knob import EstimatorFeatures
from dustin_lab.plotting import plot_fidelity
from dustin_hf.profiles import read_profile
from dustin_lab.settings import EvalSettings
from dustin_lab.texts import describe_text

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "qwen2.5-coder-1.5b+0.5b.json"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--texts", nargs="+", default=["emma", "prideprejudice", "stdlib:typing"],
                        help="bundled books or stdlib:MODULE (held out: not mobydick or paradise_lost, the profile's)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--targets", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    parser.add_argument("--target-budget", type=int, default=512, help="the knob's floor")
    parser.add_argument("--max-budget", type=int, default=None, help="the knob's ceiling (default: 4 x floor)")
    parser.add_argument("--ppl-tokens", type=int, default=256, help="teacher-forced tokens walked per window")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--pair", nargs=2, metavar=("TARGET", "DRAFT"), help="model folders (default: the offline pair)")
    parser.add_argument("--prefill-chunk", type=int, default=1024,
                        help="prompt tokens per prefill forward (smaller: a lower memory peak on a shared machine)")
    parser.add_argument("--features", action="store_true", help="also write every step's estimator features")
    parser.add_argument("--scratch", default="/tmp/dustin_hf_knob", help="per-unit reports and features")
    parser.add_argument("--out", required=True, help="the merged report (its plot: the same path with .png)")
    parser.add_argument("--merge-only", action="store_true", help="merge the units in --scratch, run nothing")
    args = parser.parse_args(argv)

    scratch = Path(args.scratch)
    settings = EvalSettings(books=tuple(args.texts), contexts=tuple(args.contexts), budgets=tuple(args.budgets),
                            targets=tuple(args.targets), target_budget=args.target_budget, max_budget=args.max_budget,
                            ppl_tokens=args.ppl_tokens, new_tokens=0, offset=args.offset, needle_contexts=())
    units = [(text, context) for context in args.contexts for text in args.texts]
    if not args.merge_only:
        _run_units(args, settings, units, scratch)
    reports = [json.loads(_unit_path(scratch, t, c).read_text()) for t, c in units if _unit_path(scratch, t, c).exists()]
    if not reports:
        parser.error(f"no finished units in {scratch}")
    merged = _merge(reports, settings, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    merged["plot"] = _relative(plot_fidelity(merged, out.with_suffix(".png")))
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(json.dumps({"knob": merged["summary"]["knob"], "knob_criteria": merged["summary"]["knob_criteria"]}))
    return merged


def _unit_path(scratch: Path, text: str, context: int) -> Path:
    return scratch / f"unit_{text.replace(':', '_')}_{context}.json"


def _run_units(args, settings: EvalSettings, units, scratch: Path) -> None:
    from dustin_lab.models import fetch_pair
    from dustin_lab.pair import describe_machine, load_pair

    torch.set_grad_enabled(False)
    config, fraction, _ = read_profile(args.profile)
    config = config.replace(prefill_chunk=args.prefill_chunk)
    pair = None
    for text, context in units:
        path = _unit_path(scratch, text, context)
        if path.exists():
            continue
        if pair is None:
            pair = load_pair(*(args.pair or fetch_pair(progress=True)), "cpu", "float32")
        unit = replace(settings, books=(text,), contexts=(context,))
        features = scratch / "features" / f"{text.replace(':', '_')}_{context}"
        probe = (lambda book, ctx: EstimatorFeatures(features)) if args.features else None
        started = time.perf_counter()
        report = evaluate(pair, config, fraction, unit, progress=True, walk_probe=probe)
        report.update(command=_command(), machine=describe_machine(pair.device), unit_seconds=time.perf_counter() - started,
                      text=describe_text(text), features=str(features) if args.features else None)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report) + "\n")
        print(f"{text}@{context}: {report['unit_seconds']:.0f} s", json.dumps(report["summary"]["knob"]), flush=True)


def _merge(reports: list[dict], settings: EvalSettings, args) -> dict:
    """One report over every unit: the walks concatenated, the summary recomputed, what each unit ran on."""
    done = {(w["book"], w["context"]) for r in reports for w in r["perplexity"]}
    settings = replace(settings, books=tuple(t for t in settings.books if any(d[0] == t for d in done)),
                       contexts=tuple(c for c in settings.contexts if any(d[1] == c for d in done)))
    merged = {key: reports[0][key] for key in ("format", "model_pair", "settings", "profile_config",
                                               "draft_share_fraction", "resolved", "knob_resolved")}
    merged["settings"] = {**merged["settings"], "books": list(settings.books), "contexts": list(settings.contexts)}
    merged.update(command=_command(), profile_path=_relative(args.profile), machine=reports[0]["machine"],
                  units=[{"text": r["text"], "context": r["settings"]["contexts"][0], "seconds": r["unit_seconds"],
                          "command": r["command"], "machine": r["machine"], "features": r["features"]}
                         for r in reports],
                  perplexity=[w for r in reports for w in r["perplexity"]],
                  prefill_seconds=[p for r in reports for p in r["prefill_seconds"]],
                  continuations=[], needles=[], partial=len(reports) < len(args.texts) * len(args.contexts))
    merged["summary"] = summarize(merged, settings)
    return merged


def _relative(path) -> str | None:
    if path is None:
        return None
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _command() -> str:
    return shlex.join(["python", "benchmarks/knob_cpu.py", *sys.argv[1:]])


if __name__ == "__main__":
    main()
