"""Sliding windows count masked input slots as stock does.

Stock's cache keeps every input slot, masked or not, and a window counts cache indices
(``masking_utils.sliding_window_overlay``: key visible iff ``kv_idx > q_idx - window``); the decode loop's caches
hold the unmasked tokens only. So a masked slot inside a window takes a place there: the masked attention, the
read sets chosen inside a window and the windows of the prompt's own queries count stock's indices
(:func:`dustin_hf.decode.masks.stock_slots`). End to end, the conformance grid (``test_conformance_grid.py``) compares
tokens with stock's; here the pieces, and sparse steps inside windows.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf
from dustin_hf.config import DustinConfig, resolve
from dustin_hf.decode.masks import prompts_from_mask, stock_slots
from dustin_hf.kernels.masked import masked_attention
from dustin_hf.selection.fill import select_positions
from dustin_hf.selection.knob import select_by_recovery
from dustin_hf.selection.selector import Selector

pytestmark = pytest.mark.usefixtures("one_thread")


def _mask(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows])


def test_stock_slots_put_each_cache_position_where_stock_keeps_it():
    """Prompt tokens at the input slots they came from, new tokens after the padded width; left padding alone
    (every row one offset from its cache positions) needs no table."""
    mask = _mask("0011011", "1111100", "0111111")
    prompts = prompts_from_mask(random_prompt(7, batch=3), mask)
    table = stock_slots(prompts, width=7, capacity=10)
    assert table.tolist() == [
        [2, 3, 5, 6, 7, 8, 9, 10, 11, 12],
        [0, 1, 2, 3, 4, 7, 8, 9, 10, 11],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    ]
    left = prompts_from_mask(random_prompt(7, batch=2), _mask("0001111", "1111111"))
    assert stock_slots(left, width=7, capacity=10) is None


def _reference(q, k, v, seqlens, slots, window, scale, indices=None, counts=None):
    """One query at a time in float64: cached keys (all, or the selected ones) and the step's new tokens up to the
    query itself, those whose stock index is within ``window`` of the query's."""
    batch, n_q, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        length = int(seqlens[b])
        cached = list(range(length)) if indices is None else indices[b, : counts[b]].tolist()
        for j in range(n_q):
            me = length + j
            keys = [c for c in cached + list(range(length, me + 1)) if slots[b, me] - slots[b, c] < window]
            for h in range(heads):
                logits = k[b, keys, h // group].double() @ q[b, j, h].double() * scale
                out[b, j, h] = logits.softmax(0) @ v[b, keys, h // group].double()
    return out


@pytest.mark.parametrize("selected", [False, True])
def test_masked_attention_counts_the_window_in_stock_indices(selected):
    """Rows whose stock indices jump (holes, right padding): each query sees the keys within ``window`` stock
    indices, dense or a selection, values as the explicit reference; without ``key_slots`` the slots themselves."""
    gen = torch.Generator().manual_seed(0)
    batch, n_q, heads, kv_heads, dim, capacity, window = 2, 3, 4, 2, 8, 24, 6
    q = torch.randn(batch, n_q, heads, dim, generator=gen)
    k, v = (torch.randn(batch, capacity, kv_heads, dim, generator=gen) for _ in range(2))
    seqlens = torch.tensor([12, 9], dtype=torch.int32)
    slots = torch.arange(capacity).repeat(batch, 1)
    slots[0, 8:] += 3  # a hole of 3 slots before cache position 8
    slots[1, 9:] += 4  # right padding: 4 masked slots before the new tokens
    indices = counts = None
    if selected:
        indices = torch.tensor([[0, 2, 5, 7, 8, 10, 11], [1, 4, 6, 7, 8, 0, 0]], dtype=torch.int32)
        counts = torch.tensor([7, 5], dtype=torch.int32)
    out, _ = masked_attention(
        q, k, v, seqlens, softmax_scale=0.3, indices=indices, num_indices=counts, window=window, key_slots=slots
    )
    expected = _reference(q, k, v, seqlens, slots, window, 0.3, indices, counts)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    plain, _ = masked_attention(
        q, k, v, seqlens, softmax_scale=0.3, indices=indices, num_indices=counts, window=window
    )
    identity = torch.arange(capacity).repeat(batch, 1)
    torch.testing.assert_close(
        plain.double(), _reference(q, k, v, seqlens, identity, window, 0.3, indices, counts), atol=1e-5, rtol=1e-5
    )


def _config(**kwargs):
    model = tiny_model("qwen2", layers=2)
    return resolve(DustinConfig(**kwargs), model.config, model.config)


@pytest.mark.parametrize("knob", [False, True])
def test_read_sets_per_row_window(knob):
    """A window per row (what masked slots leave of it in cache positions) selects each row as that row alone with
    its own window: inside ``[L - w + 1, L)``, its whole window where the budget covers it."""
    cfg = _config(
        budget=8,
        sink_tokens=2,
        recent_tokens=2,
        min_context=0,
        **({"min_recovery": 0.9, "max_budget": 12} if knob else {}),
    )
    seqlens, windows = [60, 40, 30], [20, 7, 12]
    gen = torch.Generator().manual_seed(1)
    draft, target = torch.rand(3, 60, generator=gen), torch.rand(3, 60, generator=gen)
    for b, n in enumerate(seqlens):
        draft[b, n:] = target[b, n:] = 0
    select = select_by_recovery if knob else select_positions
    together = select(seqlens, draft, target, [True] * 3, cfg, window=windows)
    for b, (n, w) in enumerate(zip(seqlens, windows)):
        alone = select([n], draft[b : b + 1, :n], target[b : b + 1, :n], [True], cfg, window=w)
        picked = together.indices[b, : together.counts[b]].tolist()
        assert picked == alone.indices[0, : alone.counts[0]].tolist(), b
        assert all(n - w + 1 <= p < n for p in picked), (b, picked)
    assert together.indices[1, : together.counts[1]].tolist() == list(range(34, 40))  # the budget covers it


def test_selector_windows_count_stock_indices():
    """The read set's window per row: the step's first query (cache position ``L``) sees cache positions whose stock
    index is within the window of its own; a hole inside the window leaves fewer positions in it."""
    prompts = prompts_from_mask(random_prompt(10, batch=2), _mask("1111011111", "1111111111"))
    table = stock_slots(prompts, width=10, capacity=20)
    selector = Selector(
        _config(budget=8, sink_tokens=2, recent_tokens=2, min_context=0),
        "reference",
        1,
        1,
        1.0,
        1.0,
        graphs=False,
        window=6,
        window_slots=table,
    )
    # row 0: L = 9 (stock index 10) sees indices 5..9, the hole at input slot 4 aside: cache positions 4..8
    assert selector._row_windows([9, 10]) == [6, 6]
    assert selector._row_windows([6, 10]) == [5, 6]  # L = 6 (index 7) sees indices 2..6: positions 2, 3, 4, 5


@pytest.mark.parametrize("budget", [24, 8])
def test_sparse_steps_inside_windows_with_holes(budget):
    """Every layer windowed (Mistral, window 12), prompts of ~60 tokens with holes inside the windows: a budget
    covering the window (24) reads each window whole, so the tokens are stock greedy's, at batch 1 and per row of a
    batch; a smaller one (8) runs and reads inside the windows."""
    target = tiny_model("mistral", layers=2, sliding_window=12)
    draft = set_gamma(noisy_copy(target), 3)
    ids = random_prompt(60, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[0, [52, 55, 56]] = 0  # holes inside the first queries' windows
    mask[1, :5] = 0
    mask[1, 30:33] = 0
    config = {"budget": budget, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4}
    call = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    with dustin_hf.patch(target):
        batch = target.generate(
            input_ids=ids,
            attention_mask=mask,
            assistant_model=draft,
            cache_implementation="dustin",
            cache_config=dict(config),
            **call,
        )
        single = target.generate(
            input_ids=ids[:1],
            attention_mask=mask[:1],
            assistant_model=draft,
            cache_implementation="dustin",
            cache_config=dict(config),
            **call,
        )
    stats = getattr(batch, "cache", None) or batch.past_key_values
    assert stats.stats["sparse_steps"] > 0
    if budget < 12:
        return
    for b in range(2):
        start = int(mask[b].nonzero()[0])
        alone = target.generate(input_ids=ids[b : b + 1, start:], attention_mask=mask[b : b + 1, start:], **call)
        assert batch.sequences[b, 60:].tolist() == alone.sequences[0, 60 - start :].tolist(), b
    assert (
        single.sequences[0, 60:].tolist()
        == target.generate(input_ids=ids[:1], attention_mask=mask[:1], **call).sequences[0, 60:].tolist()
    )


@pytest.mark.parametrize("selection", ["dustin", "verify"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_same_shape_calls_on_one_handle_equal_fresh_handles(selection, do_sample):
    """Two calls of one shape on one patched model (the second reuses the first's workspace and selector), a
    windowed model with holes inside the windows and a budget below the window, the masks differing between the
    calls: each call returns what it returns on a freshly patched model, greedy and sampling. Nothing per call
    (the holes' window table, above all) carries over to the next call."""
    target = tiny_model("mistral", layers=2, sliding_window=12)
    draft = set_gamma(noisy_copy(target), 3)
    ids = random_prompt(60, batch=2, seed=3)
    first, second = torch.ones_like(ids), torch.ones_like(ids)
    first[0, [52, 55, 56]] = 0
    first[1, 30:33] = 0
    second[0, :4] = 0
    second[1, [50, 53, 57, 58]] = 0
    call = dict(
        assistant_model=draft,
        cache_implementation="dustin",
        max_new_tokens=12,
        do_sample=do_sample,
        cache_config={"budget": 8, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4, "selection": selection},
    )

    def run(mask):
        torch.manual_seed(7)
        return target.generate(input_ids=ids, attention_mask=mask, **call)

    fresh = []
    for mask in (first, second):
        with dustin_hf.patch(target):
            fresh.append(run(mask))
    with dustin_hf.patch(target) as handle:
        reused = [run(first)]
        held = handle.workspaces.held
        reused.append(run(second))
        assert handle.workspaces.held is held and held.runs == 2  # the second call took the first's workspace
    assert not torch.equal(fresh[0], fresh[1])
    for got, want in zip(reused, fresh):
        assert torch.equal(got, want)
