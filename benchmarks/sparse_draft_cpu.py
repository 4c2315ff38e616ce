"""What a sparse draft costs in acceptance, on the real pair, teacher-forced (same text for every method).

``DustinConfig(sparse_draft=True)`` lets the draft read the last verification's selection plus the
positions written since, instead of its whole cache. Verification is unchanged; only the drafts, and so
the acceptance, can change. Free-running continuations cannot show that reliably (each method's text
diverges after a few tokens), so this walks a book teacher-forced (:mod:`dustin_lab.walk`) with three
methods on the same prefill: dense verification, Dustin, Dustin with the sparse draft. It reports
each one's teacher-forced accepted drafts per step and perplexity, and writes the per-step counts as
acceptance traces (task ``teacher-forced``) that ``benchmarks/e2e.py`` can replay.

    python benchmarks/sparse_draft_cpu.py --contexts 4096 8192 --out benchmarks/results/sparse_draft_cpu.json
    python benchmarks/sparse_draft_cpu.py --books alice prideprejudice --contexts 4096 --guarded --traces '' \
        --out benchmarks/results/sparse_draft_cpu_more.json
    python benchmarks/sparse_draft_cpu.py --books alice --contexts 4096 --tokens 301 --oracle \
        --only dense dustin oracle-shared oracle-per-layer --traces '' --out benchmarks/results/oracle_cpu.json

``--oracle`` adds two methods that read, at each sparse step, the top ``budget`` positions of the dense
method's true attention (:mod:`dustin_lab.oracle`): ``oracle-shared`` (one set for all layers, what a
perfect Dustin scorer would pick) and ``oracle-per-layer`` (each layer its own set); it also measures
every sparse method's attention recovery at every step; ``--oracle-budgets B ...`` adds both oracles at other
budgets (``oracle-shared@B``, ``oracle-per-layer@B``); with ``--guarded`` too, both oracles also walk
with the guarded method's dense layers (``oracle-shared-guarded``, ``oracle-per-layer-guarded``).
``--variant NAME:FIELD=VALUE[;FIELD=VALUE]`` adds Dustin with config fields changed (values in JSON),
e.g. ``--variant 'recent192:recent_tokens=192;draft_share=207'``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dustin_hf.config import resolve
from dustin_lab.models import fetch_pair
from dustin_lab.pair import load_pair
from dustin_lab.prefilled import prefill_pair
from dustin_hf.profiles import config_for_budget, read_profile
from dustin_lab.texts import token_window
from dustin_lab.traces import trace_record, write_trace
from dustin_lab.walk import teacher_forced_walk

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "qwen2.5-coder-1.5b+0.5b.json"
GAMMA = 4


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=201, help="teacher-forced tokens walked per context")
    parser.add_argument("--books", nargs="+", default=["emma"],
                        help="bundled books (emma, alice and prideprejudice are held out from calibration)")
    parser.add_argument("--offset", type=int, default=0, help="token offset of the window in the book")
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--traces", default=str(ROOT / "benchmarks" / "traces"),
                        help="where to write the traces (one per context and method, books pooled); '' for none")
    parser.add_argument("--guarded", action="store_true",
                        help="also walk Dustin with the first two and last two target layers dense (and, with "
                             "--oracle, both oracles with those layers dense)")
    parser.add_argument("--refresh", type=int, default=0, metavar="N",
                        help="also walk Dustin rewriting, every N steps, the K/V of the positions verified since "
                             "with one dense forward (an experiment beyond the paper)")
    parser.add_argument("--oracle", action="store_true",
                        help="also walk oracle-shared and oracle-per-layer: read sets from the true attention "
                             "(an experiment beyond the paper; measures recovery every step)")
    parser.add_argument("--oracle-budgets", type=int, nargs="+", default=[], metavar="B",
                        help="with --oracle: also walk both oracles at these budgets")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[;FIELD=VALUE]",
                        help="also walk Dustin with these config fields changed (JSON values); repeatable")
    parser.add_argument("--only", nargs="+", default=None, metavar="METHOD", help="walk only these methods")
    parser.add_argument("--out", default=None, help="save the report JSON here")
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    target_dir, draft_dir = fetch_pair(progress=True)
    pair = load_pair(target_dir, draft_dir, "cpu", "float32")
    names = pair.describe()
    config, fraction, _ = read_profile(args.profile)
    base = config_for_budget(config, fraction, args.budget).replace(min_context=1024)
    t_cfg, d_cfg = pair.target.config.get_text_config(), pair.draft.config.get_text_config()
    methods = {"dense": None,
               "dustin": resolve(base, t_cfg, d_cfg),
               "dustin-sparse-draft": resolve(base.replace(sparse_draft=True), t_cfg, d_cfg)}
    if args.guarded:
        methods["dustin-guarded"] = resolve(base.replace(dense_layers=(0, 1, -2, -1)), t_cfg, d_cfg)
    refresh = {}
    if args.refresh:
        methods[f"dustin-refresh{args.refresh}"] = methods["dustin"]
        refresh[f"dustin-refresh{args.refresh}"] = args.refresh
    for spec in args.variant:
        name, _, fields = spec.partition(":")
        changes = {key: json.loads(value) for key, _, value in (f.partition("=") for f in fields.split(";"))}
        methods[name] = resolve(base.replace(**changes), t_cfg, d_cfg)
    oracle = {}
    if args.oracle:
        for kind in ("shared", "per-layer"):
            methods[f"oracle-{kind}"] = methods["dustin"]
            oracle[f"oracle-{kind}"] = kind
            for budget in args.oracle_budgets:
                other = config_for_budget(config, fraction, budget).replace(min_context=1024)
                methods[f"oracle-{kind}@{budget}"] = resolve(other, t_cfg, d_cfg)
                oracle[f"oracle-{kind}@{budget}"] = kind
            if args.guarded:  # the oracle's read sets with the guarded method's dense layers
                methods[f"oracle-{kind}-guarded"] = methods["dustin-guarded"]
                oracle[f"oracle-{kind}-guarded"] = kind
    scoring_layer = methods["dustin"].target_layer  # its history query is kept from the prefill
    if args.only:
        unknown = sorted(set(args.only) - set(methods))
        if unknown:
            parser.error(f"--only: no method named {', '.join(unknown)}; the methods here are {', '.join(methods)}")
        methods = {name: cfg for name, cfg in methods.items() if name in args.only}
        oracle = {name: kind for name, kind in oracle.items() if name in methods}
        refresh = {name: n for name, n in refresh.items() if name in methods}
    report = {"command": " ".join([Path(sys.executable).name] + sys.argv), "model_pair": names,
              "profile": str(Path(args.profile).relative_to(ROOT)) if Path(args.profile).is_relative_to(ROOT)
              else args.profile, "budget": args.budget, "gamma": GAMMA, "books": args.books, "results": [],
              "traces": []}
    pair_names = {"target": names["target"]["name"], "draft": names["draft"]["name"]}
    for context in args.contexts:
        sequences = {name: [] for name in methods}
        for book in args.books:
            window = token_window(pair.tokenizer, book, context + args.tokens, args.offset)
            started = time.perf_counter()
            state = prefill_pair(pair.target, pair.draft, window[:context], (scoring_layer,), progress=True)
            walk = teacher_forced_walk(pair.target, pair.draft, state, window[context:], GAMMA, methods,
                                       recovery_every=1 if oracle else 0, desc=f"walk {book}@{context}",
                                       refresh_every=refresh, oracle=oracle)
            row = {"book": book, "context": context, "steps": walk.steps, "seconds": time.perf_counter() - started,
                   "tf_accepted_per_step": walk.accepted, "ppl": walk.ppl,
                   "ppl_ratio": {m: walk.ppl[m] / walk.ppl["dense"] for m in methods}}
            if oracle:
                row.update(recovery=walk.recovery, recovery_per_layer=walk.recovery_per_layer,
                           top1_agreement_with_dense=walk.top1_agreement_with_dense)
            report["results"].append(row)
            print(json.dumps(row), flush=True)
            for name in methods:
                sequences[name].append({"source": {"book": book, "offset": args.offset}, "prompt_tokens": context,
                                        "generated_tokens": walk.tokens, "gammas": [GAMMA] * walk.steps,
                                        "accepted": walk.accepted_trace[name]})
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            del state, walk  # before the next text's prefill: two long prefilled caches at once do not fit
        for name, cfg in methods.items() if args.traces else ():
            record = trace_record(pair_names, "teacher-forced", context, GAMMA, name,
                                  None if cfg is None else args.budget, None if cfg is None else asdict(cfg),
                                  sequences[name][0]["generated_tokens"], names["dtype"], names["device"],
                                  sequences[name])
            report["traces"].append(str(write_trace(args.traces, record).relative_to(ROOT)))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
