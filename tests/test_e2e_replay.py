"""The end-to-end benchmark's replays (``benchmarks/replay.py``): synthetic traces, hand-checked outcomes, and the
decode loop honouring them (tiny models, CPU)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import e2e  # noqa: E402
import replay  # noqa: E402
from replay import (  # noqa: E402
    AcceptReplay,
    BudgetReplay,
    CountReplay,
    ExactReplay,
    Predictions,
    at_budget,
    load_budgets,
    load_predictions,
    synthetic_predictions,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, far faster under load

GAMMA = 4


def _trace(dense, sparse=None, draft=None, draft_sparse=None, budget=32, name="t") -> Predictions:
    sparse = dense if sparse is None else sparse
    draft = dense if draft is None else draft
    draft_sparse = draft if draft_sparse is None else draft_sparse
    return Predictions(
        name,
        4096,
        GAMMA,
        budget,
        dict(
            truth=list(dense),
            dense=list(dense),
            sparse=list(sparse),
            draft=list(draft),
            draft_sparse=list(draft_sparse),
        ),
    )


def _steps(hook, batch: int, n: int) -> list[list[int]]:
    zeros = torch.zeros(batch, dtype=torch.long)
    return [hook(zeros).tolist() for _ in range(n)]


# ----------------------------------------------------------------------------- counts
def test_count_replay_walks_each_row_from_its_own_offset():
    accept = CountReplay((0, 1, 2, 3, 4, 5), "x").hooks()["accept"]
    assert _steps(accept, 3, 3) == [[0, 2, 4], [1, 3, 5], [2, 4, 0]]
    assert CountReplay.load(None, GAMMA).counts == replay.PAPER_COUNTS


def test_count_replay_rejects_another_gamma(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "dustin_hf.acceptance_trace/1", "gamma": 3, "sequences": []}))
    with pytest.raises(ValueError, match="γ=3"):
        CountReplay.load([str(path)], GAMMA)


# ----------------------------------------------------------------------------- plain acceptance
def test_accept_replay_keeps_the_longest_agreeing_prefix_and_cycles():
    dense = list(range(10))
    draft = [d if i not in (2, 7) else -1 for i, d in enumerate(dense)]
    accept = AcceptReplay([_trace(dense, draft=draft)], "draft", "dense", GAMMA).hooks()["accept"]
    # from 0: 0, 1 agree, 2 not -> 2 kept, next at 3; from 3: 3..6 -> 4 (γ), next at 8; from 8: 8, 9, 0, 1 (the
    # text cycles) -> 4, next at 13 = 3
    assert _steps(accept, 1, 4) == [[2], [4], [4], [4]]


def test_accept_replay_rows_cover_the_texts_in_proportion():
    walks = replay._Walks([_trace(range(30), name="a"), _trace(range(10), name="b")], ("dense",))
    first, length, offset = walks.rows(4, torch.device("cpu"))
    assert first.tolist() == [0, 0, 0, 30] and length.tolist() == [30, 30, 30, 10]
    assert offset.tolist() == [0, 10, 20, 0]


def test_accept_replay_reads_its_verifier():
    dense, sparse = [1] * 8, [1, 1, 0, 1, 1, 1, 1, 1]
    trace = _trace(dense, sparse=sparse)
    assert _steps(AcceptReplay([trace], "draft", "dense", GAMMA).hooks()["accept"], 1, 1) == [[4]]
    assert _steps(AcceptReplay([trace], "draft", "sparse", GAMMA).hooks()["accept"], 1, 1) == [[2]]


def test_a_fresh_hook_starts_over():
    accept = AcceptReplay([synthetic_predictions()], "draft", "dense", GAMMA)
    assert _steps(accept.hooks()["accept"], 3, 5) == _steps(accept.hooks()["accept"], 3, 5)


# ----------------------------------------------------------------------------- exact mode
def test_exact_replay_by_hand():
    """Sparse steps extend the tentative tokens, a confirmation keeps them while the two targets agree (then the
    drafts), a dense step commits at once."""
    dense = list(range(20))
    sparse = [-1 if i in (3, 6) else t for i, t in enumerate(dense)]
    confirm = ExactReplay([_trace(dense, sparse=sparse, draft=sparse)], "draft", 2, max_tentative=12).hooks()[
        "confirm"
    ]

    def step(t, d):
        out = confirm(torch.zeros(1, dtype=torch.long), torch.tensor([t]), torch.tensor([d]))
        return int(out[0])

    assert step(0, False) == 2  # sparse from 0: positions 0, 1 kept; tentative 0..2
    assert step(3, True) == 3  # 0..2 agree; the draft at 3 is the sparse target's, which the dense one rejects
    assert step(0, False) == 2  # committed 0..3; sparse from 4: 4, 5 kept, tentative 4..6
    assert step(0, False) == 2  # from 7: tentative 4..9
    assert step(6, True) == 2  # 4, 5 agree, 6 does not: 2 kept, the dense target's token at 6; committed 0..6
    assert step(0, True) == 2  # dense from 7: 7, 8 kept, committed 0..9


def _reference_exact(trace: Predictions, draft: str, gamma: int, batch: int):
    """Exact mode's replay in plain Python, one row at a time, returning each confirming row's tentative count."""
    tok, n = trace.tokens, len(trace)
    starts = [b * n // batch for b in range(batch)]
    committed, end = list(starts), list(starts)

    def run(a, b, pos, limit):
        k = 0
        while k < limit and tok[a][(pos + k) % n] == tok[b][(pos + k) % n]:
            k += 1
        return k

    def step(tentative, dense):
        out = []
        for b in range(batch):
            t, c, e = tentative[b], committed[b], end[b]
            if t:
                kept = run("sparse", "dense", c, t)
                count = kept if kept < t else t + run(draft, "dense", c + t, gamma)
                committed[b] = end[b] = c + count + 1
            elif dense[b]:
                count = run(draft, "dense", e, gamma)
                committed[b] = end[b] = e + count + 1
            else:
                count = run(draft, "sparse", e, gamma)
                end[b] = e + count + 1
            out.append(count)
        return out

    return step, lambda b: end[b] - committed[b]


@pytest.mark.parametrize("seed", range(4))
def test_exact_replay_matches_a_plain_reference(seed):
    rng = random.Random(seed)
    trace = synthetic_predictions(length=97, seed=seed)
    batch, gamma = 5, GAMMA
    confirm = ExactReplay([trace], "draft_sparse", gamma, max_tentative=40).hooks()["confirm"]
    reference, held = _reference_exact(trace, "draft_sparse", gamma, batch)
    for _ in range(60):
        tentative = [held(b) if held(b) and rng.random() < 0.4 else 0 for b in range(batch)]
        dense = [bool(t) or rng.random() < 0.2 for t in tentative]
        got = confirm(torch.zeros(batch, dtype=torch.long), torch.tensor(tentative), torch.tensor(dense))
        assert got.tolist() == reference(tentative, dense)


# ----------------------------------------------------------------------------- files
def _write(path: Path, record: dict) -> str:
    path.write_text(json.dumps(record))
    return str(path)


def _prediction_record(**changes) -> dict:
    lists = {key: [1, 2, 3] for key in replay.PREDICTION_KEYS}
    return {
        "format": replay.PREDICTION_FORMAT,
        "model_pair": {"target": "t", "draft": "d"},
        "text": {"book": "x"},
        "context": 4096,
        "gamma": GAMMA,
        "budget": 512,
        "predictions": lists,
        "extra": 1,
    } | changes


def test_load_predictions_checks_format_gamma_and_lists(tmp_path):
    traces = load_predictions([_write(tmp_path / "a.json", _prediction_record())], GAMMA)
    assert len(traces[0]) == 3 and traces[0].budget == 512 and traces[0].pair == "t + d"
    with pytest.raises(ValueError, match="not a dustin_hf.prediction_trace/1"):
        load_predictions([_write(tmp_path / "b.json", _prediction_record(format="x"))], GAMMA)
    with pytest.raises(ValueError, match="γ=2"):
        load_predictions([_write(tmp_path / "c.json", _prediction_record(gamma=2))], GAMMA)
    short = _prediction_record()
    short["predictions"]["sparse"] = [1]
    with pytest.raises(ValueError, match="one length"):
        load_predictions([_write(tmp_path / "d.json", short)], GAMMA)
    partial = _prediction_record()
    del partial["predictions"]["draft_sparse"]
    with pytest.raises(ValueError, match=r"lack \['draft_sparse'\]"):
        load_predictions([_write(tmp_path / "e.json", partial)], GAMMA)
    with pytest.raises(ValueError, match=r"budget 1024 with selection 'dustin' \(recorded: dustin 512\)"):
        at_budget(traces, 1024)


def test_traces_of_the_selection_layers_stay_apart(tmp_path):
    """A trace recorded with the selection layers (its resolved config names them) is named ``..._select.json``
    and replays only the methods that run them: the same budget's trace of Dustin's set must never stand in."""
    from dustin_lab.traces import prediction_record, write_predictions

    lists = {key: [1, 2, 3] for key in replay.PREDICTION_KEYS}
    paths = [
        write_predictions(
            tmp_path,
            prediction_record(
                {"target": "t", "draft": "d"}, {"name": "emma"}, 4096, GAMMA, 512, config, lists, "float32", "cpu"
            ),
        )
        for config in ({"selection_layers": []}, {"selection_layers": [2, 14]})
    ]
    assert [p.name.endswith("_b512.json") for p in paths] == [True, False] and paths[1].name.endswith("_select.json")
    traces = load_predictions([str(p) for p in paths], GAMMA)
    assert [t.selection for t in traces] == ["dustin", "verify"]
    assert at_budget(traces, 512) == traces[:1] and at_budget(traces, 512, "verify") == traces[1:]
    with pytest.raises(ValueError, match=r"selection 'verify' \(recorded: dustin 512\)"):
        at_budget(traces[:1], 512, "verify")
    both = _sources(predictions=traces, budget=512, exact_budgets=(512,))
    exact = both.method("dustin_exact_select", 96)
    assert (exact.config.mode, exact.config.selection, exact.config.sparse_draft) == ("exact", "verify", True)
    assert paths[1].name in exact.acceptance and paths[0].name not in exact.acceptance
    assert paths[0].name in both.method("dustin_exact", 96).acceptance
    select = both.method("dustin_select", 96)
    assert paths[1].name in select.acceptance and "Dustin's set's acceptance" not in select.acceptance
    alone = _sources(predictions=traces[:1], budget=512, exact_budgets=(512,))  # no trace with the selection layers
    assert "Dustin's set's acceptance" in alone.method("dustin_select", 96).acceptance
    with pytest.raises(ValueError, match="selection 'verify'"):
        alone.method("dustin_exact_select", 96)
    counted = _sources(predictions=None, counts={"dustin_sparse_draft": CountReplay((1,), "one")})
    assert (
        counted.method("dustin_select", 96).acceptance == "one (Dustin's set's acceptance: no trace recorded "
        "with the selection layers given)"
    )


def _knob_record(**changes) -> dict:
    """A knob trace as the walk's writer makes it (two rows; row 1 has no third step)."""
    from dustin_lab.traces import knob_trace_record

    config = {"min_recovery": 0.9, "budget": 512, "max_budget": 3200}
    seqlens, counts = [[4096, 4096], [4101, 4101], [4106]], [[600, 512], [3000, 4101], [300]]
    record = knob_trace_record(
        {"target": "t", "draft": "d"},
        {"name": "emma"},
        4096,
        4,
        config,
        seqlens,
        counts,
        [[1, 2], [0, 3], [4]],
        "float32",
        "cpu",
    )
    return record | changes


def test_load_budgets_scales_to_the_context_and_clamps(tmp_path):
    budgets = load_budgets([_write(tmp_path / "k.json", _knob_record())], 32768)
    # x8, within [512, 3200 x 8]: row 0's steps 4800, 24000, 2400; row 1's 4096 and a step read in full
    full = replay._FULL
    assert budgets.counts == (4800, 24000, 2400, 4096, full)
    assert (budgets.floor, budgets.ceiling, budgets.min_recovery) == (512, 25600, 0.9)
    assert budgets.read_in_full == 1 / 5 and budgets.mean == (4800 + 24000 + 2400 + 4096) / 4
    assert "scaled by 32768/4096" in budgets.source and "1 of 5 row-steps read in full" in budgets.source
    step = budgets.hooks()["budgets"]
    assert step([0, 0]) == [4800, 2400] and step([0, 0]) == [24000, 4096]
    clamped = load_budgets([_write(tmp_path / "c.json", _knob_record(max_budget=2048))], 32768)
    assert clamped.counts[1] == 2048 * 8  # 24000 over the ceiling


def test_load_budgets_wants_one_target(tmp_path):
    paths = [_write(tmp_path / "a.json", _knob_record()), _write(tmp_path / "b.json", _knob_record(min_recovery=0.8))]
    with pytest.raises(ValueError, match="one min_recovery"):
        load_budgets(paths, 32768)
    assert load_budgets(paths, 32768, min_recovery=0.8).min_recovery == 0.8
    with pytest.raises(ValueError, match="not a dustin_hf.knob_trace/1"):
        load_budgets([_write(tmp_path / "c.json", _knob_record(format="x"))], 32768)


def test_an_explicit_budget_holds_in_smoke_runs_too():
    """``--budget`` given is the budget, also when it is the default's value under ``--smoke`` (whose own default
    is smaller); left out, each mode takes its default."""
    parse = e2e._parser().parse_args
    assert e2e.sources(parse(["--smoke"])).budget == e2e.SMOKE_BUDGET
    assert e2e.sources(parse(["--smoke", "--budget", str(e2e.BUDGET)])).budget == e2e.BUDGET
    assert e2e.sources(parse([])).budget == e2e.BUDGET
    assert e2e.sources(parse(["--budget", "256"])).budget == 256


# ----------------------------------------------------------------------------- the methods
def _sources(**changes) -> e2e.Sources:
    fields = dict(
        predictions=[synthetic_predictions(budget=32)],
        counts={},
        knob=None,
        knob_target=None,
        budget=32,
        exact_budgets=(32,),
        synthetic=True,
    )
    return e2e.Sources(**(fields | changes))


def test_methods_have_the_settings_the_issues_name():
    sources = _sources()
    assert sources.method("spec_dense", 96).config is None
    lossless = sources.method("spec_sparse_draft", 96).config
    assert (lossless.mode, lossless.confirm_tokens, lossless.sparse_draft) == ("exact", 0, True)
    exact = sources.method("dustin_exact", 96).config
    defaults = e2e.DustinConfig()
    assert (exact.mode, exact.sparse_draft, exact.confirm_tokens, exact.confirm_every) == (
        "exact",
        True,
        defaults.confirm_tokens,
        defaults.confirm_every,
    )
    scheduled = _sources(confirm=(12, 8)).method("dustin_exact", 96).config  # e2e.py --confirm 12 8
    assert (scheduled.confirm_tokens, scheduled.confirm_every) == (12, 8)
    assert _sources(confirm=(12, 8)).method("spec_sparse_draft", 96).config.confirm_tokens == 0
    several = _sources(exact_budgets=(32, 64), predictions=[synthetic_predictions(budget=b) for b in (32, 64)])
    # e2e.py --exact-budget 32 64: one dustin_exact row each
    assert [(label, m.config.budget) for label, m in e2e._variants(several, "dustin_exact", 96)] == [
        ("dustin_exact@32", 32),
        ("dustin_exact@64", 64),
    ]
    assert [label for label, _ in e2e._variants(sources, "dustin_exact", 96)] == ["dustin_exact"]
    assert several.method("spec_sparse_draft", 96).config.budget == 32  # the lossless baseline's: the first
    knob = sources.method("dustin_knob", 96)
    assert knob.config.min_recovery is not None and knob.config.sparse_draft
    assert knob.config.max_budget == knob.replays[1].ceiling and "SYNTHETIC" in knob.acceptance
    assert set(knob.hooks().__dict__) >= {"accept", "budgets"} and knob.hooks().accept is not None


def test_every_method_has_a_place_in_the_run_order():
    # main() sorts the asked methods by RUN_ORDER: one missing there raised ValueError when asked for
    assert set(e2e.METHODS) <= set(e2e.RUN_ORDER)
    assert set(e2e.DEFAULT_METHODS) <= set(e2e.METHODS)
    select = _sources().method("dustin_select", 96).config
    assert (select.selection, select.sparse_draft) == ("verify", True)


def test_methods_say_what_they_need():
    with pytest.raises(ValueError, match="--predictions"):
        _sources(predictions=None).method("dustin_exact", 96)
    with pytest.raises(ValueError, match="--knob-traces"):
        _sources(synthetic=False).method("dustin_knob", 96)
    counts = CountReplay((1,), "one")
    assert _sources(predictions=None, counts={"dustin": counts}).method("dustin", 96).replays == (counts,)


# ----------------------------------------------------------------------------- the decode loop honours them
@pytest.fixture(scope="module")
def pair():
    import dustin_hf

    torch.manual_seed(0)
    target = e2e.build_model("tiny", [torch.device("cpu")], torch.float32)
    draft = e2e.build_model("tiny-draft", [torch.device("cpu")], torch.float32)
    handle = dustin_hf.patch(target)
    yield target, draft
    handle.unpatch()


class _Checked:
    """An ExactReplay whose every call is checked against the plain reference, with the loop's tentative counts."""

    def __init__(self, trace: Predictions, batch: int):
        self.inner = ExactReplay([trace], "draft_sparse", GAMMA, max_tentative=32)
        self.reference, self.held = _reference_exact(trace, "draft_sparse", GAMMA, batch)
        self.source, self.calls = self.inner.source, []

    def hooks(self) -> dict:
        confirm = self.inner.hooks()["confirm"]

        def checked(n_accepted, tentative, dense):
            t, d = tentative.tolist(), [bool(x) for x in dense.tolist()]
            assert all(n == 0 or n == self.held(b) for b, n in enumerate(t))  # the loop and the replay agree
            out = confirm(n_accepted, tentative, dense)
            assert out.tolist() == self.reference(t, d)
            self.calls.append((t, d))
            return out

        return {"confirm": checked}


def test_exact_mode_runs_on_the_replay_and_agrees_with_it(pair):
    target, draft = pair
    trace = synthetic_predictions(budget=32, seed=3)
    checked = _Checked(trace, batch=3)
    config = e2e.DustinConfig(budget=32, min_context=96, mode="exact", sparse_draft=True)
    row = e2e.run_speculative(
        target, draft, 3, 96, e2e.Method("dustin_exact", config, (checked,)), torch.float32, new_tokens=40
    )
    stats = row["exact"]
    assert stats["confirmations"] > 0 and stats["tentative_rejected"] > 0 and stats["sparse_row_steps"] > 0
    assert any(any(t) for t, _ in checked.calls) and any(not any(d) for _, d in checked.calls)


def test_knob_runs_on_the_replayed_budgets(pair):
    target, draft = pair
    budgets = BudgetReplay((37, 41, 53, 44, 59), 32, 64, 0.9, "test budgets")
    handed = []

    class Recorded:
        source = budgets.source

        def hooks(self):
            inner = budgets.hooks()["budgets"]

            def recorded(seqlens):
                handed.append(inner(seqlens))
                return handed[-1]

            return {"budgets": recorded}

    accept = AcceptReplay([synthetic_predictions(budget=32)], "draft_sparse", "sparse", GAMMA)
    config = e2e.DustinConfig(budget=32, min_context=96, sparse_draft=True, min_recovery=0.9, max_budget=64)
    row = e2e.run_speculative(
        target, draft, 2, 96, e2e.Method("dustin_knob", config, (accept, Recorded())), torch.float32, new_tokens=24
    )
    knob = row["knob"]
    assert handed and handed[0] == [37, 53]  # each row from its own offset of the five counts
    # what the rows read are the replayed counts, not the estimate's (which would pick no such sizes)
    assert {knob["budget_p50"], knob["budget_p95"], knob["budget_max"]} <= {37, 41, 53, 44, 59}
    assert knob["dense_fallbacks"] == 0
