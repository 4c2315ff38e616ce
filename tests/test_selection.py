"""Budget fill: sinks, recent window, draft top-m, target fill; no duplicates; dense rows."""

import pytest
import torch
from tiny_models import tiny_model

from dustin_hf.config import DustinConfig, resolve
from dustin_hf.selection.fill import select_positions


def _config(**kwargs):
    model = tiny_model("qwen2", layers=2)
    return resolve(DustinConfig(**kwargs), model.config, model.config)


def test_positions_come_from_each_source_in_order():
    cfg = _config(budget=16, sink_tokens=2, recent_tokens=3, draft_share=4, min_context=0)
    length = 100
    draft = torch.zeros(1, length)
    target = torch.zeros(1, length)
    draft_top = [50, 10, 70, 30]
    draft[0, draft_top] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    draft[0, 99] = 100.0  # inside the recent window: must not use a draft slot
    target[0, [10, 50]] = 50.0  # already chosen by the draft: must not be chosen twice
    target_top = [5, 15, 25, 35, 45, 55, 65]
    target[0, target_top] = torch.arange(7, 0, -1).float()
    sel = select_positions([length], draft, target, [True], cfg)
    chosen = sel.indices[0, : sel.counts[0]].tolist()
    assert sel.counts == [16]
    assert chosen == sorted(chosen) and len(set(chosen)) == 16
    expected = {0, 1, 97, 98, 99, *draft_top, *target_top}
    assert set(chosen) == expected


def test_rows_without_history_fill_by_draft_scores():
    cfg = _config(budget=8, sink_tokens=1, recent_tokens=1, draft_share=2, min_context=0)
    length = 40
    draft = torch.zeros(2, length)
    draft[:, [20, 21, 22, 23, 24, 25]] = torch.tensor([6.0, 5, 4, 3, 2, 1])
    target = torch.zeros(2, length)
    target[:, [5, 6, 7, 8]] = 9.0
    sel = select_positions([length, length], draft, target, [True, False], cfg)
    with_history = set(sel.indices[0].tolist())
    without = set(sel.indices[1].tolist())
    assert with_history == {0, 39, 20, 21, 5, 6, 7, 8}
    assert without == {0, 39, 20, 21, 22, 23, 24, 25}


def test_short_rows_are_dense_and_width_covers_them():
    cfg = _config(budget=8, sink_tokens=1, recent_tokens=1, draft_share=2, min_context=30)
    seqlens = [5, 20, 50]  # within budget -> dense; below min_context -> dense; long -> sparse
    scores = torch.rand(3, 50)
    sel = select_positions(seqlens, scores, scores, [True] * 3, cfg)
    assert sel.counts == [5, 20, 8]
    assert sel.indices.shape == (3, 20)  # the dense 20-position row needs more than the budget
    assert sel.indices[0, :5].tolist() == list(range(5))
    assert sel.indices[1, :20].tolist() == list(range(20))
    row = sel.indices[2, :8].tolist()
    assert row[0] == 0 and row[-1] == 49 and len(set(row)) == 8


def test_short_rows_beside_sparse_ones_read_in_full_by_their_count():
    """With ``full_rows`` (the decode loop's selections) a dense row beside sparse ones keeps the budget's width:
    its count is its length, and written out (as the kernels read it) it is all of ``0 .. L - 1``; the sparse row
    is the listing's."""
    from dustin_hf.kernels import full_rows_written

    cfg = _config(budget=8, sink_tokens=1, recent_tokens=1, draft_share=2, min_context=30)
    seqlens = [5, 20, 50]
    scores = torch.rand(3, 50)
    listed = select_positions(seqlens, scores, scores, [True] * 3, cfg)
    sel = select_positions(seqlens, scores, scores, [True] * 3, cfg, full_rows=True)
    assert sel.full_rows and not listed.full_rows
    assert sel.counts == [5, 20, 8] and sel.num_indices.tolist() == [5, 20, 8] and sel.indices.shape == (3, 8)
    indices, counts = full_rows_written(sel.indices, sel.num_indices, torch.tensor(seqlens), None, 1)
    assert counts.tolist() == [5, 20, 8]
    assert [indices[b, :c].tolist() for b, c in enumerate(counts.tolist())] == [
        listed.indices[b, :c].tolist() for b, c in enumerate(listed.counts)
    ]
    # every row dense: listed as before (no sparse row to keep the width of)
    alone = select_positions(seqlens[:2], scores[:2, :20], scores[:2, :20], [True] * 2, cfg, full_rows=True)
    assert not alone.full_rows and alone.indices[1].tolist() == list(range(20))


@pytest.mark.parametrize("seed", range(5))
def test_random_scores_give_valid_selections(seed):
    generator = torch.Generator().manual_seed(seed)
    cfg = _config(budget=32, sink_tokens=4, recent_tokens=8, draft_share=7, min_context=0)
    seqlens = torch.randint(33, 300, (6,), generator=generator).tolist()
    span = max(seqlens)
    draft = torch.rand(6, span, generator=generator)
    target = torch.rand(6, span, generator=generator)
    for b, n in enumerate(seqlens):  # scores are zero past each row's end, as scoring returns them
        draft[b, n:] = 0
        target[b, n:] = 0
    sel = select_positions(seqlens, draft, target, [True] * 6, cfg)
    for b, n in enumerate(seqlens):
        row = sel.indices[b, : sel.counts[b]]
        assert sel.counts[b] == 32
        assert len(set(row.tolist())) == 32 and bool((row >= 0).all()) and bool((row < n).all())
        assert set(range(4)) | set(range(n - 8, n)) <= set(row.tolist())
        free = [p for p in range(4, n - 8)]
        best_draft = sorted(free, key=lambda p: -draft[b, p].item())[:7]
        assert set(best_draft) <= set(row.tolist())
        rest = [p for p in free if p not in best_draft]
        best_target = sorted(rest, key=lambda p: -target[b, p].item())[: 32 - 4 - 8 - 7]
        assert set(best_target) <= set(row.tolist())


def test_truncated_keeps_each_rows_entries_below_its_limit():
    """After exact mode's confirmation a row's positions from its confirmed start are rewritten: its read set keeps
    the sorted prefix below that start (the sparse draft reads the rest as positions written since)."""
    from dustin_hf.selection.fill import Selection, truncated

    indices = torch.tensor([[0, 1, 5, 9, 12, 0], [0, 2, 3, 4, 0, 0]], dtype=torch.int32)
    selection = Selection(indices, torch.tensor([5, 4], dtype=torch.int32), [5, 4])
    seqlens = [13, 200]  # cuts far below the recent window: the counts come back from the device
    cut = truncated(selection, [9, 100], seqlens, recent=2)
    assert cut.counts == [3, 4] and cut.num_indices.tolist() == [3, 4]
    assert torch.equal(cut.indices, indices)  # the entries stay in place; only the counts shrink
    assert truncated(selection, [0, 3], seqlens, recent=2).counts == [0, 2]


@pytest.mark.parametrize("kind", ["fill", "window", "short_window", "knob", "fill_full_rows", "knob_full_rows"])
@pytest.mark.parametrize("seed", range(3))
def test_truncated_counts_on_the_host_are_the_devices(seed, kind, monkeypatch):
    """Cuts inside each row's recent window (exact mode's: a row's tentative positions are its last few) and rows
    read in full give the counts on the host, without reading the device, equal to counting the entries below the
    cut, for the paper's fill, a sliding window (one shorter than the recent window too) and the knob's sets; a cut
    below a recent window falls back to counting on the device."""
    from dustin_hf.selection.fill import truncated
    from dustin_hf.selection.knob import select_by_recovery

    generator = torch.Generator().manual_seed(seed)
    fields = dict(budget=32, sink_tokens=4, recent_tokens=8, draft_share=7, min_context=100)
    if kind.startswith("knob"):
        fields.update(draft_share=0, min_recovery=0.9, max_budget=96)
    cfg = _config(**fields)
    full_rows = kind.endswith("full_rows")  # row 0 named by its count, its index row unread
    seqlens = torch.randint(33, 300, (6,), generator=generator).tolist()
    seqlens[0], seqlens[3] = 60, 250  # row 0 below min_context (read in full), row 3 sparse
    draft, target = torch.rand(6, max(seqlens), generator=generator), torch.rand(6, max(seqlens), generator=generator)
    window = {"window": 120, "short_window": 6}.get(kind)
    if kind.startswith("knob"):
        sel = select_by_recovery(seqlens, draft, target, [True] * 6, cfg, full_rows=full_rows)
    else:
        sel = select_positions(seqlens, draft, target, [True] * 6, cfg, window=window, full_rows=full_rows)
    assert sel.full_rows == full_rows  # row 0 below min_context (fill), the knob's fallbacks past its ceiling
    for b in range(6) if full_rows else ():  # never read: a row read in full counts 0 .. limit - 1 after a cut
        if sel.counts[b] >= seqlens[b]:
            sel.indices[b] = -1
    limits = [n - int(torch.randint(0, min(8, c) + 1, (1,), generator=generator)) for n, c in zip(seqlens, sel.counts)]
    expected = [
        min(limits[b], n) if c >= n else int(((sel.indices[b, :c]) < limits[b]).sum())
        for b, (c, n) in enumerate(zip(sel.counts, seqlens))
    ]
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read the counts back from the device"))
    cut = truncated(sel, limits, seqlens, recent=8)
    monkeypatch.undo()
    assert cut.counts == expected and cut.num_indices.tolist() == expected
    # row 3 cut below its recent window (a short window: below the window, inside recent_tokens): counted on the
    # device, still right
    limits[3] = seqlens[3] - (7 if kind == "short_window" else 20)
    expected[3] = (
        limits[3] if sel.counts[3] >= seqlens[3] else int((sel.indices[3, : sel.counts[3]] < limits[3]).sum())
    )
    assert truncated(sel, limits, seqlens, recent=8).counts == expected


def test_the_registry_serves_min_recovery_with_the_knob_and_every_other_config_with_dustins_set():
    from dustin_hf.selection.dustin_set import DustinSet
    from dustin_hf.selection.knob import RecoveryKnob
    from dustin_hf.selection.selector import Selector

    def policy(**fields):
        config = _config(budget=32, sink_tokens=2, recent_tokens=2, **fields)
        return Selector(config, "reference", 2, 2, 0.25, 0.25, graphs=False).policy

    assert isinstance(policy(min_recovery=0.9), RecoveryKnob)
    assert isinstance(policy(), DustinSet) and isinstance(policy(selection="verify"), DustinSet)


@pytest.mark.parametrize("min_recovery", [None, 0.8])
def test_the_front_scores_with_the_history_it_is_handed(min_recovery):
    """``Selector.select(..., history=...)`` reads the history queries it is handed, for the rows whose history is
    their last cached position's query; row 1's is older (rolled back past it), so it fills by the draft's scores:
    the read sets equal the fill over the two signals computed directly."""
    from types import SimpleNamespace

    from dustin_hf.selection.history import History
    from dustin_hf.selection.knob import select_by_recovery
    from dustin_hf.selection.scoring import draft_lookahead_scores, target_history_scores
    from dustin_hf.selection.selector import Selector

    cfg = _config(budget=12, sink_tokens=1, recent_tokens=2, min_context=0, min_recovery=min_recovery)
    generator = torch.Generator().manual_seed(0)
    gamma, seqlens, capacity, dim = 3, [40, 33], 48, 16
    buffers = {layer: torch.randn(2, capacity, 2, dim, generator=generator) for layer in (0, 1)}
    cache = SimpleNamespace(capacity=capacity, layer_buffers=lambda layer: (buffers[layer], None))
    runner = SimpleNamespace(cache=cache)
    kept = {layer: [torch.randn(2, 2, dim, generator=generator) for _ in range(gamma)] for layer in cfg.draft_layers}
    history = History(2)
    history.keep(torch.randn(2, 2, dim, generator=generator), [seqlens[0] - 1, seqlens[1] - 5])
    base = torch.tensor(seqlens)
    selector = Selector(cfg, "reference", 2, 2, 0.25, 0.25, graphs=False)
    got = selector.select(runner, runner, seqlens, base, kept, gamma, history=history)

    queries = [torch.stack(kept[layer], dim=1) for layer in cfg.draft_layers]
    keys = [buffers[layer] for layer in cfg.draft_layers]
    s_draft = draft_lookahead_scores(queries, keys, base, cfg.draft_heads, 2, 0.25, max(seqlens))
    s_target = target_history_scores(
        history.queries, buffers[cfg.target_layer], base, cfg.target_heads, 2, 0.25, max(seqlens)
    )
    fill = select_positions if min_recovery is None else select_by_recovery
    expected = fill(seqlens, s_draft, s_target, [True, False], cfg, lengths=base, full_rows=True)
    assert got.counts == expected.counts
    for row, count in enumerate(got.counts):
        assert torch.equal(got.indices[row, :count], expected.indices[row, :count])
