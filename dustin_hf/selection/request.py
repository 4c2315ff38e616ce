"""What a read-set policy is handed at a verification step, and the two signals it scores cached positions with.

A policy (:mod:`dustin_hf.selection.selector`'s registry) turns a :class:`ReadRequest` into each row's read set. The
policies before the forward score positions with the same two signals (:mod:`dustin_hf.selection.scoring`): the
draft's lookahead attention (the queries that produced this step's drafts, on the draft's scoring heads) and the
target's history attention (the query of each row's last committed token, kept in a :class:`History`). The
:class:`Scorer` gathers their inputs from the request (:meth:`Scorer.inputs`) and scores them
(:meth:`Scorer.scores`), the latter a function of device tensors alone, so a policy may capture it in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import ResolvedConfig
from ..kernels.tuning import KernelTuning
from .history import History
from .scoring import draft_lookahead_scores, target_history_scores

__all__ = ["ReadRequest", "ScoreInputs", "Scorer", "row_windows"]


@dataclass(frozen=True)
class ReadRequest:
    """One verification step as the decode loop sees it when it asks a policy for the read sets.

    Args:
        target, draft: the models' runners (``.cache``: ``capacity`` and ``layer_buffers(layer)``; the target's
            ``.graph_pools``).
        seqlens: cached positions ``L_b`` per row (host ints); ``base``: the same, ``(B,)`` on the device.
        kept_queries: the draft's kept queries, ``{layer: [(B, heads, D)] * γ}``.
        gamma: the drafts of the step; ``row_gamma``: each row's, when some row proposed fewer (it scores with its
            own queries only), else ``None``.
        history: the target's history queries.
        window: the sliding window every target layer has, or each row's (:func:`row_windows`); ``None``: none.
        budgets: the quality knob's replayed counts, ``budgets(seqlens) -> list[int]``
            (:attr:`~dustin_hf.decode.hooks.DecodeHooks.budgets`); ``None``: the knob chooses.
    """

    target: Any
    draft: Any
    seqlens: list[int]
    base: torch.Tensor
    kept_queries: dict
    gamma: int
    row_gamma: list[int] | None
    history: History
    window: int | list[int] | None = None
    budgets: Callable[[list[int]], list[int]] | None = None


def row_windows(window: int | None, window_slots: torch.Tensor | None, seqlens: list[int]) -> int | list[int] | None:
    """The window, or with ``window_slots`` (``(B, capacity)`` int64 on the CPU, what the window counts in rows with
    masked input slots: :func:`dustin_hf.decode.masks.stock_slots`) each row's: the cache positions a window of
    stock's indices holds back from the step's first query (at position ``L``), so that ``[L - w + 1, L)`` is what
    it sees."""
    if window is None or window_slots is None:
        return window
    lengths = torch.tensor(seqlens)
    first = window_slots.gather(1, lengths[:, None])  # (B, 1) the first query's index in stock's cache
    outside = (window_slots[:, : max(seqlens)] <= first - window).sum(dim=1)  # indices only grow along a row
    return (lengths - outside + 1).tolist()


@dataclass(frozen=True)
class ScoreInputs:
    """The tensors a step's two signals read, gathered once (:meth:`Scorer.inputs`)."""

    draft_queries: list[torch.Tensor]  # per draft scoring layer, (B, γ, heads, D)
    draft_keys: list[torch.Tensor]  # per draft scoring layer, the draft cache's key buffer
    target_keys: torch.Tensor  # the target's scoring layer's key buffer
    history_queries: torch.Tensor | None  # (B, heads, D); None: no row has a history
    has_history: list[bool]  # per row, whether its history is its last cached position's query
    span: int  # positions scored per row
    query_counts: torch.Tensor | None  # (B,) each row's drafts where some row proposed fewer than γ, else None

    @property
    def devices(self) -> set[torch.device]:
        return {self.target_keys.device, *(k.device for k in self.draft_keys)}


@dataclass(frozen=True)
class Scorer:
    """The two signals of a step (module docstring) on the config's scoring layers and heads.

    Args:
        config: the resolved Dustin settings (scoring layers and heads).
        backend: the attention backend; ``"triton"`` scores with the Triton kernels over the cache capacity.
        t_group, d_group: query heads per key head of the target and the draft.
        t_scale, d_scale: their attention scales.
        tuning: the kernels' launch heuristics.
    """

    config: ResolvedConfig
    backend: str
    t_group: int
    d_group: int
    t_scale: float
    d_scale: float
    tuning: KernelTuning

    @property
    def triton(self) -> bool:
        return self.backend == "triton"

    def inputs(self, request: ReadRequest) -> ScoreInputs:
        cfg, t_cache = self.config, request.target.cache
        has_history = request.history.rows_at(request.seqlens)
        counts = None
        if request.row_gamma is not None and any(g != request.gamma for g in request.row_gamma):
            counts = torch.tensor(request.row_gamma).to(request.base.device, non_blocking=True)
        # every row's L is below capacity - γ - 2 (the loop sizes the caches so), and the draft queries see up
        # to L + γ - 1: the Triton scores span the capacity less γ, a size fixed for the whole generation
        return ScoreInputs(
            [torch.stack(request.kept_queries[layer], dim=1) for layer in cfg.draft_layers],  # (B, γ, h, D)
            [request.draft.cache.layer_buffers(layer)[0] for layer in cfg.draft_layers],
            t_cache.layer_buffers(cfg.target_layer)[0],
            request.history.queries if any(has_history) else None,
            has_history,
            t_cache.capacity - request.gamma if self.triton else max(request.seqlens),
            counts,
        )

    def scores(
        self,
        inputs: ScoreInputs,
        draft_queries: list[torch.Tensor],
        lengths: torch.Tensor,
        history_queries: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(S_draft, S_target)``, each ``(B, span)`` on ``lengths``' device (``S_target`` ``None`` without a
        history); the queries and lengths are passed apart from ``inputs`` so that a graph replays with new ones."""
        cfg, backend = self.config, "triton" if self.triton else "reference"
        s_draft = draft_lookahead_scores(
            draft_queries,
            inputs.draft_keys,
            lengths.to(inputs.draft_keys[0].device),
            cfg.draft_heads,
            self.d_group,
            self.d_scale,
            inputs.span,
            backend=backend,
            query_counts=inputs.query_counts,
            tuning=self.tuning.score,
        ).to(lengths.device)
        if history_queries is None:
            return s_draft, None
        keys = inputs.target_keys
        s_target = target_history_scores(
            history_queries.to(keys.device),
            keys,
            lengths.to(keys.device),
            cfg.target_heads,
            self.t_group,
            self.t_scale,
            inputs.span,
            backend=backend,
            tuning=self.tuning.score,
        ).to(lengths.device)
        return s_draft, s_target
