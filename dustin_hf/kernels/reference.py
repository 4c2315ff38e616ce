"""Plain-PyTorch attention over a per-row KV cache: the oracle in tests and the CPU path.

Every backend in this package computes the same function, defined here. Layouts follow
flash-attn's ``flash_attn_with_kvcache``:

    query i of row b (absolute position cache_seqlens[b] + i) attends to
      * the cached positions of row b: all of [0, cache_seqlens[b]) (dense), or only
        indices[b, :num_indices[b]] (sparse), and
      * the step's new tokens at slots [cache_seqlens[b], cache_seqlens[b] + i] (bottom-right causal).

The new tokens' keys and values are already written into the cache at those slots. Rows are
independent: nothing of row b is ever read for row b' != b.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# SDPA's backends for a prompt's causal attention on CUDA, fastest first. On an H200 (7B heads, 32k tokens, GQA)
# cuDNN's ran at 656 TFLOP/s against flash's 355; SDPA's own order may put flash first.
_PREFILL_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def verify_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    num_indices: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Attention of ``Q`` new queries per row over a preallocated cache.

    Args:
        q: ``(batch, Q, nheads, headdim)``, the new tokens' queries (post-RoPE).
        k_cache, v_cache: ``(batch, capacity, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (GQA).
        cache_seqlens: ``(batch,)``, int; cached positions before the new tokens.
        softmax_scale: the factor applied to ``q @ k^T``.
        indices: ``(batch, W)``, int; selected cached positions, each ``< cache_seqlens[b]``.
            ``None`` attends to every cached position.
        num_indices: ``(batch,)``, int; how many leading entries of each ``indices`` row are valid.
        max_seqlen_k: an upper bound on ``max(cache_seqlens) + Q`` if the caller knows it (saves a device
            sync for batches; a single row always reads its exact length).

    Returns:
        ``(batch, Q, nheads, headdim)``, in ``q``'s dtype.
    """
    batch, n_q, n_heads, head_dim = q.shape
    device = q.device
    seqlens = cache_seqlens.to(device=device, dtype=torch.long)
    query_pos = seqlens[:, None] + torch.arange(n_q, device=device)  # (B, Q) absolute positions
    if indices is None:
        if max_seqlen_k is None or batch == 1:  # one row (prefill): its exact key count
            max_seqlen_k = int(seqlens.max()) + n_q
        keys, values = k_cache[:, :max_seqlen_k], v_cache[:, :max_seqlen_k]  # (B, Tk, Hkv, D)
        if batch == 1:  # keys end at the last query: a bottom-right causal bias, which flash kernels take maskless
            mask = causal_lower_right(n_q, max_seqlen_k)
        else:
            key_pos = torch.arange(max_seqlen_k, device=device)
            mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # (B, 1, Q, Tk)
    else:
        idx = indices.to(device=device, dtype=torch.long)
        counts = num_indices.to(device=device, dtype=torch.long)
        slots = torch.cat([idx, query_pos], dim=1)  # (B, W + Q): the selection, then the new tokens
        keys, values = gather_positions(k_cache, slots), gather_positions(v_cache, slots)
        n_sel = idx.shape[1]
        selected_ok = torch.arange(n_sel, device=device)[None, :] < counts[:, None]  # (B, W)
        new_ok = torch.ones(n_q, n_q, dtype=torch.bool, device=device).tril()  # (Q, Q): new j <= query i
        mask = torch.cat([selected_ok[:, None, :].expand(batch, n_q, n_sel), new_ok.expand(batch, n_q, n_q)], dim=2)
        mask = mask[:, None]  # (B, 1, Q, W + Q)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (B, Hq, Q, D)
        keys.transpose(1, 2).to(q.dtype),  # (B, Hkv, Tk, D)
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=softmax_scale,
        enable_gqa=n_heads != keys.shape[2],
    )  # (B, Hq, Q, D)
    return out.transpose(1, 2)


def gather_positions(cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``cache[b, positions[b]]`` for every row: ``(B, T, H, D)`` x ``(B, N)`` -> ``(B, N, H, D)``."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    return cache[rows, positions]


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, *, softmax_scale: float
) -> torch.Tensor:
    """A prompt chunk's attention: every row holds ``start`` cached positions and brings ``Q`` new tokens.

    Args:
        q: ``(batch, Q, nheads, headdim)``, the new tokens' queries (post-RoPE).
        k_cache, v_cache: ``(batch, capacity, nheads_k, headdim)``, the new tokens already written at slots
            ``start .. start + Q - 1``.
        start: cached positions every row holds before the new tokens (a host int).

    Returns ``(batch, Q, nheads, headdim)``: :func:`verify_attention_reference` of a dense call, computed as one
    causal SDPA call: square (``start == 0``, a whole prompt) with ``is_causal``, which cuDNN runs on CUDA, else
    with the bottom-right causal bias.
    """
    n_q = q.shape[1]
    keys = k_cache[:, : start + n_q].transpose(1, 2).to(q.dtype)  # (B, Hkv, Tk, D)
    values = v_cache[:, : start + n_q].transpose(1, 2).to(q.dtype)
    causal = dict(is_causal=True) if start == 0 else dict(attn_mask=causal_lower_right(n_q, start + n_q))
    backends = sdpa_kernel(_PREFILL_BACKENDS, set_priority=True) if q.is_cuda else contextlib.nullcontext()
    with backends:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, scale=softmax_scale, enable_gqa=q.shape[2] != keys.shape[1], **causal
        )  # (B, Hq, Q, D)
    return out.transpose(1, 2)
