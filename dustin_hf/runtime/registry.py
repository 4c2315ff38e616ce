"""What an open :func:`~dustin_hf.runtime.fused.fused_ops` context changed, each change with its undo: forwards it
replaced (:func:`_replace_forward`) and the decoder layers it registered for
:class:`dustin_hf.runtime.pipeline.Pipeline`'s fused layer path (:func:`_register`), which the pipeline reads back
with :func:`fused_decoder_layer` and :func:`fused_norm`.

Nothing of a registered layer is replaced; the pipeline, the staged forward the decode loop captures, runs it its
own way: a decoder layer (``recognise._DECODER_LAYER_CLASSES``) whose forward compiles to transformers' standard
pre-norm block (both of its 5.17-5.25 spellings) with fused norms, called plainly (no hooks, no replaced forward, no
offloading), runs submodule by submodule, each residual add inside the next norm's launch (:func:`~.ops.add_rms_norm`:
the add rounds as PyTorch's, the norm is :func:`~.ops.rms_norm`'s kernel code, so the logits are the same bits).

Greedy heads need no registration: the pipeline takes their argmax with :func:`~.ops.argmax`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch

from .ops import _fused_rms_norm_forward
from .recognise import _DECODER_LAYER_CLASSES, _standard_layer_code

__all__ = ["fused_decoder_layer", "fused_norm"]

_MISSING = object()
# Decoder layers an open context registered for pipeline.Pipeline's fused layer path.
_REGISTERED: weakref.WeakSet = weakref.WeakSet()


def fused_decoder_layer(layer: torch.nn.Module) -> bool:
    """Whether an open :func:`~.fused.fused_ops` context registered ``layer`` for the fused decoder-layer path.

    A registered layer's forward is transformers' standard pre-norm block
    (:class:`~dustin_hf.runtime._transformers_reference.StandardDecoderLayer`),
    so calling its submodules in that order with the arguments it passes them computes what it computes;
    both its norms are fused RMSNorms (:func:`fused_norm`), so each residual add can run inside the RMSNorm
    launch after it (:func:`~.ops.add_rms_norm`). Nothing wraps it that would be skipped: no torch hooks, no
    replaced forward, no accelerate hook that offloads weights.
    """
    return layer in _REGISTERED


def fused_norm(module: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """``(weight, eps)`` of an RMSNorm whose forward an open context replaced with :func:`~.ops.rms_norm`, else
    ``None``."""
    for attr in ("_old_forward", "forward"):
        forward = module.__dict__.get(attr)
        if getattr(forward, "func", None) is _fused_rms_norm_forward:
            return module.weight, module.variance_epsilon
    return None


def _standard_layer(module: torch.nn.Module) -> bool:
    cls = type(module)
    if cls.__name__ not in _DECODER_LAYER_CLASSES or not _runs_as_its_class(module) or not _standard_layer_code(cls):
        return False
    norms = (getattr(module, name, None) for name in ("input_layernorm", "post_attention_layernorm"))
    return all(norm is not None and fused_norm(norm) is not None for norm in norms)


def _runs_as_its_class(module: torch.nn.Module) -> bool:
    """Calling ``module`` runs its class's forward and nothing else: no torch hooks, no forward set on the
    instance but accelerate's device hook (which only moves inputs) without weight offloading."""
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    if "forward" not in module.__dict__:
        return True
    hook, old = getattr(module, "_hf_hook", None), module.__dict__.get("_old_forward")
    hooks = getattr(hook, "hooks", (hook,))  # a SequentialHook holds several
    class_forward = getattr(old, "__func__", None) is type(module).forward
    return class_forward and not any(getattr(h, "offload", False) for h in hooks)


def _register(module: torch.nn.Module, check: Callable[[torch.nn.Module], bool], undo: list) -> bool:
    """Register ``module`` for pipeline.Pipeline's fused layer path if ``check`` passes (and no enclosing context
    did)."""
    if module in _REGISTERED or not check(module):
        return False
    _REGISTERED.add(module)
    undo.append(functools.partial(_REGISTERED.discard, module))
    return True


def _replace_forward(module: torch.nn.Module, forward: Callable, undo: list) -> bool:
    """Set ``module``'s forward (or accelerate's ``_old_forward`` under a device hook, so inputs still move)
    unless an enclosing context already replaced it; ``forward`` is tagged so that a nested one can tell."""
    hooked = hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__
    attr = "_old_forward" if hooked else "forward"
    current = module.__dict__.get(attr, _MISSING)
    if getattr(current, "_dustin_fused", False):
        return False  # an enclosing context did it
    if not getattr(forward, "_dustin_fused", False):  # a bound method carries its function's tag
        forward._dustin_fused = True
    setattr(module, attr, forward)
    undo.append(functools.partial(_restore_attr, module, attr, current))
    return True


def _restore_attr(obj, attr: str, value) -> None:
    if value is _MISSING:
        delattr(obj, attr)
    else:
        setattr(obj, attr, value)
