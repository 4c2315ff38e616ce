"""dustin_hf: draft-augmented sparse verification (Dustin) for speculative decoding in transformers.

    import dustin_hf
    dustin_hf.patch(model)
    out = model.generate(input_ids, attention_mask=mask, assistant_model=draft,
                         cache_implementation="dustin", max_new_tokens=256)

Importing the package changes nothing; :func:`patch` does, and its handle undoes it. The public
names load on first use (PEP 562), so ``import dustin_hf`` and ``dustin-hf --help`` do not import
torch or transformers.
"""

__all__ = ["DustinCache", "DustinConfig", "DustinPatch", "is_patched", "patch"]
__version__ = "0.1.0"


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
