"""Make ``cache_implementation="dustin"`` pass ``GenerationConfig.validate()``, and only on patched models.

transformers has no registry for cache implementations: ``validate()`` reads the module global
``transformers.generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS`` (a tuple) at call time.
We replace that tuple with one that also holds ``"dustin"`` while at least one model is patched,
and put the original object back when the last patch is undone.

Once the name validates, a model that was never patched would take it in ``_prepare_cache_for_generation``
as an unknown implementation and decode with a plain dynamic cache, silently. So while the name is registered,
``GenerationMixin._prepare_cache_for_generation`` is wrapped to refuse it with a ``ValueError`` that says to
patch the model (a patched model's class overrides the method and never reaches the wrapper for ``"dustin"``).
Checked on transformers 5.17-5.25.
"""

from __future__ import annotations

import functools
import threading

from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

__all__ = ["CACHE_NAME", "register_cache_implementation", "unregister_cache_implementation"]

CACHE_NAME = "dustin"
_lock = threading.Lock()
_users = 0
_original: tuple | None = None
_original_prepare = None


def _refuse_unpatched(prepare):
    @functools.wraps(prepare)
    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        if generation_config.cache_implementation == CACHE_NAME:
            raise ValueError(
                f"cache_implementation='dustin' needs a patched model: call dustin_hf.patch(model) on this "
                f"{type(self).__name__} first (another model in this process is patched, this one is not)"
            )
        return prepare(self, generation_config, *args, **kwargs)

    _prepare_cache_for_generation._dustin_guard = True
    return _prepare_cache_for_generation


def register_cache_implementation() -> None:
    """Add ``"dustin"`` to the accepted cache implementations (reference-counted)."""
    global _users, _original, _original_prepare
    with _lock:
        if _users == 0:
            current = configuration_utils.ALL_CACHE_IMPLEMENTATIONS
            if not isinstance(current, (tuple, list)):
                raise RuntimeError(
                    "transformers.generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS is not a tuple or list in "
                    "this transformers version; dustin_hf cannot register cache_implementation='dustin'"
                )
            _original = current
            if CACHE_NAME not in current:
                configuration_utils.ALL_CACHE_IMPLEMENTATIONS = type(current)([*current, CACHE_NAME])
            _original_prepare = GenerationMixin.__dict__["_prepare_cache_for_generation"]
            GenerationMixin._prepare_cache_for_generation = _refuse_unpatched(_original_prepare)
        _users += 1


def unregister_cache_implementation() -> None:
    """Undo one :func:`register_cache_implementation`; the last one restores the original objects."""
    global _users, _original, _original_prepare
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            configuration_utils.ALL_CACHE_IMPLEMENTATIONS = _original
            current = GenerationMixin.__dict__.get("_prepare_cache_for_generation")
            if getattr(current, "_dustin_guard", False):  # ours: put the original back (someone else's: leave it)
                GenerationMixin._prepare_cache_for_generation = _original_prepare
            _original, _original_prepare = None, None
