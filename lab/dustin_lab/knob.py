"""The quality knob's evidence: what it read, and how well its estimate tracks the true recovery.

The knob (``DustinConfig.min_recovery``) grows each row's read set until the *estimated* recovery
(:func:`~dustin_hf.selection.fill.estimated_mass`: the scoring heads' attention) reaches the target. Whether that
controls quality depends on how closely the estimate follows the *true* recovery: the share of attention that
every layer, head and query of the target puts on the set (:mod:`dustin_hf.selection.recovery`). Here:

* :func:`budget_summary`: the positions a method read per step (mean, median, 95th percentile, max, dense
  fallbacks), as ``stats["knob"]`` reports them for a decode;
* :func:`correlation`: Pearson and Spearman between per-step estimates and truths;
* :class:`EstimatorFeatures`: a walk probe (:func:`~dustin_lab.walk.teacher_forced_walk`'s ``probe``)
  that keeps, per step, the true per-position weights and every head's attention of the two signals (the
  dense target's history query on every layer, the draft's lookahead queries on every layer), so that any
  estimator can be tried offline (:mod:`dustin_lab.estimators`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dustin_hf.experimental import head_probabilities

__all__ = ["EstimatorFeatures", "budget_summary", "correlation", "load_features"]


def budget_summary(counts: list[int], contexts: list[int]) -> dict:
    """Positions read per step (``counts``) at ``contexts`` cached positions: mean, p50, p95, max, and the steps
    read in full (``count == context``: a dense fallback, or a context within the floor)."""
    if not counts:
        return {"steps": 0}
    ordered = torch.tensor(sorted(counts), dtype=torch.float64)
    full = sum(c >= n for c, n in zip(counts, contexts))
    return {
        "steps": len(counts),
        "mean": float(ordered.mean()),
        "p50": float(ordered.quantile(0.5)),
        "p95": float(ordered.quantile(0.95)),
        "max": int(ordered[-1]),
        "read_in_full": full,
        "mean_share_of_context": sum(c / n for c, n in zip(counts, contexts)) / len(counts),
    }


def correlation(x: list[float], y: list[float]) -> dict:
    """Pearson and Spearman (ties by average rank) of paired samples; ``None`` for fewer than 3 or a constant."""
    n = len(x)
    if n != len(y):
        raise ValueError(f"correlation needs paired samples, got {n} and {len(y)}")
    out = {"n": n, "pearson": None, "spearman": None}
    if n < 3:
        return out
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    out["pearson"] = _pearson(a, b)
    out["spearman"] = _pearson(_ranks(a), _ranks(b))
    return out


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a - a.mean(), b - b.mean()
    scale = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / scale if scale > 0 else None


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1, tied values sharing their mean rank."""
    _, inverse, counts = values.unique(return_inverse=True, return_counts=True)  # unique values come sorted
    ends = counts.cumsum(0).to(values.dtype)
    return ((ends - counts + ends - 1) / 2)[inverse]


class EstimatorFeatures:
    """A walk probe writing, per step, one ``step_<n>.pt`` under ``directory`` (nothing kept in memory):

    * ``at``: ``L``, the cached positions; ``truth``: ``(L,)`` float32, the mean over layers of the reference
      attention (a shared set's true recovery is its sum); ``layer_truth``: ``(n_layers, L)`` float16, per layer;
    * ``history``: ``(n_target_layers, H, L)`` float16, each head's attention of the dense target's query of the
      token at ``L - 1`` (what ``S_target`` is a sum of);
    * ``draft``: ``(n_draft_layers, H_draft, L)`` float16, each head's attention of the draft's γ lookahead
      queries, summed over them and restricted to ``[0, L)`` (what ``S_draft`` is a sum of).

    A step whose history lacks a layer (step 0, when the prefill kept only a few) is skipped.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.saved = 0

    def __call__(self, step) -> None:
        at = step.at
        if set(step.history) != set(step.target_keys):
            return
        device = step.weights.device
        history = torch.stack(
            [
                head_probabilities(
                    step.history[layer][None],
                    step.target_keys[layer],
                    torch.tensor([at - 1], device=device),
                    at,
                    step.target_scale,
                )
                for layer in sorted(step.target_keys)
            ]
        )  # (n_layers, H, L)
        draft = torch.stack(
            [
                head_probabilities(
                    queries,
                    step.draft_keys[layer],
                    at + torch.arange(queries.shape[0], device=device),
                    at,
                    step.draft_scale,
                )
                for layer, queries in sorted(step.draft_queries.items())
            ]
        )  # (n_draft_layers, H_draft, L)
        torch.save(
            {
                "step": step.step,
                "at": at,
                "truth": step.weights.mean(dim=0).float().cpu(),
                "layer_truth": step.weights.half().cpu(),
                "history": history.half().cpu(),
                "draft": draft.half().cpu(),
            },
            self.directory / f"step_{step.step:04d}.pt",
        )
        self.saved += 1


def load_features(directory: str | Path) -> list[dict]:
    """The steps :class:`EstimatorFeatures` wrote under ``directory``, in order."""
    paths = sorted(Path(directory).glob("step_*.pt"))
    if not paths:
        raise FileNotFoundError(f"no step_*.pt feature files under {directory}")
    return [torch.load(path) for path in paths]
