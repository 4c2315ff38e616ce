"""Fused RMSNorm and rotary embedding for transformers' Llama, Mistral and Qwen families, as an opt-in context.

    if fused_ops_available(target) and fused_ops_available(draft):
        with fused_ops(target, draft):
            ...  # capture CUDA graphs / decode

Why: a decode step replayed from CUDA graphs (Qwen2.5-7B target + 0.5B draft, batch 16) ran ~4400 tiny
elementwise kernels, ~9 ms of GPU time. transformers' RMSNorm is ~8 of them per call (253 calls a step)
and ``apply_rotary_pos_emb`` ~10 per layer. :func:`rms_norm` and :func:`apply_rotary` are one Triton
launch each (:mod:`dustin_hf.kernels.triton_fused`) with transformers' numerics: rotary bit-exact;
RMSNorm rounds as transformers does, but its sum of squares is reduced in another order, so a few
elements per million (H200, bf16) round one ulp the other way, at most 2 ulps of a 16-bit output.
Under CUDA graphs on an H200 (80 rows, bf16) a norm of 3584 took 1.9 us instead of 21 us, the rotary
of 28 + 4 heads of 128 at batch 16 x 5 positions 2.7 us instead of 26 us.

What :func:`fused_ops` replaces, and why there (checked on transformers 5.17, 5.23 and 5.24):

* **RMSNorm**: ``forward`` of every module instance whose class is in ``_RMS_NORM_CLASSES`` and whose
  ``forward`` compiles to the same bytecode as transformers' (:class:`_StandardRMSNorm`). Gemma's
  ``(1 + weight)`` norm is another function and is not listed. Where accelerate's device hook wraps
  the forward (``device_map``), the hook's ``_old_forward`` is replaced instead, so inputs still move.
* **Rotary**: the attention forwards of these families call the *module global*
  ``apply_rotary_pos_emb(query_states, key_states, cos, sin)`` by name. The class decorator
  ``@use_kernelized_func(apply_rotary_pos_emb)`` only hands the function to the ``kernels`` package's
  ``kernelize()`` (an instance attribute the forward never calls), and
  ``@use_kernel_forward_from_hub("rotary_pos_emb")`` only tags the function (without ``kernels``
  installed, both do nothing). So the global in ``sys.modules[type(attention).__module__]`` is what
  runs, and what is replaced, when it and the module's ``rotate_half`` compile to transformers' standard
  bytecode. That global is shared by every model of the family in the process; tensors on a device the
  kernel cannot run on go to the original function.

Everything is restored on exit, also on an exception. Nested and repeated contexts are safe: what an
enclosing context already replaced is left to it. Enter the context before capturing CUDA graphs:
graphs captured outside it keep the unfused kernels, graphs captured inside keep the fused ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator

import torch

__all__ = ["FusedOps", "apply_rotary", "fused_ops", "fused_ops_available", "rms_norm"]

# RMSNorm classes with transformers' standard forward (identical in 5.17, 5.23, 5.24); each instance is
# also checked against _StandardRMSNorm.forward's bytecode before it is replaced.
_RMS_NORM_CLASSES = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm",
})
_MISSING = object()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in one Triton launch: ``weight * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)``.

    ``x (..., N)`` and ``weight (N,)`` fp16/bf16/fp32 on one device (CUDA, or CPU under
    ``TRITON_INTERPRET=1``). Returns ``x.shape`` in ``torch.promote_types(weight.dtype, x.dtype)``.
    """
    _check_device(x)
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}; they must share a device")
    from .kernels.triton_fused import rms_norm_triton

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
    from .kernels.triton_fused import apply_rotary_triton

    return apply_rotary_triton(q, k, cos, sin, unsqueeze_dim)


def fused_ops_available(model: torch.nn.Module) -> bool:
    """True when triton is importable and every parameter of ``model`` is on a CUDA device."""
    return importlib.util.find_spec("triton") is not None and all(p.is_cuda for p in model.parameters())


@dataclasses.dataclass(frozen=True)
class FusedOps:
    """What one :func:`fused_ops` context replaced (not what an enclosing context had already replaced).

    Attributes:
        norms: RMSNorm modules whose forward now calls :func:`rms_norm`.
        rotary_modules: modeling modules whose ``apply_rotary_pos_emb`` now calls :func:`apply_rotary`.
    """

    norms: int
    rotary_modules: tuple[str, ...]


@contextlib.contextmanager
def fused_ops(*models: torch.nn.Module) -> Iterator[FusedOps]:
    """Run ``models``' RMSNorms and rotary embeddings through the fused kernels while the context is open.

    Raises ``ValueError`` for a model the kernels cannot run on (see :func:`fused_ops_available`; on
    CPU the Triton interpreter, ``TRITON_INTERPRET=1``, is accepted too). Yields a :class:`FusedOps`.
    """
    for model in models:
        if not (fused_ops_available(model) or (_interpreting() and importlib.util.find_spec("triton"))):
            devices = sorted({str(p.device) for p in model.parameters()})
            raise ValueError(
                f"fused_ops needs triton and {type(model).__name__} on CUDA (parameters on {devices}); "
                "check fused_ops_available(model) first and run without fused_ops when it is False"
            )
    undo: list[Callable[[], None]] = []
    try:
        norms = sum(_fuse_norm(m, undo) for model in models for m in model.modules())
        rotary = tuple(name for name in _attention_modules(models) if _fuse_rotary(sys.modules[name], undo))
        yield FusedOps(norms=norms, rotary_modules=rotary)
    finally:
        for restore in reversed(undo):
            restore()


# ----------------------------------------------------------------------------- RMSNorm


class _StandardRMSNorm:
    """transformers' RMSNorm forward, verbatim (the classes in ``_RMS_NORM_CLASSES``, 5.17 to 5.24): the bytecode
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
    """Point ``module``'s forward (or accelerate's ``_old_forward`` under a device hook) at :func:`rms_norm`."""
    cls = type(module)
    if cls.__name__ not in _RMS_NORM_CLASSES or not _same_code(cls.forward, _StandardRMSNorm.forward):
        return False
    hooked = hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__
    attr = "_old_forward" if hooked else "forward"
    current = module.__dict__.get(attr, _MISSING)
    if getattr(current, "__func__", None) is _fused_rms_norm_forward:
        return False  # an enclosing context did it
    setattr(module, attr, types.MethodType(_fused_rms_norm_forward, module))
    undo.append(functools.partial(_restore_attr, module, attr, current))
    return True


def _restore_attr(obj, attr: str, value) -> None:
    if value is _MISSING:
        delattr(obj, attr)
    else:
        setattr(obj, attr, value)


# ----------------------------------------------------------------------------- rotary embedding


# transformers' rotate_half and apply_rotary_pos_emb (Llama/Mistral/Qwen2/Qwen3 and MoE variants, 5.17 to
# 5.24), verbatim but for the docstrings' text: a module's pair is replaced only if it compiles to this bytecode.
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
    """Names of the modules defining the models' attention classes, in first-seen order."""
    names = (type(m).__module__ for model in models for m in model.modules() if type(m).__name__.endswith("Attention"))
    return [name for name in dict.fromkeys(names) if name in sys.modules]


def _fuse_rotary(module: types.ModuleType, undo: list) -> bool:
    """Replace ``module.apply_rotary_pos_emb`` with a call to :func:`apply_rotary` if it is the standard one."""
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None or hasattr(original, "_fused_original"):
        return False  # none, or an enclosing context did it
    standard = _same_code(original, _standard_apply_rotary_pos_emb) and _same_code(
        getattr(module, "rotate_half", None), rotate_half
    )
    if not standard or str(inspect.signature(original)) != "(q, k, cos, sin, unsqueeze_dim=1)":
        return False
    module.apply_rotary_pos_emb = _fused_rotary(original)
    undo.append(functools.partial(setattr, module, "apply_rotary_pos_emb", original))
    return True


def _fused_rotary(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _triton_runs_on(q.device):  # another model of the family, e.g. on CPU
            return original(q, k, cos, sin, unsqueeze_dim)
        return apply_rotary(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._fused_original = original
    return apply_rotary_pos_emb


# ----------------------------------------------------------------------------- helpers


def _same_code(fn, reference) -> bool:
    """Whether ``fn`` compiles to ``reference``'s bytecode, names and constants (docstrings' text aside)."""
    code, ref = getattr(fn, "__code__", None), reference.__code__
    if code is None:
        return False

    def consts(c):
        return tuple("<str>" if isinstance(x, str) else x for x in c.co_consts)

    return (code.co_code, code.co_names, code.co_varnames, consts(code)) == (
        ref.co_code, ref.co_names, ref.co_varnames, consts(ref)
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def _check_device(t: torch.Tensor) -> None:
    if not _triton_runs_on(t.device):
        raise ValueError(
            f"the fused kernels run in Triton: they need CUDA tensors (got {t.device}), or on CPU the "
            "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
