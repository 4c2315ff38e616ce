"""Fused Triton kernel for verification attention over selected cache positions (split-K decoding).

Computes exactly :func:`dustin_hf.kernels.reference.verify_attention_reference`: each of the ``Q``
new queries of row ``b`` attends to the selected cached positions ``indices[b, :num_indices[b]]``
(or to all of ``[0, cache_seqlens[b])`` in dense mode) plus the step's new tokens at slots
``cache_seqlens[b] + j`` for ``j <= i`` (bottom-right causal).

Why a custom kernel: the alternative (gather the selection into a packed copy, then run a varlen
flash kernel) reads the selected K/V rows, writes them, and reads them again. Here every program
reads the K/V rows straight out of the full cache by index, so the selected rows cross HBM once.

Algorithm (flash-decoding):

* **Keys of a row.** Row ``b`` has ``n_keys = n_cached + Q`` keys in a fixed order: key ordinal
  ``n < n_cached`` is cached position ``indices[b, n]`` (sparse) or ``n`` (dense, where
  ``n_cached = cache_seqlens[b]``); ordinal ``n >= n_cached`` is the new token slot
  ``cache_seqlens[b] + (n - n_cached)``. Query ``i`` sees ordinal ``n`` iff ``n - n_cached <= i``,
  which is always true for cached keys and is the causal mask ``j <= i`` for the new tokens. In dense
  mode (and sparse with one query) the new tokens are just the tail of the key sequence, processed
  once by whichever split owns it. In sparse mode with several queries they are not in the loop:
  split 0 attends to them first, in a tile of ``BLOCK_T >= Q`` keys of their own, and the splits
  divide the ``W`` selected ordinals only. A budget of 512 is then 8 tiles of 64, not 8 and a ninth
  holding 5 keys, which costs about as much as a full one (each tile waits for its gathers); the
  separate tile costs less. One query keeps its new token in the loop: there a tile of its own costs
  more than the one key adds to the last tile.
* **Open loops.** Where every row sees every key of the loop (sparse with the new tokens apart, or one
  query), the loop is lean (``OPEN_LOOP``): no causal mask, the scale and the mask of keys past the
  loop's end one multiply-add with a bias of 0 / ``-inf`` per key, no guard for rows that have seen
  nothing (each tile holds a visible key), the K/V gathers unmasked (ordinals past the end read slot
  0, a real row), their slot offsets in int32 where the cache allows and shared by K and V where the
  strides agree. The kernel is bound by one warpgroup's instruction latency, not by memory (its time
  follows the SM clock; one warp per scheduler), so instructions are time: the open loop's 64-key tile
  takes about a third fewer than the masked one. Dense mode with several queries keeps the masked loop,
  except a selection layer's call (``SCORES``, :func:`verify_attention_scores_triton`): its loop walks the cached
  positions only, open, and split 0 attends to the new tokens after it, so each split's running max and sum
  are those of the cached positions alone, which the scoring needs.
* **GQA packing.** The ``G = Hq / Hkv`` query heads sharing one KV head and the ``Q`` queries are
  packed into one ``M = G * Q`` row block (row ``r`` is query ``r // G``, head ``r % G`` of the
  group), padded to ``BLOCK_M >= 16`` for ``tl.dot``. Each K/V tile is loaded once per group.
* **Grid.** ``(num_splits * m_tiles, Hkv, B)``: one program per (split, row tile, kv head, batch
  row). ``m_tiles = ceil(G * Q / BLOCK_M)`` is 1 unless ``G * Q > 128``. Split ``s`` owns key
  ordinals ``[s * chunk, min((s + 1) * chunk, n_keys))`` and walks them in ``BLOCK_N`` tiles with an
  online softmax in fp32 (exp2, scores pre-multiplied by ``softmax_scale * log2(e)``). A split
  beyond a short row's keys runs zero iterations and writes ``lse = -inf``, ``out = 0``.
* **Merge.** With one split the program normalises and writes the output directly. Otherwise it
  writes a normalised partial output (fp32) and its log-sum-exp (base 2), and the splits of each
  (row, query, head) are combined by log-sum-exp (empty splits get weight ``exp2(-inf) = 0``) in one
  of two ways (``LaunchConfig.merge``): ``"ticket"``, in the same launch: each split takes a ticket from
  an atomic counter per (batch row, kv head, row tile) once its partial is stored, and the last to
  arrive merges all of them and resets the counter to 0 for the next launch; or ``"kernel"``, a second
  launch of :func:`_merge_splits_kernel` (one program per output row, better when the splits are many
  and one program would read them all alone). The counters live in a zeroed buffer per device
  (:func:`dustin_hf.kernels._device.tickets`), allocated once and left at zero by every launch, so a
  call captured in a CUDA graph replays correctly; two ticket-merge launches on one device must not run
  concurrently.
* **Pipelining.** Triton's software pipeliner overlaps the K/V gathers of later tiles with the
  current one. In sparse mode it splits ``num_stages`` between the index load and the K/V gathers
  whose addresses depend on it (Triton 3.6, sm_90, read off the compiled TTGIR and PTX; checked by
  ``tests/verify_ptx.py``): with 3-4 stages the gathers of tile ``t + 1`` are issued only once tile
  ``t`` is computed and are waited for right away, so every tile pays a full memory latency; with
  5-6 the gathers of one tile are in flight while another is computed, with 7-8 two, and the index
  loads are asynchronous copies issued further ahead. Sparse mode takes 5 stages when the buffers fit
  (:func:`_num_stages`): a second tile in flight costs more registers and shared memory than it hides.

The number of splits and the tile sizes come only from host-known sizes (``B``, ``Hkv``, ``W`` or
``max_seqlen_k``, the SM count), so a call with ``max_seqlen_k`` given (or in sparse mode) makes no
host sync and can be captured in a CUDA graph. :func:`launch_config` is the heuristic, its constants a
:class:`~dustin_hf.kernels.tuning.VerifyTuning`; a call takes either, or an explicit :class:`LaunchConfig`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import prepare_interpreter, sm_count, smem_limit, tickets
from .triton_launch import await_producers, dependent_launch
from .triton_score import ScoreBuffers, score_buffers
from .tuning import ScoreTuning, VerifyTuning

__all__ = [
    "LaunchConfig",
    "launch_config",
    "sparse_loop_keys",
    "verify_attention_scores_triton",
    "verify_attention_triton",
]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64  # the merge kernel holds (num_splits, head_dim) fp32 values of one row in registers
_MAX_BLOCK_M = 128
# "ticket" merge up to this many splits: the last split reads every partial (splits x BLOCK_M x D fp32)
# from L2 alone, while the merge kernel spreads that over one program per output row.
_MAX_TICKET_SPLITS = 8


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of one call; build with :func:`launch_config`.

    Attributes:
        block_m: packed (query, head) rows per program, a power of two >= 16.
        block_n: keys per inner-loop tile, a power of two >= 16.
        block_d: head dim padded to a power of two >= 16 (the padding is masked).
        num_splits: programs per (batch row, kv head, row tile) along the keys.
        chunk: key ordinals per split, a multiple of ``block_n``.
        num_warps, num_stages: Triton launch options of the main kernel.
        merge: how splits are combined: ``"none"`` (one split), ``"ticket"`` (the last split to
            finish, in the main kernel) or ``"kernel"`` (a second launch).
        int32_offsets: the open loop computes slot offsets in int32 where every offset of the cache fits
            (fewer instructions a tile); ``False``: in int64 always, as a cache of more than 2**31 elements
            per row needs.
    """

    block_m: int
    block_n: int
    block_d: int
    num_splits: int
    chunk: int
    num_warps: int
    num_stages: int
    merge: str
    int32_offsets: bool = True


def _shared_bytes(block_m: int, block_n: int, block_d: int, elem_bytes: int, num_stages: int, sparse: bool) -> int:
    """An upper bound of the shared memory Triton 3.6 gives the main kernel: the K and V tiles kept in flight
    (sparse: ``(stages - 1) // 2`` of each, the index loads take the other stages; dense: ``stages - 1``, at
    least one), q's tile, the probabilities' tile and 1 KiB. Compiled for sm_80 and sm_86 it bounds every
    configuration ``tests/smem_report.py`` compiles (bf16 and fp32, head dim 64 and 128, one and five queries,
    sparse and dense), by 0.5 to 9 KiB."""
    in_flight = max(1, (num_stages - 1) // 2 if sparse else num_stages - 1)
    return (in_flight * 2 * block_n * block_d + block_m * (block_d + block_n)) * elem_bytes + 1024


def _fit_shared(
    block_m: int, block_n: int, block_d: int, elem_bytes: int, num_stages: int, sparse: bool, limit: int
) -> tuple[int, int]:
    """``(block_n, num_stages)``: the given ones if :func:`_shared_bytes` fits ``limit``, else fewer stages
    (sparse 3, dense 2), then narrower key tiles (down to 16). fp32 inputs with head dim 128 need this on
    GPUs with less shared memory than an H100's (99 KiB a block on sm_86/89, 163 KiB on an A100)."""
    for n in (block_n, block_n // 2, block_n // 4):
        if n < 16:
            break
        for stages in dict.fromkeys((num_stages, 3 if sparse else 2)):
            if stages <= num_stages and _shared_bytes(block_m, n, block_d, elem_bytes, stages, sparse) <= limit:
                return n, stages
    raise ValueError(
        f"no launch configuration of the verification kernel fits {limit} bytes of shared memory "
        f"(block_m {block_m}, head dim {block_d}, {elem_bytes}-byte elements); use 16-bit inputs"
    )


def launch_config(
    batch: int,
    n_kv_heads: int,
    group: int,
    n_queries: int,
    head_dim: int,
    n_keys: int,
    sm_count: int,
    *,
    sparse: bool = False,
    elem_bytes: int = 2,
    tuning: VerifyTuning | None = None,
    smem_limit: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
) -> LaunchConfig:
    """Tile sizes and split count from host-known sizes only (no device data, so graph-safe).

    ``n_keys`` bounds the key ordinals the splits divide (:func:`sparse_loop_keys` in sparse mode,
    ``max_seqlen_k`` dense); ``elem_bytes`` is the size of one q/k/v element; ``tuning`` the heuristic's
    constants (:class:`~dustin_hf.kernels.tuning.VerifyTuning`). Any launch keyword left ``None`` takes the
    heuristic value. Splits: none for a short key range (at most ``tuning.short_range_blocks`` tiles) whose
    programs fill half the SMs already; otherwise enough programs to give every SM about
    ``tuning.sparse_programs_per_sm`` (sparse) or ``tuning.programs_per_sm`` (dense) of them (floor, so no
    partial extra wave), but never fewer than ``tuning.min_blocks_per_split`` key tiles per split, and at most
    ``_MAX_SPLITS`` (one query, sparse: the ``decode_*`` values, warps too). Merge: ``"ticket"`` up to
    ``_MAX_TICKET_SPLITS`` splits, else ``"kernel"``. Stages: :func:`_num_stages`. ``smem_limit`` (bytes a block
    may use): a heuristic key-tile width and stage count that would not fit are reduced (:func:`_fit_shared`);
    given ones are kept.
    """
    tuning = tuning or VerifyTuning()
    programs_per_sm = tuning.sparse_programs_per_sm if sparse else tuning.programs_per_sm
    min_blocks_per_split = tuning.min_blocks_per_split
    if sparse and n_queries == 1:  # a draft's decode step: its own defaults
        programs_per_sm, min_blocks_per_split = tuning.decode_programs_per_sm, tuning.decode_min_blocks_per_split
        num_warps = num_warps or tuning.decode_num_warps
    rows = group * n_queries
    block_m = min(_MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    m_tiles = triton.cdiv(rows, block_m)
    block_d = max(16, triton.next_power_of_2(head_dim))
    fit = smem_limit is not None and block_n is None and num_stages is None
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    if fit:
        block_n, num_stages = _fit_shared(
            block_m,
            block_n,
            block_d,
            elem_bytes,
            _num_stages(block_m, block_n, block_d, elem_bytes, sparse, tuning),
            sparse,
            smem_limit,
        )
    n_blocks = max(1, triton.cdiv(n_keys, block_n))
    programs = batch * n_kv_heads * m_tiles
    if num_splits is None and n_blocks <= tuning.short_range_blocks and 2 * programs >= sm_count:
        num_splits = 1
    if num_splits is None:
        by_occupancy = max(1, (programs_per_sm * sm_count) // max(1, programs))
        by_work = max(1, n_blocks // min_blocks_per_split)
        num_splits = min(by_occupancy, by_work, _MAX_SPLITS)
    num_splits = max(1, min(num_splits, n_blocks, _MAX_SPLITS))
    blocks_per_split = triton.cdiv(n_blocks, num_splits)
    num_splits = triton.cdiv(n_blocks, blocks_per_split)  # drop splits that would own no tile at all
    if num_warps is None:
        # dense, 128 (query, head) rows of head dim 128 (a confirming step's 13 queries of a 7-query-head group):
        # 40% of the copy bandwidth on an H200 with 4 warps, 62% with 8; other tiles
        # keep the rule they were tuned with
        wide = not sparse and block_m >= 128 and block_d >= 128
        num_warps = 8 if wide or block_m * block_d >= 128 * 256 else 4
    if num_stages is None:
        num_stages = _num_stages(block_m, block_n, block_d, elem_bytes, sparse, tuning)
    if num_splits == 1:
        merge = "none"
    elif merge is None:
        merge = "ticket" if num_splits <= _MAX_TICKET_SPLITS else "kernel"
    elif merge not in ("ticket", "kernel") or (merge == "ticket" and num_splits > _MAX_TICKET_SPLITS):
        raise ValueError(
            f"merge must be 'kernel', or 'ticket' with at most {_MAX_TICKET_SPLITS} splits; "
            f"got {merge!r} with {num_splits} splits"
        )
    return LaunchConfig(
        block_m, block_n, block_d, num_splits, blocks_per_split * block_n, num_warps, num_stages, merge
    )


def _num_stages(block_m: int, block_n: int, block_d: int, elem_bytes: int, sparse: bool, tuning: VerifyTuning) -> int:
    """Software-pipelining depth: in sparse mode the deepest of ``tuning.sparse_stages`` that fits.

    Sparse mode needs 2 more stages per K/V tile kept in flight (the index loads take the others;
    see the module docstring); ``num_stages`` 5 / 3 keep 3 / 2 K and V buffers of
    ``block_n x block_d`` each, which with q's tile must fit in ``tuning.pipeline_smem_bytes``. Dense mode
    has no index load: 3 stages (one K/V tile in flight) for tiles up to 64 x 128, else 2.
    """
    if not sparse:
        return 3 if block_n * block_d <= 64 * 128 else 2
    tile_bytes = 2 * block_n * block_d * elem_bytes  # one K and one V buffer
    q_bytes = block_m * block_d * elem_bytes
    for stages in tuning.sparse_stages:
        if (stages + 1) // 2 * tile_bytes + q_bytes <= tuning.pipeline_smem_bytes:
            return stages
    return tuning.sparse_stages[-1]


# The score buffers' strides (SCORES) follow the span and the scoring rows: specialising on their divisibility by 16
# would compile a new variant in the middle of an eager decode; the stores tell the compiler what is aligned.
@triton.jit(do_not_specialize=["stride_sb", "stride_sr", "stride_mb", "stride_mt", "stride_eb", "stride_cb"])
def _verify_fwd_kernel(
    Q,
    K,
    V,
    SEQLENS,
    INDICES,
    NUM_INDICES,  # inputs; INDICES/NUM_INDICES unused when not SPARSE
    OUT,
    OUT_PART,
    LSE_PART,  # OUT written iff SINGLE_SPLIT (or by the last split, TICKET_MERGE), else partials
    TICKETS,  # (B * Hkv * M_TILES,) int32 counters, zero between launches; read iff TICKET_MERGE
    SHIFTED,
    TILE_MAX,
    LSE_C,
    LSE_C_PART,
    QCOUNT,  # SCORES only (verify_attention_scores_triton); QCOUNT iff HAS_COUNTS
    qk_scale,  # softmax_scale * log2(e): scores come out in base-2 units
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ib,
    stride_in,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pb,
    stride_pt,
    stride_ph,
    stride_ps,  # OUT_PART (B, Q, Hq, S, D) with unit d stride
    stride_lb,
    stride_lt,
    stride_lh,  # LSE_PART (B, Q, Hq, S) with unit split stride; LSE_C_PART alike
    stride_sb,
    stride_sr,
    stride_mb,
    stride_mt,
    stride_eb,
    stride_cb,  # SHIFTED, TILE_MAX, LSE_C, QCOUNT (SCORES)
    chunk,  # key ordinals per split (multiple of BLOCK_N)
    N_QUERIES: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    M_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    TICKET_MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TAIL_FIRST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OPEN_LOOP: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    SAME_T_STRIDE: tl.constexpr,
    PDL: tl.constexpr,
    ROWS: tl.constexpr,  # 0: every row; 1: only rows read in full (num_indices >= cache_seqlens); 2: only the others
    SCORES: tl.constexpr = False,
    SCORE_QUERIES: tl.constexpr = 0,
    HAS_COUNTS: tl.constexpr = False,
):
    await_producers(PDL)
    split = tl.program_id(0) // M_TILES
    m_tile = tl.program_id(0) % M_TILES
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # int64: batch offsets of a large cache overflow int32

    # Packed rows of this program: row r = (query r // GROUP, head kv_head * GROUP + r % GROUP).
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = rows < GROUP * N_QUERIES
    if ROWS != 0:  # one launch of a mixed call: a program of a row the other launch owns loads, reads, writes nothing
        own = _owned(NUM_INDICES + b, SEQLENS + b, ROWS)
        row_ok = row_ok & own
    query = rows // GROUP  # (BLOCK_M,) query index i; >= N_QUERIES only on padding rows
    head = kv_head * GROUP + rows % GROUP  # (BLOCK_M,) query head
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + query[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    # Key ordinals of row b: [0, n_cached) cached, then the N_QUERIES new slots.
    cached_len = tl.load(SEQLENS + b).to(tl.int32)  # L_b, first new-token slot
    if SPARSE:
        n_cached = tl.load(NUM_INDICES + b).to(tl.int32)
    else:
        n_cached = cached_len
    lo = split * chunk
    if TAIL_FIRST or SCORES:  # the loop walks the selected (SCORES: the cached) positions only
        hi = tl.minimum(lo + chunk, n_cached)
    else:  # ... or those and the new tokens
        hi = tl.minimum(lo + chunk, n_cached + N_QUERIES)
    if ROWS != 0:
        hi = tl.where(own, hi, lo)
    # hi <= lo: this split owns no key of row b

    k_base = K + b * stride_kb + kv_head * stride_kh + d[None, :] * stride_kd  # (1, BLOCK_D)
    v_base = V + b * stride_vb + kv_head * stride_vh + d[None, :] * stride_vd
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of p @ v
    if TAIL_FIRST:  # the new tokens, on split 0, before the loop (a 5-key tile in the loop costs a whole tile)
        t_ok = (tl.arange(0, BLOCK_T) < N_QUERIES) & (split == 0)
        if ROWS != 0:
            t_ok = t_ok & own
        m_i, l_i, acc = _attend_new_tokens(
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            cached_len,
            query,
            t_ok,
            d_ok,
            m_i,
            l_i,
            acc,
            qk_scale,
            DOT_PRECISION,
            BLOCK_T,
        )
    if SCORES:  # the rows that score: the leading queries (of the row's own count), every head
        score_row = row_ok & (query < SCORE_QUERIES)
        if HAS_COUNTS:
            score_row = score_row & (query < tl.load(QCOUNT + b * stride_cb))
        score_out = query * (GROUP * tl.num_programs(1)) + head  # (BLOCK_M,) row j * Hq + h of the score buffers
    if OPEN_LOOP:  # every row sees every key of the loop (no causal mask): lean tiles
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key ordinals
            key_ok = n < hi
            slot = _open_loop_slots(
                INDICES + b * stride_ib, stride_in, n, key_ok, n_cached, cached_len, SPARSE, TAIL_FIRST
            )
            if OFFSETS_32:
                slot = slot.to(tl.int32)
            else:
                slot = slot.to(tl.int64)
            k_off = slot * stride_kt
            if SAME_T_STRIDE:
                v_off = k_off
            else:
                v_off = slot * stride_vt
            if HEAD_DIM == BLOCK_D:
                k = tl.load(k_base + k_off[:, None])  # (BLOCK_N, BLOCK_D)
                v = tl.load(v_base + v_off[:, None])
            else:
                k = tl.load(k_base + k_off[:, None], mask=d_ok[None, :], other=0.0)
                v = tl.load(v_base + v_off[:, None], mask=d_ok[None, :], other=0.0)
            bias = tl.where(key_ok, 0.0, float("-inf"))  # (BLOCK_N,)
            if SCORES:  # the tile's step inline, its scores shifted by the running max kept for the scoring pass
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale + bias[None, :]
                m_new = tl.maximum(m_i, tl.max(s, 1))
                x_ptrs = SHIFTED + tl.multiple_of(b * stride_sb + score_out * stride_sr, BLOCK_N)[:, None] + n[None, :]
                tl.store(
                    x_ptrs,
                    (s - m_new[:, None]).to(SHIFTED.dtype.element_ty),
                    mask=score_row[:, None],
                    eviction_policy="evict_last",
                )  # read back soon by the scoring pass: keep it in L2
                tl.store(TILE_MAX + b * stride_mb + (start // BLOCK_N) * stride_mt + score_out, m_new, mask=score_row)
                l_i, acc = _accumulate(s, m_new, v, m_i, l_i, acc, DOT_PRECISION)
                m_i = m_new
            else:
                m_i, l_i, acc = _attend_open_tile(q, k, v, bias, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    else:
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key ordinals
            key_ok = n < hi
            pos = n.to(tl.int64)  # dense (sparse calls take the open loop): the key ordinal is the cache slot
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + pos[:, None] * stride_kt, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
            v = tl.load(v_base + pos[:, None] * stride_vt, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
            visible = key_ok[None, :] & ((n[None, :] - n_cached) <= query[:, None])  # causal on the new tail
            m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    if SCORES:  # the split's log-sum-exp over the cached positions alone, then the new tokens (split 0)
        lse_c = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        lse_c_rows = b * stride_lb + query * stride_lt + head * stride_lh
        if SINGLE_SPLIT:
            tl.store(LSE_C + b * stride_eb + score_out, tl.where(l_i == 0.0, 0.0, lse_c), mask=score_row)
        else:
            tl.store(LSE_C_PART + lse_c_rows + split, lse_c, mask=score_row)
        if split == 0:
            t_ok = tl.arange(0, BLOCK_T) < N_QUERIES
            m_i, l_i, acc = _attend_new_tokens(
                q,
                k_base,
                v_base,
                stride_kt,
                stride_vt,
                cached_len,
                query,
                t_ok,
                d_ok,
                m_i,
                l_i,
                acc,
                qk_scale,
                DOT_PRECISION,
                BLOCK_T,
            )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # (BLOCK_M, BLOCK_D), normalised over this split's keys
    store_mask = row_ok[:, None] & d_ok[None, :]
    o_ptrs = OUT + b * stride_ob + query[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    if SINGLE_SPLIT:
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=store_mask)
    else:
        part_rows = b * stride_pb + query * stride_pt + head * stride_ph  # (BLOCK_M,) split 0 of each row
        lse_rows = b * stride_lb + query * stride_lt + head * stride_lh
        tl.store(OUT_PART + (part_rows + split * stride_ps)[:, None] + d[None, :], out, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # base-2 log-sum-exp
        tl.store(LSE_PART + lse_rows + split, lse, mask=row_ok)
        if TICKET_MERGE:
            group_slot = (b * tl.num_programs(1) + kv_head) * M_TILES + m_tile
            num_splits = tl.num_programs(0) // M_TILES
            if SCORES:  # the last split merges the cached log-sum-exps too
                _merge_if_last(
                    TICKETS + group_slot,
                    num_splits,
                    o_ptrs,
                    OUT_PART,
                    part_rows,
                    stride_ps,
                    LSE_PART,
                    lse_rows,
                    store_mask,
                    row_ok,
                    d,
                    BLOCK_M,
                    BLOCK_D,
                    BLOCK_S,
                    LSE_C_PART + lse_c_rows,
                    LSE_C + b * stride_eb + score_out,
                    score_row,
                    True,
                )
            elif ROWS == 0:
                _merge_if_last(
                    TICKETS + group_slot,
                    num_splits,
                    o_ptrs,
                    OUT_PART,
                    part_rows,
                    stride_ps,
                    LSE_PART,
                    lse_rows,
                    store_mask,
                    row_ok,
                    d,
                    BLOCK_M,
                    BLOCK_D,
                    BLOCK_S,
                    LSE_PART,
                    LSE_PART,
                    row_ok,
                    False,
                )
            elif own:  # every program of a (row, kv head, row tile) takes this branch alike: no ticket is left taken
                _merge_if_last(
                    TICKETS + group_slot,
                    num_splits,
                    o_ptrs,
                    OUT_PART,
                    part_rows,
                    stride_ps,
                    LSE_PART,
                    lse_rows,
                    store_mask,
                    row_ok,
                    d,
                    BLOCK_M,
                    BLOCK_D,
                    BLOCK_S,
                    LSE_PART,
                    LSE_PART,
                    row_ok,
                    False,
                )


@triton.jit
def _owned(num_indices, seqlen, ROWS: tl.constexpr):
    """Whether a launch of a mixed call (``ROWS`` 1: the rows read in full, 2: the others) owns this batch row: it
    reads in full iff its count covers everything it holds."""
    if ROWS == 1:
        own = tl.load(num_indices) >= tl.load(seqlen)
    else:
        own = tl.load(num_indices) < tl.load(seqlen)
    return own


@triton.jit
def _attend_new_tokens(
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    cached_len,
    query,
    t_ok,
    d_ok,
    m_i,
    l_i,
    acc,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """The step's new tokens (slots ``cached_len + t`` where ``t_ok``) in a tile of their own, causal: query ``i``
    sees ``t <= i``; returns the updated online-softmax state."""
    t = tl.arange(0, BLOCK_T)
    t_mask = t_ok[:, None] & d_ok[None, :]
    t_pos = (cached_len + t).to(tl.int64)
    k_t = tl.load(k_base + t_pos[:, None] * stride_kt, mask=t_mask, other=0.0)  # (BLOCK_T, BLOCK_D)
    v_t = tl.load(v_base + t_pos[:, None] * stride_vt, mask=t_mask, other=0.0)
    t_visible = t_ok[None, :] & (t[None, :] <= query[:, None])
    return _attend_tile(q, k_t, v_t, t_visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: the rows ``q`` (BLOCK_M, D) over a key tile ``k``/``v`` (N, D), ``visible``
    (BLOCK_M, N) masking scores; returns the updated running max, sum and output accumulator."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, N) fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    l_i, acc = _accumulate(s, m_safe, v, m_i, l_i, acc, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_open_tile(q, k, v, bias, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """:func:`_attend_tile` for a tile every row sees, except the keys that ``bias`` (N,) sets to ``-inf``.
    At least one key keeps a bias of 0, so the running max is finite after the tile: the scale and the
    mask are one multiply-add, and no row needs the all-masked guard."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale + bias[None, :]  # (BLOCK_M, N) fp32
    m_new = tl.maximum(m_i, tl.max(s, 1))
    l_i, acc = _accumulate(s, m_new, v, m_i, l_i, acc, DOT_PRECISION)  # alpha 0 where nothing was seen before
    return m_new, l_i, acc


@triton.jit
def _accumulate(s, m_ref, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """The online-softmax update both tile steps share: rescale the running sum and accumulator from the old
    max ``m_i`` to the finite reference ``m_ref`` (BLOCK_M,), then add the tile's ``exp2(s - m_ref)`` and its
    product with ``v``; returns the new sum and accumulator."""
    alpha = tl.exp2(m_i - m_ref)  # (BLOCK_M,) rescales the old state
    p = tl.exp2(s - m_ref[:, None])  # (BLOCK_M, N)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return l_i, acc


@triton.jit
def _merge_if_last(
    ticket,
    num_splits,
    o_ptrs,
    OUT_PART,
    part_rows,
    stride_ps,
    LSE_PART,
    lse_rows,
    store_mask,
    row_ok,
    d,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    lse_c_parts,
    lse_c_out,
    score_row,
    SCORES: tl.constexpr,
):
    """Take a ticket; the last of the ``num_splits`` programs of this (row, kv head, row tile) merges.

    ``o_ptrs`` (BLOCK_M, BLOCK_D) are this program's output addresses; ``part_rows``/``lse_rows``
    (BLOCK_M,) the offsets of split 0 of its rows in OUT_PART (split stride ``stride_ps``, unit d
    stride) and LSE_PART (unit split stride). ``BLOCK_S >= num_splits`` is a power of two. ``SCORES``: it also
    merges the rows' cached log-sum-exps (``lse_c_parts`` (BLOCK_M,) split 0 of each, unit split stride) into
    ``lse_c_out`` where ``score_row``.

    Memory ordering (PTX memory model; the grid-sync pattern of CUDA cooperative groups):
    * release: every thread stored its share of the partial above; the CTA barrier orders those stores
      before the atomic, which Triton issues from one thread, and its release at GPU scope is
      cumulative, so it publishes every store the barrier ordered before it;
    * acquire: the last arriver's atomic acquires every earlier arriver's release (they all modified
      the same counter), and the barrier through which Triton hands the atomic's result to all
      threads orders the merge's loads after it. The loads use ``.cg`` (L2, never an L1 line filled
      before the acquire).
    Programs only count; none waits for another, so any schedule of the grid terminates.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")  # tickets taken before this one
    if arrived == num_splits - 1:
        # Online log-sum-exp over the splits, as in the main loop: out = sum_s 2^lse_s out_s / sum_s 2^lse_s.
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        w_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in tl.static_range(BLOCK_S):  # unrolled, so the loads of all splits can be in flight together
            s_ok = s < num_splits
            lse_s = tl.load(LSE_PART + lse_rows + s, mask=row_ok & s_ok, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(
                OUT_PART + (part_rows + s * stride_ps)[:, None] + d[None, :],
                mask=store_mask & s_ok,
                other=0.0,
                cache_modifier=".cg",
            )  # (BLOCK_M, BLOCK_D)
            m_new = tl.maximum(m, lse_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows (split 0 of a real row holds key 0)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse_s - m_safe)  # 0 for an empty split
            acc = acc * alpha[:, None] + part * w[:, None]
            w_sum = w_sum * alpha + w
            m = m_new
        out = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]  # w_sum >= 1 on real rows (the top split's w = 1)
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=store_mask)
        if SCORES:
            _merge_lse(lse_c_parts, lse_c_out, score_row, num_splits, BLOCK_S)
        tl.store(ticket, 0)  # every split has its ticket: nothing reads the counter again in this launch


@triton.jit
def _merge_lse(part_ptrs, out_ptrs, rows_ok, num_splits, BLOCK_S: tl.constexpr):
    """``out = log2(sum_s 2^part_s)`` per row (``part_ptrs``: split 0 of each row, unit split stride; empty splits
    are ``-inf``); a row that saw nothing gets 0 (finite: the scoring pass's rows see some key or are left out)."""
    s = tl.arange(0, BLOCK_S)
    part = tl.load(
        part_ptrs[:, None] + s[None, :],
        mask=rows_ok[:, None] & (s[None, :] < num_splits),
        other=float("-inf"),
        cache_modifier=".cg",
    )  # (rows, BLOCK_S)
    part_max = tl.max(part, 1)
    part_max = tl.where(part_max == float("-inf"), 0.0, part_max)
    total = tl.sum(tl.exp2(part - part_max[:, None]), 1)
    tl.store(out_ptrs, part_max + tl.log2(tl.where(total == 0.0, 1.0, total)), mask=rows_ok)


@triton.jit
def _open_loop_slots(
    idx_row, stride_in, n, key_ok, n_cached, cached_len, SPARSE: tl.constexpr, TAIL_FIRST: tl.constexpr
):
    """Cache slot of each key ordinal ``n`` (BLOCK_N,) of an open loop (one query, or the selected positions
    only), and slot 0 past the loop's end (``key_ok`` false): a real row of the cache, read without a
    mask and then masked out of the scores.

    Sparse with the new tokens apart: ``indices[b, n]``. Sparse with one query: those, then the new token
    at ordinal ``n_cached``. Dense (one query, or a selection layer's cached positions): the ordinal is the slot.
    """
    if SPARSE:
        if TAIL_FIRST:
            slot = tl.load(idx_row + n * stride_in, mask=key_ok, other=0)
        else:
            selected = tl.load(idx_row + n * stride_in, mask=n < n_cached, other=0)
            slot = tl.where(n == n_cached, cached_len, selected)
    else:
        slot = tl.where(key_ok, n, 0)
    return slot


@triton.jit
def _merge_splits_kernel(
    OUT_PART,
    LSE_PART,
    OUT,  # (R, S, D) fp32, (R, S) fp32, (R, D) out dtype; R = B * Q * Hq rows
    SEQLENS,
    NUM_INDICES,  # read iff ROWS != 0
    LSE_C_PART,
    LSE_C,  # SCORES: (R, S) and (R,) fp32, the cached log-sum-exps
    num_splits,
    rows_per_b,  # rows_per_b = Q * Hq: output rows of one batch row
    score_rows_per_b,  # SCORES: the leading rows of a batch row that score (SCORE_QUERIES * Hq)
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    ROWS: tl.constexpr,
    SCORES: tl.constexpr = False,
):
    """One program per (batch row, query, head): ``out = sum_s w_s out_s / sum_s w_s``.

    ``w_s = 2^(lse_s - max_s lse_s)``; an empty split has ``lse_s = -inf``, so ``w_s = 0``. ``ROWS`` as in the
    main kernel: a row the launch does not own is neither read nor written. ``SCORES``: a scoring row's cached
    log-sum-exps are merged too.
    """
    await_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    if ROWS != 0:
        b = row // rows_per_b
        own = _owned(NUM_INDICES + b, SEQLENS + b, ROWS)
        s_ok = s_ok & own
        d_ok = d_ok & own
    lse = tl.load(LSE_PART + row * num_splits + s, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse, 0)  # finite: the split owning the query's own token is never empty
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # (BLOCK_S,), 0 for empty splits
    part_ptrs = OUT_PART + (row * num_splits + s[:, None]) * HEAD_DIM + d[None, :]
    part = tl.load(part_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    w_sum = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)  # (BLOCK_D,)
    tl.store(OUT + row * HEAD_DIM + d, out.to(OUT.dtype.element_ty), mask=d_ok)
    if SCORES:  # as _merge_lse, for one row (a row past its batch row's query count merges what it never wrote;
        # the scoring pass leaves such rows out)
        scores = (row % rows_per_b) < score_rows_per_b
        lse_c = tl.load(LSE_C_PART + row * num_splits + s, mask=s_ok & scores, other=float("-inf"))  # (BLOCK_S,)
        c_max = tl.max(lse_c, 0)
        c_max = tl.where(c_max == float("-inf"), 0.0, c_max)
        total = tl.sum(tl.exp2(lse_c - c_max), 0)
        tl.store(LSE_C + row, c_max + tl.log2(tl.where(total == 0.0, 1.0, total)), mask=scores)


def verify_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    num_indices: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    full_rows: bool = False,
    tuning: VerifyTuning | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Attention of ``Q`` new queries per row over selected (or all) cached positions plus the new tokens.

    Args:
        q: ``(batch, Q, nheads, headdim)``, fp16/bf16/fp32; any strides.
        k_cache, v_cache: ``(batch, capacity, nheads_k, headdim)``, same dtype as ``q``; any strides
            (e.g. ``cache[:, :T]`` or ``cache[1:3]`` views of a bigger buffer). ``nheads % nheads_k == 0``.
        cache_seqlens: ``(batch,)``, int32/int64; cached positions before the new tokens, whose
            K/V already sit at slots ``cache_seqlens[b] .. cache_seqlens[b] + Q - 1``.
        softmax_scale: the factor applied to ``q @ k^T``.
        indices: ``(batch, W)``, int32/int64; selected cached positions, each ``< cache_seqlens[b]``,
            no duplicates. ``None`` attends to every cached position (dense).
        num_indices: ``(batch,)``, int32/int64; valid leading entries of each ``indices`` row (the
            rest is never read). ``None`` means all ``W``.
        max_seqlen_k: ``max(cache_seqlens) + Q`` as a host int (or a bound of it), dense mode and ``full_rows``
            only. It sizes the grid; if ``None`` it is computed with one device->host sync (so pass it under CUDA
            graphs).
        full_rows: sparse mode: a row whose count covers everything it holds (``num_indices[b] >=
            cache_seqlens[b]``) reads all of ``[0, cache_seqlens[b])`` without its index row (so ``W`` need not
            hold it), its keys split as a dense call's. Two launches, each skipping the other's rows: the dense
            one for those rows, the sparse one (``config``'s) for the others. The split between them is read on
            the device, so one captured call serves any mix of rows.
        tuning: the launch heuristic's constants (``None``: the defaults).
        config: this call's launch parameters instead of the heuristic's (:func:`launch_config`; ``n_keys``
            from :func:`sparse_loop_keys` in sparse mode).

    Returns:
        ``(batch, Q, nheads, headdim)`` in ``q``'s dtype (contiguous).

    Calls on one device must not run concurrently (from different streams): a call that splits the
    keys merges the splits through counters shared by the device's calls (see
    :func:`dustin_hf.kernels._device.tickets`).
    """
    batch, n_queries, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    _check_inputs(q, k_cache, v_cache, cache_seqlens, indices)
    sparse = indices is not None
    if sparse:
        n_keys = sparse_loop_keys(indices.shape[1], n_queries)
        if num_indices is None:
            num_indices = torch.full((batch,), indices.shape[1], dtype=torch.int32, device=q.device)
    else:
        n_keys = max_seqlen_k if max_seqlen_k is not None else int(cache_seqlens.max()) + n_queries  # host sync
        indices = num_indices = cache_seqlens  # placeholders, never read when not SPARSE
    group = n_heads // n_kv_heads
    if config is None:
        config = launch_config(
            batch,
            n_kv_heads,
            group,
            n_queries,
            head_dim,
            n_keys,
            sm_count(q.device),
            sparse=sparse,
            elem_bytes=q.element_size(),
            tuning=tuning,
            smem_limit=smem_limit(q.device),
        )
    if not (sparse and full_rows):
        return _launch(q, k_cache, v_cache, cache_seqlens, indices, num_indices, softmax_scale, sparse, config)
    tuning = tuning or VerifyTuning()
    span = max_seqlen_k if max_seqlen_k is not None else int(cache_seqlens.max()) + n_queries  # host sync
    # the dense launch's splits are sized for a share of the rows reading in full (it cannot know how many do):
    # a lone row then still spreads over many SMs, and a batch of them over a few waves
    assumed = max(1, batch // tuning.full_rows_divisor)
    whole = launch_config(
        assumed,
        n_kv_heads,
        group,
        n_queries,
        head_dim,
        span,
        sm_count(q.device),
        elem_bytes=q.element_size(),
        tuning=tuning,
        smem_limit=smem_limit(q.device),
    )
    out = _launch(q, k_cache, v_cache, cache_seqlens, indices, num_indices, softmax_scale, False, whole, rows=1)
    return _launch(
        q, k_cache, v_cache, cache_seqlens, indices, num_indices, softmax_scale, True, config, rows=2, out=out
    )


@dataclasses.dataclass(frozen=True)
class _Scores:
    """What a dense call writes for the scoring pass (:func:`verify_attention_scores_triton`)."""

    buffers: ScoreBuffers
    queries: int  # the leading queries that score
    query_counts: torch.Tensor | None  # (B,): row b's queries past query_counts[b] score nothing; None: all score


def verify_attention_scores_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    max_seqlen_k: int,
    span: int,
    score_queries: int | None = None,
    query_counts: torch.Tensor | None = None,
    tuning: VerifyTuning | None = None,
    score_tuning: ScoreTuning | None = None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, ScoreBuffers]:
    """Dense :func:`verify_attention_triton` that also writes the scoring kernel's pass 1 outputs for the leading
    ``score_queries`` queries (``None``: all), every head, over the cached positions alone (each query's softmax over
    ``[0, cache_seqlens[b])``, the new tokens left out): a selection layer's key read serves both.

    The kernel walks the cached positions in its open loop (every query sees every cached key) and writes, per
    tile, the scores shifted by the running max and that max, and per split the log-sum-exp, before it attends to
    the new tokens (split 0, causal); the merge of the splits merges those log-sum-exps too.
    :func:`dustin_hf.kernels.triton_score.attention_mass_from_scores` then sums the probabilities.

    Args:
        q, k_cache, v_cache, cache_seqlens, softmax_scale, tuning: as :func:`verify_attention_triton` (dense).
        max_seqlen_k: ``max(cache_seqlens) + Q`` (or a bound of it), host int.
        span: positions the scores cover, ``>= max(cache_seqlens)`` (host int); the buffers also hold every cached
            position ``max_seqlen_k`` allows, which the kernel writes.
        query_counts: ``(B,)`` int, ``>= 1``: row ``b`` scores only its first ``query_counts[b]`` queries.
        score_tuning: the scoring pass's heuristic (its step sizes the buffers).
        config: this call's launch parameters instead of the heuristic's (a dense :func:`launch_config`).

    Returns the attention output ``(B, Q, nheads, headdim)`` and the :class:`ScoreBuffers`.
    """
    batch, n_queries, n_heads, head_dim = q.shape
    _check_inputs(q, k_cache, v_cache, cache_seqlens, None)
    score_queries = n_queries if score_queries is None else min(score_queries, n_queries)
    if score_queries < 1 or span > k_cache.shape[1]:
        raise ValueError(
            f"need at least one scoring query and a span ({span}) within the cache "
            f"({k_cache.shape[1]}); got {score_queries} queries"
        )
    n_kv_heads = k_cache.shape[2]
    if config is None:  # the splits divide the cached keys
        config = launch_config(
            batch,
            n_kv_heads,
            n_heads // n_kv_heads,
            n_queries,
            head_dim,
            max(1, max_seqlen_k - n_queries),
            sm_count(q.device),
            elem_bytes=q.element_size(),
            tuning=tuning,
            smem_limit=smem_limit(q.device),
        )
    buffers = score_buffers(
        batch,
        score_queries,
        n_queries,
        n_heads,
        span,
        config.block_n,
        head_dim,
        k_cache,
        written=max_seqlen_k - n_queries,
        tuning=score_tuning,
    )  # the kernel writes every cached key
    out = _launch(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        cache_seqlens,
        cache_seqlens,
        softmax_scale,
        False,
        config,
        scores=_Scores(buffers, score_queries, query_counts),
    )
    return out, buffers


def _tail_first(n_queries: int) -> bool:
    """Whether a sparse call attends to its new tokens before the key loop: with several queries (module
    docstring). One query keeps its new token at the loop's end, where it costs no tile of its own."""
    return n_queries > 1


def sparse_loop_keys(width: int, n_queries: int) -> int:
    """Key ordinals a sparse call's splits divide (``n_keys`` of :func:`launch_config`): the ``width``
    selected ones, plus the new tokens unless they are attended to before the loop."""
    return width + (0 if _tail_first(n_queries) else n_queries)


def _offsets_fit_int32(cache: torch.Tensor) -> bool:
    """Whether every slot's offset in ``cache`` (slot * its stride) fits in int32, as the sparse loop then
    computes it (the batch and head offsets are int64 in any case)."""
    return (cache.shape[1] - 1) * cache.stride(1) < 2**31


def _check_inputs(q, k_cache, v_cache, cache_seqlens, indices) -> None:
    """Shape/dtype checks on host metadata only (no device reads)."""
    batch, _, n_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache/v_cache must be (batch, capacity, nheads_k, {head_dim}); got {tuple(k_cache.shape)}"
        )
    if n_heads % k_cache.shape[2] != 0:
        raise ValueError(f"nheads ({n_heads}) must be a multiple of nheads_k ({k_cache.shape[2]})")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32; got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache must have q's dtype {q.dtype}; got {k_cache.dtype}/{v_cache.dtype}")
    if head_dim > 256:
        raise ValueError(f"head dims up to 256 are supported; got {head_dim}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be ({batch},); got {tuple(cache_seqlens.shape)}")
    if indices is not None and (indices.dim() != 2 or indices.shape[0] != batch):
        raise ValueError(f"indices must be ({batch}, W); got {tuple(indices.shape)}")


def _launch(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    indices,
    num_indices,
    softmax_scale,
    sparse,
    cfg: LaunchConfig,
    rows: int = 0,
    out: torch.Tensor | None = None,
    scores: _Scores | None = None,
):
    """Run the main kernel (and the merge kernel when ``cfg.merge == "kernel"``); returns the output. ``rows``:
    which rows it computes (the kernel's ``ROWS``: 0 all; 1 those read in full, 2 the others, into ``out``).
    ``scores`` (a dense call): the kernel also writes the scoring pass's inputs there."""
    prepare_interpreter()
    batch, n_queries, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    group = n_heads // n_kv_heads
    m_tiles = triton.cdiv(group * n_queries, cfg.block_m)
    if out is None:
        out = torch.empty(batch, n_queries, n_heads, head_dim, dtype=q.dtype, device=q.device)
    single = cfg.num_splits == 1
    ticket = cfg.merge == "ticket"
    counters = tickets(q.device, batch * n_kv_heads * m_tiles) if ticket else cache_seqlens  # else unused
    if single:
        out_part = lse_part = out  # unused placeholders
        part_strides, lse_strides = (0, 0, 0, 0), (0, 0, 0)
    else:
        part_shape = (batch, n_queries, n_heads, cfg.num_splits)
        out_part = torch.empty(*part_shape, head_dim, dtype=torch.float32, device=q.device)  # (B, Q, Hq, S, D)
        lse_part = torch.empty(part_shape, dtype=torch.float32, device=q.device)  # (B, Q, Hq, S)
        part_strides, lse_strides = out_part.stride()[:4], lse_part.stride()[:3]
    if scores is None:
        score_args, score_strides = (out, out, out, out, cache_seqlens), (0,) * 6  # unused placeholders
    else:
        b = scores.buffers
        lse_c_part = lse_part if single else torch.empty_like(lse_part)  # (B, Q, Hq, S): as the outputs' partials
        counts = scores.query_counts if scores.query_counts is not None else cache_seqlens  # else never read
        score_args = (b.shifted, b.tile_max, b.lse, lse_c_part, counts)
        score_strides = (*b.shifted.stride()[:2], *b.tile_max.stride()[:2], b.lse.stride(0), counts.stride(0))
    grid = (cfg.num_splits * m_tiles, n_kv_heads, batch)
    tail_first = sparse and _tail_first(n_queries)
    pdl = dependent_launch(q)
    _verify_fwd_kernel[grid](
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        indices,
        num_indices,
        out,
        out_part,
        lse_part,
        counters,
        *score_args,
        softmax_scale * _LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *(indices.stride()[:2] if sparse else (0, 0)),
        *out.stride(),
        *part_strides,
        *lse_strides,
        *score_strides,
        cfg.chunk,
        N_QUERIES=n_queries,
        GROUP=group,
        HEAD_DIM=head_dim,
        M_TILES=m_tiles,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d,
        SPARSE=sparse,
        SINGLE_SPLIT=single,
        TICKET_MERGE=ticket,
        BLOCK_S=triton.next_power_of_2(cfg.num_splits) if ticket else 1,  # constexpr: only where it is used
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no tf32 rounding; 16-bit: unused
        TAIL_FIRST=tail_first,
        BLOCK_T=max(16, triton.next_power_of_2(n_queries)),
        OPEN_LOOP=tail_first or n_queries == 1 or scores is not None,
        OFFSETS_32=cfg.int32_offsets and _offsets_fit_int32(k_cache) and _offsets_fit_int32(v_cache),
        SAME_T_STRIDE=k_cache.stride(1) == v_cache.stride(1),
        PDL=pdl,
        ROWS=rows,
        SCORES=scores is not None,
        SCORE_QUERIES=0 if scores is None else scores.queries,
        HAS_COUNTS=scores is not None and scores.query_counts is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    if cfg.merge == "kernel":
        _merge_splits_kernel[(batch * n_queries * n_heads,)](
            out_part,
            lse_part,
            out,
            cache_seqlens,
            num_indices,
            score_args[3],
            score_args[2],
            cfg.num_splits,
            n_queries * n_heads,
            0 if scores is None else scores.queries * n_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=max(2, triton.next_power_of_2(cfg.num_splits)),
            BLOCK_D=cfg.block_d,
            PDL=pdl,
            ROWS=rows,
            SCORES=scores is not None,
            num_warps=4 if cfg.block_d >= 128 else 2,
            launch_pdl=pdl,
        )
    return out
