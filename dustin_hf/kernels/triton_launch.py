"""Programmatic dependent launch (PDL) for the decode loop's Triton kernels.

Why: at decode sizes most kernels run for a few microseconds (a 0.5B draft's layer at 16 rows is about 9
launches), and between two kernels of a CUDA graph the GPU idles while the second one's blocks are
scheduled and start up, plus the ramp of its first loads: a real share of such a short kernel. On sm_90
and later a kernel launched with the *programmatic stream serialization* attribute may start before the
kernel it follows has finished, once every block of that one has signalled
``griddepcontrol.launch_dependents`` (or exited); it must then execute ``griddepcontrol.wait``, which
returns when the kernels before it have completed and their memory is visible, before it touches
memory they might write or read.

Every kernel of :mod:`dustin_hf.kernels` follows one rule so the overlap cannot race: with ``PDL`` its
first statement is :func:`await_producers` (wait, then let the next kernel launch), before any load or
store, so it sees exactly what a serialized launch would see, and its successors cannot start writing
before it started (they wait for it to complete). Kernels launched without the attribute (cuBLAS,
PyTorch's) serialize as always. Where the attribute is ignored (a copy before the kernel) nothing
changes either.

:func:`dependent_launch` decides per call what the GPU and Triton can do: sm_90+ CUDA tensors, not under
``TRITON_INTERPRET``, a Triton that has the launch attribute and ``griddepcontrol`` (3.4 and later). Everywhere
else every kernel launches serialized. Launch sites pass the answer twice: ``PDL=`` (the constexpr that
compiles the wait in) and ``launch_pdl=`` (Triton's launch attribute).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["await_producers", "dependent_launch"]

_TRITON_HAS_GDC = hasattr(tl.extra.cuda, "gdc_wait")  # Triton 3.4+: gdc_wait / gdc_launch_dependents, launch_pdl


@functools.cache
def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def dependent_launch(t: torch.Tensor) -> bool:
    """Whether a Triton kernel launched for ``t``'s device may start before the kernel it follows ends."""
    return (
        _TRITON_HAS_GDC
        and t.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and _capability_major(t.device) >= 9
    )


@triton.jit
def await_producers(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernels launched before this one have completed (their writes visible),
    then allow the next kernel to launch. Must come before the kernel's first load or store."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
