"""benchmarks/long_context.py: its measures of free-running text, its merge of runs, and the whole script on tiny
models (every phase, as the GPU runs it, at CPU sizes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import long_context as lc  # noqa: E402
from tiny_models import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")


def test_text_measures():
    """distinct n-grams, the longest span occurring twice, a looping tail, copying from the prompt."""
    assert lc.distinct([1, 2, 3, 4, 5, 6]) == 1.0
    assert lc.distinct([7] * 10) == 1 / 7  # 7 four-grams, all the same
    assert lc.longest_repeat([1, 2, 3, 9, 1, 2, 3, 8]) == 3
    assert lc.longest_repeat([5, 5, 5, 5]) == 3  # overlapping occurrences count
    assert lc.longest_repeat([1, 2, 3]) == 0
    text = list(range(40)) + [1, 2, 3] * 30
    assert lc.loop_period(text) == 3
    assert lc.loop_period(list(range(200))) is None
    assert lc.loop_period([1, 2] * 10) is None  # shorter than the tail it must repeat
    prompt = list(range(100))
    assert lc.copied_share(list(range(10, 30)), prompt) == 1.0
    assert lc.copied_share([0, 1, 2, 3, 4, 5, 6, 99, 98, 97, 96, 95, 94, 93, 92], prompt, n=8) == 0.0
    assert lc.first_difference([1, 2, 3], [1, 2, 4]) == 2 and lc.first_difference([1, 2], [1, 2]) == 2


def test_answers_end_at_the_first_special_token():
    class Tok:
        all_special_ids = [0, 1]

    assert lc._reply(Tok(), [5, 6, 1, 7, 8]) == [5, 6]
    assert lc._reply(Tok(), [5, 6]) == [5, 6]


def test_free_summary_gives_the_dense_references_spread():
    def row(method, distinct, loop, sampling=False):
        return {
            "context": 8,
            "method": method,
            "sampling": sampling,
            "row": 0,
            "text": "t",
            "distinct4": distinct,
            "longest_repeat": 5,
            "loop_period": loop,
            "copied8": 0.1,
            "nll": None if method == "plain" else 0.3,
            "leaves_plain_at": 4,
            "mean_accepted_per_step": None if method == "plain" else 32.0,
        }

    summary = lc._free_summary(
        [
            row("plain", 0.5, None),
            row("dense", 0.4, 3),
            row("exact", 0.45, None),
            row("sparse", 0.2, 2),
            row("dense", 0.9, None, sampling=True),
        ],
        batch=16,
    )
    spread = summary["8/dense_spread/greedy"]
    assert spread["distinct4"] == [0.4, 0.5] and spread["rows_looping"] == [0, 1]
    assert summary["8/sparse/greedy"]["drafts_kept_per_step_per_row"] == 2.0  # 32 kept by the batch of 16
    assert summary["8/dense/sampling"]["distinct4"] == 0.9


def test_publish_merges_runs_and_drops_token_lists(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
    fidelity = {"context": 8, "text": "t", "methods": {"x": {"ppl_ratio": 1.1}}}
    (a / "fidelity.json").write_text(json.dumps({"command": "first", "records": [fidelity]}))
    (b / "fidelity.json").write_text(
        json.dumps({"command": "second", "records": [{**fidelity, "methods": {"y": {"ppl_ratio": 1.0}}}]})
    )
    free = {"context": 8, "method": "m", "sampling": False, "row": 0, "tokens": [1, 2, 3], "distinct4": 1.0}
    (a / "free.json").write_text(json.dumps({"command": "first", "records": [free], "summary": {"k": 1}}))
    (b / "free.json").write_text(
        json.dumps({"command": "second", "records": [free, {**free, "row": 1}], "summary": {"k": 2}})
    )
    written = lc.publish([a, b], tmp_path / "out")
    assert sorted(p.name for p in written) == ["real_pair_fidelity.json", "real_pair_free.json"]
    merged = json.loads((tmp_path / "out" / "real_pair_fidelity.json").read_text())
    assert merged["sources"] == ["first", "second"] and set(merged["records"][0]["methods"]) == {"x", "y"}
    free_out = json.loads((tmp_path / "out" / "real_pair_free.json").read_text())
    assert len(free_out["records"]) == 2 and all("tokens" not in r for r in free_out["records"])
    assert free_out["summary"] == {"k": 2}


def test_every_phase_runs_on_tiny_models(tmp_path):
    """The script as the GPU runs it, at CPU sizes: each phase writes records, stored prefills serve every setting,
    the walk writes the sparse draft's traces, a second run resumes instead of repeating."""
    out = tmp_path / "study"
    argv = [
        "--smoke",
        "--phases",
        "retrieval",
        "free",
        "fidelity",
        "calls",
        "--out",
        str(out),
        "--quiet",
        "--traces",
        str(tmp_path / "traces"),
    ]
    lc.main(argv)
    retrieval = json.loads((out / "retrieval.json").read_text())
    assert {r["method"] for r in retrieval["records"]} == {
        "plain",
        "dense",
        "exact",
        "small",
        "small_sd",
        "small_select",
    }
    assert all(r["same_as_plain"] for r in retrieval["records"] if r["method"] in ("dense", "exact"))
    free = json.loads((out / "free.json").read_text())
    assert {(r["method"], r["sampling"]) for r in free["records"]} >= {
        ("plain", False),
        ("small", False),
        ("dense", True),
        ("small", True),
    }
    assert all(r["leaves_plain_at"] == 24 for r in free["records"] if r["method"] == "dense" and not r["sampling"])
    fidelity = json.loads((out / "fidelity.json").read_text())
    assert {"small", "small_sd", "small_select", "oracle64"} == set(fidelity["records"][0]["methods"])
    assert list((tmp_path / "traces" / "small_sd").glob("*_predictions_*.json"))
    calls = json.loads((out / "calls.json").read_text())
    assert {r["method"] for r in calls["records"]} == {
        "plain",
        "stock_assisted",
        "classic",
        "default",
        "dustin_sparse_draft",
        "exact",
    }
    assert any(r.get("sparse_steps") for r in calls["records"] if r["method"] == "dustin_sparse_draft")
    count = len(free["records"])
    lc.main(argv[:2] + ["free"] + argv[6:])  # the same phase again: everything is there, nothing runs twice
    assert len(json.loads((out / "free.json").read_text())["records"]) == count
    from transformers.generation import configuration_utils

    assert "dustin" not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS  # unpatched when done
