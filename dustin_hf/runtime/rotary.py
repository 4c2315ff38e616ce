"""transformers' rotary embedding through :func:`~.ops.apply_rotary`, attention by attention; no module global changes.

transformers' Llama, Mistral and Qwen attentions call their modeling module's ``apply_rotary_pos_emb`` by name. Every
release of the supported range (5.17 to 5.25) decorates that function with ``@use_kernel_forward_from_hub`` and the
attention classes with ``@use_kernelized_func(apply_rotary_pos_emb)``, the extension point for it. :func:`fuse_rotary`
takes, for one attention instance:

* **its own wrapper** where there is one: with the ``kernels`` package from 0.19 (a dependency of transformers from
  5.25) each attention holds a wrapper module of the function (in ``attention._kernel_funcs``), to which the global
  routes the call while that attention's forward runs. ``kernels.kernelize`` sets the wrapper's ``forward`` to a hub
  kernel; the context sets it to the Triton kernel (and removes it on exit). A wrapper with a kernel of the user's is
  left alone.
* **else a copy of its forward**: without that hook (transformers 5.17 without ``kernels``, or ``kernels`` before
  0.19, whose wrapper is the module global itself, shared by every model) the attention's ``forward`` becomes, for
  this instance only, a copy of its class's function whose globals are its modeling module's with that one name
  bound to the kernel: the same code, the same arguments, every other name the module's. Only where the class's
  forward is that plain function (not wrapped: 5.24 wraps it in ``deprecate_kwarg``, ``kernels`` 0.19 in its router).

Either way only when the function behind the name is transformers' standard one
(:func:`~.recognise._standard_rotary`: the layer name ``rotary_pos_emb`` is shared by functions of other
semantics, e.g. gpt-oss's). Other models of the family, and these outside the context, run transformers' function.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch

from .ops import apply_rotary
from .recognise import _standard_rotary
from .registry import _replace_forward

__all__ = ["fuse_rotary", "rotary_wrapper"]


def rotary_wrapper(attention: torch.nn.Module) -> torch.nn.Module | None:
    """``attention``'s own wrapper module of ``apply_rotary_pos_emb`` (``kernels`` 0.19 and later), else ``None``."""
    shared = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)
    # the key use_kernelized_func files it under: the wrapper's layer name ("rotary_pos_emb")
    key = getattr(shared, "__name__", None) or getattr(shared, "kernel_layer_name", None)
    wrapper = getattr(attention, "_kernel_funcs", {}).get(key)
    return wrapper if isinstance(wrapper, torch.nn.Module) and wrapper is not shared else None


def fuse_rotary(attention: torch.nn.Module, undo: list) -> bool:
    """Run ``attention``'s ``apply_rotary_pos_emb`` as :func:`~.ops.apply_rotary` (its wrapper's forward, else a copy
    of its forward) when the function is transformers' standard one and no kernel was set on it (``kernelize()``:
    the user's choice; or an enclosing context)."""
    modeling = sys.modules.get(type(attention).__module__)
    wrapper = rotary_wrapper(attention)
    if modeling is None or (wrapper is not None and "forward" in vars(wrapper)):
        return False
    if wrapper is None:
        return _standard_rotary(modeling) is not None and _fuse_by_copy(attention, modeling, undo)
    if _standard_rotary(modeling, wrapper) is None:
        return False
    # a bound method, as kernelize() sets: under torch.compile the routing calls ``forward.__func__``
    wrapper.forward = types.MethodType(_fused_rotary_forward, wrapper)
    undo.append(functools.partial(vars(wrapper).pop, "forward", None))
    return True


def _fuse_by_copy(attention: torch.nn.Module, modeling: types.ModuleType, undo: list) -> bool:
    """``attention``'s forward as a copy of its class's plain function (one that calls ``apply_rotary_pos_emb`` by
    name), that name bound to the kernel."""
    forward = type(attention).forward
    plain = (
        inspect.isfunction(forward) and forward.__globals__ is vars(modeling) and not hasattr(forward, "__wrapped__")
    )
    if not (plain and "apply_rotary_pos_emb" in forward.__code__.co_names):
        return False
    names = {**vars(modeling), "apply_rotary_pos_emb": fused_apply_rotary_pos_emb}
    copy = types.FunctionType(forward.__code__, names, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = forward.__kwdefaults__, forward.__qualname__
    copy._dustin_fused = True  # an enclosing context's replacement: a nested one leaves it
    return _replace_forward(attention, types.MethodType(copy, attention), undo)


def fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb`` as :func:`~.ops.apply_rotary`: its signature, its outputs bit for bit."""
    return apply_rotary(q, k, cos, sin, unsqueeze_dim)


def _fused_rotary_forward(self, q, k, cos, sin, unsqueeze_dim=1):
    return apply_rotary(q, k, cos, sin, unsqueeze_dim)
