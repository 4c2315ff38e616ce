"""The chunked transfer of the GGUF files (dustin_lab.transfer): split here, receive and join there, damage refused."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dustin_lab import transfer
from dustin_lab.transfer import TransferError


def _sources(tmp_path: Path, sizes=(1000, 2500, 7)) -> list[Path]:
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / "src" / f"file{i}.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def _send_all(chunks: Path, store: Path) -> None:
    for folder in sorted(p for p in chunks.iterdir() if p.is_dir()):
        transfer.receive(folder, store)


@pytest.mark.parametrize("chunk_bytes", [512, 1000, 3507, 10_000])
def test_split_receive_join_round_trip(tmp_path, chunk_bytes):
    """Any chunk size, boundaries inside and between files (3507 ends exactly with the stream): the joined files
    equal the sources byte for byte."""
    sources = _sources(tmp_path)
    manifest = transfer.split(sources, tmp_path / "chunks", chunk_bytes)
    assert sum(c["size"] for c in manifest["chunks"]) == sum(p.stat().st_size for p in sources)
    assert all(c["size"] <= chunk_bytes for c in manifest["chunks"]) and all(c["size"] for c in manifest["chunks"])
    _send_all(tmp_path / "chunks", tmp_path / "store")
    assert transfer.status(tmp_path / "store")["missing"] == []
    joined = transfer.join(tmp_path / "store", tmp_path / "out")
    assert [p.name for p in joined] == [p.name for p in sources]
    for a, b in zip(joined, sources):
        assert a.read_bytes() == b.read_bytes()


def test_a_corrupted_chunk_is_refused_on_arrival(tmp_path):
    transfer.split(_sources(tmp_path), tmp_path / "chunks", 1000)
    chunk = tmp_path / "chunks" / "01" / transfer.CHUNK
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1  # one flipped bit, same size
    chunk.write_bytes(bytes(data))
    with pytest.raises(TransferError, match="chunk 01 fails its sha256"):
        transfer.receive(tmp_path / "chunks" / "01", tmp_path / "store")
    assert chunk.exists()  # left where it was, nothing moved into the store
    assert not (tmp_path / "store" / "01.bin").exists()


def test_a_short_chunk_is_refused(tmp_path):
    transfer.split(_sources(tmp_path), tmp_path / "chunks", 1000)
    chunk = tmp_path / "chunks" / "02" / transfer.CHUNK
    chunk.write_bytes(chunk.read_bytes()[:-1])
    with pytest.raises(TransferError, match="chunk 02 has 999 bytes, expected 1,000"):
        transfer.receive(tmp_path / "chunks" / "02", tmp_path / "store")


def test_join_names_the_missing_chunks(tmp_path):
    transfer.split(_sources(tmp_path), tmp_path / "chunks", 1000)
    for name in ("00", "02"):
        transfer.receive(tmp_path / "chunks" / name, tmp_path / "store")
    with pytest.raises(TransferError, match=r"2 of 4 chunks missing or short .*: 01, 03;"):
        transfer.join(tmp_path / "store", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written before every chunk is there


def test_join_rehashes_chunks_damaged_in_the_store(tmp_path):
    """A chunk damaged after its arrival (same size) is found before any file is rebuilt."""
    transfer.split(_sources(tmp_path), tmp_path / "chunks", 1000)
    _send_all(tmp_path / "chunks", tmp_path / "store")
    stored = tmp_path / "store" / "03.bin"
    data = bytearray(stored.read_bytes())
    data[0] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(TransferError, match="chunk 03 fails its sha256"):
        transfer.join(tmp_path / "store", tmp_path / "out")


def test_chunks_of_another_split_are_refused(tmp_path):
    transfer.split(_sources(tmp_path), tmp_path / "a", 1000)
    transfer.receive(tmp_path / "a" / "00", tmp_path / "store")
    transfer.split(_sources(tmp_path / "other", sizes=(999,)), tmp_path / "b", 1000)
    with pytest.raises(TransferError, match="another split"):
        transfer.receive(tmp_path / "b" / "00", tmp_path / "store")


def test_the_joined_file_is_checked_against_the_manifest(tmp_path):
    """A manifest whose file checksum disagrees with its chunks (a split from changed sources) fails the join."""
    sources = _sources(tmp_path)
    transfer.split(sources, tmp_path / "chunks", 1000)
    _send_all(tmp_path / "chunks", tmp_path / "store")
    held = tmp_path / "store" / transfer.MANIFEST
    manifest = json.loads(held.read_text())
    manifest["files"][1]["sha256"] = hashlib.sha256(b"something else").hexdigest()
    held.write_text(json.dumps(manifest))
    with pytest.raises(TransferError, match="file1.gguf does not match the manifest"):
        transfer.join(tmp_path / "store", tmp_path / "out")


def test_receive_runs_as_a_plain_script_without_torch(tmp_path):
    """On the GPU machine ``receive`` runs as ``python lab/dustin_lab/transfer.py``: no package install, no torch."""
    transfer.split(_sources(tmp_path), tmp_path / "chunks", 1000)
    script = Path(transfer.__file__)
    code = (
        "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as done:\n    assert not done.code, done.code\nassert 'torch' not in sys.modules, 'torch'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(script), "receive", str(tmp_path / "chunks" / "00"), str(tmp_path / "store")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "chunk 00 ok: 1/4" in done.stdout
    bad = subprocess.run(
        [sys.executable, str(script), "join", str(tmp_path / "store")], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "3 of 4 chunks missing" in bad.stderr
