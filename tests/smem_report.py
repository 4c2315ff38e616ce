"""Shared memory of the verification kernel and the decode GEMMs, compiled for an A100 (sm_80) and an
sm_86/89 GPU (RTX 30xx/40xx, A10, L4) without a GPU.

Run as a script, without ``TRITON_INTERPRET`` (``tests/test_kernels.py`` does so in a subprocess). For each
point of a grid it calls the public launcher on that GPU simulated (``kernel_ptx.launches_on``: the launcher
asks the device for its per-block limit and fits the heuristic's launch to it), catches the launch, compiles
it for the GPU's architecture and reports the shared memory the compiled kernel declares beside the module's
own estimate (``_shared_bytes``) and the limit, as one JSON list:

* verification (``kernel: "verify"``): bf16 and fp32, head dim 64 and 128, one and five queries of a
  7-query-head group, sparse, dense, and dense writing a selection layer's scores;
* decode GEMMs (``"skinny"``, ``"gated"``): ``skinny_linear`` at 16, 32, 80 and 128 rows (the 7B's q/k/v
  shape) and ``gated_linear`` at 16 and 32 rows (the 0.5B draft's gate/up), bf16 and fp32.

A kernel over the limit fails to launch there (``OutOfResources``), which no CPU test of values can see.
Exits 77 where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import itertools
import json

import torch
from kernel_ptx import A100, SM86, compile_for, launches_on, require_cuda_compiler

GPUS = {80: A100, 86: SM86}
BATCH, N_KV_HEADS, GROUP, BUDGET, CONTEXT = 4, 2, 7, 512, 4096


def main() -> None:
    require_cuda_compiler()
    report, compiled = [], {}

    def shared(cc, launch) -> int:
        key = (
            cc,
            launch.name,
            repr(sorted((k, v) for k, v in launch.args.items() if not isinstance(v, torch.Tensor))),
            repr(launch.options),
        )
        if key not in compiled:
            compiled[key] = compile_for(launch, cc).metadata.shared
        return compiled[key]

    report += _verify_report(shared)
    report += _gemm_report(shared)
    print(json.dumps(report))


def _verify_report(shared) -> list[dict]:
    from dustin_hf.kernels import triton_verify

    rows = []
    for cc, dtype, head_dim, n_queries, (sparse, scores) in itertools.product(
        GPUS, (torch.bfloat16, torch.float32), (64, 128), (1, 5), ((True, False), (False, False), (False, True))
    ):

        def run():
            q = torch.empty(BATCH, n_queries, N_KV_HEADS * GROUP, head_dim, device="cuda", dtype=dtype)
            cache = torch.empty(BATCH, CONTEXT + n_queries, N_KV_HEADS, head_dim, device="cuda", dtype=dtype)
            seqlens = torch.empty(BATCH, device="cuda", dtype=torch.int32)
            if scores:  # a selection layer's dense call, writing the scores too
                triton_verify.verify_attention_scores_triton(
                    q,
                    cache,
                    cache,
                    seqlens,
                    softmax_scale=head_dim**-0.5,
                    max_seqlen_k=CONTEXT + n_queries,
                    span=CONTEXT,
                    query_counts=seqlens,
                )
                return
            indices = torch.empty(BATCH, BUDGET, device="cuda", dtype=torch.int32) if sparse else None
            triton_verify.verify_attention_triton(
                q,
                cache,
                cache,
                seqlens,
                softmax_scale=head_dim**-0.5,
                indices=indices,
                num_indices=seqlens if sparse else None,
                max_seqlen_k=None if sparse else CONTEXT + n_queries,
            )

        launch = launches_on(GPUS[cc], run)[0]  # the main kernel (a merge launch, if any, comes after it)
        block_m, block_n, block_d = (launch.args[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_D"))
        num_stages = launch.options["num_stages"]
        rows.append(
            dict(
                kernel="verify",
                cc=cc,
                dtype=str(dtype).removeprefix("torch."),
                head_dim=head_dim,
                n_queries=n_queries,
                sparse=sparse,
                scores=scores,
                block_m=block_m,
                block_n=block_n,
                num_stages=num_stages,
                shared=shared(cc, launch),
                estimate=triton_verify._shared_bytes(block_m, block_n, block_d, dtype.itemsize, num_stages, sparse),
                limit=GPUS[cc].max_shared_mem,
            )
        )
    return rows


def _gemm_report(shared) -> list[dict]:
    from dustin_hf.kernels import triton_gemm

    rows = []
    for cc, dtype in itertools.product(GPUS, (torch.bfloat16, torch.float32)):

        def empty(*shape):
            return torch.empty(*shape, device="cuda", dtype=dtype)

        def run():
            for m in (16, 32, 80, 128):
                triton_gemm.skinny_linear(empty(m, 3584), empty(4608, 3584))
            for m in (16, 32):
                triton_gemm.gated_linear(empty(m, 896), empty(9728, 896))

        for launch in launches_on(GPUS[cc], run):
            args, gated = launch.args, launch.args["GATED"]
            rows.append(
                dict(
                    kernel="gated" if gated else "skinny",
                    cc=cc,
                    dtype=str(dtype).removeprefix("torch."),
                    m=args["M"],
                    block_m=args["BLOCK_M"],
                    block_n=args["BLOCK_N"],
                    block_k=args["BLOCK_K"],
                    num_stages=launch.options["num_stages"],
                    shared=shared(cc, launch),
                    estimate=triton_gemm._shared_bytes(
                        args["BLOCK_M"],
                        args["BLOCK_N"],
                        args["BLOCK_K"],
                        dtype.itemsize,
                        launch.options["num_stages"],
                        gated,
                    ),
                    limit=GPUS[cc].max_shared_mem,
                )
            )
    return rows


if __name__ == "__main__":
    main()
