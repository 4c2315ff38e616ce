"""How often sparse verification picks the dense target's token, on the real pair, and the traces the GPU replay walks.

Exact mode (``DustinConfig(mode="exact")``) commits a sparse step's tokens only once a dense verification agrees
with them, so what it gains depends on the top-1 agreement of the sparse target (the target reading Dustin's
selection) with the dense target. This walks texts teacher-forced (:mod:`dustin_lab.walk`, the same text
for every method) with dense verification and, at each budget, Dustin with the sparse draft (the calibrated
profile, ``sparse_draft=True``: exact mode's setting, so its selections are scored by the sparse draft's queries),
and with ``--dense-draft-budgets`` also plain Dustin (the dense draft), and reports per (text, context, budget)
the agreement of every pair of predictors on the same positions. Each walk writes one prediction trace per budget
(:func:`dustin_lab.traces.prediction_record`: per position the true token, the dense and the sparse
target's argmax, the dense and the sparse draft's) under ``--traces``. With ``--selection verify`` the sparse target
reads the selection layers' sets instead of Dustin's (the profile's layers), for the replay of exact mode with them.

With ``--targets`` the same walk (no extra prefill) also runs the quality knob (``min_recovery``, the sparse draft,
floor ``--knob-floor``, ceiling ``--knob-ceiling``) and measures true recovery at every step: per target the
perplexity and teacher-forced acceptance against dense, the realised budget per step, the correlation of the
scoring heads' estimated recovery with the true one (every layer, head and query of the dense target), and one knob
trace per target (:func:`dustin_lab.traces.knob_trace_record`) for the GPU replay.

    python benchmarks/agreement_cpu.py --texts emma alice stdlib:typing --contexts 4096 --budgets 512 1024 2048 \\
        --targets 0.9 0.95 --out benchmarks/results/agreement_cpu_4k.json
    python benchmarks/agreement_cpu.py --texts emma alice stdlib:typing --contexts 8192 \\
        --budgets 512 1024 2048 4096 --out benchmarks/results/agreement_cpu_8k.json
    python benchmarks/agreement_cpu.py --selection verify --texts emma alice stdlib:typing --budgets 512 2048 \\
        --dense-draft-budgets --out benchmarks/results/agreement_cpu_4k_select.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dustin_hf.experimental import config_for_budget, read_profile, resolve
from dustin_lab.knob import budget_summary, correlation
from dustin_lab.models import fetch_pair
from dustin_lab.pair import add_device_options, describe_machine, load_pair
from dustin_lab.prefilled import prefill_pair
from dustin_lab.texts import describe_text, token_window
from dustin_lab.traces import knob_trace_record, prediction_record, write_knob_trace, write_predictions
from dustin_lab.walk import teacher_forced_walk

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "qwen2.5-coder-1.5b+0.5b.json"
GAMMA = 4
MIN_CONTEXT = 1024  # every walk step is sparse at 4k and 8k


def _shown(path) -> str:
    """``path`` relative to the checkout when it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _share(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def _row(walk, text: str, context: int, budgets: list[int], dense_draft_budgets: list[int], seconds: float) -> dict:
    dense, draft = walk.predictions["dense"], walk.draft_predictions["dense"]
    row = {
        "text": text,
        "context": context,
        "positions": walk.tokens,
        "steps": walk.steps,
        "seconds": seconds,
        "dense_vs_truth": _share(dense, walk.truth),
        "draft_vs_dense": _share(draft, dense),
        "dense_ppl": walk.ppl["dense"],
        "dense_tf_accepted": walk.accepted["dense"],
        "budgets": {},
    }
    for b in budgets:
        name = f"sd{b}"
        sparse, draft_sparse = walk.predictions[name], walk.draft_predictions[name]
        entry = {
            "sparse_vs_dense": _share(sparse, dense),
            "draft_vs_sparse": _share(draft, sparse),
            "draft_sparse_vs_sparse": _share(draft_sparse, sparse),
            "draft_sparse_vs_dense": _share(draft_sparse, dense),
            "ppl_ratio": walk.ppl[name] / walk.ppl["dense"],
            "tf_accepted": walk.accepted[name],
        }
        if b in dense_draft_budgets:
            entry["dense_draft_sparse_vs_dense"] = _share(walk.predictions[f"b{b}"], dense)
        row["budgets"][str(b)] = entry
    return row


def _estimate_truth_pairs(walk, name: str, contexts: list[int]) -> list[tuple[float, float]]:
    """(estimated, true) recovery of ``name``'s read set at each step that did not read the whole context (a
    dense fallback's 1.0 and 1.0 would say nothing about the estimate)."""
    steps = zip(walk.estimated_recovery[name], walk.true_recovery[name], walk.read_counts[name], contexts)
    return [(e, t) for e, t, n, at in steps if e is not None and t is not None and n < at]


def _knob_row(walk, name: str, contexts: list[int]) -> dict:
    """The knob at one target (``contexts``: cached positions at each step): quality against dense, what it read,
    and its estimate against the truth."""
    pairs = _estimate_truth_pairs(walk, name, contexts)
    return {
        "ppl_ratio": walk.ppl[name] / walk.ppl["dense"],
        "tf_accepted": walk.accepted[name],
        "tf_accepted_ratio": walk.accepted[name] / walk.accepted["dense"] if walk.accepted["dense"] else None,
        "sparse_vs_dense": _share(walk.predictions[name], walk.predictions["dense"]),
        "budget": budget_summary(walk.read_counts[name], contexts),
        "mean_estimated_recovery": sum(e for e, _ in pairs) / len(pairs) if pairs else None,
        "mean_true_recovery": sum(t for _, t in pairs) / len(pairs) if pairs else None,
        "estimate_vs_truth": correlation([e for e, _ in pairs], [t for _, t in pairs]),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--texts",
        nargs="+",
        default=["emma", "stdlib:typing"],
        help="bundled books (emma, alice, prideprejudice are held out from calibration) or "
        "stdlib:MODULE (that module's source in this Python)",
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument(
        "--dense-draft-budgets",
        type=int,
        nargs="*",
        default=[512],
        help="also walk plain Dustin (dense draft) at these budgets",
    )
    parser.add_argument(
        "--selection",
        choices=("dustin", "verify"),
        default="dustin",
        help="who chooses the sparse target's read sets: Dustin's set (default) or the selection "
        "layers (DustinConfig(selection='verify'), the profile's layers; traces ..._select.json)",
    )
    parser.add_argument(
        "--targets",
        type=float,
        nargs="*",
        default=[],
        help="also walk the quality knob (min_recovery) at these targets, with the sparse draft",
    )
    parser.add_argument("--knob-floor", type=int, default=512, help="the knob's budget (its floor)")
    parser.add_argument("--knob-ceiling", type=int, default=2048, help="the knob's max_budget")
    parser.add_argument("--tokens", type=int, default=401, help="teacher-forced tokens walked per text and context")
    parser.add_argument("--offset", type=int, default=0, help="token offset of the window in each text")
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per prefill forward (memory)")
    parser.add_argument("--traces", default=str(ROOT / "benchmarks" / "traces"), help="'' for none")
    parser.add_argument("--out", default=None, help="save the report JSON here (after every walk)")
    add_device_options(parser)
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    pair = load_pair(*fetch_pair(progress=True), args.device, args.dtype)
    names = pair.describe()
    pair_names = {"target": names["target"]["name"], "draft": names["draft"]["name"]}
    config, fraction, _ = read_profile(args.profile)
    t_cfg, d_cfg = pair.target.config.get_text_config(), pair.draft.config.get_text_config()
    report = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": describe_machine(pair.device),
        "model_pair": names,
        "profile": _shown(args.profile),
        "selection": args.selection,
        "gamma": GAMMA,
        "min_context": MIN_CONTEXT,
        "results": [],
        "traces": [],
    }
    for context in args.contexts:
        budgets = [b for b in args.budgets if b < context]
        configs = {b: config_for_budget(config, fraction, b).replace(min_context=MIN_CONTEXT) for b in budgets}
        methods = {
            "dense": None,
            **{
                f"sd{b}": resolve(configs[b].replace(sparse_draft=True, selection=args.selection), t_cfg, d_cfg)
                for b in budgets
            },
            **{f"b{b}": resolve(configs[b], t_cfg, d_cfg) for b in args.dense_draft_budgets if b in configs},
        }
        floor = config_for_budget(config, fraction, args.knob_floor).replace(
            min_context=MIN_CONTEXT, sparse_draft=True
        )
        for t in args.targets:
            methods[f"k{t}"] = resolve(floor.replace(min_recovery=t, max_budget=args.knob_ceiling), t_cfg, d_cfg)
        scoring_layer = methods[f"sd{budgets[0]}"].target_layer
        for text in args.texts:
            window = token_window(pair.tokenizer, text, context + args.tokens, args.offset)
            started = time.perf_counter()
            state = prefill_pair(
                pair.target, pair.draft, window[:context], (scoring_layer,), args.prefill_chunk, progress=True
            )
            walk = teacher_forced_walk(
                pair.target,
                pair.draft,
                state,
                window[context:],
                GAMMA,
                methods,
                recovery_every=1 if args.targets else 0,
                desc=f"walk {text}@{context}",
            )
            row = _row(walk, text, context, budgets, args.dense_draft_budgets, time.perf_counter() - started)
            contexts = [context + step * (GAMMA + 1) for step in range(walk.steps)]  # L at each step
            row["knob"] = {str(t): _knob_row(walk, f"k{t}", contexts) for t in args.targets}
            for b in budgets if args.targets else ():  # the fixed budgets on the same footing (every step measured)
                pairs = _estimate_truth_pairs(walk, f"sd{b}", contexts)
                row["budgets"][str(b)].update(
                    mean_true_recovery=walk.recovery.get(f"sd{b}"),
                    mean_estimated_recovery=sum(e for e, _ in pairs) / len(pairs) if pairs else None,
                    estimate_vs_truth=correlation([e for e, _ in pairs], [t for _, t in pairs]),
                )
            report["results"].append(row)
            print(json.dumps(row), flush=True)
            source = {**describe_text(text), "offset": args.offset}
            for b in budgets if args.traces else ():
                name = f"sd{b}"
                predictions = {
                    "truth": walk.truth,
                    "dense": walk.predictions["dense"],
                    "sparse": walk.predictions[name],
                    "draft": walk.draft_predictions["dense"],
                    "draft_sparse": walk.draft_predictions[name],
                }
                record = prediction_record(
                    pair_names,
                    source,
                    context,
                    GAMMA,
                    b,
                    asdict(methods[name]),
                    predictions,
                    names["dtype"],
                    names["device"],
                )
                report["traces"].append(_shown(write_predictions(args.traces, record)))
            for t in args.targets if args.traces else ():
                name = f"k{t}"
                record = knob_trace_record(
                    pair_names,
                    source,
                    context,
                    GAMMA,
                    asdict(methods[name]),
                    [[n] for n in contexts],
                    [[n] for n in walk.read_counts[name]],
                    [[a] for a in walk.accepted_trace[name]],
                    names["dtype"],
                    names["device"],
                )
                report["traces"].append(_shown(write_knob_trace(args.traces, record)))
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            del state, walk  # before the next text's prefill: two long prefilled caches at once do not fit
    return report


if __name__ == "__main__":
    main()
