"""The history signal's state: each row's query of its last committed token on the target's scoring heads.

Dustin's set scores cached positions with two signals; the history signal is the attention of the query that the
target computed for each row's last committed token at the previous verification (kept from that forward, never
recomputed). The sparse verifier keeps it for its run and hands it to the read-set policy; the KV cache holds keys
and values only.
"""

from __future__ import annotations

import torch

__all__ = ["History"]


class History:
    """Per row: the scoring heads' query of the last committed token and its position (-1: none)."""

    def __init__(self, batch: int):
        self.queries: torch.Tensor | None = None  # (B, heads, D)
        self.positions: list[int] = [-1] * batch

    def keep(self, queries: torch.Tensor, positions: list[int]) -> None:
        """``queries (B, heads, D)``: each row's query at ``positions[b]``."""
        self.queries, self.positions = queries, list(positions)

    def rows_at(self, seqlens: list[int]) -> list[bool]:
        """Which rows hold the query of their last cached position (``seqlens[b] - 1``), what the score needs."""
        return [p == n - 1 for p, n in zip(self.positions, seqlens)]
