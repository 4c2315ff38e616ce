"""Dense verification attention at a confirming step's widths: the launch heuristic against a sweep of launches.

Exact mode's confirming step verifies ``1 + confirm_tokens + gamma`` queries per row densely (9 at the defaults,
13 with confirm_tokens 8); with a group of 7 query heads per KV head more than 9 queries pack more than 64 rows
per program, a tile shape the decode-width sweeps never timed. Times every combination of block_m, num_warps,
block_n, num_stages and num_splits per width (CUDA-graph timer), K/V bytes read per ms as GB/s.

    python benchmarks/confirm_probe.py --out benchmarks/results/confirm_probe_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import sys
from pathlib import Path

import torch
import triton
import triton.testing

from dustin_hf.kernels import triton_verify
from dustin_hf.kernels._device import sm_count, smem_limit

LAYOUTS = {"qwen2.5-7b": (28, 4, 128), "qwen2.5-72b": (64, 8, 128)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--queries", type=int, nargs="+", default=(5, 9, 13))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for layout, nq in itertools.product(args.layouts, args.queries):
        hq, hkv, d = LAYOUTS[layout]
        cap = args.context + nq
        q = torch.randn(args.batch, nq, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(args.batch, cap, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seqlens = torch.full((args.batch,), args.context, device=dev, dtype=torch.int32)
        kv_bytes = 2 * args.batch * args.context * hkv * d * 2
        shape = (args.batch, hkv, hq // hkv, nq, d, cap, sm_count(dev))
        heuristic = triton_verify.launch_config(*shape, sparse=False, smem_limit=smem_limit(dev))
        variants = [("heuristic", heuristic)]
        for bm, warps, bn, stages, splits in itertools.product((64, 128), (4, 8), (32, 64), (2, 3), (4, 8)):
            if bm < heuristic.block_m // 2 or bm > heuristic.block_m:
                continue
            cfg = triton_verify.launch_config(*shape, sparse=False, block_n=bn, num_splits=splits, num_warps=warps,
                                              num_stages=stages)
            variants.append((f"bm{bm} w{warps} bn{bn} st{stages} sp{splits}", dataclasses.replace(cfg, block_m=bm)))
        best = None
        for name, cfg in variants:
            fn = lambda cfg=cfg: triton_verify._launch(q, k, v, seqlens, seqlens, seqlens, d ** -0.5, False, cfg)
            try:
                ms = triton.testing.do_bench_cudagraph(fn)
            except Exception as error:  # noqa: BLE001 - a launch that does not compile is reported, not fatal
                rows.append(dict(layout=layout, queries=nq, variant=name, error=repr(error)[:200]))
                continue
            row = dict(layout=layout, queries=nq, variant=name, ms=ms, gbps=kv_bytes / ms / 1e6,
                       config=dataclasses.asdict(cfg))
            rows.append(row)
            if name == "heuristic" or best is None or ms < best["ms"]:
                print(f"{layout} Q={nq:2d} {name:28s} {ms:7.3f} ms {kv_bytes / ms / 1e6:7.0f} GB/s", flush=True)
            if name != "heuristic" and (best is None or ms < best["ms"]):
                best = row
    result = dict(command=" ".join(["python", *sys.argv]), gpu=torch.cuda.get_device_name(),
                  versions=dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version()),
                  batch=args.batch, context=args.context, rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
