"""The quality knob's read-set policy (``DustinConfig(min_recovery=...)``): each row reads the smallest set whose
estimated recovery reaches the target.

The estimate is the scoring heads' share of attention (:func:`estimated_mass`: the two signals of
:class:`~dustin_hf.selection.request.Scorer`, each normalised over the row); the set takes the sinks and the recent
window, then positions by that mass until their sum reaches ``min_recovery``, at least ``budget`` positions and at
most ``max_budget`` (:func:`select_by_recovery`). Each row's count is its own, so the choice is made in PyTorch
and read back to the host once, and no CUDA graph replays it.
"""

from __future__ import annotations

import torch

from ..config import ResolvedConfig
from ..runtime.plan import device_tensor
from .fill import Selection, dense_rows, per_row
from .request import ReadRequest, Scorer

__all__ = ["RecoveryKnob", "estimated_mass", "select_by_recovery"]


class RecoveryKnob:
    """``min_recovery``: per row and step, the smallest set whose estimated recovery reaches it.

    Args:
        scorer: the two signals' settings (its ``config`` is the policy's).
        graphs: unused (each row's count is read back to the host, which no graph replays).
    """

    def __init__(self, scorer: Scorer, graphs: bool):
        self.scorer = scorer

    @staticmethod
    def applies(config: ResolvedConfig) -> bool:
        return config.min_recovery is not None

    @property
    def config(self) -> ResolvedConfig:
        return self.scorer.config

    def select(self, request: ReadRequest) -> Selection:
        inputs = self.scorer.inputs(request)
        s_draft, s_target = self.scorer.scores(inputs, inputs.draft_queries, request.base, inputs.history_queries)
        # a row read in full by its count (one width, so the target's CUDA graph); within a sliding window a row
        # reads its window, which only a listing says
        return select_by_recovery(
            request.seqlens,
            s_draft,
            s_target,
            inputs.has_history,
            self.config,
            lengths=request.base,
            counts=None if request.budgets is None else request.budgets(request.seqlens),
            window=request.window,
            full_rows=request.window is None,
        )

    @property
    def graph_report(self) -> dict:
        return {"captured": 0, "failed": []}


def estimated_mass(
    draft_scores: torch.Tensor, target_scores: torch.Tensor | None, has_history: list[bool], lengths: torch.Tensor
) -> torch.Tensor:
    """``(B, span)`` float32: each cached position's share of the scoring heads' attention, the mean of the target
    history's and the draft lookahead's masses, each normalised over the row's ``[0, L)`` (the draft's alone for
    a row without a history). It sums to 1 over a row, so a set's sum is its estimated recovery."""
    valid = torch.arange(draft_scores.shape[1], device=draft_scores.device)[None, :] < lengths[:, None]

    def normalised(scores):
        scores = scores.float() * valid
        return scores / scores.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)

    mass = normalised(draft_scores)
    if target_scores is not None and any(has_history):
        both = 0.5 * (mass + normalised(target_scores))
        mass = torch.where(device_tensor(has_history, mass.device)[:, None], both, mass)
    return mass


def select_by_recovery(
    seqlens: list[int],
    draft_scores: torch.Tensor,
    target_scores: torch.Tensor | None,
    has_history: list[bool],
    config: ResolvedConfig,
    lengths: torch.Tensor | None = None,
    counts: list[int] | None = None,
    window: int | list[int] | None = None,
    full_rows: bool = False,
) -> Selection:
    """The quality knob's read sets (``config.min_recovery``): per row, the sinks and the recent window, then
    positions by :func:`estimated_mass` until the set's estimated recovery reaches the target; at least
    ``budget`` positions, at most ``max_budget``, else (the target out of reach) every position. Rows that
    :func:`~dustin_hf.selection.fill.dense_rows` reads in full are read in full. Indices come out sorted, ``(B, W)``
    int32 with ``W`` the ceiling, or more when a row read in full is listed (without ``full_rows``) or a replayed
    count passes it.
    ``counts`` (benchmarks replaying recorded budgets): each row's size instead of the one the target asks for (a
    count reaching the row's context reads it in full; one past the ceiling short of it, the forced positions and
    the ceiling's top entries).
    ``window``: a sliding window every layer has (or each row's, as for
    :func:`~dustin_hf.selection.fill.select_positions`): only ``[L - window + 1, L)`` holds candidates (and mass),
    and the sinks are the window's first positions.
    ``full_rows``: a row read in full is named by its count alone (:attr:`Selection.full_rows`), so ``W`` stays
    the ceiling."""
    device = draft_scores.device
    lengths = device_tensor(seqlens, device) if lengths is None else lengths.to(device)
    mass, inside, forced = _candidates(draft_scores, target_scores, has_history, config, lengths, window)
    rank, take, out_of_reach, reached = _ranked(mass, inside, forced, config, lengths, counts)
    dense = dense_rows(seqlens, config)
    whole = out_of_reach | device_tensor(dense, device)
    positions = torch.arange(mass.shape[1], device=device)[None, :]
    chosen = forced | ((rank < take[:, None]) & inside)
    chosen = torch.where(whole[:, None], inside if window is not None else positions < lengths[:, None], chosen)
    counts_t = chosen.sum(dim=1)
    estimate = torch.where(whole, torch.ones_like(reached[:, 0]), (mass * chosen).sum(dim=1))
    host = torch.stack([counts_t.float(), estimate, out_of_reach.float()]).tolist()  # one sync: counts size the sets
    counts = [int(c) for c in host[0]]
    # rows read in full through their counts alone (full_rows, no window: a window's row is listed)
    unlisted = [full_rows and window is None and (bool(o) or d) for o, d in zip(host[2], dense)]
    width = max([config.max_budget] + [c for c, u in zip(counts, unlisted) if not u])  # the ceiling if all fit it
    order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices[:, :width]  # chosen first, in order
    order = torch.nn.functional.pad(order, (0, width - order.shape[1]))
    indices = torch.where(torch.arange(width, device=device)[None, :] < counts_t[:, None], order, 0)
    fallback = [bool(f) and not d for f, d in zip(host[2], dense)]
    return Selection(
        indices.to(torch.int32).contiguous(),
        counts_t.to(torch.int32),
        counts,
        recovery=host[1],
        fallback=fallback,
        full_rows=any(u and c > config.max_budget for u, c in zip(unlisted, counts)),
    )


def _candidates(draft_scores, target_scores, has_history, config, lengths, window):
    """Each position's estimated mass ``(B, span)``, and which positions are candidates (inside the row and its
    window) and which are forced (the window's sinks, the recent ones)."""
    batch, span = draft_scores.shape
    positions = torch.arange(span, device=draft_scores.device)[None, :]
    windows = per_row(window, batch)
    low = (
        torch.zeros_like(lengths)
        if windows is None
        else (lengths - device_tensor(windows, lengths.device) + 1).clamp_min(0)
    )
    outside = positions < low[:, None]  # before the window: no query of the step can see it
    if window is not None:
        draft_scores = draft_scores.float().masked_fill(outside, 0.0)
        target_scores = None if target_scores is None else target_scores.float().masked_fill(outside, 0.0)
    mass = estimated_mass(draft_scores, target_scores, has_history, lengths)  # (B, span)
    inside = ~outside & (positions < lengths[:, None])
    forced = inside & (
        (positions < low[:, None] + config.sink_tokens) | (positions >= lengths[:, None] - config.recent_tokens)
    )
    return mass, inside, forced


def _ranked(mass, inside, forced, config, lengths, counts):
    """Each position's rank by mass among the unforced candidates (``depth``: unranked), how many ranked entries
    each row takes, which rows the ceiling cannot serve (read in full), and the estimate reached per entry taken."""
    target, floor, ceiling = config.min_recovery, config.budget, config.max_budget
    batch, span = mass.shape
    device = mass.device
    n_forced = forced.sum(dim=1)  # (B,)
    others = mass.masked_fill(forced | ~inside, -1.0)
    depth = min(span, ceiling)
    top = others.topk(depth, dim=1)  # by estimated mass, largest first
    forced_mass = (mass * forced).sum(dim=1, keepdim=True)
    reached = forced_mass + top.values.clamp_min(0).cumsum(dim=1)  # (B, depth)
    # entries needed past the forced positions: none where they reach the target alone, else up to the first count
    # whose estimate reaches it (never below the floor, above the ceiling)
    needed = torch.where(forced_mass[:, 0] >= target, 0, (reached < target).sum(dim=1) + 1)
    room = torch.minimum(ceiling - n_forced, inside.sum(dim=1) - n_forced).clamp_min(0)  # candidates it may add
    out_of_reach = (needed > room) | (target >= 1.0)  # the ceiling (or the context) falls short: read everything
    take = torch.minimum(needed, room).clamp_min(floor - n_forced)  # top entries to add
    if counts is not None:  # replayed sizes: the same order, the given count
        given = device_tensor(counts, device)
        out_of_reach = given >= lengths
        take = (torch.minimum(given, lengths) - n_forced).clamp(0, depth)  # the ranked entries there are
    rank = torch.full_like(others, depth, dtype=torch.long).scatter_(
        1, top.indices, torch.arange(depth, device=device).expand(batch, depth)
    )  # each position's place in `top`
    return rank, take, out_of_reach, reached
