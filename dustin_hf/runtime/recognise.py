"""Which of a model's transformers code is the code dustin_hf checked: the version check behind
:func:`dustin_hf.runtime.fused.fused_ops`.

A fused path that replaces a module's own forward (RMSNorm, the MLP, the rotary embedding, the decoder layer's
pipeline) applies only when the module's class is listed here (``_RMS_NORM_CLASSES``,
``_MLP_CLASSES``, ``_ATTENTION_CLASSES``, ``_DECODER_LAYER_CLASSES``) and its forward -- or, for the rotary
embedding, its modeling module's ``apply_rotary_pos_emb`` and ``rotate_half`` -- compiles to the same instructions,
names and constants as the verbatim copy in :mod:`dustin_hf.runtime._transformers_reference` (:func:`_same_code`).
Comparing bytecode, not version numbers, also catches a model whose code was patched. The attention's projections
need no such check: their fusion (:mod:`dustin_hf.runtime.projections`) replaces only the forwards of the plain
``nn.Linear`` modules of a listed attention class, and ``k_proj`` / ``v_proj`` take their slice of the fused GEMM
only when called on the very tensor ``q_proj`` saw (else they run their own linear), whatever code calls them.

transformers' extension points give two of these paths their place (per module instance, :mod:`~.rotary`), not their
recognition: ``@use_kernel_forward_from_hub`` names a layer only when the ``kernels`` package is installed (5.17 does
not require it), and the names are not semantics (``"rotary_pos_emb"`` also names gpt-oss's and ModernBERT's other
rotaries), so the check stays by code for every path.

Where a listed class (or a modeling module's rotary function) compiles to other code than the one checked (a
transformers release newer than :data:`dustin_hf.compat.VERIFIED_RANGE`), that part keeps transformers' own code,
with one warning per process naming what differs (:func:`_warn_unrecognised`): the outputs stay transformers', only
launches are saved elsewhere.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
import types
import warnings
from collections.abc import Callable

import torch
import transformers

from ..compat import VERIFIED_RANGE
from . import _transformers_reference as copies

# RMSNorm classes with transformers' standard forward (identical in 5.17, 5.23, 5.24, 5.25); each instance is
# also checked against StandardRMSNorm.forward's bytecode before it is replaced.
_RMS_NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
    }
)
# MLP classes with the standard ``down(act(gate(x)) * up(x))`` forward (5.17 to 5.25), checked by bytecode too.
_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_ATTENTION_CLASSES = frozenset(
    {
        "LlamaAttention",
        "MistralAttention",
        "MixtralAttention",
        "Qwen2Attention",
        "Qwen2MoeAttention",
        "Qwen3Attention",
        "Qwen3MoeAttention",
    }
)
# Decoder layers whose forward is the standard pre-norm block (5.17 to 5.25, checked by bytecode too).
_DECODER_LAYER_CLASSES = frozenset(
    {
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen2MoeDecoderLayer",
        "Qwen3DecoderLayer",
        "Qwen3MoeDecoderLayer",
    }
)
# What the warning about unrecognised transformers code has already named in this process.
_WARNED: set[str] = set()


def _standard_norm_code(cls: type) -> bool:
    return _same_code(cls.forward, copies.StandardRMSNorm.forward)


def _standard_mlp_code(cls: type) -> bool:
    return _same_code(cls.forward, copies.StandardMLP.forward)


def _standard_layer_code(cls: type) -> bool:
    forward = inspect.unwrap(cls.forward)  # 5.24 wraps it in deprecate_kwarg
    return any(
        _same_code(forward, copy.forward) for copy in (copies.StandardDecoderLayer, copies.StandardDecoderLayer524)
    )


def _wrapped_function(fn) -> Callable | None:
    """The plain function ``fn`` runs: ``fn`` itself, or the one a ``kernels`` wrapper module calls.

    With the ``kernels`` package installed, ``@use_kernel_forward_from_hub`` turns a decorated function into an
    instance of a ``Func(nn.Module)`` class (tagged ``kernel_layer_name``) whose forward calls the function, held
    in its closure as ``func``, unless a model was kernelized. ``None`` for anything else (or a wrapper whose own
    forward was replaced)."""
    if inspect.isfunction(fn):
        return fn
    forward = getattr(type(fn), "forward", None)
    if not (
        isinstance(fn, torch.nn.Module)
        and hasattr(type(fn), "kernel_layer_name")
        and inspect.isfunction(forward)
        and "forward" not in vars(fn)
    ):
        return None
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    inner = cells["func"].cell_contents if "func" in cells else None
    return inner if inspect.isfunction(inner) else None


def _standard_rotary(module: types.ModuleType, rotary=None) -> Callable | None:
    """The function behind ``rotary`` (default ``module.apply_rotary_pos_emb``) if it and ``module.rotate_half`` are
    transformers' standard ones (the copies in :mod:`~dustin_hf.runtime._transformers_reference`), else ``None``."""
    function = _wrapped_function(getattr(module, "apply_rotary_pos_emb", None) if rotary is None else rotary)
    if function is None or not _same_code(function, copies.apply_rotary_pos_emb):
        return None
    if not _same_code(getattr(module, "rotate_half", None), copies.rotate_half):
        return None
    return function if str(inspect.signature(function)) == "(q, k, cos, sin, unsqueeze_dim=1)" else None


def _unrecognised(modules) -> list[str]:
    """What of ``modules`` a fused path is listed for but whose code differs from the one checked (the class's
    forward, or its modeling module's rotary function): each part keeps transformers' own code."""
    found = []
    for module in modules:
        cls = type(module)
        name = cls.__name__
        if (
            (name in _RMS_NORM_CLASSES and not _standard_norm_code(cls))
            or (name in _MLP_CLASSES and not _standard_mlp_code(cls))
            or (name in _DECODER_LAYER_CLASSES and not _standard_layer_code(cls))
        ):
            found.append(f"{cls.__module__}.{cls.__qualname__}.forward")
        if name in _ATTENTION_CLASSES and cls.__module__ in sys.modules:
            modeling = sys.modules[cls.__module__]
            if _standard_rotary(modeling) is None:
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
        "Those parts run transformers' own code (the same outputs, more kernel launches); the rest stays fused, "
        "the attention's q/k/v GEMM included (it replaces only the linear layers' forwards).",
        stacklevel=4,
    )


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
        return [
            ("LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname, None if i.opcode in jumps else i.argval)
            for i in dis.get_instructions(c)
        ]

    return (instructions(code), code.co_names, code.co_varnames, consts(code)) == (
        instructions(ref),
        ref.co_names,
        ref.co_varnames,
        consts(ref),
    )
