"""Quality-versus-budget plot of a fidelity report (matplotlib, an optional dependency)."""

from __future__ import annotations

import warnings
from pathlib import Path

__all__ = ["plot_fidelity"]


def plot_fidelity(report: dict, path: str | Path) -> Path | None:
    """Four panels against the budget, one line per context: perplexity ratio to dense, acceptance
    ratio to dense, attention recovery (calibrated vs default heads, and the oracle), needle accuracy.

    Returns the PNG's path, or ``None`` (with a warning) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: skipping the plot (pip install 'dustin-hf[models]')", stacklevel=2)
        return None
    per_context = report["summary"]["per_context"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0, 0], "ppl_ratio", "perplexity / dense (teacher-forced)", 1.0),
        (axes[0, 1], "accepted_ratio", "mean accepted drafts / dense", 1.0),
    ]
    for ax, key, title, ref in panels:
        for context, row in per_context.items():
            budgets = sorted(int(b) for b in row)
            values = [row[str(b)][key] for b in budgets]
            if any(v is not None for v in values):
                ax.plot(budgets, [v if v is not None else float("nan") for v in values], marker="o", label=f"context {context}")
        ax.axhline(ref, color="gray", lw=0.8, ls="--")
        ax.set_title(title)
    ax = axes[1, 0]
    for context, row in per_context.items():
        budgets = sorted(int(b) for b in row)
        for key, style in (("recovery_calibrated", "-"), ("recovery_default", ":"), ("recovery_oracle", "--")):
            values = [row[str(b)].get(key) for b in budgets]
            if any(v is not None for v in values):
                label = f"{context}, {key.removeprefix('recovery_')}" + ("" if key.endswith("oracle") else " heads")
                ax.plot(budgets, [v if v is not None else float("nan") for v in values], marker="o", ls=style, label=label)
    ax.set_title("attention recovery (share of dense attention mass)")
    ax = axes[1, 1]
    for context, accuracy in report["summary"]["needle_accuracy"].items():
        budgets = sorted(int(b) for b in accuracy if b != "dense")
        line = ax.plot(budgets, [accuracy[str(b)] for b in budgets], marker="o", label=f"Dustin, context {context}")
        ax.axhline(accuracy["dense"], color=line[0].get_color(), lw=0.8, ls="--", label=f"dense, context {context}")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("needle accuracy")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (cached positions read per step)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    pair = report.get("model_pair", {})
    machine = report.get("machine", {})
    fig.suptitle(f"Dustin fidelity: {pair.get('target', {}).get('name', '?')} + {pair.get('draft', {}).get('name', '?')}"
                 f" ({machine.get('device', '?')}, {pair.get('dtype', '?')})", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
