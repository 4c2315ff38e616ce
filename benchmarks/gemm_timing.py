"""Decode-sized GEMMs: cuBLAS (``F.linear``) against :func:`dustin_hf.kernels.triton_gemm.skinny_linear`;
``*_silu`` shapes: cuBLAS + ``silu_mul`` (two launches) against :func:`~dustin_hf.kernels.triton_gemm.gated_linear`.

The shapes are a Qwen2.5-0.5B draft layer's projections at batch 16, one token per row (q/k/v fused,
o_proj, gate/up fused, down) and its head, the Qwen2.5-7B target's at 16 rows x 5 verified tokens
(``7b_*``) and the 72B target's at 8 rows x 5 (``72b_*``). Each call is timed as a CUDA-graph replay of
about ``--reps`` back-to-back calls (how the decode loop runs them; the timer of ``blas_choice.py``), so
launch cost inside a graph is included and Python's is not; the calls rotate among copies of the weight
filling twice the L2, so each reads its weight from HBM as a decode step does. ``--sweep`` times the
kernel's launch configurations too (``key=v1,v2 ...``, keys: block_n, block_k, split_k, num_warps,
num_stages; ``;`` between specs).
Prints a table and one JSON line; ``--out`` saves it.

    python benchmarks/gemm_timing.py --out benchmarks/results/gemm_h200.json
    python benchmarks/gemm_timing.py --sweep "split_k=1,2,4,8 block_n=32,64,128"
    python benchmarks/gemm_timing.py --smoke      # CPU, Triton interpreter, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

import attention  # benchmarks/ is the script's directory
from blas_choice import graph_us

# name: (M, N, K, bias) of the 0.5B draft (hidden 896, intermediate 4864, 14 q / 2 kv heads of 64, vocab 151936)
SHAPES = {
    "qkv": (16, 1152, 896, True),
    "o_proj": (16, 896, 896, False),
    "gate_up": (16, 9728, 896, False),
    "down": (16, 896, 4864, False),
    "lm_head": (16, 151936, 896, False),
    # the 7B target's verification projections: 16 rows x 5 queries (hidden 3584, intermediate 18944, 28 q / 4 kv)
    "7b_qkv": (80, 4608, 3584, True),
    "7b_o_proj": (80, 3584, 3584, False),
    "7b_gate_up": (80, 37888, 3584, False),
    "7b_down": (80, 3584, 18944, False),
    # the 72B target's: 8 rows x 5 queries (hidden 8192, intermediate 29568, 64 q / 8 kv heads of 128)
    "72b_qkv": (40, 10240, 8192, True),
    "72b_o_proj": (40, 8192, 8192, False),
    "72b_gate_up": (40, 59136, 8192, False),
    "72b_down": (40, 8192, 29568, False),
    "72b_gate_up_silu": (40, 29568, 8192, False, "gated"),
    "7b_gate_up_silu": (80, 18944, 3584, False, "gated"),
    # gated: N output columns from a [gate; up] weight of 2N rows
    "gate_up_silu": (16, 4864, 896, False, "gated"),
    "gate_up_silu_32": (32, 4864, 896, False, "gated"),
}
L2_BYTES = 60 * 2**20  # H200: calls rotate among enough weight copies that each reads its weight from HBM
SMOKE_SHAPES = {"qkv": (3, 40, 48, True), "down": (5, 24, 200, False), "gate_up_silu": (4, 24, 40, False, "gated")}


SWEEP_KEYS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")  # keywords of triton_gemm.launch_config


def parse_sweep(spec: str) -> list[dict]:
    """``"split_k=1,2 block_n=64,128"`` (``;`` separates specs, 0 or auto is the heuristic's value; the syntax
    of ``attention.py --sweep``) -> every combination of each spec as keyword overrides."""
    return [dict(zip(keys, combo)) for keys in attention.parse_sweep(spec, SWEEP_KEYS)
            for combo in itertools.product(*keys.values())]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--reps", type=int, default=50,
                        help="calls per timed graph (whole rotations over the weight copies, at least one)")
    parser.add_argument("--sweep", default="", help="kernel launch configurations to time as well")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=None, help="every shape with this many rows (M) instead")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    from dustin_hf.kernels.triton_gemm import gated_linear, launch_config, skinny_linear
    from dustin_hf.runtime.fused import silu_mul

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --smoke)")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in args.shapes}
    sweep = parse_sweep(args.sweep) if args.sweep else []
    rows = []
    for name, (m, n, k, has_bias, *kind) in shapes.items():
        m = args.rows or m
        gated = kind == ["gated"]
        rows_w = 2 * n if gated else n
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=dtype)
        copies = 1 if args.smoke else -(-2 * L2_BYTES // (rows_w * k * x.element_size()))
        weights = [torch.randn(rows_w, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
        b = torch.randn(n, device=device, dtype=dtype) if has_bias else None

        def timed_us(call) -> float:  # one call per weight copy, so each reads its weight from HBM
            def rotation():
                for w in weights:
                    call(w)
            return graph_us(rotation, copies, reps=max(1, args.reps // copies))

        def baseline(w):
            out = torch.nn.functional.linear(x, w, b)
            return silu_mul(out) if gated else out

        def kernel(w, **overrides):
            return gated_linear(x, w, **overrides) if gated else skinny_linear(x, w, b, **overrides)

        ref = baseline(weights[0])
        cfg = launch_config(m, n, k, attention.sm_count(device), x.element_size(), gated=gated)
        row = {"shape": name, "m": m, "n": n, "k": k, "bias": has_bias, "gated": gated,
               "weight_mb": rows_w * k * x.element_size() / 1e6,
               "heuristic": f"n{cfg.block_n}/k{cfg.block_k}/s{cfg.split_k}/w{cfg.num_warps}/st{cfg.num_stages}"}
        out = kernel(weights[0])
        row["max_err"] = (out.float() - ref.float()).abs().max().item()
        if device.type == "cuda":
            row["cublas_us"] = timed_us(baseline)
            row["triton_us"] = timed_us(kernel)
            row["cublas_tbps"] = row["weight_mb"] / row["cublas_us"]  # MB per us is TB/s
            row["triton_tbps"] = row["weight_mb"] / row["triton_us"]
            tried = []
            for overrides in sweep:
                try:
                    us = timed_us(functools.partial(kernel, **overrides))
                except Exception as error:  # an invalid combination (shared memory, block sizes) is reported
                    tried.append({"overrides": overrides, "error": f"{type(error).__name__}: {str(error)[:80]}"})
                    continue
                tried.append({"overrides": overrides, "us": us})
            if tried:
                row["sweep"] = tried
                timed = [t for t in tried if "us" in t]
                if timed:
                    row["best"] = min(timed, key=lambda t: t["us"])
        rows.append(row)
        best = f"  best {row['best']['us']:.2f} us {row['best']['overrides']}" if "best" in row else ""
        timing = (f"cuBLAS {row['cublas_us']:6.2f} us  Triton {row['triton_us']:6.2f} us ({row['heuristic']})"
                  if "cublas_us" in row else "(not timed)")
        print(f"{name:<15} {m}x{n}x{k}  {row['weight_mb']:7.2f} MB  {timing}  err {row['max_err']:.2e}{best}")
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "rows": rows,
              "dtype": str(dtype), "reps": args.reps}
    if device.type == "cuda":
        import transformers

        result["gpu"] = torch.cuda.get_device_name(device)
        result["versions"] = {"torch": torch.__version__, "triton": triton.__version__,
                              "transformers": transformers.__version__}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
