"""Bundled public-domain books: list them, load them, cut token windows out of them.

Calibration and evaluation need long natural text (thousands of tokens per prompt). The package
ships five books as ``dustin_lab/data/texts/<name>.txt.gz`` (see the README there); their sha256 and
size are checked against ``SHA256SUMS`` on every load. Source code is the other kind of text a user
decodes: a name ``stdlib:MODULE`` (e.g. ``stdlib:typing``) stands for the source file of that module of
the running Python's standard library (not bundled: :func:`describe_text` records its path, Python
version and sha256, so a measurement says which file it read).

    from dustin_lab import texts
    texts.list_books()                                   # ['alice', 'emma', ...]
    ids = texts.token_window(tokenizer, "emma", 4096)    # (4096,) int64, from the book's start
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import platform
import sysconfig
from importlib import resources
from pathlib import Path

import torch

__all__ = ["TextTooShortError", "list_books", "load_text", "describe_text", "book_tokens", "token_window"]

_PACKAGE_DIR = "data/texts"
_STDLIB = "stdlib:"


class TextTooShortError(ValueError):
    """A book holds fewer tokens than the context asked for."""


def _data_dir():
    return resources.files("dustin_lab").joinpath(_PACKAGE_DIR)


@functools.cache
def _checksums() -> dict[str, tuple[str, int]]:
    """``{name: (sha256, size)}`` from ``SHA256SUMS`` (lines ``<sha256>  <bytes>  <name>.txt``)."""
    table = {}
    for line in _data_dir().joinpath("SHA256SUMS").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, size, filename = line.split()
            table[filename.removesuffix(".txt")] = (digest, int(size))
    return table


def list_books() -> list[str]:
    """Names of the bundled books, sorted (``load_text`` accepts these)."""
    return sorted(_checksums())


def _stdlib_path(name: str) -> Path:
    """The source file of standard-library module ``stdlib:MODULE`` of this Python."""
    module = name.removeprefix(_STDLIB)
    spec = importlib.util.find_spec(module) if module else None
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    path = None if spec is None or not spec.origin or not spec.origin.endswith(".py") else Path(spec.origin).resolve()
    if path is None or stdlib not in path.parents:
        raise ValueError(
            f"{name!r}: {module!r} is not a pure-Python module of this Python's standard library "
            f"({stdlib}); try stdlib:typing"
        )
    return path


@functools.cache
def load_text(name: str) -> str:
    """The full UTF-8 text of book ``name`` (checked against its recorded sha256 and size), or of ``stdlib:MODULE``."""
    if name.startswith(_STDLIB):
        return _stdlib_path(name).read_text(encoding="utf-8")
    table = _checksums()
    if name not in table:
        raise ValueError(f"unknown book {name!r}; the bundled books are {list_books()}")
    raw = gzip.decompress(_data_dir().joinpath(f"{name}.txt.gz").read_bytes())
    digest, size = table[name]
    if len(raw) != size or hashlib.sha256(raw).hexdigest() != digest:
        raise RuntimeError(
            f"bundled book {name!r} is corrupt (size or sha256 differs from SHA256SUMS); reinstall dustin-hf"
        )
    return raw.decode("utf-8")


def describe_text(name: str) -> dict:
    """Where text ``name`` comes from, for reports: a bundled book, or a standard-library file (path, Python,
    sha256)."""
    if not name.startswith(_STDLIB):
        load_text(name)  # checks the name and the file
        return {"kind": "book", "name": name, "sha256": _checksums()[name][0]}
    path = _stdlib_path(name)
    return {
        "kind": "python-source",
        "name": name,
        "path": str(path),
        "python": platform.python_version(),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


_TOKEN_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def book_tokens(tokenizer, name: str) -> torch.Tensor:
    """The whole book tokenized (no special tokens), ``(n,)`` int64; memoised per tokenizer object."""
    key = (id(tokenizer), name)
    if key not in _TOKEN_CACHE:
        ids = tokenizer(load_text(name), add_special_tokens=False)["input_ids"]
        _TOKEN_CACHE[key] = torch.tensor(ids, dtype=torch.long)
    return _TOKEN_CACHE[key]


def token_window(tokenizer, name: str, length: int, offset: int = 0) -> torch.Tensor:
    """Tokens ``[offset, offset + length)`` of book ``name``, ``(length,)`` int64.

    Raises :class:`TextTooShortError` (saying how long the book is) when the window does not fit.
    """
    if length < 1 or offset < 0:
        raise ValueError(f"length must be >= 1 and offset >= 0, got length={length}, offset={offset}")
    ids = book_tokens(tokenizer, name)
    if offset + length > ids.numel():
        raise TextTooShortError(
            f"book {name!r} has {ids.numel():,} tokens with this tokenizer, too few for {length:,} tokens from offset "
            f"{offset:,}; use a shorter context, a smaller offset or a longer book ({', '.join(list_books())})"
        )
    return ids[offset : offset + length].clone()
