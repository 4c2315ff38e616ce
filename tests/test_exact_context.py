"""benchmarks/exact_context.py: the step costs fitted from a GPU run and the estimate built from them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import exact_context  # noqa: E402

WARMUP = 3  # e2e.py: counted in dense_steps / sparse_steps, not in steps, seconds or tokens


def _row(method, seconds, dense, sparse, tokens=0):
    """A row whose timed steps are ``dense`` dense and ``sparse`` sparse, its counts holding a warm-up in the same
    proportion (so that the scaling back is exact)."""
    scale = (dense + sparse + WARMUP) / (dense + sparse)
    return {"method": method, "seconds": seconds, "dense_steps": dense * scale, "sparse_steps": sparse * scale,
            "tokens": tokens, "steps": dense + sparse, "tokens_per_step": 0.0}


# D = 10 ms; exact's sparse step 5 ms at 512, 8 ms at 2048 (so 2 ms more per 1024 positions)
GPU = {"rows": [_row("spec_sparse_draft", 1.0, 100, 0), _row("dustin_exact@2048", 50 * 0.010 + 25 * 0.008, 50, 25),
                _row("dustin_exact@512", 40 * 0.010 + 60 * 0.005, 40, 60)]}


def test_step_costs_recover_the_dense_and_sparse_steps():
    costs = exact_context.step_costs(GPU)
    assert costs["dense"] == pytest.approx(0.010)
    assert costs["sparse"] == pytest.approx({512: 0.005, 2048: 0.008})
    assert costs["sparse_per_position"] == pytest.approx(0.003 / 1536)
    assert exact_context.costs_ms(costs)["sparse_2048"] == pytest.approx(8.0)


def _expected(tokens, dense, sparse, sparse_ms):  # per ms; the CPU seconds play no part
    return (tokens / (dense * 10 + sparse * sparse_ms)) / (200 / (100 * 10))


@pytest.mark.parametrize("budget, sparse_ms", [(2048, 8.0), (4096, 12.0)])
def test_the_estimate_prices_each_replay_with_its_own_budget(budget, sparse_ms):
    run = {"command": "python e2e.py --smoke --predictions a/x.json b/y.json --out r.json",
           "exact_mode": {"budget": [budget]},
           "rows": [_row("spec_sparse_draft", 9.9, 100, 0, tokens=200),
                    {**_row("dustin_exact", 9.9, 40, 60, tokens=300), "exact": {"confirmed_fraction": 0.9}}]}
    (out,) = exact_context.cases(run, exact_context.step_costs(GPU))
    assert out["predictions"] == ["x.json", "y.json"] and out["estimated_sparse_step_ms"] == pytest.approx(sparse_ms)
    assert out["ESTIMATE_exact_over_baseline"] == pytest.approx(_expected(300, 40, 60, sparse_ms))


def test_a_replay_of_several_budgets_prices_each_row_at_its_own():
    run = {"command": "python e2e.py --predictions x.json", "exact_mode": {"budget": [4096, 2048]},
           "rows": [_row("spec_sparse_draft", 9.9, 100, 0, tokens=200),
                    {**_row("dustin_exact@4096", 9.9, 30, 70, tokens=320), "exact": {}},
                    {**_row("dustin_exact@2048", 9.9, 40, 60, tokens=300), "exact": {}}]}
    priced = exact_context.cases(run, exact_context.step_costs(GPU))
    assert [c["budget"] for c in priced] == [4096, 2048]
    assert priced[0]["ESTIMATE_exact_over_baseline"] == pytest.approx(_expected(320, 30, 70, 12.0))
    assert priced[1]["ESTIMATE_exact_over_baseline"] == pytest.approx(_expected(300, 40, 60, 8.0))


def test_a_gpu_run_of_one_exact_budget_prices_that_budget_only():
    one = {"exact_mode": {"budget": [2048]},
           "rows": [GPU["rows"][0], {**GPU["rows"][1], "method": "dustin_exact"}]}
    costs = exact_context.step_costs(one)
    assert costs["sparse"] == pytest.approx({2048: 0.008}) and costs["sparse_per_position"] is None
    assert exact_context.sparse_step(costs, 2048) == pytest.approx(0.008)
    with pytest.raises(SystemExit, match="needs a second one"):
        exact_context.sparse_step(costs, 4096)


def test_a_gpu_run_without_an_exact_row_is_refused():
    with pytest.raises(SystemExit, match="dustin_exact"):
        exact_context.step_costs({"rows": GPU["rows"][:1]})
