"""Fused RMSNorm (with the residual add before it), rotary embedding and projections for transformers' Llama,
Mistral and Qwen families, as a context.

    if fused_ops_available(target) and fused_ops_available(draft):
        with fused_ops(target, draft):
            ...  # capture CUDA graphs / decode

Why: a decode step replayed from CUDA graphs (Qwen2.5-7B target + 0.5B draft, batch 16) is thousands of
tiny elementwise kernels. transformers' RMSNorm is ~8 of them per call (253 calls a step) and
``apply_rotary_pos_emb`` ~10 per layer. :func:`rms_norm` and :func:`apply_rotary` are one Triton launch
each (:mod:`dustin_hf.kernels.triton_fused`) with transformers' numerics: rotary bit-exact; RMSNorm
rounds as transformers does, but its sum of squares is reduced in another order, so a few elements per
million (bf16) round one ulp the other way, at most 2 ulps of a 16-bit output.

What :func:`fused_ops` replaces, and why there (checked on transformers 5.17, 5.23, 5.24 and 5.25):

* **RMSNorm**: ``forward`` of every module instance whose class is in ``_RMS_NORM_CLASSES`` and whose
  ``forward`` compiles to the same bytecode as transformers' (:class:`_StandardRMSNorm`). Gemma's
  ``(1 + weight)`` norm is another function and is not listed. Where accelerate's device hook wraps
  the forward (``device_map``), the hook's ``_old_forward`` is replaced instead, so inputs still move.
* **Rotary**: the attention forwards of these families call the *module global*
  ``apply_rotary_pos_emb(query_states, key_states, cos, sin)`` by name. Without the ``kernels`` package the
  decorators around it (``@use_kernel_forward_from_hub("rotary_pos_emb")`` on the function,
  ``@use_kernelized_func(apply_rotary_pos_emb)`` on the attention class) do nothing. With it (a dependency of
  transformers from 5.25) the global is an ``nn.Module`` whose forward calls the function unless a model was
  ``kernelize()``-d, and the attention's forward routes the call to a per-model copy of that module. Either
  way the global in ``sys.modules[type(attention).__module__]`` is what runs, and what is replaced, when the
  function (itself, or the one the module wraps) and the module's ``rotate_half`` compile to transformers'
  standard bytecode, and no model given was ``kernelize()``-d (a hub kernel the user chose is left alone).
  That global is shared by every model of the family in the process; tensors on a device the kernel cannot
  run on go to the original global.

* **Projections** (fewer, larger GEMMs: at decode sizes each GEMM launch costs more than its
  arithmetic): an MLP of the standard form ``down(silu(gate(x)) * up(x))`` (``_MLP_CLASSES``, checked by
  bytecode, SiLU, no biases) runs one GEMM over ``[gate; up]`` and :func:`silu_mul` (both in one
  :func:`gated_linear` launch for a draft's weight at decode sizes, or a large target's at verification
  sizes: :class:`FusedTuning`), and its down projection at decode sizes as :func:`skinny_linear` (one
  launch where cuBLAS splits K and reduces in a second); an attention's
  ``q_proj``, ``k_proj`` and ``v_proj`` (plain ``nn.Linear``) run one GEMM over ``[q; k; v]`` when they are
  called on the same input, as every listed family's attention does: ``q_proj`` computes all three and
  ``k_proj``/``v_proj`` hand out their slices (on any other input each runs its own). That GEMM and ``o_proj``
  run as :func:`skinny_linear` for a draft's small weights at decode sizes (on sm_90 every kernel of its
  decode layer is then a Triton launch that starts as a dependent of the one before). The weights are not
  copied: each projection's weight (and bias) becomes a view of the fused tensor while the context is open,
  and gets its own storage back on exit. Numerics: SiLU·mul rounds as PyTorch does; a fused GEMM (and a
  skinny one) may reduce in another order than the separate ones (cuBLAS picks its kernel by shape), so its
  outputs can differ in the last bits.

* **Decoder layers and rotary tables** (for :class:`dustin_hf.runtime.graphs.Pipeline`, the staged forward the
  decode loop captures): nothing is replaced, the context only registers (:func:`fused_decoder_layer`,
  :func:`static_rotary`) the decoder layers (``_DECODER_LAYER_CLASSES``) whose forward compiles to
  transformers' standard pre-norm block (:class:`_StandardDecoderLayer`, both of its 5.17-5.25 spellings)
  with fused norms, called plainly (no hooks, no replaced forward, no offloading), and the rotary modules
  (``_ROTARY_CLASSES``) of a position-static rope type (``_STATIC_ROPE_TYPES``). The pipeline then runs
  such a layer submodule by submodule with each residual add inside the next norm's launch
  (:func:`add_rms_norm`: the add rounds as PyTorch's, the norm is :func:`rms_norm`'s kernel code, so the
  logits are the same bits), and gathers cos/sin rows from a table the module computed once. It also registers
  Qwen2 attention modules whose forward compiles to transformers' (:func:`fused_attention`): the pipeline runs
  their projections, then the rotary embedding and the cache's K/V write in one launch
  (:func:`rotary_write_kv`), then the attention function and ``o_proj`` (the same values, one launch fewer).

* **Greedy heads**: nothing is replaced; :class:`dustin_hf.runtime.graphs.Pipeline` takes the argmax of a greedy
  head's logits with :func:`argmax` (on CUDA one Triton launch, the same indices as ``torch.argmax``).

Where a listed class (or a modeling module's rotary function) compiles to other code than the one checked (a
transformers release newer than :data:`dustin_hf.compat.VERIFIED_RANGE`), that part keeps transformers' own
code, with one warning per process naming what differs: the outputs stay transformers', only launches are
saved elsewhere.

Everything is restored on exit, also on an exception (the fused weights only when the context made them: a
:class:`FusedWeights` given to it keeps them for the next context). Nested and repeated contexts are safe: what an
enclosing context already replaced is left to it. Enter the context before capturing CUDA graphs:
graphs captured outside it keep the unfused kernels, graphs captured inside keep the fused ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import importlib.util
import inspect
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
import transformers

from ..compat import VERIFIED_RANGE
from ..kernels.tuning import ArgmaxTuning, Checked, GemmTuning
from ._attention_reference import StandardQwen2Attention, StandardQwen2Attention524

__all__ = [
    "FusedOps", "FusedTuning", "FusedWeights", "add_rms_norm", "apply_rotary", "argmax", "fused_attention", "fused_decoder_layer",
    "fused_norm",
    "fused_ops", "fused_ops_available", "gated_linear", "rms_norm", "rotary_write_kv", "silu_mul", "skinny_linear",
    "static_rotary",
]

# RMSNorm classes with transformers' standard forward (identical in 5.17, 5.23, 5.24, 5.25); each instance is
# also checked against _StandardRMSNorm.forward's bytecode before it is replaced.
_RMS_NORM_CLASSES = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm",
})
# MLP classes with the standard ``down(act(gate(x)) * up(x))`` forward (5.17 to 5.25), checked by bytecode too.
_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_ATTENTION_CLASSES = frozenset({
    "LlamaAttention", "MistralAttention", "MixtralAttention", "Qwen2Attention", "Qwen2MoeAttention", "Qwen3Attention",
    "Qwen3MoeAttention",
})
# Decoder layers whose forward is the standard pre-norm block (5.17 to 5.25, checked by bytecode too).
_DECODER_LAYER_CLASSES = frozenset({
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen2MoeDecoderLayer", "Qwen3DecoderLayer",
    "Qwen3MoeDecoderLayer",
})
# Rotary modules computing cos/sin position by position from ``inv_freq`` (5.17 to 5.25), and the rope types
# whose ``inv_freq`` does not depend on the sequence length (transformers' ``dynamic_rope_update`` changes it for
# "dynamic" and "longrope" ones).
_ROTARY_CLASSES = frozenset({
    "LlamaRotaryEmbedding", "MistralRotaryEmbedding", "MixtralRotaryEmbedding", "Qwen2RotaryEmbedding",
    "Qwen2MoeRotaryEmbedding", "Qwen3RotaryEmbedding", "Qwen3MoeRotaryEmbedding",
})
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_MISSING = object()
# Decoder layers and rotary modules an open context registered for graphs.Pipeline's fused paths.
_REGISTERED: weakref.WeakSet = weakref.WeakSet()
# What the warning about unrecognised transformers code has already named in this process.
_WARNED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class FusedTuning(Checked):
    """Which projections :func:`fused_ops` runs through the Triton GEMMs, by rows and weight bytes (0 turns a
    path off).

    Attributes:
        skinny_rows: an MLP's down projection of at most this many rows (a draft's decode step: 16 rows at batch
            16, 32 in its first forward of a step) runs as :func:`skinny_linear`: cuBLAS runs the 0.5B draft's
            (K = 4864) as a split-K GEMM plus a reduction launch.
        gated_max_bytes: with at most this many bytes of ``[gate; up]`` weight, at up to ``skinny_rows`` rows, an
            MLP's gate/up GEMM and SiLU-mul run as one :func:`gated_linear` launch (a latency-bound GEMM: the
            0.5B draft's 17 MB).
        gated_min_large_bytes, gated_rows: ... and with at least ``gated_min_large_bytes``, at up to
            ``gated_rows`` rows (a large target's verification: 72B at batch 8 is 40 rows of 969 MB). Weights
            between the two limits (a 7B's 272 MB) keep cuBLAS, which is faster there; a down projection of
            more than ``skinny_rows`` rows keeps it too.
        skinny_projection_max_bytes: an attention's q/k/v (fused) and o_proj GEMMs of at most this many bytes of
            weight (the 0.5B draft's 2.1 and 1.6 MB), at up to ``skinny_rows`` rows, run as :func:`skinny_linear`
            launches, which can start as dependents of the kernel before them (cuBLAS's cannot). Larger weights
            keep cuBLAS.
    """

    minimum = 0

    skinny_rows: int = 32
    gated_max_bytes: int = 32 * 2**20
    gated_min_large_bytes: int = 512 * 2**20
    gated_rows: int = 64
    skinny_projection_max_bytes: int = 8 * 2**20


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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tuning: GemmTuning | None = None) -> torch.Tensor:
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
def fused_ops(*models: torch.nn.Module, tuning: FusedTuning | None = None,
              gemm: GemmTuning | None = None, weights: FusedWeights | None = None) -> Iterator[FusedOps]:
    """Run ``models``' RMSNorms and rotary embeddings through the fused kernels while the context is open.

    ``tuning``: which projections run as Triton GEMMs (``None``: the defaults); ``gemm``: those GEMMs' launch
    heuristic; ``weights``: where the concatenated projection weights come from and stay after the context
    (``None``: made for this context, every layer's own storage given back on exit). Raises ``ValueError`` for a model the kernels cannot run on (see :func:`fused_ops_available`; on
    CPU the Triton interpreter, ``TRITON_INTERPRET=1``, is accepted too). Yields a :class:`FusedOps`.
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
        yield FusedOps(norms=norms, rotary_modules=rotary, mlps=mlps, qkv=qkv, outputs=outputs, layers=layers,
                       rotary_tables=tables, attentions=attentions)
    finally:
        for restore in reversed(undo):
            restore()


# ----------------------------------------------------------------------------- RMSNorm


class _StandardRMSNorm:
    """transformers' RMSNorm forward, verbatim (the classes in ``_RMS_NORM_CLASSES``, 5.17 to 5.25): the bytecode
    a class's forward must compile to before its instances are replaced."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fuse_norm(module: torch.nn.Module, undo: list) -> bool:
    """Point ``module``'s forward at :func:`rms_norm`."""
    cls = type(module)
    if cls.__name__ not in _RMS_NORM_CLASSES or not _same_code(cls.forward, _StandardRMSNorm.forward):
        return False
    # a partial, not a bound method: it can carry the _dustin_fused tag
    return _replace_forward(module, functools.partial(_fused_rms_norm_forward, module), undo)


def _replace_forward(module: torch.nn.Module, forward: Callable, undo: list) -> bool:
    """Set ``module``'s forward (or accelerate's ``_old_forward`` under a device hook, so inputs still move)
    unless an enclosing context already replaced it; ``forward`` is tagged so that a nested one can tell."""
    hooked = hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__
    attr = "_old_forward" if hooked else "forward"
    current = module.__dict__.get(attr, _MISSING)
    if getattr(current, "_dustin_fused", False):
        return False  # an enclosing context did it
    forward._dustin_fused = True
    setattr(module, attr, forward)
    undo.append(functools.partial(_restore_attr, module, attr, current))
    return True


def _restore_attr(obj, attr: str, value) -> None:
    if value is _MISSING:
        delattr(obj, attr)
    else:
        setattr(obj, attr, value)


# ----------------------------------------------------------------------------- rotary embedding


# transformers' rotate_half and apply_rotary_pos_emb (Llama/Mistral/Qwen2/Qwen3 and MoE variants, 5.17 to
# 5.25), verbatim but for the docstrings' text: a module's pair is replaced only if it compiles to this bytecode.
def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _standard_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Applies Rotary Position Embedding to the query and key tensors."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


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
    return any("forward" in vars(f) for f in getattr(attention, "_kernel_funcs", {}).values()
               if isinstance(f, torch.nn.Module))


def _wrapped_function(fn) -> Callable | None:
    """The plain function ``fn`` runs: ``fn`` itself, or the one a ``kernels`` wrapper module calls.

    With the ``kernels`` package installed, ``@use_kernel_forward_from_hub`` turns a decorated function into an
    instance of a ``Func(nn.Module)`` class (tagged ``kernel_layer_name``) whose forward calls the function, held
    in its closure as ``func``, unless a model was kernelized. ``None`` for anything else (or a wrapper whose own
    forward was replaced)."""
    if inspect.isfunction(fn):
        return fn
    forward = getattr(type(fn), "forward", None)
    if not (isinstance(fn, torch.nn.Module) and hasattr(type(fn), "kernel_layer_name")
            and inspect.isfunction(forward) and "forward" not in vars(fn)):
        return None
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    inner = cells["func"].cell_contents if "func" in cells else None
    return inner if inspect.isfunction(inner) else None


def _standard_rotary(module: types.ModuleType) -> Callable | None:
    """The function behind ``module.apply_rotary_pos_emb`` if it and ``module.rotate_half`` are transformers'
    standard ones (:func:`_standard_apply_rotary_pos_emb`, :func:`rotate_half`), else ``None``."""
    function = _wrapped_function(getattr(module, "apply_rotary_pos_emb", None))
    if function is None or not _same_code(function, _standard_apply_rotary_pos_emb):
        return None
    if not _same_code(getattr(module, "rotate_half", None), rotate_half):
        return None
    return function if str(inspect.signature(function)) == "(q, k, cos, sin, unsqueeze_dim=1)" else None


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
        if not _triton_runs_on(q.device):  # another model of the family, e.g. on CPU
            return original(q, k, cos, sin, unsqueeze_dim)
        return apply_rotary(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._fused_original = original
    return apply_rotary_pos_emb


# ----------------------------------------------------------------------------- projections


class _StandardMLP:
    """transformers' gated MLP forward, verbatim (``_MLP_CLASSES``, 5.17 to 5.25)."""

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


def _plain_linears(*linears) -> bool:
    """Plain ``nn.Linear`` layers (not quantized or hooked) sharing one dtype and device, the Triton kernels' dtypes."""
    if not all(type(m) is torch.nn.Linear and not hasattr(m, "_hf_hook") for m in linears):
        return False
    weights = [m.weight for m in linears]
    return len({(w.dtype, w.device) for w in weights}) == 1 and weights[0].dtype in (
        torch.float16, torch.bfloat16, torch.float32) and _triton_runs_on(weights[0].device)


class FusedWeights:
    """The concatenated weights :func:`fused_ops` runs as one GEMM (``[q; k; v]``, ``[gate; up]``), kept from one
    context to the next.

    Each fused layer's parameters become views of the concatenation (no second copy of the weights). A context
    given no ``FusedWeights`` makes its own and gives every layer its own storage back on exit; a context given one
    leaves the concatenations in place, so CUDA graphs captured over them replay in a later context (the decode
    loop's :class:`~dustin_hf.decode.workspace.Workspace`). Until :meth:`release`, the layers' parameters share storage
    (views of one tensor that do not overlap: ``state_dict()``, ``save_pretrained`` and safetensors take them as
they take separate tensors). A layer whose parameters were replaced since
    (``param.data = ...``, ``model.to(...)``) is concatenated afresh and :attr:`generation` counts up.
    """

    def __init__(self):
        # per fused group of layers: the layers, the weight and bias concatenations, and the parameters' addresses
        self._held: dict[tuple[int, ...], tuple[tuple, torch.Tensor, torch.Tensor | None, tuple[int, ...]]] = {}
        self.generation = 0  # counts concatenations made: graphs captured over older ones read freed memory

    def share(self, linears) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``linears``' weights (and biases) concatenated along the output dimension, the layers' parameters views
        of them: the held concatenation while the parameters are still its views, else a new one."""
        key = tuple(id(m) for m in linears)
        held = self._held.get(key)
        if held is not None and all(a is b for a, b in zip(held[0], linears)) and held[3] == _addresses(linears):
            return held[1], held[2]
        fused = []
        for name in ("weight", "bias"):
            params = [getattr(m, name) for m in linears]
            if params[0] is None:
                fused.append(None)
                continue
            whole = torch.cat([p.detach() for p in params])
            for param, view in zip(params, whole.split([p.shape[0] for p in params])):
                param.data = view  # the layer's own storage (or an older concatenation) is released here
            fused.append(whole)
        self._held[key] = (tuple(linears), fused[0], fused[1], _addresses(linears))
        self.generation += 1
        return fused[0], fused[1]

    def release(self) -> None:
        """Give every layer still viewing a held concatenation its own storage back; hold nothing."""
        held, self._held = self._held, {}
        for linears, _, _, addresses in held.values():
            if _addresses(linears) == addresses:  # not replaced since (else nothing of ours to undo)
                for m in linears:
                    for param in (m.weight, m.bias):
                        if param is not None:
                            param.data = param.data.clone()  # the concatenation goes once every view is replaced


def _addresses(linears) -> tuple[int, ...]:
    return tuple(p.data_ptr() for m in linears for p in (m.weight, m.bias) if p is not None)


def _fuse_mlp(module: torch.nn.Module, undo: list, weights: FusedWeights, tuning: FusedTuning,
              gemm: GemmTuning | None) -> bool:
    """``down(silu(gate(x)) * up(x))`` as one GEMM over ``[gate; up]`` and one :func:`silu_mul` launch."""
    cls = type(module)
    if cls.__name__ not in _MLP_CLASSES or not _same_code(cls.forward, _StandardMLP.forward):
        return False
    gate, up = module.gate_proj, module.up_proj
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    if not (silu and gate.bias is None and up.bias is None and _plain_linears(gate, up, module.down_proj)):
        return False
    if getattr(module.__dict__.get("forward"), "_dustin_fused", False):
        return False  # an enclosing context did it
    weight, _ = weights.share((gate, up))
    down = module.down_proj
    weight_bytes = weight.numel() * weight.element_size()
    gated_rows = (tuning.skinny_rows if weight_bytes <= tuning.gated_max_bytes
                  else tuning.gated_rows if weight_bytes >= tuning.gated_min_large_bytes else 0)

    def forward(x):
        if x.numel() <= gated_rows * x.shape[-1]:  # decode-sized: one launch, no gate_up tensor
            hidden = gated_linear(x, weight, gemm)
        else:
            hidden = silu_mul(torch.nn.functional.linear(x, weight))
        if hidden.numel() <= tuning.skinny_rows * hidden.shape[-1]:  # decode-sized: no split-K + reduction launch
            return skinny_linear(hidden, down.weight, down.bias, gemm)
        return down(hidden)

    return _replace_forward(module, forward, undo)


def _fuse_qkv(module: torch.nn.Module, undo: list, weights: FusedWeights, tuning: FusedTuning,
              gemm: GemmTuning | None) -> bool:
    """``q_proj``, ``k_proj``, ``v_proj`` of one input as one GEMM over ``[q; k; v]``."""
    if type(module).__name__ not in _ATTENTION_CLASSES:
        return False
    q, k, v = (getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    if not _plain_linears(q, k, v) or len({m.bias is None for m in (q, k, v)}) != 1:
        return False
    if getattr(q.__dict__.get("forward"), "_dustin_fused", False):
        return False  # an enclosing context did it
    weight, bias = weights.share((q, k, v))
    n_q, n_k = q.out_features, k.out_features
    last = {}  # the input q_proj last saw and the fused projection of it, until v_proj takes its slice

    def q_forward(x):
        out = _projection(x, weight, bias, tuning, gemm)
        last.update(x=x, out=out)
        return out[..., :n_q]

    def k_forward(x):
        if last.get("x") is x:
            return last["out"][..., n_q : n_q + n_k]
        return torch.nn.functional.linear(x, k.weight, k.bias)

    def v_forward(x):
        if last.get("x") is x:
            out = last.pop("out")
            last.clear()
            return out[..., n_q + n_k :]
        return torch.nn.functional.linear(x, v.weight, v.bias)

    for layer, forward in ((q, q_forward), (k, k_forward), (v, v_forward)):
        _replace_forward(layer, forward, undo)
    return True


def _fuse_output(module: torch.nn.Module, undo: list, tuning: FusedTuning, gemm: GemmTuning | None) -> bool:
    """An attention's ``o_proj`` through :func:`_projection` (one :func:`skinny_linear` launch at decode sizes)."""
    o = getattr(module, "o_proj", None)
    if type(module).__name__ not in _ATTENTION_CLASSES or not _plain_linears(o):
        return False
    return _replace_forward(o, lambda x: _projection(x, o.weight, o.bias, tuning, gemm), undo)


def _projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tuning: FusedTuning,
                gemm: GemmTuning | None) -> torch.Tensor:
    """``F.linear``; for at most ``tuning.skinny_rows`` rows and ``tuning.skinny_projection_max_bytes`` of weight
    one :func:`skinny_linear` launch."""
    if (x.numel() <= tuning.skinny_rows * x.shape[-1]
            and weight.numel() * weight.element_size() <= tuning.skinny_projection_max_bytes):
        return skinny_linear(x, weight, bias, gemm)
    return torch.nn.functional.linear(x, weight, bias)


# ----------------------------------------------------------------------------- decoder layers, rotary tables


def fused_decoder_layer(layer: torch.nn.Module) -> bool:
    """Whether an open :func:`fused_ops` context registered ``layer`` for the fused decoder-layer path.

    A registered layer's forward is transformers' standard pre-norm block (:class:`_StandardDecoderLayer`),
    so calling its submodules in that order with the arguments it passes them computes what it computes;
    both its norms are fused RMSNorms (:func:`fused_norm`), so each residual add can run inside the RMSNorm
    launch after it (:func:`add_rms_norm`). Nothing wraps it that would be skipped: no torch hooks, no
    replaced forward, no accelerate hook that offloads weights.
    """
    return layer in _REGISTERED


def fused_attention(module: torch.nn.Module) -> bool:
    """Whether an open :func:`fused_ops` context registered the attention ``module`` for the pipeline's own path.

    A registered module's forward is transformers' Qwen2 attention
    (:class:`~dustin_hf.runtime._attention_reference.StandardQwen2Attention`, both spellings): projections,
    ``apply_rotary_pos_emb``, the cache's ``update``, the attention function registered for the model,
    ``o_proj``; nothing wraps it. So the pipeline may call those pieces itself,
    with :func:`rotary_write_kv` doing the rotary embedding and the K/V write in one launch. Llama and
    Mistral attentions (another call of the attention function) and Qwen3's (norms on q and k) are not
    registered and run their own forward.
    """
    return module in _REGISTERED


def rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, row0: int) -> torch.Tensor:
    """:func:`apply_rotary` of ``q, k (B, T, H, D)`` and the cache write of the rotated keys and ``v`` at ``slots``
    (rows ``row0..``), in one launch; returns ``q_embed (B, T, Hq, D)``
    (:func:`dustin_hf.kernels.triton_fused.rotary_write_kv_triton`)."""
    _check_device(q)
    from ..kernels.triton_fused import rotary_write_kv_triton

    return rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, row0)


def static_rotary(module: torch.nn.Module) -> bool:
    """Whether an open :func:`fused_ops` context registered the rotary ``module`` for a table of cos/sin rows.

    A registered module computes each position's cos/sin from its ``inv_freq`` alone, element by element,
    and its ``rope_type`` never changes ``inv_freq`` with the sequence length (``_STATIC_ROPE_TYPES``), so
    the rows of positions ``0..capacity-1``, computed once by the module, are its output for any positions.
    """
    return module in _REGISTERED


def fused_norm(module: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """``(weight, eps)`` of an RMSNorm whose forward an open context replaced with :func:`rms_norm`, else ``None``."""
    for attr in ("_old_forward", "forward"):
        forward = module.__dict__.get(attr)
        if getattr(forward, "func", None) is _fused_rms_norm_forward:
            return module.weight, module.variance_epsilon
    return None


class _StandardDecoderLayer:
    """transformers' decoder-layer forward, verbatim (``_DECODER_LAYER_CLASSES``, 5.17 and 5.23; its form from 5.24
    names the cache ``cache``, :class:`_StandardDecoderLayer524`). No docstring: it would be a constant."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class _StandardDecoderLayer524:
    """The same forward as transformers 5.24 writes it (the cache argument is ``cache``)."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def _standard_layer(module: torch.nn.Module) -> bool:
    cls = type(module)
    if cls.__name__ not in _DECODER_LAYER_CLASSES or not _runs_as_its_class(module) or not _standard_layer_code(cls):
        return False
    norms = (getattr(module, name, None) for name in ("input_layernorm", "post_attention_layernorm"))
    return all(norm is not None and fused_norm(norm) is not None for norm in norms)


def _standard_layer_code(cls: type) -> bool:
    forward = inspect.unwrap(cls.forward)  # 5.24 wraps it in deprecate_kwarg
    return any(_same_code(forward, ref.forward) for ref in (_StandardDecoderLayer, _StandardDecoderLayer524))


def _standard_attention(module: torch.nn.Module) -> bool:
    return (type(module).__name__ == "Qwen2Attention" and _runs_as_its_class(module)
            and _standard_attention_code(type(module)))


def _standard_attention_code(cls: type) -> bool:
    # 5.24 wraps the forward in deprecate_kwarg; with the kernels package, use_kernelized_func wraps it once more
    forward = inspect.unwrap(cls.forward)
    return any(_same_code(forward, ref.forward) for ref in (StandardQwen2Attention, StandardQwen2Attention524))


def _static_rotary(module: torch.nn.Module) -> bool:
    rope_type = getattr(module, "rope_type", None)
    return (type(module).__name__ in _ROTARY_CLASSES and isinstance(rope_type, str)
            and rope_type in _STATIC_ROPE_TYPES and _runs_as_its_class(module))


def _runs_as_its_class(module: torch.nn.Module) -> bool:
    """Calling ``module`` runs its class's forward and nothing else: no torch hooks, no forward set on the
    instance but accelerate's device hook (which only moves inputs) without weight offloading."""
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    if "forward" not in module.__dict__:
        return True
    hook, old = getattr(module, "_hf_hook", None), module.__dict__.get("_old_forward")
    hooks = getattr(hook, "hooks", (hook,))  # a SequentialHook holds several
    return (getattr(old, "__func__", None) is type(module).forward
            and not any(getattr(h, "offload", False) for h in hooks))


def _register(module: torch.nn.Module, check: Callable[[torch.nn.Module], bool], undo: list) -> bool:
    """Register ``module`` for graphs.Pipeline's fused paths if ``check`` passes (and no enclosing context did)."""
    if module in _REGISTERED or not check(module):
        return False
    _REGISTERED.add(module)
    undo.append(functools.partial(_REGISTERED.discard, module))
    return True


# ----------------------------------------------------------------------------- unrecognised code


def _unrecognised(modules) -> list[str]:
    """What of ``modules`` a fused path is listed for but whose code differs from the one checked (the class's
    forward, or its modeling module's rotary function): each part keeps transformers' own code."""
    found = []
    for module in modules:
        cls = type(module)
        name = cls.__name__
        if ((name in _RMS_NORM_CLASSES and not _same_code(cls.forward, _StandardRMSNorm.forward))
                or (name in _MLP_CLASSES and not _same_code(cls.forward, _StandardMLP.forward))
                or (name in _DECODER_LAYER_CLASSES and not _standard_layer_code(cls))
                or (name == "Qwen2Attention" and not _standard_attention_code(cls))):
            found.append(f"{cls.__module__}.{cls.__qualname__}.forward")
        if name in _ATTENTION_CLASSES and cls.__module__ in sys.modules:
            modeling = sys.modules[cls.__module__]
            rotary = getattr(modeling, "apply_rotary_pos_emb", None)
            if not hasattr(rotary, "_fused_original") and _standard_rotary(modeling) is None:
                found.append(f"{cls.__module__}.apply_rotary_pos_emb")
    return list(dict.fromkeys(found))


def _warn_unrecognised(modules) -> None:
    """One warning per process for each unrecognised part (:func:`_unrecognised`) not named before."""
    new = [name for name in _unrecognised(modules) if name not in _WARNED]
    if not new:
        return
    _WARNED.update(new)
    low, high = VERIFIED_RANGE
    warnings.warn(
        f"dustin_hf's fused decode kernels do not apply to {', '.join(new)} in transformers "
        f"{transformers.__version__}: that code differs from what dustin_hf checked (transformers {low} to {high}). "
        "Those parts run transformers' own code (the same outputs, more kernel launches); the rest stays fused.",
        stacklevel=4,
    )


# ----------------------------------------------------------------------------- helpers


def _same_code(fn, reference) -> bool:
    """Whether ``fn`` compiles to ``reference``'s instructions, names and constants (docstrings' text aside).

    Instructions are compared by operation and argument, with two differences a compiler makes for the same
    source ignored: the method-call form of an attribute load (CPython 3.11 patch releases differ in when they
    emit ``LOAD_METHOD`` for a call written over several lines, and a wheel's bytecode may come from another
    one) and, with it, the byte offsets jumps land on."""
    code = getattr(fn, "__code__", None)
    return code is not None and _same_code_objects(code, reference.__code__)


@functools.lru_cache(maxsize=None)  # every context checks every module: a model's classes share a few functions
def _same_code_objects(code, ref) -> bool:
    def consts(c):
        return tuple("<str>" if isinstance(x, str) else x for x in c.co_consts)

    def instructions(c):
        jumps = set(dis.hasjrel) | set(dis.hasjabs)
        return [("LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname, None if i.opcode in jumps else i.argval)
                for i in dis.get_instructions(c)]

    return (instructions(code), code.co_names, code.co_varnames, consts(code)) == (
        instructions(ref), ref.co_names, ref.co_varnames, consts(ref)
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _argmax_kernel_runs_on(device: torch.device) -> bool:
    return _has_triton() and _triton_runs_on(device)


def _check_device(t: torch.Tensor) -> None:
    if not _triton_runs_on(t.device):
        raise ValueError(
            f"the fused kernels run in Triton: they need CUDA tensors (got {t.device}), or on CPU the "
            "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
