"""Bad inputs (issue #24): each one a clear error that names the argument and what is allowed, never a crash deep
inside or a silent fallback; and ids a smaller-vocabulary draft cannot embed are read as the loop reads them."""

import json
import re

import pytest
import torch
from fuzz import shared_tokenizer
from tiny_models import PAD, VOCAB, left_pad, noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.compat import CACHE_KWARG

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def pair():
    target = tiny_model("llama", layers=2, hidden=32)
    return target, set_gamma(noisy_copy(target), 3)


def _dustin(target, draft, prompt, **kwargs):
    return target.generate(
        prompt, assistant_model=draft, cache_implementation="dustin", max_new_tokens=4, do_sample=False, **kwargs
    )


def _names_all(message: str, *words: str) -> bool:
    """Every regex of ``words`` is found in ``message``."""
    return all(re.search(word, message) for word in words)


# ---------------------------------------------------------------------------------------- calibration="prompt"
def test_prompt_calibration_needs_positions_beyond_the_windows_in_the_config(pair):
    """sink_tokens + recent_tokens == budget leaves the search no position to choose (a ZeroDivisionError in the
    calibration search before): refused when the config is made or, at the latest, when generate() starts."""
    target, draft = pair
    with pytest.raises(ValueError) as refused:
        config = DustinConfig(calibration="prompt", budget=20, sink_tokens=4, recent_tokens=16, min_context=0)
        with dustin_hf.patch(target, config):
            _dustin(target, draft, random_prompt(200))
    assert _names_all(str(refused.value), "calibration", "sink_tokens", "recent_tokens", "budget"), refused.value


def test_prompt_calibration_needs_positions_beyond_the_windows_in_cache_config(pair):
    target, draft = pair
    cache_config = dict(calibration="prompt", budget=24, sink_tokens=8, recent_tokens=16, min_context=0)
    with dustin_hf.patch(target), pytest.raises(ValueError) as refused:
        _dustin(target, draft, random_prompt(200), cache_config=cache_config)
    assert _names_all(str(refused.value), "calibration", "sink_tokens", "recent_tokens", "budget"), refused.value


# ---------------------------------------------------------------------------------------- cache_config
@pytest.mark.parametrize("cache_config", [[1, 2], [("budget", 64)], "budget", 7], ids=["list", "pairs", "str", "int"])
def test_cache_config_must_be_a_mapping(pair, cache_config):
    """Before: 'int' object is not iterable (or a list of pairs silently taken as a dict)."""
    target, draft = pair
    with dustin_hf.patch(target), pytest.raises((TypeError, ValueError)) as refused:
        _dustin(target, draft, random_prompt(12), cache_config=cache_config)
    message = str(refused.value)
    assert _names_all(message, "cache_config", r"(?i)dict|mapping", "DustinConfig|budget"), message


# ---------------------------------------------------------------------------------------- smaller-vocabulary draft
def _small_vocab_pair(draft_vocab: int = 80):
    target = tiny_model("qwen2", layers=2, hidden=32)
    draft = noisy_copy(target, noise=0.01)
    draft.resize_token_embeddings(draft_vocab)
    return target, set_gamma(draft, 3)


def test_prompt_ids_a_smaller_draft_cannot_embed_are_clamped_like_generated_ones():
    """A draft whose embedding has fewer rows than the target's, with one shared tokenizer (the README's pattern):
    prompt ids past the draft's rows (an IndexError in the draft's embedding before) are fed to the draft as the
    loop already feeds such generated ids, clamped to its last row. The draft only proposes, so with a budget
    covering the context every row is still the target's own greedy output."""
    draft_vocab = 80
    target, draft = _small_vocab_pair(draft_vocab)
    rows = [random_prompt(n, seed=40 + n)[0] for n in (30, 9, 22)]
    rows[0][-1], rows[1][0], rows[2][5] = VOCAB - 2, draft_vocab, draft_vocab + 3  # the last token, the first, inside
    assert all(int(r.max()) >= draft_vocab for r in rows)
    ids, mask = left_pad(rows)
    tok = shared_tokenizer(draft_vocab)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    alone = [target.generate(r[None], **kwargs)[0, r.numel() :] for r in rows]
    with dustin_hf.patch(target, DustinConfig(budget=64, min_context=0)):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            cache_implementation="dustin",
            tokenizer=tok,
            assistant_tokenizer=tok,
            **kwargs,
        )
    for b, want in enumerate(alone):
        assert torch.equal(out[b, ids.shape[1] :], want), f"row {b}"


def test_prompt_ids_a_smaller_draft_cannot_embed_on_sparse_steps():
    """The same ids on sparse steps, with the sparse draft: no crash, well-formed rows."""
    target, draft = _small_vocab_pair(80)
    rows = [random_prompt(n, seed=60 + n)[0] for n in (120, 90)]
    ids, mask = left_pad(rows)
    tok = shared_tokenizer(80)
    config = DustinConfig(budget=24, sink_tokens=2, recent_tokens=6, min_context=0, sparse_draft=True)
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            cache_implementation="dustin",
            tokenizer=tok,
            assistant_tokenizer=tok,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=PAD,
            return_dict_in_generate=True,
        )
    assert out.sequences.shape == (2, ids.shape[1] + 8)
    assert getattr(out, CACHE_KWARG).stats["sparse_steps"] > 0


# ---------------------------------------------------------------------------------------- profile paths
@pytest.mark.parametrize("contents", [None, "budget = 256\n"], ids=["missing", "not_json"])
def test_a_bad_profile_path_says_a_profile_was_expected(pair, tmp_path, contents):
    """Before: a bare FileNotFoundError, or a JSONDecodeError, that did not say what the path was for."""
    target, _ = pair
    path = tmp_path / "settings.json"
    if contents is not None:
        path.write_text(contents)
    with pytest.raises((FileNotFoundError, ValueError)) as refused:
        dustin_hf.patch(target, str(path))
    message = str(refused.value)
    assert str(path) in message and re.search("(?i)profile", message.replace(str(path), "")), message
    assert not dustin_hf.is_patched(target)


def test_a_profile_with_unknown_fields_names_them(pair, tmp_path):
    target, _ = pair
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"config": {"budgett": 256}}))
    with pytest.raises(ValueError, match="budgett"):
        dustin_hf.patch(target, path)
    assert not dustin_hf.is_patched(target)


# ---------------------------------------------------------------------------------------- position_ids
@pytest.mark.parametrize("case", ["too_wide", "other_batch", "three_d", "float"])
def test_position_ids_that_are_not_one_integer_per_input_slot_are_refused(pair, case):
    """The loop honours position_ids as stock does (the conformance grid); what it cannot follow, one position id per
    input slot as an integer, is refused naming them (before: ignored without a word)."""
    target, draft = pair
    ids = random_prompt(12, batch=2)
    positions = {
        "too_wide": torch.arange(13)[None],
        "other_batch": torch.arange(12).repeat(3, 1),
        "three_d": torch.arange(12).repeat(3, 2, 1),
        "float": torch.arange(12.0)[None],
    }[case]
    with dustin_hf.patch(target), pytest.raises(ValueError, match="position_ids"):
        _dustin(target, draft, ids, position_ids=positions)


# ---------------------------------------------------------------------------------------- "dustin" without patch()
def test_dustin_on_a_model_that_was_never_patched_while_another_is(pair):
    """Before: stock assisted decoding on a plain cache, without a word (batch 1)."""
    target, draft = pair
    other = tiny_model("qwen2", layers=2, hidden=32, seed=3)
    with dustin_hf.patch(other):
        with pytest.raises(ValueError, match=r"dustin_hf\.patch\(model\)"):
            _dustin(target, draft, random_prompt(12))
        ids, mask = left_pad([random_prompt(12)[0], random_prompt(5, seed=1)[0]])
        with pytest.raises(ValueError, match=r"dustin_hf\.patch\(model\)"):
            _dustin(target, draft, ids, attention_mask=mask)


def test_dustin_on_a_model_whose_patch_was_undone_while_another_is_patched(pair):
    target, draft = pair
    other = tiny_model("qwen2", layers=2, hidden=32, seed=3)
    with dustin_hf.patch(other):
        dustin_hf.patch(target).unpatch()
        with pytest.raises(ValueError, match=r"dustin_hf\.patch\(model\)"):
            _dustin(target, draft, random_prompt(12))


def test_dustin_with_nothing_patched_is_refused_by_transformers(pair):
    """Importing dustin_hf changes nothing, so transformers' own validation answers (its message, which the README
    quotes): it names the argument and the implementations it knows. dustin_hf's message needs a registration,
    which only patch() makes."""
    target, draft = pair
    with pytest.raises(ValueError, match=r"Invalid `cache_implementation` \(dustin\)"):
        _dustin(target, draft, random_prompt(12))


# ---------------------------------------------------------------------------------------- decoding modes
def test_beam_search_is_refused_as_beam_search(pair):
    """Before: 'pass assistant_model=<draft model>', though one was passed (beam search is not assisted)."""
    target, draft = pair
    with dustin_hf.patch(target), pytest.raises(ValueError) as refused:
        _dustin(target, draft, random_prompt(12), num_beams=2)
    message = str(refused.value)
    assert _names_all(message, "beam search", "num_beams=2", "num_beams=1"), message
