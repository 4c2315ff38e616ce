"""DustinCache: per-row writes, rollback over many random accept lengths, growth, the Cache contract."""

import pytest
import torch

from dustin_hf.decode.cache import DustinCache
from dustin_hf.runtime.plan import ForwardPlan
from dustin_hf.selection.history import History

HEADS, DIM = 2, 4


def _write(cache: DustinCache, layer: int, rows: slice, seqlens: list[int], keys: torch.Tensor):
    """One forward's worth of writes: keys (B', H, Q, D) at each row's next slots."""
    plan = ForwardPlan(rows=rows, cache_seqlens=seqlens, q_len=keys.shape[2])
    with cache.forward_plan(plan):
        out_k, out_v = cache.update(keys, -keys, layer)
    cache.advance(rows, [keys.shape[2]] * len(seqlens))
    return out_k, out_v


def test_random_accept_lengths_keep_cache_consistent():
    """Model the cache as per-row Python lists; every step writes γ+1 tokens then keeps a random prefix."""
    torch.manual_seed(0)
    batch, gamma, layers = 3, 4, 2
    cache = DustinCache(num_layers=layers, batch_size=batch, capacity=8)  # small: forces growth
    model = [[] for _ in range(batch)]  # the positions each row really holds, as key values
    counter = 0
    for step in range(60):
        seqlens = list(cache.seq_lengths)
        new = torch.arange(counter, counter + batch * (gamma + 1), dtype=torch.float32).reshape(batch, 1, gamma + 1, 1)
        counter += batch * (gamma + 1)
        keys = new.expand(batch, HEADS, gamma + 1, DIM).contiguous()
        plan = ForwardPlan(rows=slice(0, batch), cache_seqlens=seqlens, q_len=gamma + 1)
        with cache.forward_plan(plan):  # one forward writes every layer
            for layer in range(layers):
                cache.update(keys, -keys, layer)
        cache.advance(plan.rows, [gamma + 1] * batch)
        keep = torch.randint(1, gamma + 2, (batch,)).tolist()
        cache.rollback([n + k for n, k in zip(seqlens, keep)])
        for b, k in enumerate(keep):
            model[b].extend(new[b, 0, :k, 0].tolist())
        assert cache.seq_lengths == [len(m) for m in model]
        for layer in range(layers):
            k_buf, v_buf = cache.layer_buffers(layer)
            for b in range(batch):
                held = k_buf[b, : len(model[b]), :, :]
                assert held[:, 0, 0].tolist() == model[b], f"step {step} row {b} layer {layer}"
                assert bool((held == held[:, :1, :1]).all())  # every head and dim got the value
                assert bool((v_buf[b, : len(model[b])] == -held).all())
    assert cache.capacity >= max(len(m) for m in model)


def test_update_returns_views_in_transformers_layout_for_the_covered_rows():
    cache = DustinCache(num_layers=1, batch_size=4, capacity=16)
    keys = torch.randn(1, HEADS, 5, DIM)
    out_k, out_v = _write(cache, 0, slice(2, 3), [0], keys)
    assert out_k.shape == (1, HEADS, 16, DIM)  # (B', H, capacity, D)
    torch.testing.assert_close(out_k[:, :, :5], keys)
    assert cache.seq_lengths == [0, 0, 5, 0]
    assert out_k.data_ptr() == cache.layer_buffers(0)[0][2].data_ptr()  # a view, no copy


def test_plan_must_agree_with_cache_lengths():
    cache = DustinCache(num_layers=1, batch_size=2)
    plan = ForwardPlan(rows=slice(0, 2), cache_seqlens=[0, 3], q_len=1)
    with pytest.raises(RuntimeError, match="row 1 holds 3"):
        with cache.forward_plan(plan):
            pass
    with pytest.raises(RuntimeError, match="ForwardPlan must be active"):
        cache.update(torch.zeros(2, HEADS, 1, DIM), torch.zeros(2, HEADS, 1, DIM), 0)


def test_crop_follows_the_transformers_contract():
    cache = DustinCache(num_layers=1, batch_size=2, capacity=32)
    _write(cache, 0, slice(0, 2), [0, 0], torch.randn(2, HEADS, 10, DIM))
    cache.rollback([10, 6])
    cache.crop(-3)
    assert cache.seq_lengths == [7, 3]
    cache.crop(5)
    assert cache.seq_lengths == [5, 3]
    assert cache.get_seq_length() == 5
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback([6, 3])


def test_growth_keeps_contents():
    cache = DustinCache(num_layers=1, batch_size=1, capacity=4)
    keys = torch.randn(1, HEADS, 3, DIM)
    _write(cache, 0, slice(0, 1), [0], keys)
    more = torch.randn(1, HEADS, 300, DIM)
    _write(cache, 0, slice(0, 1), [3], more)
    k_buf = cache.layer_buffers(0)[0]
    assert cache.capacity >= 303
    torch.testing.assert_close(k_buf[0, :3], keys[0].transpose(0, 1))
    torch.testing.assert_close(k_buf[0, 3:303], more[0].transpose(0, 1))


def test_update_writes_at_the_plan_it_is_handed():
    """transformers 5.24+ attention layers pass their keyword arguments (the runner's ``dustin_plan``) to ``update``:
    the cache writes at that plan's slots with no plan made active, as it writes at the active one on 5.17."""
    cache = DustinCache(num_layers=1, batch_size=2, capacity=16)
    _write(cache, 0, slice(0, 2), [0, 0], torch.randn(2, HEADS, 4, DIM))
    cache.rollback([4, 2])
    plan = ForwardPlan(rows=slice(0, 2), cache_seqlens=[4, 2], q_len=1)
    new = torch.randn(2, HEADS, 1, DIM)
    cache.update(new, new, 0, kwargs={"dustin_plan": plan})
    keys, _ = cache.layer_buffers(0)
    assert torch.equal(keys[0, 4], new[0, :, 0]) and torch.equal(keys[1, 2], new[1, :, 0])


def test_a_row_has_a_history_only_for_its_last_cached_position():
    history = History(batch=2)
    history.keep(torch.zeros(2, 1, DIM), [9, 5])
    assert history.rows_at([10, 6]) == [True, True]
    assert history.rows_at([12, 6]) == [False, True]  # row 0 moved on without a new query
