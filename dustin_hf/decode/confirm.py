"""Exact mode's per-row bookkeeping: when a row confirms its tentative tokens, and what it keeps meanwhile.

Exact mode (``DustinConfig(mode="exact")``) verifies in three levels: the draft q proposes, the sparse target
p~ (the target reading Dustin's selection) accepts *tentatively*, the dense target p confirms. A row's
tentative tokens are exact samples (or greedy tokens) of p~; a dense verification whose queries are the row's
last committed token, its tentative tokens and the step's new drafts checks them as one speculative block with
p~ as their proposal (then the drafts with q as theirs): greedy keeps the longest prefix the dense argmax
agrees with; sampling keeps each with probability ``min(1, p / p~)`` and redraws a rejection from
``norm(max(0, p - p~))``. So what is committed is exactly the target's greedy output, or exactly distributed
as the target's samples, at any budget.

:class:`ConfirmSchedule` decides, per row and step, whether the row confirms now: once it holds
``limit[b]`` tentative tokens, once ``confirm_every`` sparse steps passed since its last confirmation, or when it
would stop within its tentative tokens (EOS, length, a stopping criterion: only confirmed tokens end a row).
The limit adapts per row: after a confirmation that rejected some tentative tokens it drops to the number it
kept (a row whose sparse steps keep being wrong confirms sooner; at 0 it verifies densely every step, as the
lossless sparse-draft baseline does, and probes one tentative token again after ``confirm_every`` dense steps);
after one that kept them all it doubles, up to ``confirm_tokens``. When one row confirms, every row holding
tentative tokens confirms in the same forward, and in a greedy batch every other row verifies densely in it too:
the step reads densely anyway (one dense kernel for the batch), rows that confirm together keep their sparse steps
in phase, and a greedy row's tokens do not depend on when it confirms (confirmation is exact whenever it happens).
Confirming each greedy row on its own schedule costs more steps, each paying the step's fixed cost, than it saves
in rows read in full. Greedy rows never drop below a limit of 1
(``min_limit``), so sparse steps stay sparse for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.plan import device_tensor

__all__ = ["ConfirmSchedule", "ExactStats", "block_proposals", "blocks"]


@dataclass
class ExactStats:
    """What exact mode did (``stats["exact"]``)."""

    confirmations: int = 0  # rows confirmed (a confirm step confirms one or more rows)
    confirm_steps: int = 0  # verification forwards that confirmed at least one row
    tentative_confirmed: int = 0  # tentative tokens the dense check kept
    tentative_rejected: int = 0  # tentative tokens it dropped (the first disagreement and all after it)
    committed_by_confirmations: int = 0  # tokens committed by confirm steps (confirmed + drafts + the target's own)
    dense_rows: int = 0  # row-steps verified densely without tentative tokens (short contexts, limit 0)
    sparse_rows: int = 0  # row-steps verified sparsely (tentative)

    def as_dict(self) -> dict:
        checked = self.tentative_confirmed + self.tentative_rejected
        return {
            "confirmations": self.confirmations,
            "confirm_steps": self.confirm_steps,
            "tentative_confirmed": self.tentative_confirmed,
            "tentative_rejected": self.tentative_rejected,
            "confirmed_fraction": self.tentative_confirmed / checked if checked else 1.0,
            "tokens_per_confirmation": self.committed_by_confirmations / self.confirmations
            if self.confirmations
            else 0.0,
            "dense_row_steps": self.dense_rows,
            "sparse_row_steps": self.sparse_rows,
        }


@dataclass
class ConfirmSchedule:
    """Per-row confirmation state of one exact-mode run.

    Args:
        batch: rows.
        confirm_tokens: the most tentative tokens a row holds before it confirms (0: every verification dense).
        confirm_every: sparse steps after which a row confirms at the latest (and dense steps after which a row
            at limit 0 tries one tentative token again).
        min_limit: the lowest a row's limit drops after a rejection (greedy batches: 1, so that no row verifies
            densely alone: its dense reads would make the batch's sparse steps mixed, and one tentative token and
            the batch's next confirmation cost less).
    """

    batch: int
    confirm_tokens: int
    confirm_every: int
    min_limit: int = 0
    limit: list[int] = field(init=False)
    since: list[int] = field(init=False)  # sparse steps since the row's last confirmation (dense steps at limit 0)
    must: list[bool] = field(init=False)  # the row would stop within its tentative tokens: confirm next step
    proposals: list[list[torch.Tensor]] = field(init=False)  # sampling: p~ of each tentative token, (V,) each
    stats: ExactStats = field(default_factory=ExactStats)

    def __post_init__(self):
        self.limit = [self.confirm_tokens] * self.batch
        self.since = [0] * self.batch
        self.must = [False] * self.batch
        self.proposals = [[] for _ in range(self.batch)]

    def dense(self, b: int) -> bool:
        """Row ``b`` verifies densely this step without tentative tokens (its limit is 0)."""
        return self.limit[b] == 0

    def wants(self, b: int, tentative: int) -> bool:
        """Whether row ``b``, holding ``tentative`` tokens, asks for a confirmation this step."""
        return tentative > 0 and (self.must[b] or tentative >= self.limit[b] or self.since[b] >= self.confirm_every)

    def after_sparse(self, b: int, would_stop: bool) -> None:
        self.since[b] += 1
        self.must[b] = would_stop
        self.stats.sparse_rows += 1

    def after_dense(self, b: int) -> None:
        """A step verified row ``b`` densely without tentative tokens; at limit 0 it probes again after a while."""
        self.stats.dense_rows += 1
        if self.limit[b] == 0 and self.confirm_tokens > 0:
            self.since[b] += 1
            if self.since[b] >= self.confirm_every:
                self.limit[b], self.since[b] = 1, 0

    def after_confirm(self, b: int, tentative: int, kept: int, committed: int) -> None:
        """Row ``b`` confirmed ``kept`` of its ``tentative`` tokens and committed ``committed`` tokens in all."""
        stats = self.stats
        stats.confirmations += 1
        stats.tentative_confirmed += kept
        stats.tentative_rejected += tentative - kept
        stats.committed_by_confirmations += committed
        floor = min(self.min_limit, self.confirm_tokens)
        # a partial rejection drops the limit to what was kept, never above confirm_tokens: a row holding more than
        # confirm_tokens + γ tentative tokens would not fit a confirming step's block
        grown = max(1, 2 * self.limit[b]) if kept == tentative else max(kept, floor)
        self.limit[b] = min(self.confirm_tokens, grown)
        self.since[b], self.must[b] = 0, False
        self.proposals[b] = []


def blocks(
    tokens: torch.Tensor, starts: list[int], tentative: list[int], drafts: torch.Tensor, width: int
) -> torch.Tensor:
    """``(B, width)`` verification inputs of exact mode: row ``b``'s token at ``starts[b]`` and the
    ``tentative[b]`` after it, then its drafts, cut or padded (with its last input) to ``width``.

    Two gathers for the batch rather than a few ops per row: every step builds these on the host's critical path."""
    device, gamma = tokens.device, drafts.shape[1]
    start = device_tensor(starts, device)[:, None]
    n = device_tensor(tentative, device)[:, None]
    j = torch.arange(width, device=device)[None, :]
    out = tokens.gather(1, start + torch.minimum(j, n))  # x and the tentative tokens (the last one again past them)
    if gamma:  # then the drafts, the last one again past them
        out = torch.where(j <= n, out, drafts.gather(1, (j - n - 1).clamp(0, gamma - 1)))
    return out


def block_proposals(
    draft_probs: torch.Tensor, tentative_probs: list[list[torch.Tensor]], tentative: list[int], vocab: int, width: int
) -> torch.Tensor:
    """``(B, width, V)`` proposal distributions of exact mode's blocks: p~ of each tentative token a confirming
    row holds, then the draft's q (zero past the draft's vocabulary and past a row's block)."""
    batch, gamma, draft_vocab = draft_probs.shape
    out = draft_probs.new_zeros(batch, width, vocab)
    for b, n in enumerate(tentative):
        if n:
            out[b, :n] = torch.stack(tentative_probs[b][:n])
        take = min(gamma, width - n)
        out[b, n : n + take, :draft_vocab] = draft_probs[b, :take]
    return out
