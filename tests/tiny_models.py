"""Tiny random-weight models built from configs, their prompts, and the one-thread fixture: what both the
library's tests (``tests/``) and the lab's (``lab/tests/``) build on. No downloads anywhere in the tests.

Tests import them from here (``from tiny_models import tiny_model``): pyproject's ``pythonpath`` puts ``tests/`` on
the path for both folders. ``tests/conftest.py`` imports this module first (it sets ``TRITON_INTERPRET`` before
anything loads triton) and holds the fixture ``one_thread`` for the library's tests; a lab test imports it."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU; set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy

import pytest
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = ["PAD", "VOCAB", "left_pad", "noisy_copy", "one_thread", "random_prompt", "set_gamma", "tiny_model"]

VOCAB = 96
PAD = VOCAB - 1  # never drawn by random_prompt, so generate() never mistakes a prompt token for padding
WEIGHT_SCALE = 1.0
_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny_model(
    family: str = "qwen2",
    layers: int = 3,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    vocab: int = VOCAB,
    **overrides,
):
    """A random-weight causal LM of ``family`` small enough for CPU tests (float32, eval mode)."""
    config_cls, model_cls, extra = _FAMILIES[family]
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16384,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **{**extra, **overrides},
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    for param in model.parameters():  # larger weights: peaky logits, so greedy argmax has no near-ties
        param.data.mul_(WEIGHT_SCALE)
    return model


def noisy_copy(model, noise: float = 0.001, seed: int = 1):
    """A draft that agrees with ``model`` most of the time: the same weights plus small noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for param in draft.parameters():
        param.data.add_(noise * torch.randn(param.shape, generator=generator))
    return draft


def set_gamma(draft, gamma: int, threshold: float | None = None):
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.assistant_confidence_threshold = threshold if threshold is not None else 0.0
    return draft


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is faster, and far faster when other processes share the cores.
    Use as ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_prompt(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, PAD, (batch, length), generator=generator)


def left_pad(rows: list[torch.Tensor], pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D token tensors into ``(input_ids, attention_mask)``, as a tokenizer with padding_side='left'."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.numel() :] = r
        mask[b, width - r.numel() :] = 1
    return ids, mask
