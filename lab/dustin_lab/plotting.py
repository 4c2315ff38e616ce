"""Quality-versus-budget plot of a fidelity report (matplotlib, an optional dependency)."""

from __future__ import annotations

import warnings
from pathlib import Path

__all__ = ["plot_fidelity"]


def plot_fidelity(report: dict, path: str | Path) -> Path | None:
    """Four panels, one line per context. Against the positions read per step: perplexity ratio to dense and
    acceptance ratio to dense (teacher-forced when the walk ran, else in the continuations), the fixed budgets'
    curve and, when the report has quality-knob targets, the knob's curve (each target at its mean positions
    read) on the same axes. Against the budget: attention recovery (calibrated vs default heads, and the
    oracle) and needle accuracy.

    Returns the PNG's path, or ``None`` (with a warning) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(
            "matplotlib is not installed: skipping the plot (pip install -e './lab[models]' in the repository)",
            stacklevel=2,
        )
        return None
    summary = report["summary"]
    per_context = summary["per_context"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    teacher_forced = any(r.get("tf_accepted_ratio") is not None for row in per_context.values() for r in row.values())
    acceptance = "tf_accepted_ratio" if teacher_forced else "accepted_ratio"
    panels = [
        (axes[0, 0], "ppl_ratio", "perplexity / dense (teacher-forced)"),
        (axes[0, 1], acceptance, "drafts kept per step / dense" + (" (teacher-forced)" if teacher_forced else "")),
    ]
    for ax, key, title in panels:
        for context, row in per_context.items():
            budgets = sorted(int(b) for b in row)
            line = _curve(ax, budgets, [row[str(b)].get(key) for b in budgets], f"budget, context {context}", "-", "o")
            knob = summary.get("knob", {}).get(context, {})
            targets = sorted(knob, key=lambda t: knob[t]["mean_read"])
            _curve(
                ax,
                [knob[t]["mean_read"] for t in targets],
                [knob[t].get(key) for t in targets],
                f"knob ({', '.join(targets)}), context {context}",
                "--",
                "s",
                color=None if line is None else line.get_color(),
            )
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title(title)
        ax.set_xlabel("positions read per step (fixed budget, or the knob's mean)")
    ax = axes[1, 0]
    for context, row in per_context.items():
        budgets = sorted(int(b) for b in row)
        for key, style in (("recovery_calibrated", "-"), ("recovery_default", ":"), ("recovery_oracle", "--")):
            values = [row[str(b)].get(key) for b in budgets]
            if any(v is not None for v in values):
                label = f"{context}, {key.removeprefix('recovery_')}" + ("" if key.endswith("oracle") else " heads")
                ax.plot(
                    budgets, [v if v is not None else float("nan") for v in values], marker="o", ls=style, label=label
                )
    ax.set_title("attention recovery (share of dense attention mass)")
    ax = axes[1, 1]
    for context, accuracy in report["summary"]["needle_accuracy"].items():
        budgets = sorted(int(b) for b in accuracy if b != "dense")
        line = ax.plot(budgets, [accuracy[str(b)] for b in budgets], marker="o", label=f"Dustin, context {context}")
        ax.axhline(accuracy["dense"], color=line[0].get_color(), lw=0.8, ls="--", label=f"dense, context {context}")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("needle accuracy")
    for ax in axes[1]:
        ax.set_xlabel("budget (cached positions read per step)")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    pair = report.get("model_pair", {})
    machine = report.get("machine", {})
    fig.suptitle(
        f"Dustin fidelity: {pair.get('target', {}).get('name', '?')} + {pair.get('draft', {}).get('name', '?')}"
        f" ({machine.get('device', '?')}, {pair.get('dtype', '?')})",
        fontsize=11,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curve(ax, xs, ys, label, style, marker, color=None):
    """One line of ``(x, y)`` points (``None`` values skipped); returns it, or ``None`` when nothing is plotted."""
    points = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if not points:
        return None
    return ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, ls=style, label=label, color=color)[
        0
    ]
