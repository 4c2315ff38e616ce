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

__all__ = ["DustinCache", "DustinConfig", "DustinPatch", "is_patched", "patch"]
__version__ = "0.1.0"

# What a user may want to see (a call verified densely throughout, a workspace built or reused, fused ops off) goes to
# the "dustin_hf" logger at INFO: silent unless asked for, e.g. logging.getLogger("dustin_hf").setLevel("INFO") with
# a handler (logging.basicConfig())
_logging.getLogger(__name__).addHandler(_logging.NullHandler())


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
