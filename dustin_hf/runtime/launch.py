"""Process-wide launch settings the decode loop holds while it runs (restored after)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["all_on_cuda", "prefer_cublaslt"]


@contextlib.contextmanager
def prefer_cublaslt(device: torch.device):
    """Route PyTorch's GEMMs through cuBLASLt while decoding (restored after; CUDA only).

    PyTorch's default, the cuBLAS API, runs the skinny down projections of a target's verification (a 7B's
    at 80 rows, a 72B's at 40) as split-K with a reduction launch where cuBLASLt picks one kernel without,
    which is faster; the other projections (and a 0.5B draft's down projection at 16 rows, split-K in both)
    run the same kernels either way. The setting is
    process-wide while ``generate`` runs.
    """
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def all_on_cuda(model) -> bool:
    return all(p.is_cuda for p in model.parameters())
