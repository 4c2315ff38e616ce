"""Prefill a long prompt once; reuse the state for every budget, the walk and every decode run.

On a CPU the 1.5B target reads 4k tokens in minutes, so evaluation prefills each prompt once and
starts every later run (dense speculative decoding, Dustin at each budget, the teacher-forced walk)
from a copy of the same state. The state is exactly what :class:`~dustin_hf.decode.decoder.SpeculativeDecoder`
has after its own prefill of the prompt: the target cache holds the prompt, the draft cache all but
its last token, and the target's last query on the scoring layer is kept as the first history.

:meth:`PrefillStore.hook` plugs the stored states into the decoder through its ``prefill`` argument
(:func:`speculative_decoder` passes it): a prompt found in the store is copied in, any other prompt
is prefilled normally.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from dustin_hf import DustinCache, is_patched, patch
from dustin_hf.experimental import (
    DecodeHooks,
    Drafting,
    ModelRunner,
    SpeculativeDecoder,
    attention_routed,
    calibrate_on_prompts,
    model_device,
    select_heads,
)
from dustin_hf.kernels import resolve_backend

__all__ = [
    "Prefilled",
    "PrefillStore",
    "clone_cache",
    "copy_row_into",
    "dustin_attention_on",
    "prefill_pair",
    "speculative_decoder",
]


@dataclass
class Prefilled:
    """One prompt read by both models, as the decoder leaves it after its prefill.

    ``history[layer]``: ``(1, heads, D)``, the target's query of the prompt's last token on every
    query head of ``layer`` (the layers asked for at prefill time).
    """

    tokens: torch.Tensor  # (C,) int64, on the models' device
    target_cache: DustinCache  # positions [0, C)
    draft_cache: DustinCache  # positions [0, C - 1)
    last_logits: torch.Tensor  # (V,) float32: the target's prediction for the token after the prompt
    history: dict[int, torch.Tensor]
    seconds: float  # wall time of both prefills


@contextlib.contextmanager
def dustin_attention_on(target, draft):
    """Register Dustin's attention (patching ``target`` for the block if it is not already) and route both
    models to it; everything is restored on exit."""
    handle = None if is_patched(target) else patch(target)
    try:
        with attention_routed(target, draft):
            yield
    finally:
        if handle is not None:
            handle.unpatch()


def clone_cache(src: DustinCache, capacity: int | None = None, rows: int | None = None) -> DustinCache:
    """A new cache holding ``src``'s rows and lengths (contents copied, at least ``capacity`` slots); with ``rows``,
    a one-row ``src`` copied into each of ``rows`` rows."""
    dst = DustinCache(len(src.layers), rows or src.batch_size, max(capacity or 0, max(src.seq_lengths) + 1))
    copy_cache_into(src, dst)
    return dst


def copy_cache_into(src: DustinCache, dst: DustinCache) -> None:
    """Write ``src``'s cached positions and lengths into ``dst`` (same layers; the same rows, or one row copied into
    each of ``dst``'s; ``dst`` grows if needed)."""
    if len(src.layers) != len(dst.layers) or src.batch_size not in (1, dst.batch_size):
        raise ValueError(f"cannot copy {src!r} into {dst!r}: layers or rows differ")
    length = max(src.seq_lengths)
    dst.ensure_capacity(length)
    for s_layer, d_layer in zip(src.layers, dst.layers):
        keys, values = s_layer.buffers()  # (B, capacity, H, D)
        if not d_layer.is_initialized:
            d_layer.lazy_initialization(keys.transpose(1, 2), values.transpose(1, 2))  # allocates dst.capacity slots
        d_keys, d_values = d_layer.buffers()
        d_keys[:, :length].copy_(keys[:, :length])
        d_values[:, :length].copy_(values[:, :length])
    dst.seq_lengths = list(src.seq_lengths) * (dst.batch_size // src.batch_size)


def copy_row_into(src: DustinCache, dst: DustinCache, row: int) -> None:
    """Write a one-row ``src``'s cached positions and length into row ``row`` of ``dst`` (same layers)."""
    if len(src.layers) != len(dst.layers) or src.batch_size != 1 or not 0 <= row < dst.batch_size:
        raise ValueError(f"cannot copy {src!r} into row {row} of {dst!r}")
    length = src.seq_lengths[0]
    dst.ensure_capacity(length)
    for s_layer, d_layer in zip(src.layers, dst.layers):
        keys, values = s_layer.buffers()  # (1, capacity, H, D)
        if not d_layer.is_initialized:
            d_layer.lazy_initialization(keys.transpose(1, 2), values.transpose(1, 2))  # allocates dst's rows
        d_keys, d_values = d_layer.buffers()
        d_keys[row, :length].copy_(keys[0, :length])
        d_values[row, :length].copy_(values[0, :length])
    dst.seq_lengths[row] = length


def prefill_pair(
    target,
    draft,
    tokens: torch.Tensor,
    history_layers: tuple[int, ...] = (),
    chunk: int | None = 4096,
    capacity: int = 0,
    progress: bool = False,
) -> Prefilled:
    """Prefill ``tokens (C,)`` like the decoder does, keeping every query head of ``history_layers``.

    Runs with Dustin's attention routed (the caller need not patch anything). ``chunk``: prompt tokens per forward
    (``None``: as the decoder chooses, from the free memory on CUDA). ``capacity``: slots to
    reserve past the prompt in both caches (they grow on demand anyway). ``progress``: a bar over the tokens both
    models read, chunk by chunk (on a CPU a 16k prompt takes the 1.5B target minutes), gone once done.
    """
    device = model_device(target)
    tokens = tokens.to(device)
    backend = resolve_backend("auto", device)
    t_cfg, d_cfg = target.config.get_text_config(), draft.config.get_text_config()
    capture = {layer: tuple(range(t_cfg.num_attention_heads)) for layer in history_layers}
    start = time.perf_counter()
    with torch.no_grad(), dustin_attention_on(target, draft):
        t_model = ModelRunner(target, DustinCache(t_cfg.num_hidden_layers, 1, tokens.numel() + capacity + 1), backend)
        d_model = ModelRunner(draft, DustinCache(d_cfg.num_hidden_layers, 1, tokens.numel() + capacity + 1), backend)
        with tqdm(
            total=2 * tokens.numel() - 1,
            desc=f"prefill {tokens.numel()} tokens",
            unit="tok",
            leave=False,
            disable=not progress,
        ) as bar:
            logits, kept = ModelRunner.prefill(t_model, [tokens], chunk, capture, on_chunk=bar.update)
            ModelRunner.prefill(d_model, [tokens[:-1]], chunk, {}, on_chunk=bar.update)
    history = {layer: kept[0][layer][:, 0] for layer in history_layers}  # (1, heads, D)
    return Prefilled(tokens, t_model.cache, d_model.cache, logits[0], history, time.perf_counter() - start)


class PrefillStore:
    """Prefilled prompts of one target/draft pair, looked up by their tokens."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft
        self._states: list[Prefilled] = []

    def add(self, state: Prefilled) -> Prefilled:
        self._states.append(state)
        return state

    def find(self, tokens: torch.Tensor, drop_last: bool = False) -> Prefilled | None:
        """The state whose prompt is ``tokens`` (or, with ``drop_last``, whose prompt minus its last token is)."""
        for state in self._states:
            prompt = state.tokens[:-1] if drop_last else state.tokens
            if prompt.numel() == tokens.numel() and torch.equal(prompt, tokens.to(prompt.device)):
                return state
        return None

    def clear(self) -> None:
        self._states.clear()

    def hook(self, missing: Callable | None = None):
        """A function with ``ModelRunner.prefill``'s signature (plus the model wrapper) for the decoder's hook: a batch
        whose every row is in the store (each row looked up on its own, so a left-padded batch of stored prompts
        qualifies) has each row's state copied into its row of the run's cache; any other batch is prefilled by
        ``missing`` (the same signature; ``None``: ``ModelRunner.prefill``)."""
        missing = missing or ModelRunner.prefill

        def prefill(model, rows: list[torch.Tensor], chunk: int, capture: dict):
            if model.model is self.target:
                states = [self.find(ids) for ids in rows]
                if all(s is not None and set(capture) <= set(s.history) for s in states):
                    for b, state in enumerate(states):
                        copy_row_into(state.target_cache, model.cache, b)
                    kept = [
                        {layer: select_heads(s.history[layer][:, None], heads) for layer, heads in capture.items()}
                        for s in states
                    ]
                    return [s.last_logits for s in states], kept
            elif model.model is self.draft:
                states = [self.find(ids, drop_last=True) for ids in rows]
                if all(s is not None for s in states):
                    for b, state in enumerate(states):
                        copy_row_into(state.draft_cache, model.cache, b)
                    return [s.last_logits for s in states], [{} for _ in states]
            return missing(model, rows, chunk, capture)

        return prefill


def speculative_decoder(
    target, draft, generation_config, *, dustin_config, gamma: int, store: PrefillStore | None = None
):
    """A :class:`~dustin_hf.decode.decoder.SpeculativeDecoder` with a fixed γ (no early stop) that takes prompts
    found in ``store`` from there instead of prefilling them."""
    return SpeculativeDecoder(
        target,
        draft,
        generation_config,
        dustin_config=dustin_config,
        drafting=Drafting(gamma),
        hooks=None if store is None else DecodeHooks(prefill=store.hook()),
        calibrate=calibrate_on_prompts,
    )
