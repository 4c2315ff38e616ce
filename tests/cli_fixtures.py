"""Tiny model folders for CLI tests: a word-level tokenizer and random-weight Qwen2 models, saved to disk."""

from __future__ import annotations

import collections
import copy
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dustin_hf.research.texts import load_text

SPECIAL = ["<unk>", "<eos>"]


def tiny_tokenizer(words: int = 250, book: str = "alice") -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the ``words`` most frequent words (and punctuation) of a bundled book."""
    counts = collections.Counter(re.findall(r"\w+|[^\w\s]", load_text(book)))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + [w for w, _ in counts.most_common(words)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


def tiny_qwen(vocab: int, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def save_pair(root: Path, words: int = 250, draft_words: int | None = None) -> tuple[Path, Path]:
    """``root/target`` and ``root/draft``: the draft is a noisy copy of the target, or (``draft_words``) a
    different model with a different tokenizer."""
    tok = tiny_tokenizer(words)
    target = tiny_qwen(len(tok), layers=3, seed=0)
    draft_tok = tok if draft_words is None else tiny_tokenizer(draft_words)
    if draft_words is None:  # a noisy copy: it agrees with the target often, so drafts get accepted
        draft = copy.deepcopy(target)
        generator = torch.Generator().manual_seed(1)
        for param in draft.parameters():
            param.data.add_(0.002 * torch.randn(param.shape, generator=generator))
    else:
        draft = tiny_qwen(len(draft_tok), layers=2, seed=1)
    paths = root / "target", root / "draft"
    for model, tokenizer, path in ((target, tok, paths[0]), (draft, draft_tok, paths[1])):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths
