"""Every Triton kernel of the package launched as a programmatic dependent, compiled for sm_90 without a GPU.

Run as a script, without ``TRITON_INTERPRET`` (``tests/test_kernels.py`` does so in a subprocess). It forces
:func:`dustin_hf.kernels.triton_launch.dependent_launch` on (meta tensors are not on an sm_90 GPU), calls each
module's launcher on meta tensors at decode shapes (the 0.5B draft's norms, rotary + K/V write, SiLU-mul,
GEMMs and head argmax at 16 rows; a split-K GEMM; scoring, selection and verification at 32k), catches every
launch, compiles it for sm_90 and prints one JSON list: per launch, the kernel, its ``PDL`` constexpr and
``launch_pdl`` option, and where in the PTX the ``griddepcontrol`` instructions sit relative to the first
global memory access.

A kernel launched with ``launch_pdl`` may start while the kernel before it still runs: a load or store ahead of
its ``griddepcontrol.wait`` (one the compiler hoisted, or a kernel that forgot the wait) would race, and no CPU
test of values can see it. Exits 77 where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import contextlib
import json
import re

import torch

from kernel_ptx import H200_SMS, capture_launches, compile_sm90, patched, require_cuda_compiler, scoring_launches

_MEMORY_OP = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.global|prefetch\.)")


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def launches() -> list[tuple[object, dict, dict]]:
    from dustin_hf.kernels import triton_argmax, triton_cache, triton_fused, triton_gemm, triton_select, triton_verify

    batch, hidden, heads, kv_heads, head_dim, context, budget = 16, 896, 14, 2, 64, 32768, 512
    out = []

    def fused():
        x = _meta(batch, 1, hidden)
        triton_fused.rms_norm_triton(x, _meta(hidden), 1e-6)
        triton_fused.add_rms_norm_triton(x, x, _meta(hidden), 1e-6)
        q, k = _meta(batch, 1, heads, head_dim), _meta(batch, 1, kv_heads, head_dim)
        cos = _meta(batch, 1, head_dim)
        cache = _meta(batch, context + 8, kv_heads, head_dim)
        triton_fused.rotary_write_kv_triton(q, k, k, cos, cos, cache, cache, _meta(batch, 1, dtype=torch.int64), 0)
        triton_fused.apply_rotary_triton(q.transpose(1, 2), k.transpose(1, 2), cos, cos)
        triton_fused.silu_mul_triton(_meta(batch, 1, 2 * 4864))

    out += capture_launches(triton_fused, ("_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel"), fused)
    out += capture_launches(triton_cache, ("_write_kv_kernel",), lambda: triton_cache.write_kv_triton(
        _meta(batch, kv_heads, 5, head_dim), _meta(batch, kv_heads, 5, head_dim),
        _meta(batch, context + 8, kv_heads, head_dim), _meta(batch, context + 8, kv_heads, head_dim),
        _meta(batch, 5, dtype=torch.int64), 0))

    def gemm():
        triton_gemm.skinny_linear(_meta(batch, hidden), _meta(1152, hidden), _meta(1152))
        triton_gemm.skinny_linear(_meta(batch, 4864), _meta(hidden, 4864))  # split K: tickets and partials
        triton_gemm.gated_linear(_meta(batch, hidden), _meta(2 * 4864, hidden))

    with patched(triton_gemm, _smem_limit=lambda device: 232448, _sm_count=lambda device: H200_SMS):
        out += capture_launches(triton_gemm, ("_skinny_gemm_kernel",), gemm)

    with patched(triton_argmax, _sm_count=lambda device: H200_SMS):
        out += capture_launches(triton_argmax, ("_argmax_kernel",), lambda: (
            triton_argmax.argmax_triton(_meta(batch, 1, 151936)),  # split rows: partials and tickets
            triton_argmax.argmax_triton(_meta(batch, 1, 151936), splits=1)))

    out += scoring_launches()
    scores = _meta(batch, context, dtype=torch.float32)
    out += capture_launches(triton_select, ("_local_pools_kernel", "_merge_pools_kernel"), lambda: (
        triton_select.select_sparse_triton(scores, scores, _meta(batch, dtype=torch.int32), sink=4, recent=60,
                                           share=224, fill=224)))

    def verify():
        q = _meta(batch, 5, 28, 128)
        cache = _meta(batch, context + 5, 4, 128)
        seqlens, indices = _meta(batch, dtype=torch.int32), _meta(batch, budget, dtype=torch.int32)
        for sparse, merge in ((True, "ticket"), (False, "kernel")):
            n_keys = budget + 5 if sparse else context + 5
            config = triton_verify._config(batch, 4, 7, 5, 128, n_keys, H200_SMS, sparse=sparse, elem_bytes=2,
                                           num_splits=2, merge=merge)
            triton_verify._verify_attention_triton(
                q, cache, cache, seqlens, softmax_scale=128**-0.5, indices=indices if sparse else None,
                num_indices=seqlens if sparse else None, max_seqlen_k=None if sparse else context + 5, config=config)

    out += capture_launches(triton_verify, ("_verify_fwd_kernel", "_merge_splits_kernel"), verify)
    return out


def main() -> None:
    require_cuda_compiler()
    from dustin_hf.kernels import (triton_argmax, triton_cache, triton_fused, triton_gemm, triton_score, triton_select,
                                   triton_verify)

    with contextlib.ExitStack() as stack:
        for module in (triton_argmax, triton_cache, triton_fused, triton_gemm, triton_score, triton_select,
                       triton_verify):
            stack.enter_context(patched(module, dependent_launch=lambda t: True))
        caught = launches()
    report = []
    for kernel, args, options in caught:
        lines = compile_sm90(kernel, args, options).splitlines()

        def first(pattern: str) -> int | None:
            return next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)

        report.append(dict(
            kernel=kernel.fn.__name__, pdl=args.get("PDL"), launch_pdl=options.get("launch_pdl"),
            waits=sum("griddepcontrol.wait" in line for line in lines),
            launches=sum("griddepcontrol.launch_dependents" in line for line in lines),
            first_wait=first(r"griddepcontrol\.wait"), first_launch=first(r"griddepcontrol\.launch_dependents"),
            first_memory=first(_MEMORY_OP.pattern)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
