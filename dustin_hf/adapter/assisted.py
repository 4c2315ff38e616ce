"""From ``generate()``'s prepared arguments to a :class:`~dustin_hf.decode.decoder.SpeculativeDecoder` run.

Checks what the loop does not support (with errors that say so), resolves the Dustin settings for
this call (the patch's config, overridden by ``generate(..., cache_config={...})``), routes both
models' attention to ``"dustin"`` for the call only, and runs the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import torch
from transformers import GenerationConfig

from ..calibration import prompt as prompt_calibration
from ..compat import CACHE_KWARG, check_pair
from ..config import resolve
from ..decode.cache import DustinCache
from ..decode.decoder import DecodeResult, SpeculativeDecoder
from ..decode.settings import Drafting, GenerateSettings, RuntimeOptions
from .attention import ATTENTION_NAME

__all__ = ["attention_routed", "run_assisted"]

# model kwargs generate() prepares itself (position_ids from the mask, unless the caller gave them: the loop
# follows either as stock does); anything else would be silently ignored by the loop
_KNOWN_MODEL_KWARGS = {
    "attention_mask",
    "position_ids",
    "use_cache",
    "logits_to_keep",
    "output_attentions",
    "output_hidden_states",
    CACHE_KWARG,
}


@contextlib.contextmanager
def attention_routed(*models):
    """Route ``models``' attention to ``"dustin"`` inside the block; restore each model's own after."""
    saved = [(m.config, m.config._attn_implementation) for m in models]
    try:
        for config, _ in saved:
            config._attn_implementation = ATTENTION_NAME
        yield
    finally:
        for config, previous in saved:
            config._attn_implementation = previous


# What the loop drafts with when the draft's generation config leaves all three unset (transformers would take
# 20 drafts and a 0.4 confidence stop): a short fixed length keeps every step one forward shape (one CUDA graph
# each) and wastes little verification when acceptance is low, which long-context sparse verification is built for.
DEFAULT_DRAFTING = {
    "num_assistant_tokens": 4,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": None,
}


def draft_settings(draft) -> dict:
    """γ, its schedule and the confidence threshold, read from the draft's generation config as transformers does
    (a value left unset takes transformers' default), or :data:`DEFAULT_DRAFTING` when all three are unset."""
    config = draft.generation_config
    given = {name: getattr(config, name, None) for name in DEFAULT_DRAFTING}
    if all(value is None for value in given.values()):
        return dict(DEFAULT_DRAFTING)
    defaults = GenerationConfig._get_default_generation_params()
    return {name: defaults[name] if value is None else value for name, value in given.items()}


def run_assisted(
    target,
    draft,
    input_ids: torch.Tensor,
    generation_config,
    logits_processor,
    stopping_criteria,
    *,
    use_dustin: bool,
    synced_gpus: bool = False,
    streamer=None,
    tokenizer=None,
    assistant_tokenizer=None,
    model_kwargs: dict | None = None,
) -> DecodeResult:
    """Speculative decoding of ``input_ids`` (any batch size) with ``draft`` proposing tokens.

    The loop keeps its caches and CUDA graphs on the target's patch handle for the next call
    (:mod:`dustin_hf.decode.workspace`); with ``return_dict_in_generate`` the result's ``cache`` is a copy in stock's
    layout (:class:`~dustin_hf.decode.cache.GeneratedCache`), else ``None``."""
    model_kwargs = model_kwargs or {}
    _check_call(target, draft, logits_processor, model_kwargs, synced_gpus, tokenizer, assistant_tokenizer)
    handle, drafting = target._dustin_patch, draft_settings(draft)
    config = _dustin_config(target, draft, generation_config) if use_dustin else None
    decoder = SpeculativeDecoder(
        target, draft,
        GenerateSettings.from_generate(generation_config, logits_processor, stopping_criteria, streamer),
        dustin_config=config,
        drafting=Drafting(
            int(drafting["num_assistant_tokens"]), drafting["assistant_confidence_threshold"] or None,
            drafting["num_assistant_tokens_schedule"],
        ),
        runtime=RuntimeOptions(workspaces=handle.workspaces), hooks=handle.hooks,
        # the loop sits below the calibration search: it runs the search it is handed
        calibrate=prompt_calibration.calibrate_on_prompts,
    )  # fmt: skip
    with attention_routed(target, draft):
        result = decoder.generate(
            input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"),
            cache=_prompt_cache(target, input_ids, generation_config, model_kwargs),
        )  # fmt: skip
    if drafting["num_assistant_tokens_schedule"] == "heuristic":  # transformers keeps the schedule's length
        lengths = result.draft_tokens
        draft.generation_config.num_assistant_tokens = round(sum(lengths) / len(lengths))
    if not generation_config.return_dict_in_generate:
        return dataclasses.replace(result, cache=None, draft_cache=None)
    # the loop's own cache stays with the model for its next call: the caller gets stock's layout, a copy
    prompts = result.prompts
    lengths = [p.length + n - 1 for p, n in zip(prompts, result.generated)]
    returned = result.cache.to_dynamic(target.config, [p.slots for p in prompts], input_ids.shape[1], lengths,
                                       result.stats)  # fmt: skip
    # what a dense forward wrote: a row that verified sparsely wrote its generated tokens' values so (exact mode
    # returns confirmed tokens only, whose values the confirming dense forward rewrote)
    sparse = result.stats.sparse_rows if config is not None and config.mode == "sparse" else set()
    returned.dense_positions = [p.length if b in sparse else n for b, (p, n) in enumerate(zip(prompts, lengths))]
    return dataclasses.replace(result, cache=returned, draft_cache=None)


def _check_call(target, draft, logits_processor, model_kwargs: dict, synced_gpus: bool, tokenizer,
                assistant_tokenizer) -> None:  # fmt: skip
    """What the loop does not support, refused with an error that says so."""
    if draft is None:
        raise ValueError(
            "batched assisted generation and cache_implementation='dustin' need a draft model: pass "
            "assistant_model=... (prompt lookup and early-exit assistants are not supported here)"
        )
    if synced_gpus:
        raise NotImplementedError(
            "synced_gpus (DeepSpeed ZeRO-3 / FSDP) is not supported by dustin_hf's decoding loop"
        )
    for processor in logits_processor or []:
        if type(processor).__name__ == "UnbatchedClassifierFreeGuidanceLogitsProcessor":
            raise NotImplementedError(
                "guidance_scale (classifier-free guidance) runs the model a second time inside its logits processor, "
                "outside dustin_hf's decoding loop: it is not supported with an assistant model here; leave "
                "guidance_scale unset"
            )
    unknown = set(model_kwargs) - _KNOWN_MODEL_KWARGS
    if unknown:
        raise ValueError(f"dustin_hf's decoding loop does not pass these model inputs on: {sorted(unknown)}")
    check_pair(target, draft, tokenizer, assistant_tokenizer)


def _prompt_cache(target, input_ids: torch.Tensor, generation_config, model_kwargs: dict):
    """A given cache of ``input_ids``' leading slots (transformers' prompt-reuse recipe: a forward over the shared
    prefix, ``copy.deepcopy``, ``generate(..., past_key_values=copy)``), checked, or ``None`` (``generate()`` hands
    an empty cache of its own when none is given)."""
    given = model_kwargs.get(CACHE_KWARG)
    if given is None or given.get_seq_length() == 0:
        return None
    DustinCache.check_prefix(given, input_ids, target.config.get_text_config())
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise NotImplementedError(
            "output_attentions / output_hidden_states with a prompt cache are not supported by dustin_hf's loop (its "
            "prompt outputs would cover the uncached tokens only): pass the full prompt without the cache"
        )
    if target._dustin_patch.hooks is not None and target._dustin_patch.hooks.prefill is not None:
        raise ValueError("a prefill hook and a prompt cache both say how the prompt is read: pass one of them")
    return given


def _dustin_config(target, draft, generation_config):
    """The patch's Dustin settings, overridden by this call's ``cache_config``, resolved for the pair."""
    config = target._dustin_patch.config
    overrides = generation_config.cache_config
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ValueError(
            "cache_config must be a mapping of DustinConfig fields to values for this call, e.g. "
            f"cache_config={{'budget': 256}}; got {type(overrides).__name__} {overrides!r}"
        )
    if overrides:
        config = config.replace(**dict(overrides))
    return resolve(config, target.config.get_text_config(), draft.config.get_text_config())
