"""What a patched model keeps between generate() calls, and the prompt's forwards.

A call leaves its caches, CUDA graphs and fused weights (:mod:`dustin_hf.decode.workspace`) for the next call of the
same shape: that call must give exactly what a fresh one gives, and a call of another shape, another model, or after
the weights moved must never read them. ``release()`` frees them. The prompt is read in as few forwards as memory
allows (:meth:`~dustin_hf.decode.runner.ModelRunner.prefill`): one per row, or neighbouring rows of one length
together, or a long row in chunks that attend to the chunks before; each way gives the same logits and cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _triton_runs
from tiny_models import left_pad, noisy_copy, random_prompt, set_gamma, tiny_model
from transformers import DynamicCache

import dustin_hf
from dustin_hf.adapter.assisted import attention_routed
from dustin_hf.compat import CACHE_KWARG
from dustin_hf.decode.cache import DustinCache
from dustin_hf.decode.runner import ModelRunner, _row_groups
from dustin_hf.runtime.fused import FusedWeights, fused_ops

pytestmark = pytest.mark.usefixtures("one_thread")

SPARSE = {"budget": 16, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4}
CALL = dict(
    cache_implementation="dustin",
    cache_config=SPARSE,
    max_new_tokens=14,
    do_sample=False,
    return_dict_in_generate=True,
)


def _pair(seed: int = 0):
    target = tiny_model("qwen2", layers=2, seed=seed)
    return target, set_gamma(noisy_copy(target), 3)


def _generate(target, draft, ids, **overrides):
    mask = torch.ones_like(ids)
    return target.generate(ids, attention_mask=mask, assistant_model=draft, **{**CALL, **overrides})


# ----------------------------------------------------------------------------- reuse between calls


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_second_call_reuses_the_workspace_and_equals_a_fresh_one(do_sample):
    """The second call of a shape takes the first one's workspace (same caches) and returns what a model patched
    afresh returns for it, token for token (sampling: at the same seed), even though it follows another call."""
    target, draft = _pair()
    first_ids, ids = random_prompt(48, batch=2, seed=1), random_prompt(48, batch=2, seed=2)
    with dustin_hf.patch(target) as handle:
        torch.manual_seed(5)
        _generate(target, draft, first_ids, do_sample=do_sample)
        held = handle.workspaces.held
        caches = held.target.cache, held.draft.cache
        torch.manual_seed(7)
        again = _generate(target, draft, ids, do_sample=do_sample)
        assert handle.workspaces.held is held and (held.target.cache, held.draft.cache) == caches
        assert getattr(again, CACHE_KWARG).stats["workspace"]["runs"] == 2
    with dustin_hf.patch(target) as fresh:
        torch.manual_seed(7)
        alone = _generate(target, draft, ids, do_sample=do_sample)
        assert getattr(alone, CACHE_KWARG).stats["workspace"]["runs"] == 1
    assert torch.equal(again.sequences, alone.sequences)
    assert fresh.workspaces.held is None  # unpatch() released it


def test_a_call_of_another_shape_or_model_builds_its_own():
    """Batch size, a longer prompt than the caches hold, the draft model, the Dustin settings and a moved weight each
    make the next call build a new workspace (the held one is released first, never used)."""
    target, draft = _pair()
    ids = random_prompt(48, batch=2, seed=1)
    with dustin_hf.patch(target) as handle:
        _generate(target, draft, ids)
        calls = {
            "batch": lambda: _generate(target, draft, ids[:1]),
            "capacity": lambda: _generate(target, draft, random_prompt(400, batch=2, seed=1)),  # more than it holds
            "draft": lambda: _generate(target, set_gamma(noisy_copy(target, seed=3), 3), ids),
            "config": lambda: _generate(target, draft, ids, cache_config={**SPARSE, "budget": 24}),
            "dense": lambda: _generate(target, draft, ids, cache_implementation=None, cache_config=None),
        }
        for name, call in calls.items():
            _generate(target, draft, ids)
            held = handle.workspaces.held
            assert held is not None and held.runs >= 1, name
            call()
            assert handle.workspaces.held is not held, name
        _generate(target, draft, random_prompt(700, batch=2, seed=1))
        held = handle.workspaces.held
        _generate(target, draft, ids)  # far fewer slots than it holds (past the slack): caches sized for this call
        assert handle.workspaces.held is not held and handle.workspaces.held.capacity < held.capacity
        held = handle.workspaces.held
        layer = target.model.layers[0].self_attn.q_proj
        layer.weight.data = layer.weight.data.clone()  # the same values at another address: graphs would read old
        _generate(target, draft, ids)
        assert handle.workspaces.held is not held


def test_a_call_within_the_slack_reuses_the_larger_workspace():
    """A shorter prompt (fewer slots needed, within the slack) runs in the held, larger caches."""
    target, draft = _pair()
    with dustin_hf.patch(target) as handle:
        _generate(target, draft, random_prompt(200, batch=2, seed=1))
        held = handle.workspaces.held
        _generate(target, draft, random_prompt(150, batch=2, seed=2))
        assert handle.workspaces.held is held and held.runs == 2


def test_release_frees_the_workspace():
    target, draft = _pair()
    ids = random_prompt(48, batch=2, seed=1)
    with dustin_hf.patch(target) as handle:
        _generate(target, draft, ids)
        assert handle.workspaces.held is not None
        handle.release()
        assert handle.workspaces.held is None
        _generate(target, draft, ids)
        assert handle.workspaces.held is not None
    assert handle.workspaces.held is None  # unpatch() released it


@pytest.mark.skipif(not _triton_runs(), reason="fused ops run in Triton (CUDA, or TRITON_INTERPRET=1)")
def test_fused_weights_outlive_the_context_until_released():
    """Given a :class:`FusedWeights`, the fused q/k/v and gate/up tensors stay in place after the context (the next
    context uses the same ones: graphs captured over them stay valid) until ``release()``, which gives every layer
    its own storage back with the same values; a replaced parameter is fused afresh."""
    model = tiny_model("qwen2", layers=2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    attn = model.model.layers[0].self_attn
    weights = FusedWeights()
    with fused_ops(model, weights=weights):
        pass
    shared = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == shared  # still one storage after the context
    generation = weights.generation
    with fused_ops(model, weights=weights):
        assert attn.q_proj.weight.untyped_storage().data_ptr() == shared and weights.generation == generation
    attn.k_proj.weight.data = attn.k_proj.weight.data.clone()
    with fused_ops(model, weights=weights):
        assert weights.generation > generation
        assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()
    weights.release()
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with fused_ops(model):  # no FusedWeights given: every layer gets its own storage back on exit
        pass
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()


def test_warmup_builds_the_workspace_a_real_call_reuses():
    """``warmup`` runs a few steps of a short random prompt sized for ``max_length``; the real call of that length
    (another prompt length, the same slots needed) takes its workspace."""
    target, draft = _pair()
    prompt_len, new = 120, 14
    with dustin_hf.patch(target) as handle:
        stats = handle.warmup(
            draft, batch_size=2, max_length=prompt_len + new, steps=4, cache_config=SPARSE, do_sample=False
        )
        assert 1 <= stats["steps"] <= 4
        held = handle.workspaces.held
        out = _generate(target, draft, random_prompt(prompt_len, batch=2, seed=3), max_new_tokens=new)
        assert handle.workspaces.held is held and held.runs == 2
    assert out.sequences.shape == (2, prompt_len + new)


@pytest.mark.parametrize("warm", [{"budget": 48, "mode": "exact"}, {"budget": 24, "selection": "dustin"}])
def test_warmup_settings_never_reach_later_calls(warm):
    """A warm-up with other settings than the handle's (``cache_config`` for that run only): the handle keeps its
    config, and later calls that pass none decode with it, as on a handle that was never warmed up."""
    target, draft = _pair()
    config = dustin_hf.DustinConfig(budget=16, min_context=0, sink_tokens=2, recent_tokens=4)
    ids = random_prompt(120, batch=2, seed=3)
    call = {k: v for k, v in CALL.items() if k != "cache_config"}
    with dustin_hf.patch(target, config):
        want = _generate(target, draft, ids, **call).sequences
    with dustin_hf.patch(target, config) as handle:
        handle.warmup(draft, batch_size=2, max_length=134, steps=4, cache_config=warm, do_sample=False)
        assert handle.config == config
        got = _generate(target, draft, ids, **call).sequences
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- the returned cache


def test_the_returned_cache_is_stocks():
    """With holes and left padding, the returned cache is a ``DynamicCache`` of stock's layout: as many positions
    as stock greedy's cache after the same call, and at every unmasked input slot and generated position stock's
    keys and values (a budget covering the context: the same forwards)."""
    target, draft = _pair()
    ids, mask = left_pad([random_prompt(30, seed=1)[0], random_prompt(24, seed=2)[0]])
    mask[0, 10] = 0  # a hole
    call = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    greedy = target.generate(ids, **call)
    with dustin_hf.patch(target):
        out = target.generate(
            ids,
            assistant_model=draft,
            cache_implementation="dustin",
            cache_config={"budget": 4096, "min_context": 0},
            **call,
        )
    assert torch.equal(out.sequences, greedy.sequences)
    mine, stock = getattr(out, CACHE_KWARG), getattr(greedy, CACHE_KWARG)
    assert isinstance(mine, DynamicCache) and mine.get_seq_length() == stock.get_seq_length()
    assert out.sequences.shape[1] - 1 == mine.get_seq_length()
    real = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1).bool()  # slots whose keys anyone reads
    for layer, (got, ref) in enumerate(zip(mine.layers, stock.layers)):
        assert got.keys.shape == ref.keys.shape, layer
        for b in range(2):
            torch.testing.assert_close(got.keys[b, :, real[b]], ref.keys[b, :, real[b]], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values[b, :, real[b]], ref.values[b, :, real[b]], atol=1e-5, rtol=1e-5)
            assert not got.keys[b, :, ~real[b]].any()  # masked slots: zeros, where stock has keys nobody reads
    assert mine.stats["steps"] > 0


def test_continuing_from_a_returned_cache_equals_reading_the_whole_sequence():
    """A returned cache holds the call's prompts and every token they generated but the last, in stock's layout:
    passed back with ``out.sequences`` (stock's way to continue), the next call reads only each row's last token and
    answers as the call that reads everything (within the budget the cache's values are the dense target's)."""
    target, draft = _pair()
    ids = random_prompt(20, batch=2, seed=1)
    call = dict(assistant_model=draft, max_new_tokens=4, do_sample=False)
    with dustin_hf.patch(target):
        out = target.generate(ids, **call, return_dict_in_generate=True)
        whole = target.generate(out.sequences, **call)
        continued = target.generate(out.sequences, **call, **{CACHE_KWARG: getattr(out, CACHE_KWARG)})
    assert torch.equal(continued, whole)


# ----------------------------------------------------------------------------- prefill


def _prefilled(model, rows: list[torch.Tensor], chunk: int | None):
    """``ModelRunner.prefill`` of ``rows`` into a fresh cache: (last logits per row, kept queries, the cache)."""
    cache = DustinCache(model.config.num_hidden_layers, len(rows), max(r.numel() for r in rows) + 8)
    runner = ModelRunner(model, cache, "reference")
    with dustin_hf.patch(model), attention_routed(model), torch.no_grad():
        logits, kept = runner.prefill(rows, chunk, {1: (0, 1)})
    return torch.stack(logits), kept, cache


def test_prefill_in_chunks_equals_one_forward_per_row():
    """A 230-token prompt in chunks of 80 (each chunk attends to the ones before it; chunks of more than 64 tokens
    take the prompt's attention path) gives the logits, the kept query and the cache contents of one forward; and
    both equal the unpatched model's own forward."""
    model = tiny_model("qwen2", layers=2)
    ids = random_prompt(230, seed=4)[0]
    whole, kept_whole, cache_whole = _prefilled(model, [ids], None)
    chunked, kept_chunked, cache_chunked = _prefilled(model, [ids], 80)
    reference = model(ids[None]).logits[0, -1]
    torch.testing.assert_close(whole[0], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[0], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept_chunked[0][1], kept_whole[0][1], atol=1e-5, rtol=1e-5)
    for a, b in zip(cache_whole.layers, cache_chunked.layers):
        torch.testing.assert_close(a.buffers()[0][:, :230], b.buffers()[0][:, :230], atol=1e-5, rtol=1e-5)
    assert cache_chunked.seq_lengths == [230]


def test_rows_of_one_length_share_a_forward_and_give_each_rows_own_result():
    """Neighbouring rows of one length go in one forward (while they fit the chunk); each row's logits and cache
    equal its own forward's, whatever its neighbours."""
    model = tiny_model("qwen2", layers=2)
    rows = [random_prompt(20, seed=s)[0] for s in (1, 2)] + [random_prompt(9, seed=3)[0], random_prompt(20, seed=4)[0]]
    assert _row_groups([20, 20, 9, 20], 64, one_each=False) == [(0, 2), (2, 3), (3, 4)]
    assert _row_groups([20, 20, 20], 40, one_each=False) == [(0, 2), (2, 3)]  # a group holds at most a chunk
    together, kept, cache = _prefilled(model, rows, 64)
    for b, ids in enumerate(rows):
        alone, kept_alone, cache_alone = _prefilled(model, [ids], 64)
        torch.testing.assert_close(together[b], alone[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kept[b][1], kept_alone[0][1], atol=1e-5, rtol=1e-5)
        n = ids.numel()
        torch.testing.assert_close(
            cache.layers[1].buffers()[1][b, :n], cache_alone.layers[1].buffers()[1][0, :n], atol=1e-5, rtol=1e-5
        )


def test_full_budget_equals_greedy_with_any_prefill_chunk():
    """The decode loop's output does not depend on how the prompt was read in (chunks of 7, one forward)."""
    target, draft = _pair()
    ids, mask = left_pad([random_prompt(40, seed=1)[0], random_prompt(33, seed=2)[0], random_prompt(40, seed=3)[0]])
    greedy = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    with dustin_hf.patch(target):
        for chunk in (7, None):
            out = target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                max_new_tokens=10,
                do_sample=False,
                cache_implementation="dustin",
                cache_config={"budget": 4096, "min_context": 0, "prefill_chunk": chunk},
            )
            assert torch.equal(out, greedy), chunk


def test_a_copied_or_moved_model_keeps_no_workspace():
    """``copy.deepcopy`` of a patched model starts with nothing held (the caches, graphs and draft stay the
    original's); ``model.to(...)`` frees what a run left, since no later call could use it."""
    import copy

    target, draft = _pair()
    with dustin_hf.patch(target) as handle:
        _generate(target, draft, random_prompt(48, batch=2, seed=1))
        assert handle.workspaces.held is not None
        twin = copy.deepcopy(target)
        assert twin._dustin_patch.workspaces.held is None
        target.to(torch.float64)
        assert handle.workspaces.held is None


def test_prompt_calibration_keeps_no_workspace():
    """``calibration="prompt"`` picks other scoring heads on every call, each pick with graphs of its own: such a
    run releases its workspace instead of keeping it (the held ones would grow without bound)."""
    target, draft = _pair()
    with dustin_hf.patch(target) as handle:
        _generate(target, draft, random_prompt(64, batch=2, seed=1), cache_config={**SPARSE, "calibration": "prompt"})
        assert handle.workspaces.held is None


@pytest.mark.skipif(not _triton_runs(), reason="fused ops run in Triton (CUDA, or TRITON_INTERPRET=1)")
def test_save_pretrained_takes_fused_weights_as_they_are(tmp_path):
    """Held fused weights (layers' parameters as views of one tensor) save and load like separate tensors."""
    model = tiny_model("qwen2", layers=2)
    weights = FusedWeights()
    with fused_ops(model, weights=weights):
        pass
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    weights.release()


def test_a_model_drafting_for_itself_gets_the_draft_runner_of_a_draft():
    """``assistant_model=model``: the draft's runner reads what a draft reads (no selection layers, no dense
    layers of the target's), although it holds the same model object as the target's."""
    target, _ = _pair()
    set_gamma(target, 3)
    config = {**SPARSE, "selection": "verify", "dense_layers": (0,), "sparse_draft": True}
    with dustin_hf.patch(target) as handle:
        _generate(target, target, random_prompt(48, batch=2, seed=1), cache_config=config)
        held = handle.workspaces.held
        assert held.target.select is not None and held.target.dense_layers == (0,)
        assert held.draft.select is None and held.draft.dense_layers == ()
