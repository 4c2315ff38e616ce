"""Shared memory of the verification kernel and the decode GEMMs, compiled for an A100 (sm_80) and an
sm_86/89 GPU (RTX 30xx/40xx, A10, L4) without a GPU.

Run as a script, without ``TRITON_INTERPRET`` (``tests/test_kernels.py`` does so in a subprocess). For each
point of a grid it builds the heuristic launch under that GPU's per-block limit, catches the launch on meta
tensors, compiles it for the GPU's architecture and reports the shared memory the compiled kernel declares
beside the module's own estimate (``_shared_bytes``) and the limit, as one JSON list:

* verification (``kernel: "verify"``): bf16 and fp32, head dim 64 and 128, one and five queries of a
  7-query-head group, sparse and dense (``triton_verify._config(smem_limit=...)``);
* decode GEMMs (``"skinny"``, ``"gated"``): ``skinny_linear`` at 16, 32, 80 and 128 rows (the 7B's q/k/v
  shape) and ``gated_linear`` at 16 and 32 rows (the 0.5B draft's gate/up), bf16 and fp32, with the device
  limit the launch asks for (``triton_gemm._smem_limit``) set to the GPU's.

A kernel over the limit fails to launch there (``OutOfResources``), which no CPU test of values can see.
Exits 77 where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import itertools
import json

import torch

from kernel_ptx import capture_launches, compile_for, patched, require_cuda_compiler

LIMITS = {80: 166912, 86: 101376}  # opt-in shared memory per block: A100; sm_86/sm_89 (RTX 30xx/40xx, A10, L4)
BATCH, N_KV_HEADS, GROUP, BUDGET, CONTEXT = 4, 2, 7, 512, 4096


def main() -> None:
    require_cuda_compiler()
    from dustin_hf.kernels import triton_verify

    report, compiled = [], {}

    def shared(cc, kernel, args, options) -> int:
        key = (cc, kernel.fn.__name__, repr(sorted((k, v) for k, v in args.items() if not isinstance(v, torch.Tensor))),
               repr(options))
        if key not in compiled:
            compiled[key] = compile_for(kernel, args, options, cc).metadata.shared
        return compiled[key]

    for cc, dtype, head_dim, n_queries, sparse in itertools.product(
            LIMITS, (torch.bfloat16, torch.float32), (64, 128), (1, 5), (True, False)):
        q = torch.empty(BATCH, n_queries, N_KV_HEADS * GROUP, head_dim, device="meta", dtype=dtype)
        cache = torch.empty(BATCH, CONTEXT + n_queries, N_KV_HEADS, head_dim, device="meta", dtype=dtype)
        seqlens = torch.empty(BATCH, device="meta", dtype=torch.int32)
        indices = torch.empty(BATCH, BUDGET, device="meta", dtype=torch.int32) if sparse else None
        n_keys = triton_verify._sparse_loop_keys(BUDGET, n_queries) if sparse else CONTEXT + n_queries
        config = triton_verify._config(BATCH, N_KV_HEADS, GROUP, n_queries, head_dim, n_keys, 132, sparse=sparse,
                                       elem_bytes=q.element_size(), smem_limit=LIMITS[cc])

        def run():
            triton_verify._verify_attention_triton(
                q, cache, cache, seqlens, softmax_scale=head_dim**-0.5, indices=indices,
                num_indices=seqlens if sparse else None, max_seqlen_k=None if sparse else CONTEXT + n_queries,
                config=config)

        launches = capture_launches(triton_verify, ("_verify_fwd_kernel", "_merge_splits_kernel"), run)
        kernel, args, options = launches[0]  # the main kernel (a merge launch, if any, comes after it)
        report.append(dict(
            kernel="verify", cc=cc, dtype=str(dtype).removeprefix("torch."), head_dim=head_dim, n_queries=n_queries,
            sparse=sparse, block_m=config.block_m, block_n=config.block_n, num_stages=config.num_stages,
            shared=shared(cc, kernel, args, options),
            estimate=triton_verify._shared_bytes(config.block_m, config.block_n, config.block_d, q.element_size(),
                                                 config.num_stages, sparse),
            limit=LIMITS[cc]))
    report += _gemm_report(shared)
    print(json.dumps(report))


def _gemm_report(shared) -> list[dict]:
    from dustin_hf.kernels import triton_gemm

    rows = []
    for cc, dtype in itertools.product(LIMITS, (torch.bfloat16, torch.float32)):
        def empty(*shape):
            return torch.empty(*shape, device="meta", dtype=dtype)

        def run():
            for m in (16, 32, 80, 128):
                triton_gemm.skinny_linear(empty(m, 3584), empty(4608, 3584))
            for m in (16, 32):
                triton_gemm.gated_linear(empty(m, 896), empty(9728, 896))

        with patched(triton_gemm, _smem_limit=lambda device: LIMITS[cc], _sm_count=lambda device: 132):
            launches = capture_launches(triton_gemm, ("_skinny_gemm_kernel",), run)
        for kernel, args, options in launches:
            gated = args["GATED"]
            rows.append(dict(
                kernel="gated" if gated else "skinny", cc=cc, dtype=str(dtype).removeprefix("torch."), m=args["M"],
                block_m=args["BLOCK_M"], block_n=args["BLOCK_N"], block_k=args["BLOCK_K"],
                num_stages=options["num_stages"], shared=shared(cc, kernel, args, options),
                estimate=triton_gemm._shared_bytes(args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"],
                                                   dtype.itemsize, options["num_stages"], gated),
                limit=LIMITS[cc]))
    return rows


if __name__ == "__main__":
    main()
