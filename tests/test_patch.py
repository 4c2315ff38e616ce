"""patch()/unpatch(): everything it changes comes back; errors for bad models and bad calls."""

import re
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from tiny_models import random_prompt, set_gamma, tiny_model
from transformers import AttentionInterface, GenerationConfig
from transformers.generation import configuration_utils

import dustin_hf
from dustin_hf import DustinConfig, compat
from dustin_hf.compat import check_transformers


def _snapshot(model):
    return {
        "class": type(model),
        "dict_keys": set(model.__dict__),
        "attn": model.config._attn_implementation,
        "cache_impls": configuration_utils.ALL_CACHE_IMPLEMENTATIONS,
        "attention_registry": dict(AttentionInterface._global_mapping),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _assert_same(before, after):
    assert after["class"] is before["class"]
    assert after["dict_keys"] == before["dict_keys"]
    assert after["attn"] == before["attn"]
    assert after["cache_impls"] is before["cache_impls"]
    assert after["attention_registry"] == before["attention_registry"]
    for name, tensor in before["state"].items():
        assert torch.equal(tensor, after["state"][name])


def test_unpatch_restores_model_and_transformers(qwen_pair):
    target, draft = qwen_pair
    before = _snapshot(target)
    handle = dustin_hf.patch(target)
    assert dustin_hf.is_patched(target) and type(target).__name__ == before["class"].__name__
    assert isinstance(target, before["class"])
    assert "dustin" in configuration_utils.ALL_CACHE_IMPLEMENTATIONS and "dustin" in AttentionInterface._global_mapping
    target.generate(random_prompt(12), assistant_model=draft, cache_implementation="dustin", max_new_tokens=5)
    assert target.config._attn_implementation == before["attn"]  # routed only during the call
    handle.unpatch()
    handle.unpatch()  # twice is harmless
    _assert_same(before, _snapshot(target))
    with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
        GenerationConfig(cache_implementation="dustin").validate()


def test_context_manager_and_double_patch(qwen_pair):
    target, _ = qwen_pair
    before = _snapshot(target)
    with dustin_hf.patch(target) as handle:
        again = dustin_hf.patch(target, DustinConfig(budget=64))
        assert again is handle and handle.config.budget == 64
        assert type(target).__mro__.count(before["class"]) == 1  # not wrapped twice
        GenerationConfig(cache_implementation="dustin").validate()
    _assert_same(before, _snapshot(target))


def test_two_models_share_the_registrations(qwen_pair):
    target, draft = qwen_pair
    first, second = dustin_hf.patch(target), dustin_hf.patch(draft)
    first.unpatch()
    assert "dustin" in configuration_utils.ALL_CACHE_IMPLEMENTATIONS  # still needed by the second model
    second.unpatch()
    assert "dustin" not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS
    assert "dustin" not in AttentionInterface._global_mapping


def test_patched_model_without_dustin_is_unchanged(qwen_pair):
    target, draft = qwen_pair
    ids = random_prompt(20)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assisted = target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False)
    with dustin_hf.patch(target):
        assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False), plain)
        assert torch.equal(target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False), assisted)


def test_dustin_needs_an_assistant(qwen_pair):
    target, _ = qwen_pair
    with dustin_hf.patch(target):
        with pytest.raises(ValueError, match="needs assisted generation"):
            target.generate(random_prompt(8), cache_implementation="dustin", max_new_tokens=3)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)),
            "not supported",
        ),
        (
            lambda: transformers.T5ForConditionalGeneration(
                transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2)
            ),
            "encoder-decoder",
        ),
    ],
)
def test_unsupported_models_are_refused_at_patch(build, message):
    with pytest.raises(ValueError, match=message):
        dustin_hf.patch(build())


class _Vocab:
    """The one tokenizer method the pair check reads."""

    def __init__(self, size):
        self.size = size

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.size)}


def test_mismatched_draft_is_refused_at_generate():
    target = tiny_model("qwen2", vocab=96)
    bigger = set_gamma(tiny_model("qwen2", vocab=128), 2)
    padded = set_gamma(tiny_model("qwen2", vocab=80), 2)
    kwargs = dict(cache_implementation="dustin", max_new_tokens=3)
    with dustin_hf.patch(target):
        with pytest.raises(ValueError, match="larger than the target's"):
            target.generate(
                random_prompt(8),
                assistant_model=bigger,
                tokenizer=_Vocab(96),
                assistant_tokenizer=_Vocab(128),
                **kwargs,
            )
        with pytest.raises(ValueError, match="tokenizers differ"):
            target.generate(
                random_prompt(8),
                assistant_model=padded,
                tokenizer=_Vocab(96),
                assistant_tokenizer=_Vocab(80),
                **kwargs,
            )
        same = _Vocab(96)  # one tokenizer, two embedding sizes (as Qwen2.5-7B vs 0.5B): accepted
        out = target.generate(
            random_prompt(8), assistant_model=padded, tokenizer=same, assistant_tokenizer=same, **kwargs
        )
        assert out.shape == (1, 11)
        with pytest.raises(ValueError, match="outside the target's vocabulary"):
            target.generate(
                torch.tensor([[3, 96, 5]]), assistant_model=padded, tokenizer=same, assistant_tokenizer=same, **kwargs
            )


def test_unsupported_generate_options_are_refused(qwen_pair):
    target, draft = qwen_pair
    with dustin_hf.patch(target):
        with pytest.raises(ValueError, match="unknown DustinConfig field"):
            target.generate(
                random_prompt(8),
                assistant_model=draft,
                cache_implementation="dustin",
                max_new_tokens=3,
                cache_config={"budgett": 3},
            )


def test_declared_range_is_the_verified_one():
    """pyproject's lower bound (the oldest version .ci/run tests) is the oldest supported and verified one."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    lowest = re.search(r'"transformers>=([0-9.]+),<([0-9]+)"', pyproject)
    assert Version(lowest.group(1)) == compat._MIN_VERSION == Version(compat.VERIFIED_RANGE[0])
    assert int(lowest.group(2)) == compat._MAX_MAJOR


def test_transformers_version_guard():
    check_transformers("5.17.0")
    with pytest.warns(UserWarning, match="newer"):
        check_transformers("5.99.0")
    for bad in ("4.57.0", "5.16.2", "6.0.0"):
        with pytest.raises(RuntimeError, match="supports transformers >= 5.17.0"):
            check_transformers(bad)


def test_what_a_user_may_want_to_see_goes_to_the_dustin_hf_logger_at_info(caplog, capsys):
    """A call that never verified sparsely says so (once per process, and in ``stats["dense_rows"]``, by reason);
    building a decode workspace and reusing the held one are logged too. All at INFO on the ``dustin_hf`` logger:
    nothing reaches stderr unless a user asks for it."""
    import logging

    from dustin_hf.decode import sparse as sparse_mode

    target = tiny_model("qwen2", layers=2)
    draft = set_gamma(tiny_model("qwen2", layers=2, seed=1), 3)
    short = random_prompt(40, batch=2)
    call = dict(
        attention_mask=torch.ones_like(short),
        assistant_model=draft,
        cache_implementation="dustin",
        max_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
    )

    def stats(out):
        return (getattr(out, "cache", None) or out.past_key_values).stats

    sparse_mode._LOGGED.clear()
    with dustin_hf.patch(target):
        target.generate(short, **call)  # the default levels: nothing shown
        assert capsys.readouterr().err == ""
    sparse_mode._LOGGED.clear()
    with dustin_hf.patch(target), caplog.at_level(logging.INFO, logger="dustin_hf"):
        dense = target.generate(short, **call)  # 40 positions, within the budget (2048)
        target.generate(short, **call)
        below = target.generate(short, **call, cache_config={"budget": 24})  # past the budget, below min_context
        sparse = target.generate(short, **call, cache_config={"budget": 24, "min_context": 24})
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("dustin_hf")]
    said = [m for m in messages if "every step of this call verified densely" in m]
    assert len(said) == 2  # once per setting, not once per call
    assert "budget=2048 and min_context=2048" in said[0] and "budget=24 and min_context=2048" in said[1]
    assert sum("reusing the held decode workspace" in m for m in messages) == 1
    assert sum("building a decode workspace" in m and "another shape" in m for m in messages) == 2
    assert stats(dense)["sparse_steps"] == 0 and stats(dense)["dense_rows"] == {
        "within_budget": 2,
        "below_min_context": 0,
    }
    assert stats(below)["sparse_steps"] == 0 and stats(below)["dense_rows"] == {
        "within_budget": 0,
        "below_min_context": 2,
    }
    assert stats(sparse)["sparse_steps"] > 0 and stats(sparse)["dense_rows"] == {
        "within_budget": 0,
        "below_min_context": 0,
    }
    with dustin_hf.patch(target):  # the budget reached by the last tokens only: no verification read sparsely
        edge = target.generate(short, **{**call, "max_new_tokens": 8}, cache_config={"budget": 46, "min_context": 0})
    assert stats(edge)["sparse_steps"] == 0 and stats(edge)["dense_rows"] == {
        "within_budget": 2,
        "below_min_context": 0,
    }
