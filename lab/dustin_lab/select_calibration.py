"""Calibration of ``selection="verify"``: which selection layers keep the sparse target closest to the dense one.

The scoring heads are calibrated by attention recovery (:mod:`dustin_hf.search`), a quantity linear in the read set
and cheap to score for thousands of candidates. For selection layers it misleads: on the Qwen2.5-Coder 1.5B/0.5B
pair the layer whose own choice added the most recovery over Dustin's set on the layers after it gave the
*lowest* top-1 agreement with dense verification of every layer set tried on held-out texts, and early selection
layers, which recovery ranks last, gave the highest (``benchmarks/results/select_cpu.json``). So the candidates
are judged by what they are for: a teacher-forced walk (:func:`~dustin_lab.walk.teacher_forced_walk`) over
calibration books, each candidate a method of the same walk, beside dense verification and Dustin's own set;
the candidate whose greedy predictions agree most often with dense verification's wins (ties: the lower
perplexity). Each candidate costs one target forward a step, so the grid is small: an early first layer, alone
or with one re-selection layer further in (TidalDecode's pattern).
"""

from __future__ import annotations

import time

import torch

from dustin_hf.config import DustinConfig, resolve

from .prefilled import prefill_pair
from .texts import token_window
from .walk import teacher_forced_walk

__all__ = ["calibrate_selection_layers", "selection_candidates"]


def selection_candidates(num_layers: int) -> list[tuple[int, ...]]:
    """The grid: a first selection layer among the early ones (1, 2, 4), alone or with a re-selection layer at a
    quarter, half or two thirds of the depth."""
    firsts = sorted({layer for layer in (1, 2, 4) if layer < num_layers - 1})
    seconds = sorted({num_layers // 4, num_layers // 2, (2 * num_layers) // 3})
    grid = [(first,) for first in firsts]
    grid += [(first, second) for first in firsts for second in seconds if first < second < num_layers - 1]
    return grid


def calibrate_selection_layers(pair, base: DustinConfig, books: tuple[str, ...], context: int = 4096,
                               tokens: int = 151, gamma: int = 4, candidates: list[tuple[int, ...]] | None = None,
                               offset: int = 0, progress: bool = True) -> dict:
    """Walk ``tokens`` teacher-forced tokens after ``context`` of each book with every candidate; return the
    chosen layers and each candidate's top-1 agreement with dense verification and perplexity ratio to it,
    pooled over the books (Dustin's set alone as ``"dustin"``).

    ``base``: the config the candidates extend (scoring heads, budget, windows); its ``min_context`` should be
    below ``context`` so that every step is sparse."""
    t_cfg, d_cfg = pair.target.config.get_text_config(), pair.draft.config.get_text_config()
    candidates = candidates or selection_candidates(t_cfg.num_hidden_layers)
    dustin = resolve(base.replace(selection="dustin"), t_cfg, d_cfg)
    methods = {"dense": None, "dustin": dustin}
    for layers in candidates:
        methods[_name(layers)] = resolve(base.replace(selection="verify", selection_layers=layers), t_cfg, d_cfg)
    started = time.perf_counter()
    agreed, nll, positions = {name: 0.0 for name in methods}, {name: 0.0 for name in methods}, 0
    per_book = {}
    for book in books:
        window = token_window(pair.tokenizer, book, context + tokens, offset)
        state = prefill_pair(pair.target, pair.draft, window[:context], (dustin.target_layer,), progress=progress)
        walk = teacher_forced_walk(pair.target, pair.draft, state, window[context:], gamma, methods,
                                   recovery_every=0, progress=progress, desc=f"select layers: {book}")
        for name in methods:
            agreed[name] += walk.top1_agreement_with_dense[name] * walk.tokens
            nll[name] += walk.nll[name]
        positions += walk.tokens
        per_book[book] = {name: {"top1_agreement": walk.top1_agreement_with_dense[name],
                                 "ppl_ratio": walk.ppl[name] / walk.ppl["dense"]} for name in methods}
        del state, walk
    pooled = {name: {"top1_agreement": agreed[name] / positions,
                     "ppl_ratio": float(torch.tensor((nll[name] - nll["dense"]) / positions).exp())}
              for name in methods if name != "dense"}
    best = max(candidates, key=lambda layers: (pooled[_name(layers)]["top1_agreement"],
                                               -pooled[_name(layers)]["ppl_ratio"]))
    return {"chosen": list(best), "pooled": pooled, "per_book": per_book, "books": list(books),
            "context": context, "tokens": positions, "budget": base.budget, "seconds": time.perf_counter() - started}


def _name(layers: tuple[int, ...]) -> str:
    return "select-L" + ",".join(map(str, layers))
