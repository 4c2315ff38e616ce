"""Selection layers on the real pair, teacher-forced: the verification forward's own choice beside Dustin's and the
oracle's.

For each text and context, one teacher-forced walk (:mod:`dustin_lab.walk`) on one prefill, every method on
the same tokens: dense verification; Dustin's set (the profile's scoring heads) at each budget; the selection mode
(``DustinConfig(selection="verify")``: at the selection layers the γ+1 verification queries attend to every cached
position and choose the set the layers after them read; the layers before read Dustin's set, or everything with
``--select dense:LAYERS``) at each budget; and the shared oracle (the top positions of the dense method's attention
over every layer) at each budget. Per method: perplexity against dense, top-1 agreement with dense, teacher-forced
drafts kept per step against dense, attention recovery (of what each layer actually read).

Each unit (text, context) is written to ``--scratch`` when done, so an interrupted run resumes; the merged report
(``records``: one per method, text, context and budget) goes to ``--out`` after every unit.

    python benchmarks/select_cpu.py --texts emma alice stdlib:typing --contexts 4096 --budgets 256 512 1024 \\
        --out benchmarks/results/select_cpu.json
    # the layer sweep on a calibration book (not a held-out one): several layer sets at one budget, no oracle
    python benchmarks/select_cpu.py --texts mobydick --budgets 512 --select 1 --select 2 --select 4 --select 2,14 \\
        --no-oracle --out benchmarks/results/select_cpu_layers.json
    # exact mode instead of the walk: greedy model.generate() continuations with Dustin's set and with the selection
    # layers (the sparse draft on), the share of tentative tokens the dense confirmation keeps
    python benchmarks/select_cpu.py --exact 200 --texts alice stdlib:typing --budgets 512 --out /tmp/exact.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dustin_lab.pair import add_device_options

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "qwen2.5-coder-1.5b+0.5b.json"
GAMMA = 4


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--texts",
        nargs="+",
        default=["emma", "alice", "stdlib:typing"],
        help="bundled books or stdlib:MODULE (held out: not mobydick or paradise_lost, the profile's)",
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--tokens", type=int, default=201, help="teacher-forced tokens walked per unit (γ+1 a step)")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--no-select", action="store_true", help="leave the selection layers out")
    parser.add_argument(
        "--select",
        action="append",
        default=None,
        metavar="profile|[dense:]LAYERS",
        help="selection layers, comma-separated (repeatable: one method each); 'dense:' first: the "
        "layers before the first one read everything; 'profile' (the default): the profile's "
        "selection_layers, else the library's default (method 'verify-select-L<layers>')",
    )
    parser.add_argument(
        "--dustin-dense",
        action="append",
        default=[],
        metavar="LAYERS",
        help="also Dustin's set with these layers read in full (comma-separated; repeatable): a "
        "control that reads as many full layers as a selection method",
    )
    parser.add_argument("--no-dustin", action="store_true", help="leave Dustin's set out")
    parser.add_argument("--no-oracle", action="store_true", help="leave the shared oracle out")
    parser.add_argument(
        "--exact",
        type=int,
        default=0,
        metavar="TOKENS",
        help="instead of the walk: exact mode's greedy continuation of TOKENS tokens per text, context "
        "and budget, once with Dustin's set and once with the profile's selection layers (the "
        "sparse draft on, or off with --no-sparse-draft); the report's 'exact' records",
    )
    parser.add_argument("--no-sparse-draft", action="store_true", help="--exact: the draft reads everything")
    parser.add_argument("--scratch", default="/tmp/dustin_hf_select", help="per-unit reports")
    parser.add_argument("--out", required=True)
    add_device_options(parser)
    args = parser.parse_args(argv)

    from dustin_hf.experimental import config_for_budget, read_profile, resolve
    from dustin_lab.models import fetch_pair
    from dustin_lab.pair import describe_machine, load_pair
    from dustin_lab.prefilled import prefill_pair
    from dustin_lab.texts import describe_text, token_window
    from dustin_lab.walk import teacher_forced_walk

    torch.set_grad_enabled(False)
    pair = load_pair(*fetch_pair(progress=True), args.device, args.dtype)
    t_cfg, d_cfg = pair.target.config.get_text_config(), pair.draft.config.get_text_config()
    config, fraction, _ = read_profile(args.profile)
    selects = [
        (False, None)
        if spec == "profile"
        else (spec.startswith("dense:"), tuple(int(v) for v in spec.removeprefix("dense:").split(",")))
        for spec in ([] if args.no_select else args.select or ["profile"])
    ]
    if args.exact:
        return _exact(args, pair, config, fraction, selects, describe_machine)
    methods, oracle, kinds = {"dense": None}, {}, {"dense": ("dense", None, None)}
    for budget in args.budgets:
        base = config_for_budget(config, fraction, budget).replace(min_context=1024, selection="dustin")
        if not args.no_dustin:
            methods[f"dustin@{budget}"] = resolve(base, t_cfg, d_cfg)
            kinds[f"dustin@{budget}"] = ("dustin", budget, None)
        for spec in args.dustin_dense:
            dense = tuple(int(v) for v in spec.split(","))
            name = "dustin-dense-L" + ",".join(map(str, dense))
            methods[f"{name}@{budget}"] = resolve(base.replace(dense_layers=dense), t_cfg, d_cfg)
            kinds[f"{name}@{budget}"] = (name, budget, None)
        for dense_before, layers in selects:
            chosen = base.replace(selection="verify", **({} if layers is None else {"selection_layers": layers}))
            cfg = resolve(chosen, t_cfg, d_cfg)
            if dense_before:
                cfg = resolve(chosen.replace(dense_layers=tuple(range(min(cfg.selection_layers)))), t_cfg, d_cfg)
            name = ("verify-select-dense-L" if dense_before else "verify-select-L") + ",".join(
                map(str, cfg.selection_layers)
            )
            methods[f"{name}@{budget}"] = cfg
            kinds[f"{name}@{budget}"] = (name, budget, list(cfg.selection_layers))
        if not args.no_oracle:
            methods[f"oracle-shared@{budget}"] = resolve(base, t_cfg, d_cfg)
            oracle[f"oracle-shared@{budget}"] = "shared"
            kinds[f"oracle-shared@{budget}"] = ("oracle-shared", budget, None)
    scoring_layer = config.target_layer if config.target_layer is not None else t_cfg.num_hidden_layers // 2
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    units = []
    for context in args.contexts:
        for text in args.texts:
            path = scratch / f"unit_{text.replace(':', '_')}_{context}_{args.tokens}.json"
            if path.exists():
                units.append(json.loads(path.read_text()))
                print(f"{text}@{context}: done before ({path})", flush=True)
                continue
            window = token_window(pair.tokenizer, text, context + args.tokens, args.offset)
            started = time.perf_counter()
            state = prefill_pair(pair.target, pair.draft, window[:context], (scoring_layer,), progress=True)
            walk = teacher_forced_walk(
                pair.target,
                pair.draft,
                state,
                window[context:],
                GAMMA,
                methods,
                recovery_every=1,
                desc=f"walk {text}@{context}",
                oracle=oracle,
            )
            unit = {
                "text": text,
                "text_source": describe_text(text),
                "context": context,
                "steps": walk.steps,
                "tokens": walk.tokens,
                "seconds": time.perf_counter() - started,
                "prefill_seconds": state.seconds,
                "records": _records(walk, kinds, text, context),
            }
            path.write_text(json.dumps(unit) + "\n")
            units.append(unit)
            _print_unit(unit)
            del state, walk
            _write(args, units, methods, pair, describe_machine)
    return _write(args, units, methods, pair, describe_machine)


def _exact(args, pair, config, fraction, selects, describe_machine) -> dict:
    """``--exact``: per text, context and budget, exact mode's continuation with each selection; the confirmed
    fraction is the share of tentative (sparse-verified) tokens the dense confirmation kept."""
    from dustin_hf.experimental import config_for_budget
    from dustin_lab.demo import DemoRun, run_demo
    from dustin_lab.texts import token_window

    sparse_draft = not args.no_sparse_draft
    if any(dense_before for dense_before, _ in selects):
        raise SystemExit("--exact takes --select profile or LAYERS, not dense:LAYERS")
    selections = ([] if args.no_dustin else [("dustin", None)]) + [("verify", layers) for _, layers in selects]
    records = []
    report = {
        "command": shlex.join(["python", "benchmarks/select_cpu.py", *sys.argv[1:]]),
        "machine": describe_machine(pair.device),
        "model_pair": pair.describe(),
        "gamma": GAMMA,
        "greedy": True,
        "exact": records,
    }
    for context in args.contexts:
        for text in args.texts:
            prompt = token_window(pair.tokenizer, text, context, args.offset)
            for budget in args.budgets:
                for selection, chosen in selections:
                    chosen_layers = {} if chosen is None else {"selection_layers": chosen}
                    cfg = config_for_budget(config, fraction, budget).replace(
                        min_context=1024, selection=selection, **chosen_layers
                    )
                    run = DemoRun(
                        "exact",
                        f"exact mode, {selection} selection, budget {budget}",
                        {
                            "cache_implementation": "dustin",
                            "cache_config": {"mode": "exact", "sparse_draft": sparse_draft},
                        },
                    )
                    result = run_demo(pair, cfg, prompt, [run], GAMMA, args.exact, lambda *lines: None)["exact"]
                    stats = result["stats"]
                    records.append(
                        {
                            "selection": selection,
                            "selection_layers": None if chosen is None else list(chosen),
                            "text": text,
                            "context": context,
                            "budget": budget,
                            "new_tokens": len(result["tokens"]),
                            "sparse_draft": sparse_draft,
                            "confirmed_fraction": stats["exact"]["confirmed_fraction"],
                            "tentative_confirmed": stats["exact"]["tentative_confirmed"],
                            "tentative_rejected": stats["exact"]["tentative_rejected"],
                            "tokens_per_target_forward": len(result["tokens"]) / stats["steps"],
                            "seconds": result["generate_seconds"],
                        }
                    )
                    r = records[-1]
                    print(
                        f"{text}@{context} budget {budget} {selection}: confirmed fraction "
                        f"{r['confirmed_fraction']:.3f} ({r['tentative_confirmed']} kept, {r['tentative_rejected']} "
                        f"dropped), {r['tokens_per_target_forward']:.2f} tokens a target forward, "
                        f"{r['seconds']:.0f} s",
                        flush=True,
                    )
                    out = Path(args.out)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _records(walk, kinds: dict, text: str, context: int) -> list[dict]:
    dense = "dense"
    records = []
    for name, (method, budget, layers) in kinds.items():
        kept = walk.accepted[name] / walk.accepted[dense] if walk.accepted[dense] else None
        records.append(
            {
                "method": method,
                "text": text,
                "context": context,
                "budget": budget,
                "selection_layers": layers,
                "ppl": walk.ppl[name],
                "ppl_ratio": walk.ppl[name] / walk.ppl[dense],
                "top1_agreement": walk.top1_agreement_with_dense[name],
                "tf_accepted_per_step": walk.accepted[name],
                "accepted_ratio_to_dense": kept,
                "recovery": walk.recovery.get(name),
                "recovery_per_layer": walk.recovery_per_layer.get(name),
                "steps": walk.steps,
                "sparse_steps": walk.sparse_steps[name],
            }
        )
    return records


def _print_unit(unit: dict) -> None:
    print(f"{unit['text']}@{unit['context']}: {unit['steps']} steps, {unit['seconds']:.0f} s", flush=True)
    print(f"  {'method':28s} {'budget':>6s} {'ppl ratio':>9s} {'top-1':>6s} {'kept':>6s} {'recovery':>8s}")
    for r in unit["records"]:
        print(
            f"  {r['method']:28s} {str(r['budget']):>6s} {r['ppl_ratio']:9.4f} {r['top1_agreement']:6.3f} "
            f"{r['accepted_ratio_to_dense'] or 0:6.3f} {r['recovery'] or 1.0:8.4f}",
            flush=True,
        )


def _write(args, units, methods, pair, describe_machine) -> dict:
    report = {
        "command": shlex.join(["python", "benchmarks/select_cpu.py", *sys.argv[1:]]),
        "machine": describe_machine(pair.device),
        "model_pair": pair.describe(),
        "profile": str(Path(args.profile).resolve().relative_to(ROOT))
        if Path(args.profile).resolve().is_relative_to(ROOT)
        else args.profile,
        "gamma": GAMMA,
        "tokens_per_unit": args.tokens,
        "offset": args.offset,
        "configs": {
            name: None
            if cfg is None
            else {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}
            for name, cfg in methods.items()
        },
        "units": [{k: v for k, v in u.items() if k != "records"} for u in units],
        "records": [r for u in units for r in u["records"]],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"records": len(report["records"]), "out": str(out)}), flush=True)
    return report


if __name__ == "__main__":
    main()
