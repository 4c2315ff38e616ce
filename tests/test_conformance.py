"""Drop-in conformance: every call stock assisted decoding accepts gives stock's tokens and outputs (issue #25).

The reference is always stock transformers on the unpatched model: greedy ``generate()`` without the assistant
(the same call, or each row alone) and stock assisted decoding (batch 1). The subject is the patched model with
``cache_implementation="dustin"`` (a budget covering the context unless a test says otherwise) and, for batches,
the dense batched path (patched model, assistant, no ``"dustin"``: dustin_hf's loop runs it for batches > 1).

1. transformers' own assisted-decoding tests (``tests/generation/test_utils.py``), on tiny Llama, Qwen2, Qwen3
   and Mistral configs with the testers' inputs (``tril`` masks) and checks (``_check_generate_outputs``);
2. logits processors and stopping criteria per row in ragged left-padded batches;
3. attention masks as stock reads them (left, right, holes);
4. sliding-window attention (Mistral, Qwen2's per-layer windows);
5. the draft's stock assistant settings (defaults, schedules, an explicit ``num_assistant_tokens``).

Reference code shared by these tests (the testers' models and inputs, the output checks) is in ``stock.py``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from stock import (
    ASSISTED_CALL,
    FAMILIES,
    TESTER_SEQ_LENGTH,
    TESTER_VOCAB,
    TokenCollector,
    alone,
    assert_outputs_match_greedy,
    char_tokenizer,
    check_cache_for_generate,
    check_generate_outputs,
    output_shapes,
    processor_kwargs,
    set_tester_assistant,
    tiny_tester_inputs,
    tiny_tester_model,
)
from tiny_models import PAD, left_pad, noisy_copy, random_prompt, set_gamma, tiny_model
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
from transformers.generation.candidate_generator import AssistedCandidateGenerator

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.compat import CACHE_KWARG
from dustin_hf.config import resolve
from dustin_hf.selection.fill import select_positions

pytestmark = pytest.mark.usefixtures("one_thread")

FULL = {"budget": 4096, "min_context": 0}  # covers every context here: every read is dense
SMALL = {"budget": 16, "min_context": 0, "sink_tokens": 2, "recent_tokens": 4, "selection": "dustin"}
MODES = ["dense", "dustin"]


def _patched_generate(model, draft, mode: str, cache_config: dict | None = None, **kwargs):
    """The subject: the patched model's ``generate`` with the assistant, in ``mode``; unpatched afterwards."""
    extra = {}
    if mode == "dustin":
        extra = {"cache_implementation": "dustin", "cache_config": dict(cache_config or FULL)}
    with dustin_hf.patch(model):
        return model.generate(assistant_model=draft, **extra, **kwargs)


def _assert_same_sequences(out, reference) -> None:
    """Same prompt columns and, row by row, the same generated tokens (the failure names the row)."""
    width = reference.sequences.shape[1] - len(reference.scores if reference.scores else reference.logits)
    assert torch.equal(out.sequences[:, :width], reference.sequences[:, :width])
    for b, (got, ref) in enumerate(zip(out.sequences[:, width:].tolist(), reference.sequences[:, width:].tolist())):
        assert got == ref, f"row {b}: generated {got}, stock greedy {ref}"


def _tester_pair(family: str, assistant_type: str):
    model = tiny_tester_model(family)
    assistant = model if assistant_type == "same" else tiny_tester_model(family, seed=1)
    return model, set_tester_assistant(assistant)


# ---- 1. transformers' assisted-decoding test patterns ----------------------------------------------------------


@pytest.mark.parametrize("assistant_type", ["random", "same"])
@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_decoding_matches_greedy_search(family, assistant_type):
    """``test_assisted_decoding_matches_greedy_search``: batch 1, mask ``[1, 0, 0, 0, 0, 0, 0]``, the testers'
    processors, all four ``output_*`` flags. Sequences equal stock greedy's token for token; every returned
    tuple has the structure ``_check_generate_outputs`` requires and the shapes stock assisted decoding returns."""
    model, assistant = _tester_pair(family, assistant_type)
    inputs = tiny_tester_inputs(batch_size=1)
    call = {**ASSISTED_CALL, **inputs, **processor_kwargs()}
    greedy = model.generate(**call)
    stock = model.generate(assistant_model=assistant, **call)
    assert torch.equal(stock.sequences, greedy.sequences)  # the reference agrees with itself
    out = _patched_generate(model, assistant, "dustin", **call)
    _assert_same_sequences(out, greedy)
    check_generate_outputs(out, model.config, prompt_length=TESTER_SEQ_LENGTH)
    assert output_shapes(out) == output_shapes(stock)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_reference_checks_accept_stock_outputs(family):
    """The checks above are stock's: stock greedy and stock assisted decoding (batch 1, the testers' call) pass
    them, and a stock assisted run that kept no draft (a random assistant) matches greedy's values."""
    model, assistant = _tester_pair(family, "random")
    call = {**ASSISTED_CALL, **tiny_tester_inputs(batch_size=1), **processor_kwargs()}
    greedy = model.generate(**call)
    assisted = model.generate(assistant_model=assistant, **call)
    for output in (greedy, assisted):
        check_generate_outputs(output, model.config, prompt_length=TESTER_SEQ_LENGTH)
        check_cache_for_generate(output, model.config)
    assert output_shapes(assisted) == output_shapes(greedy)
    assert_outputs_match_greedy(assisted, greedy, call["attention_mask"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tril_mask_continues_after_the_masked_tokens(family):
    """The testers' batch-1 mask ``[1, 0, 0, 0, 0, 0, 0]`` without the attention / hidden-state flags: stock
    greedy feeds all seven tokens and continues after them (the last, masked, token's query produces the first
    new token); the new tokens' positions continue from the last prompt position id. Tokens and logits equal
    stock greedy's."""
    model, assistant = _tester_pair(family, "same")
    call = dict(ASSISTED_CALL, output_attentions=False, output_hidden_states=False)
    call.update(tiny_tester_inputs(batch_size=1), **processor_kwargs())
    greedy = model.generate(**call)
    out = _patched_generate(model, assistant, "dustin", **call)
    _assert_same_sequences(out, greedy)
    for got, ref in zip(out.logits, greedy.logits):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_returned_values_match_greedy(family):
    """With an all-ones mask (the mask question aside): the scores, logits, hidden states and attentions
    themselves, not only their shapes, equal stock greedy's (``stock.assert_outputs_match_greedy`` says which
    entries and where stock's own assisted path differs)."""
    model, assistant = _tester_pair(family, "same")
    inputs = tiny_tester_inputs(batch_size=1)
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    call = {**ASSISTED_CALL, **inputs, **processor_kwargs()}
    greedy = model.generate(**call)
    out = _patched_generate(model, assistant, "dustin", **call)
    _assert_same_sequences(out, greedy)
    check_generate_outputs(out, model.config, prompt_length=TESTER_SEQ_LENGTH)
    assert_outputs_match_greedy(out, greedy, inputs["attention_mask"])


@pytest.mark.parametrize("batch", [1, 2])
def test_outputs_under_a_chunked_prefill_equal_one_shot_prefill(batch):
    """The prompt read in chunks smaller than it (``prefill_chunk``): the returned scores, logits, hidden states and
    attentions equal those of the prompt read in one forward, entry by entry (the prompt's entry 0 covering every
    position of every chunk), and stock greedy's."""
    model, assistant = _tester_pair("llama", "same")
    inputs = tiny_tester_inputs(batch_size=batch, length=23)
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    call = {**ASSISTED_CALL, **inputs}
    greedy = model.generate(**call)
    outs = {
        chunk: _patched_generate(model, assistant, "dustin", {**FULL, "prefill_chunk": chunk}, **call)
        for chunk in (None, 4, 9)
    }
    for chunk, out in outs.items():
        _assert_same_sequences(out, greedy)
        assert output_shapes(out) == output_shapes(outs[None]), chunk
        for name in ("scores", "logits"):
            for got, want in zip(getattr(out, name), getattr(outs[None], name)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for name in ("hidden_states", "attentions"):
            for k, (step, one_shot) in enumerate(zip(getattr(out, name), getattr(outs[None], name))):
                for layer, (got, want) in enumerate(zip(step, one_shot)):
                    torch.testing.assert_close(
                        got,
                        want,
                        atol=1e-5,
                        rtol=1e-5,
                        msg=lambda m, c=chunk, n=name, k=k, l=layer: f"{c} {n}[{k}][{l}]: {m}",
                    )
        assert_outputs_match_greedy(out, greedy, inputs["attention_mask"])


@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_decoding_sample(family):
    """``test_assisted_decoding_sample``: the model as its own assistant, sampling, all four flags, the testers'
    ``tril`` mask. Stock checks structure only (seeded assisted sampling need not reproduce plain sampling)."""
    model, assistant = _tester_pair(family, "same")
    inputs = tiny_tester_inputs(batch_size=1)
    call = {**ASSISTED_CALL, **inputs, "do_sample": True}
    torch.manual_seed(0)
    stock = model.generate(assistant_model=assistant, **call)
    torch.manual_seed(0)
    out = _patched_generate(model, assistant, "dustin", **call)
    assert out.sequences.shape == (1, TESTER_SEQ_LENGTH + ASSISTED_CALL["max_new_tokens"])
    assert torch.equal(out.sequences[:, :TESTER_SEQ_LENGTH], inputs["input_ids"])
    check_generate_outputs(out, model.config, prompt_length=TESTER_SEQ_LENGTH)
    assert output_shapes(out) == output_shapes(stock)


def test_returned_cache_follows_the_cache_contract():
    """``_check_past_key_values_for_generate``: the returned cache is a transformers ``Cache`` holding
    ``sequences.shape[1] - 1`` positions in layers of stock's key/value layout."""
    model, assistant = _tester_pair("llama", "random")
    inputs = tiny_tester_inputs(batch_size=1)
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    call = dict(ASSISTED_CALL, output_attentions=False, output_hidden_states=False, **inputs)
    out = _patched_generate(model, assistant, "dustin", **call)
    check_cache_for_generate(out, model.config)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_small_budget_outputs_keep_stocks_structure(family):
    """A budget smaller than the context (every decode step sparse): the tuples keep stock's structure and
    shapes; the prompt's entry (a dense forward) equals stock greedy's; on sparse steps each attention row is
    the softmax over the positions read, scattered into the full-length row: it sums to 1 and has at most
    ``budget`` cached positions plus the step's new tokens nonzero."""
    prompt_len, gamma = 64, 2
    model, assistant = _tester_pair(family, "random")
    ids = torch.randint(0, TESTER_VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(5))
    call = dict(ASSISTED_CALL, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8)
    greedy = model.generate(**call)
    out = _patched_generate(model, assistant, "dustin", cache_config=SMALL, **call)
    assert out.sequences.shape == (1, prompt_len + 8)
    check_generate_outputs(out, model.config, prompt_length=prompt_len)
    for got, ref in zip(out.hidden_states[0] + out.attentions[0], greedy.hidden_states[0] + greedy.attentions[0]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for step in out.attentions[1:]:
        for layer in step:  # (1, heads, 1, keys)
            torch.testing.assert_close(layer.sum(-1), torch.ones(layer.shape[:-1]), atol=1e-5, rtol=1e-5)
            assert int((layer != 0).sum(-1).max()) <= SMALL["budget"] + gamma + 1


# ---- 2. logits processors and stopping criteria per row -------------------------------------------------------

N_NEW = 12
LENGTHS = [5, 17, 11, 23]


def _rows():
    return [random_prompt(n, seed=10 + i)[0] for i, n in enumerate(LENGTHS)]


def _min_new_tokens_case(model, rows, plain) -> dict:
    """EOS for the most padded row: a token it emits within ``min_new_tokens`` when unconstrained, and again
    later, so that alone (with ``min_new_tokens``) it stops between ``min_new_tokens`` and ``N_NEW``; a loop that
    counts new tokens from the padded width keeps EOS banned past that point (issue #24)."""
    short = min(range(len(rows)), key=lambda b: rows[b].numel())
    for eos in dict.fromkeys(plain[short][:3].tolist()):
        kwargs = dict(eos_token_id=eos, min_new_tokens=3, pad_token_id=PAD)
        if 3 < alone(model, rows[short], max_new_tokens=N_NEW, **kwargs).numel() < N_NEW:
            return kwargs
    raise AssertionError("no EOS candidate stops the short row after min_new_tokens: change the prompts' seeds")


def _penalty(prompt_ignore_length) -> dict:
    """A user's own ``RepetitionPenaltyLogitsProcessor`` (an int, or one length per row of the padded batch)."""
    processor = RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=prompt_ignore_length)
    return {"logits_processor": LogitsProcessorList([processor])}


def _processor_case(name: str, model, rows, plain, padded_width: int) -> tuple[dict, list[dict]]:
    """``(batch kwargs, per-row kwargs of the same processor for each row alone)``, with token ids taken from
    the unprocessed outputs ``plain`` so that every processor changes some row."""
    tok = lambda b, i: int(plain[b][i])  # noqa: E731
    if name == "repetition_penalty":  # generate() ignores each row's left padding (prompt_ignore_length)
        kwargs = dict(repetition_penalty=1.5)
    elif name == "no_repeat_ngram_size":
        kwargs = dict(no_repeat_ngram_size=2)
    elif name == "bad_words_ids":
        kwargs = dict(bad_words_ids=[[tok(0, 2)], [tok(1, 3), tok(1, 4)]])
    elif name == "min_new_tokens":
        kwargs = _min_new_tokens_case(model, rows, plain)
    elif name == "suppress_tokens":
        kwargs = dict(suppress_tokens=[tok(0, 1), tok(3, 0)])
    elif name == "eos_token_id_list":
        kwargs = dict(eos_token_id=[tok(0, 3), tok(3, 5)], pad_token_id=PAD)
    elif name == "stop_strings":
        tokenizer = char_tokenizer(PAD + 1)
        kwargs = dict(
            stop_strings=[tokenizer.decode([tok(1, 4), tok(1, 5)]), tokenizer.decode([tok(2, 3)])],
            tokenizer=tokenizer,
            pad_token_id=PAD,
        )
    elif name == "prompt_ignore_length_int":  # ignore the prompt: the padded width in the batch, the row alone
        return _penalty(padded_width), [_penalty(r.numel()) for r in rows]
    elif name == "prompt_ignore_length_tensor":  # per row: its padding and its first two tokens
        try:
            RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([0]))
        except ValueError:
            pytest.skip(
                f"transformers {transformers.__version__}'s RepetitionPenaltyLogitsProcessor takes an int "
                "prompt_ignore_length only (per-row tensors came after 5.17)"
            )
        pads = torch.tensor([padded_width - r.numel() for r in rows])
        return _penalty(pads + 2), [_penalty(2) for _ in rows]
    elif name == "forced_eos_token_id":  # the last new token forced, counted from each row's own length
        kwargs = dict(
            forced_eos_token_id=next(t for t in range(PAD) if all(t not in p.tolist() for p in plain)),
            pad_token_id=PAD,
        )
    elif name == "begin_suppress_tokens":  # at each row's own first new token
        kwargs = dict(begin_suppress_tokens=sorted({tok(b, 0) for b in range(len(rows))}))
    elif name == "exponential_decay_length_penalty":  # an EOS boosted from each row's own third new token on
        kwargs = dict(exponential_decay_length_penalty=(2, 4.0), eos_token_id=tok(1, 6), pad_token_id=PAD)
    elif name == "prefix_allowed_tokens_fn":  # row b may write only tokens congruent to b mod 4: its own index

        def allowed(batch_id, ids):
            return list(range(batch_id % 4, PAD, 4))

        return (
            dict(prefix_allowed_tokens_fn=allowed),
            [dict(prefix_allowed_tokens_fn=lambda _, ids, b=b: allowed(b, ids)) for b in range(len(rows))],
        )
    else:
        raise KeyError(name)
    return kwargs, [kwargs] * len(rows)


PROCESSORS = [
    "repetition_penalty",
    "prompt_ignore_length_int",
    "prompt_ignore_length_tensor",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_new_tokens",
    "suppress_tokens",
    "eos_token_id_list",
    "stop_strings",
    # what depends on a row's position or index: shifted by its left padding, or given its own batch index
    "forced_eos_token_id",
    "begin_suppress_tokens",
    "exponential_decay_length_penalty",
    "prefix_allowed_tokens_fn",
]


@pytest.mark.parametrize("scores", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("processor", PROCESSORS)
def test_batched_processor_equals_each_row_alone(processor, mode, scores):
    """Batch of 4, ragged left padding: each row's tokens (and, with ``output_scores``, its processed scores) equal
    its prompt decoded alone (unpadded) by stock greedy with the same processor. Without ``output_scores`` the loop
    must still run the processors (its argmax-only path is for unprocessed greedy decoding). A row stopped by EOS
    is followed by ``pad_token_id``; after a stop string only the prefix is compared: stock's batched loop pads
    finished rows only when an EOS criterion exists, so what follows a stop string is not stock-defined."""
    target = tiny_model("llama", layers=2)
    draft = set_gamma(noisy_copy(target), 4)
    rows = _rows()
    ids, mask = left_pad(rows)
    plain = [alone(target, r, max_new_tokens=N_NEW) for r in rows]
    batch_kwargs, row_kwargs = _processor_case(processor, target, rows, plain, ids.shape[1])
    scored = dict(max_new_tokens=N_NEW, do_sample=False, return_dict_in_generate=True, output_scores=True)
    refs = [target.generate(r[None], **scored, **kw) for r, kw in zip(rows, row_kwargs)]
    ref_tokens = [ref.sequences[0, r.numel() :] for ref, r in zip(refs, rows)]
    assert any(not torch.equal(t, p[: t.numel()]) or t.numel() < N_NEW for t, p in zip(ref_tokens, plain))

    run = scored if scores else {**scored, "output_scores": False}
    out = _patched_generate(target, draft, mode, input_ids=ids, attention_mask=mask, **run, **batch_kwargs)
    eos_stops = "eos_token_id" in batch_kwargs
    for b, (ref, tokens) in enumerate(zip(refs, ref_tokens)):
        got = out.sequences[b, ids.shape[1] :]
        assert got[: tokens.numel()].tolist() == tokens.tolist(), f"row {b}: {got.tolist()}, alone {tokens.tolist()}"
        if eos_stops:
            assert bool((got[tokens.numel() :] == PAD).all()), f"row {b}: {got.tolist()} after {tokens.tolist()}"
        for k, score in enumerate(ref.scores if scores else ()):
            torch.testing.assert_close(
                out.scores[k][b], score[0], atol=1e-4, rtol=1e-4, msg=lambda m, b=b, k=k: f"row {b}, scores[{k}]: {m}"
            )


def test_streamer_receives_stocks_stream():
    """A streamer (batch 1, as stock allows): the prompt first, then every generated token once, in order;
    ``end()`` once. The tokens equal stock greedy's stream."""
    target = tiny_model("llama", layers=2)
    draft = set_gamma(noisy_copy(target), 4)
    ids = random_prompt(9, seed=4)
    stock = TokenCollector()
    target.generate(ids, do_sample=False, max_new_tokens=N_NEW, streamer=stock)
    streamed = TokenCollector()
    out = _patched_generate(
        target, draft, "dustin", input_ids=ids, do_sample=False, max_new_tokens=N_NEW, streamer=streamed
    )
    assert streamed.chunks[0] == ids[0].tolist()
    assert streamed.tokens == out[0].tolist() == stock.tokens
    assert streamed.ends == 1


# ---- 3. attention masks as stock reads them -------------------------------------------------------------------


def _masked_batch(layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of width 12. Masked slots hold real token ids (not PAD): stock feeds them
    and only the mask hides them."""
    ids = random_prompt(12, batch=4, seed=21)
    if layout == "left":
        mask = torch.tensor([[0] * 7 + [1] * 5, [0] * 2 + [1] * 10, [1] * 12, [0] * 4 + [1] * 8])
    elif layout == "right":
        mask = torch.tensor([[1] * 5 + [0] * 7, [1] * 10 + [0] * 2, [1] * 12, [1] * 8 + [0] * 4])
    elif layout == "holes":  # a hole inside, a hole after left padding, the testers' tril row, a masked last slot
        mask = torch.tensor(
            [
                [1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1],
                [0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
                [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                [1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0],
            ]
        )
    else:
        raise KeyError(layout)
    return ids, mask


@pytest.mark.parametrize("processors", ["none", "testers"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["left", "right", "holes"])
def test_mask_read_as_stock_reads_it(layout, mode, processors):
    """Per row, the tokens (and logits) stock greedy gives for the same call on the same batch and mask without
    the assistant. Stock's rules (generation/utils.py): prompt positions are ``cumsum(mask) - 1`` with masked
    slots at 0 (``_prepare_position_ids_for_generation``); each new token's position is the previous last
    position + 1 (``_update_model_kwargs_for_generation``), so after right padding or a masked last slot the
    new tokens restart at 1; masked slots are never attended to, but the last slot's query, masked or not,
    produces the first new token. Where the processors see pad tokens: stock hands every processor the whole
    padded row (masked slots included); ``repetition_penalty`` skips only each row's leading masked slots
    (``prompt_ignore_length = argmax(mask != 0)``, ``_get_logits_processor``), so a hole's or a right pad's
    token ids are penalised; ``bad_words_ids`` and n-gram bans match across masked slots."""
    target = tiny_model("llama", layers=2)
    draft = set_gamma(noisy_copy(target), 3)
    ids, mask = _masked_batch(layout)
    call = dict(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        return_dict_in_generate=True,
        output_logits=True,
        **(processor_kwargs() if processors == "testers" else {}),
    )
    greedy = target.generate(**call)
    out = _patched_generate(target, draft, mode, **call)
    _assert_same_sequences(out, greedy)
    for got, ref in zip(out.logits, greedy.logits):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# ---- 4. sliding-window attention ------------------------------------------------------------------------------


def _windowed(kind: str, window: int):
    if kind == "mistral":
        return tiny_model("mistral", layers=2, sliding_window=window)
    # Qwen2 (5.24's Qwen2Config.__post_init__): layer i slides iff use_sliding_window and i >= max_window_layers
    model = tiny_model("qwen2", layers=3, use_sliding_window=True, sliding_window=window, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return model


@pytest.mark.parametrize("kind", ["mistral", "qwen2_mixed"])
def test_sliding_window_full_budget_equals_greedy(kind):
    """A window (16) shorter than the prompts: with a budget covering the context, ``"dustin"`` equals stock
    greedy, batch 1 and each row of a ragged left-padded batch (stock counts the window in cache slots, so left
    padding does not change it)."""
    target = _windowed(kind, window=16)
    draft = set_gamma(noisy_copy(target), 3)
    rows = [random_prompt(n, seed=30 + n)[0] for n in (40, 25, 9)]
    single = _patched_generate(target, draft, "dustin", input_ids=rows[0][None], do_sample=False, max_new_tokens=16)
    assert single[0, 40:].tolist() == alone(target, rows[0], max_new_tokens=16).tolist()
    ids, mask = left_pad(rows)
    out = _patched_generate(
        target, draft, "dustin", input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16
    )
    for b, row in enumerate(rows):
        assert out[b, ids.shape[1] :].tolist() == alone(target, row, max_new_tokens=16).tolist(), f"row {b}"


def test_sliding_window_budget_covering_the_window_is_exact():
    """Every layer windowed (Mistral, window 12), context 120, budget 24: the budget covers each layer's window
    but not the context, and a windowed layer reads nothing outside its window, so the output is stock greedy's."""
    target = _windowed("mistral", window=12)
    draft = set_gamma(noisy_copy(target), 3)
    ids = random_prompt(120, seed=8)
    config = {"budget": 24, "min_context": 0, "sink_tokens": 4, "recent_tokens": 8}
    out = _patched_generate(
        target, draft, "dustin", cache_config=config, input_ids=ids, do_sample=False, max_new_tokens=16
    )
    assert out[0, 120:].tolist() == alone(target, ids[0], max_new_tokens=16).tolist()


def test_select_positions_with_a_window_reads_only_the_window():
    """The read set of a windowed layer (expected API: ``select_positions(..., window=W)``). Stock's window
    (masking_utils.sliding_window_overlay: key visible iff ``kv_idx > q_idx - W``) lets the first verified
    token, at position L, see cached positions ``[L - W + 1, L)``; no selected index may lie outside that range
    (sinks included). A budget below the window fills the budget from inside it; a budget covering the window
    reads all of it; a row shorter than the window is read in full."""
    window, budget = 32, 16
    config = resolve(
        DustinConfig(budget=budget, min_context=0, sink_tokens=2, recent_tokens=4),
        tiny_model("qwen2").config,
        tiny_model("qwen2", layers=2).config,
    )
    seqlens = [200, 50, 10]
    generator = torch.Generator().manual_seed(0)
    draft_scores = torch.rand(3, max(seqlens), generator=generator)
    target_scores = torch.rand(3, max(seqlens), generator=generator)
    for b, n in enumerate(seqlens):
        draft_scores[b, n:] = target_scores[b, n:] = 0
    sel = select_positions(
        seqlens, draft_scores, target_scores, [True] * 3, config, backend="reference", window=window
    )
    for b, n in enumerate(seqlens):
        picked = sel.indices[b, : sel.counts[b]].tolist()
        lo = max(0, n - window + 1)
        assert all(lo <= p < n for p in picked), (b, picked)
        if n - lo > budget:  # the window holds more than the budget: the budget, from inside the window
            assert len(set(picked)) == len(picked) == budget, (b, picked)
        else:
            assert picked == list(range(lo, n)), (b, picked)

    wide = resolve(
        DustinConfig(budget=64, min_context=0, sink_tokens=2, recent_tokens=4),
        tiny_model("qwen2").config,
        tiny_model("qwen2", layers=2).config,
    )
    sel = select_positions(seqlens, draft_scores, target_scores, [True] * 3, wide, backend="reference", window=window)
    for b, n in enumerate(seqlens):
        assert sel.indices[b, : sel.counts[b]].tolist() == list(range(max(0, n - window + 1), n)), b


# ---- 5. the draft's stock assistant settings ------------------------------------------------------------------


def _stats(out) -> dict:
    return getattr(out, CACHE_KWARG).stats


def test_untouched_draft_generation_config_runs_and_equals_greedy():
    """The draft's ``generation_config`` as loaded (``num_assistant_tokens``, its schedule and
    ``assistant_confidence_threshold`` unset: stock's defaults 20, ``"constant"``, 0.4, filled in by
    ``AssistedCandidateGenerator.__init__``): ``"dustin"`` runs and equals stock greedy, batch 1 and per row of
    a batch."""
    target = tiny_model("qwen2", layers=2)
    draft = noisy_copy(target)
    config = draft.generation_config
    assert (
        config.num_assistant_tokens,
        config.num_assistant_tokens_schedule,
        config.assistant_confidence_threshold,
    ) == (None, None, None)
    rows = _rows()[:3]
    ids = rows[1][None]
    out = _patched_generate(
        target, draft, "dustin", input_ids=ids, do_sample=False, max_new_tokens=20, return_dict_in_generate=True
    )
    assert out.sequences[0, ids.shape[1] :].tolist() == alone(target, rows[1], max_new_tokens=20).tolist()
    assert _stats(out)["steps"] > 0
    ids, mask = left_pad(rows)
    out = _patched_generate(
        target, draft, "dustin", input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20
    )
    for b, row in enumerate(rows):
        assert out[b, ids.shape[1] :].tolist() == alone(target, row, max_new_tokens=20).tolist(), f"row {b}"


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
def test_assistant_schedules_equal_greedy(schedule):
    target = tiny_model("qwen2", layers=2)
    draft = noisy_copy(target)
    draft.generation_config.num_assistant_tokens_schedule = schedule
    ids = random_prompt(13, seed=6)
    out = _patched_generate(target, draft, "dustin", input_ids=ids, do_sample=False, max_new_tokens=20)
    assert out[0, 13:].tolist() == alone(target, ids[0], max_new_tokens=20).tolist()


@pytest.mark.parametrize("gamma", [3, 5])
def test_explicit_num_assistant_tokens_is_honoured(gamma):
    """``num_assistant_tokens = γ`` with the confidence threshold off (stock: 0 disables ``ConfidenceCriteria``,
    while ``None`` means the default 0.4): every step proposes γ drafts (fewer only where the length limit cuts,
    as stock's ``_calculate_new_tokens`` does)."""
    target = tiny_model("qwen2", layers=2)
    draft = set_gamma(noisy_copy(target), gamma, threshold=0.0)
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    ids = random_prompt(13, seed=6)
    out = _patched_generate(
        target, draft, "dustin", input_ids=ids, do_sample=False, max_new_tokens=30, return_dict_in_generate=True
    )
    assert out.sequences[0, 13:].tolist() == alone(target, ids[0], max_new_tokens=30).tolist()
    stats = _stats(out)
    assert (gamma - 1) * stats["steps"] < stats["draft_tokens"] <= gamma * stats["steps"], stats


def test_confidence_threshold_proposes_the_first_unconfident_draft(monkeypatch):
    """Stock's ``assistant_confidence_threshold`` (``ConfidenceCriteria`` in the draft's own ``generate``): drafting
    stops after a drafted token whose probability is below the threshold, and that token is still proposed. A
    threshold of 1.0 (never confident) therefore proposes exactly one draft per step (none where the length
    limit leaves no room), whatever ``num_assistant_tokens`` says."""
    target = tiny_model("qwen2", layers=2)
    draft = set_gamma(noisy_copy(target), 5, threshold=1.0)
    ids = random_prompt(13, seed=6)
    proposed = []
    get_candidates = AssistedCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        proposed.append(candidates.shape[1] - input_ids.shape[1])
        return candidates, logits

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", recording)
    target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=20)
    monkeypatch.undo()
    assert set(proposed[:-1]) == {1} and proposed[-1] in (0, 1), proposed

    out = _patched_generate(
        target, draft, "dustin", input_ids=ids, do_sample=False, max_new_tokens=20, return_dict_in_generate=True
    )
    assert out.sequences[0, 13:].tolist() == alone(target, ids[0], max_new_tokens=20).tolist()
    stats = _stats(out)
    assert stats["steps"] - 1 <= stats["draft_tokens"] <= stats["steps"], stats


@pytest.mark.parametrize("assistant_type", ["same", "random"])
def test_heuristic_schedule_adapts_like_stock(assistant_type):
    """``"heuristic"`` (candidate_generator.py, ``update_candidate_strategy``): +2 drafts after a step that kept
    them all, -1 (at least 1) otherwise, and stock writes the final value back to the draft's
    ``generation_config.num_assistant_tokens`` (end of ``_assisted_decoding``). Batch 1: a perfect draft (the
    model itself) grows γ from 4, a random one shrinks it; the write-back moves the same way as stock's."""
    start = 4
    model = tiny_model("qwen2", layers=2)
    ids = random_prompt(13, seed=6)

    def draft():
        d = model if assistant_type == "same" else tiny_model("qwen2", layers=2, seed=3)
        d.generation_config.num_assistant_tokens = start
        d.generation_config.num_assistant_tokens_schedule = "heuristic"
        d.generation_config.assistant_confidence_threshold = 0.0
        return d

    stock_draft = draft()
    model.generate(ids, assistant_model=stock_draft, do_sample=False, max_new_tokens=30)
    stock_final = stock_draft.generation_config.num_assistant_tokens
    assert (stock_final > start) if assistant_type == "same" else (stock_final < start)

    ours = draft()
    out = _patched_generate(
        model, ours, "dustin", input_ids=ids, do_sample=False, max_new_tokens=30, return_dict_in_generate=True
    )
    assert out.sequences[0, 13:].tolist() == alone(model, ids[0], max_new_tokens=30).tolist()
    stats = _stats(out)
    per_step = stats["draft_tokens"] / stats["steps"]
    final = ours.generation_config.num_assistant_tokens
    if assistant_type == "same":
        assert per_step > start and final > start, (stats, final)
    else:
        assert per_step < start and final < start, (stats, final)


@pytest.mark.parametrize("schedule", ["heuristic", "heuristic_transient", "constant"])
def test_only_the_heuristic_schedule_writes_its_final_length_back(schedule, monkeypatch):
    """Stock (end of ``_assisted_decoding``, batch 1) writes the schedule's final ``num_assistant_tokens`` back into
    the draft's ``generation_config`` under ``"heuristic"`` only, so the next call starts from it;
    ``"heuristic_transient"`` moves the same way within a call and leaves the config alone. The patched model does
    the same: alone, a row's final length; for a batch, where stock has nothing to copy, the rounded mean of its
    rows' final lengths, each row's being the one it reaches alone (so the value does not depend on which row is
    first). The three rows end at different lengths, so the mean differs from any one row's.

    The final length itself need not equal stock's: the steps differ (the loop takes the first token from the
    prefill; stock drafts at most up to the length limit, so a last step with room for one token drafts none and
    counts as one that kept all its drafts, +2)."""
    from dustin_hf.decode.decoder import SpeculativeDecoder

    start = 4
    model = tiny_model("qwen2", layers=2)
    draft = noisy_copy(model, noise=0.01)  # keeps some drafts, not all: lengths grow and shrink

    def reset():
        config = draft.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = start, schedule
        config.assistant_confidence_threshold = 0.0

    stock_lengths = []  # the candidate generator's length after each step
    update = AssistedCandidateGenerator.update_candidate_strategy

    def recording(self, *args, **kwargs):
        update(self, *args, **kwargs)
        stock_lengths.append(self.num_assistant_tokens)

    monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", recording)
    reset()
    model.generate(random_prompt(13, seed=6), assistant_model=draft, do_sample=False, max_new_tokens=30)
    moved = schedule != "constant"
    assert (stock_lengths[-1] != start) == moved, stock_lengths
    assert draft.generation_config.num_assistant_tokens == (stock_lengths[-1] if schedule == "heuristic" else start)

    decoders, results = [], []
    run = SpeculativeDecoder.generate

    def keeping(self, *args, **kwargs):
        decoders.append(self)
        results.append(run(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(SpeculativeDecoder, "generate", keeping)
    rows = _rows()[:3]
    call = dict(
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=30,
        pad_token_id=PAD,
        cache_implementation="dustin",
        cache_config=FULL,
    )
    alone = []
    with dustin_hf.patch(model):
        for row in rows:
            reset()
            model.generate(row[None], **call)
            alone.append(results[-1].draft_tokens[0])
            assert draft.generation_config.num_assistant_tokens == (alone[-1] if schedule == "heuristic" else start)
        reset()
        ids, mask = left_pad(rows)
        model.generate(ids, attention_mask=mask, **call)
        finals = results[-1].draft_tokens
        written = draft.generation_config.num_assistant_tokens
        model.generate(ids, attention_mask=mask, **call)  # the next call starts from what was written
    assert finals == alone, (finals, alone)
    assert (len(set(finals)) > 1) == moved, finals
    assert written == (round(sum(finals) / len(finals)) if schedule == "heuristic" else start), (written, finals)
    assert decoders[-1].drafting.num_draft_tokens == written
