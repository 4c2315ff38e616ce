"""The draft's decode-step attention: launch configs of the sparse verification kernel at one query.

The 0.5B draft with the sparse draft on (``sparse_draft=True``) attends, in each of its 24 layers and each of its
four forwards a step, one query per row to the selected positions (budget 512) plus its new token: 16 rows x 2
KV heads of 64 at batch 16, 32 programs per split over 9 key tiles. Each config is timed as a CUDA-graph replay of
24 calls over 24 distinct caches (one per layer, so no call reads another's keys from L2), launched as the
package launches them (as programmatic dependents on sm_90). Prints one line per config and saves a JSON with
``--out``; ``{}`` is the heuristic of :func:`dustin_hf.kernels.triton_verify.launch_config`.

    python benchmarks/draft_attention.py --out benchmarks/results/draft_attention_h200_sweep_pdl.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from blas_choice import graph_us  # benchmarks/ is the script's directory
from e2e import _versions

CONFIGS = [{}, dict(num_splits=1), dict(num_splits=2), dict(num_splits=3), dict(num_splits=4), dict(num_splits=5),
           dict(num_splits=9), dict(num_splits=3, block_n=32), dict(num_splits=6, block_n=32),
           dict(num_splits=9, block_n=32), dict(num_splits=17, block_n=32), dict(num_splits=4, num_stages=3),
           dict(num_splits=9, num_stages=2), dict(num_splits=9, merge="kernel"), dict(num_splits=5, num_warps=2),
           dict(num_splits=9, num_warps=2)]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--out", help="save the rows as JSON (with command, GPU and versions)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from dustin_hf.kernels import triton_verify as tv

    b, hkv, group, d, layers = args.batch, 2, 7, 64, 24
    caches = [tuple(torch.randn(b, args.context + 8, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(layers)]
    q = torch.randn(b, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((b,), args.context, dtype=torch.int32, device="cuda")
    indices = torch.stack([torch.sort(torch.randperm(args.context, device="cuda")[:args.budget]).values
                           for _ in range(b)]).int()
    num = torch.full((b,), args.budget, dtype=torch.int32, device="cuda")
    n_keys = tv.sparse_loop_keys(args.budget, 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def attend(k, v, config=None):
        return tv.verify_attention_triton(q, k, v, seqlens, softmax_scale=d**-0.5, indices=indices, num_indices=num,
                                          config=config)

    reference = attend(*caches[0])
    rows = []
    for overrides in CONFIGS:
        config = tv.launch_config(b, hkv, group, 1, d, n_keys, sms, sparse=True, elem_bytes=2, **overrides)
        err = (attend(*caches[0], config).float() - reference.float()).abs().max().item()
        us = graph_us(lambda: [attend(k, v, config) for k, v in caches], layers, reps=2, iters=10)
        rows.append(dict(overrides=overrides, config=str(config), us=round(us, 2), max_err=err))
        print(f"{str(overrides):45s} {us:6.2f} us  err {err:.2e}  {config}", flush=True)
    if args.out:
        result = dict(command=" ".join(["python3", *sys.argv]), gpu=torch.cuda.get_device_name(0), versions=_versions(),
                      rows=rows)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
