"""``dustin_hf.patch(model)``: the one line that makes ``cache_implementation="dustin"`` work.

Patching changes three things, and the returned handle's ``unpatch()`` restores all three:

1. the ``"dustin"`` attention function is registered in transformers' attention registry (an
   extension point; reference-counted across patched models);
2. ``"dustin"`` is added to the accepted cache implementations (``dustin_hf.patches.cache_registry``);
3. the model's class becomes a subclass that routes assisted decoding through Dustin's loop
   (``dustin_hf.patches.generation``).

The model's weights, config and attention implementation are untouched: without
``cache_implementation="dustin"`` (and with a batch of one) a patched model generates exactly as
before. Patching an already-patched model returns its existing handle (with the new config, if
one is given): nothing is wrapped twice.
"""

from __future__ import annotations

import threading
from pathlib import Path

from transformers import AttentionInterface

from .attention import ATTENTION_NAME, dustin_attention
from .compat import check_model, check_transformers
from .config import DustinConfig
from .patches.cache_registry import register_cache_implementation, unregister_cache_implementation
from .patches.generation import patched_class

__all__ = ["DustinPatch", "patch", "is_patched"]

_lock = threading.Lock()
_attention_users = 0
_displaced_attention = None  # what "dustin" meant in the registry before us, if anything


def _register_attention() -> None:
    global _attention_users, _displaced_attention
    with _lock:
        if _attention_users == 0:
            _displaced_attention = AttentionInterface._global_mapping.get(ATTENTION_NAME)
            AttentionInterface.register(ATTENTION_NAME, dustin_attention)
        _attention_users += 1


def _unregister_attention() -> None:
    global _attention_users, _displaced_attention
    with _lock:
        _attention_users -= 1
        if _attention_users == 0:
            if _displaced_attention is None:
                AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
            else:
                AttentionInterface._global_mapping[ATTENTION_NAME] = _displaced_attention
            _displaced_attention = None


class DustinPatch:
    """Handle returned by :func:`patch`. ``unpatch()`` (or leaving the ``with`` block) undoes the patch."""

    def __init__(self, model, config: DustinConfig):
        self.model = model
        self.config = config
        self._original_class = type(model)
        self.active = False

    def _apply(self) -> None:
        register_cache_implementation()
        _register_attention()
        self.model.__class__ = patched_class(self._original_class)
        self.model._dustin_patch = self
        self.active = True

    def unpatch(self) -> None:
        """Restore the model's class and the registries; calling it twice is harmless."""
        if not self.active:
            return
        self.model.__class__ = self._original_class
        del self.model._dustin_patch
        _unregister_attention()
        unregister_cache_implementation()
        self.active = False

    def __enter__(self) -> "DustinPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def __repr__(self):
        state = "active" if self.active else "undone"
        return f"DustinPatch({self._original_class.__name__}, {state}, {self.config})"


def is_patched(model) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get("_dustin_patch"), DustinPatch)


def patch(model, config: DustinConfig | str | Path | None = None) -> DustinPatch:
    """Enable ``generate(..., assistant_model=draft, cache_implementation="dustin")`` on ``model``.

    Args:
        model: the target causal LM (Llama, Mistral, Qwen2/2.5/3 families).
        config: a :class:`DustinConfig`, a path to a calibration profile (JSON), or ``None`` for
            the defaults. ``generate(..., cache_config={...})`` overrides fields for one call.

    Returns:
        A :class:`DustinPatch`; ``handle.unpatch()`` restores everything.
    """
    check_transformers()
    if isinstance(config, (str, Path)):
        config = DustinConfig.from_profile(config)
    if config is not None and not isinstance(config, DustinConfig):
        raise TypeError(f"config must be a DustinConfig, a profile path or None, got {type(config).__name__}")
    if is_patched(model):
        handle = model._dustin_patch
        if config is not None:
            handle.config = config
        return handle
    check_model(model, role="target")
    handle = DustinPatch(model, config or DustinConfig())
    handle._apply()
    return handle
