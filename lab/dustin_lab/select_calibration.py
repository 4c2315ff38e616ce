"""Calibration of ``selection="verify"``: which selection layers keep the sparse target closest to the dense one.

The scoring heads are calibrated by attention recovery (:func:`dustin_hf.experimental.search`), a quantity linear in
the read set
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

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dustin_hf import DustinConfig
from dustin_hf.experimental import resolve

from .pair import add_device_options
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


def calibrate_selection_layers(
    pair,
    base: DustinConfig,
    books: tuple[str, ...],
    context: int = 4096,
    tokens: int = 151,
    gamma: int = 4,
    candidates: list[tuple[int, ...]] | None = None,
    offset: int = 0,
    progress: bool = True,
) -> dict:
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
        walk = teacher_forced_walk(
            pair.target,
            pair.draft,
            state,
            window[context:],
            gamma,
            methods,
            recovery_every=0,
            progress=progress,
            desc=f"select layers: {book}",
        )
        for name in methods:
            agreed[name] += walk.top1_agreement_with_dense[name] * walk.tokens
            nll[name] += walk.nll[name]
        positions += walk.tokens
        per_book[book] = {
            name: {
                "top1_agreement": walk.top1_agreement_with_dense[name],
                "ppl_ratio": walk.ppl[name] / walk.ppl["dense"],
            }
            for name in methods
        }
        del state, walk
    pooled = {
        name: {
            "top1_agreement": agreed[name] / positions,
            "ppl_ratio": float(torch.tensor((nll[name] - nll["dense"]) / positions).exp()),
        }
        for name in methods
        if name != "dense"
    }
    best = max(
        candidates, key=lambda layers: (pooled[_name(layers)]["top1_agreement"], -pooled[_name(layers)]["ppl_ratio"])
    )
    return {
        "chosen": list(best),
        "pooled": pooled,
        "per_book": per_book,
        "books": list(books),
        "context": context,
        "tokens": positions,
        "budget": base.budget,
        "seconds": time.perf_counter() - started,
    }


def _name(layers: tuple[int, ...]) -> str:
    return "select-L" + ",".join(map(str, layers))


_MAIN_DOC = """The selection layers of ``selection="verify"`` for a calibrated profile, by teacher-forced agreement
with dense.

Walks the profile's calibration books (not the held-out texts) teacher-forced with every candidate layer set of
:func:`dustin_lab.select_calibration.selection_candidates` (or ``--candidates``) beside dense verification
and Dustin's own set, at the profile's budget; prints each candidate's pooled top-1 agreement with dense and
perplexity ratio, then one JSON line; with ``--write`` records the best in the profile (``config.selection_layers``
and a ``selection_layers`` section with every candidate's figures and this command).

    python -m dustin_lab.select_calibration --profile profiles/qwen2.5-coder-1.5b+0.5b.json \
        --books mobydick paradise_lost --tokens 151 --write
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=_MAIN_DOC.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_MAIN_DOC
    )
    parser.add_argument(
        "--profile", required=True, help="the calibrated profile (e.g. profiles/qwen2.5-coder-1.5b+0.5b.json)"
    )
    parser.add_argument("--books", nargs="+", default=["mobydick", "paradise_lost"], help="calibration books")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=151, help="teacher-forced tokens walked per book")
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=None,
        metavar="LAYERS",
        help="comma-separated layer sets (default: the library's grid)",
    )
    parser.add_argument("--write", action="store_true", help="record the best in the profile")
    add_device_options(parser)
    args = parser.parse_args(argv)

    from dustin_hf.experimental import read_profile

    from .models import fetch_pair
    from .pair import describe_machine, load_pair

    torch.set_grad_enabled(False)
    config, _, profile = read_profile(args.profile)
    pair = load_pair(*fetch_pair(progress=True), args.device, args.dtype)
    candidates = [tuple(int(v) for v in c.split(",")) for c in args.candidates] if args.candidates else None
    report = calibrate_selection_layers(
        pair, config.replace(min_context=1024), tuple(args.books), args.context, args.tokens, candidates=candidates
    )
    print(f"{'method':16s} {'top-1':>6s} {'ppl ratio':>9s}")
    for name, row in sorted(report["pooled"].items(), key=lambda kv: -kv[1]["top1_agreement"]):
        print(f"{name:16s} {row['top1_agreement']:6.3f} {row['ppl_ratio']:9.4f}")
    report.update(
        command=shlex.join(["python", "-m", "dustin_lab.select_calibration", *sys.argv[1:]]),
        machine=describe_machine(pair.device),
    )
    if args.write:
        profile["config"]["selection_layers"] = report["chosen"]
        profile["selection_layers"] = report
        Path(args.profile).write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps({"chosen": report["chosen"], "seconds": round(report["seconds"])}))
    return report


if __name__ == "__main__":
    main()
