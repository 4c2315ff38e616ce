"""Logits processing and the acceptance rule, per row of a ragged batch.

Greedy: the target's argmax at each verified position; the drafts are kept up to the first
disagreement, then the target's own token follows (so greedy speculative decoding returns exactly
the target's greedy output).

Sampling (Leviathan et al. 2023, algorithm 1), per row: with ``p`` the target's and ``q`` the
draft's processed distributions, draft token ``x_i`` (drawn from ``q_i``) is kept with probability
``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the replacement is drawn from the residual
``norm(max(0, p_i - q_i))``; if all γ are kept, a bonus token is drawn from ``p_{γ+1}``. The result
is an exact sample of the target's distribution (with a full verification budget).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation import logits_process as lp

__all__ = ["LogitsPipeline", "accept_greedy", "accept_sampled", "pick_tokens"]

# Processors whose output depends only on the scores, never on the token history: they can run on
# all rows and positions of a ragged batch at once.
_HISTORY_FREE = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.InfNanRemoveLogitsProcessor,
    lp.LogitNormalization,
    lp.SuppressTokensLogitsProcessor,
)


class LogitsPipeline:
    """transformers' logits processors applied to ``(B, n, V)`` logits of a ragged batch.

    History-free processors (temperature, top-k/p, ...) run once on all rows and positions. Any
    other processor (repetition penalty, min length, n-gram bans, ...) sees the exact token history
    of each row and position, as if that row were decoded alone: one call per row and position.
    """

    def __init__(self, processors: lp.LogitsProcessorList | None):
        self.processors = processors if processors is not None else lp.LogitsProcessorList()
        self.history_free = all(isinstance(p, _HISTORY_FREE) for p in self.processors)

    def __call__(self, logits: torch.Tensor, history: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """``logits (B, n, V)`` float32; ``history(b, i)`` is row b's ``(1, len)`` token ids before position i."""
        if not self.processors:
            return logits
        batch, n, vocab = logits.shape
        if self.history_free:
            dummy = torch.zeros(batch * n, 1, dtype=torch.long, device=logits.device)
            return self.processors(dummy, logits.reshape(batch * n, vocab)).reshape(batch, n, vocab)
        out = torch.empty_like(logits)
        for b in range(batch):
            for i in range(n):
                out[b, i] = self.processors(history(b, i), logits[b, i][None])[0]
        return out


def pick_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """One token per row from processed ``scores (B, V)``: argmax, or a draw from ``softmax(scores)``."""
    if not do_sample:
        return scores.argmax(dim=-1)
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)


def accept_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        draft_tokens: ``(B, γ)`` proposed tokens.
        target_tokens: ``(B, γ+1)`` the target's argmax of its processed scores at each verified
            position; position i predicts the token after the i-th verified input (position 0: after
            the last committed token).

    Returns:
        ``n_accepted (B,)``: leading drafts equal to the target's tokens; ``next_token (B,)``: the
        target's token right after them (the correction, or the bonus if all γ were kept).
    """
    agree = (draft_tokens == target_tokens[:, :-1]).long()
    n_accepted = agree.cumprod(dim=1).sum(dim=1)  # length of the agreeing prefix
    next_token = target_tokens.gather(1, n_accepted[:, None]).squeeze(1)
    return n_accepted, next_token


def accept_sampled(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling, each row independently (same outputs as :func:`accept_greedy`).

    Args:
        draft_tokens: ``(B, γ)`` drawn from ``draft_probs``.
        draft_probs: ``(B, γ, Vd)`` the draft's processed distributions ``q`` (``Vd <= V``; a draft
            with a smaller, padded vocabulary puts no mass on the target's extra ids).
        target_scores: ``(B, γ+1, V)`` the target's processed scores; ``p = softmax``.
    """
    batch, gamma = draft_tokens.shape
    p = target_scores.softmax(dim=-1)  # (B, γ+1, V)
    q = torch.zeros_like(p[:, :gamma])
    q[..., : draft_probs.shape[-1]] = draft_probs
    p_x = p[:, :gamma].gather(2, draft_tokens[..., None]).squeeze(2)  # p_i(x_i), (B, γ)
    q_x = q.gather(2, draft_tokens[..., None]).squeeze(2)  # q_i(x_i) > 0: x_i was drawn from q_i
    # keep x_i with probability min(1, p/q): u <= p/q  <=>  u * q <= p (no division by a tiny q)
    kept = torch.rand_like(p_x) * q_x <= p_x
    n_accepted = kept.long().cumprod(dim=1).sum(dim=1)  # (B,)

    # The token after the kept prefix: at a rejection, from norm(max(0, p - q)); after all γ, from p_{γ+1}.
    rows = torch.arange(batch, device=p.device)
    p_next = p[rows, n_accepted]  # (B, V)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n_accepted]  # zero when all were kept
    residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual; then the rejection had probability 0 and p itself is the law
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_next)
    next_token = torch.multinomial(residual, num_samples=1).squeeze(1)
    return n_accepted, next_token
