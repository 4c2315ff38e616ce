"""Scores are true attention probability masses on the chosen heads (checked against explicit math)."""

import torch
from conftest import explicit_attention_mass

from dustin_hf.selection.scoring import attention_mass, draft_lookahead_scores, target_history_scores


def test_attention_mass_matches_explicit_softmax():
    torch.manual_seed(0)
    batch, cap, kv, d, group = 3, 40, 2, 8, 3
    keys = torch.randn(batch, cap, kv, d)
    heads = (0, 2, 4, 5)
    q = torch.randn(batch, 2, len(heads), d)
    query_pos = torch.tensor([[10, 11], [25, 26], [30, 31]])
    got = attention_mass(q, keys, query_pos, heads, group, 0.3, 27, 32)
    want = explicit_attention_mass(q, keys, query_pos, heads, group, 0.3, 27)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_target_history_is_one_distribution_per_head():
    torch.manual_seed(1)
    keys = torch.randn(2, 64, 2, 16)
    history = torch.randn(2, 3, 16)
    seqlens = torch.tensor([20, 50])
    scores = target_history_scores(history, keys, seqlens, (0, 1, 2), 4, 0.25, 50)
    assert scores.shape == (2, 50)
    torch.testing.assert_close(scores.sum(1), torch.tensor([3.0, 3.0]))  # each of 3 heads sums to 1
    assert scores[0, 20:].abs().max() == 0  # nothing past the row's length


def test_draft_lookahead_counts_only_cached_positions():
    torch.manual_seed(2)
    gamma, seqlens = 3, torch.tensor([12, 30])
    keys = [torch.randn(2, 40, 1, 8), torch.randn(2, 40, 1, 8)]
    queries = [torch.randn(2, gamma, 2, 8), torch.randn(2, gamma, 1, 8)]
    scores = draft_lookahead_scores(queries, keys, seqlens, ((0, 1), (1,)), 2, 0.35, 30)
    want = sum(
        explicit_attention_mass(q, k, seqlens[:, None] + torch.arange(gamma), heads, 2, 0.35, 30)
        for q, k, heads in zip(queries, keys, ((0, 1), (1,)))
    )
    for b, n in enumerate(seqlens.tolist()):  # mass on the draft tokens themselves is not a cached position
        want[b, n:] = 0
    torch.testing.assert_close(scores.double(), want, rtol=1e-5, atol=1e-6)
    assert bool((scores.sum(1) < gamma * 3).all())


def test_select_heads_equals_index_select_without_an_index_tensor():
    """Heads evenly spaced are a view; any other set is stacked from views (no host->device copy, graph-safe)."""
    from dustin_hf.runtime.plan import select_heads

    x = torch.randn(2, 3, 8, 4)
    for heads in [(0,), (2, 3, 4), (1, 3, 5), (5, 1), (0, 2, 3), (7,), (6, 4, 2)]:
        for dim in (1, 2):
            if max(heads) >= x.shape[dim]:
                continue
            picked = select_heads(x, heads, dim)
            assert torch.equal(picked, x.index_select(dim, torch.tensor(heads))), (heads, dim)
            evenly = len(heads) == 1 or (
                heads[1] > heads[0] and heads == tuple(range(heads[0], heads[-1] + 1, heads[1] - heads[0]))
            )
            if evenly:
                assert picked.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), heads
