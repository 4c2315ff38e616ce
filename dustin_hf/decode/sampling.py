"""The acceptance rule of speculative decoding, per row of a ragged batch, and the draws it makes.

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

import torch

from ..runtime.plan import device_tensor

__all__ = ["RowGenerators", "accept_greedy", "accept_sampled", "pick_tokens"]


class RowGenerators:
    """Random draws per row from a counter-based generator, seeded from the global one at the start of a run.

    Draw ``j`` of row ``b`` is a hash of ``(seed_b, j)``: a row's draws depend on its own seed and on how many
    draws it made before, never on its batch-mates (how many rows there are, how many draws they made), and a
    whole batch draws in one vectorized operation. The hash is Wellons' ``lowbias32`` on 32-bit lanes (two
    rounds, keyed by the seed); a uniform takes its 24 high bits, so probabilities below ``2**-24`` are never
    sampled (as for ``torch.multinomial`` in float32). Seeds come from ``torch.randint`` on the global
    generator, so ``torch.manual_seed`` makes a run reproducible.
    """

    def __init__(self, batch: int, device: torch.device):
        self.seeds = torch.randint(0, 2**32, (batch,), dtype=torch.int64).to(device)
        self.counters = torch.zeros(batch, dtype=torch.int64, device=device)

    def uniform(self, counts: list[int] | torch.Tensor, width: int) -> torch.Tensor:
        """``(B, width)`` floats in ``[0, 1)``; row ``b`` consumes its first ``counts[b]`` draws (the rest are
        drawn again by its next call)."""
        index = self.counters[:, None] + torch.arange(width, device=self.counters.device)  # (B, width)
        bits = _hash32(_hash32(index & 0xFFFFFFFF ^ self.seeds[:, None]) ^ (index >> 32) ^ self.seeds[:, None])
        if not isinstance(counts, torch.Tensor):
            counts = device_tensor(counts, self.counters.device)
        self.counters += counts.to(torch.int64)
        return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))

    def categorical(self, probs: torch.Tensor, rows: list[bool] | None = None) -> torch.Tensor:
        """One draw per row from ``probs (B, V)`` (non-negative, each row summing to more than 0), by inverse
        CDF; rows not in ``rows`` draw nothing and take their argmax instead."""
        counts = [1] * probs.shape[0] if rows is None else [int(r) for r in rows]
        u = self.uniform(counts, 1)  # (B, 1)
        cdf = probs.float().cumsum(dim=-1)
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)
        if rows is None:
            return picked
        return torch.where(device_tensor(rows, probs.device), picked, probs.argmax(dim=-1))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 integer hash of the low 32 bits of ``x`` (int64 lanes; products wrap mod 2**64 and
    are masked back to 32 bits)."""
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def pick_tokens(scores: torch.Tensor, rng: RowGenerators | None, rows: list[bool] | None = None) -> torch.Tensor:
    """One token per row from processed ``scores (B, V)``: the argmax (``rng`` None), or a draw from
    ``softmax(scores)`` with each row's own generator (only for ``rows``; the others take the argmax)."""
    if rng is None:
        return scores.argmax(dim=-1)
    return rng.categorical(scores.softmax(dim=-1), rows)


def _within(gammas: list[int] | None, batch: int, width: int, device) -> torch.Tensor | None:
    """``(B, width)`` bool: position ``i`` of row ``b`` is one of its own ``gammas[b]`` drafts (``None``: all are)."""
    if gammas is None or all(g == width for g in gammas):
        return None
    return torch.arange(width, device=device)[None, :] < device_tensor(gammas, device)[:, None]


def accept_greedy(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, gammas: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        draft_tokens: ``(B, γ)`` proposed tokens.
        target_tokens: ``(B, γ+1)`` the target's argmax of its processed scores at each verified
            position; position i predicts the token after the i-th verified input (position 0: after
            the last committed token).
        gammas: the drafts each row proposed (``<= γ``; a row that stopped drafting early ignores the
            positions after its own); ``None``: every row proposed γ.

    Returns:
        ``n_accepted (B,)``: leading drafts equal to the target's tokens; ``next_token (B,)``: the
        target's token right after them (the correction, or the bonus if all γ were kept).
    """
    agree = draft_tokens == target_tokens[:, :-1]
    within = _within(gammas, *draft_tokens.shape, draft_tokens.device)
    if within is not None:
        agree = agree & within
    agree = agree.long()
    n_accepted = agree.cumprod(dim=1).sum(dim=1)  # length of the agreeing prefix
    next_token = target_tokens.gather(1, n_accepted[:, None]).squeeze(1)
    return n_accepted, next_token


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_scores: torch.Tensor,
    rng: RowGenerators,
    gammas: list[int] | None = None,
    rows: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling, each row independently (same outputs as :func:`accept_greedy`).

    Args:
        draft_tokens: ``(B, γ)`` drawn from ``draft_probs``.
        draft_probs: ``(B, γ, Vd)`` the draft's processed distributions ``q`` (``Vd <= V``; a draft
            with a smaller, padded vocabulary puts no mass on the target's extra ids).
        target_scores: ``(B, γ+1, V)`` the target's processed scores; ``p = softmax``.
        rng: each row's generator.
        gammas: the drafts each row proposed (as in :func:`accept_greedy`); a row's positions past its own
            drafts are never kept, and after all of its own were kept it draws its bonus from p.
        rows: the rows that draw (unfinished ones); the others draw nothing and get a token of no consequence.
    """
    batch, gamma = draft_tokens.shape
    p = target_scores.softmax(dim=-1)  # (B, γ+1, V)
    q = torch.zeros_like(p[:, :gamma])
    q[..., : draft_probs.shape[-1]] = draft_probs
    within = _within(gammas, batch, gamma, p.device)
    if within is not None:
        q = q * within[..., None]  # past a row's own drafts q is nothing: the token there is p's own
    p_x = p[:, :gamma].gather(2, draft_tokens[..., None]).squeeze(2)  # p_i(x_i), (B, γ)
    q_x = q.gather(2, draft_tokens[..., None]).squeeze(2)  # q_i(x_i) > 0: x_i was drawn from q_i
    # keep x_i with probability min(1, p/q): u <= p/q  <=>  u * q <= p (no division by a tiny q)
    own = [gamma] * batch if gammas is None else gammas
    kept = rng.uniform([g if rows is None or rows[b] else 0 for b, g in enumerate(own)], gamma) * q_x <= p_x
    if within is not None:
        kept = kept & within
    n_accepted = kept.long().cumprod(dim=1).sum(dim=1)  # (B,)

    # The token after the kept prefix: at a rejection, from norm(max(0, p - q)); after all γ, from p_{γ+1}.
    index = torch.arange(batch, device=p.device)
    p_next = p[index, n_accepted]  # (B, V)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[index, n_accepted]  # zero when all were kept
    residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual; then the rejection had probability 0 and p itself is the law
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_next)
    next_token = rng.categorical(residual, rows)
    return n_accepted, next_token
