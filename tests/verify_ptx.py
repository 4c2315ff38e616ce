"""The verification attention kernel compiled for an H100/H200 (sm_90) without a GPU.

Run as a script, without ``TRITON_INTERPRET`` (``tests/test_kernels.py`` does so in a subprocess):
it calls the Triton verification kernel on a simulated H200 (``kernel_ptx.launches_on``) at the headline
point of ``benchmarks/attention.py`` (Qwen2.5-72B layout, batch 16, 512 selected positions + 5 new tokens,
bf16), once with the heuristic launch config and once with two splits merged in the kernel, compiles each
launch for sm_90 and prints one JSON list: per launch, its config and what its PTX says about

* ``max_wait_group``: the most ``cp.async`` groups the main loop leaves in flight while it computes
  a tile (3 groups per tile: K, V, the index load of a later tile);
* ``cp_async_16``: 16-byte ``cp.async`` copies (the K/V gathers), ``local``: spill loads/stores;
* ``release_order``/``acquire_order``: whether a ``bar.sync`` lies between the partial stores and the
  ticket ``atom``, and between the ``atom`` and the merge's loads.

Values cannot be checked this way, only the schedule, which no CPU test of the values can see.
Exits 77 where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json
import re

import torch
from kernel_ptx import H200, Launch, compile_sm90, launches_on, require_cuda_compiler

BATCH, N_KV_HEADS, GROUP, N_QUERIES, HEAD_DIM, BUDGET = 16, 8, 8, 5, 128, 512


def verify_launches() -> list[tuple[str, Launch]]:
    """``(label, launch)`` of the main kernel at the headline point on a simulated H200: the heuristic's launch,
    and two splits merged in the kernel."""
    from dustin_hf.kernels import triton_verify

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="cuda", dtype=dtype)

    ticket = triton_verify.launch_config(
        BATCH,
        N_KV_HEADS,
        GROUP,
        N_QUERIES,
        HEAD_DIM,
        BUDGET,
        H200.sm_count,
        sparse=True,
        elem_bytes=2,
        num_splits=2,
        num_stages=5,
        merge="ticket",
    )

    def run():
        q = empty(BATCH, N_QUERIES, N_KV_HEADS * GROUP, HEAD_DIM)
        cache = empty(BATCH, 32768 + N_QUERIES, N_KV_HEADS, HEAD_DIM)
        seqlens = empty(BATCH, dtype=torch.int32)
        indices = empty(BATCH, BUDGET, dtype=torch.int32)
        kwargs = dict(softmax_scale=HEAD_DIM**-0.5, indices=indices, num_indices=seqlens)
        triton_verify.verify_attention_triton(q, cache, cache, seqlens, **kwargs)
        triton_verify.verify_attention_triton(q, cache, cache, seqlens, **kwargs, config=ticket)

    launches = launches_on(H200, run)
    return list(zip(("heuristic", "ticket"), launches, strict=True))


def _ordered(ptx: str, before: str, middle: str, after: str) -> bool | None:
    """Whether a ``middle`` instruction lies between the last ``before`` preceding the first ``after``
    and that ``after``; ``None`` if there is no ``after``."""
    end = ptx.find(after)
    if end < 0:
        return None
    head = ptx[:end]
    return head.rfind(middle) > head.rfind(before) >= 0


def summary(ptx: str) -> dict:
    atom = "atom.global.gpu.acq_rel"
    tail = ptx[ptx.find(atom) :] if atom in ptx else ""
    return dict(
        max_wait_group=max(int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)),
        cp_async_16=len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (?:16|0x10)\b", ptx)),
        local=len(re.findall(r"\b(?:ld|st)\.local", ptx)),
        release_order=_ordered(ptx, "st.global", "bar.sync", atom),
        acquire_order=_ordered(tail, atom, "bar.sync", "ld.global.cg") if tail else None,
    )


def main() -> None:
    require_cuda_compiler()
    report = []
    for label, launch in verify_launches():
        report.append(
            dict(label=label, constexprs=launch.constexprs, options=launch.options, **summary(compile_sm90(launch)))
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
