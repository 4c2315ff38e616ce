"""Triton kernels for RMSNorm (alone or after a residual add) and rotary embedding, one launch each, rounding
exactly where PyTorch does.

:func:`dustin_hf.runtime.fused.fused_ops` swaps them into transformers' models; this module is only the kernels.

Why: under CUDA graphs the decode step is made of thousands of microsecond-long elementwise kernels. transformers'
RMSNorm is about 8 of them (to fp32, pow, mean, add eps, rsqrt, mul, to the input dtype, mul by the
weight), ``apply_rotary_pos_emb`` about 10 (for q and for k: ``q * cos``, neg, cat, mul, add). Each
becomes one launch here, q and k together.

Numerics. PyTorch's elementwise ops on fp16/bf16 tensors compute in fp32 and round the result to the
tensor's dtype, once per op. The kernels compute in fp32 and round (``round_to``, to nearest, ties to
even) after every op whose PyTorch output is 16-bit, in the dtype PyTorch's type promotion gives
that op. Products of two 16-bit values are exact in fp32, so each rounding matches PyTorch's bit for
bit; so does every fp32 op, since the kernels are compiled with ``enable_fp_fusion=False`` (no
multiply-add is contracted into one FMA, which rounds once where PyTorch rounds twice).

* Rotary: ``q * cos + rotate_half(q) * sin`` is bit-exact to PyTorch for every dtype.
* Add + RMSNorm (:func:`add_rms_norm_triton`): the residual stream's ``residual + x`` (rounded once, as
  PyTorch's add) is normalised in the same launch by the same kernel code as :func:`rms_norm_triton`
  (a constexpr flag adds the load, add and store), so both outputs equal the two separate launches.
* RMSNorm: ``mean(x**2)`` sums in another order than PyTorch's reduction (and ``rsqrt`` may differ
  by an ulp on the GPU), so the fp32 ``rsqrt(var + eps)`` can differ in its last bits, and the
  16-bit ``y = x * rsqrt(...)`` can round one ulp the other way (a few elements per million in bf16),
  which the weight multiply makes at most 2 ulps of a 16-bit output. Everything after
  the reduction rounds as PyTorch does.

The rounding (:mod:`dustin_hf.kernels._rounding`) gives the same bits in Triton's interpreter (the CPU test
path) as compiled. Sizes come from host ints only and outputs from ``torch.empty``: no host sync, so both
kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import launch_device
from ._rounding import TL_DTYPES, round_to
from .triton_launch import await_producers, dependent_launch

__all__ = [
    "add_rms_norm_triton",
    "apply_rotary_triton",
    "rms_norm_triton",
    "rotary_write_kv_triton",
    "silu_mul_triton",
]

_MAX_ONE_TILE = 16384  # RMSNorm rows up to this many elements are held in registers, longer ones looped
_LOOP_BLOCK = 4096
_ROTARY_TILE = 4096  # (heads x half head dim) elements per rotary tile
_SILU_MUL_BLOCK = 1024


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _norm_input(x_row, r_row, res_row, cols, mask, X_DTYPE: tl.constexpr, ADD: tl.constexpr, STORE: tl.constexpr):
    """A tile of the row to normalise, fp32: ``x``, or with ``ADD`` the sum ``residual + x`` rounded to
    ``X_DTYPE`` as PyTorch's add rounds it (stored to the new residual when ``STORE``)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(r + x, X_DTYPE)
        if STORE:
            tl.store(res_row + cols, x.to(res_row.dtype.element_ty), mask=mask)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    res_ptr,
    stride_x,
    stride_r,
    stride_out,
    stride_res,
    eps,
    N_COLS: tl.constexpr,
    X_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row: ``out = weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``.

    With ``ADD`` the row normalised is ``x = residual + x`` (``r_ptr``), also written to ``res_ptr``; the
    reduction and everything after it is the same code either way."""
    await_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    res_row = res_ptr + row * stride_res
    out_row = out_ptr + row * stride_out
    if N_COLS <= BLOCK:  # the whole row in registers: x is read once
        cols = tl.arange(0, BLOCK)
        mask = cols < N_COLS
        x = _norm_input(x_row, r_row, res_row, cols, mask, X_DTYPE, ADD, True)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N_COLS + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = round_to(x * rstd, X_DTYPE)  # .to(input_dtype)
        out = round_to(w * y, OUT_DTYPE)  # weight * y in the promoted dtype
        tl.store(out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # two passes over the row: sum of squares, then normalise (the second read mostly hits L2)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = _norm_input(x_row, r_row, res_row, cols, cols < N_COLS, X_DTYPE, ADD, True)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N_COLS + eps)
        for start in range(0, N_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N_COLS
            x = _norm_input(x_row, r_row, res_row, cols, mask, X_DTYPE, ADD, False)  # the same sum again
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            out = round_to(w * round_to(x * rstd, X_DTYPE), OUT_DTYPE)
            tl.store(out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, block: int | None = None) -> torch.Tensor:
    """transformers' RMSNorm: ``weight * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)``, ``x32 = x.float()``.

    Args:
        x: ``(..., N)``, fp16/bf16/fp32, any strides (copied if its last dim is not contiguous).
        weight: ``(N,)``, fp16/bf16/fp32, on ``x``'s device.
        eps: added to the mean square (as fp32).
        block: tile width; ``None`` picks one (tests force the looped path with a small one).

    Returns:
        ``x.shape``, contiguous, in ``torch.promote_types(weight.dtype, x.dtype)`` (fp32 for a bf16
        ``x`` with an fp32 weight, as in PyTorch).
    """
    _check_norm(x, weight)
    return _rms_norm(x, None, weight, eps, block)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``total = residual + x`` and :func:`rms_norm_triton` of it, in one launch: returns ``(normed, total)``.

    Args:
        x, residual: ``(..., N)``, one shape and dtype (fp16/bf16/fp32), any strides.
        weight, eps, block: as in :func:`rms_norm_triton`.

    Returns:
        ``normed``: what :func:`rms_norm_triton` returns for ``total`` (the same kernel code: the sum of
        squares is reduced alike). ``total``: ``x.shape``, contiguous, in ``x``'s dtype, rounded as
        PyTorch's ``residual + x`` (the fp32 sum rounded once to the dtype).
    """
    _check_norm(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x in shape, dtype and device; got {tuple(residual.shape)} {residual.dtype} "
            f"{residual.device} for x {tuple(x.shape)} {x.dtype} {x.device}"
        )
    return _rms_norm(x, residual, weight, eps, block)


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in TL_DTYPES or weight.dtype not in TL_DTYPES:
        raise ValueError(f"rms_norm takes fp16, bf16 or fp32 tensors; got x {x.dtype}, weight {weight.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be ({x.shape[-1]},) for x of shape {tuple(x.shape)}; got {tuple(weight.shape)}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t (..., N)`` as ``(rows, N)``, last dim contiguous (a view unless the leading dims cannot be flattened)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _rms_norm(x, residual, weight, eps, block) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of ``_rms_norm_kernel``; with ``residual``, on ``residual + x`` (also returned)."""
    n_cols = x.shape[-1]
    rows = _rows(x)
    res_rows = rows if residual is None else _rows(residual)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or n_cols == 0:
        return out, total
    if block is None:
        block = triton.next_power_of_2(n_cols) if n_cols <= _MAX_ONE_TILE else _LOOP_BLOCK
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    total_rows = out.view(-1, n_cols) if total is None else total.view(-1, n_cols)  # unused without a residual
    pdl = dependent_launch(x)
    with launch_device(x):
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight.contiguous(),
            out,
            total_rows,
            rows.stride(0),
            res_rows.stride(0),
            n_cols,
            n_cols,
            float(eps),
            N_COLS=n_cols,
            X_DTYPE=TL_DTYPES[x.dtype],
            OUT_DTYPE=TL_DTYPES[out_dtype],
            BLOCK=block,
            ADD=residual is not None,
            PDL=pdl,
            num_warps=num_warps,
            enable_fp_fusion=False,
            launch_pdl=pdl,
        )
    return out, total


# ----------------------------------------------------------------------------- rotary embedding


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_h,
    stride_d,
    out_stride_h,
    out_stride_d,
    cos1,
    cos2,
    sin1,
    sin2,
    d,
    d_mask,
    N_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    COS_DTYPE: tl.constexpr,
    SIN_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """``x * cos + rotate_half(x) * sin`` for the heads of one (batch row, position), with
    ``rotate_half(x) = cat(-x2, x1)``.

    Each product is rounded to its PyTorch dtype (``COS_DTYPE = promote(x, cos)``, ``SIN_DTYPE =
    promote(x, sin)``), then the sum to ``OUT_DTYPE``. ``round(-a * s) = -round(a * s)``: the negation
    commutes with rounding to nearest, so ``neg`` then ``mul`` equals one fused step.
    """
    for h0 in range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < N_HEADS)[:, None] & d_mask[None, :]
        src = x_ptr + h[:, None] * stride_h + d[None, :] * stride_d  # (BLOCK_H, BLOCK_HALF), first halves
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
        out1 = round_to(round_to(x1 * cos1[None, :], COS_DTYPE) + round_to(-x2 * sin1[None, :], SIN_DTYPE), OUT_DTYPE)
        out2 = round_to(round_to(x2 * cos2[None, :], COS_DTYPE) + round_to(x1 * sin2[None, :], SIN_DTYPE), OUT_DTYPE)
        dst = out_ptr + h[:, None] * out_stride_h + d[None, :] * out_stride_d
        tl.store(dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF * out_stride_d, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(
    src,
    dst,
    stride_h,
    dst_stride_h,
    N_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Copy the heads of one (batch row, position), unit stride along the head dim, casting to ``dst``'s dtype."""
    d = tl.arange(0, BLOCK_D)
    for h0 in range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < N_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        x = tl.load(src + h[:, None] * stride_h + d[None, :], mask=mask)
        tl.store(dst + h[:, None] * dst_stride_h + d[None, :], x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    seq_len,
    sq_b,
    sq_h,
    sq_t,
    sq_d,
    sk_b,
    sk_h,
    sk_t,
    sk_d,
    sqo_b,
    sqo_h,
    sqo_t,
    sqo_d,
    sko_b,
    sko_h,
    sko_t,
    sko_d,
    sc_b,
    sc_t,
    sc_d,
    ss_b,
    ss_t,
    ss_d,
    v_ptr,
    v_out_ptr,
    slots_ptr,
    row0,
    sv_b,
    sv_h,
    sv_t,
    svo_b,
    svo_h,
    svo_t,  # read iff TO_CACHE
    N_Q_HEADS: tl.constexpr,
    N_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    Q_COS_DTYPE: tl.constexpr,
    Q_SIN_DTYPE: tl.constexpr,
    Q_OUT_DTYPE: tl.constexpr,
    K_COS_DTYPE: tl.constexpr,
    K_SIN_DTYPE: tl.constexpr,
    K_OUT_DTYPE: tl.constexpr,
    TO_CACHE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (batch row, position): loads its cos/sin once, rotates every q head, then every k head.

    With ``TO_CACHE`` the rotated keys and the values go straight into the caches (``k_out``/``v_out``, rows
    ``row0 + b``, slot ``slots[b, t]``) instead of a new key tensor: the K/V write of a decode step, in the
    same launch."""
    await_producers(PDL)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    if TO_CACHE:
        slot = tl.load(slots_ptr + pid)
        k_out_row = k_out_ptr + (row0 + b) * sko_b + slot * sko_t
    else:
        k_out_row = k_out_ptr + b * sko_b + t * sko_t
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos_row = cos_ptr + b * sc_b + t * sc_t
    sin_row = sin_ptr + b * ss_b + t * ss_t
    cos1 = tl.load(cos_row + d * sc_d, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + (d + HALF) * sc_d, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + d * ss_d, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + (d + HALF) * ss_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + b * sq_b + t * sq_t,
        q_out_ptr + b * sqo_b + t * sqo_t,
        sq_h,
        sq_d,
        sqo_h,
        sqo_d,
        cos1,
        cos2,
        sin1,
        sin2,
        d,
        d_mask,
        N_Q_HEADS,
        HALF,
        BLOCK_H,
        Q_COS_DTYPE,
        Q_SIN_DTYPE,
        Q_OUT_DTYPE,
    )
    _rotate_heads(
        k_ptr + b * sk_b + t * sk_t,
        k_out_row,
        sk_h,
        sk_d,
        sko_h,
        sko_d,
        cos1,
        cos2,
        sin1,
        sin2,
        d,
        d_mask,
        N_K_HEADS,
        HALF,
        BLOCK_H,
        K_COS_DTYPE,
        K_SIN_DTYPE,
        K_OUT_DTYPE,
    )
    if TO_CACHE:
        _copy_heads(
            v_ptr + b * sv_b + t * sv_t,
            v_out_ptr + (row0 + b) * svo_b + slot * svo_t,
            sv_h,
            svo_h,
            N_K_HEADS,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
        )


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb``, bit for bit, in one launch for q and k.

    Args:
        q: ``(B, Hq, T, D)`` with ``unsqueeze_dim=1`` (``(B, T, Hq, D)`` with 2); fp16/bf16/fp32, any
            strides; ``D`` even, at most 512.
        k: like ``q`` with ``Hk`` heads (same ``B``, ``T``, ``D``).
        cos, sin: ``(B, T, D)`` (``B`` may be 1: broadcast), fp16/bf16/fp32; transformers' rotary
            module casts them to the hidden states' dtype.
        unsqueeze_dim: where cos/sin get their head axis: 1 (or -3) or 2 (or -2).

    Returns:
        ``(q_embed, k_embed)``, shaped and strided like ``q`` and ``k``, each in the dtype PyTorch's
        promotion gives ``x * cos + rotate_half(x) * sin``.
    """
    dim = unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim
    _check_rotary(q, k, cos, sin, dim)
    q_out = torch.empty_like(q, dtype=_rotary_dtypes(q, cos, sin)[2])
    k_out = torch.empty_like(k, dtype=_rotary_dtypes(k, cos, sin)[2])
    cos4, sin4 = cos.unsqueeze(dim), sin.unsqueeze(dim)
    views = [q, k, q_out, k_out, cos4, sin4]
    if dim == 2:  # one (B, H, T, D) indexing for both layouts
        views = [v.transpose(1, 2) for v in views]
    qv, kv, qov, kov, cos4, sin4 = views
    _launch_rotary(qv, kv, cos4, sin4, qov, kov)
    return q_out, k_out


def rotary_write_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    row0: int,
) -> torch.Tensor:
    """``apply_rotary_pos_emb`` of ``q`` and ``k`` and the cache write of the rotated keys and the values, in one
    launch: returns ``q_embed``; ``k_cache[row0 + b, slots[b, t]] = k_embed[b, t]`` and likewise ``v``.

    Args:
        q: ``(B, T, Hq, D)``; k, v: ``(B, T, Hk, D)`` (the layout of a projection's ``view``, before
            transformers' ``transpose(1, 2)``); any strides with a unit last stride.
        cos, sin: ``(B, T, D)`` (``B`` may be 1).
        k_cache, v_cache: ``(B_cache, capacity, Hk, D)``, unit last stride.
        slots: ``(B, T)`` contiguous int64 cache slots; row0: the cache row of ``b = 0``.

    Returns:
        ``q_embed (B, T, Hq, D)``, contiguous. Every value is what :func:`apply_rotary_triton` and the cache's
        write give (the same rotation code; the write is a copy, cast to the cache's dtype).
    """
    _check_rotary(q, k, cos, sin, 2)
    if v.shape != k.shape:
        raise ValueError(f"v must be shaped like k {tuple(k.shape)}; got {tuple(v.shape)}")
    batch, seq_len, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[2]
    if k_cache.dim() != 4 or k_cache.shape[2:] != (n_k_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit keys {tuple(k.shape)}")
    if slots.shape != (batch, seq_len) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slots must be a contiguous ({batch}, {seq_len}) int64 tensor; got {tuple(slots.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("q, k, v and the caches need a unit stride along the head dimension")
    if not (0 <= row0 and row0 + batch <= k_cache.shape[0]):
        raise ValueError(f"rows {row0}..{row0 + batch - 1} are outside the cache's {k_cache.shape[0]}")
    q_out = torch.empty(q.shape, dtype=_rotary_dtypes(q, cos, sin)[2], device=q.device)
    heads_first = [t.transpose(1, 2) for t in (q, k, q_out, k_cache, v, v_cache)]  # (B, H, T, D) indexing
    _launch_rotary(
        *heads_first[:2], cos.unsqueeze(1), sin.unsqueeze(1), *heads_first[2:4], cache=(*heads_first[4:], slots, row0)
    )
    return q_out


def _launch_rotary(q, k, cos, sin, q_out, k_out, *, cache=None) -> None:
    """One :func:`_rotary_kernel` launch over ``(B, H, T, D)``-indexed views (``cos``/``sin`` ``(B or 1, 1, T, D)``).

    With ``cache = (v, v_out, slots, row0)`` (``v``/``v_out`` indexed like ``k``/``k_out``) the rotated keys go to
    ``k_out[row0 + b, :, slots[b, t]]`` and the values to ``v_out`` alike, instead of ``k_out[b, :, t]``."""
    batch, n_q_heads, seq_len, head_dim = q.shape
    if batch * seq_len == 0:
        return
    cos = cos.expand(batch, 1, seq_len, head_dim)  # broadcast axes get stride 0
    sin = sin.expand(batch, 1, seq_len, head_dim)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_q_heads, k.shape[1])), max(1, _ROTARY_TILE // block_half))
    q_dtypes = [TL_DTYPES[t] for t in _rotary_dtypes(q, cos, sin)]
    k_dtypes = [TL_DTYPES[t] for t in _rotary_dtypes(k, cos, sin)]
    if cache is None:
        cache_args = (q, q, q, 0, 0, 0, 0, 0, 0, 0)  # unused without a cache write
    else:
        v, v_out, slots, row0 = cache
        cache_args = (v, v_out, slots, row0, *v.stride()[:3], *v_out.stride()[:3])
    pdl = dependent_launch(q)
    with launch_device(q):
        _rotary_kernel[(batch * seq_len,)](
            q,
            k,
            cos,
            sin,
            q_out,
            k_out,
            seq_len,
            *q.stride(),
            *k.stride(),
            *q_out.stride(),
            *k_out.stride(),
            cos.stride(0),
            cos.stride(2),
            cos.stride(3),
            sin.stride(0),
            sin.stride(2),
            sin.stride(3),
            *cache_args,
            N_Q_HEADS=n_q_heads,
            N_K_HEADS=k.shape[1],
            HALF=half,
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
            Q_COS_DTYPE=q_dtypes[0],
            Q_SIN_DTYPE=q_dtypes[1],
            Q_OUT_DTYPE=q_dtypes[2],
            K_COS_DTYPE=k_dtypes[0],
            K_SIN_DTYPE=k_dtypes[1],
            K_OUT_DTYPE=k_dtypes[2],
            TO_CACHE=cache is not None,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            PDL=pdl,
            num_warps=4,
            enable_fp_fusion=False,
            launch_pdl=pdl,
        )


def _rotary_dtypes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.dtype, ...]:
    """PyTorch's dtypes of ``x * cos``, ``rotate_half(x) * sin`` and their sum."""
    with_cos, with_sin = torch.promote_types(x.dtype, cos.dtype), torch.promote_types(x.dtype, sin.dtype)
    return with_cos, with_sin, torch.promote_types(with_cos, with_sin)


def _check_rotary(q, k, cos, sin, dim: int) -> None:
    """Shape/dtype checks on host metadata only (no device reads)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        raise ValueError(
            f"apply_rotary takes 4-D q, k and 3-D cos, sin; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 or 2 (the head axis of q and k); got {dim}")
    for t in (q, k, cos, sin):
        if t.dtype not in TL_DTYPES:
            raise ValueError(f"apply_rotary takes fp16, bf16 or fp32 tensors; got {t.dtype}")
    head_dim = q.shape[-1]
    if head_dim % 2 or head_dim > 512:
        raise ValueError(f"the head dim must be even and at most 512; got {head_dim}")
    seq_axis = 3 - dim  # (B, H, T, D) or (B, T, H, D)
    if k.shape[0] != q.shape[0] or k.shape[seq_axis] != q.shape[seq_axis] or k.shape[-1] != head_dim:
        raise ValueError(f"q and k must share batch, length and head dim; got {tuple(q.shape)} and {tuple(k.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        shape = q.shape[0], q.shape[seq_axis], head_dim
        if t.shape[0] not in (1, shape[0]) or t.shape[1:] != shape[1:]:
            raise ValueError(
                f"{name} must be {shape} (or batch 1) for q of shape {tuple(q.shape)}; got {tuple(t.shape)}"
            )
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"q, k, cos and sin must be on one device; got {sorted(map(str, devices))}")


# ----------------------------------------------------------------------------- SiLU(gate) * up


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, stride_gu, stride_out, n_cols, DTYPE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """``out = silu(gate) * up`` for one row block, ``gate | up`` the two halves of a ``gate_up`` row, each
    product rounded as PyTorch's two kernels round it (``silu`` in fp32 to ``DTYPE``, then the product)."""
    await_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), DTYPE)
    out = round_to(silu * up, DTYPE)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up (..., 2I)`` = ``[gate | up]``: ``(..., I)`` in ``gate_up``'s dtype, one launch.

    Matches ``F.silu(gate) * up`` to the last bit except where the exponential's last fp32 bit decides a
    rounding (PyTorch's ``expf`` and Triton's ``exp`` may differ there by one fp32 ulp).
    """
    if gate_up.dtype not in TL_DTYPES:
        raise ValueError(f"silu_mul takes fp16, bf16 or fp32; got {gate_up.dtype}")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up); got {tuple(gate_up.shape)}")
    n_cols = gate_up.shape[-1] // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows = gate_up.reshape(-1, 2 * n_cols)
    out = torch.empty(*gate_up.shape[:-1], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or n_cols == 0:
        return out
    pdl = dependent_launch(gate_up)
    with launch_device(gate_up):
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n_cols, _SILU_MUL_BLOCK))](
            rows,
            out,
            rows.stride(0),
            n_cols,
            n_cols,
            DTYPE=TL_DTYPES[gate_up.dtype],
            BLOCK=_SILU_MUL_BLOCK,
            PDL=pdl,
            num_warps=4,
            enable_fp_fusion=False,
            launch_pdl=pdl,
        )
    return out
