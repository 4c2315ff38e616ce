"""transformers' rotary embedding through :func:`~.ops.apply_rotary`, attention by attention, through the extension
point transformers gives it.

transformers' Llama, Mistral and Qwen attentions call their modeling module's ``apply_rotary_pos_emb`` by name. Every
release of the supported range (5.17 to 5.25) decorates that function with ``@use_kernel_forward_from_hub`` and the
attention classes with ``@use_kernelized_func(apply_rotary_pos_emb)``; with the ``kernels`` package from 0.19 (a
dependency of transformers from 5.25) each attention instance holds a wrapper module of its own
(in ``attention._kernel_funcs``), to which the global routes the call while that attention's
forward runs. ``kernels.kernelize`` sets that wrapper's ``forward`` to a hub kernel; :func:`fuse_rotary` sets it to
the Triton kernel, and the context's undo removes it. Nothing global changes: other models of the family, and these
outside the context, run transformers' function.

Where the hook is missing (no ``kernels`` package, or one before 0.19, whose wrapper is the module global itself,
shared by every model) the attentions' rotary stays transformers' in the models' own forwards (prefill, eager steps);
inside the decode loop's CUDA graphs a Qwen2 attention's rotary is fused anyway, with its K/V write
(:func:`~.registry.fused_attention`).
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from .ops import apply_rotary
from .recognise import _standard_rotary

__all__ = ["fuse_rotary", "rotary_wrapper"]


def rotary_wrapper(attention: torch.nn.Module) -> torch.nn.Module | None:
    """``attention``'s own wrapper module of ``apply_rotary_pos_emb`` (``kernels`` 0.19 and later), else ``None``."""
    shared = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)
    # the key use_kernelized_func files it under: the wrapper's layer name ("rotary_pos_emb")
    key = getattr(shared, "__name__", None) or getattr(shared, "kernel_layer_name", None)
    wrapper = getattr(attention, "_kernel_funcs", {}).get(key)
    return wrapper if isinstance(wrapper, torch.nn.Module) and wrapper is not shared else None


def fuse_rotary(attention: torch.nn.Module, undo: list) -> bool:
    """Point ``attention``'s rotary wrapper at :func:`~.ops.apply_rotary` when the function behind it is transformers'
    standard one and no kernel was set on it (by ``kernelize()``: the user's choice; or by an enclosing context)."""
    wrapper = rotary_wrapper(attention)
    if wrapper is None or "forward" in vars(wrapper):
        return False
    modeling = sys.modules.get(type(attention).__module__)
    if modeling is None or _standard_rotary(modeling, wrapper) is None:
        return False
    # a bound method, as kernelize() sets: under torch.compile the routing calls ``forward.__func__``
    wrapper.forward = types.MethodType(_fused_rotary_forward, wrapper)
    undo.append(functools.partial(vars(wrapper).pop, "forward", None))
    return True


def _fused_rotary_forward(self, q, k, cos, sin, unsqueeze_dim=1):
    return apply_rotary(q, k, cos, sin, unsqueeze_dim)
