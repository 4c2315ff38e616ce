"""Exact mode on the real pair, CPU: its greedy continuation is dense speculative decoding's, token for token.

For each bundled book (held out from calibration) and context, one long prompt is continued greedily through
``model.generate(..., assistant_model=draft)`` on the patched target (the calibrated profile at ``--budget``), twice:
with no Dustin arguments (transformers' own assisted decoding: classic speculative decoding, dense verification)
and with ``cache_implementation="dustin"`` in exact mode (``DustinConfig(mode="exact")``, the sparse draft, the
confirm schedule at its defaults). The two continuations must be identical; the report gives exact mode's share of
tentative tokens the dense check confirmed, tokens committed per target forward and dense verifications per
committed token (from ``stats["exact"]``), beside the dense run's tokens per step.

    python benchmarks/exact_cpu.py --books emma alice --contexts 4096 8192 --out benchmarks/results/exact_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dustin_lab.demo import DemoRun, run_demo
from dustin_lab.models import fetch_pair
from dustin_lab.pair import describe_machine, load_pair
from dustin_hf.profiles import config_for_budget, read_profile
from dustin_lab.texts import token_window

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "qwen2.5-coder-1.5b+0.5b.json"
GAMMA = 4


def _summary(result: dict) -> dict:
    """What one exact-mode run did, from its stats (batch 1: one target forward per step)."""
    stats = result["stats"]
    exact, tokens = stats["exact"], len(result["tokens"])
    return {"confirmed_fraction": exact["confirmed_fraction"], "tokens_per_target_forward": tokens / stats["steps"],
            "dense_verifications_per_token": (exact["confirm_steps"] + exact["dense_row_steps"]) / tokens,
            "tokens_per_confirmation": exact["tokens_per_confirmation"], "target_forwards": stats["steps"],
            "sparse_steps": stats["sparse_steps"], "exact": exact}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--books", nargs="+", default=["emma", "alice"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--out", default=None, help="save the report JSON here (after every prompt)")
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    pair = load_pair(*fetch_pair(progress=True), "cpu", "float32")
    config, fraction, _ = read_profile(args.profile)
    config = config_for_budget(config, fraction, args.budget).replace(min_context=1024)
    exact = {"mode": "exact", "sparse_draft": True}
    runs = [DemoRun("dense", "classic speculative decoding (transformers' assisted decoding)"),
            DemoRun("exact", f"exact Dustin, budget {args.budget}", {"cache_implementation": "dustin",
                                                                     "cache_config": exact})]
    report = {"command": " ".join([Path(sys.executable).name] + sys.argv), "machine": describe_machine(pair.device),
              "model_pair": pair.describe(), "config": {**config.to_dict(), **exact}, "gamma": GAMMA,
              "new_tokens": args.new_tokens, "greedy": True, "results": []}
    for context in args.contexts:
        for book in args.books:
            prompt = token_window(pair.tokenizer, book, context, args.offset)
            results = run_demo(pair, config, prompt, runs, GAMMA, args.new_tokens, lambda *lines: print(*lines))
            dense, run = results["dense"], results["exact"]
            row = {"book": book, "offset": args.offset, "context": context,
                   "identical": run["agreement_with_dense"]["identical"], "agreement": run["agreement_with_dense"],
                   "generated_tokens": len(run["tokens"]),
                   "dense": {"tokens_per_target_forward": dense["mean_accepted_per_step"] + 1,
                             "decode_tokens_per_s": dense["decode_tokens_per_s"]},
                   "exact": {**_summary(run), "decode_tokens_per_s": run["decode_tokens_per_s"]},
                   "text": run["text"]}
            report["results"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    report["all_identical"] = all(r["identical"] for r in report["results"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
