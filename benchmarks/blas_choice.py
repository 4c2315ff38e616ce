"""cuBLAS vs cuBLASLt for the decode loop's GEMM shapes on this GPU (which kernels each picks, and their time).

PyTorch calls the cuBLAS API for a plain ``F.linear`` unless ``torch.backends.cuda.preferred_blas_library``
says ``"cublaslt"``. For the skinny down projections of decoding the two pick different kernels (split-K with
a reduction launch, or not); the decode loop runs with the faster one (``dustin_hf.decoding``). Each shape is
timed inside a CUDA graph over several weight copies, so the weights come from HBM as in a model forward.

    python benchmarks/blas_choice.py --out benchmarks/results/blas_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch
import torch.nn.functional as F

# (name, rows M, in K, out N): Qwen2.5-0.5B draft at 16 rows, 7B verification at 16 x 5 rows, 72B at 8 x 5 rows
SHAPES = [("0.5b down", 16, 4864, 896), ("0.5b gate_up", 16, 896, 9728), ("0.5b qkv", 16, 896, 1152),
          ("0.5b o", 16, 896, 896), ("0.5b head", 16, 896, 151936),
          ("7b qkv", 80, 3584, 4608), ("7b o", 80, 3584, 3584), ("7b gate_up", 80, 3584, 37888),
          ("7b down", 80, 18944, 3584), ("7b head", 80, 3584, 152064),
          ("72b o", 40, 8192, 8192), ("72b gate_up", 40, 8192, 59136), ("72b down", 40, 29568, 8192)]


def graph_us(fn, calls: int, reps: int = 4, iters: int = 20) -> float:
    """Microseconds per call of ``fn`` (which makes ``calls`` calls), replayed from a CUDA graph, best of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end, best = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), float("inf")
    for _ in range(5):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (iters * reps * calls))
    return best


def kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:80] for e in prof.events() if e.device_type.name == "CUDA" and "Memset" not in e.name})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="save the rows as JSON (with command, GPU and versions)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device, default = torch.device("cuda"), torch.backends.cuda.preferred_blas_library()
    rows = []
    try:
        for name, m, k, n in SHAPES:
            copies = max(2, min(8, int(200e6 // (n * k * 2))))  # > L2 in all
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

            def fn():
                for w in weights:
                    F.linear(x, w)

            row = dict(shape=name, m=m, k=k, n=n)
            for library in ("cublas", "cublaslt", "cublas", "cublaslt"):  # twice, alternating: the best of both
                torch.backends.cuda.preferred_blas_library(library)
                us = min(graph_us(fn, copies), row[library]["us"] if library in row else float("inf"))
                row[library] = dict(us=us, kernels=kernels(lambda: F.linear(x, weights[0])))
            row["lt_speedup"] = row["cublas"]["us"] / row["cublaslt"]["us"]
            rows.append(row)
            print(f"{name:<14} M={m:<3} K={k:<6} N={n:<7} cublas {row['cublas']['us']:8.2f} us  "
                  f"cublaslt {row['cublaslt']['us']:8.2f} us  ({row['lt_speedup']:.2f}x)  "
                  f"{' + '.join(row['cublas']['kernels'])}  |  {' + '.join(row['cublaslt']['kernels'])}", flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    result = dict(command=" ".join([sys.executable.split("/")[-1], *sys.argv]), gpu=torch.cuda.get_device_name(),
                  versions=dict(python=platform.python_version(), torch=torch.__version__),
                  default_library=str(default), dtype="bfloat16", rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
