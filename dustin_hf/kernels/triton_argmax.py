"""``torch.argmax(x, dim=-1)`` over long rows (a model head's logits) in one Triton launch.

Why: greedy decoding takes the argmax of every head output. PyTorch's reduction over a 152k vocabulary
takes several times the memory time of the few MB it reads (the draft's 16 rows, a 7B target's 80). Here
each row is cut into chunks of whole tiles, one program each, so the grid gives every SM about
``ArgmaxTuning.programs_per_sm`` programs; and the launch can start as a programmatic dependent of the
kernel before it, as the package's other kernels do.

Algorithm: program ``(row, s)`` scans its chunk in ``BLOCK``-wide tiles, keeping the largest value and its
first index (a later tile replaces it only when strictly greater), stores that partial and takes a ticket
(an atomic counter per row); the last program of the row takes the largest partial and, among equal ones,
the earliest index (so the result does not depend on which program finished last), writes it and resets
the counter for the next launch (CUDA-graph replay safe). Values are compared as int32 keys that order as
``torch.argmax`` compares: -0.0 equals +0.0 and a NaN is larger than anything (so its first index wins);
ties go to the lowest index; a row of ``-inf`` gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import launch_device, prepare_interpreter, sm_count, workspace
from .triton_launch import await_producers, dependent_launch
from .tuning import ArgmaxTuning

__all__ = ["argmax_triton"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _order_key(x):
    """fp32 ``x`` as an int32 that orders as ``torch.argmax`` compares: -0.0 and +0.0 equal, every NaN above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives: larger magnitude, smaller key
    key = tl.where(x == 0.0, 0, key)  # -0.0 is +0.0
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _argmax_kernel(
    X,
    OUT,
    PART_K,
    PART_I,
    TICKETS,
    n_cols,
    stride_row,
    chunk,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    await_producers(PDL)
    row = tl.program_id(0)
    s = tl.program_id(1)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, n_cols)
    x_row = X + row.to(tl.int64) * stride_row
    best = tl.full((), -2147483648, tl.int32)  # below every key: the first tile's maximum replaces it
    best_i = lo
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < hi, other=-float("inf")).to(tl.float32)
        top, at = tl.max(_order_key(x), axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = top > best  # strictly greater: ties keep the earlier index
        best_i = tl.where(take, start + at, best_i)
        best = tl.where(take, top, best)
    if SPLITS == 1:
        tl.store(OUT + row, best_i.to(tl.int64))
    else:
        tl.store(PART_K + row * SPLITS + s, best)
        tl.store(PART_I + row * SPLITS + s, best_i)
        # release the partial before the ticket; the last arrival acquires every other split's partial
        ticket = tl.atomic_add(TICKETS + row, 1, sem="acq_rel")
        if ticket == SPLITS - 1:
            t = tl.arange(0, SPLITS_P2)
            keys = tl.load(PART_K + row * SPLITS + t, mask=t < SPLITS, other=-2147483648, cache_modifier=".cg")
            index = tl.load(PART_I + row * SPLITS + t, mask=t < SPLITS, other=n_cols, cache_modifier=".cg")
            top = tl.max(keys, axis=0)
            tl.store(OUT + row, tl.min(tl.where(keys == top, index, n_cols)).to(tl.int64))  # earliest of the ties
            tl.atomic_xchg(TICKETS + row, 0)  # ready for the next launch (graph replays reuse the counters)


def _workspace(device: torch.device, rows: int, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial keys and indices and zeroed tickets of a launch shape
    (:func:`~dustin_hf.kernels._device.workspace`)."""
    return workspace(
        ("argmax", device, rows, splits),
        lambda: (
            torch.empty(rows * splits, dtype=torch.int32, device=device),
            torch.empty(rows * splits, dtype=torch.int32, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device),
        ),
    )


def _splits(rows: int, n_cols: int, sm_count: int, tuning: ArgmaxTuning) -> int:
    """Chunks per row: about ``tuning.programs_per_sm`` programs per SM, each at least one tile long."""
    return max(1, min(triton.cdiv(n_cols, tuning.block), triton.cdiv(tuning.programs_per_sm * sm_count, rows)))


def argmax_triton(x: torch.Tensor, *, splits: int | None = None, tuning: ArgmaxTuning | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64, shape ``x.shape[:-1]``) for fp16/bf16/fp32 ``x`` with a last dimension below
    2**31; the same index as PyTorch's for every input (ties: the first; NaN: the first NaN). ``splits``: chunks
    per row (default: enough to fill the GPU); ``tuning``: the tile and the split's aim (``None``: the defaults)."""
    tuning = tuning or ArgmaxTuning()
    if x.dtype not in _DTYPES:
        raise ValueError(f"argmax_triton takes fp16, bf16 or fp32; got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"argmax_triton needs a non-empty last dimension; got shape {tuple(x.shape)}")
    n_cols = x.shape[-1]
    if n_cols >= 2**31:
        raise ValueError(f"argmax_triton indexes with int32: the last dimension must be below 2**31, got {n_cols}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, n_cols)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    prepare_interpreter()
    if rows.shape[0]:
        if splits is None:
            splits = _splits(rows.shape[0], n_cols, sm_count(x.device), tuning)
        tiles = triton.cdiv(n_cols, tuning.block)
        chunk = triton.cdiv(tiles, max(1, min(splits, tiles))) * tuning.block  # whole tiles per chunk
        splits = triton.cdiv(n_cols, chunk)  # no chunk without a column
        part_k, part_i, tickets = _workspace(x.device, rows.shape[0], splits) if splits > 1 else (out, out, out)
        pdl = dependent_launch(x)
        with launch_device(x):
            _argmax_kernel[(rows.shape[0], splits)](
                rows,
                out,
                part_k,
                part_i,
                tickets,
                n_cols,
                rows.stride(0),
                chunk,
                SPLITS=splits,
                SPLITS_P2=triton.next_power_of_2(splits),
                BLOCK=tuning.block,
                PDL=pdl,
                num_warps=4,
                launch_pdl=pdl,
            )
    return out.reshape(x.shape[:-1])
