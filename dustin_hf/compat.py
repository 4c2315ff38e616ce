"""Which transformers versions and which models the patch is known to work with.

The patch relies on transformers internals (``_assisted_decoding`` looked up on the model's class,
``ALL_CACHE_IMPLEMENTATIONS`` read at validation time, keyword arguments reaching the attention
function). Those were checked on the versions in ``VERIFIED_RANGE``; a newer 5.x gets a warning,
anything outside 5.x an error. Models must route attention through transformers' registry with a
standard KV cache (full or sliding-window attention; linear-attention and recurrent layers have none).
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version
from transformers.generation.utils import ALL_CACHE_NAMES

__all__ = ["CACHE_KWARG", "VERIFIED_RANGE", "check_transformers", "check_model", "check_pair"]

VERIFIED_RANGE = ("5.17.0", "5.25.0")  # inclusive; both ends tested (.ci/run)

# The keyword that carries the KV cache into a model's forward and through generate()'s model kwargs:
# "past_key_values" up to 5.23, "cache" from 5.24 (which still accepts the old name, with a warning).
CACHE_KWARG = ALL_CACHE_NAMES[0]
_MIN_VERSION, _MAX_MAJOR = Version("5.17.0"), 6

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def check_transformers(version: str | None = None) -> None:
    """Raise outside the supported range; warn above the verified one."""
    current = Version(version or transformers.__version__)
    low, high = (Version(v) for v in VERIFIED_RANGE)
    if current < _MIN_VERSION or current.major >= _MAX_MAJOR:
        raise RuntimeError(
            f"dustin_hf supports transformers >= {_MIN_VERSION} and < {_MAX_MAJOR} (verified {low} to {high}); "
            f"found {current}. Install a supported version, e.g. pip install 'transformers>={low},<{_MAX_MAJOR}'"
        )
    if current > high:
        warnings.warn(
            f"dustin_hf was verified on transformers {low} to {high}; {current} is newer. It should work, but if "
            f"generation fails, pin transformers=={high}",
            stacklevel=3,
        )


def check_model(model, role: str = "target") -> None:
    """Raise a ``ValueError`` naming the reason if ``model`` cannot run Dustin's attention and cache."""
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{role} model {name} is an encoder-decoder; Dustin supports decoder-only causal LMs")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{role} model {name} (model_type={model_type!r}) is not supported; supported families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (full attention through transformers' attention registry)"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{role} model {name} does not route attention through transformers' attention registry")
    layer_types = getattr(text, "layer_types", None) or []
    if any(t in str(layer_types) for t in ("linear", "mamba", "conv")):
        raise ValueError(f"{role} model {name} has linear-attention layers; Dustin needs a standard KV cache")


def check_pair(target, draft, tokenizer=None, assistant_tokenizer=None) -> None:
    """The draft must share the target's tokenizer, so that positions and token ids line up."""
    check_model(draft, role="draft")
    t_vocab = target.config.get_text_config().vocab_size
    d_vocab = draft.config.get_text_config().vocab_size
    if d_vocab > t_vocab:
        raise ValueError(
            f"the draft's vocabulary ({d_vocab}) is larger than the target's ({t_vocab}); Dustin needs a draft "
            "that shares the target's tokenizer"
        )
    if d_vocab == t_vocab:
        return
    # Same family, different padding of the embedding matrix (e.g. Qwen2.5-7B: 152064 vs 0.5B: 151936)
    if tokenizer is None or assistant_tokenizer is None:
        raise ValueError(
            f"target vocabulary {t_vocab} != draft vocabulary {d_vocab}: pass tokenizer= and assistant_tokenizer= "
            "to generate() so dustin_hf can check that both models use the same tokenizer (they may be the same "
            "object); Dustin does not translate between different tokenizers"
        )
    if tokenizer is not assistant_tokenizer and tokenizer.get_vocab() != assistant_tokenizer.get_vocab():
        raise ValueError("the target and draft tokenizers differ; Dustin needs a draft that shares the target's tokenizer")
