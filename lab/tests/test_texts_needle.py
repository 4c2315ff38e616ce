"""Bundled books and the needle task, with a tiny word-level tokenizer (no downloads)."""

import pytest
from cli_fixtures import tiny_tokenizer

from dustin_lab import texts
from dustin_lab.needle import make_needle, make_needles, needle_found


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_books_are_listed_and_verified():
    assert texts.list_books() == ["alice", "emma", "mobydick", "paradise_lost", "prideprejudice"]
    assert texts.load_text("emma").startswith("EMMA")


def test_unknown_book_names_the_choices():
    with pytest.raises(ValueError, match="bundled books are"):
        texts.load_text("ulysses")


def test_standard_library_source_is_a_text():
    """``stdlib:MODULE`` reads that module's source from this Python, and says which file it was."""
    import hashlib
    import typing

    source = texts.load_text("stdlib:typing")
    assert source == open(typing.__file__, encoding="utf-8").read()
    info = texts.describe_text("stdlib:typing")
    assert info["kind"] == "python-source" and info["path"].endswith("typing.py")
    assert info["sha256"] == hashlib.sha256(source.encode("utf-8")).hexdigest()
    assert texts.describe_text("emma")["kind"] == "book"
    with pytest.raises(ValueError, match="not a pure-Python module of this Python's standard library"):
        texts.load_text("stdlib:pytest")


def test_token_window_and_too_short_error(tok):
    ids = texts.token_window(tok, "alice", 100, offset=10)
    assert ids.shape == (100,) and ids.tolist() == texts.book_tokens(tok, "alice")[10:110].tolist()
    with pytest.raises(texts.TextTooShortError, match="alice.*too few for 10,000,000 tokens"):
        texts.token_window(tok, "alice", 10_000_000)


def test_needle_is_deterministic_near_the_asked_length_and_depth(tok):
    a = make_needle(tok, "emma", 400, 0.5, seed=3)
    b = make_needle(tok, "emma", 400, 0.5, seed=3)
    assert a.passphrase == b.passphrase and a.prompt_ids.tolist() == b.prompt_ids.tolist()
    assert abs(a.prompt_ids.numel() - 400) <= 16
    assert 0.3 < a.needle_position / a.prompt_ids.numel() < 0.8
    assert needle_found(f"It is {a.passphrase.upper()}.", a) and not needle_found("no idea", a)


def test_make_needles_covers_the_product(tok):
    cases = make_needles(tok, ["emma", "alice"], [200, 300], [0.1, 0.9])
    assert [(c.context, c.depth) for c in cases] == [(200, 0.1), (200, 0.9), (300, 0.1), (300, 0.9)]
    assert {c.book for c in cases} == {"emma", "alice"}
