"""The quality knob against fixed budgets, from ``agreement_cpu.py`` reports: the table, the criteria, the plot.

Every walk of an ``agreement_cpu.py --targets ...`` report ran dense verification, fixed budgets and knob targets
on the same text (teacher-forced), so each point is comparable: perplexity and drafts kept per step relative to
dense, against the positions read per step (a fixed budget, or the knob's mean realised budget). For each target
the criteria of the quality knob are checked on every walk: perplexity within 1% of dense, teacher-forced
acceptance >= 97% of dense, mean realised budget <= 1024. Reports the estimate-vs-truth correlation too.

    python benchmarks/knob_curve.py benchmarks/results/agreement_cpu_4k.json benchmarks/results/agreement_cpu_8k.json \\
        --out benchmarks/results/knob_curve_cpu.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dustin_lab.evaluation import KNOB_BUDGET_LIMIT as BUDGET_LIMIT

PPL_LIMIT, ACCEPT_LIMIT = 1.01, 0.97  # the criteria of dustin-hf eval, checked here on every walk (the worst one)


def _walks(reports: list[dict]) -> list[dict]:
    return [row for report in reports for row in report["results"] if row.get("knob")]


def curve(walks: list[dict]) -> dict:
    """Per walk: the fixed budgets' and each target's (positions read, perplexity ratio, acceptance ratio)."""
    out = {}
    for w in walks:
        dense_accepted = w.get("dense_tf_accepted")
        if dense_accepted is None:  # reports from before the field: dense's from a target's ratio
            k = next((k for k in w["knob"].values() if k["tf_accepted_ratio"]), None)
            dense_accepted = None if k is None else k["tf_accepted"] / k["tf_accepted_ratio"]
        fixed = {b: {"read": int(b), "ppl_ratio": r["ppl_ratio"],
                     "tf_accepted_ratio": r["tf_accepted"] / dense_accepted if dense_accepted else None,
                     "sparse_vs_dense": r["sparse_vs_dense"], "mean_true_recovery": r.get("mean_true_recovery"),
                     "mean_estimated_recovery": r.get("mean_estimated_recovery"),
                     "estimate_vs_truth": r.get("estimate_vs_truth")}
                 for b, r in w["budgets"].items()}
        knob = {t: {"read": k["budget"]["mean"], "p95": k["budget"]["p95"], "read_in_full": k["budget"]["read_in_full"],
                    "ppl_ratio": k["ppl_ratio"], "tf_accepted_ratio": k["tf_accepted_ratio"],
                    "sparse_vs_dense": k["sparse_vs_dense"], "mean_estimated_recovery": k["mean_estimated_recovery"],
                    "mean_true_recovery": k["mean_true_recovery"], "estimate_vs_truth": k["estimate_vs_truth"]}
                for t, k in w["knob"].items()}
        out[f"{w['text']}@{w['context']}"] = {"fixed": fixed, "knob": knob}
    return out


def criteria(points: dict) -> dict:
    """Per target: does every walk meet the three limits, and the worst value of each."""
    targets = sorted({t for p in points.values() for t in p["knob"]}, key=float)
    out = {}
    for t in targets:
        rows = [p["knob"][t] for p in points.values() if t in p["knob"]]
        worst = {"ppl_ratio": max(r["ppl_ratio"] for r in rows),
                 "tf_accepted_ratio": min(r["tf_accepted_ratio"] for r in rows),
                 "mean_budget": max(r["read"] for r in rows)}
        out[t] = {**worst, "walks": len(rows),
                  "pass": worst["ppl_ratio"] <= PPL_LIMIT and worst["tf_accepted_ratio"] >= ACCEPT_LIMIT
                  and worst["mean_budget"] <= BUDGET_LIMIT}
    return out


def plot(points: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], "ppl_ratio", "perplexity / dense (teacher-forced)"),
                           (axes[1], "tf_accepted_ratio", "drafts kept per step / dense (teacher-forced)")):
        for name, p in points.items():
            fixed = sorted(p["fixed"].values(), key=lambda r: r["read"])
            line = ax.plot([r["read"] for r in fixed], [r[key] for r in fixed], "o-", label=f"{name}, fixed budget")[0]
            knob = sorted(p["knob"].items(), key=lambda kv: kv[1]["read"])
            ax.plot([r["read"] for _, r in knob], [r[key] for _, r in knob], "s--", color=line.get_color(),
                    label=f"{name}, knob ({', '.join(t for t, _ in knob)})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(PPL_LIMIT if key == "ppl_ratio" else ACCEPT_LIMIT, color="red", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("positions read per verification step (fixed budget, or the knob's mean)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.suptitle("The quality knob against fixed budgets: Qwen2.5-Coder 1.5B + 0.5B, CPU float32, sparse draft")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("reports", nargs="+", help="agreement_cpu.py reports walked with --targets")
    parser.add_argument("--out", required=True, help="the summary JSON (its plot: the same path with .png)")
    args = parser.parse_args(argv)
    reports = [json.loads(Path(r).read_text()) for r in args.reports]
    walks = _walks(reports)
    if not walks:
        parser.error("no walk in these reports ran the knob (agreement_cpu.py --targets)")
    points = curve(walks)
    summary = {"command": shlex.join(["python", "benchmarks/knob_curve.py", *(argv or sys.argv[1:])]),
               "sources": [{"path": r, "command": rep["command"], "machine": rep["machine"]}
                           for r, rep in zip(args.reports, reports)],
               "limits": {"ppl_ratio": PPL_LIMIT, "tf_accepted_ratio": ACCEPT_LIMIT, "mean_budget": BUDGET_LIMIT},
               "walks": points, "criteria": criteria(points)}
    out = Path(args.out)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    png = plot(points, out.with_suffix(".png"))
    summary["plot"] = None if png is None else str(png)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    for name, p in points.items():
        print(name)
        for b, r in sorted(p["fixed"].items(), key=lambda kv: int(kv[0])):
            corr = r.get("estimate_vs_truth") or {}
            print(f"  budget {b:>5}: ppl x{r['ppl_ratio']:.4f}  accepted x{_f(r['tf_accepted_ratio'])}"
                  f"  top-1 vs dense {r['sparse_vs_dense']:.3f}  recovery true {_f(r['mean_true_recovery'])}"
                  f"  est {_f(r['mean_estimated_recovery'])}"
                  f" (pearson {corr.get('pearson')}, spearman {corr.get('spearman')})")
        for t, r in sorted(p["knob"].items(), key=lambda kv: float(kv[0])):
            corr = r["estimate_vs_truth"]
            print(f"  knob {t:>5}: ppl x{r['ppl_ratio']:.4f}  accepted x{_f(r['tf_accepted_ratio'])}"
                  f"  top-1 vs dense {r['sparse_vs_dense']:.3f}  read mean {r['read']:.0f} p95 {r['p95']:.0f}"
                  f" ({r['read_in_full']} steps in full)  recovery est {_f(r['mean_estimated_recovery'])}"
                  f" true {_f(r['mean_true_recovery'])}  (pearson {corr['pearson']}, spearman {corr['spearman']};"
                  " steps read in full left out)")
    for t, c in summary["criteria"].items():
        print(f"target {t}: worst ppl x{c['ppl_ratio']:.4f}, accepted x{c['tf_accepted_ratio']:.3f}, "
              f"mean budget {c['mean_budget']:.0f} over {c['walks']} walks: {'PASS' if c['pass'] else 'fail'}")
    return summary


if __name__ == "__main__":
    main()
