"""What the draft reads on a sparse step with ``DustinConfig.sparse_draft``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ResolvedConfig
from .plan import device_tensor
from .selection import Selection

__all__ = ["DraftReads"]


@dataclass(frozen=True)
class DraftReads:
    """What the draft reads on a sparse step with ``DustinConfig.sparse_draft``: the positions the last
    sparse verification read, plus every position written since (the tokens committed after it and
    this step's drafts), each row's count growing with every draft forward.

    ``indices`` is ``(B, budget + extra(γ))``: the last selection, then ``L' .. L' + extra - 1`` where
    ``L'`` is each row's cached length at that verification. After it, a row committed ``k <= γ+1``
    tokens and the draft wrote up to γ more, so at most ``2γ`` positions are new.
    """

    indices: torch.Tensor
    base: list[int]  # L' per row
    counts: list[int]  # entries of the last selection per row

    @staticmethod
    def extra(gamma: int) -> int:
        return 2 * gamma

    @classmethod
    def after(cls, last, config: ResolvedConfig, gamma: int, capacity: int) -> "DraftReads | None":
        """From ``(selection, seqlens)`` of the last verification, if it read ``budget`` positions in every
        row (rows read in full, or no sparse step yet: the draft reads everything too). Entries past a
        row's count stay inside the ``capacity`` slots of the cache."""
        if last is None:
            return None
        selection, seqlens = last
        if selection.indices.shape[1] != config.budget or any(n != config.budget for n in selection.counts):
            return None
        since = [[min(n + i, capacity - 1) for i in range(cls.extra(gamma))] for n in seqlens]  # host: one copy
        since = device_tensor(since, selection.indices.device, torch.int32)
        return cls(torch.cat([selection.indices, since], dim=1), list(seqlens), list(selection.counts))

    def at(self, cached: list[int]) -> Selection:
        """The read set of a draft forward whose rows hold ``cached`` positions."""
        extra = self._extra
        counts = [c + min(max(n - base, 0), extra) for c, n, base in zip(self.counts, cached, self.base)]
        return Selection(self.indices, device_tensor(counts, self.indices.device, torch.int32), counts)

    def ahead(self, beyond: torch.Tensor) -> torch.Tensor:
        """:meth:`at`'s per-row counts for rows holding ``base + beyond`` positions, ``beyond`` a device tensor."""
        return device_tensor(self.counts, beyond.device, torch.int32) + beyond.clamp(0, self._extra).to(torch.int32)

    @property
    def _extra(self) -> int:
        """Positions past the last selection a row may read (written since it)."""
        return self.indices.shape[1] - self.counts[0]
