"""The old-vs-new A/B's ratios (``benchmarks/ab_trees.sh``): new over old per shape and measure, from the ``AB``
lines of ``ab_point.py`` runs in the order old, new, new, old; prints a table and one JSON line, saves the results.

Each ratio pools both orders (the sum of the new runs' values over the old runs'), so a drift across the process
sequence (clocks, the allocator, the Triton cache) weighs on both trees alike; the ratio of each order is kept too.
``decode``: tokens/s (above 1: new is faster); ``call`` and ``warmup`` (``DustinPatch.warmup()`` before it):
seconds (below 1: new is faster).

    python benchmarks/ab_compare.py OUT/ab_*.txt --out OUT/ab_trees.json --command "..."
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

MEASURES = {"decode": "decode_tokens_per_s", "call": "call_seconds", "warmup": "warmup_seconds"}
WITHIN = 0.01  # the acceptance: new within 1% of old


def read_runs(paths) -> list[dict]:
    """The ``AB`` line of each file, in the order given."""
    runs = []
    for path in paths:
        lines = [line for line in Path(path).read_text().splitlines() if line.startswith("AB ")]
        if not lines:
            raise SystemExit(f"{path}: no AB line (the run failed or timed out; see that file)")
        runs.append(json.loads(lines[-1][3:]))
    return runs


def ratios(runs: list[dict]) -> list[dict]:
    """Per shape and measure: new over old pooled over every run, and per order (old then new, new then old)."""
    rows = []
    for i, point in enumerate(runs[0]["points"]):
        for name, key in MEASURES.items():
            values = {label: [r["points"][i][key] for r in runs if r["label"] == label] for label in ("old", "new")}
            pooled = sum(values["new"]) / sum(values["old"])
            by_order = [n / o for o, n in zip(values["old"], values["new"])]  # the neighbours: runs 1-2 and 4-3
            rows.append(
                dict(
                    context=point["context"],
                    batch=point["batch"],
                    measure=name,
                    old=values["old"],
                    new=values["new"],
                    ratio=pooled,
                    ratio_by_order=by_order,
                    within=abs(pooled - 1) <= WITHIN,
                )
            )
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="ab_point.py outputs, in the order they ran")
    parser.add_argument("--out", default=None, help="save the results JSON here")
    parser.add_argument("--command", default="", help="the command that ran the A/B (saved with the results)")
    args = parser.parse_args(argv)
    runs = read_runs(args.files)
    rows = ratios(runs)
    print(f"\n{'shape':<10}{'measure':<12}{'old':>22}{'new':>22}{'new/old':>9}  by order")
    for r in rows:
        old, new = (" ".join(f"{v:.4g}" for v in r[k]) for k in ("old", "new"))
        orders = " ".join(f"{v:.4f}" for v in r["ratio_by_order"])
        print(f"{r['context']}x{r['batch']:<4}{r['measure']:<12}{old:>22}{new:>22}{r['ratio']:>9.4f}  {orders}")
    result = dict(
        benchmark="ab_trees",
        command=args.command,
        machine=platform.node(),
        gpu=runs[0]["gpu"],
        versions=runs[0]["versions"],
        trees={r["label"]: r["dustin_hf"] for r in runs},
        order=[r["label"] for r in runs],
        tokens={"decode": runs[0]["decode_tokens"], "call": runs[0]["call_tokens"]},
        rows=rows,
        runs=runs,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    summary = {f"{r['context']}x{r['batch']} {r['measure']}": round(r["ratio"], 4) for r in rows}
    print(json.dumps({"benchmark": "ab_trees", "gpu": result["gpu"], "new_over_old": summary}))
    return result


if __name__ == "__main__":
    main()
