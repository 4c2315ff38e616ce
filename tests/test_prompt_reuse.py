"""Stock's prompt-reuse recipe with the loop: a cache of the prompts' shared prefix, passed as ``past_key_values``.

transformers documents it for plain decoding: a forward over the prefix fills a ``DynamicCache``, each call takes a
``copy.deepcopy`` of it and ``generate()`` reads only the uncached tokens. The loop reads the given positions into
its own caches (the target's; the draft reads its whole prompt, as stock's assistant does) and prefills the rest of
each row, so a call with the cache gives the tokens of the same call without it, and the cache is left as it was.
"""

import contextlib

import pytest
import torch
from tiny_models import left_pad, noisy_copy, random_prompt, set_gamma, tiny_model
from transformers import DynamicCache

import dustin_hf
from dustin_hf.compat import CACHE_KWARG

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2)
    return target, set_gamma(noisy_copy(target, noise=0.02), 3)


def _prefix_cache(model, ids: torch.Tensor, mask: torch.Tensor, slots: int) -> DynamicCache:
    """What the recipe builds: a forward over the first ``slots`` input slots, with stock's mask and positions."""
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :slots], attention_mask=mask[:, :slots], position_ids=positions[:, :slots],
              use_cache=True, **{CACHE_KWARG: cache})  # fmt: skip
    return cache


def _generate(target, draft, ids, mask, cache=None, **kwargs):
    extra = {} if cache is None else {CACHE_KWARG: cache}
    call = dict(assistant_model=draft, cache_implementation="dustin", max_new_tokens=NEW, do_sample=False)
    return target.generate(ids, attention_mask=mask, **{**call, **kwargs}, **extra)


@contextlib.contextmanager
def _prompt_tokens_fed(*models):
    """Counts the tokens of every forward wider than a decode step's (γ + 1 = 4 inputs; exact mode's confirming
    blocks 1 + confirm_tokens + γ = 8) per model while open: the prompt forwards, where each row's rest is longer."""
    fed = {id(m): 0 for m in models}

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 8:
            fed[id(module)] += ids.numel()

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in models]
    try:
        yield fed
    finally:
        for handle in hooks:
            handle.remove()


@pytest.mark.parametrize(
    "config",
    [
        {},  # the default budget covers the context: plain greedy
        {"budget": 16, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4},  # sparse steps from the first
        {"budget": 16, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4, "mode": "exact"},
        {"budget": 16, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4, "selection": "dustin",
         "sparse_draft": True},
    ],
    ids=["dense", "sparse", "exact", "dustin_sparse_draft"],
)  # fmt: skip
def test_a_deep_copied_prompt_cache_gives_the_tokens_of_the_call_without_it(pair, config):
    """Left-padded rows of different lengths; the cache holds the first 40 input slots (padding included, as
    stock's does), so each row reuses a different number of its own tokens. The caller's cache is only read."""
    target, draft = pair
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (70, 55, 48)])
    cache = _prefix_cache(target, ids, mask, 40)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with dustin_hf.patch(target, dustin_hf.DustinConfig(**config)):
        without = _generate(target, draft, ids, mask)
        reused = _generate(target, draft, ids, mask, cache=cache)
    assert torch.equal(reused, without)
    if not config or config.get("mode") == "exact":  # the target's own tokens
        assert torch.equal(reused, target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    assert cache.get_seq_length() == 40
    assert all(
        torch.equal(k, layer.keys) and torch.equal(v, layer.values) for (k, v), layer in zip(kept, cache.layers)
    )


def test_the_target_reads_only_the_uncached_tokens(pair):
    """The prompt forwards of the target cover each row's tokens past the cache (at least its last one), the draft
    its whole prompt."""
    target, draft = pair
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (60, 50)])
    cache = _prefix_cache(target, ids, mask, 45)
    with dustin_hf.patch(target), _prompt_tokens_fed(target, draft) as fed:
        _generate(target, draft, ids, mask, cache=cache, max_new_tokens=2)
    real_in_prefix = int(mask[:, :45].sum())
    assert fed[id(target)] == int(mask.sum()) - real_in_prefix
    assert fed[id(draft)] == int(mask.sum()) - 2  # every prompt token but each row's last


def test_a_cache_the_input_does_not_extend_is_refused(pair):
    """Stock's decoding feeds a cache as long as the input (or longer) again, silently wrong; the loop says why."""
    target, draft = pair
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (30, 24)])
    with dustin_hf.patch(target):
        for slots, message in ((30, "leaves at least its last token"), (20, None)):
            cache = _prefix_cache(target, ids, mask, slots)
            if message is None:
                _generate(target, draft, ids, mask, cache=cache, max_new_tokens=2)
                continue
            with pytest.raises(ValueError, match=message):
                _generate(target, draft, ids, mask, cache=cache, max_new_tokens=2)
        with pytest.raises(ValueError, match="rows"):
            _generate(target, draft, ids, mask, cache=_prefix_cache(target, ids[:1], mask[:1], 10), max_new_tokens=2)
        with pytest.raises(NotImplementedError, match="prompt cache"):
            _generate(target, draft, ids, mask, cache=_prefix_cache(target, ids, mask, 10), max_new_tokens=2,
                      output_hidden_states=True, return_dict_in_generate=True)  # fmt: skip


# ---- automatic prefix reuse: the caches a call leaves serve the next call's shared prefix ----------------------
SPARSE = {
    "budget": 16,
    "min_context": 0,
    "sink_tokens": 2,
    "recent_tokens": 4,
    "selection": "dustin",
}  # every layer sparse


@pytest.mark.parametrize("config", [{}, SPARSE, {**SPARSE, "mode": "exact"}], ids=["dense", "sparse", "exact"])
def test_a_follow_up_turn_reuses_the_prompt_and_gives_the_tokens_of_a_fresh_call(pair, config):
    """Turn 2's rows: the first turn's prompt + its answer + a question (reuses the prompt, not the answer, whose
    values the decode steps wrote); another prompt of the same length (reuses nothing); a part of the first turn's
    prompt + new tokens (reuses that part). Each row gives the tokens of the same call in a fresh process, and the
    target prefills only what it does not reuse."""
    target, draft = pair
    first = [random_prompt(n, seed=n)[0] for n in (50, 44, 38)]
    with dustin_hf.patch(target, dustin_hf.DustinConfig(**config)) as handle:
        ids, mask = left_pad(first)
        out = _generate(target, draft, ids, mask)
        answer = out[0, ids.shape[1] :]
        second = [
            torch.cat([first[0], answer, random_prompt(6, seed=7)[0]]),
            random_prompt(44, seed=99)[0],
            torch.cat([first[2][:30], random_prompt(9, seed=8)[0]]),
        ]
        ids2, mask2 = left_pad(second)
        with _prompt_tokens_fed(target) as fed:
            reused = _generate(target, draft, ids2, mask2)
        held = _prompt_values(handle, second)
        handle.release()  # a fresh process holds nothing
        fresh = _generate(target, draft, ids2, mask2)
        # what the prompts' positions hold is a dense forward's, the reused ones included (a decode step's values
        # for the first turn's answer would differ past the first layer)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(held, _prompt_values(handle, second)))
    assert torch.equal(reused, fresh)
    common_second = int((first[1] == second[1]).cumprod(0).sum())
    assert fed[id(target)] == sum(len(p) for p in second) - (len(first[0]) + common_second + 30)


def _prompt_values(handle, prompts) -> list[torch.Tensor]:
    """The keys each layer of the held target cache holds at each row's prompt positions."""
    cache = handle.workspaces.held.target.cache
    return [cache.layer_buffers(layer)[0][b, : len(p)].clone() for layer in range(len(cache.layers))
            for b, p in enumerate(prompts)]  # fmt: skip


def test_reuse_follows_the_held_caches_only(pair):
    """No reuse after release(), with reuse_prefix=False, or with another draft (the held caches are another
    pair's); the prompt is read whole then."""
    target, draft = pair
    prompts = [random_prompt(n, seed=n)[0] for n in (40, 36)]
    ids, mask = left_pad(prompts)
    total = sum(len(p) for p in prompts)
    other = set_gamma(noisy_copy(target, noise=0.05, seed=4), 3)
    with dustin_hf.patch(target) as handle:
        for reused, before, call in (
            (True, lambda: None, {}),  # the held caches' prompts: each row reads its last token only
            (False, handle.release, {}),
            (False, lambda: None, {"cache_config": {"reuse_prefix": False}}),
            (False, lambda: None, {"assistant_model": other}),
        ):
            _generate(target, draft, ids, mask, max_new_tokens=2)
            before()
            with _prompt_tokens_fed(target) as fed:
                _generate(target, draft, ids, mask, max_new_tokens=2, **call)
            assert fed[id(target)] == (0 if reused else total), call  # reused: every row reads its last token


def test_weights_changed_in_place_are_never_read_from_an_older_prompt(pair):
    """load_state_dict writes the weights in place (same addresses): the held caches' prompt values are the old
    weights', so the next call reads its whole prompt and answers as the new weights do."""
    target, draft = pair
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (40, 36)])
    other = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2, seed=5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    try:
        with dustin_hf.patch(target) as handle:
            _generate(target, draft, ids, mask)
            target.load_state_dict(other.state_dict())
            changed = _generate(target, draft, ids, mask)
            handle.release()
            fresh = _generate(target, draft, ids, mask)
        assert torch.equal(changed, fresh)
    finally:
        target.load_state_dict(before)


def test_the_recipe_in_batched_assisted_decoding_without_dustin(pair):
    """A batch with a draft and no cache_implementation runs the loop's dense verification: the recipe works there
    too, and equals plain greedy decoding."""
    target, draft = pair
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (52, 47)])
    with dustin_hf.patch(target):
        reused = _generate(target, draft, ids, mask, cache=_prefix_cache(target, ids, mask, 33),
                           cache_implementation=None)  # fmt: skip
    assert torch.equal(reused, target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))


def test_a_follow_up_longer_than_the_first_calls_need_still_reuses(pair):
    """A follow-up turn needs more slots than the first call did: the workspace the first call built holds room for
    it (a sixteenth more), so the turn reuses the prompt without a warm-up sized for the whole conversation."""
    target, draft = pair
    first = random_prompt(470, seed=3)
    with dustin_hf.patch(target) as handle:
        out = target.generate(
            first, assistant_model=draft, cache_implementation="dustin", max_new_tokens=12, do_sample=False
        )
        capacity = handle.workspaces.held.capacity
        second = torch.cat([out, random_prompt(20, seed=4)], dim=1)
        assert second.shape[1] + 12 + 8 > -(-(first.shape[1] + 12 + 8) // 256) * 256  # past the first's rounding
        with _prompt_tokens_fed(target) as fed:
            target.generate(
                second, assistant_model=draft, cache_implementation="dustin", max_new_tokens=12, do_sample=False
            )
        assert handle.workspaces.held.capacity == capacity  # the same workspace served the turn
    assert fed[id(target)] == second.shape[1] - first.shape[1]  # the answer and the question


# ---- what is never reused ---------------------------------------------------------------------------------------
def test_a_returned_cache_passes_back_only_what_dense_forwards_wrote():
    """In sparse mode a returned cache's generated positions hold the sparse verification's values: passed back
    with out.sequences, the next call re-reads them, and answers as the call that reads everything."""
    target = tiny_model("qwen2", layers=4, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target, noise=0.02), 3)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (50, 44)])
    sparse = {"budget": 16, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4}
    with dustin_hf.patch(target, dustin_hf.DustinConfig(**sparse)) as handle:
        out = _generate(target, draft, ids, mask, max_new_tokens=20, return_dict_in_generate=True)
        grown = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :])], dim=1)
        continued = _generate(target, draft, out.sequences, grown, cache=getattr(out, CACHE_KWARG))
        handle.release()
        fresh = _generate(target, draft, out.sequences, grown)
    assert torch.equal(continued, fresh)


def test_prompt_outputs_and_holes_are_never_served_from_an_earlier_prompt(pair):
    """Calls returning hidden states read their whole prompt (their prompt outputs come from that forward, and
    equal a fresh call's), and a prompt with a masked slot inside it (which a sliding window counts) is neither
    reused nor served from a prompt without one."""
    target, draft = pair
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (40, 36)])
    holed = mask.clone()
    holed[0, 20] = 0
    record, recorded = {"output_hidden_states": True, "return_dict_in_generate": True}, None
    with dustin_hf.patch(target) as handle:
        for first, second, call in ((mask, mask, record), (holed, mask, {}), (mask, holed, {})):
            _generate(target, draft, ids, first, max_new_tokens=2, **call)
            with _prompt_tokens_fed(target) as fed:
                out = _generate(target, draft, ids, second, max_new_tokens=2, **call)
            assert fed[id(target)] == int(second.sum()), call
            recorded = out if call else recorded
        handle.release()
        fresh = _generate(target, draft, ids, mask, max_new_tokens=2, **record)
    assert all(torch.equal(a, b) for a, b in zip(fresh.hidden_states[0], recorded.hidden_states[0]))


def test_a_model_made_under_inference_mode_runs_and_reuses_nothing():
    """Inference tensors keep no version counter: the workspace cannot see a write to them, so nothing is reused."""
    with torch.inference_mode():
        target = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2)
        draft = set_gamma(noisy_copy(target, noise=0.02), 3)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (40, 36)])
    with dustin_hf.patch(target):
        first = _generate(target, draft, ids, mask)
        with _prompt_tokens_fed(target) as fed:
            again = _generate(target, draft, ids, mask)
    assert torch.equal(first, again) and fed[id(target)] == int(mask.sum())


def test_a_prompt_cache_of_another_shape_is_refused(pair):
    target, draft = pair
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (30, 24)])
    smaller = tiny_model("qwen2", layers=1, hidden=32, heads=4, kv_heads=2)
    with dustin_hf.patch(target), pytest.raises(ValueError, match="the target's"):
        _generate(target, draft, ids, mask, cache=_prefix_cache(smaller, ids, mask, 10), max_new_tokens=2)
