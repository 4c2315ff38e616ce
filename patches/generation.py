"""The assisted-decoding path of ``generate()`` for patched models.

transformers has no extension point for the decoding loop: ``generate()`` looks the method up with
``getattr(type(self), "_assisted_decoding")``, so an instance attribute cannot override it. A patched
model's class is swapped for a subclass (same name and module, so everything that inspects the
class still sees the original) that overrides two methods:

- ``_prepare_cache_for_generation``: with ``cache_implementation="dustin"``, checks that this is
  assisted generation and leaves the cache to the decoding loop (which builds a ``DustinCache`` for
  the target and one for the draft, and reads a given prompt cache's positions into the target's);
- ``_assisted_decoding``: runs :class:`dustin_hf.decode.decoder.SpeculativeDecoder` for Dustin or for any
  batch larger than one (stock transformers refuses those); a batch of one without Dustin takes the
  stock path unchanged.

Checked against transformers 5.17 to 5.25 (the signatures below are theirs).
"""

from __future__ import annotations

from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMode

from dustin_hf.compat import CACHE_KWARG

from .cache_registry import CACHE_NAME

__all__ = ["patched_class", "DustinGenerationMixin"]

_SUBCLASSES: dict[type, type] = {}


class DustinGenerationMixin:
    """Overrides of ``GenerationMixin`` internals; ``self._dustin_patch`` is the model's patch handle."""

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
    ):
        if generation_config.cache_implementation != CACHE_NAME:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
            )
        if generation_config.num_beams > 1:
            raise ValueError(
                "cache_implementation='dustin' does not support beam search "
                f"(num_beams={generation_config.num_beams}): speculative decoding keeps one sequence per row; use "
                "num_beams=1 (greedy or do_sample=True)"
            )
        if generation_mode != GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                "cache_implementation='dustin' verifies draft tokens, so it needs assisted generation: pass "
                f"assistant_model=<draft model> to generate() (got generation mode {generation_mode.value!r})"
            )
        # a given cache is a prompt cache (transformers' prompt-reuse recipe): the loop reads its positions into
        # its own caches and leaves it as it was (dustin_hf.decode.cache.DustinCache.load_prefix)
        if not generation_config.use_cache:
            raise ValueError("cache_implementation='dustin' needs use_cache=True")

    def _apply(self, fn, *args, **kwargs):
        # model.to() / .half() / .cuda() move every parameter: the workspace a decode run left (caches, graphs,
        # fused weights on the old device) could serve no later call, so free it now rather than at the next call
        patch = self.__dict__.get("_dustin_patch")
        if patch is not None:
            patch.release()
        return super()._apply(fn, *args, **kwargs)

    def _assisted_decoding(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        inputs_tensor=None,
        assistant_model=None,
        assistant_tokenizer=None,
        tokenizer=None,
        **model_kwargs,
    ):
        use_dustin = generation_config.cache_implementation == CACHE_NAME
        if not use_dustin and input_ids.shape[0] == 1:
            return super()._assisted_decoding(
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                synced_gpus=synced_gpus,
                streamer=streamer,
                inputs_tensor=inputs_tensor,
                assistant_model=assistant_model,
                assistant_tokenizer=assistant_tokenizer,
                tokenizer=tokenizer,
                **model_kwargs,
            )
        from dustin_hf.adapter.assisted import run_assisted

        result = run_assisted(
            self,
            assistant_model,
            input_ids,
            generation_config,
            logits_processor,
            stopping_criteria,
            use_dustin=use_dustin,
            synced_gpus=synced_gpus,
            streamer=streamer,
            tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer,
            model_kwargs=model_kwargs,
        )
        if not generation_config.return_dict_in_generate:
            return result.sequences
        return GenerateDecoderOnlyOutput(
            sequences=result.sequences,
            scores=result.scores,
            logits=result.logits,
            attentions=result.attentions,
            hidden_states=result.hidden_states,
            **{CACHE_KWARG: result.cache},
        )


def patched_class(cls: type) -> type:
    """The subclass of ``cls`` with the overrides above (one per class, reused by every patched model)."""
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(
            cls.__name__,
            (DustinGenerationMixin, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_dustin_original_class": cls},
        )
    return _SUBCLASSES[cls]
