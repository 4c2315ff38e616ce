"""How exact mode's replayed outcomes move with the context its predictions were recorded at, and what that would
cost on the GPU: an ESTIMATE.

The H200 run (``e2e_h200_exact.json``) replays predictions recorded at 4k and 8k, where a budget of 2048 is a half
or a quarter of the cache; at 32k it is a sixteenth, and the sparse target's agreement with the dense one falls as
that share falls (``agreement_cpu_*.json``). The replayed outcomes (tokens per step, confirmations, dense steps) do
not depend on the models or the device, so ``benchmarks/e2e.py --smoke --batches 16`` reproduces them on the CPU
(it gives the GPU run's own counts on the GPU run's traces). This reads such CPU replays, one per trace, each with
``spec_sparse_draft`` and ``dustin_exact`` rows, and prices their steps with two costs fitted from the GPU run:

* ``D``, a dense step: ``spec_sparse_draft``'s seconds over its timed steps (every step of it is dense);
* ``S(budget)``, a sparse step of exact mode: ``(seconds - n_dense * D) / n_sparse`` of each exact-mode row
  (``dustin_exact@BUDGET``, or ``dustin_exact`` at the run's exact budget); a replay at a budget the run did not
  time is priced on the line through the smallest and largest timed budgets (``--exact-budget 2048 512``; the
  current ``e2e_h200_exact.json`` timed 2048 only, the one at 4ac8a0a both).

A row's ``seconds`` and ``tokens`` leave out the first ``e2e.WARMUP_STEPS`` steps, its dense / sparse step counts
do not; the counts are scaled to the timed steps (the warm-up taken to split like the rest). The estimate is exact
mode's rate over the baseline's, ``(tokens_e / (n_dense_e D + n_sparse_e S)) / (tokens_s / (n_dense_s D))``, per
exact budget of each replay. It assumes a confirming step costs what a baseline step does, that the baseline's step
costs D whatever its draft reads (D is fitted with the draft reading 2048 positions), and that the 32k GPU step
costs hold for outcomes recorded at other contexts; a GPU run replaying those predictions measures it.

    python benchmarks/e2e.py --smoke --contexts 4096 --batches 16 --new-tokens 256 \\
        --methods spec_sparse_draft dustin_exact --exact-budget 2048 --no-profile --predictions TRACE --out RUN.json
    python benchmarks/exact_context.py RUN.json ... --gpu benchmarks/results/e2e_h200_exact.json \\
        --out benchmarks/results/exact_context_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _timed(row: dict) -> tuple[float, float]:
    """``(dense, sparse)`` step counts of a row scaled to its timed steps (``row["steps"]``)."""
    counted = row["dense_steps"] + row["sparse_steps"]
    return row["dense_steps"] * row["steps"] / counted, row["sparse_steps"] * row["steps"] / counted


def exact_rows(run: dict) -> dict[int, dict]:
    """A run's exact-mode rows by budget, in the run's order: ``dustin_exact@BUDGET``, or ``dustin_exact`` at the
    run's exact budget."""
    out = {}
    for row in run["rows"]:
        method, _, label = row["method"].partition("@")
        if method == "dustin_exact":
            out[int(label) if label else run["exact_mode"]["budget"][0]] = row
    return out


def rates(exact: dict, base: dict, costs: dict, sparse: float, dense: float | None = None) -> tuple[float, float]:
    """Priced tokens/s of an exact-mode row and of the baseline row: exact's dense steps at ``dense`` (default
    ``D``) and its sparse steps at ``sparse``; every step of the baseline at ``D``."""
    n_dense, n_sparse = _timed(exact)
    dense = costs["dense"] if dense is None else dense
    return (exact["tokens"] / (n_dense * dense + n_sparse * sparse),
            base["tokens"] / (_timed(base)[0] * costs["dense"]))


def summaries(exact: dict, base: dict) -> dict:
    """The replayed counts a priced case keeps of its two rows."""
    keep = ("tokens", "steps", "dense_steps", "sparse_steps", "tokens_per_step")
    return {"spec_sparse_draft": {k: base[k] for k in keep},
            "dustin_exact": {**{k: exact[k] for k in keep}, "exact": exact["exact"]}}


def step_costs(gpu: dict) -> dict:
    """``D`` and ``S`` at each budget the GPU run timed exact mode at (seconds); with two budgets or more, also
    ``sparse_per_position``, the slope through the smallest and the largest (else ``None``)."""
    rows = {r["method"]: r for r in gpu["rows"]}
    if "spec_sparse_draft" not in rows:
        raise SystemExit("the GPU run lacks the spec_sparse_draft row (run_h200.sh e2e-exact)")
    dense = rows["spec_sparse_draft"]["seconds"] / _timed(rows["spec_sparse_draft"])[0]
    exact = exact_rows(gpu)
    if not exact:
        raise SystemExit("the GPU run lacks a dustin_exact row (run_h200.sh e2e-exact)")
    sparse = {}
    for budget, row in sorted(exact.items()):
        n_dense, n_sparse = _timed(row)
        sparse[budget] = (row["seconds"] - n_dense * dense) / n_sparse
    lo, hi = min(sparse), max(sparse)
    slope = (sparse[hi] - sparse[lo]) / (hi - lo) if hi > lo else None
    return {"dense": dense, "sparse": sparse, "sparse_per_position": slope}


def sparse_step(costs: dict, budget: int) -> float:
    """A sparse step's cost at ``budget`` (seconds): timed, or on the line through the timed budgets."""
    if budget in costs["sparse"]:
        return costs["sparse"][budget]
    if costs["sparse_per_position"] is None:
        raise SystemExit(f"the GPU run timed exact mode at budget {sorted(costs['sparse'])} only; pricing budget "
                         f"{budget} needs a second one (run_h200.sh e2e-exact --exact-budget 2048 512)")
    lo = min(costs["sparse"])
    return costs["sparse"][lo] + (budget - lo) * costs["sparse_per_position"]


def costs_ms(costs: dict) -> dict:
    """The step costs for a report, in milliseconds."""
    return {"dense": costs["dense"] * 1e3, **{f"sparse_{b}": s * 1e3 for b, s in costs["sparse"].items()},
            "sparse_per_position": None if costs["sparse_per_position"] is None else costs["sparse_per_position"] * 1e3}


def _traces(command: str) -> list[str]:
    """The prediction traces a replay's command names (file names only)."""
    words = command.split()
    start = words.index("--predictions") + 1
    end = next((i for i in range(start, len(words)) if words[i].startswith("--")), len(words))
    return [w.rsplit("/", 1)[-1] for w in words[start:end]]


def cases(run: dict, costs: dict) -> list[dict]:
    """One priced case per exact-mode row of a replay (``dustin_exact`` or ``dustin_exact@BUDGET``)."""
    base = next(r for r in run["rows"] if r["method"] == "spec_sparse_draft")
    out = []
    for budget, exact in exact_rows(run).items():
        sparse = sparse_step(costs, budget)
        exact_rate, base_rate = rates(exact, base, costs, sparse)
        out.append({"predictions": _traces(run["command"]), "budget": budget, "command": run["command"],
                    **summaries(exact, base), "estimated_sparse_step_ms": sparse * 1e3,
                    "ESTIMATE_exact_over_baseline": exact_rate / base_rate})
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="CPU replays written by e2e.py --smoke --batches 16 --out")
    parser.add_argument("--gpu", required=True, help="the H200 run whose step costs price the replays")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = json.loads(Path(args.gpu).read_text())
    costs = step_costs(gpu)
    report = {"command": " ".join([Path(sys.executable).name, sys.argv[0]] + (sys.argv[1:] if argv is None else argv)),
              "what": "CPU replays of exact mode and the lossless baseline (outcomes only: their CPU rates mean "
                      "nothing), priced with step costs fitted from the GPU run: an ESTIMATE",
              "gpu_run": args.gpu, "step_costs_ms": costs_ms(costs),
              "cases": [c for p in args.runs for c in cases(json.loads(Path(p).read_text()), costs)]}
    for c in report["cases"]:
        e = c["dustin_exact"]
        print(f"budget {c['budget']:5d}  confirmed {e['exact']['confirmed_fraction']:.3f}  "
              f"{e['exact']['tokens_per_confirmation']:.2f} tokens/confirmation  dense steps {e['dense_steps']} of "
              f"{e['dense_steps'] + e['sparse_steps']}  ESTIMATE exact / baseline {c['ESTIMATE_exact_over_baseline']:.3f}"
              f"  ({', '.join(c['predictions'])})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
