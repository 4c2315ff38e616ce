"""dustin_hf: draft-augmented sparse verification (Dustin) for speculative decoding in transformers.

    import dustin_hf
    dustin_hf.patch(model)
    out = model.generate(input_ids, attention_mask=mask, assistant_model=draft,
                         cache_implementation="dustin", max_new_tokens=256)

Importing the package changes nothing; :func:`patch` does, and its handle undoes it.
"""

from .cache import DustinCache
from .config import DustinConfig
from .patching import DustinPatch, is_patched, patch

__all__ = ["DustinCache", "DustinConfig", "DustinPatch", "is_patched", "patch"]
__version__ = "0.1.0"
