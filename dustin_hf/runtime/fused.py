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
* **Rotary**: the attention forwards of these families call the *module global* ``apply_rotary_pos_emb`` by name.
  Without the ``kernels`` package the decorators around it do nothing; with it (a dependency of transformers from
  5.25) the global is an ``nn.Module`` whose forward calls the function unless a model was ``kernelize()``-d, and
  the attention routes the call to a per-model copy of that module. Either way the global in
  ``sys.modules[type(attention).__module__]`` is what runs, and what is replaced, unless a model given was
  ``kernelize()``-d (a hub kernel the user chose is left alone). That global is shared by every model of the
  family in the process; tensors on a device the kernel cannot run on go to the original global.
* **Projections**: MLPs as one ``[gate; up]`` GEMM, an attention's q/k/v as one GEMM, small ones as Triton GEMMs
  (:mod:`~dustin_hf.runtime.projections`).
* **Decoder layers, rotary tables, Qwen2 attentions**: nothing is replaced; the context registers them for
  :class:`dustin_hf.runtime.graphs.Pipeline`'s fused paths (:mod:`~dustin_hf.runtime.registry`).

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
import sys
import types
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
    rotary_write_kv,
    silu_mul,
    skinny_linear,
    triton_runs_on,
)
from .projections import FusedTuning, FusedWeights, _fuse_mlp, _fuse_output, _fuse_qkv
from .recognise import _RMS_NORM_CLASSES, _standard_norm_code, _standard_rotary, _warn_unrecognised
from .registry import (
    _register,
    _replace_forward,
    _standard_attention,
    _standard_layer,
    _static_rotary,
    fused_attention,
    fused_decoder_layer,
    fused_norm,
    static_rotary,
)

__all__ = [
    "FusedOps",
    "FusedTuning",
    "FusedWeights",
    "add_rms_norm",
    "apply_rotary",
    "argmax",
    "fused_attention",
    "fused_decoder_layer",
    "fused_norm",
    "fused_ops",
    "fused_ops_available",
    "gated_linear",
    "rms_norm",
    "rotary_write_kv",
    "silu_mul",
    "skinny_linear",
    "static_rotary",
]


@dataclasses.dataclass(frozen=True)
class FusedOps:
    """What one :func:`fused_ops` context replaced (not what an enclosing context had already replaced).

    Attributes:
        norms: RMSNorm modules whose forward now calls :func:`rms_norm`.
        rotary_modules: modeling modules whose ``apply_rotary_pos_emb`` now calls :func:`apply_rotary`.
        mlps: MLPs running one ``[gate; up]`` GEMM and :func:`silu_mul`.
        qkv: attentions whose q/k/v projections run as one GEMM.
        outputs: attentions whose ``o_proj`` runs as :func:`skinny_linear` at decode sizes.
        layers: decoder layers :class:`~dustin_hf.runtime.graphs.Pipeline` runs submodule by submodule with each
            residual add fused into the next RMSNorm (:func:`fused_decoder_layer`).
        rotary_tables: rotary modules whose cos/sin :class:`~dustin_hf.runtime.graphs.Pipeline` reads from a
            table of every cache position (:func:`static_rotary`).
        attentions: attention modules :class:`~dustin_hf.runtime.graphs.Pipeline` runs from their projections, with
            the rotary embedding and the K/V write in one launch (:func:`fused_attention`).
    """

    norms: int
    rotary_modules: tuple[str, ...]
    mlps: int = 0
    qkv: int = 0
    outputs: int = 0
    layers: int = 0
    rotary_tables: int = 0
    attentions: int = 0


@contextlib.contextmanager
def fused_ops(
    *models: torch.nn.Module,
    tuning: FusedTuning | None = None,
    gemm: GemmTuning | None = None,
    weights: FusedWeights | None = None,
) -> Iterator[FusedOps]:
    """Run ``models``' RMSNorms and rotary embeddings through the fused kernels while the context is open.

    ``tuning``: which projections run as Triton GEMMs (``None``: the defaults); ``gemm``: those GEMMs' launch
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
        modules = list(dict.fromkeys(m for model in models for m in model.modules()))  # a model given twice: once
        _warn_unrecognised(modules)
        norms = sum(_fuse_norm(m, undo) for m in modules)
        rotary = tuple(name for name in _attention_modules(models) if _fuse_rotary(sys.modules[name], undo))
        mlps = sum(_fuse_mlp(m, undo, weights, tuning, gemm) for m in modules)
        qkv = sum(_fuse_qkv(m, undo, weights, tuning, gemm) for m in modules)
        outputs = sum(_fuse_output(m, undo, tuning, gemm) for m in modules)
        layers = sum(_register(m, _standard_layer, undo) for m in modules)
        tables = sum(_register(m, _static_rotary, undo) for m in modules)
        attentions = sum(_register(m, _standard_attention, undo) for m in modules)
        yield FusedOps(
            norms=norms,
            rotary_modules=rotary,
            mlps=mlps,
            qkv=qkv,
            outputs=outputs,
            layers=layers,
            rotary_tables=tables,
            attentions=attentions,
        )
    finally:
        for restore in reversed(undo):
            restore()


def _fuse_norm(module: torch.nn.Module, undo: list) -> bool:
    """Point ``module``'s forward at :func:`rms_norm`."""
    cls = type(module)
    if cls.__name__ not in _RMS_NORM_CLASSES or not _standard_norm_code(cls):
        return False
    # a partial, not a bound method: it can carry the _dustin_fused tag
    return _replace_forward(module, functools.partial(_fused_rms_norm_forward, module), undo)


def _attention_modules(models) -> list[str]:
    """Names of the modules defining the models' attention classes, in first-seen order, but none where an
    attention of the models was ``kernelize()``-d (its rotary call then goes to the hub kernel the user chose)."""
    attentions = [m for model in models for m in model.modules() if type(m).__name__.endswith("Attention")]
    kernelized = {type(m).__module__ for m in attentions if _kernelized(m)}
    names = (type(m).__module__ for m in attentions)
    return [name for name in dict.fromkeys(names) if name in sys.modules and name not in kernelized]


def _kernelized(attention: torch.nn.Module) -> bool:
    """Whether ``kernels.kernelize`` gave ``attention`` a kernel of its own for a function it calls (the ``kernels``
    package keeps one wrapper module per model in ``_kernel_funcs``; ``kernelize`` sets that wrapper's forward)."""
    return any(
        "forward" in vars(f)
        for f in getattr(attention, "_kernel_funcs", {}).values()
        if isinstance(f, torch.nn.Module)
    )


def _fuse_rotary(module: types.ModuleType, undo: list) -> bool:
    """Replace ``module.apply_rotary_pos_emb`` with a call to :func:`apply_rotary` if it is the standard one."""
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None or hasattr(original, "_fused_original"):
        return False  # none, or an enclosing context did it
    function = _standard_rotary(module)
    if function is None:
        return False
    module.apply_rotary_pos_emb = _fused_rotary(original, function)
    undo.append(functools.partial(setattr, module, "apply_rotary_pos_emb", original))
    return True


def _fused_rotary(original: Callable, function: Callable) -> Callable:
    """``apply_rotary_pos_emb`` through :func:`apply_rotary`; ``original`` (the global it replaces: the standard
    ``function``, or the ``kernels`` wrapper calling it) where the kernel cannot run."""

    @functools.wraps(function)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not triton_runs_on(q.device):  # another model of the family, e.g. on CPU
            return original(q, k, cos, sin, unsqueeze_dim)
        return apply_rotary(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._fused_original = original
    return apply_rotary_pos_emb
