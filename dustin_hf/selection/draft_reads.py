"""What the draft reads on a sparse step with ``DustinConfig.sparse_draft``, chosen per row.

A row whose last verification read a selection (``budget`` positions) drafts against that selection plus every
position written since (the tokens committed after it and this step's drafts), its count growing with every
draft forward. A row whose last verification read everything (its context within the budget or below
``min_context``) drafts against everything. Each row's reads depend only on that row, never on its batch-mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ResolvedConfig
from ..runtime.plan import device_tensor
from .fill import Selection

__all__ = ["DraftReads"]


@dataclass(frozen=True)
class DraftReads:
    """The draft's read sets for one step, from ``(selection, seqlens)`` of the last sparse verification.

    ``indices`` is ``(B, W)``: for a sparse row the last selection (its ``S`` columns: the budget, or the quality
    knob's ceiling), then ``L' .. L' + extra - 1`` where ``L'`` is the row's cached length at that verification.
    A dense row reads all it holds through its count (:attr:`~dustin_hf.selection.fill.Selection.full_rows`); its
    index row is filler, never read. After the verification a row committed ``k <= γ+1`` tokens and the draft
    writes up to γ more, so at most ``extra = 2γ`` positions are new (more in exact mode: :meth:`extra_for`);
    ``W`` is ``S + extra`` (``S`` widened to a sparse row's longer selection, which is rare).
    """

    indices: torch.Tensor
    base: list[int]  # L' per row
    counts: list[int]  # entries of the last selection per row (sparse rows)
    dense: list[bool]  # rows that read everything
    extra_slots: int  # extra_for(config, γ)

    @staticmethod
    def extra_for(config: ResolvedConfig | None, gamma: int) -> int:
        """Positions a row may write after its last selection before its next draft forward: ``2γ``. In exact mode a
        confirming row keeps its read set below its confirmed start, then rewrites up to ``confirm_tokens + γ``
        tentative positions and commits ``γ + 1`` more before drafting γ: ``confirm_tokens + 3γ + 1``."""
        if config is not None and config.mode == "exact":
            return config.confirm_tokens + 3 * gamma + 1
        return 2 * gamma

    @classmethod
    def after(cls, last, config: ResolvedConfig, gamma: int, capacity: int) -> "DraftReads | None":
        """From ``(selection, seqlens)`` of the last verification (``None``: no sparse step yet, the draft reads
        everything). Entries past a row's count stay inside the ``capacity`` slots of the cache."""
        if last is None:
            return None
        selection, seqlens = last
        extra = cls.extra_for(config, gamma)
        dense = [c >= n for c, n in zip(selection.counts, seqlens)]  # read in full (count = the row's length)
        if all(dense):
            return None
        # the budget or the knob's ceiling, or more where a sparse row's selection has more (a sliding window's
        # rows, a replayed count): such a width runs without a CUDA graph
        columns = max([config.budget, config.max_budget] + [c for c, d in zip(selection.counts, dense) if not d])
        width = columns + extra
        device = selection.indices.device
        picked = selection.indices[:, : min(width, selection.indices.shape[1])]
        picked = torch.nn.functional.pad(picked, (0, width - picked.shape[1]))
        # a sparse row's count c entries, then the positions written since: L' .. L' + extra - 1 (in the cache)
        column = torch.arange(width, device=device, dtype=torch.int32)[None, :]
        count = device_tensor(selection.counts, device, torch.int32)[:, None]
        since = (device_tensor(seqlens, device, torch.int32)[:, None] + column - count).clamp_max(capacity - 1)
        sparse_part = torch.where(column < count, picked, since)
        return cls(sparse_part.contiguous(), list(seqlens), list(selection.counts), dense, extra)

    @property
    def full_rows(self) -> bool:
        """Whether some row reads in full through its count: the forwards' :attr:`Selection.full_rows`."""
        return any(self.dense)

    def at(self, cached: list[int]) -> Selection:
        """The read set of a draft forward whose rows hold ``cached`` positions."""
        counts = [
            n if d else c + min(max(n - base, 0), self.extra_slots)
            for c, n, base, d in zip(self.counts, cached, self.base, self.dense)
        ]
        return Selection(
            self.indices, device_tensor(counts, self.indices.device, torch.int32), counts, full_rows=self.full_rows
        )

    def ahead(self, beyond: torch.Tensor) -> torch.Tensor:
        """:meth:`at`'s per-row counts for rows holding ``base + beyond`` positions, ``beyond`` a device tensor."""
        device = beyond.device
        sparse = device_tensor(self.counts, device, torch.int32) + beyond.clamp(0, self.extra_slots).to(torch.int32)
        if not any(self.dense):
            return sparse
        whole = device_tensor(self.base, device, torch.int32) + beyond.to(torch.int32)
        return torch.where(device_tensor(self.dense, device), whole, sparse)
