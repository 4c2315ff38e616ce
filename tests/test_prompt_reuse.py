"""Stock's prompt-reuse recipe with the loop: a cache of the prompts' shared prefix, passed as ``past_key_values``.

transformers documents it for plain decoding: a forward over the prefix fills a ``DynamicCache``, each call takes a
``copy.deepcopy`` of it and ``generate()`` reads only the uncached tokens. The loop reads the given positions into
its own caches (the target's; the draft reads its whole prompt, as stock's assistant does) and prefills the rest of
each row, so a call with the cache gives the tokens of the same call without it, and the cache is left as it was.
"""

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
    fed = {"target": 0, "draft": 0}

    def counting(role):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and ids.shape[1] > 4:  # prompt forwards (decode steps feed at most γ + 1)
                fed[role] += ids.numel()

        return hook

    hooks = [
        m.register_forward_pre_hook(counting(r), with_kwargs=True) for r, m in (("target", target), ("draft", draft))
    ]
    try:
        with dustin_hf.patch(target):
            _generate(target, draft, ids, mask, cache=cache, max_new_tokens=2)
    finally:
        for hook in hooks:
            hook.remove()
    real_in_prefix = int(mask[:, :45].sum())
    assert fed["target"] == int(mask.sum()) - real_in_prefix
    assert fed["draft"] == int(mask.sum()) - 2  # every prompt token but each row's last


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
