"""benchmarks/exact_whatif.py: the SYNTHETIC copies whose sparse target agrees more with the dense one."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import exact_whatif  # noqa: E402

from dustin_hf.research import traces  # noqa: E402


def _record(n=200, agree=0.8, seed=0):
    rng = random.Random(seed)
    dense = [rng.randrange(50) for _ in range(n)]
    sparse = [d if rng.random() < agree else d + 50 for d in dense]
    lists = {"truth": dense[::-1], "dense": dense, "sparse": sparse, "draft": [t + 1 for t in dense],
             "draft_sparse": [t + 2 for t in sparse]}
    return traces.prediction_record({"target": "t", "draft": "d"}, {"kind": "book", "name": "x"}, 4096, 4, 2048,
                                    {}, lists, "float32", "cpu")


def _share(record):
    p = record["predictions"]
    return sum(s == d for s, d in zip(p["sparse"], p["dense"])) / len(p["dense"])


@pytest.mark.parametrize("level", [0.9, 0.95, 1.0])
def test_the_copy_agrees_at_the_level_asked_and_changes_only_disagreeing_sparse_predictions(level):
    record = _record()
    copy = exact_whatif.raised(record, level, seed=1)
    assert _share(copy) == pytest.approx(level, abs=1 / 200)
    assert copy["agreement"]["sparse_vs_dense"] == pytest.approx(_share(copy))
    before, after = record["predictions"], copy["predictions"]
    for key in ("truth", "dense", "draft", "draft_sparse"):
        assert after[key] == before[key]
    changed = [i for i, (a, b) in enumerate(zip(before["sparse"], after["sparse"])) if a != b]
    assert changed and all(after["sparse"][i] == before["dense"][i] != before["sparse"][i] for i in changed)
    assert "SYNTHETIC" in copy["model_pair"]["what_if"]


def test_a_level_below_the_recorded_agreement_leaves_the_predictions_as_they_are():
    record = _record(agree=0.9)
    assert exact_whatif.raised(record, 0.5, seed=0)["predictions"]["sparse"] == record["predictions"]["sparse"]


def test_the_kept_disagreements_follow_the_seed():
    record = _record()
    same = [exact_whatif.raised(record, 0.9, seed=s)["predictions"]["sparse"] for s in (3, 3, 4)]
    assert same[0] == same[1] != same[2]
