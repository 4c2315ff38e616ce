"""Make ``cache_implementation="dustin"`` pass ``GenerationConfig.validate()``.

transformers has no registry for cache implementations: ``validate()`` reads the module global
``transformers.generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS`` (a tuple) at call time.
We replace that tuple with one that also holds ``"dustin"`` while at least one model is patched,
and put the original object back when the last patch is undone. Checked on transformers 5.17-5.24.
"""

from __future__ import annotations

import threading

from transformers.generation import configuration_utils

__all__ = ["CACHE_NAME", "register_cache_implementation", "unregister_cache_implementation"]

CACHE_NAME = "dustin"
_lock = threading.Lock()
_users = 0
_original: tuple | None = None


def register_cache_implementation() -> None:
    """Add ``"dustin"`` to the accepted cache implementations (reference-counted)."""
    global _users, _original
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
        _users += 1


def unregister_cache_implementation() -> None:
    """Undo one :func:`register_cache_implementation`; the last one restores the original object."""
    global _users, _original
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            configuration_utils.ALL_CACHE_IMPLEMENTATIONS = _original
            _original = None
