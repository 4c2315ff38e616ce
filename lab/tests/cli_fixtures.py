"""Tiny model folders for CLI tests: the lab's tiny pair (a word-level tokenizer, random Qwen2 models)."""

from dustin_lab.tiny import save_tiny_pair as save_pair
from dustin_lab.tiny import tiny_qwen, tiny_tokenizer

__all__ = ["save_pair", "tiny_qwen", "tiny_tokenizer"]
