"""Needle in a haystack (LongBench-style retrieval), built from the bundled books.

A sentence ``The secret passphrase is <word>-<number>.`` is inserted at a given depth (share of the
haystack before it) of a book excerpt, and the model is asked for the passphrase at the end. With
a chat template (instruct models) the question is a user turn followed by the generation prompt;
without one, a plain ``Question: ... Answer:`` suffix. The answer is scored by exact containment of
the passphrase (case-insensitive). Everything is deterministic given the seed.

The needle sits at a sentence boundary near the asked depth; the prompt's total length is within
a few tokens of the asked context (re-tokenising around the insertion can shift it slightly;
``Needle.prompt_ids.numel()`` is the exact length).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

from .texts import TextTooShortError, book_tokens

__all__ = ["Needle", "make_needle", "make_needles", "needle_found"]

_WORDS = (
    "amber",
    "falcon",
    "harbor",
    "juniper",
    "lantern",
    "meadow",
    "orchid",
    "quartz",
    "saffron",
    "thistle",
    "velvet",
    "walnut",
    "cobalt",
    "ember",
    "glacier",
    "indigo",
)
QUESTION = "What is the secret passphrase mentioned in the text above? Answer with the passphrase only."
_INTRO = "Read the following text carefully."
_SEARCH_TOKENS = 256  # how far past the asked depth to look for a sentence end
_ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Esq.")


@dataclass(frozen=True)
class Needle:
    """One retrieval case: the prompt, where the needle is, and the expected answer."""

    book: str
    context: int  # asked prompt length in tokens
    depth: float  # asked share of the haystack before the needle
    passphrase: str
    offset: int  # first haystack token in the book
    needle_position: int  # token index of the needle sentence's start in the prompt (approximate)
    prompt_ids: torch.Tensor  # (n,) int64

    def describe(self) -> dict:
        return {
            "book": self.book,
            "context": self.context,
            "depth": self.depth,
            "passphrase": self.passphrase,
            "offset": self.offset,
            "needle_position": self.needle_position,
            "prompt_tokens": self.prompt_ids.numel(),
        }


def needle_found(answer: str, needle: Needle) -> bool:
    """Exact containment of the passphrase in the answer (case-insensitive)."""
    return needle.passphrase.lower() in answer.lower()


def _render(tokenizer, haystack: str) -> list[int]:
    """The full prompt's ids around ``haystack`` (chat template when the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{_INTRO}\n\n{haystack}\n\n{QUESTION}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = f"{_INTRO}\n\n{haystack}\n\nQuestion: {QUESTION}\nAnswer:"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sentence_cut(tokenizer, ids: torch.Tensor, cut: int) -> int:
    """The first token at or after ``cut`` that follows a sentence end (``.``, ``!`` or ``?``, maybe
    closing a quote; not after Mr./Mrs./Dr./St.); ``cut`` itself if none is near."""
    for i in range(max(cut, 2), min(cut + _SEARCH_TOKENS, ids.numel())):
        piece = tokenizer.decode(ids[i - 2 : i]).rstrip().rstrip("\"'")
        if piece.endswith((".", "!", "?")) and not piece.endswith(_ABBREVIATIONS):
            return i
    return cut


def make_needle(tokenizer, book: str, context: int, depth: float, seed: int = 0) -> Needle:
    """One needle case of ``context`` prompt tokens from ``book`` at ``depth`` (0 < depth < 1)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(zlib.crc32(f"{seed}:{book}:{context}:{depth:.4f}".encode()))
    passphrase = f"{rng.choice(_WORDS)}-{rng.randrange(1000, 10000)}"
    needle_text = f"The secret passphrase is {passphrase}."
    overhead = len(_render(tokenizer, needle_text)) + 2  # template, question and needle around an empty haystack
    size = context - overhead
    if size < 16:
        raise ValueError(
            f"context {context} is too short for a needle prompt (its frame alone takes {overhead} tokens)"
        )
    ids = book_tokens(tokenizer, book)
    if ids.numel() < size:
        raise TextTooShortError(
            f"book {book!r} has {ids.numel():,} tokens, too few for a {context:,}-token needle prompt"
        )
    offset = rng.randrange(0, ids.numel() - size + 1)
    hay = ids[offset : offset + size]
    cut = _sentence_cut(tokenizer, hay, int(round(depth * size)))
    haystack = f"{tokenizer.decode(hay[:cut]).rstrip()} {needle_text} {tokenizer.decode(hay[cut:]).lstrip()}"
    prompt = torch.tensor(_render(tokenizer, haystack), dtype=torch.long)
    position = _needle_position(tokenizer, prompt, passphrase)
    if position >= prompt.numel():  # a lossy tokenizer (unknown words) cannot show it: estimate from the cut
        position = prompt.numel() - size + cut
    return Needle(book, context, depth, passphrase, offset, position, prompt)


def _needle_position(tokenizer, prompt: torch.Tensor, passphrase: str) -> int:
    """Token index where the decoded prompt first contains the passphrase (binary search on prefixes)."""
    lo, hi = 0, prompt.numel()
    while lo < hi:
        mid = (lo + hi) // 2
        if passphrase in tokenizer.decode(prompt[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def make_needles(tokenizer, books: list[str], contexts: list[int], depths: list[float], seed: int = 0) -> list[Needle]:
    """The cross product, books cycling over (context, depth) pairs so that every book is used."""
    cases = []
    for i, (context, depth) in enumerate((c, d) for c in contexts for d in depths):
        cases.append(make_needle(tokenizer, books[i % len(books)], context, depth, seed))
    return cases
