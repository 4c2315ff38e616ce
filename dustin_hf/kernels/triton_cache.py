"""One Triton launch that writes a forward's new keys and values into the preallocated cache.

The PyTorch way (``cache[rows, slots] = states``) costs three launches per layer (the row ids, one
``index_put`` for keys, one for values). Inside a replayed decode step a launch costs GPU time whatever
it does, and a step writes K/V in every layer of four draft forwards and one target forward: 124 layer
writes at the 7B + 0.5B shapes. This kernel does both writes in one launch, a pure
copy (values are identical to the PyTorch path), graph-safe (slots are read on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import await_producers, dependent_launch

__all__ = ["write_kv_triton"]


@triton.jit
def _write_kv_kernel(
    K_SRC,
    V_SRC,
    K_DST,
    V_DST,
    SLOTS,  # sources (B', H, Q, D) strided; caches (B, T, H, D); slots (B', Q) int64
    row0,
    n_queries,
    sk_b,
    sk_h,
    sk_q,
    sv_b,
    sv_h,
    sv_q,
    dk_b,
    dk_t,
    dk_h,
    dv_b,
    dv_t,
    dv_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    await_producers(PDL)
    pid = tl.program_id(0)  # one program per (row, new token); all heads
    head = tl.program_id(1)
    b = pid // n_queries
    i = pid % n_queries
    slot = tl.load(SLOTS + pid)
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    k = tl.load(K_SRC + b * sk_b + head * sk_h + i * sk_q + d, mask=ok)
    v = tl.load(V_SRC + b * sv_b + head * sv_h + i * sv_q + d, mask=ok)
    tl.store(K_DST + (row0 + b) * dk_b + slot * dk_t + head * dk_h + d, k.to(K_DST.dtype.element_ty), mask=ok)
    tl.store(V_DST + (row0 + b) * dv_b + slot * dv_t + head * dv_h + d, v.to(V_DST.dtype.element_ty), mask=ok)


def write_kv_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    row0: int,
) -> None:
    """``k_cache[row0 + b, slots[b, i], h] = keys[b, h, i]`` (and values alike), in one launch.

    Args:
        keys, values: ``(B', H, Q, D)`` new states (any strides with a unit last stride).
        k_cache, v_cache: ``(B, T, H, D)`` buffers (unit last stride).
        slots: ``(B', Q)`` contiguous int64 cache slots.
        row0: the first cache row the ``B'`` rows map to.
    """
    batch, heads, n_queries, head_dim = keys.shape
    if values.shape != keys.shape or k_cache.shape[2:] != (heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"keys/values {tuple(keys.shape)}/{tuple(values.shape)} do not fit caches "
            f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}"
        )
    if slots.shape != (batch, n_queries) or not slots.is_contiguous():
        raise ValueError(f"slots must be a contiguous ({batch}, {n_queries}) tensor; got {tuple(slots.shape)}")
    if 1 != keys.stride(-1) or 1 != values.stride(-1) or 1 != k_cache.stride(-1) or 1 != v_cache.stride(-1):
        raise ValueError("states and caches need a unit stride along the head dimension")
    pdl = dependent_launch(keys)
    _write_kv_kernel[(batch * n_queries, heads)](
        keys,
        values,
        k_cache,
        v_cache,
        slots,
        row0,
        n_queries,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )
