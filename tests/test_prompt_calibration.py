"""Quick calibration on the prompt (``DustinConfig(calibration="prompt")``), tiny random-weight models."""

import pytest
import torch
from tiny_models import left_pad, noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf
from dustin_hf.calibration import prompt as prompt_calibration

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", layers=3, hidden=32, heads=4, kv_heads=2)
    return target, set_gamma(noisy_copy(target), 4)


def _snapshot(runner):
    cache = runner.cache
    return list(cache.seq_lengths), [
        tuple(t.clone() for t in cache.layer_buffers(l)) for l in range(len(cache.layers))
    ]


def test_calibration_leaves_both_caches_as_prefilled_and_decoding_exact(pair, monkeypatch):
    """Every layer dense: whatever heads calibration picks, decoding must equal greedy, which only holds
    if the replayed steps put every slot and length back (checked bit for bit too)."""
    target, draft = pair
    rows = [random_prompt(n, seed=n)[0] for n in (300, 420)]
    ids, mask = left_pad(rows)
    real, checked = prompt_calibration.calibrate_on_prompts, []

    def checking(t_runner, d_runner, *args):
        before = [_snapshot(t_runner), _snapshot(d_runner)]
        out = real(t_runner, d_runner, *args)
        for (lengths, tensors), runner in zip(before, (t_runner, d_runner)):
            after_lengths, after = _snapshot(runner)
            assert after_lengths == lengths
            assert all(torch.equal(a, b) for x, y in zip(tensors, after) for a, b in zip(x, y))
        checked.append(out[1])
        return out

    monkeypatch.setattr(prompt_calibration, "calibrate_on_prompts", checking)  # what generate() hands the loop
    config = dustin_hf.DustinConfig(budget=32, min_context=128, dense_layers=(0, 1, 2), calibration="prompt")
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            max_new_tokens=16,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    report = out.past_key_values.stats["calibration"]
    assert checked and report["steps"] == 2 * prompt_calibration.STEPS and sorted(report["rows"]) == [0, 1]
    assert report["recovery"] >= report["default_recovery"]
    width = ids.shape[1]
    for b, row in enumerate(rows):
        alone = target.generate(row[None], max_new_tokens=16, do_sample=False)[0, row.numel() :]
        assert torch.equal(out.sequences[b, width:], alone)


def test_calibrated_heads_are_used_and_reported(pair, monkeypatch):
    """The steps score with the calibrated heads: the history each step hands the policy holds the calibrated
    scoring heads' queries, the first one (the prompt's, kept from prefill on every head) included."""
    from dustin_hf.selection.selector import Selector

    target, draft = pair
    ids = random_prompt(500, seed=3)
    config = dustin_hf.DustinConfig(budget=32, min_context=128, calibration="prompt")
    real, histories = Selector.select, []

    def recording(self, *args, history, **kwargs):
        histories.append((tuple(history.queries.shape), self.config.target_heads))
        return real(self, *args, history=history, **kwargs)

    monkeypatch.setattr(Selector, "select", recording)
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids,
            assistant_model=draft,
            max_new_tokens=12,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    report = stats["calibration"]
    assert stats["sparse_steps"] == stats["steps"] > 0
    assert 0 < report["default_recovery"] <= report["recovery"] <= 1
    assert 0 <= report["target_layer"] < 3 and report["target_heads"] and report["draft_layers"]
    assert report["draft_share"] <= 32 - 4 - 16
    assert histories and all(shape[1] == len(heads) for shape, heads in histories), histories
    assert len(report["target_heads"]) < target.config.num_attention_heads  # the check above can fail


def test_calibration_keeps_the_settings_it_does_not_search(pair):
    """Prompt calibration replaces the scoring heads and the draft share only: exact mode, its schedule, the
    sparse draft and the knob stay what the user asked for (greedy exact mode still equals greedy decoding)."""
    target, draft = pair
    ids = random_prompt(500, seed=3)
    config = dustin_hf.DustinConfig(
        budget=32,
        min_context=128,
        calibration="prompt",
        mode="exact",
        confirm_tokens=8,
        confirm_every=3,
        sparse_draft=True,
    )
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids,
            assistant_model=draft,
            max_new_tokens=16,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert "target_layer" in stats["calibration"] and stats["exact"]["confirmations"] > 0
    assert stats["draft_sparse_forwards"] > 0
    greedy = target.generate(ids, assistant_model=None, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, greedy)


def test_short_prompt_keeps_the_configured_heads(pair):
    target, draft = pair
    config = dustin_hf.DustinConfig(budget=32, min_context=4, calibration="prompt")
    with dustin_hf.patch(target, config):
        out = target.generate(
            random_prompt(8, seed=1),
            assistant_model=draft,
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    assert "skipped" in out.past_key_values.stats["calibration"]
