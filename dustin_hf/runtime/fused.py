"""Fused RMSNorm (with the residual add before it), rotary embedding and projections for transformers' Llama,
Mistral and Qwen families, as a context.

    if fused_ops_available(target) and fused_ops_available(draft):
        with fused_ops(target, draft):
            ...  # capture CUDA graphs / decode

:func:`fused_ops` swaps the launch functions of :mod:`~dustin_hf.runtime.ops` into the models' code where that code
is transformers' own (:mod:`~dustin_hf.runtime.recognise` checks it against the copies in
:mod:`~dustin_hf.runtime._transformers_reference`; code it does not recognise stays, with one warning):

* **RMSNorm**: ``forward`` of every recognised module instance (Gemma's ``(1 + weight)`` norm is another function
  and is not listed). Where accelerate's device hook wraps the forward (``device_map``), the hook's
  ``_old_forward`` is replaced instead, so inputs still move.
* **Rotary**: each attention's own ``apply_rotary_pos_emb`` wrapper, the extension point transformers gives it (with
  the ``kernels`` package from 0.19), else that attention's forward as a copy of its class's calling the kernel by
  that name (:mod:`~dustin_hf.runtime.rotary`). No module global is replaced.
* **Projections**: MLPs as one ``[gate; up]`` GEMM, an attention's q/k/v as one GEMM, small ones as Triton GEMMs
  (:mod:`~dustin_hf.runtime.projections`).
* **Decoder layers**: nothing is replaced; the context registers them for
  :class:`dustin_hf.runtime.pipeline.Pipeline`'s fused layer path (:mod:`~dustin_hf.runtime.registry`).

Each path can be turned off on its own (:class:`FusedTuning`'s switches), which ``benchmarks/surgery.py`` uses to
measure what each buys against transformers' own code.

Everything is restored on exit, also on an exception (the fused weights only when the context made them: a
:class:`FusedWeights` given to it keeps them for the next context). Nested and repeated contexts are safe: what an
enclosing context already replaced is left to it. Enter the context before capturing CUDA graphs:
graphs captured outside it keep the unfused kernels, graphs captured inside keep the fused ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Callable, Iterator

import torch

from ..kernels.tuning import GemmTuning
from .ops import (
    _fused_rms_norm_forward,
    _interpreting,
    add_rms_norm,
    apply_rotary,
    argmax,
    fused_ops_available,
    gated_linear,
    rms_norm,
    silu_mul,
    skinny_linear,
)
from .projections import FusedTuning, FusedWeights, _fuse_mlp, _fuse_qkv
from .recognise import _RMS_NORM_CLASSES, _standard_norm_code, _warn_unrecognised
from .registry import _register, _replace_forward, _standard_layer, fused_decoder_layer, fused_norm
from .rotary import fuse_rotary

__all__ = [
    "FusedOps",
    "FusedTuning",
    "FusedWeights",
    "add_rms_norm",
    "apply_rotary",
    "argmax",
    "fused_decoder_layer",
    "fused_norm",
    "fused_ops",
    "fused_ops_available",
    "gated_linear",
    "rms_norm",
    "silu_mul",
    "skinny_linear",
]


@dataclasses.dataclass(frozen=True)
class FusedOps:
    """What one :func:`fused_ops` context replaced (not what an enclosing context had already replaced).

    Attributes:
        norms: RMSNorm modules whose forward now calls :func:`rms_norm`.
        rotary_modules: modeling modules of the attentions whose ``apply_rotary_pos_emb`` now calls
            :func:`apply_rotary` (:mod:`~dustin_hf.runtime.rotary`).
        mlps: MLPs running one ``[gate; up]`` GEMM and :func:`silu_mul`.
        qkv: attentions whose q/k/v projections run as one GEMM.
        layers: decoder layers :class:`~dustin_hf.runtime.pipeline.Pipeline` runs submodule by submodule with each
            residual add fused into the next RMSNorm (:func:`fused_decoder_layer`).
    """

    norms: int
    rotary_modules: tuple[str, ...]
    mlps: int = 0
    qkv: int = 0
    layers: int = 0


@contextlib.contextmanager
def fused_ops(
    *models: torch.nn.Module,
    tuning: FusedTuning | None = None,
    gemm: GemmTuning | None = None,
    weights: FusedWeights | None = None,
) -> Iterator[FusedOps]:
    """Run ``models``' RMSNorms and rotary embeddings through the fused kernels while the context is open.

    ``tuning``: which fused paths to take and which projections run as Triton GEMMs (``None``: the defaults, every
    path); ``gemm``: those GEMMs' launch
    heuristic; ``weights``: where the concatenated projection weights come from and stay after the context
    (``None``: made for this context, every layer's own storage given back on exit). Raises ``ValueError`` for a
    model the kernels cannot run on (see :func:`fused_ops_available`; on CPU the Triton interpreter,
    ``TRITON_INTERPRET=1``, is accepted too). Yields a :class:`FusedOps`.
    """
    tuning = tuning or FusedTuning()
    for model in models:
        if not (fused_ops_available(model) or (_interpreting() and importlib.util.find_spec("triton"))):
            devices = sorted({str(p.device) for p in model.parameters()})
            raise ValueError(
                f"fused_ops needs triton and {type(model).__name__} on CUDA (parameters on {devices}); "
                "check fused_ops_available(model) first and run without fused_ops when it is False"
            )
    undo: list[Callable[[], None]] = []
    if weights is None:
        weights = FusedWeights()
        undo.append(weights.release)
    try:
        yield _fuse(models, tuning, gemm, weights, undo)
    finally:
        for restore in reversed(undo):
            restore()


def _fuse(models, tuning: FusedTuning, gemm: GemmTuning | None, weights: FusedWeights, undo: list) -> FusedOps:
    """Take every fused path ``tuning`` leaves on for ``models``' modules, each change's undo added to ``undo``."""
    modules = list(dict.fromkeys(m for model in models for m in model.modules()))  # a model given twice: once
    _warn_unrecognised(modules)

    def count(switch: bool, fuse) -> int:
        return sum(fuse(m) for m in modules) if switch else 0

    norms = count(tuning.norms, lambda m: _fuse_norm(m, undo))
    rotary = [m for m in modules if tuning.rotary and fuse_rotary(m, undo)]
    mlps = count(tuning.mlps, lambda m: _fuse_mlp(m, undo, weights, tuning, gemm))
    qkv = count(tuning.qkv, lambda m: _fuse_qkv(m, undo, weights, tuning, gemm))
    layers = count(tuning.layers, lambda m: _register(m, _standard_layer, undo))  # only with fused norms
    return FusedOps(
        norms=norms,
        rotary_modules=tuple(dict.fromkeys(type(m).__module__ for m in rotary)),
        mlps=mlps,
        qkv=qkv,
        layers=layers,
    )


def _fuse_norm(module: torch.nn.Module, undo: list) -> bool:
    """Point ``module``'s forward at :func:`rms_norm`."""
    cls = type(module)
    if cls.__name__ not in _RMS_NORM_CLASSES or not _standard_norm_code(cls):
        return False
    # a partial, not a bound method: it can carry the _dustin_fused tag
    return _replace_forward(module, functools.partial(_fused_rms_norm_forward, module), undo)
