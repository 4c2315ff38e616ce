"""Step 2 of a Dustin step: the read-set policy a config asks for, and the decode loop's front to it.

A read-set policy turns a :class:`~dustin_hf.selection.request.ReadRequest` into each row's read set before the
verification forward (:meth:`ReadPolicy.select`). The registry :data:`POLICIES` lists them, asked in order; the
first whose ``applies(config)`` holds serves the run:

- :class:`~dustin_hf.selection.knob.RecoveryKnob` (``min_recovery``): the smallest set reaching an estimated
  recovery;
- :class:`~dustin_hf.selection.dustin_set.DustinSet` (the default): the paper's fixed budget, filled by the draft's
  lookahead and the target's history.

``selection="verify"`` adds the selection layers (:mod:`dustin_hf.selection.layers`), which choose again inside
the forward from the set chosen here. A new policy is one file with ``applies``, ``select``, ``config`` and
``graph_report``, and one line in :data:`POLICIES`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import ResolvedConfig
from ..kernels.tuning import KernelTuning
from .dustin_set import DustinSet
from .fill import Selection
from .history import History
from .knob import RecoveryKnob
from .request import ReadRequest, Scorer, row_windows

__all__ = ["POLICIES", "ReadPolicy", "Selector", "read_policy"]


class ReadPolicy(Protocol):
    """What a read-set policy offers; made as ``Policy(scorer, graphs)``."""

    config: ResolvedConfig

    @staticmethod
    def applies(config: ResolvedConfig) -> bool:
        """Whether the policy serves ``config``."""

    def select(self, request: ReadRequest) -> Selection:
        """Each row's read set of the step's verification."""

    @property
    def graph_report(self) -> dict:
        """``{"captured": int, "failed": [str]}``: the CUDA graphs the policy captured, and why any failed."""


POLICIES: tuple[type, ...] = (RecoveryKnob, DustinSet)  # asked in order: the default last


def read_policy(scorer: Scorer, graphs: bool) -> ReadPolicy:
    """The first policy of :data:`POLICIES` that applies to ``scorer.config``; ``graphs``: it may capture CUDA
    graphs (needs the target's graph pools)."""
    policy = next(p for p in POLICIES if p.applies(scorer.config))
    return policy(scorer, graphs)


class Selector:
    """The decode loop's front to its read-set policy; kept with a workspace across decode runs (the policy owns
    the steady step's graph; the per-run hooks, ``budgets`` and ``window_slots``, are set by each run).

    Args:
        config: the resolved Dustin settings (scoring layers and heads, budget, windows, the policy).
        backend: the attention backend; ``"triton"`` scores and selects with the Triton kernels.
        t_group, d_group: query heads per key head of the target and the draft.
        t_scale, d_scale: their attention scales.
        graphs: capture the steady step (needs the target's graph pools).
        window: the sliding window every target layer has (Mistral-style models), else ``None``: the read set is
            chosen inside it (:func:`~dustin_hf.selection.fill.select_positions`).
        window_slots: ``(B, capacity)`` int64 on the CPU, what the window counts in rows with masked input slots
            (:func:`dustin_hf.decode.masks.stock_slots`), else ``None`` (the cache positions).
        budgets: the quality knob's replayed counts (:attr:`~dustin_hf.decode.hooks.DecodeHooks.budgets`).
        tuning: the kernels' launch heuristics (scoring and selection take theirs).
    """

    def __init__(
        self,
        config: ResolvedConfig,
        backend: str,
        t_group: int,
        d_group: int,
        t_scale: float,
        d_scale: float,
        graphs: bool,
        window: int | None = None,
        budgets=None,
        tuning: KernelTuning | None = None,
        window_slots: torch.Tensor | None = None,
    ):
        scorer = Scorer(config, backend, t_group, d_group, t_scale, d_scale, tuning or KernelTuning())
        self.policy = read_policy(scorer, graphs)
        self.window, self.budgets, self.window_slots = window, budgets, window_slots

    @property
    def config(self) -> ResolvedConfig:
        return self.policy.config

    def select(
        self,
        target,
        draft,
        seqlens: list[int],
        base: torch.Tensor,
        kept_queries: dict,
        gamma: int,
        row_gamma: list[int] | None = None,
        *,
        history: History,
    ) -> Selection:
        """The read sets of a step at ``seqlens`` (``base``: the same on the device) from the draft's kept
        queries (``{layer: [(B, heads, D)] * γ}``) and the target's ``history``; ``row_gamma``: the drafts each
        row proposed, when some row proposed fewer than γ (it scores with its own queries only)."""
        window = self._row_windows(seqlens)
        return self.policy.select(
            ReadRequest(target, draft, seqlens, base, kept_queries, gamma, row_gamma, history, window, self.budgets)
        )

    def _row_windows(self, seqlens: list[int]) -> int | list[int] | None:
        return row_windows(self.window, self.window_slots, seqlens)

    @property
    def graph_report(self) -> dict:
        return self.policy.graph_report
