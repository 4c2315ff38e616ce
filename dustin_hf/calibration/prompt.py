"""Quick calibration from the prompt itself, when no profile exists (``DustinConfig(calibration="prompt")``).

Offline calibration (the lab's :mod:`dustin_lab.calibrate`) needs texts and minutes. The prompt is a long text
the models have just read, so the decoder can calibrate on it: after both prefills it replays a few
verification-like steps inside the prompt's second half (the target over ``γ+2`` prompt tokens, the
draft over ``γ+1``, every head of every layer kept), turns them into the same step features the
offline search uses, and runs that search (target layer and heads, draft layers and heads, ``m``;
the budget, windows and dense layers stay the user's) within :data:`SEARCH_SECONDS`.

The replayed steps rewrite prompt slots of both caches; the slots and the row lengths are saved
before each step and put back after it, so decoding starts from exactly the prefilled state.
Feature memory: per step ``(target layers × (heads + 1) + draft layers × heads) × L`` float32, on the
models' device, a few steps at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from ..config import SEARCHED_FIELDS, DustinConfig, ResolvedConfig, resolve
from .search import default_choice, recovery_of, search, stack_features, step_features

__all__ = ["SEARCH_SECONDS", "STEPS", "calibrate_on_prompts"]

STEPS = 4  # verification-like steps replayed per calibrated row
ROWS = 2  # rows of a batch calibrated (the longest prompts); one choice serves the whole batch
SEARCH_SECONDS = 5.0  # the greedy search stops here, keeping its best choice so far


@contextlib.contextmanager
def _restored(cache, row: int, start: int, stop: int):
    """Put back row ``row``'s slots ``[start, stop)`` of every layer and its length after the block."""
    length = cache.seq_lengths[row]
    saved = [
        tuple(t[row, start:stop].clone() for t in cache.layer_buffers(layer)) for layer in range(len(cache.layers))
    ]
    cache.seq_lengths[row] = start
    try:
        yield
    finally:
        for layer, tensors in enumerate(saved):
            for buffer, kept in zip(cache.layer_buffers(layer), tensors):
                buffer[row, start:stop].copy_(kept)
        cache.seq_lengths[row] = length


def _positions(length: int, gamma: int) -> list[int]:
    """Step positions ``L`` in the prompt's second half (each needs ``L + γ + 1 <= length``)."""
    last = length - gamma - 1
    first = max(length // 2, 2)
    if last < first:
        return []
    return torch.linspace(first, last, STEPS).round().long().unique().tolist()


def calibrate_on_prompts(
    target, draft, tokens: torch.Tensor, config: ResolvedConfig, gamma: int, lengths: list[int]
) -> tuple[ResolvedConfig, dict]:
    """The scoring heads and ``m`` searched on the prompts (the first ``lengths[b]`` of ``tokens[b]``, ``(B, T)``)
    held by ``target``/``draft`` (:class:`~dustin_hf.decode.runner.ModelRunner` s right after prefill: the target
    caches each prompt, the draft all but its last token); returns the new resolved config and a report
    (``stats["calibration"]``)."""
    started = time.perf_counter()
    rows = sorted(range(len(lengths)), key=lambda b: -lengths[b])[:ROWS]
    steps = _prompt_steps(target, draft, tokens, rows, lengths, gamma)
    if steps is None:
        return config, {"skipped": f"prompts shorter than {2 * (gamma + 2)} tokens: kept the configured heads"}
    t_cfg, d_cfg = target.model.config.get_text_config(), draft.model.config.get_text_config()
    base = DustinConfig(
        budget=config.budget, sink_tokens=config.sink_tokens, recent_tokens=config.recent_tokens,
        dense_layers=config.dense_layers, min_context=config.min_context, backend=config.backend,
        prefill_chunk=config.prefill_chunk,
    )  # fmt: skip
    budgets = (config.budget,)
    deadline = time.perf_counter() + SEARCH_SECONDS
    choice, log = search(steps, t_cfg, d_cfg, budgets, base, deadline, progress=False, search_windows=False)
    default = default_choice(base, t_cfg, d_cfg, config.budget)
    recovery = recovery_of(steps, choice, budgets, base)[config.budget]
    default_recovery = recovery_of(steps, default, budgets, base)[config.budget]
    if default_recovery > recovery:  # never worse than the defaults on the prompt's own steps
        choice, recovery = default, default_recovery
    picked = resolve(choice.config(base, config.budget), t_cfg, d_cfg)
    # only the searched fields change: mode, the confirm schedule, the sparse draft and the knob stay the user's
    chosen = dataclasses.replace(
        config, calibration="none", **{name: getattr(picked, name) for name in SEARCHED_FIELDS}
    )
    report = {
        "steps": len(steps.seqlens),
        "rows": rows,
        "seconds": time.perf_counter() - started,
        "recovery": recovery,
        "default_recovery": default_recovery,
        "target_layer": chosen.target_layer,
        "target_heads": list(chosen.target_heads),
        "draft_layers": list(chosen.draft_layers),
        "draft_heads": [list(h) for h in chosen.draft_heads],
        "draft_share": chosen.draft_share,
        "candidates": log["candidates_evaluated"],
        "stopped_early": log["stopped_early"],
    }
    return chosen, report


def _prompt_steps(target, draft, tokens: torch.Tensor, rows: list[int], lengths: list[int], gamma: int):
    """The search's features of verification steps replayed inside the prompts of ``rows`` (each step's cache
    slots put back after it), or ``None`` where the prompts are too short for any."""
    features, seqlens, sources = [], [], []
    for row in rows:
        for at in _positions(lengths[row], gamma):
            with _restored(target.cache, row, at - 1, at + gamma + 1), _restored(draft.cache, row, at - 1, at + gamma):
                features.append(
                    step_features(
                        target.model, draft.model, target, draft, tokens[row], at, gamma, target.backend, row=row
                    )
                )
            seqlens.append(at)
            sources.append({"row": row, "position": at})
    return stack_features(features, seqlens, sources) if features else None
