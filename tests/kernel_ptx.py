"""The scoring kernels' global-memory instructions, compiled for an H100/H200 (sm_90) without a GPU.

Run as a script, without ``TRITON_INTERPRET`` (``tests/test_score_kernel.py`` does so in a
subprocess): it calls :func:`attention_mass_triton` on meta tensors at the scoring shapes of
``benchmarks/select_timing.py`` (Qwen2.5-72B's target layer and the Qwen2.5-0.5B draft, batch 16,
32k positions), catches each kernel launch instead of running it, compiles it with the
specialisation Triton's JIT picks for those arguments (its own binder), and prints one JSON list:
per launch, the kernel, its tile sizes and a count of each global load/store/cp.async/atomic
instruction in the PTX. The launches are sized for an H200's 132 SMs (as many splits and pass 2
programs as there). Values cannot be checked this way, only how the memory is accessed, which no CPU test
of the values can see. Exits 77 where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import sys

import torch

SKIP = 77
H200_SMS = 132
_MEMORY_OP = re.compile(r"\b(ld\.global[\w.:]*|st\.global[\w.:]*|cp\.async\.c[ag][\w.:]*|atom\.[\w.:]*)")


def capture_launches(module, names: tuple[str, ...], run) -> list[tuple[object, dict, dict]]:
    """``(kernel, arguments by name, launch options)`` of every launch of ``module``'s kernels ``names``
    that ``run()`` makes; the launches are caught, not run."""
    launches = []

    class Catch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names = [p.name for p in self.kernel.params]
                options = {k: v for k, v in kwargs.items() if k not in names}
                launches.append((self.kernel, dict(zip(names, args)) | {k: kwargs[k] for k in names if k in kwargs},
                                 options))
            return launch

    with patched(module, **{name: Catch(getattr(module, name)) for name in names}):
        run()
    return launches


@contextlib.contextmanager
def patched(module, **values):
    """``module``'s attributes ``values`` set inside the block and restored after it (also on an exception)."""
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def require_cuda_compiler() -> None:
    """Exit with ``SKIP`` where this Triton has no NVIDIA backend to compile with."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        make_backend(GPUTarget("cuda", 90, 32))
    except Exception as error:
        print(f"cannot compile for CUDA here: {error}", file=sys.stderr)
        sys.exit(SKIP)


def compile_sm90(kernel, args: dict, options: dict) -> str:
    """PTX of ``kernel`` for sm_90, specialised on ``args`` as Triton's JIT would at launch."""
    return compile_for(kernel, args, options, 90).asm["ptx"]


def compile_for(kernel, args: dict, options: dict, capability: int):
    """``kernel`` compiled for compute capability ``capability`` (90: sm_90), specialised on ``args`` as Triton's
    JIT would at launch: the compiled kernel (``.asm``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, parsed = binder(**args, **options)
    parsed, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, parsed)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=parsed.__dict__)


def scoring_launches() -> list[tuple[object, dict, dict]]:
    """The launches of one step's target and draft scoring at select_timing.py's point, on meta tensors."""
    from dustin_hf import scoring
    from dustin_hf.kernels import triton_score

    batch, context, n_queries, dtype = 16, 32768, 5, torch.bfloat16

    def empty(*shape):
        return torch.empty(*shape, device="meta", dtype=dtype)

    seqlens = torch.full((batch,), context, dtype=torch.int32, device="meta")

    def run():
        scoring.target_history_scores(empty(batch, 8, 128), empty(batch, context + n_queries, 8, 128), seqlens,
                                      tuple(range(8)), 8, 128**-0.5, context, backend="triton")
        scoring.draft_lookahead_scores([empty(batch, n_queries - 1, 7, 64)] * 3,
                                       [empty(batch, context + n_queries, 2, 64)] * 3, seqlens,
                                       (tuple(range(7)),) * 3, 7, 64**-0.5, context, backend="triton")

    with patched(triton_score, _sm_count=lambda device: H200_SMS):  # meta tensors: size the launches as on the GPU
        return capture_launches(triton_score, ("_score_pass1_kernel", "_score_pass2_kernel"), run)


def main() -> None:
    require_cuda_compiler()
    report, seen = [], set()
    for kernel, args, options in scoring_launches():
        constexprs = {p.name: args[p.name] for p in kernel.params if p.is_constexpr}
        key = (kernel.fn.__name__, constexprs.get("HEAD_DIM"), constexprs["BLOCK_N"])
        if key in seen:  # the draft layers repeat one tile shape (pass 2 adds flags, not accesses)
            continue
        seen.add(key)
        ops = collections.Counter(_MEMORY_OP.findall(compile_sm90(kernel, args, options)))
        report.append(dict(kernel=kernel.fn.__name__, constexprs=constexprs, options=options, ops=dict(ops)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
