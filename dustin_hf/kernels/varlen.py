"""Gather-then-varlen backends: flash-attn's ``flash_attn_varlen_func`` or PyTorch's ``varlen_attn``.

Secondary backends for :func:`dustin_hf.kernels.reference.verify_attention_reference`'s function:
copy each row's attended keys (the selected cached positions, then the ``Q`` new slots) into one
packed ``(total_k, nheads_k, headdim)`` tensor and run a FlashAttention-2 varlen kernel with
bottom-right causal masking, under which query ``i`` of a row with ``n + Q`` keys sees keys
``j <= n + i``: all ``n`` selected ones and the new tokens up to itself. They pay for the gathered
copy that the fused Triton kernel avoids, and serve as a baseline and a fallback.

Which path runs (chosen from the installed versions, inspected at runtime since PyTorch's
``varlen_attn`` signature changed between releases: 2.10 had ``is_causal=``, later ones
``window_size=``, ``enable_gqa=`` and ``seqused_k=``):

- ``varlen_attn`` with ``seqused_k``: no host sync. Sparse mode gathers each row padded to
  ``W + Q`` keys and passes the valid count as ``seqused_k``; dense mode gathers nothing, it views
  the cache itself as packed rows (row ``b`` starts at ``b * batch_stride``) with ``seqused_k = L + Q``.
- flash-attn, dense mode: ``flash_attn_with_kvcache`` on the cache directly (no gather, no sync).
- otherwise: ragged packing; sizing the packed tensors costs **one device->host sync** per call.

Without ``enable_gqa`` the gathered K/V heads are repeated to the query heads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

__all__ = ["torch_varlen_available", "torch_varlen_flavour", "verify_attention_varlen"]


@functools.cache
def _torch_varlen_fn() -> Callable | None:
    """PyTorch's ``varlen_attn`` if this build has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _flash_attn_fns() -> tuple[Callable, Callable]:
    """flash-attn's ``(flash_attn_varlen_func, flash_attn_with_kvcache)``."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    return flash_attn_varlen_func, flash_attn_with_kvcache


def _params(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def torch_varlen_available() -> bool:
    """True when ``torch.nn.attention.varlen.varlen_attn`` exists and CUDA is available."""
    return _torch_varlen_fn() is not None and torch.cuda.is_available()


def torch_varlen_flavour() -> str:
    """How PyTorch's ``varlen_attn`` runs here: ``"seqused_k"`` (padded rows, no host sync; dense mode over the
    cache itself), ``"gather"`` (ragged packing, one host sync a call) or ``"n/a"`` (this torch has none)."""
    fn = _torch_varlen_fn()
    return "n/a" if fn is None else "seqused_k" if "seqused_k" in _params(fn) else "gather"


def verify_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    num_indices: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    use_flash_attn: bool,
    kernels: tuple[Callable, Callable | None] | None = None,
) -> torch.Tensor:
    """Attention of ``Q`` new queries per row over selected (or all) cached positions plus the new tokens.

    Args:
        q: ``(batch, Q, nheads, headdim)``, fp16/bf16.
        k_cache, v_cache: ``(batch, capacity, nheads_k, headdim)``; ``nheads % nheads_k == 0``.
        cache_seqlens: ``(batch,)``, int; cached positions before the new tokens (whose K/V sit at
            slots ``cache_seqlens[b] .. cache_seqlens[b] + Q - 1``).
        softmax_scale: the factor applied to ``q @ k^T``.
        indices: ``(batch, W)``, int; selected cached positions. ``None``: dense, all of ``[0, L_b)``.
        num_indices: ``(batch,)``, int; valid leading entries of each ``indices`` row (``None``: all).
        max_seqlen_k: ``max(cache_seqlens) + Q`` if known; dense mode only (else an upper bound is used).
        use_flash_attn: flash-attn's kernels if True, else PyTorch's ``varlen_attn``.
        kernels: ``(varlen, with_kvcache)`` to call instead of the installed ones (flash-attn's
            ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``; PyTorch's ``varlen_attn`` and ``None``):
            functions of their signatures and FlashAttention-2's semantics (the CPU tests pass such fakes).

    Returns:
        ``(batch, Q, nheads, headdim)`` in ``q``'s dtype. May sync with the host (see the module doc).
    """
    batch, n_queries, n_heads, head_dim = q.shape
    seqlens = cache_seqlens.to(torch.int32)
    if indices is not None and num_indices is None:
        num_indices = torch.full((batch,), indices.shape[1], dtype=torch.int32, device=q.device)
    attend, with_kvcache = kernels or (_flash_attn_fns() if use_flash_attn else (_torch_varlen_fn(), None))
    if with_kvcache is not None and indices is None and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1:
        lengths = seqlens + n_queries  # flash-attn counts the new tokens in cache_seqlens
        return with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, softmax_scale=softmax_scale, causal=True)

    q_packed = q.reshape(batch * n_queries, n_heads, head_dim)  # (B*Q, Hq, D): every row has Q queries
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * n_queries  # (B+1,)
    if "seqused_k" in _params(attend):
        packed = _pack_padded(k_cache, v_cache, seqlens, indices, num_indices, n_queries, max_seqlen_k)
    else:
        packed = _pack_ragged(k_cache, v_cache, seqlens, indices, num_indices, n_queries)
    k, v, cu_seqlens_k, seqused_k, max_k = packed
    out = _call_varlen(attend, q_packed, k, v, cu_seqlens_q, cu_seqlens_k, n_queries, max_k, softmax_scale, seqused_k)
    return out.view(batch, n_queries, n_heads, head_dim)


def _call_varlen(attend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, seqused_k):
    """Call flash-attn's or PyTorch's varlen kernel with bottom-right causal masking.

    ``q (total_q, Hq, D)``, ``k/v (total_k, Hkv, D)``, ``cu_seqlens_* (B+1,)`` int32, ``seqused_k (B,)``
    int32 or ``None``. Adapts to the keyword names ``attend`` accepts.
    """
    params = _params(attend)
    kwargs = {}
    if seqused_k is not None:
        kwargs["seqused_k"] = seqused_k
    if "softmax_scale" in params:  # flash-attn: causal is bottom-right aligned, GQA native
        return attend(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=True,
            **kwargs,
        )
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older varlen_attn: expand the KV heads to the query heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # must be a tuple: varlen_attn compares it to (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = softmax_scale
    else:  # default scale is headdim ** -0.5: fold the ratio into q
        q = q * (softmax_scale * q.shape[-1] ** 0.5)
    return attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def _pack_padded(k_cache, v_cache, seqlens, indices, num_indices, n_queries, max_seqlen_k):
    """Fixed-size packing with ``seqused_k`` (no host sync).

    Returns ``(k, v, cu_seqlens_k, seqused_k, max_seqlen_k)``: ``k/v (rows, Hkv, D)`` where row ``b``'s
    keys are rows ``cu_seqlens_k[b] .. cu_seqlens_k[b] + seqused_k[b] - 1``.
    """
    batch, capacity = k_cache.shape[:2]
    device = k_cache.device
    if indices is None:
        viewed = _as_packed_rows(k_cache), _as_packed_rows(v_cache)
        if viewed[0] is not None and viewed[1] is not None and viewed[0][1] == viewed[1][1]:
            (k, row_stride), (v, _) = viewed
            cu_seqlens_k = torch.arange(batch + 1, dtype=torch.int32, device=device) * row_stride
            max_k = max_seqlen_k if max_seqlen_k is not None else capacity
            return k, v, cu_seqlens_k, seqlens + n_queries, max_k
        slots = torch.arange(capacity, device=device).expand(batch, capacity)  # (B, capacity): gather all
        n_cached = seqlens
    else:
        width = indices.shape[1] + n_queries
        ordinal = torch.arange(width, device=device)  # (W+Q,)
        n_cached = num_indices.to(torch.int32)
        selected = torch.cat([indices.long(), indices.new_zeros(batch, n_queries, dtype=torch.long)], dim=1)
        new_slot = seqlens[:, None].long() + ordinal - n_cached[:, None]  # (B, W+Q)
        is_new = (ordinal >= n_cached[:, None]) & (ordinal < n_cached[:, None] + n_queries)
        slots = torch.where(ordinal < n_cached[:, None], selected, torch.where(is_new, new_slot, 0))  # (B, W+Q)
    width = slots.shape[1]
    k = _gather(k_cache, slots).reshape(batch * width, *k_cache.shape[2:])  # (B*width, Hkv, D)
    v = _gather(v_cache, slots).reshape(batch * width, *v_cache.shape[2:])
    cu_seqlens_k = torch.arange(batch + 1, dtype=torch.int32, device=device) * width
    return k, v, cu_seqlens_k, n_cached + n_queries, width


def _as_packed_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """View ``(B, capacity, H, D)`` as ``(rows, H, D)`` over the same memory, row ``b`` starting at ``b * stride``.

    Works for views such as ``buf[:, :T]`` or ``buf[1:3]`` whose batch stride is a whole number of
    positions; ``None`` when it is not, or when the head dim is not contiguous.
    """
    batch, capacity, n_heads, head_dim = cache.shape
    stride_b, stride_t, stride_h, stride_d = cache.stride()
    if stride_d != 1 or stride_t == 0 or stride_b % stride_t != 0:
        return None
    row_stride = stride_b // stride_t
    rows = (batch - 1) * row_stride + capacity
    return cache.as_strided((rows, n_heads, head_dim), (stride_t, stride_h, stride_d)), row_stride


def _pack_ragged(k_cache, v_cache, seqlens, indices, num_indices, n_queries):
    """Tight packing, rows back to back; one host sync to size it.

    Returns ``(k, v, cu_seqlens_k, None, max_seqlen_k)``.
    """
    device = k_cache.device
    batch = k_cache.shape[0]
    n_cached = (seqlens if indices is None else num_indices).long()  # (B,)
    counts = n_cached + n_queries  # (B,) keys per row
    counts_host = counts.cpu()  # the one host sync
    total, max_k = int(counts_host.sum()), int(counts_host.max())
    cu_seqlens_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu_seqlens_k[1:] = counts.cumsum(0)
    row = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=total)  # (total,)
    ordinal = torch.arange(total, device=device) - cu_seqlens_k[:-1].long()[row]  # (total,) within the row
    if indices is None or indices.shape[1] == 0:
        cached_slot = ordinal
    else:
        cached_slot = indices.long()[row, ordinal.clamp(max=indices.shape[1] - 1)]
    slot = torch.where(ordinal < n_cached[row], cached_slot, seqlens.long()[row] + ordinal - n_cached[row])
    return k_cache[row, slot], v_cache[row, slot], cu_seqlens_k, None, max_k  # k/v (total, Hkv, D)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[b, slots[b]]``: ``(B, T, H, D)`` x ``(B, N)`` -> ``(B, N, H, D)``."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    return cache[rows, slots]
