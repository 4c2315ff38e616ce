"""Bundled public-domain books: list them, load them, cut token windows out of them.

Calibration and evaluation need long natural text (thousands of tokens per prompt). The package
ships five books as ``dustin_hf/research/data/texts/<name>.txt.gz`` (see the README there); their sha256 and
size are checked against ``SHA256SUMS`` on every load.

    from dustin_hf.research import texts
    texts.list_books()                                   # ['alice', 'emma', ...]
    ids = texts.token_window(tokenizer, "emma", 4096)    # (4096,) int64, from the book's start

Source code works the same way: ``"py:typing"`` names the source of the standard-library module ``typing``
of the Python running this (held out from calibration, and what a coder pair is for); its file, Python
version and sha256 are in :func:`describe_text`, since they differ between Pythons.
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

__all__ = ["PYTHON_SOURCE", "TextTooShortError", "list_books", "load_text", "book_tokens", "describe_text",
           "token_window"]

_PACKAGE_DIR = "data/texts"
PYTHON_SOURCE = "py:"  # prefix of a text name that is a standard-library module's source


class TextTooShortError(ValueError):
    """A book holds fewer tokens than the context asked for."""


def _data_dir():
    return resources.files("dustin_hf.research").joinpath(_PACKAGE_DIR)


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


@functools.cache
def load_text(name: str) -> str:
    """The full UTF-8 text of book ``name``, checked against its recorded sha256 and size (or, for
    ``"py:MODULE"``, that standard-library module's source)."""
    if name.startswith(PYTHON_SOURCE):
        return _stdlib_source(name.removeprefix(PYTHON_SOURCE)).read_text(encoding="utf-8")
    table = _checksums()
    if name not in table:
        raise ValueError(f"unknown book {name!r}; the bundled books are {list_books()}")
    raw = gzip.decompress(_data_dir().joinpath(f"{name}.txt.gz").read_bytes())
    digest, size = table[name]
    if len(raw) != size or hashlib.sha256(raw).hexdigest() != digest:
        raise RuntimeError(f"bundled book {name!r} is corrupt (size or sha256 differs from SHA256SUMS); reinstall dustin-hf")
    return raw.decode("utf-8")


def _stdlib_source(module: str) -> Path:
    """The ``.py`` file of standard-library module ``module`` (a clear error for anything else)."""
    spec = importlib.util.find_spec(module) if module else None
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    inside = origin is not None and stdlib in origin.resolve().parents and not {"site-packages", "dist-packages"} & set(
        origin.resolve().relative_to(stdlib).parts)
    if not inside or origin.suffix != ".py":
        raise ValueError(f"{PYTHON_SOURCE}{module}: not a pure-Python standard-library module of this Python "
                         f"(try {PYTHON_SOURCE}typing or {PYTHON_SOURCE}inspect)")
    return origin


def describe_text(name: str) -> dict:
    """Where text ``name`` comes from: the bundled book, or the module file with the Python version and sha256."""
    if not name.startswith(PYTHON_SOURCE):
        return {"name": name, "kind": "book", "sha256": _checksums()[name][0] if name in _checksums() else None}
    path = _stdlib_source(name.removeprefix(PYTHON_SOURCE))
    return {"name": name, "kind": "python source", "path": str(path), "python": platform.python_version(),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "chars": len(load_text(name))}


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
