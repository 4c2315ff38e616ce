"""Exact mode's confirm schedule replayed on the real pair's recorded predictions, priced with the GPU step costs.

Exact mode's speed depends on how often the sparse target's tokens survive the dense check, on how many a row
gathers before it confirms (``confirm_tokens`` / ``confirm_every``) and on the budget (a larger one agrees more and
costs more per sparse step). This replays the loop's own schedule (:class:`dustin_hf.exact.ConfirmSchedule`, driven
with :meth:`SpeculativeDecoder._exact_step`'s greedy batch rules: when one row confirms, every row holding tentative
tokens confirms in the same forward and every other row verifies densely in it; no row's limit drops below 1) on the prediction traces that ``benchmarks/agreement_cpu.py`` records
(teacher-forced, per position: the dense / sparse target's and the dense / sparse draft's argmax), for batch 16,
256 tokens per row, each row from its own offset. Acceptance of d drafts from position p against a verifier is the
agreeing prefix of the two lists from p; a tentative token at p is the sparse target's ``sparse[p]``, kept while
``dense[p]`` agrees.

Each step is priced with the measured phase times of the 7B + 0.5B pair at 32k, batch 16, one H200 (``COSTS``,
from ``benchmarks/results/e2e_h200_32k_argmax.json``) plus two derived terms: a budget above 512 reads more
selected positions per row (the target's K/V and the sparse draft's for each of its γ forwards, at the sparse
kernel's 78% of copy bandwidth), and a confirmation's longer block ``1 + tentative + γ`` queries per row can make
the 7B's GEMMs compute-bound (a roofline at ``gemm_tflops``; its dense attention is taken as still bound by reading
the cache). The result is an ESTIMATE of decode tokens/s, reported beside classic speculative decoding (dense draft,
dense verification) and the lossless sparse-draft baseline (``confirm_tokens=0``: MagicDec's method) on the same
predictions; the GPU run measures it.

    python benchmarks/exact_schedule.py --out benchmarks/results/exact_schedule.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dustin_hf.exact import ConfirmSchedule
from dustin_hf.research.traces import load_predictions

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "benchmarks" / "traces"
BATCH, NEW_TOKENS = 16, 256
CONFIRM_TOKENS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
CONFIRM_EVERY = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class Costs:
    """Milliseconds per verification step of the whole batch (7B + 0.5B, 32k, batch 16, γ=4, one H200)."""

    dense_draft_ms: float = 10.29  # γ draft forwards reading the whole cache (classic's draft phase)
    sparse_draft_ms: float = 3.68  # γ draft forwards reading a budget-512 selection
    select_ms: float = 0.30  # scoring + selection
    dense_verify_ms: float = 11.37  # the target reading every cached position, 5 queries per row
    sparse_verify_ms: float = 4.82  # the target reading 512 selected positions
    target_kv_bytes: int = 28 * 4 * 128 * 2 * 2  # per position and row: layers x kv heads x head dim x (K, V) x bf16
    draft_kv_bytes: int = 24 * 2 * 64 * 2 * 2
    sparse_gbps: float = 0.78 * 4231  # the sparse kernels' share of the measured copy bandwidth
    target_params: float = 7.07e9  # the 7B's GEMM weights (the embedding table is a gather)
    copy_gbps: float = 4231.0
    gemm_tflops: float = 650.0  # bf16 GEMM throughput reached at a few hundred rows (an assumption)

    def budget_ms(self, budget: int, target_rows: float, gamma: int) -> float:
        """Extra reads of ``budget - 512`` more selected positions: the target's for ``target_rows`` sparse rows,
        the sparse draft's for all rows and γ forwards."""
        extra = max(budget - 512, 0) * (target_rows * self.target_kv_bytes + BATCH * gamma * self.draft_kv_bytes)
        return extra / (self.sparse_gbps * 1e6)

    def gemm_ms(self, queries_per_row: int) -> float:
        """What the target's GEMMs cost beyond reading their weights once, at ``BATCH x queries_per_row`` rows."""
        compute = BATCH * queries_per_row * 2 * self.target_params / (self.gemm_tflops * 1e9)
        return max(0.0, compute - 2 * self.target_params / (self.copy_gbps * 1e6))


def _agree(a: list[int], b: list[int], start: int, length: int) -> int:
    """Leading positions from ``start`` (cyclic) where ``a`` and ``b`` agree, at most ``length``."""
    n = len(a)
    for i in range(length):
        if a[(start + i) % n] != b[(start + i) % n]:
            return i
    return length


def replay_exact(p: dict, budget: int, confirm_tokens: int, confirm_every: int, gamma: int, costs: Costs,
                 batch: int = BATCH, new_tokens: int = NEW_TOKENS) -> dict:
    """Exact mode with the sparse draft on prediction lists ``p``: committed tokens, steps, estimated ms, stats."""
    n = len(p["truth"])
    schedule = ConfirmSchedule(batch, confirm_tokens, confirm_every, min_limit=1)  # greedy
    pos = [b * n // batch for b in range(batch)]  # each row's next uncommitted position
    tentative, generated = [0] * batch, [0] * batch
    steps = dense_row_steps = 0
    ms = 0.0
    while any(g < new_tokens for g in generated):
        active = [b for b in range(batch) if generated[b] < new_tokens]
        wanted = [schedule.wants(b, tentative[b]) for b in active]
        confirming = {b for b in active if tentative[b] > 0 and any(wanted)}
        dense = set(active) if confirming else {b for b in active if schedule.dense(b)}  # greedy: all at a confirm
        width = max(tentative[b] if b in confirming else 0 for b in active) + gamma
        for b in active:
            t, end = tentative[b], pos[b] + tentative[b]
            if b in confirming:
                kept = _agree(p["sparse"], p["dense"], pos[b], t)
                accepted = kept if kept < t else t + _agree(p["draft_sparse"], p["dense"], end, gamma)
                count = min(accepted + 1, new_tokens - generated[b])
                schedule.after_confirm(b, t, kept, count)
            elif b in dense:
                count = min(_agree(p["draft_sparse"], p["dense"], end, gamma) + 1, new_tokens - generated[b])
                schedule.after_dense(b)
            else:
                tentative[b] += _agree(p["draft_sparse"], p["sparse"], end, gamma) + 1
                schedule.after_sparse(b, generated[b] + tentative[b] >= new_tokens)
                continue
            pos[b] += count
            generated[b] += count
            tentative[b] = 0
        steps += 1
        dense_row_steps += len(dense)
        dense_share = len(dense) / batch  # the step is priced as a batch-16 one with this share of rows dense
        ms += (costs.sparse_draft_ms + costs.select_ms + costs.sparse_verify_ms
               + dense_share * (costs.dense_verify_ms - costs.sparse_verify_ms)
               + costs.budget_ms(budget, (1 - dense_share) * BATCH, gamma) + costs.gemm_ms(1 + width))
    tokens = batch * new_tokens
    return {"tokens": tokens, "steps": steps, "ms": ms * BATCH / batch, "tokens_per_s": tokens / ms * 1e3 * BATCH / batch,
            "tokens_per_row_step": tokens / (steps * batch), "dense_row_steps_per_token": dense_row_steps / tokens,
            **{k: schedule.stats.as_dict()[k] for k in ("confirmed_fraction", "tokens_per_confirmation",
                                                         "confirmations", "tentative_rejected")}}


def replay_plain(p: dict, drafter: str, verifier: str, step_ms: float, gamma: int) -> dict:
    """A method whose every step verifies ``p[drafter]``'s drafts against ``p[verifier]`` and commits what it keeps
    (classic speculative decoding: ``draft`` vs ``dense``; Dustin's sparse mode: ``draft_sparse`` vs ``sparse``)."""
    n = len(p["truth"])
    pos, generated, steps = [b * n // BATCH for b in range(BATCH)], [0] * BATCH, 0
    while any(g < NEW_TOKENS for g in generated):
        for b in range(BATCH):
            if generated[b] < NEW_TOKENS:
                count = min(_agree(p[drafter], p[verifier], pos[b], gamma) + 1, NEW_TOKENS - generated[b])
                pos[b], generated[b] = pos[b] + count, generated[b] + count
        steps += 1
    ms = steps * step_ms
    tokens = BATCH * NEW_TOKENS
    return {"tokens": tokens, "steps": steps, "ms": ms, "tokens_per_s": tokens / ms * 1e3,
            "tokens_per_row_step": tokens / (steps * BATCH)}


def expected_prefix(a: float, n: int) -> float:
    """E[confirmed prefix] of n tentative tokens each agreeing with probability a, independently: a(1 - a^n)/(1 - a)."""
    return n if a >= 1 else a * (1 - a ** n) / (1 - a)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--traces", nargs="*", default=None, help="prediction traces (default: all under "
                                                                 "benchmarks/traces)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.traces] if args.traces else sorted(TRACES.glob("*_predictions_*.json"))
    costs = Costs()
    cells = []
    for path in paths:
        trace = load_predictions(path)
        p, gamma, budget = trace["predictions"], trace["gamma"], trace["budget"]
        cell = {"text": trace["text"]["name"], "context": trace["context"], "budget": budget,
                "positions": trace["positions"], "agreement": trace["agreement"], "file": path.name,
                "classic": replay_plain(p, "draft", "dense", costs.dense_draft_ms + costs.dense_verify_ms, gamma),
                "sparse_mode": replay_plain(p, "draft_sparse", "sparse", costs.sparse_draft_ms + costs.select_ms
                                            + costs.sparse_verify_ms + costs.budget_ms(budget, BATCH, gamma), gamma),
                "sparse_draft_baseline": replay_exact(p, budget, 0, 1, gamma, costs), "exact": {}}
        for tokens, every in itertools.product(CONFIRM_TOKENS[1:], CONFIRM_EVERY):
            run = replay_exact(p, budget, tokens, every, gamma, costs)
            run["x_classic"] = run["tokens_per_s"] / cell["classic"]["tokens_per_s"]
            run["x_sparse_draft_baseline"] = run["tokens_per_s"] / cell["sparse_draft_baseline"]["tokens_per_s"]
            cell["exact"][f"{tokens}/{every}"] = run
        for method in ("sparse_draft_baseline", "sparse_mode"):
            cell[method]["x_classic"] = cell[method]["tokens_per_s"] / cell["classic"]["tokens_per_s"]
        cells.append(cell)
    ranking = _rank(cells)
    _print(cells, ranking)
    report = {"command": " ".join([Path(sys.executable).name] + sys.argv), "estimate": True, "costs": asdict(costs),
              "batch": BATCH, "new_tokens": NEW_TOKENS, "cells": cells, "ranking": ranking}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"best": ranking[:3]}))
    return report


def _rank(cells: list[dict]) -> list[dict]:
    """Per (budget, confirm_tokens, confirm_every): the geometric mean over the (text, context) cells of the
    estimated speed-up over classic, and the worst cell against the sparse-draft baseline."""
    by_setting: dict[tuple, list[dict]] = {}
    for cell in cells:
        for schedule, run in cell["exact"].items():
            by_setting.setdefault((cell["budget"], schedule), []).append(run)
    contexts = {(c["text"], c["context"]) for c in cells}
    rows = []
    for (budget, schedule), runs in by_setting.items():
        if len(runs) < len(contexts):  # a budget not walked at every (text, context)
            continue
        rows.append({"budget": budget, "confirm": schedule, "cells": len(runs),
                     "geomean_x_classic": math.exp(sum(math.log(r["x_classic"]) for r in runs) / len(runs)),
                     "min_x_sparse_draft_baseline": min(r["x_sparse_draft_baseline"] for r in runs)})
    return sorted(rows, key=lambda r: -r["geomean_x_classic"])


def _print(cells: list[dict], ranking: list[dict]) -> None:
    print(f"{'text':<16} {'ctx':>5} {'budget':>6} {'agree':>6} {'classic':>8} {'sd-base':>8} {'best exact (tok/confirm)':>26} "
          f"{'x cls':>6} {'x sdb':>6}")
    for c in cells:
        best_key, best = max(c["exact"].items(), key=lambda kv: kv[1]["tokens_per_s"])
        print(f"{c['text']:<16} {c['context']:>5} {c['budget']:>6} {c['agreement']['sparse_vs_dense']:>6.3f} "
              f"{c['classic']['tokens_per_s']:>8.0f} {c['sparse_draft_baseline']['tokens_per_s']:>8.0f} "
              f"{best_key + ': ' + format(best['tokens_per_s'], '.0f'):>26} {best['x_classic']:>6.2f} "
              f"{best['x_sparse_draft_baseline']:>6.2f}")
    print("\nsettings by estimated speed-up over classic (geometric mean over texts and contexts):")
    for r in ranking[:12]:
        print(f"  budget {r['budget']:>5} confirm_tokens/confirm_every {r['confirm']:>5}: {r['geomean_x_classic']:.3f}x "
              f"classic, worst cell {r['min_x_sparse_draft_baseline']:.3f}x the sparse-draft baseline")


if __name__ == "__main__":
    main()
