"""The invariant that guards everything: with a budget covering the context, Dustin is exact.

Dustin's output must equal plain greedy decoding and stock (batch-1) assisted decoding token for
token, on Llama-, Qwen2- and Qwen3-style models, for several prompt lengths and draft lengths.
"""

import pytest
import torch
from tiny_models import PAD, left_pad, noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf
from dustin_hf.compat import CACHE_KWARG
from dustin_hf.decode import sparse as sparse_mode
from dustin_hf.selection import dustin_set
from dustin_hf.selection.draft_reads import DraftReads
from dustin_hf.selection.fill import Selection

CASES = [(1, 1), (9, 3), (61, 6)]  # (prompt length, γ)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("prompt_len, gamma", CASES)
def test_full_budget_equals_greedy_and_stock_assisted(family, prompt_len, gamma):
    target = tiny_model(family, layers=3)
    draft = set_gamma(noisy_copy(target), gamma)
    ids = random_prompt(prompt_len, seed=prompt_len)
    greedy = target.generate(ids, max_new_tokens=24, do_sample=False)
    stock = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False)
    with dustin_hf.patch(target):
        out = target.generate(
            ids,
            assistant_model=draft,
            max_new_tokens=24,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    assert torch.equal(stock, greedy)
    assert torch.equal(out.sequences, greedy)
    stats = out.past_key_values.stats
    assert stats["steps"] > 0 and stats["accepted_tokens"] > 0  # the draft really was used


def test_the_defaults_past_their_budget_keep_exact_mode_exact(monkeypatch):
    """``dustin_hf.patch(model)`` as it comes (the selection layers, 2048 positions): a prompt past the budget and
    ``min_context`` verifies sparsely with the selection layers choosing, and exact mode at those defaults still
    returns plain greedy decoding's tokens."""
    from dustin_hf.selection import layers

    target = tiny_model("qwen2", layers=3, hidden=32, heads=4, kv_heads=2, seed=2)
    draft = set_gamma(noisy_copy(target), 4)
    ids = random_prompt(4000, seed=13)  # this model and prompt: reading 2048 of 4000 positions changes the answer
    greedy = target.generate(ids, max_new_tokens=16, do_sample=False)
    chose = []
    real = layers.choose_read_set
    monkeypatch.setattr(layers, "choose_read_set", lambda *a, **k: chose.append(1) or real(*a, **k))
    with dustin_hf.patch(target):
        sparse = target.generate(
            ids,
            assistant_model=draft,
            max_new_tokens=16,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
        assert sparse.past_key_values.stats["sparse_steps"] > 0 and chose  # the selection layers chose
        exact = target.generate(
            ids,
            assistant_model=draft,
            max_new_tokens=16,
            do_sample=False,
            cache_implementation="dustin",
            cache_config={"mode": "exact"},
        )
    assert not torch.equal(sparse.sequences, greedy)  # the sparse steps change the answer: exact mode has work
    assert torch.equal(exact, greedy)


def _select_everything(seqlens, draft_scores, target_scores, has_history, config, lengths=None, **options):
    """A "sparse" read set that happens to hold every cached position: sparse kernels, dense answer."""
    width = max(seqlens)
    indices = torch.arange(width, dtype=torch.int32).expand(len(seqlens), width).contiguous()
    return Selection(indices=indices, num_indices=torch.tensor(seqlens, dtype=torch.int32), counts=list(seqlens))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sparse_path_with_every_position_selected_is_exact(monkeypatch, family):
    target = tiny_model(family, layers=3)
    draft = set_gamma(noisy_copy(target), 3)
    ids = random_prompt(40, seed=3)
    greedy = target.generate(ids, max_new_tokens=20, do_sample=False)
    monkeypatch.setattr(sparse_mode, "dense_rows", lambda seqlens, cfg: [False] * len(seqlens))
    monkeypatch.setattr(dustin_set, "dense_rows", lambda seqlens, cfg: [False] * len(seqlens))
    monkeypatch.setattr(dustin_set, "select_positions", _select_everything)
    with dustin_hf.patch(target):
        out = target.generate(
            ids,
            assistant_model=draft,
            max_new_tokens=20,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, greedy)
    assert out.past_key_values.stats["dense_steps"] == 0


def test_long_prompt_small_budget_is_sparse_every_step():
    target = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target), 4)
    ids = random_prompt(3000, seed=7)
    budget = 64
    with dustin_hf.patch(target, dustin_hf.DustinConfig(budget=budget, min_context=1024, selection="dustin")):
        out = target.generate(
            ids,
            assistant_model=draft,
            max_new_tokens=30,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert out.sequences.shape[1] == 3030
    assert stats["dense_steps"] == 0 and stats["sparse_steps"] == stats["steps"] > 0
    assert stats["mean_attended"] == budget  # every row read exactly the budget, per layer


def test_mean_attended_counts_rows_read_in_full_and_the_sparse_figure_does_not():
    """A row below ``min_context`` beside a long one: on every sparse step it reads all it holds. ``mean_attended``
    averages it in (positions read per row on steps with a sparse row); ``mean_attended_sparse`` is what the sparse
    row read alone: the budget."""
    target = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target), 4)
    ids, mask = left_pad([random_prompt(1200, seed=7)[0], random_prompt(300, seed=8)[0]])
    budget = 64
    with dustin_hf.patch(target, dustin_hf.DustinConfig(budget=budget, min_context=1024, selection="dustin")):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            max_new_tokens=10,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
            pad_token_id=PAD,
        )
    stats = getattr(out, CACHE_KWARG).stats
    assert stats["sparse_steps"] == stats["steps"] > 0
    assert stats["mean_attended_sparse"] == budget
    assert stats["mean_attended"] > budget + 50  # the short row's whole context (300), averaged in


def test_dense_layers_read_everything_on_sparse_steps():
    """Every layer dense: sparse steps (selection made, small budget) still decode exactly like greedy;
    one dense layer of two: the per-layer read count is the mean of the budget and the context."""
    target = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target), 4)
    ids = random_prompt(600, seed=11)
    greedy = target.generate(ids, max_new_tokens=20, do_sample=False)
    outs = {}
    for dense in [(0, 1), (-1,), ()]:
        config = dustin_hf.DustinConfig(budget=32, min_context=256, dense_layers=dense, selection="dustin")
        with dustin_hf.patch(target, config):
            outs[dense] = target.generate(
                ids,
                assistant_model=draft,
                max_new_tokens=20,
                do_sample=False,
                cache_implementation="dustin",
                return_dict_in_generate=True,
            )
        assert outs[dense].past_key_values.stats["sparse_steps"] == outs[dense].past_key_values.stats["steps"] > 0
    assert torch.equal(outs[(0, 1)].sequences, greedy)
    assert not torch.equal(outs[()].sequences, greedy)  # the budget is small enough to change the answer
    stats = outs[(0, 1)].past_key_values.stats
    assert stats["mean_attended"] > 600  # the whole context, per layer
    half = outs[(-1,)].past_key_values.stats
    assert 32 < half["mean_attended"] < stats["mean_attended"]


def test_sparse_draft_changes_only_the_drafts():
    """``sparse_draft``: the draft reads the last selection plus what was written since. With every target
    layer dense the output is still exactly greedy (only the drafts, so the acceptance, may change)."""
    target = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target), 4)
    ids = random_prompt(600, seed=11)
    greedy = target.generate(ids, max_new_tokens=20, do_sample=False)
    stats = {}
    for sparse_draft in (False, True):
        config = dustin_hf.DustinConfig(budget=32, min_context=256, dense_layers=(0, 1), sparse_draft=sparse_draft)
        with dustin_hf.patch(target, config):
            out = target.generate(
                ids,
                assistant_model=draft,
                max_new_tokens=20,
                do_sample=False,
                cache_implementation="dustin",
                return_dict_in_generate=True,
            )
        assert torch.equal(out.sequences, greedy)
        stats[sparse_draft] = out.past_key_values.stats
    assert stats[False]["draft_sparse_forwards"] == 0
    # every step after the first sparse one drafts from a selection
    assert 0 < stats[True]["draft_sparse_forwards"] <= 4 * (stats[True]["sparse_steps"] - 1)
    assert stats[True]["accepted_tokens"] != stats[False]["accepted_tokens"]  # the drafts did change


def test_draft_reads_are_the_last_selection_and_the_positions_since():
    config = dustin_hf.config.resolve(
        dustin_hf.DustinConfig(budget=24, sink_tokens=2, recent_tokens=2),
        tiny_model("qwen2").config,
        tiny_model("qwen2", layers=2).config,
    )
    picked = torch.stack([torch.arange(0, 48, 2), torch.arange(24)]).to(torch.int32)  # (2, 24) sorted
    last = (Selection(picked, torch.tensor([24, 24], dtype=torch.int32), [24, 24]), [100, 30])
    reads = DraftReads.after(last, config, gamma=3, capacity=104)
    assert reads.indices.shape == (2, 24 + 6)
    assert reads.indices[0, 24:].tolist() == [100, 101, 102, 103, 103, 103]  # clamped inside the cache
    assert reads.indices[1, 24:].tolist() == list(range(30, 36))
    sel = reads.at([102, 30])  # row 0 committed 2 positions since, row 1 none yet
    assert sel.counts == [26, 24] and sel.num_indices.tolist() == [26, 24]
    assert reads.at([120, 29]).counts == [30, 24]  # at most 2γ new positions; never fewer than the selection
    # a row read in full on the last verification drafts from everything it holds; its batch-mate still reads its
    # own selection (each row's reads depend on that row alone)
    dense_row = (Selection(picked, torch.tensor([24, 20], dtype=torch.int32), [24, 20]), [100, 20])
    mixed = DraftReads.after(dense_row, config, 3, 104)
    assert mixed.indices.shape == (2, 30) and mixed.full_rows  # the dense row is read through its count
    assert mixed.indices[0, : 30 - 6].tolist() == picked[0].tolist()
    at = mixed.at([102, 23])
    assert at.counts == [26, 23] and at.full_rows  # the dense row reads all 23 positions it holds
    assert mixed.ahead(torch.tensor([2, 3])).tolist() == [26, 23]
    assert not reads.full_rows and not reads.at([102, 30]).full_rows
    # a sparse row whose selection is longer than the budget (a sliding window's row) widens the read set
    wide = torch.nn.functional.pad(picked, (0, 6))
    wide[0, 24:] = torch.arange(48, 54)
    longer = DraftReads.after(
        (Selection(wide, torch.tensor([30, 24], dtype=torch.int32), [30, 24]), [100, 30]), config, 3, 104
    )
    assert longer.indices.shape == (2, 30 + 6) and longer.indices[0, :30].tolist() == wide[0].tolist()
    assert longer.at([100, 30]).counts == [30, 24]
    every_row_dense = (Selection(picked, torch.tensor([20, 20], dtype=torch.int32), [20, 20]), [20, 20])
    assert DraftReads.after(every_row_dense, config, 3, 104) is None  # nothing sparse: the draft reads everything
    assert DraftReads.after(None, config, 3, 104) is None
