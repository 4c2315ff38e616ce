"""The quality knob (``DustinConfig.min_recovery``): each row's read set is the smallest reaching a target recovery."""

import pytest
import torch
from tiny_models import PAD, left_pad, noisy_copy, one_thread, random_prompt, set_gamma, tiny_model  # noqa: F401

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.experimental import estimated_mass, resolve, select_by_recovery

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, far faster under load


def _config(**fields):
    return resolve(
        DustinConfig(**{"budget": 8, "sink_tokens": 2, "recent_tokens": 2, "min_context": 0, **fields}),
        tiny_model("qwen2").config,
        tiny_model("qwen2", layers=2).config,
    )


def _scores(lengths, sharpness, seed=0):
    """Scores per row; a higher ``sharpness`` concentrates a row's mass on fewer positions."""
    generator = torch.Generator().manual_seed(seed)
    span = max(lengths)
    draft, target = (torch.rand(len(lengths), span, generator=generator) for _ in range(2))
    for b, (n, s) in enumerate(zip(lengths, sharpness)):
        draft[b], target[b] = draft[b] ** s, target[b] ** s
        draft[b, n:] = target[b, n:] = 0
    return draft, target


def _smallest_reaching(mass_row, n, config) -> int:
    """The documented order, brute force: sinks and recent first, then by mass; the first count reaching the target."""
    forced = [p for p in range(n) if p < config.sink_tokens or p >= n - config.recent_tokens]
    rest = sorted((p for p in range(n) if p not in forced), key=lambda p: -float(mass_row[p]))
    total = float(mass_row[forced].sum())
    for extra, p in enumerate(rest):
        if total >= config.min_recovery:
            return len(forced) + extra
        total += float(mass_row[p])
    return len(forced) + len(rest) if total >= config.min_recovery else n


def test_each_row_reads_the_smallest_set_reaching_the_target():
    config = _config(min_recovery=0.7, max_budget=120)
    lengths = [300, 300, 200, 6]
    draft, target = _scores(lengths, sharpness=[40.0, 2.0, 12.0, 1.0])
    selection = select_by_recovery(lengths, draft, target, [True] * 4, config)
    mass = estimated_mass(draft, target, [True] * 4, torch.tensor(lengths))
    for b, n in enumerate(lengths):
        picked = selection.indices[b, : selection.counts[b]].long()
        assert picked.tolist() == sorted(set(picked.tolist())) and int(picked.max()) < n  # sorted, distinct, cached
        if n <= config.budget:  # a context within the floor is read in full
            assert selection.counts[b] == n
            continue
        smallest = max(_smallest_reaching(mass[b], n, config), config.budget)
        if smallest > config.max_budget:  # out of reach under the ceiling: the row reads everything
            assert selection.counts[b] == n and selection.fallback[b]
            continue
        assert selection.counts[b] == smallest <= config.max_budget
        assert float(mass[b, picked].sum()) >= config.min_recovery - 1e-6
        assert abs(selection.recovery[b] - float(mass[b, picked].sum())) < 1e-5
    assert len(set(selection.counts[:3])) == 3  # rows with different needs read different counts in one batch
    assert selection.fallback[1]  # the flattest row cannot reach 0.7 in 120 positions


@pytest.mark.parametrize("seed", range(6))
def test_the_ceiling_counts_the_forced_positions(seed):
    """Wide sink and recent windows, close to the ceiling: a row never reads more than ``max_budget`` positions, the
    sinks and the recent window counted, and reads the smallest set reaching its target (the forced positions alone
    where they reach it); one whose target the ceiling cannot reach reads everything it holds."""
    rng = torch.Generator().manual_seed(seed)
    sink, recent = int(torch.randint(4, 17, (1,), generator=rng)), int(torch.randint(20, 49, (1,), generator=rng))
    budget = sink + recent + int(torch.randint(0, 9, (1,), generator=rng))
    ceiling = budget + int(torch.randint(0, 25, (1,), generator=rng))
    config = _config(
        budget=budget,
        max_budget=ceiling,
        sink_tokens=sink,
        recent_tokens=recent,
        min_recovery=float(torch.empty(1).uniform_(0.2, 0.9, generator=rng)),
    )
    lengths = [400, 300, 250, ceiling + 3]
    draft, target = _scores(lengths, sharpness=[1.0, 8.0, 30.0, 4.0], seed=seed)
    selection = select_by_recovery(lengths, draft, target, [True] * 4, config)
    mass = estimated_mass(draft, target, [True] * 4, torch.tensor(lengths))
    for b, n in enumerate(lengths):
        picked = selection.indices[b, : selection.counts[b]].tolist()
        if selection.fallback[b]:
            assert selection.counts[b] == n
            continue
        assert config.budget <= selection.counts[b] <= ceiling, (b, selection.counts[b], ceiling)
        assert set(range(sink)) | set(range(n - recent, n)) <= set(picked)
        assert selection.counts[b] == max(_smallest_reaching(mass[b], n, config), config.budget)
    # the forced positions fill the ceiling: the target out of their reach is read in full, one within it is read
    # as the forced positions alone
    for min_recovery, fallback, count in ((0.99, True, 300), (0.01, False, 48)):
        full = _config(budget=48, max_budget=48, sink_tokens=8, recent_tokens=40, min_recovery=min_recovery)
        filled = select_by_recovery([300], draft[:1, :300], target[:1, :300], [True], full)
        assert filled.fallback[0] == fallback and filled.counts[0] == count


def test_full_rows_name_fallbacks_by_their_count_and_list_the_rest():
    """``full_rows`` (the decode loop's): a fallback row beside sparse ones keeps the ceiling's width and is read in
    full through its count; written out, every row's reads equal the listed selection's. A replayed count past the
    ceiling on a row not read in full widens the tensor instead (its entries must be listed)."""
    from dustin_hf.kernels import full_rows_written

    config = _config(min_recovery=0.7, max_budget=120)
    lengths = [300, 300, 200, 6]
    draft, target = _scores(lengths, sharpness=[40.0, 2.0, 12.0, 1.0])
    listed = select_by_recovery(lengths, draft, target, [True] * 4, config)
    named = select_by_recovery(lengths, draft, target, [True] * 4, config, full_rows=True)
    assert listed.fallback[1] and listed.counts[1] == 300 and listed.indices.shape[1] == 300
    assert named.full_rows and named.indices.shape[1] == config.max_budget and named.counts == listed.counts
    indices, counts = full_rows_written(named.indices, named.num_indices, torch.tensor(lengths), None, 1)
    assert [indices[b, :c].tolist() for b, c in enumerate(counts.tolist())] == [
        listed.indices[b, :c].tolist() for b, c in enumerate(listed.counts)
    ]
    replayed = select_by_recovery(lengths, draft, target, [True] * 4, config, counts=[150, 300, 40, 6], full_rows=True)
    assert replayed.counts == [124, 300, 40, 6]  # the sinks and recent ones, then the ceiling's top entries
    assert replayed.indices.shape[1] == 124 and replayed.full_rows  # row 0 is listed past the ceiling
    assert int(replayed.indices[0, :124].max()) < 300 and len(set(replayed.indices[0, :124].tolist())) == 124


def test_the_floor_holds_when_a_few_positions_reach_the_target():
    config = _config(min_recovery=0.3, max_budget=64, budget=32)
    draft, target = _scores([200], sharpness=[80.0])
    selection = select_by_recovery([200], draft, target, [True], config)
    assert selection.counts == [32]


def test_a_target_of_one_reproduces_dense_verification():
    target = tiny_model("qwen2", layers=2, hidden=32)
    draft = set_gamma(noisy_copy(target, noise=0.02), 4)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (700, 300, 520)])
    greedy = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    fields = {"budget": 16, "min_context": 64, "sink_tokens": 2, "recent_tokens": 4}
    with dustin_hf.patch(target):
        outs = {}
        for goal in (1.0, 0.5):
            out = target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                do_sample=False,
                max_new_tokens=20,
                pad_token_id=PAD,
                cache_implementation="dustin",
                return_dict_in_generate=True,
                cache_config={**fields, "min_recovery": goal, "max_budget": 4096},
            )
            outs[goal] = out
    assert torch.equal(outs[1.0].sequences, greedy)
    knob = outs[0.5].past_key_values.stats["knob"]
    assert outs[0.5].past_key_values.stats["sparse_steps"] > 0
    assert 16 <= knob["budget_p50"] <= knob["budget_p95"] <= knob["budget_max"] < 700  # varied, below the contexts
    assert knob["estimated_recovery"] >= 0.5 and knob["row_steps"] > 0
    assert (
        outs[1.0].past_key_values.stats["knob"]["dense_fallbacks"]
        == outs[1.0].past_key_values.stats["knob"]["row_steps"]
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_recovery": 0.0}, "min_recovery must be a share in"),
        ({"min_recovery": 1.5}, "min_recovery must be a share in"),
        ({"min_recovery": "high"}, "min_recovery must be a share in"),
        ({"min_recovery": 0.9, "max_budget": 100}, "max_budget must be an int >= budget"),
        ({"max_budget": 2048}, "set min_recovery too"),
    ],
)
def test_invalid_knob_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DustinConfig(budget=512, **fields)


def test_budget_summary_and_correlation():
    from dustin_lab.knob import budget_summary, correlation

    summary = budget_summary([512, 600, 4096, 700], [4096, 4096, 4096, 5000])
    assert summary["steps"] == 4 and summary["read_in_full"] == 1 and summary["max"] == 4096
    assert summary["mean"] == 1477.0 and summary["p50"] == 650.0
    assert correlation([1, 2, 3, 4], [10, 20, 30, 41])["spearman"] == 1.0
    tied = correlation([1, 1, 2, 3], [2, 2, 3, 9])  # ties share their mean rank: the ranks are equal
    assert tied["spearman"] == pytest.approx(1.0) and 0.9 < tied["pearson"] < 1
    assert correlation([1, 2], [2, 1])["pearson"] is None and correlation([1, 1, 1], [1, 2, 3])["pearson"] is None


@pytest.mark.parametrize("selection", ["dustin", "verify"])
def test_a_window_longer_than_the_ceiling_with_the_sparse_draft(selection):
    """Every layer windowed (Mistral, window 40) and a target out of the ceiling's reach: each row reads its whole
    window (listed, longer than the ceiling), so the sparse draft's read sets widen to hold it, and the output is
    stock greedy's; with the selection layers too (a row reading its whole window keeps it)."""
    target = tiny_model("mistral", layers=2, sliding_window=40)
    draft = set_gamma(noisy_copy(target), 3)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (130, 95)])
    greedy = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD)
    config = DustinConfig(
        budget=8,
        max_budget=16,
        min_recovery=1.0,
        min_context=0,
        sink_tokens=2,
        recent_tokens=4,
        sparse_draft=True,
        selection=selection,
    )
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=PAD,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert torch.equal(out.sequences, greedy)
    assert stats["sparse_steps"] > 0 and stats["draft_sparse_forwards"] > 0 and stats["knob"]["budget_max"] > 16
