"""Attention with an explicit visibility mask: the general (slow) path for what the fast kernels do not cover.

The same function as :func:`dustin_hf.kernels.reference.verify_attention_reference` (new queries over a per-row
cache, every cached position or a selected set of them, the step's new tokens bottom-right causal), plus:

- ``window``: a sliding window (transformers' semantics: the query at cache index ``P`` sees key indices
  ``p > P - window``; ``key_slots`` gives each slot's index where it is not the slot itself, as in stock's cache
  of a row with masked input slots); selected positions outside a query's window are not attended, and a
  selection is gathered only where some query of the step can see it;
- ``hide_new``: the new tokens see the cached positions only (not each other, not themselves);
- ``return_weights``: the attention probabilities, scattered into cache-slot rows ``(B, Hq, Q, S)`` with
  ``S = max(cache_seqlens) + Q``, zero at every slot not attended (what ``output_attentions`` returns).

Without weights it is PyTorch's ``scaled_dot_product_attention`` with a boolean mask (memory ``O(B * Q * keys)``
for the mask); with them, probabilities are computed in float32 (as transformers' eager attention does), memory
``O(B * Hq * Q * keys)``. This path is for sliding windows, the rare masked query and ``output_attentions``,
never the hot loop of a full-attention model.
"""

from __future__ import annotations

import torch

from .reference import gather_positions

__all__ = ["masked_attention"]


def masked_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    num_indices: torch.Tensor | None = None,
    window: int | None = None,
    key_slots: torch.Tensor | None = None,
    hide_new: bool = False,
    return_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q (B, Q, Hq, D)``, ``k_cache/v_cache (B, capacity, Hkv, D)``, ``cache_seqlens (B,)``; ``indices (B, W)``
    and ``num_indices (B,)`` int for a selection; ``key_slots (B, capacity)`` int, non-decreasing along a row, the
    index the window counts for each slot (``None``: the slot). Returns ``(out (B, Q, Hq, D), weights (B, Hq, Q, S)
    | None)``."""
    batch, n_q, n_heads, head_dim = q.shape
    device = q.device
    seqlens = cache_seqlens.to(device=device, dtype=torch.long)
    new = seqlens[:, None] + torch.arange(n_q, device=device)  # (B, Q) the new tokens' slots = positions
    if indices is None:
        span = int(seqlens.max()) + n_q
        slots = torch.arange(span, device=device).expand(batch, span)  # (B, S)
        cached_ok = slots < seqlens[:, None]
    else:
        idx = indices.to(device=device, dtype=torch.long)
        cached_ok = torch.arange(idx.shape[1], device=device)[None, :] < num_indices.to(device)[:, None].long()
        slots = torch.cat([idx, new], dim=1)  # (B, W + Q): the selection, then the new tokens
        cached_ok = torch.cat([cached_ok, torch.zeros_like(new, dtype=torch.bool)], dim=1)
    is_new = (slots[:, None, :] >= seqlens[:, None, None]) & (slots[:, None, :] <= new[:, :, None])  # (B, Q, S)
    visible = cached_ok[:, None, :] | (is_new & (not hide_new))
    if window is not None:
        if key_slots is None:
            distance = new[:, :, None] - slots[:, None, :]  # (B, Q, S)
        else:
            index = key_slots.to(device=device, dtype=torch.long)
            last = index.shape[1] - 1
            query_index, key_index = index.gather(1, new.clamp_max(last)), index.gather(1, slots.clamp_max(last))
            distance = query_index[:, :, None] - key_index[:, None, :]
        visible = visible & (distance < window)
    if indices is None and not return_weights:  # every slot up to the longest row, read in place (prefill)
        read = slots
        keys, values = k_cache[:, : slots.shape[1]], v_cache[:, : slots.shape[1]]
    else:  # only what some query sees is gathered
        keep = visible.any(dim=1)  # (B, S)
        width = int(keep.sum(dim=1).max())
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # kept slots first, in order
        read = slots.gather(1, order)  # (B, K)
        visible = visible.gather(2, order[:, None, :].expand(-1, n_q, -1))  # (B, Q, K)
        keys = gather_positions(k_cache, read.clamp_max(k_cache.shape[1] - 1))  # (B, K, Hkv, D)
        values = gather_positions(v_cache, read.clamp_max(v_cache.shape[1] - 1))
    if not return_weights:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=visible[:, None],
            scale=softmax_scale,
            enable_gqa=n_heads != keys.shape[2],
        )  # (B, Hq, Q, D)
        # a query that sees nothing (a hidden query of an empty row) would be NaN: it attends to nothing
        return out.transpose(1, 2).nan_to_num(0.0), None
    group = n_heads // keys.shape[2]
    keys = keys.to(torch.float32).repeat_interleave(group, dim=2)  # (B, K, Hq, D)
    values = values.to(torch.float32).repeat_interleave(group, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * softmax_scale
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    probs = logits.softmax(dim=-1).nan_to_num(0.0)  # a query that sees nothing attends to nothing
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values).to(q.dtype)
    span = int(seqlens.max()) + n_q
    weights = torch.zeros(batch, n_heads, n_q, span, dtype=torch.float32, device=device)
    target = read.clamp_max(span - 1)[:, None, None, :].expand(-1, n_heads, n_q, -1)
    weights.scatter_add_(3, target, probs)
    return out, weights
