"""Estimators of a read set's recovery, tried offline on the features a walk's probe wrote.

The quality knob needs, per step, a mass over the cached positions whose sum over a set tracks that set's
true recovery (every layer, head and query of the target). The library's
(:func:`~dustin_hf.experimental.estimated_mass`)
is the mean of the scoring heads' two signals, each normalised over ``[0, L)``. An :class:`Estimator` here is
the same recipe with any heads of any layer for either signal, any mix and a power (``power < 1`` flattens
the mass, for signals sharper than the truth), computed from :class:`~dustin_lab.knob.EstimatorFeatures`.

:func:`study` scores estimators two ways, per text and pooled:

* **as a proxy**: on the paper's fixed fill of each budget (the same set for every estimator), Pearson and
  Spearman of the estimator's sum over the set against the set's true recovery, and the mean error;
* **as the knob's order and stop**: the knob's selection (:func:`~dustin_hf.selection.fill.select_by_recovery`)
  made from the estimator's mass at each target: the positions read, the true recovery they reach (mean and
  10th percentile over steps), so that estimators and the fixed budgets compare at the same mean read.

:func:`order_study` separates the knob's order from its split of the reads across steps: with the library's
estimate it compares the knob (positions by estimated mass) with a knob over the paper's order (the fixed fill at
a ladder of budgets, the smallest rung whose estimate reaches the target, else everything), and with both orders
split by the *true* recovery (an oracle: the best any split can do with that order at the ladder's steps).

A monotone map from estimate to truth (a calibration) moves every row's stop the same way a different target
does, so it relabels the knob's curve without moving it; what moves the curve is a mass that ranks steps
(and positions) more like the truth does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dustin_hf.experimental import ResolvedConfig, select_by_recovery, select_positions

from .knob import correlation

__all__ = ["Estimator", "library_estimator", "order_study", "study"]


@dataclass(frozen=True)
class Estimator:
    """A per-position mass from the features of one step.

    Args:
        target: ``((layer, heads), ...)``: history heads summed for the target's signal (empty: no history).
        draft: ``((layer, heads), ...)``: lookahead heads summed for the draft's signal (empty: none).
        draft_weight: the draft signal's share of the mix (each signal normalised over ``[0, L)`` first).
        power: the mix is raised to it and renormalised.
    """

    target: tuple[tuple[int, tuple[int, ...]], ...]
    draft: tuple[tuple[int, tuple[int, ...]], ...]
    draft_weight: float = 0.5
    power: float = 1.0

    def __post_init__(self):
        if not self.target and not self.draft:
            raise ValueError("an Estimator needs target or draft heads")
        if not 0 <= self.draft_weight <= 1 or self.power <= 0:
            raise ValueError(f"draft_weight must be in [0, 1] and power > 0, got {self.draft_weight}, {self.power}")

    def mass(self, step: dict) -> torch.Tensor:
        """``(L,)`` float32 summing to 1."""
        parts = []
        if self.target:
            parts.append((1 - self.draft_weight if self.draft else 1.0, _summed(step["history"], self.target)))
        if self.draft:
            parts.append((self.draft_weight if self.target else 1.0, _summed(step["draft"], self.draft)))
        mass = sum(weight * _normalised(signal) for weight, signal in parts)
        return _normalised(mass.pow(self.power)) if self.power != 1 else mass


def library_estimator(config: ResolvedConfig) -> Estimator:
    """The recipe :func:`~dustin_hf.selection.fill.estimated_mass` follows with ``config``'s scoring heads."""
    return Estimator(
        target=((config.target_layer, config.target_heads),), draft=tuple(zip(config.draft_layers, config.draft_heads))
    )


def _summed(features: torch.Tensor, heads) -> torch.Tensor:
    return sum(features[layer, list(h)].float().sum(dim=0) for layer, h in heads)


def _normalised(signal: torch.Tensor) -> torch.Tensor:
    return signal / signal.sum().clamp_min(torch.finfo(torch.float32).tiny)


def study(
    steps: dict[str, list[dict]],
    config: ResolvedConfig,
    estimators: dict[str, Estimator],
    targets: list[float],
    budgets: list[int],
) -> dict:
    """Score ``estimators`` on ``steps`` (per text, the feature steps of its walk): see the module docstring.

    ``config`` gives the paper's fill (its scoring heads, windows and ``draft_share``, rescaled per budget) and
    the knob's floor and ceiling (``budget``, ``max_budget``).
    """
    fills = {b: _fixed_fills(steps, config, b) for b in budgets}
    report = {"fixed_fill": {str(b): _pooled(steps, fills[b]) for b in budgets}, "estimators": {}}
    for name, estimator in estimators.items():
        masses = {text: [estimator.mass(s) for s in rows] for text, rows in steps.items()}
        proxy = {}
        for b in budgets:
            pairs = {
                text: [
                    (float(m[f].sum()), float(s["truth"][f].sum()))
                    for s, m, f in zip(rows, masses[text], fills[b][text])
                ]
                for text, rows in steps.items()
            }
            proxy[str(b)] = _correlations(pairs)
        knob = {}
        for t in targets:
            cfg = dataclasses.replace(config, min_recovery=t)
            rows = {text: [_knob_step(s, m, cfg) for s, m in zip(rows, masses[text])] for text, rows in steps.items()}
            knob[str(t)] = _knob_summary(rows)
        report["estimators"][name] = {"estimator": dataclasses.asdict(estimator), "proxy": proxy, "knob": knob}
    return report


def _fixed_fills(steps, config: ResolvedConfig, budget: int) -> dict[str, list[torch.Tensor]]:
    """Per text and step, the positions the paper's fill reads at ``budget`` (the config's heads and share)."""
    free, base_free = (
        budget - config.sink_tokens - config.recent_tokens,
        config.budget - config.sink_tokens - config.recent_tokens,
    )
    share = round(config.draft_share * free / base_free) if base_free else 0
    cfg = dataclasses.replace(config, budget=budget, draft_share=min(share, free), min_recovery=None, max_budget=0)
    library = library_estimator(config)
    fills = {}
    for text, rows in steps.items():
        fills[text] = []
        for s in rows:
            s_draft, s_target = _summed(s["draft"], library.draft), _summed(s["history"], library.target)
            chosen = select_positions([s["at"]], s_draft[None], s_target[None], [True], cfg)
            fills[text].append(chosen.indices[0, : chosen.counts[0]].long())
    return fills


def _truth(step: dict, positions: torch.Tensor) -> float:
    return float(step["truth"][positions].sum())


def _pooled(steps, fills) -> dict:
    """The true recovery of the fixed fill's sets over every step: mean, 10th percentile."""
    truths = [_truth(s, f) for text, rows in steps.items() for s, f in zip(rows, fills[text])]
    return {"mean_truth": sum(truths) / len(truths), "p10_truth": _quantile(truths, 0.1), "steps": len(truths)}


def _correlations(pairs: dict[str, list[tuple[float, float]]]) -> dict:
    everything = [p for rows in pairs.values() for p in rows]
    out = {"pooled": _agreement(everything)}
    out.update({text: _agreement(rows) for text, rows in pairs.items()})
    return out


def _agreement(pairs: list[tuple[float, float]]) -> dict:
    estimate, truth = [p[0] for p in pairs], [p[1] for p in pairs]
    error = [e - t for e, t in pairs]
    return {
        **correlation(estimate, truth),
        "mean_estimate": sum(estimate) / len(pairs),
        "mean_truth": sum(truth) / len(pairs),
        "mean_abs_error": sum(abs(e) for e in error) / len(pairs),
    }


def _knob_step(step: dict, mass: torch.Tensor, cfg: ResolvedConfig) -> tuple[int, int, float, float]:
    """The knob's read set from ``mass``: (positions read, L, its estimate, its true recovery)."""
    chosen = select_by_recovery([step["at"]], mass[None], None, [False], cfg)  # no history: the mass as given
    positions = chosen.indices[0, : chosen.counts[0]].long()
    return chosen.counts[0], step["at"], chosen.recovery[0], _truth(step, positions)


def _knob_summary(rows: dict[str, list[tuple[int, int, float, float]]]) -> dict:
    def summary(items):
        counts, truths = [r[0] for r in items], [r[3] for r in items]
        sparse = [r for r in items if r[0] < r[1]]
        return {
            "mean_read": sum(counts) / len(counts),
            "p95_read": _quantile(counts, 0.95),
            "read_in_full": len(items) - len(sparse),
            "mean_truth": sum(truths) / len(truths),
            "p10_truth": _quantile(truths, 0.1),
            "estimate_vs_truth": _agreement([(r[2], r[3]) for r in sparse]) if len(sparse) >= 3 else None,
        }

    out = {"pooled": summary([r for items in rows.values() for r in items])}
    out.update({text: summary(items) for text, items in rows.items()})
    return out


def _quantile(values: list[float], q: float) -> float:
    return float(torch.tensor(values, dtype=torch.float64).quantile(q))


def order_study(
    steps: dict[str, list[dict]],
    config: ResolvedConfig,
    targets: list[float],
    ladder: list[int] | None = None,
    reads: tuple[int, ...] = (1024, 2048),
) -> dict:
    """The knob's order against the paper's, each with the estimate's split and the truth's (see the module docstring).

    ``ladder``: the rungs (default ``budget`` to ``max_budget`` in steps of 128); the fixed fill of each rung uses
    :func:`_fixed_fills`' draft share rule. Rows (as :func:`study`'s knob rows, per target):

    * ``library_knob``: :func:`~dustin_hf.selection.fill.select_by_recovery` (positions by estimated mass);
    * ``ladder_knob``: the smallest rung whose fixed fill's estimate reaches the target, else every position;
    * ``oracle_ladder``: the smallest rung whose fixed fill's *true* recovery reaches it, else every position;
    * ``oracle_library``: the same over the library's order cut at the rungs' counts;
    * ``ladder_knob_no_fallback``: ``ladder_knob`` with the top rung where no rung reaches the target.

    ``best_mean_ladder``, ``best_mean_library``: per order, the split maximising the mean true recovery at each mean
    read (:func:`_best_mean`; a bound on the mean, where the oracle rows bound a threshold split).

    ``by_count``: per rung, the true recovery of each order at that count on every step (the orders alone).
    ``at_read``: each curve's mean and 10th-percentile truth interpolated linearly at each of ``reads`` mean reads.
    """
    ladder = sorted(ladder or range(config.budget, config.max_budget + 1, 128))
    library = library_estimator(config)
    fills = {b: _fixed_fills(steps, config, b) for b in ladder}
    per_step = {}  # text -> per step: mass, and per rung (count, paper estimate, paper truth, library-order truth)
    for text, rows in steps.items():
        per_step[text] = []
        for i, s in enumerate(rows):
            mass = library.mass(s)
            rungs = []
            for b in ladder:
                f = fills[b][text][i]
                ordered = select_by_recovery([s["at"]], mass[None], None, [False], config, counts=[len(f)])
                own = ordered.indices[0, : ordered.counts[0]].long()
                rungs.append((len(f), float(mass[f].sum()), _truth(s, f), _truth(s, own), float(mass[own].sum())))
            per_step[text].append((mass, rungs))

    def laddered(key, truth_at, fallback=True):
        """Per target, rows of the smallest rung where ``key(rung) >= target``, else the whole context (without
        ``fallback``: the top rung)."""
        out = {}
        for t in targets:
            rows = {}
            for text, items in steps.items():
                rows[text] = []
                for s, (_, rungs) in zip(items, per_step[text]):
                    hit = next((r for r in rungs if key(r) >= t), None if fallback else rungs[-1])
                    rows[text].append(
                        (s["at"], s["at"], 1.0, _truth(s, torch.arange(s["at"])))
                        if hit is None
                        else (hit[0], s["at"], hit[1], truth_at(hit))
                    )
            out[str(t)] = _knob_summary(rows)
        return out

    library_knob = {}
    for t in targets:
        cfg = dataclasses.replace(config, min_recovery=t)
        rows = {
            text: [_knob_step(s, m, cfg) for s, (m, _) in zip(items, per_step[text])] for text, items in steps.items()
        }
        library_knob[str(t)] = _knob_summary(rows)
    curves = {
        "library_knob": library_knob,
        "ladder_knob": laddered(lambda r: r[1], lambda r: r[2]),
        "oracle_ladder": laddered(lambda r: r[2], lambda r: r[2]),
        "oracle_library": laddered(lambda r: r[3], lambda r: r[3]),
        "ladder_knob_no_fallback": laddered(lambda r: r[1], lambda r: r[2], fallback=False),
    }
    best = {"best_mean_ladder": _best_mean(steps, per_step, 2), "best_mean_library": _best_mean(steps, per_step, 3)}
    by_count = {}
    for j, b in enumerate(ladder):
        items = [rungs[j] for text in steps for _, rungs in per_step[text]]
        counts = [r[0] for r in items]
        paper, own = [r[2] for r in items], [r[3] for r in items]
        by_count[str(b)] = {
            "mean_read": sum(counts) / len(counts),
            "fixed_fill": {
                "mean_truth": sum(paper) / len(paper),
                "p10_truth": _quantile(paper, 0.1),
                "mean_estimate": sum(r[1] for r in items) / len(items),
            },
            "library_order": {
                "mean_truth": sum(own) / len(own),
                "p10_truth": _quantile(own, 0.1),
                "mean_estimate": sum(r[4] for r in items) / len(items),
            },
        }
    points = {
        "fixed_fill": [(v["mean_read"], v["fixed_fill"]) for v in by_count.values()],
        "library_order_fixed": [(v["mean_read"], v["library_order"]) for v in by_count.values()],
    }
    points.update(
        {name: [(v["pooled"]["mean_read"], v["pooled"]) for v in curve.values()] for name, curve in curves.items()}
    )
    points.update({name: [(v["mean_read"], v) for v in curve] for name, curve in best.items()})
    at_read = {
        str(x): {name: {k: _interpolated(p, x, k) for k in ("mean_truth", "p10_truth")} for name, p in points.items()}
        for x in reads
    }
    return {"ladder": ladder, "targets": targets, "by_count": by_count, **curves, **best, "at_read": at_read}


def _best_mean(steps, per_step, truth_index: int) -> list[dict]:
    """The split of reads that maximises the mean true recovery at each mean read (an oracle over the rungs and the
    whole context, one order): per ``lam``, each step takes the option maximising ``truth - lam * count``."""
    out = []
    for lam in [0.0] + [10 ** (e / 20) for e in range(-160, 1)]:
        counts, truths, full = [], [], 0
        for text, items in steps.items():
            for s, (_, rungs) in zip(items, per_step[text]):
                options = [(r[0], r[truth_index]) for r in rungs] + [(s["at"], _truth(s, torch.arange(s["at"])))]
                count, truth = max(options, key=lambda o: (o[1] - lam * o[0], -o[0]))
                counts.append(count), truths.append(truth)
                full += count >= s["at"]
        out.append(
            {
                "lambda": lam,
                "mean_read": sum(counts) / len(counts),
                "read_in_full": full,
                "mean_truth": sum(truths) / len(truths),
                "p10_truth": _quantile(truths, 0.1),
            }
        )
    return sorted(out, key=lambda p: (p["mean_read"], p["mean_truth"]))


def _interpolated(points: list[tuple[float, dict]], x: float, key: str) -> float | None:
    """``key`` at mean read ``x``, linear between the first two consecutive points (in the given order) that bracket
    it; ``None`` outside the curve."""
    for (x0, a), (x1, b) in zip(points, points[1:]):
        if min(x0, x1) <= x <= max(x0, x1):
            return a[key] if x1 == x0 else a[key] + (b[key] - a[key]) * (x - x0) / (x1 - x0)
    return next((p[key] for r, p in points if r == x), None)
