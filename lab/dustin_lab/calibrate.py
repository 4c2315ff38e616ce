"""Offline calibration: the scoring heads and ``draft_share`` that maximise attention recovery.

Dustin scores positions on a few heads only: the target's history attention on one layer and the
draft's lookahead attention on a few layers (:mod:`dustin_hf.selection.scoring`). Which heads matters: the
chosen set must capture as much of the target's full attention as possible. Calibration, once per
model pair:

1. **Collect** verification-like steps from long texts: prefill a book window densely, then at
   several positions ``L`` run the target over ``tokens[L-1 : L+γ+1]`` and the draft over
   ``tokens[L-1 : L+γ]`` keeping every head of every layer. Per step this gives
   - ``W (layers, L)``: the reference attention (mean over heads and the γ+1 verification queries,
     renormalised over the cached positions; see :mod:`dustin_hf.selection.recovery`),
   - ``T (target layers, heads, L)``: each target head's history attention (query at ``L-1``),
   - ``D (draft layers, heads, L)``: each draft head's lookahead attention (queries ``L..L+γ-1``).
2. **Search**, greedily (recovery is linear in the selection, so a candidate costs one budget fill):
   target layer and heads with ``m = 0`` (singles, whole GQA groups, then greedy growth within a
   group for the best layers); then draft layers (up to three) with heads from one GQA group each,
   with ``m`` at half the free budget; then ``m`` on a grid; then (optionally) the sink and recent
   windows, and ``m`` once more. Scores average the budgets asked for.
   The selection is :func:`dustin_hf.selection.fill.select_positions`, the decoder's own budget fill.
3. **Report** the calibrated choice beside ``DustinConfig()``'s defaults on the same steps, and the
   oracle (the top positions of the reference attention itself: no selection of that size does better).

The selection layers of ``selection="verify"`` are calibrated apart, by teacher-forced agreement with dense
verification rather than by recovery (:mod:`dustin_lab.select_calibration`).

A time limit bounds the whole run: collection stops taking new books once 60% of it is spent, and
each search stage stops early keeping the best so far.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from dustin_hf import DustinConfig
from dustin_hf.experimental import (
    ModelRunner,
    StepFeatures,
    default_choice,
    oracle_recovery,
    recovery_of,
    search,
    stack_features,
    step_features,
)
from dustin_hf.kernels import resolve_backend

from .prefilled import dustin_attention_on, prefill_pair
from .settings import CalibrationSettings
from .texts import token_window

__all__ = ["CalibrationSettings", "calibrate", "collect_features"]

_COLLECT_SHARE = 0.6  # of the time limit, the most collection may use before the search starts


def collect_features(pair, settings: CalibrationSettings, deadline: float, progress: bool = True) -> StepFeatures:
    """Prefill each book window and sample ``steps_per_book`` steps from it (stops early near ``deadline``)."""
    target, draft = pair.target, pair.draft
    backend = resolve_backend("auto", pair.device)
    start = time.perf_counter()
    rows, seqlens, sources = [], [], []
    books = tqdm(settings.books, desc="calibrate: collect", unit="book", disable=not progress)
    for i, book in enumerate(books):
        if i > 0 and time.perf_counter() - start > _COLLECT_SHARE * (deadline - start):
            tqdm.write(f"calibrate: time limit near, collected {i} of {len(settings.books)} books")
            break
        books.set_postfix_str(f"{book}: prefill {settings.context} tokens")
        tokens = token_window(pair.tokenizer, book, settings.context, settings.offset).to(pair.device)
        state = prefill_pair(target, draft, tokens, progress=progress)
        positions = (
            torch.linspace(settings.min_position, settings.context - settings.gamma - 2, settings.steps_per_book)
            .round()
            .long()
            .unique()
            .tolist()
        )
        books.set_postfix_str(f"{book}: {len(positions)} steps")
        t_model = ModelRunner(target, state.target_cache, backend)
        d_model = ModelRunner(draft, state.draft_cache, backend)
        with torch.no_grad(), dustin_attention_on(target, draft):
            for at in sorted(positions, reverse=True):  # caches only ever roll back
                t_model.cache.rollback([at - 1])
                d_model.cache.rollback([at - 1])
                rows.append(step_features(target, draft, t_model, d_model, tokens, at, settings.gamma, backend))
                seqlens.append(at)
                sources.append({"book": book, "offset": settings.offset, "position": at})
        del state, t_model, d_model
    return stack_features(rows, seqlens, sources)


def calibrate(
    pair,
    settings: CalibrationSettings,
    base: DustinConfig | None = None,
    progress: bool = True,
    features: StepFeatures | None = None,
    save_features=None,
) -> dict:
    """Collect, search and compare; returns the profile's sections (``config``, ``draft_share_fraction``,
    ``recovery``, ``default_recovery``, ``oracle_recovery``, ...) as a JSON-able dict (write it with
    :func:`dustin_hf.profiles.write_profile`). ``features`` given: skip collection (search only);
    ``save_features``: a path to keep the collected features at."""
    # the search scores Dustin's set (its heads, draft share and windows): the profile says so, whatever the default
    base = (base or DustinConfig()).replace(budget=settings.profile_budget, draft_share=None, selection="dustin")
    start = time.perf_counter()
    deadline = start + settings.time_limit
    t_cfg, d_cfg = pair.target.config.get_text_config(), pair.draft.config.get_text_config()
    if features is None:
        features = collect_features(pair, settings, deadline, progress)
        if save_features is not None:
            features.save(save_features)
    collected = time.perf_counter() - start
    choice, log = search(
        features,
        t_cfg,
        d_cfg,
        settings.budgets,
        base,
        deadline,
        progress,
        settings.max_draft_layers,
        settings.search_windows,
    )
    default = default_choice(base, t_cfg, d_cfg, settings.profile_budget)
    report = {}
    for name, c in (("calibrated", choice), ("default", default)):
        per_budget = recovery_of(features, c, settings.budgets, base)
        per_layer = recovery_of(features, c, [settings.profile_budget], base, per_layer=True)[settings.profile_budget]
        report[name] = {
            "mean": sum(per_budget.values()) / len(per_budget),
            "per_budget": {str(b): v for b, v in per_budget.items()},
            f"per_layer@{settings.profile_budget}": per_layer,
        }
    oracle = oracle_recovery(features, settings.budgets)
    report["oracle"] = {
        "mean": sum(oracle.values()) / len(oracle),
        "per_budget": {str(b): v for b, v in oracle.items()},
    }
    config = choice.config(base, settings.profile_budget)
    return {
        "config": config.to_dict(),
        "draft_share_fraction": choice.share if choice.draft else None,
        "recovery": report["calibrated"],
        "default_recovery": report["default"],
        "oracle_recovery": report["oracle"],
        "default_config": default.config(base, settings.profile_budget).to_dict(),
        "search": log,
        "model_pair": pair.describe(),
        "texts": features.sources,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()},
        "seconds": {"collect": collected, "total": time.perf_counter() - start},
    }
