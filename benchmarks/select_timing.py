"""Old vs new cost of Dustin's per-step selection, and the cost of its scoring, on one GPU.

At the issue's point (Qwen2.5-72B target layout: 64 q / 8 kv heads, head dim 128; the Qwen2.5-0.5B draft:
14 q / 2 kv heads, head dim 64; batch 16, 32k context, budget 512, gamma 4; scoring heads and layers as
the default config resolves them), on random keys, with :class:`attention.ScoringStep`'s inputs:

* selection: ``select_positions`` on the same scores with the PyTorch path (two ``topk`` over the
  whole span, a cat and a sort) and with the Triton kernel (two launches); also whether both chose
  the same positions (they differ only where scores tie at a threshold);
* scoring: the target-history and the draft-lookahead scores with the PyTorch reference and with the
  Triton kernel, plus the key bytes the Triton kernel must read (each scoring key once) and its GB/s;
* per kernel: GPU microseconds per call of every kernel the Triton paths launch (``torch.profiler``,
  eager), to show where the time goes (scoring pass 1 / pass 2, the two selection launches).

Times are medians under CUDA graphs (``triton.testing.do_bench_cudagraph``), as ``attention.py
--timer cudagraph``. Prints a table, then one JSON line.

    python benchmarks/select_timing.py                  # the point above (CUDA)
    python benchmarks/select_timing.py --smoke          # tiny sizes on CPU (reference + Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from attention import DRAFT_LAYOUT, LAYOUTS, SMOKE, ScoringStep, _time_ms, _versions

TARGET_LAYOUT = next(lay for lay in LAYOUTS if lay.name == "qwen2.5-72b")
BATCH, CONTEXT, BUDGET = 16, 32768, 512
PROFILED_CALLS = 20


def _timed(fn, device: torch.device, timer: str) -> float | str:
    """Median milliseconds of ``fn``, or why it could not be timed."""
    try:
        return _time_ms(fn, device, timer)
    except Exception as error:  # e.g. a path that cannot be captured in a graph: report it, keep going
        return f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


def kernel_us(fn, calls: int = PROFILED_CALLS) -> dict[str, float]:
    """GPU microseconds per call of ``fn`` for each kernel it launches (eager, after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.self_device_time_total / calls, 2) for e in prof.key_averages() if e.self_device_time_total}


def _key_bytes(step: ScoringStep) -> int:
    """Bytes of the scoring keys: per scoring layer, the KV heads its scoring heads read, over the span."""
    def layer_bytes(keys, heads, layout, span):
        group = layout.n_heads // layout.n_kv_heads
        kv_heads = len({h // group for h in heads})
        return keys.shape[0] * span * kv_heads * keys.shape[3] * keys.element_size()

    context = max(step.seqlens_host)
    gamma = step.draft_q[0].shape[1]
    total = layer_bytes(step.target_keys, step.cfg.target_heads, step.layout, context)
    for keys, heads in zip(step.draft_keys, step.cfg.draft_heads):
        total += layer_bytes(keys, heads, step.draft, context + gamma)
    return total


def measure(batch: int, context: int, budget: int, target, draft, device: torch.device, dtype: torch.dtype,
            timer: str) -> dict:
    """Every timing of the module docstring at one point; ``None``/``"n/a: ..."`` where not measured."""
    step = ScoringStep.build(target, draft, batch, context, budget, device, dtype)
    backends = ("reference", "triton")
    result = {}
    for backend in backends:
        result[f"scoring_target_ms_{backend}"] = _timed(lambda: step.score_target(backend), device, timer)
        result[f"scoring_draft_ms_{backend}"] = _timed(lambda: step.score_draft(backend), device, timer)
        result[f"scoring_ms_{backend}"] = _timed(lambda: (step.score_target(backend), step.score_draft(backend)),
                                                 device, timer)
    scores = step.score_target("triton"), step.score_draft("triton")
    picks = {}
    for backend in backends:
        result[f"selection_ms_{backend}"] = _timed(lambda: step.select(*scores, backend), device, timer)
        picks[backend] = step.select(*scores, backend).indices
    result["selection_same_positions"] = torch.equal(picks["reference"], picks["triton"])
    result["scoring_key_bytes"] = _key_bytes(step)
    if isinstance(result["scoring_ms_triton"], float):
        result["scoring_key_gbps_triton"] = result["scoring_key_bytes"] / result["scoring_ms_triton"] / 1e6
    if device.type == "cuda":
        result["kernels_us_scoring_triton"] = kernel_us(lambda: (step.score_target("triton"), step.score_draft("triton")))
        result["kernels_us_selection_triton"] = kernel_us(lambda: step.select(*scores, "triton"))
    return result


def _print_table(result: dict) -> None:
    print(f"{'ms per step':<18}{'PyTorch':>10}{'Triton':>10}")
    for what in ("selection", "scoring", "scoring_target", "scoring_draft"):
        cells = [result[f"{what}_ms_{b}"] for b in ("reference", "triton")]
        print(f"{what:<18}" + "".join(f"{c:>10.4f}" if isinstance(c, float) else f"{'n/a':>10}" for c in cells))
    print(f"same positions: {result['selection_same_positions']}")
    for name in ("kernels_us_scoring_triton", "kernels_us_selection_triton"):
        for kernel, us in result.get(name, {}).items():
            print(f"  {name.removeprefix('kernels_us_'):<18}{us:>9.2f} us  {kernel[:90]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Prints a table, then one JSON line.")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--budget", type=int, default=BUDGET)
    parser.add_argument("--timer", choices=("cudagraph", "do_bench"), default="cudagraph",
                        help="do_bench_cudagraph (default; no launch overhead) or do_bench (L2 flushed per run)")
    parser.add_argument("--smoke", action="store_true", help="tiny layouts and sizes; runs on CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, draft, dtype = TARGET_LAYOUT, DRAFT_LAYOUT, torch.bfloat16
    if args.smoke:
        target, draft, dtype = SMOKE["layouts"][0], SMOKE["draft"], SMOKE["dtype"]
        args.batch, args.context, args.budget = 2, 2100, 64
    elif device.type != "cuda":
        sys.exit("needs a CUDA GPU; use --smoke on CPU")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'unknown'})"
    result = measure(args.batch, args.context, args.budget, target, draft, device, dtype, args.timer)
    _print_table(result)
    print(json.dumps(dict(command=" ".join([sys.executable] + sys.argv), gpu=gpu, versions=_versions(),
                          timer=args.timer, target=target.name, draft=draft.name, batch=args.batch,
                          context=args.context, budget=args.budget, dtype=str(dtype), **result)))


if __name__ == "__main__":
    main()
