"""``benchmarks/exact_schedule.py``: exact mode's schedule replayed on prediction lists (no models)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "exact_schedule", Path(__file__).resolve().parents[1] / "benchmarks" / "exact_schedule.py")
exact_schedule = sys.modules.setdefault("exact_schedule", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(exact_schedule)


def _lists(n: int, sparse_wrong=(), draft_wrong=()) -> dict:
    truth = list(range(n))
    sparse = [-1 if i in sparse_wrong else t for i, t in enumerate(truth)]
    draft = [-2 if i in draft_wrong else t for i, t in enumerate(truth)]
    return {"truth": truth, "dense": truth, "sparse": sparse, "draft": draft, "draft_sparse": draft}


def test_a_hand_replayed_row():
    """γ=2, confirm after 2 tentative tokens; the sparse target is wrong at position 1 only.
    Step 1 sparse: the draft at 0 kept, the sparse target's (wrong) token at 1: 2 tentative. Step 2 confirms: keeps
    1, the dense target's token at 1 (2 committed), the row's limit drops to 1. Step 3 sparse: 2 drafts + its token,
    3 tentative from 2. Step 4 confirms all 3, then both new drafts and the dense token: 6 committed, 8 in all."""
    run = exact_schedule.replay_exact(_lists(12, sparse_wrong={1}), 512, 2, 4, 2, exact_schedule.Costs(), batch=1,
                                      new_tokens=8)
    assert run["steps"] == 4 and run["tokens"] == 8
    assert run["confirmations"] == 2 and run["tentative_rejected"] == 1
    assert run["confirmed_fraction"] == pytest.approx(4 / 5) and run["tokens_per_confirmation"] == 4
    assert run["dense_row_steps_per_token"] == pytest.approx(2 / 8)


def test_baselines_and_agreement_bounds():
    """confirm_tokens=0 verifies every step densely (the sparse-draft baseline); where the sparse target always
    agrees, exact mode confirms everything and beats that baseline; where it never agrees, it keeps nothing."""
    costs = exact_schedule.Costs()
    perfect = _lists(400, draft_wrong=set(range(3, 400, 4)))
    baseline = exact_schedule.replay_exact(perfect, 512, 0, 1, 4, costs)
    assert baseline["confirmations"] == 0 and baseline["dense_row_steps_per_token"] == pytest.approx(
        1 / baseline["tokens_per_row_step"], rel=0.01)  # rows that finished early make a few steps partial
    classic = exact_schedule.replay_plain(perfect, "draft", "dense", 21.66, 4)
    assert classic["tokens_per_row_step"] == pytest.approx(baseline["tokens_per_row_step"])  # same lists, same counts
    exact = exact_schedule.replay_exact(perfect, 512, 8, 4, 4, costs)
    assert exact["confirmed_fraction"] == 1.0 and exact["tokens_per_s"] > baseline["tokens_per_s"]
    hopeless = exact_schedule.replay_exact(_lists(400, sparse_wrong=set(range(400))), 512, 8, 4, 4, costs)
    assert hopeless["confirmed_fraction"] == 0.0


def test_cost_terms_and_the_formula():
    costs = exact_schedule.Costs()
    assert costs.budget_ms(512, 16, 4) == 0 and 0 < costs.budget_ms(1024, 16, 4) < costs.budget_ms(2048, 16, 4)
    assert costs.gemm_ms(5) == 0 and costs.gemm_ms(13) > 0  # 80 rows read-bound, 208 compute-bound
    assert exact_schedule.expected_prefix(0.5, 2) == pytest.approx(0.5 + 0.25)
    assert exact_schedule.expected_prefix(1.0, 3) == 3
