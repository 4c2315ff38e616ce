"""Triton kernels for Dustin's budget fill: every sparse row's read set in two launches, no host sync.

Computes what :func:`dustin_hf.selection.fill.select_positions` computes for a row read sparsely: with
``L_b`` cached positions and candidates ``[sink, L_b - recent)``, the sinks ``[0, sink)``, the recent
window ``[L_b - recent, L_b)``, the top ``share`` candidates by the draft score, then the top
``fill`` remaining candidates by the history score; ``budget = sink + recent + share + fill``
positions per row, sorted ascending. With per-row ``counts`` (the quality knob's counts, which a selection
layer keeps: :mod:`dustin_hf.selection.layers`) row ``b`` takes only ``min(fill, counts[b] - sink - recent - share)``
positions by the history score, and its slots past ``counts[b]`` hold 0.

Ties: candidates are ranked in one total order, score descending then position ascending, so at
the k-th score the lowest positions win and exactly k are taken. ``torch.topk`` (the PyTorch path)
breaks ties arbitrarily: with ties at a threshold the two paths may pick different positions of
equal score, and a different draft pick can change what the history fill sees.

Why a kernel: the PyTorch path runs two ``topk`` over the whole ``(B, span)`` scores, masks, a
scatter, a cat and a sort (about ten launches).

Algorithm (a filter that keeps every winner, then an exact select among the survivors):

* **Keys.** A float score becomes a ``uint32`` whose unsigned order is the float order
  (:func:`_sortable`). The top k of a set held in registers (:func:`_top_k`) finds the k-th largest
  key bit by bit, from the top: 32 steps, each one count of the keys at or above a trial threshold.
  Keys above the threshold are in; of those equal to it, the first ``k - above`` in position order
  (an exclusive cumsum) are in. A step costs mostly its reduction's latency, so launch 1 runs its two
  searches in one loop (:func:`_top_k_pair`: both counts packed in one int32, one reduction a step
  for both instead of one each).
* **Launch 1** (:func:`_local_pools_kernel`), grid ``(n_chunks, B)``: chunk ``c`` of row ``b``
  (``chunk`` positions, in registers) keeps its local top ``share`` by draft score and its local top
  ``share + fill`` by history score, and writes each set compacted in position order to a pool
  (``-1`` in unused slots). Every global winner survives: a position of the draft pick ``D`` has
  fewer than ``share`` candidates above it in the whole row, so fewer in its chunk; a position of the
  history pick ``H`` has fewer than ``fill`` candidates outside ``D`` above it, so fewer than
  ``share + fill`` in its chunk. Chunks come in position order, so each pool is too.
* **Launch 2** (:func:`_merge_pools_kernel`), grid ``(B,)``: ``D`` is the top ``share`` of the draft
  pool; its last member ``(t, cut)`` (threshold key, last tied position taken) decides membership of
  any position from its draft key alone, which the history pool carries. ``H`` is the top ``fill``
  of the history pool outside ``D``. The program writes the sinks and the recent window to their
  slots, ``D`` and ``H`` to the middle slots, reads the middle back and sorts it (``tl.sort``).

Launch sizes come from host ints only (``B``, the scores' width, the budget split), so the call
makes no host sync and can be captured in a CUDA graph. The pools hold ``n_chunks * min(k, chunk)``
entries in one program's registers, which bounds the span the kernels take (:func:`launch_config`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import prepare_interpreter
from .triton_launch import await_producers, dependent_launch
from .tuning import SelectTuning

__all__ = ["LaunchConfig", "launch_config", "select_sparse_triton", "supports"]

# Launch 1 holds a chunk's keys in registers, launch 2 the pools. Compiled for sm_90 (Triton 3.6), neither
# spills up to 8192; at 16384 (16 warps) each spills 120-210 bytes per thread, slower but still correct.
_MAX_CHUNK = 16384  # < 2**16: launch 1 packs two counts of a chunk's keys in one int32
_MAX_POOL = 16384


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of one call; build with :func:`launch_config`.

    Attributes:
        chunk: positions per launch-1 program, a power of two.
        num_warps_local: ``num_warps`` of launch 1.
        num_warps_merge: ``num_warps`` of launch 2.
    """

    chunk: int
    num_warps_local: int
    num_warps_merge: int


def _pool_width(k: int, chunk: int) -> int:
    """Pool slots per chunk for a local top ``k``."""
    return min(k, chunk)


def launch_config(
    span: int,
    share: int,
    fill: int,
    *,
    tuning: SelectTuning | None = None,
    chunk: int | None = None,
    num_warps_local: int | None = None,
    num_warps_merge: int | None = None,
) -> LaunchConfig | None:
    """Launch parameters from host ints, or ``None`` when the pools would not fit one program's registers.

    ``chunk`` left ``None``: the smallest power of two from ``tuning.min_chunk`` whose history pool
    (``n_chunks * min(share + fill, chunk)`` entries) is at most ``tuning.target_pool``, else the largest chunk
    (``_MAX_CHUNK``) as long as its pool stays within ``_MAX_POOL``. Warps: about 16 keys per thread.
    """
    tuning = tuning or SelectTuning()
    largest_k = share + fill
    if chunk is None:
        chunk = tuning.min_chunk
        while chunk < _MAX_CHUNK and triton.cdiv(span, chunk) * _pool_width(largest_k, chunk) > tuning.target_pool:
            chunk *= 2
    if chunk & (chunk - 1) or chunk > _MAX_CHUNK:
        raise ValueError(f"chunk must be a power of two up to {_MAX_CHUNK}; got {chunk}")
    pool = triton.cdiv(span, chunk) * _pool_width(largest_k, chunk)
    if pool > _MAX_POOL:
        return None
    return LaunchConfig(
        chunk=chunk,
        num_warps_local=num_warps_local or _warps_for(chunk),
        num_warps_merge=num_warps_merge or _warps_for(triton.next_power_of_2(pool)),
    )


def _warps_for(n: int) -> int:
    """Warps for a program holding ``n`` keys: about 16 per thread, 4 to 16 warps."""
    return min(16, max(4, n // 512))


def supports(span: int, share: int, fill: int, tuning: SelectTuning | None = None) -> bool:
    """Whether :func:`select_sparse_triton` takes scores ``span`` wide with this budget split (its pools
    fit: with a 512 budget, spans up to ~500k positions)."""
    return launch_config(span, share, fill, tuning=tuning) is not None


@triton.jit
def _sortable(scores):
    """float32 -> uint32 with the same order (``-0.0`` counts as ``+0.0``; NaNs are not handled)."""
    bits = tl.where(scores == 0.0, 0.0, scores).to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all ones for negative floats (reverses them), else the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _top_k(keys, valid, k):
    """Mask of the ``k`` largest valid ``keys`` (1-D uint32), ties to the lowest index; every valid key
    when there are fewer than ``k``. Also returns the threshold: the smallest key taken."""
    threshold = tl.zeros((), tl.uint32)
    step = tl.full((), 0x80000000, tl.uint32)
    for _ in range(32):  # the largest threshold with at least k valid keys at or above it
        trial = threshold | step
        count = tl.sum((valid & (keys >= trial)).to(tl.int32), 0)
        threshold = tl.where(count >= k, trial, threshold)
        step = step >> 1
    return _take(keys, valid, k, threshold), threshold


@triton.jit
def _top_k_pair(keys_a, k_a, keys_b, k_b, valid):
    """:func:`_top_k` of two key sets over the same ``valid`` entries (fewer than 2**16 of them), both
    searches in one loop: each step counts both trial thresholds in one reduction, the two counts packed
    in the halves of an int32 (the reduction's latency, not the compares, is what a step costs)."""
    threshold_a = tl.zeros((), tl.uint32)
    threshold_b = tl.zeros((), tl.uint32)
    step = tl.full((), 0x80000000, tl.uint32)
    for _ in range(32):
        trial_a = threshold_a | step
        trial_b = threshold_b | step
        packed = (valid & (keys_a >= trial_a)).to(tl.int32) + ((valid & (keys_b >= trial_b)).to(tl.int32) << 16)
        counts = tl.sum(packed, 0)
        threshold_a = tl.where((counts & 0xFFFF) >= k_a, trial_a, threshold_a)
        threshold_b = tl.where((counts >> 16) >= k_b, trial_b, threshold_b)
        step = step >> 1
    return _take(keys_a, valid, k_a, threshold_a), _take(keys_b, valid, k_b, threshold_b)


@triton.jit
def _take(keys, valid, k, threshold):
    """The valid keys above ``threshold``, and of those equal to it the first ``k - above`` in index order."""
    above = valid & (keys > threshold)
    tie = (valid & (keys == threshold)).to(tl.int32)
    tie_rank = tl.cumsum(tie, 0) - tie  # earlier ties, in index (= position) order
    return above | ((tie != 0) & (tie_rank < k - tl.sum(above.to(tl.int32), 0)))


@triton.jit
def _write_pool(
    pool_row,
    stride_plane,
    width,
    keep,
    positions,
    key,
    draft_key,
    WITH_DRAFT_KEY: tl.constexpr,
    WIDTH_BLOCK: tl.constexpr,
):
    """Store the kept entries of one chunk compacted in position order to ``width`` slots at
    ``pool_row``, ``-1`` positions in the slots left over. Planes: positions, keys, [draft keys]."""
    kept = keep.to(tl.int32)
    slot = tl.cumsum(kept, 0) - 1
    tl.store(pool_row + slot, positions, mask=keep)
    tl.store(pool_row + stride_plane + slot, key.to(tl.int32, bitcast=True), mask=keep)
    if WITH_DRAFT_KEY:
        tl.store(pool_row + 2 * stride_plane + slot, draft_key.to(tl.int32, bitcast=True), mask=keep)
    rest = tl.arange(0, WIDTH_BLOCK)
    tl.store(pool_row + rest, -1, mask=(rest >= tl.sum(kept, 0)) & (rest < width))


@triton.jit(
    do_not_specialize=[
        "stride_db",
        "stride_hb",
        "span",
        "stride_pd_plane",
        "stride_pd",
        "stride_ph_plane",
        "stride_ph",
    ]
)
def _local_pools_kernel(
    DRAFT,
    HISTORY,
    LENGTHS,  # (B, span) float scores (unit stride along positions); (B,) int
    DRAFT_POOL,
    HISTORY_POOL,  # (2, B, n_chunks * POOL_D) and (3, B, n_chunks * POOL_H) int32
    stride_db,
    stride_hb,
    stride_l,
    span,
    stride_pd_plane,
    stride_pd,
    stride_ph_plane,
    stride_ph,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    SHARE: tl.constexpr,
    FILL: tl.constexpr,
    POOL_D: tl.constexpr,
    POOL_H: tl.constexpr,
    POOL_D_BLOCK: tl.constexpr,
    POOL_H_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    await_producers(PDL)
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    positions = c * CHUNK + tl.arange(0, CHUNK)  # (CHUNK,)
    length = tl.load(LENGTHS + b * stride_l).to(tl.int32)
    candidate = (positions >= SINK) & (positions < length - RECENT) & (positions < span)
    draft = _sortable(tl.load(DRAFT + b * stride_db + positions, mask=candidate, other=0.0).to(tl.float32))
    if FILL > 0:
        history = _sortable(tl.load(HISTORY + b * stride_hb + positions, mask=candidate, other=0.0).to(tl.float32))
        if SHARE > 0:
            keep_draft, keep_history = _top_k_pair(draft, SHARE, history, SHARE + FILL, candidate)
        else:
            keep_history, _ = _top_k(history, candidate, FILL)
    elif SHARE > 0:
        keep_draft, _ = _top_k(draft, candidate, SHARE)
    if SHARE > 0:
        _write_pool(
            DRAFT_POOL + b * stride_pd + c * POOL_D,
            stride_pd_plane,
            POOL_D,
            keep_draft,
            positions,
            draft,
            draft,
            WITH_DRAFT_KEY=False,
            WIDTH_BLOCK=POOL_D_BLOCK,
        )
    if FILL > 0:
        _write_pool(
            HISTORY_POOL + b * stride_ph + c * POOL_H,
            stride_ph_plane,
            POOL_H,
            keep_history,
            positions,
            history,
            draft,
            WITH_DRAFT_KEY=True,
            WIDTH_BLOCK=POOL_H_BLOCK,
        )


@triton.jit(do_not_specialize=["stride_pd_plane", "stride_pd", "stride_ph_plane", "stride_ph", "n_draft", "n_history"])
def _merge_pools_kernel(
    DRAFT_POOL,
    HISTORY_POOL,
    LENGTHS,
    COUNTS,
    OUT,  # pools as launch 1 wrote them; OUT (B, budget) int32
    stride_pd_plane,
    stride_pd,
    stride_ph_plane,
    stride_ph,
    stride_l,
    stride_c,
    stride_ob,
    n_draft,
    n_history,  # pool entries per row: n_chunks * POOL_D, n_chunks * POOL_H
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    SHARE: tl.constexpr,
    FILL: tl.constexpr,
    DRAFT_BLOCK: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr,
    SINK_BLOCK: tl.constexpr,
    RECENT_BLOCK: tl.constexpr,
    MIDDLE_BLOCK: tl.constexpr,
    HAS_COUNTS: tl.constexpr,  # COUNTS (B,) int read: a row's history fill stops at its count
    PDL: tl.constexpr,
):
    await_producers(PDL)
    b = tl.program_id(0).to(tl.int64)
    out = OUT + b * stride_ob
    length = tl.load(LENGTHS + b * stride_l).to(tl.int32)
    if HAS_COUNTS:
        fill = tl.minimum(tl.maximum(tl.load(COUNTS + b * stride_c).to(tl.int32) - SINK - RECENT - SHARE, 0), FILL)
    else:
        fill = FILL
    s = tl.arange(0, SINK_BLOCK)
    tl.store(out + s, s, mask=s < SINK)
    r = tl.arange(0, RECENT_BLOCK)
    tl.store(out + SINK + SHARE + fill + r, length - RECENT + r, mask=r < RECENT)
    if HAS_COUNTS:  # the slots past the row's count: 0, never read
        m = tl.arange(0, MIDDLE_BLOCK)
        tl.store(out + SINK + SHARE + fill + RECENT + m, 0, mask=m < FILL - fill)

    if SHARE > 0:  # D: the top SHARE of the draft pool
        j = tl.arange(0, DRAFT_BLOCK)
        row = DRAFT_POOL + b * stride_pd + j
        d_pos = tl.load(row, mask=j < n_draft, other=-1)
        d_key = tl.load(row + stride_pd_plane, mask=j < n_draft, other=0).to(tl.uint32, bitcast=True)
        in_d, d_threshold = _top_k(d_key, d_pos >= 0, SHARE)
        d_cut = tl.max(tl.where(in_d & (d_key == d_threshold), d_pos, -1), 0)  # last tied position taken
        tl.store(out + SINK + tl.cumsum(in_d.to(tl.int32), 0) - 1, d_pos, mask=in_d)
    if FILL > 0:  # H: the top FILL of the history pool outside D
        j = tl.arange(0, HISTORY_BLOCK)
        row = HISTORY_POOL + b * stride_ph + j
        h_pos = tl.load(row, mask=j < n_history, other=-1)
        h_key = tl.load(row + stride_ph_plane, mask=j < n_history, other=0).to(tl.uint32, bitcast=True)
        free = h_pos >= 0
        if SHARE > 0:
            h_draft = tl.load(row + 2 * stride_ph_plane, mask=j < n_history, other=0).to(tl.uint32, bitcast=True)
            free = free & ((h_draft < d_threshold) | ((h_draft == d_threshold) & (h_pos > d_cut)))
        in_h, _ = _top_k(h_key, free, fill)
        tl.store(out + SINK + SHARE + tl.cumsum(in_h.to(tl.int32), 0) - 1, h_pos, mask=in_h)

    # D and H sit unsorted between the sinks and the recent window: read them back (the barrier makes
    # every thread's stores visible) and sort them in registers
    tl.debug_barrier()
    m = tl.arange(0, MIDDLE_BLOCK)
    middle = tl.load(out + SINK + m, mask=m < SHARE + fill, other=2147483647)
    tl.store(out + SINK + m, tl.sort(middle, 0), mask=m < SHARE + fill)


def select_sparse_triton(
    draft_scores: torch.Tensor,
    history_scores: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    recent: int,
    share: int,
    fill: int,
    counts: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    tuning: SelectTuning | None = None,
) -> torch.Tensor:
    """Each row's sparse read set (sinks, recent window, draft top ``share``, history top ``fill``).

    Args:
        draft_scores: ``(B, span)`` float (fp32/fp16/bf16), ``S_draft``; unit stride along positions.
        history_scores: ``(B, span)`` float, the fill's scores (``S_target``, or ``S_draft`` for rows
            without a history); unit stride along positions.
        lengths: ``(B,)`` int32/int64, cached positions ``L_b`` per row; a row is meant to satisfy
            ``budget < L_b <= span`` (other rows get an in-range but meaningless answer).
        sink, recent, share, fill: the budget split (host ints).
        counts: ``(B,)`` int32/int64, each row's positions in all (``>= sink + recent + share``): row ``b`` takes
            ``min(fill, counts[b] - sink - recent - share)`` by the history score, and its slots past ``counts[b]``
            hold 0; ``None``: every row takes ``fill``.
        config: this call's launch parameters instead of the heuristic's (:func:`launch_config`).
        tuning: the heuristic's constants (``None``: the defaults).

    Returns:
        ``(B, sink + recent + share + fill)`` int32, each row sorted ascending.
    """
    batch, span = draft_scores.shape
    _check_inputs(draft_scores, history_scores, lengths, counts)
    budget = sink + recent + share + fill
    out = torch.empty(batch, budget, dtype=torch.int32, device=draft_scores.device)
    if batch == 0 or budget == 0:
        return out
    config = config or launch_config(span, share, fill, tuning=tuning)
    if config is None:
        raise ValueError(
            f"scores {span} wide with share {share} and fill {fill} overflow the selection kernel's "
            f"pools; use the PyTorch path (select_positions(..., backend='reference'))"
        )
    prepare_interpreter()
    n_chunks = triton.cdiv(span, config.chunk)
    pool_d, pool_h = _pool_width(share, config.chunk), _pool_width(share + fill, config.chunk)
    device = draft_scores.device
    draft_pool = torch.empty(2, batch, max(1, n_chunks * pool_d), dtype=torch.int32, device=device)
    history_pool = torch.empty(3, batch, max(1, n_chunks * pool_h), dtype=torch.int32, device=device)
    sizes = dict(SINK=sink, RECENT=recent, SHARE=share, FILL=fill)
    pdl = dependent_launch(out)
    _local_pools_kernel[(n_chunks, batch)](
        draft_scores,
        history_scores,
        lengths,
        draft_pool,
        history_pool,
        draft_scores.stride(0),
        history_scores.stride(0),
        lengths.stride(0),
        span,
        *draft_pool.stride()[:2],
        *history_pool.stride()[:2],
        **sizes,
        POOL_D=pool_d,
        POOL_H=pool_h,
        POOL_D_BLOCK=_block(pool_d),
        POOL_H_BLOCK=_block(pool_h),
        CHUNK=config.chunk,
        PDL=pdl,
        num_warps=config.num_warps_local,
        launch_pdl=pdl,
    )
    row_counts = counts if counts is not None else lengths  # placeholder, never read
    _merge_pools_kernel[(batch,)](
        draft_pool,
        history_pool,
        lengths,
        row_counts,
        out,
        *draft_pool.stride()[:2],
        *history_pool.stride()[:2],
        lengths.stride(0),
        row_counts.stride(0),
        out.stride(0),
        n_chunks * pool_d,
        n_chunks * pool_h,
        **sizes,
        DRAFT_BLOCK=_block(n_chunks * pool_d),
        HISTORY_BLOCK=_block(n_chunks * pool_h),
        SINK_BLOCK=_block(sink),
        RECENT_BLOCK=_block(recent),
        MIDDLE_BLOCK=_block(share + fill),
        HAS_COUNTS=counts is not None,
        PDL=pdl,
        num_warps=config.num_warps_merge,
        launch_pdl=pdl,
    )
    return out


def _block(n: int) -> int:
    """A power of two >= ``n`` (and >= 2: Triton's reductions and sort want a real axis)."""
    return max(2, triton.next_power_of_2(n))


def _check_inputs(draft_scores, history_scores, lengths, counts=None) -> None:
    """Shape/dtype checks on host metadata only (no device reads)."""
    if draft_scores.dim() != 2 or history_scores.shape != draft_scores.shape:
        raise ValueError(
            f"draft_scores and history_scores must both be (B, span); got {tuple(draft_scores.shape)} "
            f"and {tuple(history_scores.shape)}"
        )
    for name, t in (("draft_scores", draft_scores), ("history_scores", history_scores)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be fp16, bf16 or fp32; got {t.dtype}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} needs unit stride along positions (call .contiguous())")
    if lengths.shape != draft_scores.shape[:1] or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"lengths must be ({draft_scores.shape[0]},) int32/int64; got {tuple(lengths.shape)} {lengths.dtype}"
        )
    if counts is not None and (counts.shape != lengths.shape or counts.dtype not in (torch.int32, torch.int64)):
        raise ValueError(
            f"counts must be ({draft_scores.shape[0]},) int32/int64; got {tuple(counts.shape)} {counts.dtype}"
        )
