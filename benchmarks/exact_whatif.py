"""What exact mode would reach if the sparse target agreed more with the dense one: an ESTIMATE over SYNTHETIC
predictions.

Exact mode's speed rests on two things: how often the sparse target's greedy token survives the dense check
(measured on the real pair at budget 2048: 0.91-0.99 per text of the 4k/8k walks; 0.95 for the oracle set of 2048 on
*Alice* 4k, ``oracle_cpu_budgets.json``), and what a sparse step costs against a dense one (fitted from the H200
run, ``exact_context.py``). This separates them. It copies the recorded prediction traces, sets the sparse target's
prediction to the dense one at randomly chosen disagreeing positions until a chosen share of positions agree (a text
that agrees more already stays as recorded; the drafts' and the dense target's predictions always do), replays exact
mode and the lossless baseline through the loop on the CPU (``e2e.py --smoke --batches 16``, outcomes only) at each
confirm schedule, and prices the steps as ``exact_context.py`` does. Per case it reports the estimated rate over the
baseline and over classic speculative decoding (the GPU run's classic rate: classic's outcomes do not involve the
sparse target), and the sparse-step cost at which exact mode would reach ``--goal`` times classic.

The copies are SYNTHETIC: their ``model_pair`` says so, and so does every replay's output. The disagreements
kept are a random choice of the recorded ones, so they cluster less than a real sparse target's would; that makes
a confirmation fail more often than it would at the same agreement, most on the longer schedules.

Pricing (as ``exact_context.py``): a dense step costs ``D``, the baseline's step, and a sparse step ``S``, fitted
so that the GPU run's own exact-mode row (confirming steps of ``1 + confirm_tokens + γ`` = 9 queries a row) comes
out at its measured time. A wider confirming step costs more: the dense kernel takes 0.41 ms a layer at 13
queries against 0.25 at 9 (``confirm_probe_h200.json``). ``--wide-gpu`` names a GPU run of a wider schedule
(``e2e_h200_exact_confirm.json``, ``--confirm 8 4``: 13 queries); its confirming step is fitted as what remains of
its exact-mode seconds after its sparse steps at ``S``, and prices the cases of that width (an upper bound on
that step: e2e.py leaves out only its first steps, so a schedule whose first confirmation comes later captures
that step's CUDA graph inside the timed window). A case wider than every timed width is priced at the widest
one and marked ``upper_bound``. ``run_h200.sh e2e-whatif`` measures cases on the H200.

    python benchmarks/exact_whatif.py benchmarks/traces/*_predictions_*_ctx{4096,8192}_*_b2048.json \\
        --agreement 0.95 0.97 0.99 1.0 --confirm 4,4 8,8 12,12 --gpu benchmarks/results/e2e_h200_exact.json \\
        --wide-gpu benchmarks/results/e2e_h200_exact_confirm.json --out benchmarks/results/exact_whatif_cpu.json
    python benchmarks/exact_whatif.py TRACES --agreement 1.0 --write DIR   # the copies, for e2e.py --predictions
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from exact_context import _timed, costs_ms, exact_rows, rates, sparse_step, step_costs, summaries
from tqdm import tqdm

from dustin_lab import traces as trace_io

HERE = Path(__file__).resolve().parent


def raised(record: dict, agreement: float, seed: int) -> dict:
    """A copy of a prediction trace whose sparse predictions equal the dense ones at ``agreement`` of the
    positions (at least the recorded share): the recorded disagreements kept are a seeded random choice."""
    p = record["predictions"]
    differ = [i for i, (s, d) in enumerate(zip(p["sparse"], p["dense"])) if s != d]
    keep = min(len(differ), max(0, math.floor(len(p["dense"]) * (1 - agreement) + 1e-9)))
    kept = set(random.Random(seed).sample(differ, keep))
    sparse = [d if (s != d and i not in kept) else s for i, (s, d) in enumerate(zip(p["sparse"], p["dense"]))]
    pair = {**record["model_pair"], "what_if": f"SYNTHETIC: sparse predictions set to the dense ones at random "
                                               f"disagreeing positions, {agreement} agreeing"}
    return trace_io.prediction_record(pair, record["text"], record["context"], record["gamma"], record["budget"],
                                      record["config"], {**p, "sparse": sparse}, record["dtype"], record["device"])


def replay(paths: list[Path], budget: int, schedule: tuple[int, int], out: Path) -> dict:
    """One CPU replay of the baseline and exact mode at ``budget`` on a confirm schedule (tokens, every)."""
    command = [sys.executable, str(HERE / "e2e.py"), "--smoke", "--contexts", "4096", "--batches", "16",
               "--new-tokens", "256", "--methods", "spec_sparse_draft", "dustin_exact", "--exact-budget", str(budget),
               "--confirm", str(schedule[0]), str(schedule[1]), "--no-profile", "--predictions",
               *map(str, paths), "--out", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _width(run: dict) -> int:
    """Queries a row of a run's confirming step: the last committed token, ``confirm_tokens`` tentative, γ drafts."""
    return 1 + run["exact_mode"]["confirm_tokens"] + run["gamma"]


def wide_step(gpu: dict, costs: dict) -> tuple[int, float]:
    """``(width, seconds)``: the confirming step of a GPU run on a wider schedule, fitted as what remains of its
    exact-mode seconds after its sparse steps priced at ``costs``' ``S``."""
    budget, row = next(iter(exact_rows(gpu).items()))
    n_dense, n_sparse = _timed(row)
    return _width(gpu), (row["seconds"] - n_sparse * sparse_step(costs, budget)) / n_dense


def priced(run: dict, costs: dict, classic: float, goal: float, dense_by_width: dict[int, float]) -> dict:
    """The replay's exact-mode case priced: its rate over the baseline and over ``classic`` (tokens/s), and the
    sparse-step cost that would reach ``goal`` times classic (``None`` where its dense steps alone take longer).

    ``dense_by_width``: a confirming step's cost (seconds) by its queries a row; a case takes the narrowest timed
    width at least its own, else the widest, and is then an ``upper_bound``."""
    budget, exact = next(iter(exact_rows(run).items()))
    base = next(r for r in run["rows"] if r["method"] == "spec_sparse_draft")
    width = _width(run)
    fits = [w for w in sorted(dense_by_width) if w >= width]
    dense = dense_by_width[fits[0] if fits else max(dense_by_width)]
    sparse = sparse_step(costs, budget)
    rate, base_rate = rates(exact, base, costs, sparse, dense)
    n_dense, n_sparse = _timed(exact)
    needed = (exact["tokens"] / (goal * classic) - n_dense * dense) / n_sparse
    return {"budget": budget, **summaries(exact, base),
            "confirm_width": width, "dense_step_ms": dense * 1e3, "sparse_step_ms": sparse * 1e3,
            "upper_bound": not fits, "ESTIMATE_exact_over_baseline": rate / base_rate,
            "ESTIMATE_exact_over_classic": rate / classic,
            f"sparse_step_ms_for_{goal}x_classic": needed * 1e3 if needed > 0 else None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="prediction traces of the real pair, all at one budget")
    parser.add_argument("--agreement", type=float, nargs="+", required=True,
                        help="shares of positions where the sparse target's prediction is the dense one's")
    parser.add_argument("--confirm", nargs="+", default=["4,4"], metavar="TOKENS,EVERY",
                        help="confirm schedules (confirm_tokens,confirm_every); default 4,4 (the library's)")
    parser.add_argument("--gpu", default=None, help="the H200 run whose step costs price the replays")
    parser.add_argument("--wide-gpu", default=None, metavar="RUN",
                        help="an H200 run of exact mode on a wider confirm schedule (e2e.py --confirm), whose "
                             "confirming step prices the cases of its width")
    parser.add_argument("--goal", type=float, default=1.7, help="times classic to solve the sparse step's cost for")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", default=None, metavar="DIR",
                        help="only write the SYNTHETIC copies, to DIR/a<agreement>/ (for a GPU run of e2e.py "
                             "--predictions), and replay nothing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for a in args.agreement:
        if not 0.0 <= a <= 1.0:
            parser.error(f"--agreement {a}: a share, in [0, 1]")
    try:
        schedules = [tuple(int(v) for v in s.split(",")) for s in args.confirm]
    except ValueError:
        parser.error(f"--confirm takes TOKENS,EVERY pairs of integers, got {args.confirm}")
    if any(len(s) != 2 for s in schedules):
        parser.error(f"--confirm takes TOKENS,EVERY pairs, got {args.confirm}")
    records = [trace_io.load_predictions(p) for p in args.traces]
    budgets = {r["budget"] for r in records}
    if len(budgets) != 1:
        parser.error(f"the traces were recorded at several budgets {sorted(budgets)}: give one budget's")
    (budget,) = budgets
    if args.write:
        for level in sorted(set(args.agreement)):
            for i, r in enumerate(records):
                print(trace_io.write_predictions(Path(args.write) / f"a{level}", raised(r, level, args.seed + i)))
        return {}
    if args.gpu is None:
        parser.error("--gpu is required to price the replays (or --write DIR to only write the copies)")
    gpu = json.loads(Path(args.gpu).read_text())
    costs = step_costs(gpu)
    classic_row = next((r for r in gpu["rows"] if r["method"] == "spec_dense"), None)
    if classic_row is None:
        parser.error(f"{args.gpu} has no spec_dense (classic) row")
    classic = classic_row["tokens"] / classic_row["seconds"]
    sparse = sparse_step(costs, budget)  # a budget the run did not time fails here, before any replay
    dense_by_width = {_width(gpu): costs["dense"]}
    if args.wide_gpu:
        width, seconds = wide_step(json.loads(Path(args.wide_gpu).read_text()), costs)
        dense_by_width[width] = seconds

    levels = [None] + sorted(set(args.agreement))  # None: the recorded predictions
    out_cases = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(levels) * len(schedules), desc="replays") as bar:
        for level in levels:
            if level is None:
                paths, label = [Path(p) for p in args.traces], "recorded"
            else:
                directory = Path(tmp) / f"a{level}"
                paths = [trace_io.write_predictions(directory, raised(r, level, args.seed + i))
                         for i, r in enumerate(records)]
                label = level
            shares = [trace_io.load_predictions(p)["agreement"]["sparse_vs_dense"] for p in paths]
            for schedule in schedules:
                run = replay(paths, budget, schedule, Path(tmp) / f"run_{label}_{schedule[0]}_{schedule[1]}.json")
                case = priced(run, costs, classic, args.goal, dense_by_width)
                case.update(agreement=label, sparse_vs_dense=shares, confirm_tokens=schedule[0],
                            confirm_every=schedule[1],
                            predictions=[("" if level is None else f"SYNTHETIC a{level}/") + Path(p).name
                                         for p in paths])
                out_cases.append(case)
                bar.update()
    report = {"command": " ".join([Path(sys.executable).name, sys.argv[0]] + (sys.argv[1:] if argv is None else argv)),
              "what": "CPU replays (outcomes only) of exact mode and the lossless baseline on the recorded "
                      "predictions and on SYNTHETIC copies whose sparse target agrees more with the dense one, "
                      "priced with step costs fitted from the GPU run: an ESTIMATE",
              "gpu_run": args.gpu, "wide_gpu_run": args.wide_gpu, "step_costs_ms": costs_ms(costs),
              "confirming_step_ms_by_width": {w: v * 1e3 for w, v in sorted(dense_by_width.items())},
              "classic_tokens_per_s": classic, "goal_x_classic": args.goal, "budget": budget, "cases": out_cases}
    print(f"{'agreement':>10} {'schedule':>8} {'tok/step':>8} {'confirmed':>9} {'dense':>9} {'x base':>7} "
          f"{'x classic':>9} {'S for ' + str(args.goal) + 'x':>10}   (ESTIMATE; S now "
          f"{sparse * 1e3:.2f} ms)")
    for c in out_cases:
        e = c["dustin_exact"]
        print(f"{str(c['agreement']):>10} {c['confirm_tokens']:>4},{c['confirm_every']:<3} {e['tokens_per_step']:8.2f} "
              f"{e['exact']['confirmed_fraction']:9.3f} {e['dense_steps']:>4}/{e['dense_steps'] + e['sparse_steps']:<4} "
              f"{c['ESTIMATE_exact_over_baseline']:7.3f} {c['ESTIMATE_exact_over_classic']:9.3f} "
              + (f"{needed:8.2f} ms" if (needed := c[f"sparse_step_ms_for_{args.goal}x_classic"]) else "    none")
              + (f"  upper bound: {c['confirm_width']} queries a confirming row priced at "
                 f"{max(dense_by_width)}" if c["upper_bound"] else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
