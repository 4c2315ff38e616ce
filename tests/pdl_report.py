"""Every Triton kernel of the package launched as a programmatic dependent, compiled for sm_90 without a GPU.

Run as a script, without ``TRITON_INTERPRET`` (``tests/test_kernels.py`` does so in a subprocess). It calls each
module's launcher on a simulated H200 (``kernel_ptx.launches_on``: the package's own dependent-launch check
turns them on there) at decode shapes (the 0.5B draft's norms, rotary + K/V write, SiLU-mul, GEMMs and head
argmax at 16 rows; a split-K GEMM; scoring, selection and verification at 32k), catches every launch, compiles
it for sm_90 and prints one JSON list: per launch, the kernel, its ``PDL`` constexpr and ``launch_pdl`` option,
and where in the PTX the ``griddepcontrol`` instructions sit relative to the first global memory access.

A kernel launched with ``launch_pdl`` may start while the kernel before it still runs: a load or store ahead of
its ``griddepcontrol.wait`` (one the compiler hoisted, or a kernel that forgot the wait) would race, and no CPU
test of values can see it. Exits 77 where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json
import re

import torch
from kernel_ptx import H200, compile_sm90, launches_on, require_cuda_compiler, scoring_step

_MEMORY_OP = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.global|prefetch\.)")


def _empty(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="cuda", dtype=dtype)


def decode_step() -> None:
    """One launch of every kernel at decode shapes, tensors on ``"cuda"``."""
    from dustin_hf.kernels import triton_argmax, triton_cache, triton_fused, triton_gemm, triton_select, triton_verify

    batch, hidden, heads, kv_heads, head_dim, context, budget = 16, 896, 14, 2, 64, 32768, 512
    x = _empty(batch, 1, hidden)
    triton_fused.rms_norm_triton(x, _empty(hidden), 1e-6)
    triton_fused.add_rms_norm_triton(x, x, _empty(hidden), 1e-6)
    q, k = _empty(batch, 1, heads, head_dim), _empty(batch, 1, kv_heads, head_dim)
    cos = _empty(batch, 1, head_dim)
    cache = _empty(batch, context + 8, kv_heads, head_dim)
    triton_fused.rotary_write_kv_triton(q, k, k, cos, cos, cache, cache, _empty(batch, 1, dtype=torch.int64), 0)
    triton_fused.apply_rotary_triton(q.transpose(1, 2), k.transpose(1, 2), cos, cos)
    triton_fused.silu_mul_triton(_empty(batch, 1, 2 * 4864))
    triton_cache.write_kv_triton(
        _empty(batch, kv_heads, 5, head_dim),
        _empty(batch, kv_heads, 5, head_dim),
        cache,
        cache,
        _empty(batch, 5, dtype=torch.int64),
        0,
    )

    triton_gemm.skinny_linear(_empty(batch, hidden), _empty(1152, hidden), _empty(1152))
    triton_gemm.skinny_linear(_empty(batch, 4864), _empty(hidden, 4864))  # split K: tickets and partials
    triton_gemm.gated_linear(_empty(batch, hidden), _empty(2 * 4864, hidden))
    triton_argmax.argmax_triton(_empty(batch, 1, 151936))  # split rows: partials and tickets
    triton_argmax.argmax_triton(_empty(batch, 1, 151936), splits=1)

    scoring_step()
    scores = _empty(batch, context, dtype=torch.float32)
    triton_select.select_sparse_triton(
        scores, scores, _empty(batch, dtype=torch.int32), sink=4, recent=60, share=224, fill=224
    )

    q = _empty(batch, 5, 28, 128)
    cache = _empty(batch, context + 5, 4, 128)
    seqlens, indices = _empty(batch, dtype=torch.int32), _empty(batch, budget, dtype=torch.int32)
    for sparse, merge in ((True, "ticket"), (False, "kernel")):
        n_keys = budget if sparse else context + 5
        config = triton_verify.launch_config(
            batch, 4, 7, 5, 128, n_keys, H200.sm_count, sparse=sparse, elem_bytes=2, num_splits=2, merge=merge
        )
        triton_verify.verify_attention_triton(
            q,
            cache,
            cache,
            seqlens,
            softmax_scale=128**-0.5,
            indices=indices if sparse else None,
            num_indices=seqlens if sparse else None,
            max_seqlen_k=None if sparse else context + 5,
            config=config,
        )


def main() -> None:
    require_cuda_compiler()
    report = []
    for launch in launches_on(H200, decode_step):
        lines = compile_sm90(launch).splitlines()

        def first(pattern: str) -> int | None:
            return next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)

        report.append(
            dict(
                kernel=launch.name,
                pdl=launch.args.get("PDL"),
                launch_pdl=launch.options.get("launch_pdl"),
                waits=sum("griddepcontrol.wait" in line for line in lines),
                launches=sum("griddepcontrol.launch_dependents" in line for line in lines),
                first_wait=first(r"griddepcontrol\.wait"),
                first_launch=first(r"griddepcontrol\.launch_dependents"),
                first_memory=first(_MEMORY_OP.pattern),
            )
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
