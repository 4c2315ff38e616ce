"""benchmarks/surgery.py: each variant switches off what it names in ``fused_ops``, and the whole script runs on tiny
models (CPU), the A/B it prints included."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: the fused ops' dry runs
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import e2e  # noqa: E402
import surgery  # noqa: E402
from conftest import TRITON_RUNS  # noqa: E402
from tiny_models import one_thread  # noqa: E402,F401

from dustin_hf.runtime.rotary import rotary_wrapper  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton (CUDA, or TRITON_INTERPRET=1 on CPU)"),
]


def test_every_variant_turns_off_what_it_names():
    """Against every path on, each variant's dry run of ``fused_ops`` differs (the rotary's where every path on fuses
    some rotary: through the attentions' own rotary wrapper with the ``kernels`` package, else through a copy of
    the attention's forward, which transformers 5.24+ wraps and so leaves unfused), and ``none`` leaves every path
    off."""
    target = e2e.build_model("tiny", [torch.device("cpu")], torch.float32)
    draft = e2e.build_model("tiny-draft", [torch.device("cpu")], torch.float32)
    reports = surgery.changed_paths(target, draft, surgery.VARIANTS)
    hooked = any(rotary_wrapper(m) is not None for m in target.modules())
    assert reports["on"]["norms"] and reports["on"]["layers"]
    rotary = bool(reports["on"]["rotary_modules"])
    assert rotary or not hooked  # a wrapper of its own always takes the fused rotary
    for name in surgery.VARIANTS:
        assert (reports[name] != reports["on"]) == (name != "rotary" or rotary), name
    assert not any(reports["none"].values())


def test_smoke_runs_every_variant_and_saves_its_provenance(tmp_path):
    out = tmp_path / "surgery.json"
    result = surgery.main(["--smoke", "--out", str(out)])
    assert [row["variant"] for row in result["rows"]] == list(surgery.VARIANTS)
    for row in result["rows"]:
        assert row["decode"]["step_ms"] > 0 and "delta_percent" in row["decode"]
        assert (row["call"] is not None) == (row["variant"] in surgery.CALL_VARIANTS)
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("benchmarks/surgery.py --smoke")
    assert saved["versions"]["torch"] == torch.__version__
