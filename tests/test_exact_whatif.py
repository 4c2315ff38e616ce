"""benchmarks/exact_whatif.py: the SYNTHETIC copies whose sparse target agrees more with the dense one."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import exact_whatif  # noqa: E402

from dustin_lab import traces  # noqa: E402


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


WARMUP = 3  # e2e.py: counted in dense_steps / sparse_steps, not in steps, seconds or tokens


def _row(method, dense, sparse, tokens, seconds=9.9):
    scale = (dense + sparse + WARMUP) / (dense + sparse)
    return {"method": method, "seconds": seconds, "dense_steps": dense * scale, "sparse_steps": sparse * scale,
            "tokens": tokens, "steps": dense + sparse, "tokens_per_step": 0.0, "exact": {}}


COSTS = {"dense": 0.010, "sparse": {2048: 0.006}, "sparse_per_position": None}  # D 10 ms, S 6 ms


def _run(confirm_tokens):
    return {"gamma": 4, "exact_mode": {"budget": [2048], "confirm_tokens": confirm_tokens},
            "rows": [_row("spec_sparse_draft", 100, 0, 200), _row("dustin_exact", 40, 60, 300)]}


def test_a_case_is_priced_with_its_confirming_step_and_solves_the_goal():
    case = exact_whatif.priced(_run(4), COSTS, classic=200.0, goal=1.5, dense_by_width={9: 0.010, 13: 0.014})
    seconds = 40 * 0.010 + 60 * 0.006
    assert case["ESTIMATE_exact_over_classic"] == pytest.approx(300 / seconds / 200.0)
    assert case["ESTIMATE_exact_over_baseline"] == pytest.approx((300 / seconds) / (200 / 1.0))
    assert not case["upper_bound"] and case["dense_step_ms"] == pytest.approx(10.0)
    needed = case["sparse_step_ms_for_1.5x_classic"] / 1e3  # at that sparse step, exact runs 1.5x classic
    assert 300 / (40 * 0.010 + 60 * needed) == pytest.approx(1.5 * 200.0)


@pytest.mark.parametrize("confirm_tokens, dense_ms, bound", [(8, 14.0, False), (12, 14.0, True), (2, 10.0, False)])
def test_a_wider_confirming_step_takes_the_narrowest_timed_width_that_holds_it(confirm_tokens, dense_ms, bound):
    case = exact_whatif.priced(_run(confirm_tokens), COSTS, classic=200.0, goal=1.5,
                               dense_by_width={9: 0.010, 13: 0.014})
    assert case["confirm_width"] == 1 + confirm_tokens + 4
    assert case["dense_step_ms"] == pytest.approx(dense_ms) and case["upper_bound"] is bound
    assert case["ESTIMATE_exact_over_classic"] == pytest.approx(300 / (40 * dense_ms / 1e3 + 60 * 0.006) / 200.0)


def test_a_goal_the_dense_steps_alone_miss_has_no_sparse_step():
    case = exact_whatif.priced(_run(4), COSTS, classic=200.0, goal=100.0, dense_by_width={9: 0.010})
    assert case["sparse_step_ms_for_100.0x_classic"] is None


def test_the_wide_step_is_what_remains_after_the_sparse_steps():
    gpu = {"gamma": 4, "exact_mode": {"budget": [2048], "confirm_tokens": 8},
           "rows": [_row("dustin_exact", 50, 25, 0, seconds=50 * 0.020 + 25 * 0.006)]}
    assert exact_whatif.wide_step(gpu, COSTS) == (13, pytest.approx(0.020))
