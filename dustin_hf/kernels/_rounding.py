"""Rounding as PyTorch rounds, inside Triton kernels: fp32 results to the 16-bit dtype of the op PyTorch would run,
for the fused elementwise kernels and the gated GEMM's epilogue.

Rounding to bf16 is done on the fp32 bit pattern with integer ops, not with a cast: Triton's interpreter (the
CPU test path) truncates fp32 -> bf16 casts, while compiled kernels round to nearest; the integer version
gives the same bits in both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TL_DTYPES", "round_to"]

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest (ties to even) in ``DTYPE``, returned as fp32 (exact in ``DTYPE``)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # carries into the exponent as it should
        rounded = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    elif DTYPE == tl.float16:
        rounded = x.to(tl.float16).to(tl.float32)  # fp16 casts round to nearest in both modes
    else:
        rounded = x
    return rounded
