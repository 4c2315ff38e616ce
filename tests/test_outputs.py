"""output_attentions / output_hidden_states: stock's tuples, with stock's values where the budget covers the
context."""

import pytest
import torch
from tiny_models import PAD, left_pad, noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_attentions_and_hidden_states_match_stock_greedy(family):
    """A left-padded batch: every returned tensor has stock's shape; at the slots a row really has (its tokens and
    what it generated) the values equal stock eager greedy decoding's (padding slots hold zeros here, stock's
    forward of the pad tokens there)."""
    target = tiny_model(family, layers=2)
    target.set_attn_implementation("eager")  # stock returns attentions with eager attention only
    draft = set_gamma(noisy_copy(target), 3)
    rows = [random_prompt(n, seed=n)[0] for n in (9, 5)]
    ids, mask = left_pad(rows)
    kwargs = dict(
        do_sample=False,
        max_new_tokens=6,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_attentions=True,
        output_hidden_states=True,
    )
    stock = target.generate(ids, attention_mask=mask, **kwargs)
    with dustin_hf.patch(target):
        out = target.generate(ids, attention_mask=mask, assistant_model=draft, cache_implementation="dustin", **kwargs)
    assert torch.equal(out.sequences, stock.sequences)
    real = mask.bool()
    for name in ("attentions", "hidden_states"):
        ours, theirs = getattr(out, name), getattr(stock, name)
        assert len(ours) == len(theirs) == 6
        for t, (step, stock_step) in enumerate(zip(ours, theirs)):
            assert [x.shape for x in step] == [x.shape for x in stock_step], (name, t)
            for x, y in zip(step, stock_step):
                if t == 0:  # the prompt: compare the real slots only
                    keep = (
                        real[:, :, None]
                        if name == "hidden_states"
                        else (real[:, None, :, None] & real[:, None, None, :])
                    )
                    x, y = x * keep, y * keep
                else:  # a generated token's query: over the input slots (padding is zero) and the tokens before it
                    keep = torch.cat([real, torch.ones(real.shape[0], t, dtype=torch.bool)], dim=1)
                    if name == "attentions":
                        y = y * keep[:, None, None, :]
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
