"""What stock transformers does, as reference code for ``test_conformance.py``.

Ported from transformers' own generation tests, checked against transformers 5.24's ``generate()``:

- ``tests/causal_lm_tester.py`` (``CausalLMModelTester``): the testers' tiny model shapes and inputs,
  ``input_ids`` of shape (13, 7) and ``attention_mask = torch.tril(torch.ones_like(input_ids))``, so a batch of
  one reads ``[1, 0, 0, 0, 0, 0, 0]``;
- ``tests/generation/test_utils.py`` (``GenerationTesterMixin``): ``_get_logits_processor_kwargs``, the call of
  ``test_assisted_decoding_matches_greedy_search`` / ``test_assisted_decoding_sample``, and the shape checks of
  ``_check_generate_outputs`` (``_check_scores``, ``_check_logits``, ``_check_attentions_for_generate``,
  ``_check_hidden_states_for_generate``, ``_check_past_key_values_for_generate``), as plain asserts;
- value checks against stock greedy decoding (``assert_outputs_match_greedy``), with what stock itself returns
  (and where its assisted path differs) spelled out.
"""

from __future__ import annotations

import torch
from tiny_models import tiny_model
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.cache_utils import Cache
from transformers.generation.streamers import BaseStreamer

from dustin_hf.compat import CACHE_KWARG

__all__ = [
    "ASSISTED_CALL",
    "FAMILIES",
    "TESTER_SEQ_LENGTH",
    "TESTER_VOCAB",
    "TokenCollector",
    "alone",
    "assert_outputs_match_greedy",
    "char_tokenizer",
    "check_cache_for_generate",
    "check_generate_outputs",
    "output_shapes",
    "processor_kwargs",
    "set_tester_assistant",
    "tiny_tester_inputs",
    "tiny_tester_model",
]

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]

# CausalLMModelTester's defaults (batch 13, sequence 7, vocab 99, hidden 32, 2 layers, 2 heads, 2 kv heads); the
# MLP keeps tiny_model's (width 64, SiLU) instead of the testers' (37, GELU), which no check here depends on
TESTER_BATCH, TESTER_SEQ_LENGTH, TESTER_VOCAB = 13, 7, 99
_TESTER_SHAPE = dict(vocab=TESTER_VOCAB, hidden=32, layers=2, heads=2, kv_heads=2)
# Each family as its stock config builds it: MistralConfig's default sliding_window is 4096 (the testers keep
# it; every context here is far shorter, where sliding-window attention is full attention).
_STOCK_DEFAULTS = {"mistral": {"sliding_window": 4096}}

# test_assisted_decoding_matches_greedy_search's generation_kwargs: a) eos -1, so nothing stops early;
# c) 4 new tokens, so the target runs at least two forwards
ASSISTED_CALL = dict(
    eos_token_id=-1,
    max_new_tokens=4,
    num_beams=1,
    do_sample=False,
    output_scores=True,
    output_logits=True,
    output_hidden_states=True,
    output_attentions=True,
    return_dict_in_generate=True,
    use_cache=True,
)


def tiny_tester_model(family: str, seed: int = 0, **overrides):
    """A model of ``family`` with the testers' shape and eager attention: the testers force ``"eager"`` so that
    ``output_attentions`` returns weights (stock SDPA returns none, and assisted decoding then leaves
    ``attentions`` empty)."""
    settings = {**_STOCK_DEFAULTS.get(family, {}), "attn_implementation": "eager", **overrides}
    return tiny_model(family, seed=seed, **{**_TESTER_SHAPE, **settings})


def tiny_tester_inputs(batch_size: int = 1, seed: int = 0, length: int = TESTER_SEQ_LENGTH) -> dict:
    """``prepare_config_and_inputs_for_generate(batch_size)``: the first rows of random (13, length) ids with the
    testers' ``tril`` mask (row 0 ``[1, 0, ...]``, row 1 ``[1, 1, 0, ...]``, ...)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, TESTER_VOCAB, (TESTER_BATCH, length), generator=generator)
    attention_mask = torch.tril(torch.ones_like(input_ids))
    return {"input_ids": input_ids[:batch_size], "attention_mask": attention_mask[:batch_size]}


def processor_kwargs() -> dict:
    """``GenerationTesterMixin._get_logits_processor_kwargs(do_sample=False)`` (what the greedy tests pass)."""
    return {"bad_words_ids": [[1, 0]], "repetition_penalty": 1.2, "remove_invalid_values": True}


def set_tester_assistant(assistant, num_assistant_tokens: int = 2):
    """b) the assistant always proposes two tokens per call (constant schedule)."""
    assistant.generation_config.num_assistant_tokens = num_assistant_tokens
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return assistant


# ---- _check_generate_outputs, for a decoder-only model with a cache ------------------------------------------


def check_generate_outputs(output, config, prompt_length: int, check_cache: bool = False) -> None:
    """``GenerationTesterMixin._check_generate_outputs(output, config, use_cache=True)`` for decoder-only models:
    one tuple entry per generated token; the first attention / hidden-state entry covers the whole prompt, each
    later one the single token fed at that step. The cache check is separate (``check_cache_for_generate``)
    unless ``check_cache``."""
    batch, output_length = output.sequences.shape
    vocab = config.get_text_config().vocab_size
    generated = output_length - prompt_length
    # _check_scores
    assert isinstance(output.scores, tuple), type(output.scores)
    assert len(output.scores) == generated, (len(output.scores), generated)
    assert [s.shape for s in output.scores] == [(batch, vocab)] * generated
    # _check_logits
    assert isinstance(output.logits, tuple), type(output.logits)
    assert [x.shape[0] for x in output.logits] == [batch] * len(output.logits)
    assert [vocab - x.shape[-1] for x in output.logits] == [0] * len(output.logits)
    # _check_attentions_for_generate (use_cache: after the first step, one query per entry)
    attentions = output.attentions
    assert isinstance(attentions, tuple) and all(isinstance(a, tuple) for a in attentions), type(attentions)
    assert len(attentions) == generated, (len(attentions), generated)
    for k, step in enumerate(attentions):
        queries = prompt_length if k == 0 else 1
        expected = (batch, config.num_attention_heads, queries, prompt_length + k)
        assert [a.shape for a in step] == [expected] * len(step), (k, [tuple(a.shape) for a in step], expected)
        assert len(step) == config.num_hidden_layers
    # _check_hidden_states_for_generate (embeddings + one per layer)
    hidden = output.hidden_states
    assert isinstance(hidden, tuple) and all(isinstance(h, tuple) for h in hidden), type(hidden)
    assert len(hidden) == generated, (len(hidden), generated)
    for k, step in enumerate(hidden):
        expected = (batch, prompt_length if k == 0 else 1, config.hidden_size)
        assert [h.shape for h in step] == [expected] * len(step), (k, [tuple(h.shape) for h in step], expected)
        assert len(step) == config.num_hidden_layers + 1
    if check_cache:
        check_cache_for_generate(output, config)


def check_cache_for_generate(output, config) -> None:
    """``_check_past_key_values_for_generate(batch, cache, seq_length=sequences.shape[1] - 1, config)``: a
    ``Cache`` with one layer per decoder layer, ``(batch, kv heads, seq_length, head_dim)`` keys and values. A
    cache that preallocates (as stock's ``StaticCache``, which the testers special-case) may hold more slots
    than ``seq_length``; it must still report ``seq_length`` positions."""
    cache = getattr(output, CACHE_KWARG)
    batch, seq_length = output.sequences.shape[0], output.sequences.shape[1] - 1
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert isinstance(cache, Cache), type(cache)
    assert len(cache.layers) == config.num_hidden_layers
    assert cache.get_seq_length() == seq_length, (cache.get_seq_length(), seq_length)
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            assert (tensor.shape[0], tensor.shape[1], tensor.shape[3]) == (batch, kv_heads, head_dim), tensor.shape
            assert tensor.shape[2] >= seq_length, (tensor.shape, seq_length)


def output_shapes(output) -> dict:
    """Every returned tuple's structure: per entry, per layer, the tensor shape."""
    nested = lambda steps: [[tuple(t.shape) for t in step] for step in steps]  # noqa: E731
    return {
        "sequences": tuple(output.sequences.shape),
        "scores": [tuple(s.shape) for s in output.scores],
        "logits": [tuple(x.shape) for x in output.logits],
        "attentions": nested(output.attentions),
        "hidden_states": nested(output.hidden_states),
    }


def assert_outputs_match_greedy(output, greedy, attention_mask: torch.Tensor, atol: float = 1e-4) -> None:
    """Values, not only shapes, against stock greedy decoding of the same call (same sequences expected).

    Entry k >= 1 of ``hidden_states`` / ``attentions`` is, in stock greedy, the forward of the input token whose
    output is generated token k (position ``prompt + k - 1``); entry 0 is the prompt's forward. In entry 0 only
    the rows of unmasked prompt positions and the last position (whose output is the first generated token) are
    compared: stock computes hidden states for masked positions too, but nothing depends on them.

    Stock's own assisted decoding does not meet this on its first step: ``_split_model_outputs``
    (generation/utils.py) slices entries 1..n of the first iteration at ``layer[..., i : i + 1, :]`` of the
    forward over prompt + candidates, i.e. at prompt positions 0..n-1 instead of the candidates' positions (right
    shapes, wrong rows); stock greedy is the reference here.
    """
    close = lambda a, b: torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)  # noqa: E731
    for name in ("scores", "logits"):
        got, ref = getattr(output, name), getattr(greedy, name)
        assert len(got) == len(ref), (name, len(got), len(ref))
        for k, (g, r) in enumerate(zip(got, ref)):
            close(g, r)
    rows = attention_mask.bool().clone()  # (B, prompt) prompt rows compared in entry 0
    rows[:, -1] = True
    for name in ("hidden_states", "attentions"):
        got, ref = getattr(output, name), getattr(greedy, name)
        if got is None and ref is None:  # not asked for
            continue
        assert len(got) == len(ref), (name, len(got), len(ref))
        for k, (g_step, r_step) in enumerate(zip(got, ref)):
            for g, r in zip(g_step, r_step):
                if k == 0:
                    for b in range(rows.shape[0]):
                        keep = rows[b].nonzero().flatten()
                        close(g[b].index_select(-2, keep), r[b].index_select(-2, keep))
                else:
                    close(g, r)


# ---- per-row references and small fixtures -------------------------------------------------------------------


def alone(model, row: torch.Tensor, **kwargs) -> torch.Tensor:
    """Stock greedy ``generate()`` of one unpadded prompt: its generated tokens only."""
    return model.generate(row[None], attention_mask=torch.ones_like(row)[None], do_sample=False, **kwargs)[
        0, row.numel() :
    ]


def char_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over the tiny vocabulary (id i is one printable character), for
    ``stop_strings``: ``StopStringCriteria`` reads every token's text by decoding it after ``"abcdef"``, so the
    tokenizer must encode and decode plain text."""
    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 161 + max(0, vocab - 94))]
    backend = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(chars[:vocab])}, unk_token=chars[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=chars[0], pad_token=chars[vocab - 1])


class TokenCollector(BaseStreamer):
    """A streamer that records what ``generate()`` hands it: ``put`` values (flattened) and ``end`` calls."""

    def __init__(self):
        self.chunks: list[list[int]] = []
        self.ends = 0

    def put(self, value):
        if self.ends:
            raise AssertionError("put() after end()")
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ends += 1

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]
