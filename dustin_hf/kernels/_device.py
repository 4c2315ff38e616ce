"""What the Triton launchers of :mod:`dustin_hf.kernels` share: the device's limits, buffers kept per device,
the device a launch runs on, and the interpreter fix of the CPU path.

Importing this module imports no Triton (the package runs without it, on its PyTorch reference path); the
functions that ask Triton something import it when called.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["launch_device", "prepare_interpreter", "sm_count", "smem_limit", "tickets", "workspace"]

_T = TypeVar("_T")


def launch_device(t: torch.Tensor):
    """Make ``t``'s CUDA device current around a Triton launch.

    Triton launches on the *current* device and stream, not on its arguments' device. In a model that
    accelerate split over GPUs the layers on ``cuda:1`` run while ``cuda:0`` is current: without this
    the kernel would run on ``cuda:0``'s stream, unordered with the ``cuda:1`` work that produced its
    inputs, reading ``cuda:1`` memory over the interconnect.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA, where the Triton interpreter runs)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def smem_limit(device: torch.device) -> int | None:
    """Shared memory one block of ``device`` may use, ``None`` off CUDA (no limit): the opt-in maximum Triton's
    driver reports, the number its launcher checks a compiled kernel against (``OutOfResources``). PyTorch's
    device properties only give the 48 KiB default."""
    if device.type != "cuda":
        return None
    return _cuda_smem_limit(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_smem_limit(index: int) -> int:
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


_TICKET_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}


def tickets(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 ticket counters on ``device``, zero between launches.

    Allocated zeroed on first use and never freed: a CUDA graph captured with a buffer keeps its
    address, and every launch leaves the counters it used at zero again. A larger request allocates a
    new buffer and keeps the old one alive for the graphs that hold it. One buffer per device (not per
    stream: a buffer first made inside a graph capture would put its zeroing into every replay), so
    two launches on one device must not run at the same time, which holds for launches on one stream
    and for graphs replayed one after another.
    """
    buffers = _TICKET_BUFFERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        buffers.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


_WORKSPACES: dict[tuple, object] = {}


def workspace(key: tuple, allocate: Callable[[], _T]) -> _T:
    """The buffers ``allocate()`` made the first time ``key`` (a launcher's name, the device, the launch shape)
    was asked for, reused by every later launch of that key.

    A launcher keeps partial results and zeroed ticket counters here that each of its launches returns to zero
    when it ends, so a graph captured with them stays valid. Two launches of one key must not run concurrently
    on different streams.
    """
    if key not in _WORKSPACES:
        _WORKSPACES[key] = allocate()
    return _WORKSPACES[key]


def prepare_interpreter() -> bool:
    """Whether the Triton interpreter runs the kernels (``TRITON_INTERPRET=1``, the CPU path); if it does, let it
    run loops with runtime bounds under numpy >= 2.4 (:func:`_patch_interpreter_for_numpy_2_4`)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreting:
        _patch_interpreter_for_numpy_2_4()
    return interpreting


@functools.cache
def _patch_interpreter_for_numpy_2_4() -> None:
    """Let the Triton interpreter run loops with runtime bounds under numpy >= 2.4.

    triton <= 3.6's interpreter turns a scalar into a Python int with ``int(array_of_shape_1)``, which
    numpy 2.4 rejects (triton-lang/triton#9171, fixed upstream by #9172). Wraps the interpreter's tensor
    patching so ``__index__`` squeezes first. Compiled (GPU) kernels are unaffected.
    """
    import numpy as np
    from triton.runtime import interpreter

    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4) or not hasattr(interpreter, "_patch_lang_tensor"):
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_dustin_squeezes", False):
        return  # patched by an earlier call: wrapping again would nest a wrapper per launch

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._dustin_squeezes = True
    interpreter._patch_lang_tensor = patch_lang_tensor
