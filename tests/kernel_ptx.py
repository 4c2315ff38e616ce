"""Triton kernels compiled for NVIDIA GPUs without one: a simulated GPU, its caught launches, their PTX.

:func:`launches_on` runs a call of the package on a :class:`SimulatedGpu`: inside it a tensor made on ``"cuda"``
is a meta tensor (shapes and strides, no memory) that reports itself on the simulated device, ``torch.cuda``
and Triton's driver answer with the simulated GPU's SM count, compute capability and per-block shared memory,
and every Triton launch is caught instead of run. So the package sizes and launches its kernels exactly as
it would on that GPU (the same heuristics, the same dependent-launch check), through its public calls, with
nothing of it patched; :func:`compile_for` then compiles a caught launch for the GPU's architecture with the
specialisation Triton's JIT would pick for those arguments.

Run as a script, without ``TRITON_INTERPRET`` (``tests/test_score_kernel.py`` does so in a subprocess): it
calls the scoring of one step at the attention headline point (Qwen2.5-72B's target layer and
the Qwen2.5-0.5B draft, batch 16, 32k positions) on a simulated H200 and prints one JSON list: per launch,
the kernel, its tile sizes and a count of each global load/store/cp.async/atomic instruction in the PTX.
Values cannot be checked this way, only how the memory is accessed, which no CPU test of the values can
see. Exits 77 where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

SKIP = 77
_MEMORY_OP = re.compile(r"\b(ld\.global[\w.:]*|st\.global[\w.:]*|cp\.async\.c[ag][\w.:]*|atom\.[\w.:]*)")


@dataclasses.dataclass(frozen=True)
class SimulatedGpu:
    """What the package asks of a CUDA device before a launch. Each simulated GPU takes its own device index:
    the package caches what it learns about a device by index."""

    name: str
    index: int
    capability: tuple[int, int]
    sm_count: int
    max_shared_mem: int  # opt-in shared memory per block, what Triton's launcher checks a kernel against


H200 = SimulatedGpu("H200", 0, (9, 0), 132, 232448)
A100 = SimulatedGpu("A100 (SM count of an H200)", 1, (8, 0), 132, 166912)
SM86 = SimulatedGpu("sm_86/89: RTX 30xx/40xx, A10, L4 (SM count of an H200)", 2, (8, 6), 132, 101376)


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: object  # the JITFunction
    args: dict  # arguments by name, tensors as meta tensors
    options: dict  # launch options (num_warps, num_stages, launch_pdl, ...)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def constexprs(self) -> dict:
        return {p.name: self.args[p.name] for p in self.kernel.params if p.is_constexpr}


class _OnGpu(torch.Tensor):
    """A meta tensor that reports itself on the simulated GPU (subclassed per GPU: ``_device``)."""

    _device = torch.device("cuda", 0)

    @property
    def device(self):
        return self._device

    @property
    def is_cuda(self):
        return True


class _MetaForCuda(TorchFunctionMode):
    """Every ``"cuda"`` device a torch call is given becomes ``"meta"``; meta results come back as ``tensor_type``."""

    def __init__(self, tensor_type: type):
        super().__init__()
        self.tensor_type = tensor_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:  # building a device object is not a placement
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():  # the op sees plain meta tensors and meta devices
            args, kwargs = pytree.tree_map(_meta_for_cuda, (args, kwargs))
            out = func(*args, **kwargs)
            return pytree.tree_map(
                lambda t: t.as_subclass(self.tensor_type) if type(t) is torch.Tensor and t.is_meta else t, out
            )


def _meta_for_cuda(x):
    if isinstance(x, _OnGpu):
        return x.as_subclass(torch.Tensor)
    if isinstance(x, torch.device) and x.type == "cuda" or isinstance(x, str) and x.startswith("cuda"):
        return torch.device("meta")
    return x


class _Driver:
    """Triton's active driver, as far as the package asks it (the device properties its launch sizing reads)."""

    def __init__(self, gpu: SimulatedGpu):
        self.utils = self
        self.gpu = gpu

    def get_device_properties(self, index: int) -> dict:
        return {"max_shared_mem": self.gpu.max_shared_mem, "multiprocessor_count": self.gpu.sm_count}


def launches_on(gpu: SimulatedGpu, run: Callable[[], object]) -> list[Launch]:
    """Every Triton launch ``run()`` makes on ``gpu``, caught instead of run (module docstring)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    caught = []

    def catch(kernel, *args, grid, warmup, **kwargs):
        names = [p.name for p in kernel.params]
        options = {k: v for k, v in kwargs.items() if k not in names}
        caught.append((kernel, dict(zip(names, args)) | {k: kwargs[k] for k in names if k in kwargs}, options))

    properties = type(
        "Properties",
        (),
        {
            "multi_processor_count": gpu.sm_count,
            "name": gpu.name,
            "major": gpu.capability[0],
            "minor": gpu.capability[1],
        },
    )()
    on_gpu = type(f"On{gpu.index}", (_OnGpu,), {"_device": torch.device("cuda", gpu.index)})
    previous = driver._active
    driver.set_active(_Driver(gpu))
    try:
        with (
            mock.patch.object(JITFunction, "run", catch),
            mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: properties),
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: gpu.capability),
            mock.patch.object(torch.cuda, "current_device", lambda: gpu.index),
            mock.patch.object(torch.cuda, "device", lambda device: contextlib.nullcontext()),
            _MetaForCuda(on_gpu),
        ):
            run()
    finally:
        driver.set_active(previous)
    return [Launch(kernel, {k: _plain(v) for k, v in args.items()}, options) for kernel, args, options in caught]


def _plain(value):
    return value.as_subclass(torch.Tensor) if isinstance(value, _OnGpu) else value


def require_cuda_compiler() -> None:
    """Exit with ``SKIP`` where this Triton has no NVIDIA backend to compile with."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        make_backend(GPUTarget("cuda", 90, 32))
    except Exception as error:
        print(f"cannot compile for CUDA here: {error}", file=sys.stderr)
        sys.exit(SKIP)


def compile_sm90(launch: Launch) -> str:
    """PTX of ``launch`` for sm_90."""
    return compile_for(launch, 90).asm["ptx"]


def compile_for(launch: Launch, capability: int):
    """``launch``'s kernel compiled for compute capability ``capability`` (90: sm_90), specialised on its arguments
    as Triton's JIT would at launch: the compiled kernel (``.asm``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, parsed = binder(**launch.args, **launch.options)
    parsed, signature, constexprs, attrs = kernel._pack_args(backend, launch.options, bound, specialization, parsed)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=parsed.__dict__)


def scoring_step(batch: int = 16, context: int = 32768, n_queries: int = 5) -> None:
    """One step's target and draft scoring at the headline point (tensors on ``"cuda"``)."""
    from dustin_hf.selection import scoring

    def empty(*shape):
        return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)

    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scoring.target_history_scores(
        empty(batch, 8, 128),
        empty(batch, context + n_queries, 8, 128),
        seqlens,
        tuple(range(8)),
        8,
        128**-0.5,
        context,
        backend="triton",
    )
    scoring.draft_lookahead_scores(
        [empty(batch, n_queries - 1, 7, 64)] * 3,
        [empty(batch, context + n_queries, 2, 64)] * 3,
        seqlens,
        (tuple(range(7)),) * 3,
        7,
        64**-0.5,
        context,
        backend="triton",
    )


def main() -> None:
    require_cuda_compiler()
    report, seen = [], set()
    for launch in launches_on(H200, scoring_step):
        constexprs = launch.constexprs
        key = (launch.name, constexprs.get("HEAD_DIM"), constexprs["BLOCK_N"])
        if key in seen:  # the draft layers repeat one tile shape (pass 2 adds flags, not accesses)
            continue
        seen.add(key)
        ops = collections.Counter(_MEMORY_OP.findall(compile_sm90(launch)))
        report.append(dict(kernel=launch.name, constexprs=constexprs, options=launch.options, ops=dict(ops)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
