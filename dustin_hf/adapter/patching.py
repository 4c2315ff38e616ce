"""``dustin_hf.patch(model)``: the one line that makes ``cache_implementation="dustin"`` work.

Patching changes three things, and the returned handle's ``unpatch()`` restores all three:

1. the ``"dustin"`` attention function is registered in transformers' attention registry (an
   extension point; reference-counted across patched models);
2. ``"dustin"`` is added to the accepted cache implementations (``dustin_hf.patches.cache_registry``);
3. the model's class becomes a subclass that routes assisted decoding through Dustin's loop
   (``dustin_hf.patches.generation``).

The model's weights, config and attention implementation are untouched: without
``cache_implementation="dustin"`` (and with a batch of one) a patched model generates exactly as
before. Patching an already-patched model returns its existing handle (with the new config, if
one is given): nothing is wrapped twice.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from transformers import AttentionInterface

from ..compat import CACHE_KWARG, check_model, check_transformers
from ..config import DustinConfig
from ..decode.hooks import DecodeHooks
from ..decode.workspace import Workspaces
from ..patches.cache_registry import register_cache_implementation, unregister_cache_implementation
from ..patches.generation import patched_class
from .attention import ATTENTION_NAME, dustin_attention

__all__ = ["DustinPatch", "patch", "is_patched"]

_lock = threading.Lock()
_attention_users = 0
_displaced_attention = None  # what "dustin" meant in the registry before us, if anything


def _register_attention() -> None:
    global _attention_users, _displaced_attention
    with _lock:
        if _attention_users == 0:
            _displaced_attention = AttentionInterface._global_mapping.get(ATTENTION_NAME)
            AttentionInterface.register(ATTENTION_NAME, dustin_attention)
        _attention_users += 1


def _unregister_attention() -> None:
    global _attention_users, _displaced_attention
    with _lock:
        _attention_users -= 1
        if _attention_users == 0:
            if _displaced_attention is None:
                AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
            else:
                AttentionInterface._global_mapping[ATTENTION_NAME] = _displaced_attention
            _displaced_attention = None


class DustinPatch:
    """Handle returned by :func:`patch`. ``unpatch()`` (or leaving the ``with`` block) undoes the patch."""

    def __init__(self, model, config: DustinConfig, hooks: DecodeHooks | None = None):
        self.model = model
        self.config = config
        self.hooks = hooks
        # the caches, CUDA graphs and fused weights of the last decode run, for the next one of its shape
        self.workspaces = Workspaces()
        self._original_class = type(model)
        self.active = False

    def release(self) -> None:
        """Free what the model keeps between ``generate()`` calls: both models' KV caches, the CUDA graphs and
        their memory pools, and the fused projection weights (each layer gets its own storage back). The next call
        builds them again (on a GPU about a second at 7B / 32k / batch 16)."""
        self.workspaces.release()

    def _apply(self) -> None:
        register_cache_implementation()
        _register_attention()
        self.model.__class__ = patched_class(self._original_class)
        self.model._dustin_patch = self
        self.active = True

    def warmup(self, draft, batch_size: int, max_length: int, steps: int = 16, **generate_kwargs) -> dict:
        """Pay, before the first real call, what a process's first ``generate()`` of a shape pays: kernel compilation
        and tuning, and the CUDA graphs of every decode shape, kept for the next call of that shape.

        Runs ``generate()`` on random token ids of ``batch_size`` rows with ``assistant_model=draft`` and
        ``cache_implementation="dustin"`` (plus ``generate_kwargs``: pass what the real calls pass, e.g.
        ``do_sample``, ``cache_config``, logits processors: they decide the graphs' shapes), for ``steps`` decode
        steps.
        Its prompts are short (past ``min_context`` and the budget, so the sparse steps run too) and its length
        budget is ``max_length`` (the real calls' prompt plus ``max_new_tokens``), so its caches and graphs are those
        a real call of that length reuses (:mod:`dustin_hf.decode.workspace`). Returns the run's ``stats``; its prompt
        attention's cuDNN plan is built for the short prompt, so the first real call still builds its own.
        """
        from transformers import StoppingCriteria, StoppingCriteriaList

        clashing = sorted(
            {"max_new_tokens", "max_length", "attention_mask", "assistant_model", "input_ids", "cache_implementation"}
            & set(generate_kwargs)
        )
        if clashing:
            raise TypeError(
                f"warmup() sets {clashing} itself (its length budget is max_length); pass the other "
                "generate() arguments the real calls pass"
            )
        config = self.config.replace(**dict(generate_kwargs.get("cache_config") or {}))
        prompt_len = min(max_length // 2, max(config.min_context, config.budget + config.sink_tokens) + 64)
        vocab = min(self.model.config.get_text_config().vocab_size, draft.config.get_text_config().vocab_size)
        device = self.model.get_input_embeddings().weight.device
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=generator).to(device)

        class _After(StoppingCriteria):  # every row stops once it has ``steps`` new tokens: a few decode steps
            def __call__(self, input_ids, scores, **kwargs):
                done = input_ids.shape[1] - prompt_len >= steps
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        criteria = StoppingCriteriaList([*generate_kwargs.pop("stopping_criteria", []), _After()])
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=draft,
            cache_implementation="dustin",
            max_new_tokens=max_length - prompt_len,
            stopping_criteria=criteria,
            **{**generate_kwargs, "return_dict_in_generate": True},
        )
        return getattr(out, CACHE_KWARG).stats

    def unpatch(self) -> None:
        """Restore the model's class and the registries; calling it twice is harmless."""
        if not self.active:
            return
        self.release()
        self.model.__class__ = self._original_class
        del self.model._dustin_patch
        _unregister_attention()
        unregister_cache_implementation()
        self.active = False

    def __enter__(self) -> "DustinPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def __repr__(self):
        state = "active" if self.active else "undone"
        return f"DustinPatch({self._original_class.__name__}, {state}, {self.config})"


def is_patched(model) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get("_dustin_patch"), DustinPatch)


def patch(model, config: DustinConfig | str | Path | None = None, *, hooks: DecodeHooks | None = None) -> DustinPatch:
    """Enable ``generate(..., assistant_model=draft, cache_implementation="dustin")`` on ``model``.

    Args:
        model: the target causal LM (Llama, Mistral, Qwen2/2.5/3 families).
        config: a :class:`DustinConfig`, a path to a calibration profile (JSON), or ``None`` for
            the defaults. ``generate(..., cache_config={...})`` overrides fields for one call.
        hooks: what a benchmark or an evaluation plugs into every decode run
            (:class:`~dustin_hf.decode.hooks.DecodeHooks`: replayed acceptance, phase timing); ``None`` for none.
            Patching a patched model again with hooks replaces them (``handle.hooks = None`` removes them).

    Returns:
        A :class:`DustinPatch`; ``handle.unpatch()`` restores everything.
    """
    check_transformers()
    if isinstance(config, (str, Path)):
        config = DustinConfig.from_profile(config)
    if config is not None and not isinstance(config, DustinConfig):
        raise TypeError(f"config must be a DustinConfig, a profile path or None, got {type(config).__name__}")
    if is_patched(model):
        handle = model._dustin_patch
        if config is not None:
            handle.config = config
        if hooks is not None:
            handle.hooks = hooks
        return handle
    check_model(model, role="target")
    handle = DustinPatch(model, config or DustinConfig(), hooks)
    handle._apply()
    return handle
