"""A tiny random-weight target/draft pair saved as transformers folders: seconds on a CPU, no downloads.

The examples' ``--tiny`` mode and the CLI tests load it exactly as they would load a real pair
(``from_pretrained`` on two folders). The tokenizer is word-level over a bundled book's most frequent
words; the target is a small Qwen2 model built from a config; the draft is a slightly perturbed copy
of the target, so that it agrees with it often and drafts get accepted, as with a real pair.
"""

from __future__ import annotations

import atexit
import collections
import copy
import re
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .texts import load_text

__all__ = ["save_tiny_pair", "tiny_pair", "tiny_qwen", "tiny_tokenizer"]

_SPECIAL = ["<unk>", "<eos>"]


def tiny_tokenizer(words: int = 250, book: str = "alice") -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the ``words`` most frequent words (and punctuation) of a bundled book."""
    counts = collections.Counter(re.findall(r"\w+|[^\w\s]", load_text(book)))
    vocab = {tok: i for i, tok in enumerate(_SPECIAL + [w for w, _ in counts.most_common(words)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


def tiny_qwen(vocab: int, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """A random-weight Qwen2 causal LM (eval mode) with GQA, long enough positions for 4k-token prompts."""
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def save_tiny_pair(root: str | Path, words: int = 250) -> tuple[Path, Path]:
    """Write ``root/target`` and ``root/draft`` (model and tokenizer each); return the two folders."""
    tok = tiny_tokenizer(words)
    target = tiny_qwen(len(tok), layers=3, seed=0)
    draft = copy.deepcopy(target)  # a noisy copy: it agrees with the target often, so drafts get accepted
    generator = torch.Generator().manual_seed(1)
    for param in draft.parameters():
        param.data.add_(0.002 * torch.randn(param.shape, generator=generator))
    paths = Path(root) / "target", Path(root) / "draft"
    for model, path in zip((target, draft), paths):
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return paths


def tiny_pair() -> tuple[Path, Path]:
    """``(target_dir, draft_dir)`` of a fresh tiny pair in a temporary folder removed when the process exits."""
    root = tempfile.mkdtemp(prefix="dustin_hf_tiny_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return save_tiny_pair(root)
