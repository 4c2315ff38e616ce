"""Attention recovery: how much of the target's attention a selected set of positions captures.

For one verification step at ``L`` cached positions, every (layer, head, query) of the target has an
attention distribution over the cached positions ``[0, L)`` (the step's own new tokens are always
attended, so they do not count). Renormalised over ``[0, L)``, it is simply the softmax of that
query's logits over the cached keys. The share a set ``S`` captures is ``sum_{p in S} w[p]``;
averaged over heads and queries, one per-position weight vector per layer ``W_l`` holds everything:

    recovery_l(S) = sum_{p in S} W_l[p],    recovery(S) = mean_l recovery_l(S)

so recovery is linear in the selection, which makes calibration cheap (one gather per candidate).
"""

from __future__ import annotations

import torch

__all__ = ["head_probabilities", "position_weights", "selection_recovery"]


def head_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor, num_positions: int, softmax_scale: float
) -> torch.Tensor:
    """Per head, the attention probabilities of ``queries`` summed over queries, on ``[0, num_positions)``.

    Args:
        queries: ``(Q, H, D)`` post-RoPE queries of one layer (all H query heads).
        keys: ``(T, Hkv, D)`` the layer's cached keys, ``T > max(query_pos)``.
        query_pos: ``(Q,)`` int; query j sees keys ``<= query_pos[j]`` (its softmax runs over those).
        num_positions: leading positions to return.

    Returns:
        ``(H, num_positions)`` float32. Summed over a subset of heads this is what
        :func:`dustin_hf.selection.scoring.attention_mass` computes for those heads (up to float rounding).
    """
    n_q, n_heads, _ = queries.shape
    span = int(query_pos.max()) + 1
    keys = keys[:span].float().transpose(0, 1)  # (Hkv, span, D)
    group = n_heads // keys.shape[0]
    q = (
        queries.float().transpose(0, 1).reshape(keys.shape[0], group * n_q, -1)
    )  # (Hkv, G*Q, D): heads of a group together
    logits = torch.matmul(q, keys.transpose(1, 2)).mul_(softmax_scale).view(n_heads, n_q, span)  # (H, Q, span)
    hidden = torch.arange(span, device=keys.device)[None, :] > query_pos.to(keys.device)[:, None]  # (Q, span)
    probs = logits.masked_fill_(hidden[None], float("-inf")).softmax(dim=-1)
    return probs[..., :num_positions].sum(dim=1)  # (H, num_positions)


def position_weights(
    queries: dict[int, torch.Tensor], keys: dict[int, torch.Tensor], num_positions: int, softmax_scale: float
) -> torch.Tensor:
    """``W (n_layers, num_positions)``: per layer, the mean over heads and queries of each query's
    attention over the cached positions ``[0, num_positions)``, renormalised to sum to one.

    Args:
        queries: per layer, ``(Q, H, D)`` the verification queries (every head).
        keys: per layer, ``(T, Hkv, D)`` with ``T >= num_positions``.
    """
    rows = []
    for layer in sorted(queries):
        q, k = queries[layer].float(), keys[layer][:num_positions].float()
        n_q, n_heads, _ = q.shape
        k = k.transpose(0, 1)  # (Hkv, L, D)
        group = n_heads // k.shape[0]
        q = q.transpose(0, 1).reshape(k.shape[0], group * n_q, -1)  # (Hkv, G*Q, D)
        probs = torch.matmul(q, k.transpose(1, 2)).mul_(softmax_scale).softmax(dim=-1)  # (Hkv, G*Q, L)
        rows.append(probs.mean(dim=(0, 1)))
    return torch.stack(rows)


def selection_recovery(weights: torch.Tensor, indices: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Per layer, the share of attention the positions ``indices[:count]`` capture: ``(n_layers,)``."""
    idx = indices.flatten()[: count if count is not None else indices.numel()].long().to(weights.device)
    return weights[:, idx].sum(dim=-1)
