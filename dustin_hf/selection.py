"""Budget fill: which cached positions each sequence's verification reads this step.

Per row, one index set shared by all layers and heads (DESIGN.md section 2):

1. sinks: the first ``sink_tokens`` positions, and the ``recent_tokens`` most recent ones;
2. the top ``draft_share`` positions by the draft's lookahead attention ``S_draft``;
3. the rest of the budget by the target's attention history ``S_target``, among positions not yet
   chosen (rows without a history, e.g. after a rollback past it, fill by ``S_draft`` instead).

A row is read densely (all of ``[0, L)``) when its context fits the budget or is shorter than
``min_context``. Indices come out sorted (sequential reads), as ``(B, W)`` int32 with a per-row
count; ``W`` is the budget, or longer when a dense row needs more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ResolvedConfig

__all__ = ["Selection", "dense_rows", "select_positions"]


@dataclass(frozen=True)
class Selection:
    indices: torch.Tensor  # (B, W) int32, sorted valid entries first
    num_indices: torch.Tensor  # (B,) int32
    counts: list[int]  # num_indices on the host


def dense_rows(seqlens: list[int], config: ResolvedConfig) -> list[bool]:
    """Rows that verification reads in full: context within the budget or below ``min_context``."""
    return [length <= config.budget or length < config.min_context for length in seqlens]


def select_positions(
    seqlens: list[int],
    draft_scores: torch.Tensor,
    target_scores: torch.Tensor | None,
    has_history: list[bool],
    config: ResolvedConfig,
) -> Selection:
    """Choose each row's read set.

    Args:
        seqlens: cached positions ``L_b`` per row (host ints).
        draft_scores: ``(B, max(seqlens))`` float, ``S_draft`` (zero past each row's length).
        target_scores: ``(B, max(seqlens))`` float, ``S_target``; ``None`` if no row has a history.
        has_history: per row, whether ``target_scores`` holds a valid history for it.
        config: the resolved budget, windows and ``draft_share``.
    """
    device = draft_scores.device
    batch, span = draft_scores.shape
    dense = dense_rows(seqlens, config)
    width = max([config.budget] + [n for n, d in zip(seqlens, dense) if d])
    lengths = torch.tensor(seqlens, device=device)
    positions = torch.arange(span, device=device)
    counts = [n if d else config.budget for n, d in zip(seqlens, dense)]

    sink, recent, share = config.sink_tokens, config.recent_tokens, config.draft_share
    fill = config.budget - sink - recent - share
    chosen = [positions[:sink].expand(batch, sink), lengths[:, None] - recent + positions[:recent]]  # (B, s), (B, r)
    parts = list(chosen)
    if not all(dense) and (share or fill):
        in_range = positions[None, :] < lengths[:, None]
        fixed = (positions[None, :] < sink) | (positions[None, :] >= lengths[:, None] - recent)
        free = in_range & ~fixed  # (B, span): candidates for the two top-k fills
        # rows that only exist as padding here (dense rows) may have too few candidates; topk still returns
        # valid-shaped indices, which the dense override below replaces.
        neg_inf = torch.finfo(torch.float32).min
        by_draft = draft_scores.float().masked_fill(~free, neg_inf)
        top_draft = by_draft.topk(min(share, span), dim=1).indices  # (B, m)
        parts.append(top_draft)
        if fill:
            history = target_scores.float() if target_scores is not None else draft_scores.float()
            if target_scores is not None and not all(has_history):
                use_target = torch.tensor(has_history, device=device)[:, None]
                history = torch.where(use_target, history, draft_scores.float())
            by_history = history.masked_fill(~free, neg_inf).scatter(1, top_draft, neg_inf)
            parts.append(by_history.topk(min(fill, span), dim=1).indices)  # (B, budget - s - r - m)
    sparse_idx = torch.cat(parts, dim=1).sort(dim=1).values  # (B, budget) for sparse rows
    if sparse_idx.shape[1] < width:
        sparse_idx = torch.nn.functional.pad(sparse_idx, (0, width - sparse_idx.shape[1]))
    dense_idx = torch.arange(width, device=device).expand(batch, width)
    is_dense = torch.tensor(dense, device=device)[:, None]
    indices = torch.where(is_dense, dense_idx, sparse_idx).to(torch.int32)
    num_indices = torch.tensor(counts, dtype=torch.int32, device=device)
    return Selection(indices=indices, num_indices=num_indices, counts=counts)
