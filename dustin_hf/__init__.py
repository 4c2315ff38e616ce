"""dustin_hf: draft-augmented sparse verification (Dustin) for speculative decoding in transformers.

    import dustin_hf
    dustin_hf.patch(model)
    out = model.generate(input_ids, attention_mask=mask, assistant_model=draft,
                         cache_implementation="dustin", max_new_tokens=256)

Importing the package changes nothing; :func:`patch` does, and its handle undoes it. The public
names load on first use (PEP 562), so ``import dustin_hf`` and ``dustin-hf --help`` do not import
torch or transformers.
"""

import logging as _logging
import os as _os

__all__ = ["DustinCache", "DustinConfig", "DustinPatch", "is_patched", "patch"]
__version__ = "0.1.0"

# What a user may want to see (a call verified densely throughout, a workspace built or reused, fused ops off) goes to
# the "dustin_hf" logger at INFO: silent unless asked for, e.g. logging.getLogger("dustin_hf").setLevel("INFO") with
# a handler (logging.basicConfig())
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# `patches/` sits beside this folder in a checkout and installs as `dustin_hf.patches` (pyproject's package-dir). An
# editable install maps that name to the checkout it was made from, which Python asks only after the package's own
# path: a second checkout or a git worktree imported from its own folder (PYTHONPATH) would run the first one's
# patches. So in a checkout the package's path also holds the checkout's top folder, after its own: its
# `patches/` is found there. A wheel holds `dustin_hf/patches/` itself and has no `patches/` beside it.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "patches")) and _os.path.isfile(
    _os.path.join(_checkout, "patches", "__init__.py")
):
    __path__.append(_checkout)


def __getattr__(name: str):
    # plain import statements (not importlib strings), so the layer test reads these dependencies too
    if name == "DustinCache":
        from .decode.cache import DustinCache as value
    elif name == "DustinConfig":
        from .config import DustinConfig as value
    elif name in ("DustinPatch", "is_patched", "patch"):
        from .adapter import patching

        value = getattr(patching, name)
    else:
        raise AttributeError(f"module 'dustin_hf' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
