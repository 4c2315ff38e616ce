"""The fused decode ops as functions: one Triton launch each (:mod:`dustin_hf.kernels.triton_fused`,
:mod:`~dustin_hf.kernels.triton_gemm`, :mod:`~dustin_hf.kernels.triton_argmax`), with transformers' numerics.

Why: a decode step replayed from CUDA graphs (Qwen2.5-7B target + 0.5B draft, batch 16) is thousands of tiny
elementwise kernels. transformers' RMSNorm is ~8 of them per call (253 calls a step) and ``apply_rotary_pos_emb``
~10 per layer; :func:`rms_norm` and :func:`apply_rotary` are one launch each. Rotary is bit-exact; RMSNorm rounds as
transformers does, but its sum of squares is reduced in another order, so a few elements per million (bf16) round
one ulp the other way, at most 2 ulps of a 16-bit output. :func:`add_rms_norm` puts the residual add before it in the
same launch (the same bits as the two calls); :func:`silu_mul` rounds as PyTorch does; :func:`skinny_linear` and
:func:`gated_linear` may reduce in another order than cuBLAS (the last bits can differ); :func:`argmax` gives
``torch.argmax``'s indices.

The kernels run on CUDA tensors, or on CPU under the Triton interpreter (``TRITON_INTERPRET=1``); the others raise
``ValueError`` (but :func:`argmax`, which falls back to PyTorch). :func:`dustin_hf.runtime.fused.fused_ops` swaps
them into transformers' models.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ..kernels.tuning import ArgmaxTuning, GemmTuning

__all__ = [
    "add_rms_norm",
    "apply_rotary",
    "argmax",
    "fused_ops_available",
    "gated_linear",
    "rms_norm",
    "silu_mul",
    "skinny_linear",
    "triton_runs_on",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in one Triton launch: ``weight * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)``.

    ``x (..., N)`` and ``weight (N,)`` fp16/bf16/fp32 on one device (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). Returns ``x.shape`` in ``torch.promote_types(weight.dtype, x.dtype)``.
    """
    _check_device(x)
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}; they must share a device")
    from ..kernels.triton_fused import rms_norm_triton

    return rms_norm_triton(x, weight, eps)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` in one Triton launch for q and k, bit for bit.

    ``q (B, Hq, T, D)``, ``k (B, Hk, T, D)`` (``(B, T, H, D)`` with ``unsqueeze_dim=2``), ``cos, sin
    (B, T, D)``; fp16/bf16/fp32, ``D`` even. Returns ``(q_embed, k_embed)``. No host sync: capturable
    in a CUDA graph.
    """
    _check_device(q)
    from ..kernels.triton_fused import apply_rotary_triton

    return apply_rotary_triton(q, k, cos, sin, unsqueeze_dim)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm after it in one Triton launch: ``(rms_norm(residual + x), residual + x)``.

    ``x, residual (..., N)`` of one dtype (fp16/bf16/fp32) and ``weight (N,)`` on one device. The sum is
    rounded as PyTorch's add rounds it and the norm is :func:`rms_norm`'s kernel code on the sum, so both
    outputs equal the two separate calls bit for bit (the tests check it).
    """
    _check_device(x)
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}; they must share a device")
    from ..kernels.triton_fused import add_rms_norm_triton

    return add_rms_norm_triton(x, residual, weight, eps)


def fused_ops_available(model: torch.nn.Module) -> bool:
    """True when triton is importable and every parameter of ``model`` is on a CUDA device."""
    return importlib.util.find_spec("triton") is not None and all(p.is_cuda for p in model.parameters())


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tuning: GemmTuning | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a decode-sized ``x`` in one Triton launch
    (:func:`dustin_hf.kernels.triton_gemm.skinny_linear`; ``tuning``: its heuristic, ``None``: the defaults)."""
    _check_device(x)
    from ..kernels.triton_gemm import skinny_linear as skinny

    return skinny(x, weight, bias, tuning=tuning)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, tuning: GemmTuning | None = None) -> torch.Tensor:
    """``silu_mul(F.linear(x, weight))`` for ``weight = [gate; up]`` and a decode-sized ``x``, in one Triton launch
    (:func:`dustin_hf.kernels.triton_gemm.gated_linear`; ``tuning`` as for :func:`skinny_linear`)."""
    _check_device(x)
    from ..kernels.triton_gemm import gated_linear as gated

    return gated(x, weight, tuning=tuning)


def argmax(x: torch.Tensor, tuning: ArgmaxTuning | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)``, the same indices; where Triton runs (CUDA, or its interpreter on CPU) one launch
    (:func:`dustin_hf.kernels.triton_argmax.argmax_triton`, split over the GPU, a programmatic dependent on sm_90;
    ``tuning``: its split, ``None``: the defaults), else PyTorch's reduction."""
    if _argmax_kernel_runs_on(x.device) and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel():
        from ..kernels.triton_argmax import argmax_triton

        return argmax_triton(x, tuning=tuning)
    return x.argmax(dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension, in one Triton launch."""
    _check_device(gate_up)
    from ..kernels.triton_fused import silu_mul_triton

    return silu_mul_triton(gate_up)


# The forward fused_ops gives a recognised RMSNorm (as a partial over the module, which can carry a tag).
def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _argmax_kernel_runs_on(device: torch.device) -> bool:
    return _has_triton() and triton_runs_on(device)


def _check_device(t: torch.Tensor) -> None:
    if not triton_runs_on(t.device):
        raise ValueError(
            f"the fused kernels run in Triton: they need CUDA tensors (got {t.device}), or on CPU the "
            "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
