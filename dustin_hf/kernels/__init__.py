"""One dispatcher for attention over a per-row KV cache, dense or over selected positions.

Backends compute the function defined in :mod:`dustin_hf.kernels.reference`:

- ``"reference"``: plain PyTorch (``scaled_dot_product_attention`` with explicit masks). The test
  oracle and the CPU path.
- ``"triton"``: a fused kernel that reads cache rows by index (no gathered copy), packs the query
  heads of a GQA group, splits long selections across programs and merges by log-sum-exp.
- ``"flash_attn"``: gather the selection, then flash-attn's ``flash_attn_varlen_func`` (optional
  dependency; needs a CUDA build of flash-attn).
- ``"varlen"``: gather the selection, then PyTorch's bundled FA2 ``varlen_attn`` (CUDA only).

``resolve_backend("auto", device)`` picks once; tests force a backend by name. The Triton kernels' launch
heuristics take their constants as frozen dataclasses (:mod:`dustin_hf.kernels.tuning`, bundled in
:class:`KernelTuning`), passed explicitly; ``None`` means the measured defaults.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ._device import launch_device
from .reference import verify_attention_reference
from .tuning import ArgmaxTuning, GemmTuning, KernelTuning, ScoreTuning, SelectTuning, VerifyTuning

__all__ = [
    "BACKENDS",
    "ArgmaxTuning",
    "GemmTuning",
    "KernelTuning",
    "ScoreTuning",
    "SelectTuning",
    "VerifyTuning",
    "available_backends",
    "full_rows_written",
    "launch_device",
    "resolve_backend",
    "verify_attention",
]

BACKENDS = ("reference", "triton", "flash_attn", "varlen")
# Fastest first; "auto" takes the first one available on the device.
_AUTO_ORDER_CUDA = ("triton", "flash_attn", "varlen", "reference")


@functools.cache
def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _backend_unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why ``name`` cannot run on ``device``, or ``None`` if it can."""
    if name == "reference":
        return None
    if device.type != "cuda":
        return f"backend {name!r} needs a CUDA device (got {device.type}); use backend='reference' on CPU"
    if name == "triton" and not _has_module("triton"):
        return "backend 'triton' needs the triton package; use backend='varlen' or 'reference'"
    if name == "flash_attn" and not _has_module("flash_attn"):
        return (
            "backend 'flash_attn' needs flash-attn (pip install 'dustin-hf[flash]'); use backend='triton' or 'varlen'"
        )
    if name == "varlen":
        from . import varlen

        if not varlen.torch_varlen_available():
            return (
                "backend 'varlen' needs torch.nn.attention.varlen.varlen_attn (PyTorch >= 2.11 with CUDA); "
                "use backend='triton' or 'reference'"
            )
    return None


def available_backends(device: torch.device | str) -> list[str]:
    """The backends that can run on ``device``, fastest first."""
    device = torch.device(device)
    order = _AUTO_ORDER_CUDA if device.type == "cuda" else ("reference",)
    return [name for name in order if _backend_unavailable_reason(name, device) is None]


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Turn ``"auto"`` into a concrete backend for ``device``; check that a named one can run there."""
    device = torch.device(device)
    if name == "auto":
        return available_backends(device)[0]
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {('auto',) + BACKENDS}")
    reason = _backend_unavailable_reason(name, device)
    if reason is not None:
        raise ValueError(reason)
    return name


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    num_indices: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    full_rows: bool = False,
    backend: str = "reference",
    tuning: VerifyTuning | None = None,
) -> torch.Tensor:
    """Dispatch to ``backend`` (a concrete name from :func:`resolve_backend`).

    Shapes are those of :func:`dustin_hf.kernels.reference.verify_attention_reference`:
    ``q (batch, Q, nheads, headdim)``, ``k_cache/v_cache (batch, capacity, nheads_k, headdim)``,
    ``cache_seqlens (batch,)`` int32, ``indices (batch, W)`` int32, ``num_indices (batch,)`` int32;
    returns ``(batch, Q, nheads, headdim)``. ``full_rows``: a sparse call's rows whose count covers all they
    hold (``num_indices[b] >= cache_seqlens[b]``) read everything whatever their ``indices`` row says (``W`` may be
    shorter than they hold; ``max_seqlen_k`` bounds their keys): the Triton kernel reads them without an index
    row, the other backends get the index rows written out (:func:`full_rows_written`). ``tuning``: the Triton
    kernel's launch heuristic (``None``: its defaults); the other backends have none.
    """
    if full_rows and indices is not None and backend != "triton":
        indices, num_indices = full_rows_written(indices, num_indices, cache_seqlens, max_seqlen_k, q.shape[1])
        full_rows = False
    kwargs = dict(softmax_scale=softmax_scale, indices=indices, num_indices=num_indices, max_seqlen_k=max_seqlen_k)
    if backend == "reference":
        return verify_attention_reference(q, k_cache, v_cache, cache_seqlens, **kwargs)
    if backend == "triton":
        from .triton_verify import verify_attention_triton

        with launch_device(q):
            return verify_attention_triton(
                q, k_cache, v_cache, cache_seqlens, **kwargs, full_rows=full_rows, tuning=tuning
            )
    if backend in ("flash_attn", "varlen"):
        from .varlen import verify_attention_varlen

        if q.dtype not in (torch.float16, torch.bfloat16):  # FlashAttention-2's kernels
            raise ValueError(
                f"backend {backend!r} runs fp16 or bf16 only (got {q.dtype}); "
                "use backend='triton' or 'reference' for float32"
            )

        return verify_attention_varlen(
            q, k_cache, v_cache, cache_seqlens, use_flash_attn=backend == "flash_attn", **kwargs
        )
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def full_rows_written(
    indices: torch.Tensor,
    num_indices: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int | None,
    n_queries: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, num_indices)`` of a ``full_rows`` call with every row's reads written out: a row whose count
    covers all it holds lists ``0 .. cache_seqlens[b] - 1`` (the index tensor widened to the longest such row,
    ``max_seqlen_k - n_queries`` when given, else found with one device->host sync)."""
    seqlens = cache_seqlens.to(indices.device, torch.int32)
    width = max(indices.shape[1], (max_seqlen_k - n_queries) if max_seqlen_k is not None else int(seqlens.max()))
    full = num_indices.to(indices.device, torch.int32) >= seqlens
    padded = torch.nn.functional.pad(indices, (0, width - indices.shape[1]))
    everything = torch.arange(width, device=indices.device, dtype=indices.dtype).expand_as(padded)
    return (
        torch.where(full[:, None], everything, padded).contiguous(),
        torch.where(full, seqlens, num_indices.to(indices.device, torch.int32)),
    )
