"""Which transformers versions and which models the patch is known to work with, and what the loop reads of a model.

The patch relies on transformers internals (``_assisted_decoding`` looked up on the model's class,
``ALL_CACHE_IMPLEMENTATIONS`` read at validation time, keyword arguments reaching the attention
function). Those were checked on the versions in ``VERIFIED_RANGE``; a newer 5.x gets a warning,
anything outside 5.x an error. Models must route attention through transformers' registry with a
standard KV cache (full or sliding-window attention; linear-attention and recurrent layers have none).

The loop reads a model through the helpers at the end (device, GQA group, softmax scale, sliding windows), so
that what it assumes about transformers' modules sits in this one file.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import transformers
from packaging.version import Version
from transformers.generation.utils import ALL_CACHE_NAMES

if TYPE_CHECKING:
    import torch

__all__ = [
    "CACHE_KWARG",
    "VERIFIED_RANGE",
    "attention_scale",
    "check_transformers",
    "check_model",
    "check_pair",
    "common_window",
    "group_size",
    "model_device",
    "window_cuts",
]

# Inclusive: the releases the fused ops' copies of transformers code were checked against (5.17, 5.23, 5.24, 5.25).
# CI tests the oldest and the newest release the registry serves (.ci/run), which is 5.25 until a newer one ships.
VERIFIED_RANGE = ("5.17.0", "5.25.0")

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
        raise ValueError(
            "the target and draft tokenizers differ; Dustin needs a draft that shares the target's tokenizer"
        )


# ---- what the loop reads from a model: its device, GQA group, softmax scale and sliding windows
def model_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def group_size(text_config) -> int:
    """Query heads per key/value head (GQA group size; 1 without GQA)."""
    return text_config.num_attention_heads // (
        getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    )


def attention_scale(model, text_config) -> float:
    """The softmax scale of the model's attention layers (``module.scaling``)."""
    for module in model.modules():
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):
            return float(module.scaling)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return head_dim**-0.5


def _windows(model) -> list[int | None]:
    """Each attention layer's sliding window (``None``: full attention). Qwen2-style layers carry theirs
    (``sliding_window``, ``None`` on full layers); Mistral-style ones read the config's."""
    return [
        getattr(m, "sliding_window", getattr(m.config, "sliding_window", None))
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
    ]


def common_window(model) -> int | None:
    """The window every attention layer of ``model`` shares, if every one has the same."""
    windows = set(_windows(model))
    return next(iter(windows)) if len(windows) == 1 and isinstance(next(iter(windows)), int) else None


def window_cuts(model, capacity: int) -> bool:
    """Whether some attention layer of ``model`` has a sliding window shorter than ``capacity`` keys (such layers
    run the general masked attention, which a CUDA graph cannot capture)."""
    return any(isinstance(w, int) and w < capacity for w in _windows(model))
