"""Where a decode step's GPU time goes, from a torch.profiler Chrome trace (``e2e.py --torch-trace``).

Prints, per recorded step: wall time of the window, GPU busy time (union of kernel intervals), idle
gaps longer than 100 us, and kernel time and count by category (attention, GEMM, scoring/selection,
other small kernels), then the most expensive kernels. One JSON line at the end.

Kernels launched as programmatic dependents (the package's Triton kernels on sm_90+) start before the
kernel they follow ends and wait inside: their spans include that wait, so spans overlap and the times
by kernel add up to more than the busy time; ``overlap`` (sum of spans minus busy time) says how much.

    python benchmarks/trace_summary.py benchmarks/results/raw/dustin_32768_16.json.gz --steps 8
    python benchmarks/trace_summary.py TRACE --top 40 --by-grid   # the draft's and the target's launches apart
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

GAP_US = 100  # idle stretches longer than this are listed


def category(name: str) -> str:
    if "verify" in name or "merge_splits" in name:
        return "attention"
    if "nvjet" in name or "cublas" in name or "gemm" in name.lower():
        return "gemm"
    if "score" in name or "topk" in name.lower() or "sort" in name.lower():
        return "scoring+selection"
    if "Memcpy" in name or "Memset" in name:
        return "memcpy"
    return "other"


def summarise(path: str, steps: int, top: int = 12, by_grid: bool = False) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        raise SystemExit(f"{path}: no GPU kernels in the trace")
    busy, gaps, small_gaps, end = 0.0, [], 0.0, kernels[0]["ts"]
    for e in kernels:
        start, finish = e["ts"], e["ts"] + e["dur"]
        if start - end > GAP_US:
            gaps.append(start - end)
        elif start > end:
            small_gaps += start - end  # between launches back to back (inside a graph, mostly)
        if finish > end:
            busy += finish - max(start, end)
            end = finish
    window = end - kernels[0]["ts"]
    by_cat, n_cat = collections.Counter(), collections.Counter()
    by_name, n_name = collections.Counter(), collections.Counter()
    for e in kernels:
        by_cat[category(e["name"])] += e["dur"]
        n_cat[category(e["name"])] += 1
        key = e["name"][:100]
        if by_grid and e.get("args", {}).get("grid"):  # one kernel's launches at different sizes, apart
            key = f"{key[:70]} grid={tuple(e['args']['grid'])}"
        by_name[key] += e["dur"]
        n_name[key] += 1
    per = 1e3 * steps  # microseconds over all steps -> milliseconds per step
    out = dict(trace=path, steps=steps, wall_ms=window / per, gpu_busy_ms=busy / per,
               gaps_ms=sum(gaps) / per, small_gaps_ms=small_gaps / per, kernels=len(kernels) / steps,
               overlap_ms=(sum(e["dur"] for e in kernels) - busy) / per,
               categories={c: dict(ms=by_cat[c] / per, kernels=n_cat[c] / steps) for c in by_cat})
    print(f"{path}: per step {out['wall_ms']:.2f} ms wall, GPU busy {out['gpu_busy_ms']:.2f} ms, "
          f"idle gaps > {GAP_US} us {out['gaps_ms']:.2f} ms, shorter ones {out['small_gaps_ms']:.2f} ms, "
          f"{out['kernels']:.0f} kernels; kernel spans overlap by {out['overlap_ms']:.2f} ms (dependent launches)")
    for c, v in sorted(out["categories"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"  {c:<18} {v['ms']:7.2f} ms  {v['kernels']:7.0f} kernels")
    for name, t in by_name.most_common(top):
        print(f"    {t / per:7.3f} ms {n_name[name] / steps:7.1f}x {t / n_name[name]:7.1f} us  {name}")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steps", type=int, default=8, help="decode steps the trace covers (e2e.py records 8)")
    parser.add_argument("--top", type=int, default=12, help="list this many of the most expensive kernels")
    parser.add_argument("--by-grid", action="store_true",
                        help="list a kernel's launches per grid size (the draft's and the target's apart)")
    args = parser.parse_args(argv)
    results = [summarise(path, args.steps, args.top, args.by_grid) for path in args.traces]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
