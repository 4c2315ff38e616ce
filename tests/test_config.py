"""DustinConfig validation, profile loading and model-dependent resolution."""

import json

import pytest
from tiny_models import tiny_model

from dustin_hf import DustinConfig
from dustin_hf.config import resolve


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=0), "budget"),
        (dict(budget=-3), "non-negative"),
        (dict(budget=16, sink_tokens=10, recent_tokens=10), "exceeds budget"),
        (dict(budget=64, draft_share=100), "draft_share"),
        (dict(target_heads=()), "must not be empty"),
        (dict(target_heads=(0, 0)), "distinct"),
        (dict(draft_layers=3), "sequence of ints"),
        (dict(draft_layers=(0, 1), draft_heads=((0,), (1,), (2,))), "same length"),
        (dict(backend="cuda-magic"), "backend must be one of"),
        (dict(target_layer=-1), "target_layer"),
        (dict(dense_layers=(0, 0)), "dense_layers"),
        (dict(dense_layers=1), "dense_layers"),
        (dict(calibration="auto"), "calibration must be one of"),
        (dict(sparse_draft=1), "sparse_draft must be True or False"),
        (dict(calibration="prompt", target_layer=1), "leave them None"),
    ],
)
def test_invalid_values_raise_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DustinConfig(**kwargs)


def test_config_is_frozen_and_replace_validates():
    config = DustinConfig()
    with pytest.raises(Exception):
        config.budget = 3
    assert config.replace(budget=1024).budget == 1024
    with pytest.raises(ValueError, match="unknown DustinConfig field"):
        config.replace(bugdet=3)


def test_defaults_resolve_for_any_model():
    target, draft = (
        tiny_model("qwen2", layers=4, heads=4, kv_heads=2),
        tiny_model("llama", layers=8, heads=4, kv_heads=1),
    )
    resolved = resolve(DustinConfig(), target.config, draft.config)
    assert resolved.target_layer == 2
    assert resolved.target_heads == (0, 1)  # the first KV group of the target
    assert resolved.draft_layers == (2, 4, 6)
    assert resolved.draft_heads == ((0, 1, 2, 3),) * 3
    assert resolved.draft_share == (2048 - 4 - 16) // 2
    assert resolved.budget == 2048 and resolved.selection_layers == (2,)  # "verify": an early layer (2 of 4 layers)


def test_resolution_checks_ranges():
    target, draft = tiny_model("qwen2", layers=4), tiny_model("qwen2", layers=2)
    with pytest.raises(ValueError, match="target_layer 9 out of range"):
        resolve(DustinConfig(target_layer=9), target.config, draft.config)
    with pytest.raises(ValueError, match="out of range: the model has 4 attention heads"):
        resolve(DustinConfig(target_heads=(7,)), target.config, draft.config)
    with pytest.raises(ValueError, match="dense_layers .* the target has 4 layers"):
        resolve(DustinConfig(dense_layers=(4,)), target.config, draft.config)
    with pytest.raises(ValueError, match="dense_layers"):
        resolve(DustinConfig(dense_layers=(3, -1)), target.config, draft.config)  # the same layer twice
    assert resolve(DustinConfig(dense_layers=(-1, 0)), target.config, draft.config).dense_layers == (0, 3)


def test_the_defaults_are_the_selection_layers_at_2048_in_both_modes():
    """What the 32k measurements chose (config.DEFAULT_BUDGET): budget=None is 2048 in either mode, through
    replace() (the path of per-call cache_config overrides) too; a budget the user gave stays; equal settings are
    equal configs and hash alike."""
    assert DustinConfig().budget == DustinConfig(mode="exact").budget == DustinConfig(budget=None).budget == 2048
    assert DustinConfig().selection == "verify"
    assert DustinConfig(budget=512).replace(mode="exact").budget == 512
    assert DustinConfig().replace(mode="exact", budget=256).budget == 256
    assert DustinConfig() == DustinConfig(budget=2048) and len({DustinConfig(), DustinConfig(budget=2048)}) == 1


def test_profile_round_trip(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "config": {
                    "budget": 256,
                    "target_layer": 1,
                    "target_heads": [0, 2],
                    "draft_layers": [0, 1],
                    "draft_heads": [[0], [1, 2]],
                }
            }
        )
    )
    config = DustinConfig.from_profile(profile, min_context=100)
    assert config.budget == 256 and config.min_context == 100
    assert config.target_heads == (0, 2) and config.draft_heads == ((0,), (1, 2))
