"""A Triton GEMM for decode-sized inputs: ``x (M, K) @ weight (N, K)^T (+ bias)`` with few rows ``M``.

Why: in a decode step the draft's projections see one token per row (``M`` = batch, 16 at most here),
so each GEMM reads its weight once and does almost no arithmetic; its time is the weight read plus
launch and memory latency. cuBLAS runs these at well below the copy bandwidth, and a long ``K`` (the
down projection) as a split-K GEMM plus a separate reduction launch. This kernel takes up to
:data:`MAX_ROWS` rows; it pays off up to about 32 rows (a draft's first forward of a step), not at a
target's verification (80 rows for a 7B at batch 16 x 5 tokens), where cuBLAS is faster. SiLU·mul as a
*prologue* (the down projection reading ``[gate | up]``) does not pay: elementwise work on the ``x``
operand between its load and ``tl.dot`` is what costs (an RMSNorm there as well). As an *epilogue* it is
cheap: :func:`gated_linear` runs the gate and up projections of a ``[gate; up]`` weight in one program and
writes ``silu(gate) * up``, one launch instead of cuBLAS's GEMM and ``silu_mul``.

Algorithm: grid ``(n_tiles, split_k)``. Program ``(j, s)`` computes the ``(BLOCK_M, BLOCK_N)`` tile ``j``
of the output over its share ``s`` of ``K`` with ``tl.dot`` (rows past ``M`` masked to zero), streaming
``BLOCK_N x BLOCK_K`` weight tiles (contiguous along ``K``: ``nn.Linear`` stores ``(out, in)``). With one
split it adds the bias and stores. With several, each split stores its fp32 partial and takes a ticket
(an atomic counter per tile); the last to arrive sums every split's partial in split order (so the
result does not depend on which split finished last: replays are bit-identical), adds the bias, stores
the tile, and resets the counter for the next launch (CUDA-graph replay safe). The split count is
chosen so the grid covers the SMs about ``GemmTuning.waves`` times. Rounding: fp32 accumulation, one rounding to
the output dtype after the bias, as cuBLAS's bias epilogue; the reduction order differs from cuBLAS's,
so results may differ from ``F.linear`` in the last bits.

All sizes come from host ints, so a call makes no host sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import launch_device, prepare_interpreter, sm_count, smem_limit, workspace
from ._rounding import TL_DTYPES, round_to
from .triton_launch import await_producers, dependent_launch
from .tuning import GemmTuning

__all__ = ["MAX_ROWS", "LaunchConfig", "gated_linear", "launch_config", "skinny_linear"]

MAX_ROWS = 128  # one BLOCK_M tile of rows (a power of two >= 16 covering M): the kernel is for decode-sized inputs
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of one call; build with :func:`launch_config`. ``block_m`` is the rows' tile."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def launch_config(
    rows: int,
    n: int,
    k: int,
    sm_count: int,
    elem_bytes: int,
    *,
    gated: bool = False,
    smem_limit: int | None = None,
    tuning: GemmTuning | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> LaunchConfig:
    """The launch of ``rows`` rows of ``x (rows, k)`` against an ``(n, k)`` weight (``gated``: the ``n`` columns of
    :func:`gated_linear`, from a ``2n``-row weight), from host ints only.

    ``block_n x block_k`` weight tiles (``32 x 128`` for 16-bit weights and a rows' tile up to 32, ``64 x 128`` for
    more: a wider tile spreads the load of a larger x tile over more columns) and, for a long ``K`` only
    (``tuning.min_split_k_tiles`` tiles or more), enough splits of it for the grid to give every SM about
    ``tuning.waves`` programs, each split at least two tiles long and at most ``tuning.max_splits`` of them;
    ``tuning.num_stages`` stages. ``gated``: one split, ``tuning.gated_block_n`` wide tiles and
    ``tuning.gated_num_stages`` stages. A launch keyword given is kept; with ``smem_limit`` (bytes a block may
    use) the heuristic's stages, then its tile width, are reduced to fit (:func:`_fit_shared`).
    """
    tuning = tuning or GemmTuning()
    explicit = {name for name, value in (("block_n", block_n), ("num_stages", num_stages)) if value is not None}
    block_m = max(16, triton.next_power_of_2(rows))
    if gated:
        if split_k not in (None, 1):
            raise ValueError("gated_linear does not split K")
        block_n, num_stages, split_k = block_n or tuning.gated_block_n, num_stages or tuning.gated_num_stages, 1
    if block_k is None:
        block_k = 128 if elem_bytes == 2 else 64
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if block_n is None:
        block_n = 32 if block_m <= 32 else 64
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = (
            1
            if k_tiles < tuning.min_split_k_tiles
            else max(1, min((tuning.waves * sm_count) // n_tiles, k_tiles // 2, tuning.max_splits))
        )
    split_k = max(1, min(split_k, k_tiles))
    per_split = triton.cdiv(k_tiles, split_k)
    split_k = triton.cdiv(k_tiles, per_split)  # no split without a tile
    cfg = LaunchConfig(block_m, block_n, block_k, split_k, num_warps or 4, num_stages or tuning.num_stages)
    return _fit_shared(cfg, elem_bytes, gated, smem_limit, explicit=explicit)


@triton.jit
def _skinny_gemm_kernel(
    X,
    W,
    BIAS,
    OUT,
    PART,
    TICKETS,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GATED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Tile ``j`` of ``x @ W^T`` over split ``s`` of ``K``; ``GATED`` (one split): of
    ``silu(x @ W[:N]^T) * (x @ W[N:]^T)``, the second accumulator over the up projection's rows."""
    await_producers(PDL)
    j = tl.program_id(0)
    s = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + kk) < k_hi
        x = tl.load(
            X + rows[:, None] * stride_xm + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            W + cols.to(tl.int64)[:, None] * stride_wn + (k0 + kk)[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        if UPCAST:  # the interpreter multiplies bf16 as raw bits
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            u = tl.load(
                W + (cols + N).to(tl.int64)[:, None] * stride_wn + (k0 + kk)[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision=DOT_PRECISION)
    out_ptrs = OUT + rows[:, None] * stride_om + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:  # F.silu(gate) * up on the two projections rounded to the output dtype, as silu_mul rounds
            gate = round_to(acc, OUT_DTYPE)
            acc = round_to(round_to(gate / (1.0 + tl.exp(-gate)), OUT_DTYPE) * round_to(acc_up, OUT_DTYPE), OUT_DTYPE)
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=out_mask)
    else:
        part = PART + (j * SPLIT_K * BLOCK_M + rows[:, None]) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part + s * BLOCK_M * BLOCK_N, acc)
        # release the partial before the ticket; the last arrival acquires every other split's partial
        ticket = tl.atomic_add(TICKETS + j, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for t in range(SPLIT_K):  # split order: the sum does not depend on arrival order
                total += tl.load(part + t * BLOCK_M * BLOCK_N, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(OUT.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(TICKETS + j, 0)  # ready for the next launch (graph replays reuse the counters)


def _shared_bytes(block_m: int, block_n: int, block_k: int, elem_bytes: int, num_stages: int, gated: bool) -> int:
    """Shared memory Triton 3.6 gives the kernel: ``num_stages - 1`` buffers of the x tile and the weight tile (two
    weight tiles gated). Exact for every launch ``tests/smem_report.py`` compiles for sm_80 and sm_86."""
    return (num_stages - 1) * (block_m + (2 if gated else 1) * block_n) * block_k * elem_bytes


def _fit_shared(
    cfg: LaunchConfig, elem_bytes: int, gated: bool, limit: int | None, *, explicit: set[str]
) -> LaunchConfig:
    """``cfg`` with fewer stages (down to 2), then narrower tiles (down to 16), where its shared memory would
    exceed ``limit`` (bytes a block may use; ``None``: no limit); what the caller gave (``explicit``) is kept.
    ``gated_linear``'s 4 stages of 64-wide tiles need 110,592 bytes at 16 rows, more than an sm_86/89 block may
    use (101,376)."""
    block_m = cfg.block_m
    if limit is None or _shared_bytes(block_m, cfg.block_n, cfg.block_k, elem_bytes, cfg.num_stages, gated) <= limit:
        return cfg
    widths = (
        [cfg.block_n]
        if "block_n" in explicit
        else [w for w in (cfg.block_n, cfg.block_n // 2, cfg.block_n // 4) if w >= 16]
    )
    stages = [cfg.num_stages] if "num_stages" in explicit else range(cfg.num_stages, 1, -1)
    for block_n in widths:
        for num_stages in stages:
            if _shared_bytes(block_m, block_n, cfg.block_k, elem_bytes, num_stages, gated) <= limit:
                return dataclasses.replace(cfg, block_n=block_n, num_stages=num_stages)
    raise ValueError(
        f"no launch configuration of the decode GEMM fits {limit} bytes of shared memory "
        f"({block_m} rows, {cfg.block_k}-wide K tiles, {elem_bytes}-byte elements)"
    )


def _workspace(
    device: torch.device, n_tiles: int, split_k: int, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials and zeroed tickets of a split-K launch shape
    (:func:`~dustin_hf.kernels._device.workspace`)."""
    return workspace(
        ("gemm", device, n_tiles, split_k, block_m, block_n),
        lambda: (
            torch.empty(n_tiles * split_k * block_m * block_n, dtype=torch.float32, device=device),
            torch.zeros(n_tiles, dtype=torch.int32, device=device),
        ),
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tuning: GemmTuning | None = None,
    **overrides,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x (..., K)`` with at most :data:`MAX_ROWS` rows, one launch.

    ``weight (N, K)`` and ``bias (N,)`` as ``nn.Linear`` holds them (contiguous along ``K``); fp16, bf16 or
    fp32, all one dtype. ``tuning``: the launch heuristic's constants (``None``: the defaults); ``overrides``
    (``block_n``, ``block_k``, ``split_k``, ``num_warps``, ``num_stages``): this call's launch choices
    (:func:`launch_config`).
    """
    return _skinny(x, weight, bias, False, tuning, overrides)


def gated_linear(
    x: torch.Tensor, weight: torch.Tensor, *, tuning: GemmTuning | None = None, **overrides
) -> torch.Tensor:
    """``silu(x @ gate^T) * (x @ up^T)`` for ``weight = [gate; up]`` (``2I x K``): what a gated MLP feeds its
    down projection, in one launch, for at most :data:`MAX_ROWS` rows.

    The two projections are rounded to ``x``'s dtype, then SiLU and the product round as
    :func:`~dustin_hf.kernels.triton_fused.silu_mul_triton` does (the same ops as ``F.silu(gate) * up``); the
    GEMM reduces in another order than cuBLAS's. ``K`` is not split (``split_k`` is 1). ``tuning`` and
    ``overrides`` (``block_n``, ``block_k``, ``num_warps``, ``num_stages``) as for :func:`skinny_linear`.
    """
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"weight must be [gate; up], (2I, K); got {tuple(weight.shape)}")
    return _skinny(x, weight, None, True, tuning, overrides)


def _skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    tuning: GemmTuning | None,
    overrides: dict,
) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    m, n = rows.shape[0], weight.shape[0] // 2 if gated else weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{'gated' if gated else 'skinny'}_linear takes at most {MAX_ROWS} rows, got {m}")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be (N, {k}), got {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"x, weight and bias must share one of {_DTYPES}; got {x.dtype}, {weight.dtype}, "
            f"{None if bias is None else bias.dtype}"
        )
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("weight must be contiguous along its input dimension")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    interpreting = prepare_interpreter()
    if m and n:
        cfg = launch_config(
            m,
            n,
            k,
            sm_count(x.device),
            x.element_size(),
            gated=gated,
            smem_limit=smem_limit(x.device),
            tuning=tuning,
            **overrides,
        )
        block_m = cfg.block_m
        n_tiles = triton.cdiv(n, cfg.block_n)
        k_tiles_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
        part, tickets = (
            _workspace(x.device, n_tiles, cfg.split_k, block_m, cfg.block_n) if cfg.split_k > 1 else (out, out)
        )
        pdl = dependent_launch(x)
        with launch_device(x):
            _skinny_gemm_kernel[(n_tiles, cfg.split_k)](
                rows,
                weight,
                bias if bias is not None else weight,
                out,
                part,
                tickets,
                m,
                n,
                k,
                k_tiles_per_split * cfg.block_k,
                rows.stride(0),
                weight.stride(0),
                out.stride(0),
                HAS_BIAS=bias is not None,
                SPLIT_K=cfg.split_k,
                GATED=gated,
                OUT_DTYPE=TL_DTYPES[x.dtype],
                UPCAST=interpreting and x.dtype == torch.bfloat16,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                BLOCK_M=block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                PDL=pdl,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                launch_pdl=pdl,
            )
    return out.reshape(*x.shape[:-1], n)
