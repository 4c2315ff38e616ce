"""Triton kernels for Dustin's scores: attention probability mass per cached position, two passes.

Computes exactly :func:`dustin_hf.selection.scoring.attention_mass`: every (query ``j``, scoring head ``h``)
of row ``b`` takes a softmax over the key positions ``[0, query_pos[b, j]]`` of its KV head, and
position ``p < num_positions`` receives the sum over (query, head) of its probability. With
``query_counts`` a row counts only its leading queries (a selection layer's row that drafted fewer tokens than
the longest): the others see no key, so pass 1 reads none for them and they add nothing.

Why a kernel: PyTorch materialises the fp32 logits and probabilities of every scoring row over the
whole span (and softmaxes them in several passes); here the keys are read once and the only other
traffic is a 16-bit copy of the scores (shifted by a running max), which is smaller than the keys.

Algorithm (one softmax per packed row, normalised across programs by log-sum-exp):

* **Rows.** The scoring heads sharing a KV head and the ``n_q`` queries are packed into
  ``M = n_q * n_h`` rows of one program (row ``r`` is query ``r // n_h``, head slot ``r % n_h``),
  padded to ``BLOCK_M >= 16`` for ``tl.dot``; the KV head's key tile is loaded once for all of
  them. Heads of several KV heads run as one launch per KV head. In the buffers below, all rows of
  all heads share one numbering ``j * H + k`` (``k``: the head's place among the ``H`` heads,
  grouped by KV head), so the second pass needs no notion of KV heads. Several layers whose queries
  sit at the same positions (the draft's scoring layers, :func:`attention_mass_layers_triton`) share
  one numbering too, ``H`` counting every layer's heads: pass 1 runs per (layer, KV head) into the
  same buffers, and one pass 2 sums all layers.
* **Pass 1** (:func:`_score_pass1_kernel`), grid ``(num_splits * m_tiles, B)``: split ``s`` owns
  key positions ``[s * chunk, (s + 1) * chunk)``, stopping at the last position any of the row's
  queries sees (ragged rows skip the tail). It walks them in ``BLOCK_N`` tiles with an online
  softmax in fp32 (base 2, ``log2(e)`` folded into the scale) and, per tile, writes the shifted
  scores ``x = s - m`` (``m``: the running max including this tile, so ``x <= 0``; ``-inf`` where
  the query does not see the key; fp16 for 16-bit keys, fp32 for fp32 keys) and ``m`` itself per
  (tile, row). At its end it stores the split's log-sum-exp per row and takes a ticket from a
  counter per (batch row, row tile); the last split to arrive merges all splits' log-sum-exps into
  the row's ``lse`` and resets the counter to 0 (the ticket pattern of
  :mod:`dustin_hf.kernels.triton_verify`, on the same per-device zeroed counters,
  :func:`dustin_hf.kernels._device.tickets`, so a captured graph replays correctly; one split writes
  ``lse`` directly). The probability is then ``exp2(x + (m - lse))``:
  one offset per (row, tile). Storing ``x`` rather than ``exp2(x)`` keeps the large probabilities
  (``x`` near 0, where fp16 is finest) about 3x more accurate.
* **Pass 2** (:func:`_score_pass2_kernel`), grid ``(tiles, B)``: each program walks its positions
  in steps of ``block_p`` (a power-of-two number of pass 1 tiles); a step loads every row's scores
  in row blocks of ``block_r`` rows, adds up ``exp2(x[r, p] + m[r, tile] - lse[r])`` over the rows
  whose query sees ``p`` elementwise across the blocks, reduces once over rows, optionally adds what
  the output holds, zeroes past a per-row limit and stores. The loop is software-pipelined: the
  scores of the next step arrive through 16-byte ``cp.async`` copies while one step is computed.
  One program owns each output element: no atomics.

Bytes per scored position and KV head: the keys (``D`` elements) once, plus ``M`` 16-bit shifted
scores written and read back. For Qwen2.5-72B's target layer (``D = 128``, one query x 8 heads)
that is ``256 + 2 * 16`` bytes, where re-reading the keys in pass 2 would cost ``256``; for the
0.5B draft (``D = 64``, 4 queries x 7 heads) ``128 + 2 * 56`` against ``128``, about even. Pass 1
streams the keys in 16-byte ``cp.async`` copies, ``num_stages - 1`` tiles ahead (Triton drops their
``evict_first`` hint there), and stores the scores 16 bytes at a time with ``evict_last``, so pass 2
may find them in L2 when they fit (B = 16, 32k positions: 8 MB for the target, 29 MB per draft
layer, 88 MB for the three together). At that point one step's pass 1 reads 134 MB of target and
201 MB of draft keys and writes 8 + 88 MB of scores: ~430 MB, ~100 us at an H200's ~4.2 TB/s copy
bandwidth. Pass 2 reads those 96 MB of scores back (+ 1.6 MB of tile maxima) and writes the two
2 MB fp32 outputs once each: ~25 us of bandwidth; its ex2s (16 x 32k x (8 + 88) rows, 50 M) take
~12 us of an H200's special-function units, under the loads. The layout avoids what would make pass 2
slow: every program merging all splits' log-sum-exps (pass 1's last split merges them once), a pass 2
per draft layer re-reading and re-writing the output (one pass 2 sums all layers), and loop steps that
load a little and wait for it with nothing else in flight (the steps are large and pipelined).

Every size (grid, splits, buffers) comes from host ints only (``B``, ``n_q``, ``heads``,
``key_span``, the SM count), so the call makes no host sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._device import prepare_interpreter, sm_count, tickets
from .triton_launch import await_producers, dependent_launch
from .tuning import ScoreTuning

__all__ = [
    "LaunchConfig",
    "ScoreBuffers",
    "attention_mass_from_scores",
    "attention_mass_layers_triton",
    "attention_mass_triton",
    "buffer_tiles",
    "call_config",
    "launch_config",
    "score_buffers",
]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64  # pass 2 holds (rows, splits) log-sum-exps of one batch row in registers
_MAX_BLOCK_M = 128


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of one call; build with :func:`launch_config` or :func:`call_config`.

    Attributes:
        block_n: key positions per tile (both passes; pass 2 indexes pass 1's per-tile maxima).
        num_splits: pass 1 programs per (batch row, KV head, row tile) along the keys.
        chunk: key positions per split, a multiple of ``block_n``.
        tile: pass 2 output positions per program, a multiple of ``block_p``.
        block_p: pass 2 positions per loop step, a multiple of ``block_n`` (a power-of-two number of tiles).
        block_r: pass 2 rows per row block (a power of two; capped at the rows' next power of two).
        num_warps, num_stages: Triton launch options of pass 1.
        num_warps_reduce: ``num_warps`` of pass 2.
        num_stages_reduce: software-pipelining stages of pass 2's loop (1: none; ``s``: the scores of
            ``s - 1`` steps are loaded, through ``cp.async``, while one is computed).
        layers_per_pass2: layers whose rows share one set of buffers and one pass 2 in
            :func:`attention_mass_layers_triton` (0: all of them).
    """

    block_n: int
    num_splits: int
    chunk: int
    tile: int
    block_p: int
    block_r: int
    num_warps: int
    num_stages: int
    num_warps_reduce: int
    num_stages_reduce: int
    layers_per_pass2: int = 0


def launch_config(
    batch: int,
    pass1_programs_per_split: int,
    head_dim: int,
    span: int,
    num_positions: int,
    sm_count: int,
    *,
    key_bytes: int = 2,
    rows: int = 32,
    tuning: ScoreTuning | None = None,
    pass2_programs_per_sm: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    tile: int | None = None,
    block_p: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_warps_reduce: int | None = None,
    num_stages_reduce: int | None = None,
    layers_per_pass2: int | None = None,
) -> LaunchConfig:
    """Tile sizes and split counts from host-known sizes only (no device data, so graph-safe).

    ``pass1_programs_per_split`` is ``B * sum over KV heads of m_tiles`` (of the largest layer): the
    pass 1 programs that one split count multiplies; ``key_bytes`` is the keys' element size, ``rows`` pass 2's
    rows (all layers'); ``tuning`` the heuristic's constants (:class:`~dustin_hf.kernels.tuning.ScoreTuning`).
    Any launch keyword left ``None`` takes the heuristic value: key tiles of about ``tuning.tile_bytes``
    (``block_n * head_dim * key_bytes``); enough splits to give every SM about ``tuning.programs_per_sm``
    pass 1 programs, each walking at least ``tuning.min_blocks_per_split`` tiles; pass 2 steps of about
    ``tuning.pass2_step_elements`` scores (rows padded to row blocks; at least one tile) on 4 warps, tiles
    sized for ``pass2_programs_per_sm`` programs per SM (``tuning.pass2_warps_per_sm`` warps).
    """
    tuning = tuning or ScoreTuning()
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:
        block_n = max(32, min(128, tuning.tile_bytes // (block_d * key_bytes)))
    n_blocks = max(1, triton.cdiv(span, block_n))
    if num_splits is None:
        by_occupancy = max(1, (tuning.programs_per_sm * sm_count) // max(1, pass1_programs_per_split))
        by_work = max(1, n_blocks // tuning.min_blocks_per_split)
        num_splits = min(by_occupancy, by_work)
    num_splits = max(1, min(num_splits, n_blocks, _MAX_SPLITS))
    blocks_per_split = triton.cdiv(n_blocks, num_splits)
    num_splits = triton.cdiv(n_blocks, blocks_per_split)  # drop splits that would own no tile at all

    block_r = block_r or tuning.pass2_block_r
    rows_padded = triton.cdiv(rows, block_r) * block_r if rows > block_r else triton.next_power_of_2(rows)
    out_blocks = max(1, triton.cdiv(num_positions, block_n))
    if block_p is None:
        step_tiles = max(1, tuning.pass2_step_elements // (rows_padded * block_n))
        step_tiles = min(1 << (step_tiles.bit_length() - 1), triton.next_power_of_2(out_blocks))  # a power of two
        if tile is not None:  # an explicit tile: the largest such step that divides it
            while tile % (step_tiles * block_n):
                step_tiles //= 2
        block_p = max(1, step_tiles) * block_n
    step_tiles = block_p // block_n
    if block_p % block_n or step_tiles & (step_tiles - 1):
        raise ValueError(f"block_p ({block_p}) must be block_n ({block_n}) times a power of two")
    num_warps_reduce = num_warps_reduce or 4  # a row block of 8 rows x 128 fp16 scores: 16 bytes a thread
    if tile is None:
        out_steps = triton.cdiv(out_blocks, step_tiles)
        pass2_programs_per_sm = pass2_programs_per_sm or max(1, tuning.pass2_warps_per_sm // num_warps_reduce)
        tiles_per_row = max(1, triton.cdiv(pass2_programs_per_sm * sm_count, batch))
        tile = triton.cdiv(out_steps, min(tiles_per_row, out_steps)) * block_p
    if tile % block_p:
        raise ValueError(f"tile ({tile}) must be a multiple of block_p ({block_p}) and block_n ({block_n})")
    return LaunchConfig(
        block_n=block_n,
        num_splits=num_splits,
        chunk=blocks_per_split * block_n,
        tile=tile,
        block_p=block_p,
        block_r=block_r,
        num_warps=num_warps or (8 if key_bytes == 4 else 4),  # fp32: an FMA dot, more registers
        num_stages=num_stages or (3 if block_n * block_d <= 64 * 128 else 2),
        num_warps_reduce=num_warps_reduce,
        num_stages_reduce=num_stages_reduce or tuning.pass2_stages,
        layers_per_pass2=layers_per_pass2 or 0,
    )


def call_config(
    queries: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor],
    heads: Sequence[tuple[int, ...]],
    group_size: int,
    num_positions: int,
    key_span: int,
    *,
    tuning: ScoreTuning | None = None,
    **overrides,
) -> LaunchConfig:
    """The :func:`launch_config` that :func:`attention_mass_layers_triton` launches these layers with
    (``overrides``: launch keywords of :func:`launch_config`); the inputs as that function takes them."""
    n_queries, head_dim = queries[0].shape[1], queries[0].shape[3]
    m_tiles = [
        [triton.cdiv(n_queries * len(members), _MAX_BLOCK_M) for _, members in _kv_groups(layer, group_size)]
        for layer in heads
    ]
    batch = queries[0].shape[0]
    return launch_config(
        batch,
        batch * max(sum(tiles) for tiles in m_tiles),
        head_dim,
        max(key_span, num_positions),
        num_positions,
        sm_count(keys[0].device),
        key_bytes=keys[0].element_size(),
        rows=n_queries * sum(len(layer) for layer in heads),
        tuning=tuning,
        **overrides,
    )


# Sizes that change every decode step (span, strides of per-call buffers) must not be specialised on:
# each new divisibility pattern would compile a new kernel in the middle of decoding. The keys' strides are
# the cache buffer's, fixed for a run, and are specialised: without their divisibility by 16 Triton cannot
# prove a key row 16-byte aligned and loads the keys 2 bytes at a time, unpipelined, at a fraction of the copy
# bandwidth. The per-call buffers' strides are multiples of BLOCK_N by construction, which
# tl.multiple_of tells the compiler instead (so the 16-bit scores are stored and read 16 bytes at a time).
@triton.jit(
    do_not_specialize=[
        "stride_qb",
        "stride_pb",
        "stride_pr",
        "stride_mb",
        "stride_mt",
        "stride_eb",
        "stride_lb",
        "stride_lr",
        "stride_xb",
        "stride_cb",
        "span",
        "chunk",
    ]
)
def _score_pass1_kernel(
    Q,
    K,
    QPOS,  # Q (B, n_q, N_HEADS, D) of one KV head; K (B, capacity, D) that KV head's keys
    QCOUNT,  # (B,) int, read iff HAS_COUNTS: query j of row b counts iff j < QCOUNT[b]
    SHIFTED,
    TILE_MAX,
    LSE,  # outputs: (B, R, >= span), (B, n_tiles, R), (B, R) the rows' log-sum-exps
    LSE_PART,
    TICKETS,  # (B, R, num_splits) per-split log-sum-exps; (>= B * M_TILES,) int32 zeroed counters
    qk_scale,  # softmax_scale * log2(e): scores come out in base-2 units
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_pb,
    stride_pr,  # SHIFTED, unit stride along positions
    stride_mb,
    stride_mt,  # TILE_MAX, unit stride along rows (a tile's maxima are one write)
    stride_eb,  # LSE, unit stride along rows
    stride_lb,
    stride_lr,  # LSE_PART, unit stride along splits
    stride_xb,
    stride_xt,  # QPOS
    stride_cb,  # QCOUNT
    query_offset,
    query_step,  # query j of row b sits at QPOS[b, j] + query_offset + j * query_step
    span,
    chunk,  # key positions to cover (host int); positions per split (multiple of BLOCK_N)
    N_QUERIES: tl.constexpr,
    N_HEADS: tl.constexpr,
    ALL_HEADS: tl.constexpr,
    HEAD_OFFSET: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    M_TILES: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits, a power of two; 1: one split, which writes LSE itself
    PDL: tl.constexpr,
):
    await_producers(PDL)
    split = tl.program_id(0) // M_TILES
    m_tile = tl.program_id(0) % M_TILES
    b = tl.program_id(1).to(tl.int64)  # int64: batch offsets of a large cache overflow int32

    # Packed rows: row r = (query r // N_HEADS, head slot r % N_HEADS) -> buffer row j * ALL_HEADS + k.
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = rows < N_QUERIES * N_HEADS
    query = rows // N_HEADS  # (BLOCK_M,); >= N_QUERIES only on padding rows
    slot = rows % N_HEADS
    out_row = query * ALL_HEADS + HEAD_OFFSET + slot  # (BLOCK_M,) row in SHIFTED / TILE_MAX / LSE_PART
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + query[:, None] * stride_qt + slot[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    q = q.to(K.dtype.element_ty)  # as the reference: queries meet the keys in the keys' dtype
    last = tl.load(QPOS + b * stride_xb + query * stride_xt, mask=row_ok, other=0).to(tl.int32)
    last = tl.where(row_ok, last + query_offset + query * query_step, -1)  # (BLOCK_M,)
    if HAS_COUNTS:  # a query past its row's count sees nothing: it adds nothing, and pass 1 reads no key for it
        last = tl.where(query < tl.load(QCOUNT + b * stride_cb), last, -1)

    lo = tl.multiple_of(split * chunk, BLOCK_N)  # chunk is a multiple of BLOCK_N (host)
    hi = tl.minimum(tl.minimum(lo + chunk, span), tl.max(last, 0) + 1)  # nothing past the last visible key

    k_base = K + b * stride_kb + d[None, :] * stride_kd  # (1, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        key_ok = n < hi
        k = tl.load(
            k_base + n[:, None].to(tl.int64) * stride_kt,
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )  # streamed once: leave L2 to SHIFTED
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) fp32
        s = tl.where(key_ok[None, :] & (n[None, :] <= last[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # -inf while a row has seen nothing
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        x = s - m_safe[:, None]  # (BLOCK_M, BLOCK_N) <= 0, -inf where hidden
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(x), 1)
        m_i = m_new
        x_ptrs = SHIFTED + tl.multiple_of(b * stride_pb + out_row * stride_pr, BLOCK_N)[:, None] + n[None, :]
        # whole tiles (the rows are padded to them, and a split owns whole tiles), so the stores vectorise;
        # x = -inf past `hi`, where no query looks
        tl.store(
            x_ptrs, x.to(SHIFTED.dtype.element_ty), mask=row_ok[:, None], eviction_policy="evict_last"
        )  # pass 2 reads it back soon: keep it in L2 if it fits
        tl.store(TILE_MAX + b * stride_mb + (start // BLOCK_N) * stride_mt + out_row, m_new, mask=row_ok)

    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))  # base 2
    if BLOCK_S == 1:
        tl.store(LSE + b * stride_eb + out_row, tl.where(l_i == 0.0, 0.0, lse), mask=row_ok)  # finite, as merged
    else:
        part_rows = b * stride_lb + out_row * stride_lr  # (BLOCK_M,)
        tl.store(LSE_PART + part_rows + split, lse, mask=row_ok)
        _merge_lse_if_last(
            TICKETS + b * M_TILES + m_tile,
            tl.num_programs(0) // M_TILES,
            LSE_PART + part_rows,
            LSE + b * stride_eb + out_row,
            row_ok,
            BLOCK_S,
        )


@triton.jit
def _merge_lse_if_last(ticket, num_splits, part_ptrs, lse_ptrs, row_ok, BLOCK_S: tl.constexpr):
    """Take a ticket; the last of the ``num_splits`` programs of this (batch row, row tile) merges the
    splits' log-sum-exps of its rows (``part_ptrs``: split 0 of each, unit split stride) into ``lse_ptrs``
    and resets the counter to 0 for the next launch.

    Memory ordering as in :func:`dustin_hf.kernels.triton_verify._merge_if_last` (the grid-sync pattern):
    the CTA barrier orders every thread's partial store before the atomic, whose release at GPU scope
    publishes them; the last arriver's acquire sees every earlier release, and its loads go through L2
    (``.cg``). Programs only count, none waits, so any schedule of the grid terminates.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")  # tickets taken before this one
    if arrived == num_splits - 1:
        s = tl.arange(0, BLOCK_S)
        part = tl.load(
            part_ptrs[:, None] + s[None, :],
            mask=row_ok[:, None] & (s[None, :] < num_splits),
            other=float("-inf"),
            cache_modifier=".cg",
        )  # (BLOCK_M, BLOCK_S); empty splits are -inf
        part_max = tl.max(part, 1)
        part_max = tl.where(part_max == float("-inf"), 0.0, part_max)
        total = tl.sum(tl.exp2(part - part_max[:, None]), 1)  # 0 iff the row's query sees nothing
        lse = part_max + tl.log2(tl.where(total == 0.0, 1.0, total))  # 0 (finite) on a row that sees nothing
        tl.store(lse_ptrs, lse, mask=row_ok)
        tl.store(ticket, 0)  # every split has its ticket: nothing reads the counter again in this launch


@triton.jit(
    do_not_specialize=[
        "stride_pb",
        "stride_pr",
        "stride_mb",
        "stride_mt",
        "stride_eb",
        "stride_xb",
        "stride_cb",
        "stride_ob",
        "num_positions",
        "tile",
    ]
)
def _score_pass2_kernel(
    SHIFTED,
    TILE_MAX,
    LSE,
    QPOS,
    QCOUNT,
    LIMIT,
    OUT,  # QCOUNT as in pass 1; LIMIT (B,) read iff HAS_LIMIT
    stride_pb,
    stride_pr,
    stride_mb,
    stride_mt,
    stride_eb,
    stride_xb,
    stride_xt,
    stride_cb,
    stride_limit,
    stride_ob,
    query_offset,
    query_step,  # as in pass 1
    num_positions,
    tile,
    N_ROWS: tl.constexpr,
    ALL_HEADS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    SHARED_POS: tl.constexpr,  # every query of a row reads QPOS[b, 0] (a stride-0 view, or one query)
    PDL: tl.constexpr,
):
    """``out[b, p] (+)= sum_r exp2(x[r, p] + m[r, p // BLOCK_N] - lse[r])`` over rows whose query sees ``p``.

    A step covers ``BLOCK_T`` of pass 1's tiles (``BLOCK_T * BLOCK_N`` positions) of all rows, in
    ``ROW_BLOCKS`` blocks of ``BLOCK_R`` rows: each block's scores are one ``(BLOCK_R, BLOCK_T, BLOCK_N)``
    load, and the blocks add up elementwise before the one reduction over rows.
    """
    await_producers(PDL)
    b = tl.program_id(1).to(tl.int64)
    lo = tl.multiple_of(tl.program_id(0) * tile, BLOCK_T * BLOCK_N)  # tile: a multiple of the step (host)
    hi = tl.minimum(lo + tile, num_positions)
    t = tl.arange(0, BLOCK_T)
    if HAS_LIMIT:
        limit = tl.load(LIMIT + b * stride_limit).to(tl.int32)
    if SHARED_POS:
        first_pos = tl.load(QPOS + b * stride_xb).to(tl.int32)
    if HAS_COUNTS:
        counted = tl.load(QCOUNT + b * stride_cb).to(tl.int32)
    for start in tl.range(lo, hi, BLOCK_T * BLOCK_N, num_stages=NUM_STAGES):
        tile_start = start + t * BLOCK_N  # (BLOCK_T,) first position of each of pass 1's tiles
        n = tile_start[:, None] + tl.arange(0, BLOCK_N)[None, :]  # (BLOCK_T, BLOCK_N) positions
        pos_ok = n < hi
        out_ptrs = OUT + b * stride_ob + n
        if ACCUMULATE:
            mass = tl.load(out_ptrs, mask=pos_ok, other=0.0)  # issued first: nothing below waits for it
        else:
            mass = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        probs = tl.zeros([BLOCK_R, BLOCK_T, BLOCK_N], tl.float32)
        for rb in tl.static_range(ROW_BLOCKS):
            r = rb * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) buffer rows j * ALL_HEADS + k
            r_ok = r < N_ROWS
            x = tl.load(
                SHIFTED + tl.multiple_of(b * stride_pb + r * stride_pr, BLOCK_N)[:, None, None] + n[None, :, :],
                mask=r_ok[:, None, None],
                eviction_policy="evict_first",
            )  # (BLOCK_R, BLOCK_T, BLOCK_N), whole tiles (vectorised)
            lse = tl.load(LSE + b * stride_eb + r, mask=r_ok, other=0.0)  # (BLOCK_R,), L1 after the first step
            query = r // ALL_HEADS
            if SHARED_POS:  # no load in the loop: every query's position derives from the row's one
                last = first_pos
            else:
                last = tl.load(QPOS + b * stride_xb + query * stride_xt, mask=r_ok, other=0).to(tl.int32)
            last = last + query_offset + query * query_step
            # pass 1 skipped what no query sees: `seen` / `tile_seen` keep that garbage out (where, not *)
            last = tl.where(r_ok, tl.minimum(last, hi - 1), -1)  # padding rows see nothing, nobody sees >= hi
            if HAS_COUNTS:  # nor does a query past its row's count (pass 1 saw no key for it)
                last = tl.where(query < counted, last, -1)
            tile_seen = tile_start[None, :] <= last[:, None]  # (BLOCK_R, BLOCK_T): pass 1 wrote this row's tile
            # masked by what the buffer holds, not by `tile_seen`: no load waits for another inside the loop
            tile_max = tl.load(
                TILE_MAX + b * stride_mb + (tile_start // BLOCK_N)[None, :] * stride_mt + r[:, None],
                mask=r_ok[:, None] & (tile_start < hi)[None, :],
                other=0.0,
            )
            offset = tl.where(tile_seen, tile_max - lse[:, None], 0.0)  # (BLOCK_R, BLOCK_T), <= 0
            seen = n[None, :, :] <= last[:, None, None]  # (BLOCK_R, BLOCK_T, BLOCK_N): one compare a score
            probs += tl.where(seen, tl.exp2(x.to(tl.float32) + offset[:, :, None]), 0.0)
        mass += tl.sum(probs, 0)  # (BLOCK_T, BLOCK_N)
        if HAS_LIMIT:
            mass = tl.where(n < limit, mass, 0.0)
        tl.store(out_ptrs, mass, mask=pos_ok)


def attention_mass_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_pos: torch.Tensor,
    heads: tuple[int, ...],
    group_size: int,
    softmax_scale: float,
    num_positions: int,
    key_span: int,
    *,
    out: torch.Tensor | None = None,
    position_limit: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    tuning: ScoreTuning | None = None,
    query_offset: int = 0,
    query_step: int = 0,
    query_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed attention probabilities of ``queries`` over key positions ``[0, num_positions)``.

    Same contract as :func:`dustin_hf.selection.scoring.attention_mass`.

    Args:
        queries: ``(B, n_q, len(heads), D)``, fp16/bf16/fp32, post-RoPE queries of query heads
            ``heads``; any strides. Cast to ``keys``' dtype before the product (as the reference).
        keys: ``(B, capacity, kv_heads, D)``, fp16/bf16/fp32, a cache buffer; any strides.
        query_pos: ``(B, n_q)``, int32/int64; query j of row b sees key positions ``<= query_pos[b, j]``.
        heads: query head ids; head h reads KV head ``h // group_size``.
        softmax_scale: the model's attention scale.
        num_positions: how many leading key positions to score (host int).
        key_span: one past the last position any query sees (host int; ``max(query_pos) + 1`` when
            ``query_offset`` and ``query_step`` are 0), at most ``capacity``.
        out: ``(B, num_positions)`` fp32, contiguous rows, to add into instead of a fresh tensor.
        position_limit: ``(B,)`` int; zeroes ``out[b, p]`` for ``p >= position_limit[b]`` after the addition.
        config: this call's launch parameters instead of the heuristic's (:func:`call_config`).
        tuning: the launch heuristic's constants (``None``: the defaults).
        query_offset, query_step: query j of row b sits at ``query_pos[b, j] + query_offset + j * query_step``
            instead (host ints), so positions derived from a per-row length (the draft's ``L_b + j``, the
            target's ``L_b - 1``) can be passed as a stride-0 view of the lengths, with no kernel to make them.
        query_counts: ``(B,)`` int32/int64: row b counts only its first ``query_counts[b]`` queries, the others add
            nothing (``None``: all ``n_q``).

    Returns:
        ``(B, num_positions)`` float32 (a query that sees no key at all adds nothing).
    """
    return attention_mass_layers_triton(
        [queries],
        [keys],
        query_pos,
        [heads],
        group_size,
        softmax_scale,
        num_positions,
        key_span,
        out=out,
        position_limit=position_limit,
        config=config,
        tuning=tuning,
        query_offset=query_offset,
        query_step=query_step,
        query_counts=query_counts,
    )


def attention_mass_layers_triton(
    queries: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor],
    query_pos: torch.Tensor,
    heads: Sequence[tuple[int, ...]],
    group_size: int,
    softmax_scale: float,
    num_positions: int,
    key_span: int,
    *,
    out: torch.Tensor | None = None,
    position_limit: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    tuning: ScoreTuning | None = None,
    query_offset: int = 0,
    query_step: int = 0,
    query_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum over layers of :func:`attention_mass_triton`, with one pass 2 for all of them.

    Every layer's rows go into one set of buffers (the rows of all layers' heads, numbered
    ``j * total_heads + k`` with ``k`` running over the layers' heads in order), so pass 2 sums them
    in registers and reads and writes the output once, however many layers there are.

    Args:
        queries: per layer ``(B, n_q, len(heads[l]), D)``; one ``B``, ``n_q`` and ``D`` for all layers.
        keys: per layer ``(B, capacity_l, kv_heads_l, D)``, one dtype for all layers.
        query_pos, group_size, softmax_scale, num_positions, key_span, out, position_limit, config, tuning,
            query_offset, query_step, query_counts: as in :func:`attention_mass_triton`; the queries of every layer
            sit at the same positions.

    Returns:
        ``(B, num_positions)`` float32.
    """
    heads = [tuple(int(h) for h in layer_heads) for layer_heads in heads]
    if not queries or not (len(queries) == len(keys) == len(heads)):
        raise ValueError(
            f"need one queries, keys and heads entry per layer (at least one); got {len(queries)}, "
            f"{len(keys)} and {len(heads)}"
        )
    for layer_queries, layer_keys, layer_heads in zip(queries, keys, heads):
        _check_inputs(
            layer_queries,
            layer_keys,
            query_pos,
            layer_heads,
            group_size,
            num_positions,
            key_span,
            out,
            position_limit,
            query_counts,
        )
        if (
            layer_keys.dtype != keys[0].dtype
            or layer_keys.device != keys[0].device
            or layer_queries.shape[1::2] != queries[0].shape[1::2]
        ):
            raise ValueError(
                "all layers need one key dtype and device, one number of queries and one head dim; "
                "call attention_mass_triton per layer (with out=) otherwise"
            )
    batch, n_queries, _, head_dim = queries[0].shape
    device = keys[0].device
    span = max(key_span, num_positions)
    if num_positions == 0 or batch == 0:
        return out if out is not None else torch.empty(batch, num_positions, dtype=torch.float32, device=device)
    groups = [_kv_groups(layer_heads, group_size) for layer_heads in heads]  # per layer [(kv_head, [indices])]
    m_tiles = [[triton.cdiv(n_queries * len(members), _MAX_BLOCK_M) for _, members in layer] for layer in groups]
    total_heads = sum(len(layer_heads) for layer_heads in heads)
    n_rows = n_queries * total_heads
    given = config
    if config is None:  # splits sized per layer as for one layer alone (the largest layer's)
        config = call_config(queries, keys, heads, group_size, num_positions, key_span, tuning=tuning)
    if 0 < config.layers_per_pass2 < len(queries):  # several pass 2s, each adding into the output
        step = config.layers_per_pass2
        for first in range(0, len(queries), step):
            last = first + step >= len(queries)
            out = attention_mass_layers_triton(
                queries[first : first + step],
                keys[first : first + step],
                query_pos,
                heads[first : first + step],
                group_size,
                softmax_scale,
                num_positions,
                key_span,
                out=out,
                position_limit=position_limit if last else None,
                config=given,  # None: each group of layers sizes its own pass 2
                tuning=tuning,
                query_offset=query_offset,
                query_step=query_step,
                query_counts=query_counts,
            )
        return out
    if out is None:
        out = torch.empty(batch, num_positions, dtype=torch.float32, device=device)
        accumulate = False
    else:
        accumulate = True
    prepare_interpreter()

    shifted, tile_max, lse = _pass1_buffers(batch, n_rows, n_rows, buffer_tiles(span, config), config.block_n, keys[0])
    split = config.num_splits > 1
    lse_part = torch.empty(batch, n_rows, config.num_splits, dtype=torch.float32, device=device) if split else lse
    counters = tickets(device, batch * max(max(tiles) for tiles in m_tiles)) if split else lse  # else unused
    block_d = max(16, triton.next_power_of_2(head_dim))
    pdl = dependent_launch(out)
    counts = query_counts if query_counts is not None else query_pos  # placeholder, never read
    head_offset = 0
    for layer_queries, layer_keys, layer_groups, layer_tiles in zip(queries, keys, groups, m_tiles):
        for (kv_head, members), tiles in zip(layer_groups, layer_tiles):
            group_queries = _heads(layer_queries, members)  # (B, n_q, n_h, D)
            group_keys = layer_keys[:, :, kv_head]  # (B, capacity, D)
            rows = n_queries * len(members)
            _score_pass1_kernel[(config.num_splits * tiles, batch)](
                group_queries,
                group_keys,
                query_pos,
                counts,
                shifted,
                tile_max,
                lse,
                lse_part,
                counters,
                softmax_scale * _LOG2E,
                *group_queries.stride(),
                *group_keys.stride(),
                *shifted.stride()[:2],
                *tile_max.stride()[:2],
                lse.stride(0),
                *lse_part.stride()[:2],
                *query_pos.stride(),
                counts.stride(0),
                query_offset,
                query_step,
                span,
                config.chunk,
                N_QUERIES=n_queries,
                N_HEADS=len(members),
                ALL_HEADS=total_heads,
                HEAD_OFFSET=head_offset,
                HEAD_DIM=head_dim,
                M_TILES=tiles,
                HAS_COUNTS=query_counts is not None,
                BLOCK_M=min(_MAX_BLOCK_M, max(16, triton.next_power_of_2(rows))),
                BLOCK_N=config.block_n,
                BLOCK_D=block_d,
                DOT_PRECISION="ieee" if keys[0].dtype == torch.float32 else "tf32",
                BLOCK_S=triton.next_power_of_2(config.num_splits) if split else 1,
                PDL=pdl,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
                launch_pdl=pdl,
            )
            head_offset += len(members)
    _pass2(
        shifted,
        tile_max,
        lse,
        query_pos,
        query_counts,
        position_limit,
        out,
        accumulate,
        config,
        n_rows,
        total_heads,
        num_positions,
        query_offset,
        query_step,
        pdl,
    )
    return out


def _pass2(
    shifted,
    tile_max,
    lse,
    query_pos,
    query_counts,
    position_limit,
    out,
    accumulate,
    config,
    n_rows,
    total_heads,
    num_positions,
    query_offset,
    query_step,
    pdl,
) -> None:
    """Launch pass 2 over pass 1's buffers (rows ``j * total_heads + k``) into ``out``."""
    counts = query_counts if query_counts is not None else query_pos  # placeholder, never read
    limit = position_limit if position_limit is not None else query_pos  # placeholder, never read
    block_r = min(config.block_r, triton.next_power_of_2(n_rows))
    _score_pass2_kernel[(triton.cdiv(num_positions, config.tile), out.shape[0])](
        shifted,
        tile_max,
        lse,
        query_pos,
        counts,
        limit,
        out,
        *shifted.stride()[:2],
        *tile_max.stride()[:2],
        lse.stride(0),
        *query_pos.stride(),
        counts.stride(0),
        limit.stride(0),
        out.stride(0),
        query_offset,
        query_step,
        num_positions,
        config.tile,
        N_ROWS=n_rows,
        ALL_HEADS=total_heads,
        BLOCK_R=block_r,
        ROW_BLOCKS=triton.cdiv(n_rows, block_r),
        BLOCK_T=config.block_p // config.block_n,
        BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages_reduce,
        ACCUMULATE=accumulate,
        HAS_LIMIT=position_limit is not None,
        HAS_COUNTS=query_counts is not None,
        SHARED_POS=query_pos.shape[1] == 1 or query_pos.stride(1) == 0,
        PDL=pdl,
        num_warps=config.num_warps_reduce,
        launch_pdl=pdl,
    )


@dataclasses.dataclass(frozen=True)
class ScoreBuffers:
    """Pass 1's outputs, written by another kernel that reads the keys anyway (the dense verification kernel at a
    selection layer, :func:`dustin_hf.kernels.triton_verify.verify_attention_scores_triton`), for pass 2 to sum.

    Rows are numbered ``j * heads + h`` (query ``j``, query head ``h``), as pass 1 numbers them.

    Attributes:
        shifted: ``(B, queries * heads, tiles * block_n)``, each score minus the running max of its row (fp16 for
            16-bit keys, fp32 for fp32), ``-inf`` past the keys it covers; positions no split wrote are never read.
        tile_max: ``(B, tiles, queries * heads)`` fp32, the running max after each key tile.
        lse: ``(B, lse_queries * heads)`` fp32, each row's log-sum-exp (base 2) over the cached positions; the rows
            of queries past ``queries`` are padding, so that the writer's flat row index (over all its queries)
            addresses it, and are never read.
        config: pass 2's launch parameters (``block_n``: the writer's key tile).
        queries, heads: the scoring queries (the leading ones) and query heads.
        span: the positions covered, ``>= max(cache_seqlens)`` of the writer's call.
    """

    shifted: torch.Tensor
    tile_max: torch.Tensor
    lse: torch.Tensor
    config: LaunchConfig
    queries: int
    heads: int
    span: int


def score_buffers(
    batch: int,
    queries: int,
    lse_queries: int,
    heads: int,
    span: int,
    block_n: int,
    head_dim: int,
    keys: torch.Tensor,
    *,
    written: int | None = None,
    tuning: ScoreTuning | None = None,
) -> ScoreBuffers:
    """Empty :class:`ScoreBuffers` for ``queries`` scoring queries of ``heads`` heads over ``span`` positions, in key
    tiles of ``block_n`` (the writer's), sized for pass 2's whole steps (:func:`buffer_tiles`) and for the whole
    tiles of the ``written`` positions the writer may cover (``None``: ``span``); ``lse_queries``: the writer's
    queries (``>= queries``); ``keys``: the cache the writer reads (dtype, device)."""
    rows = queries * heads
    config = launch_config(
        batch,
        batch,
        head_dim,
        span,
        span,
        sm_count(keys.device),
        key_bytes=keys.element_size(),
        rows=rows,
        tuning=tuning,
        block_n=block_n,
    )
    tiles = max(buffer_tiles(span, config), triton.cdiv(max(span, written or 0), block_n))
    shifted, tile_max, lse = _pass1_buffers(batch, rows, lse_queries * heads, tiles, block_n, keys)
    return ScoreBuffers(shifted, tile_max, lse, config=config, queries=queries, heads=heads, span=span)


def _pass1_buffers(
    batch: int, rows: int, lse_rows: int, tiles: int, block_n: int, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1's outputs, empty: the shifted scores ``(B, rows, tiles * block_n)`` (fp32 for fp32 keys, else fp16;
    rows padded to whole tiles, so a row stride divisible by 16 lets Triton vectorise the 16-bit accesses), the tile
    maxima ``(B, tiles, rows)`` and the log-sum-exps ``(B, lse_rows)``, fp32, on the keys' device."""
    shifted_dtype = torch.float32 if keys.dtype == torch.float32 else torch.float16  # scores - running max
    return (
        torch.empty(batch, rows, tiles * block_n, dtype=shifted_dtype, device=keys.device),
        torch.empty(batch, tiles, rows, dtype=torch.float32, device=keys.device),
        torch.empty(batch, lse_rows, dtype=torch.float32, device=keys.device),
    )


def attention_mass_from_scores(
    buffers: ScoreBuffers, cache_seqlens: torch.Tensor, query_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Pass 2 over ``buffers``: per row ``b`` and position ``p < buffers.span``, the sum over heads and counted
    queries of each query's attention over the cached positions ``[0, cache_seqlens[b])`` (``query_counts``: row
    ``b`` counts its first ``query_counts[b]`` queries; ``None``: all). Returns ``(B, span)`` fp32, 0 past each
    row's length."""
    prepare_interpreter()
    batch, span = buffers.shifted.shape[0], buffers.span
    out = torch.empty(batch, span, dtype=torch.float32, device=buffers.shifted.device)
    if span == 0 or batch == 0:
        return out
    seqlens = cache_seqlens.to(out.device)
    query_pos = seqlens[:, None].expand(batch, buffers.queries)  # every query sits at L_b - 1: offset -1 below
    _pass2(
        buffers.shifted,
        buffers.tile_max,
        buffers.lse,
        query_pos,
        query_counts,
        None,
        out,
        False,
        buffers.config,
        buffers.queries * buffers.heads,
        buffers.heads,
        span,
        -1,
        0,
        dependent_launch(out),
    )
    return out


def buffer_tiles(span: int, config: LaunchConfig) -> int:
    """Key tiles per row of pass 1's buffers: ``span`` rounded up to whole pass 2 steps, whose loads (masked by row
    only) read whole steps and must stay inside each row."""
    step_tiles = config.block_p // config.block_n
    return triton.cdiv(triton.cdiv(span, config.block_n), step_tiles) * step_tiles


def _heads(queries: torch.Tensor, members: list[int]) -> torch.Tensor:
    """``queries[:, :, members]`` without an index tensor (a host copy, which a CUDA graph capture refuses): a
    strided view where ``members`` are evenly spaced, else stacked views."""
    step = members[1] - members[0] if len(members) > 1 else 1
    if step > 0 and members == list(range(members[0], members[-1] + 1, step)):
        return queries[:, :, members[0] : members[-1] + 1 : step]
    return torch.stack([queries[:, :, i] for i in members], dim=2)


def _kv_groups(heads: tuple[int, ...], group_size: int) -> list[tuple[int, list[int]]]:
    """``[(kv_head, [i for i, h in enumerate(heads) if h // group_size == kv_head])]`` by kv head."""
    return [
        (kv, [i for i, h in enumerate(heads) if h // group_size == kv])
        for kv in sorted({h // group_size for h in heads})
    ]


def _check_inputs(
    queries, keys, query_pos, heads, group_size, num_positions, key_span, out, position_limit, query_counts=None
) -> None:
    """Shape/dtype checks on host metadata only (no device reads)."""
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(
            f"queries must be (B, n_q, len(heads), D) and keys (B, capacity, kv_heads, D); "
            f"got {tuple(queries.shape)} and {tuple(keys.shape)}"
        )
    batch, n_queries, n_heads, head_dim = queries.shape
    if n_heads != len(heads) or not heads:
        raise ValueError(f"queries hold {n_heads} heads but heads={heads}")
    if keys.shape[0] != batch or keys.shape[3] != head_dim:
        raise ValueError(f"keys must be ({batch}, capacity, kv_heads, {head_dim}); got {tuple(keys.shape)}")
    if min(heads) < 0 or max(heads) // group_size >= keys.shape[2]:
        raise ValueError(f"heads {heads} with group_size {group_size} need KV heads the keys ({keys.shape[2]}) lack")
    for name, t in (("queries", queries), ("keys", keys)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be fp16, bf16 or fp32; got {t.dtype}")
    if head_dim > 256:
        raise ValueError(f"head dims up to 256 are supported; got {head_dim}")
    if query_pos.shape != (batch, n_queries) or query_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"query_pos must be ({batch}, {n_queries}) int32/int64; got {tuple(query_pos.shape)} {query_pos.dtype}"
        )
    if max(key_span, num_positions) > keys.shape[1]:
        raise ValueError(
            f"key_span ({key_span}) and num_positions ({num_positions}) must fit the keys' capacity ({keys.shape[1]})"
        )
    if out is not None and (out.shape != (batch, num_positions) or out.dtype != torch.float32 or out.stride(-1) != 1):
        raise ValueError(f"out must be ({batch}, {num_positions}) float32 with unit stride along positions")
    if position_limit is not None and position_limit.shape != (batch,):
        raise ValueError(f"position_limit must be ({batch},); got {tuple(position_limit.shape)}")
    if query_counts is not None and (
        query_counts.shape != (batch,) or query_counts.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"query_counts must be ({batch},) int32/int64; got {tuple(query_counts.shape)} {query_counts.dtype}"
        )
