"""Every attention backend against an explicit float64 oracle written here.

The oracle materialises, row by row and query by query, the list of keys the query sees, the scores,
the softmax and the weighted sum; it shares no code with ``kernels/reference.py``. Tolerance follows
flash-attn's tests: a backend's max abs error against the fp64 oracle may be at most twice the
error of plain PyTorch math done in the same low precision (scores, softmax and ``p @ v`` all in
the input dtype), plus ``1e-5``.

Triton runs on CUDA when there is one, otherwise in the Triton interpreter on CPU
(``TRITON_INTERPRET=1``, set below before triton is imported) with small shapes; the interpreter
does not support bf16 arithmetic (its ``tl.dot`` multiplies the raw bit patterns), so bf16 Triton
cases run on CUDA only. The varlen/flash-attn packing is checked on CPU against fake
varlen kernels with FlashAttention-2 semantics; the real kernels run under ``@pytest.mark.gpu``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from conftest import capture_graph, sm90_ptx_report  # noqa: E402

from dustin_hf.kernels import (  # noqa: E402
    BACKENDS,
    resolve_backend,
    varlen,  # noqa: E402
    verify_attention,
)
from dustin_hf.kernels._device import sm_count, tickets  # noqa: E402
from dustin_hf.kernels.reference import verify_attention_reference  # noqa: E402
from dustin_hf.kernels.tuning import VerifyTuning  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_RUNS = HAS_TRITON and (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
DEVICE = "cuda" if HAS_CUDA else "cpu"
LOW_PRECISION = (torch.float16, torch.bfloat16)

needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# ----------------------------------------------------------------------------- oracle and tolerance


def _visible_slots(cache_seqlens, indices, num_indices, b: int, i: int) -> list[int]:
    """Cache slots query ``i`` of row ``b`` attends to: its cached keys, then new slots ``L .. L + i``."""
    length = int(cache_seqlens[b])
    cached = list(range(length)) if indices is None else [int(x) for x in indices[b, : int(num_indices[b])]]
    return cached + [length + j for j in range(i + 1)]


def _attend(q, k_cache, v_cache, cache_seqlens, scale, indices, num_indices, dtype) -> torch.Tensor:
    """Masked softmax attention, one (row, query) at a time, computed in ``dtype``; returns ``(B, Q, Hq, D)``."""
    batch, n_queries, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[2]
    cache_seqlens, indices, num_indices = (t if t is None else t.cpu() for t in (cache_seqlens, indices, num_indices))
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for b in range(batch):
        for i in range(n_queries):
            slots = _visible_slots(cache_seqlens, indices, num_indices, b, i)
            keys = k_cache[b, slots].to(dtype).repeat_interleave(group, dim=1)  # (n, Hq, D)
            values = v_cache[b, slots].to(dtype).repeat_interleave(group, dim=1)
            query = q[b, i].to(dtype)  # (Hq, D)
            scores = torch.einsum("hd,nhd->hn", query, keys) * scale  # (Hq, n)
            probs = torch.softmax(scores, dim=-1)
            out[b, i] = torch.einsum("hn,nhd->hd", probs, values)
    return out


def _oracle(case_inputs) -> torch.Tensor:
    """The exact answer, in float64."""
    return _attend(*case_inputs.oracle_args(), dtype=torch.float64)


def _assert_matches_oracle(out: torch.Tensor, inputs, name: str) -> None:
    """flash-attn's rule: ``err(out) <= 2 * err(PyTorch math in q's dtype) + 1e-5``, both vs the fp64 oracle."""
    assert out.shape == inputs.q.shape and out.dtype == inputs.q.dtype, (out.shape, out.dtype)
    assert not torch.isnan(out).any(), f"{name}: NaN in the output"
    exact = _oracle(inputs)
    low_precision = _attend(*inputs.oracle_args(), dtype=inputs.q.dtype)
    baseline = (low_precision.double() - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    assert err <= 2 * baseline + 1e-5, f"{name}: max abs error {err:.3g} > 2 x {baseline:.3g} + 1e-5"


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Case:
    """One input configuration; ``width=None`` is dense mode."""

    seqlens: tuple[int, ...]
    n_queries: int = 5
    n_kv_heads: int = 2
    group: int = 2
    head_dim: int = 64
    width: int | None = None
    short_rows: bool = False  # some rows have num_indices < min(W, L), garbage after
    # "slice_t": buf[:, :T]; "slice_b": buf[1:1+B]; "strided_d": buf[..., ::2]; "v_wide": V = buf[..., :D] of a
    # buffer twice as wide (K and V with different slot strides)
    layout: str = "contiguous"
    index_dtype: torch.dtype = torch.int32
    num_splits: int | None = None  # Triton launch overrides (None: the heuristic)
    block_n: int | None = None
    merge: str | None = None  # "ticket" / "kernel" (None: the heuristic, "ticket" up to 8 splits)
    seed: int = 0


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor  # (B, Q, Hq, D)
    k_cache: torch.Tensor  # (B, capacity, Hkv, D), possibly a strided view
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor  # (B,)
    indices: torch.Tensor | None  # (B, W), out-of-range garbage after num_indices
    num_indices: torch.Tensor | None  # (B,)
    scale: float
    max_seqlen_k: int

    def kwargs(self) -> dict:
        return dict(
            softmax_scale=self.scale,
            indices=self.indices,
            num_indices=self.num_indices,
            max_seqlen_k=self.max_seqlen_k,
        )

    def oracle_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.cache_seqlens, self.scale, self.indices, self.num_indices)

    def in_range_indices(self) -> torch.Tensor | None:
        """``indices`` with the garbage clamped into the cache (the reference gathers every entry)."""
        return None if self.indices is None else self.indices.clamp(0, self.k_cache.shape[1] - 1)


def _make_inputs(case: Case, dtype: torch.dtype, device: str = DEVICE) -> Inputs:
    gen = torch.Generator().manual_seed(case.seed)
    batch, n_q, n_kv, d = len(case.seqlens), case.n_queries, case.n_kv_heads, case.head_dim
    capacity = max(case.seqlens) + n_q + 3
    shape = (batch, capacity, n_kv, d)
    if case.layout == "slice_t":
        buffer_shape, view = (batch, capacity + 11, n_kv, d), lambda t: t[:, :capacity]
    elif case.layout == "slice_b":
        buffer_shape, view = (batch + 2, capacity, n_kv, d), lambda t: t[1 : 1 + batch]
    elif case.layout == "strided_d":
        buffer_shape, view = (batch, capacity, n_kv, 2 * d), lambda t: t[..., ::2]
    else:
        buffer_shape, view = shape, lambda t: t
    k_cache = view(torch.randn(buffer_shape, generator=gen).to(device, dtype))
    if case.layout == "v_wide":
        v_cache = torch.randn(batch, capacity, n_kv, 2 * d, generator=gen).to(device, dtype)[..., :d]
    else:
        v_cache = view(torch.randn(buffer_shape, generator=gen).to(device, dtype))
    assert k_cache.shape == shape
    q = torch.randn(batch, n_q, n_kv * case.group, d, generator=gen).to(device, dtype)
    cache_seqlens = torch.tensor(case.seqlens, dtype=case.index_dtype, device=device)
    indices = num_indices = None
    if case.width is not None:
        indices, num_indices = _make_selection(case, capacity, gen)
        indices, num_indices = indices.to(device), num_indices.to(device)
    return Inputs(q, k_cache, v_cache, cache_seqlens, indices, num_indices, d**-0.5, max(case.seqlens) + n_q)


def _make_selection(case: Case, capacity: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique positions per row; entries past ``num_indices`` are out-of-range garbage."""
    width = case.width
    garbage = torch.tensor([capacity + 1000, -7, 2**30], dtype=torch.long)
    indices = garbage.repeat(width // 3 + 1)[:width].repeat(len(case.seqlens), 1)  # (B, W)
    counts = []
    for b, length in enumerate(case.seqlens):
        count = min(width, length)
        if case.short_rows and b % 2 == 0:
            count = count // 2
        indices[b, :count] = torch.randperm(length, generator=gen)[:count].sort().values
        counts.append(count)
    return indices.to(case.index_dtype), torch.tensor(counts, dtype=case.index_dtype)


# ----------------------------------------------------------------------------- reference vs oracle


REFERENCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 7, 8])
@pytest.mark.parametrize("n_queries", [1, 2, 5])
def test_reference_matches_oracle(n_queries, group, head_dim):
    """Every (Q, group, head dim), dense and sparse; dtype and cache layout cycle across the grid."""
    qi, gi, di = (1, 2, 5).index(n_queries), (1, 2, 7, 8).index(group), (16, 64, 128).index(head_dim)
    dtype = REFERENCE_DTYPES[(qi + gi + di) % 3]
    layout = ("contiguous", "slice_t", "slice_b")[(qi + 2 * gi + di) % 3]
    for sparse in (False, True):
        case = Case(
            seqlens=(37, 0, 90),
            n_queries=n_queries,
            n_kv_heads=1 if group >= 7 else 2,
            group=group,
            head_dim=head_dim,
            width=24 if sparse else None,
            short_rows=sparse,
            layout=layout,
            seed=n_queries * 1000 + group * 100 + head_dim + sparse,
        )
        inputs = _make_inputs(case, dtype, "cpu")
        kwargs = inputs.kwargs() | {"indices": inputs.in_range_indices(), "max_seqlen_k": None}
        out = verify_attention_reference(inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens, **kwargs)
        _assert_matches_oracle(out, inputs, f"reference[{'sparse' if sparse else 'dense'}, {dtype}]")


def test_oracle_attends_to_the_right_keys():
    """One query that sees exactly one key returns that key's value (checks the oracle's masking)."""
    case = Case(seqlens=(4,), n_queries=2, n_kv_heads=1, group=1, head_dim=16, width=3)
    inputs = _make_inputs(case, torch.float64, "cpu")
    inputs.num_indices.zero_()  # query 0 then sees only new slot L
    out = _oracle(inputs)
    torch.testing.assert_close(out[0, 0, 0], inputs.v_cache[0, 4, 0])


# ----------------------------------------------------------------------------- Triton

# Small enough for the interpreter; splits and tiles forced small so multi-tile, multi-split, empty
# splits and the merge all run.
TRITON_CASES = {
    "dense-q1-g1-d16": Case(seqlens=(37, 0, 64), n_queries=1, group=1, head_dim=16),
    "dense-ragged-splits": Case(seqlens=(100, 0, 33), group=8, n_kv_heads=1, head_dim=128, num_splits=4, block_n=32),
    "dense-slice_t-g7": Case(seqlens=(29, 61), group=7, n_kv_heads=1, layout="slice_t", num_splits=3, block_n=16),
    "dense-slice_b-int64": Case(
        seqlens=(50, 9, 0), n_queries=2, layout="slice_b", index_dtype=torch.int64, num_splits=2, block_n=16
    ),
    "dense-strided_d": Case(seqlens=(26, 41), n_queries=2, layout="strided_d", num_splits=2, block_n=16),
    "sparse-w-lt-block": Case(seqlens=(45, 0, 80), n_queries=2, width=24, short_rows=True),
    "sparse-w-gt-block": Case(seqlens=(120, 70), group=7, n_kv_heads=1, width=70, short_rows=True),
    "sparse-splits-g8": Case(
        seqlens=(90, 0, 57), group=8, n_kv_heads=1, head_dim=128, width=40, short_rows=True, num_splits=3, block_n=16
    ),
    "sparse-slice_b-int64": Case(
        seqlens=(33, 60),
        n_queries=1,
        group=8,
        n_kv_heads=1,
        width=30,
        layout="slice_b",
        index_dtype=torch.int64,
        num_splits=2,
        block_n=16,
    ),
    "sparse-slice_t-d80": Case(seqlens=(40, 25), head_dim=80, width=20, short_rows=True, layout="slice_t"),
    "sparse-v_wide": Case(seqlens=(40, 25), width=20, short_rows=True, layout="v_wide", block_n=16),
    # One query: its new token is the key ordinal after the row's selected ones, inside a tile here.
    "sparse-q1-short-splits": Case(
        seqlens=(45, 0, 80), n_queries=1, width=24, short_rows=True, num_splits=2, block_n=16
    ),
    "dense-q1-splits": Case(seqlens=(37, 0, 64), n_queries=1, group=4, num_splits=3, block_n=16, layout="v_wide"),
    "sparse-m-tiles": Case(seqlens=(30, 12), group=32, n_kv_heads=1, head_dim=16, width=16, short_rows=True),
    # Split merges. The ticket merge runs in the main kernel (the last split of each (row, kv head, row
    # tile) to finish merges); rows of 0-3 selected positions leave later splits empty (lse = -inf).
    "sparse-ticket-3-splits": Case(
        seqlens=(90, 3, 57, 1),
        group=4,
        head_dim=32,
        width=40,
        short_rows=True,
        num_splits=3,
        block_n=16,
        merge="ticket",
    ),
    "sparse-ticket-5-of-8": Case(
        seqlens=(80, 75, 0), n_queries=3, group=3, width=70, short_rows=True, num_splits=5, block_n=16, merge="ticket"
    ),  # BLOCK_S 8: 3 masked splits
    "sparse-ticket-m-tiles": Case(
        seqlens=(40, 22),
        group=32,
        n_kv_heads=2,
        head_dim=16,
        width=30,
        short_rows=True,
        num_splits=2,
        block_n=16,
        merge="ticket",
    ),  # 160 rows: 2 row tiles
    "dense-ticket-8-splits": Case(
        seqlens=(126, 0, 17), n_queries=2, group=8, n_kv_heads=1, head_dim=32, num_splits=8, block_n=16, merge="ticket"
    ),
    "sparse-kernel-merge": Case(
        seqlens=(90, 3, 57, 1),
        group=4,
        head_dim=32,
        width=40,
        short_rows=True,
        num_splits=3,
        block_n=16,
        merge="kernel",
    ),
    "dense-kernel-merge": Case(
        seqlens=(100, 0, 33), group=8, n_kv_heads=1, head_dim=128, num_splits=4, block_n=32, merge="kernel"
    ),
}
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def _run_triton(inputs: Inputs, case: Case, int32_offsets: bool = True) -> torch.Tensor:
    from dustin_hf.kernels import triton_verify

    n_keys = inputs.indices.shape[1] + case.n_queries if inputs.indices is not None else inputs.max_seqlen_k
    config = triton_verify.launch_config(
        len(case.seqlens),
        case.n_kv_heads,
        case.group,
        case.n_queries,
        case.head_dim,
        n_keys,
        sm_count(inputs.q.device),
        sparse=inputs.indices is not None,
        elem_bytes=inputs.q.element_size(),
        num_splits=case.num_splits,
        block_n=case.block_n,
        merge=case.merge,
    )
    if case.merge is not None:
        assert config.merge == case.merge, config
    args = inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens
    return triton_verify.verify_attention_triton(
        *args, **inputs.kwargs(), config=dataclasses.replace(config, int32_offsets=int32_offsets)
    )


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_matches_oracle(name, dtype):
    seed = list(TRITON_CASES).index(name) * 10 + TRITON_DTYPES.index(dtype)
    case = dataclasses.replace(TRITON_CASES[name], seed=seed)
    inputs = _make_inputs(case, dtype)
    _assert_matches_oracle(_run_triton(inputs, case), inputs, f"triton[{name}]")


@needs_triton
@pytest.mark.parametrize(
    "name", ["sparse-w-gt-block", "sparse-splits-g8", "sparse-q1-short-splits", "dense-q1-splits"]
)
def test_triton_int64_slot_offsets(name):
    """The loop over keys every row sees computes slot offsets in int32 where the cache allows it; the
    int64 path (a cache of more than 2^31 elements per batch row) gives the same result."""
    case = dataclasses.replace(TRITON_CASES[name], seed=11)
    inputs = _make_inputs(case, torch.float32)
    _assert_matches_oracle(_run_triton(inputs, case, int32_offsets=False), inputs, f"triton[{name}, int64 offsets]")


def _with_full_rows(inputs: Inputs, full: tuple[bool, ...]) -> tuple[Inputs, Inputs]:
    """``inputs`` where the rows ``full`` names read everything they hold through their count alone (``num_indices =
    cache_seqlens``, their index rows left as garbage), and the same call with those rows' reads written out."""
    seqlens = inputs.cache_seqlens.to(torch.int32)
    mask = torch.tensor(full, device=seqlens.device)
    counts = torch.where(mask, seqlens, inputs.num_indices.to(torch.int32)).to(inputs.num_indices.dtype)
    narrow = dataclasses.replace(inputs, num_indices=counts)
    from dustin_hf.kernels import full_rows_written

    indices, num_indices = full_rows_written(
        inputs.indices, counts, inputs.cache_seqlens, inputs.max_seqlen_k, inputs.q.shape[1]
    )
    return narrow, dataclasses.replace(inputs, indices=indices, num_indices=num_indices)


# (case, rows read in full, tuning of the dense part): a lone full row, several, all, none; one query (a draft's
# decode) and five; the dense part split over tickets and over the merge kernel (more than 8 splits)
FULL_ROW_CASES = {
    "one-of-three": (
        Case(seqlens=(120, 45, 300), group=4, head_dim=32, width=24, short_rows=True),
        (False, False, True),
        VerifyTuning(),
    ),
    "two-q1": (
        Case(seqlens=(90, 200, 57, 3), n_queries=1, group=2, head_dim=32, width=16, short_rows=True),
        (True, False, True, False),
        VerifyTuning(),
    ),
    "ticket-splits": (
        Case(seqlens=(260, 33, 150), group=7, n_kv_heads=1, width=20, num_splits=2, block_n=16),
        (True, False, True),
        VerifyTuning(programs_per_sm=64, min_blocks_per_split=2),
    ),
    "kernel-merge": (
        Case(
            seqlens=(700, 40, 610),
            n_queries=3,
            group=2,
            head_dim=32,
            width=48,
            short_rows=True,
            num_splits=3,
            block_n=16,
            merge="kernel",
        ),
        (True, False, False),
        VerifyTuning(programs_per_sm=64, min_blocks_per_split=1),
    ),
    "all-full": (Case(seqlens=(64, 100), group=2, head_dim=32, width=16), (True, True), VerifyTuning()),
    "none-full": (
        Case(seqlens=(64, 100), group=2, head_dim=32, width=16, short_rows=True),
        (False, False),
        VerifyTuning(),
    ),
}


@needs_triton
@pytest.mark.parametrize("name", list(FULL_ROW_CASES))
def test_triton_full_rows_read_everything_they_hold(name):
    """A sparse call with ``full_rows``: a row whose count covers all it holds reads all of it, its index row
    (narrower than it holds, garbage) unread, the other rows their selection; equal to the oracle on the reads
    written out, and to the dispatcher's reference path, which writes them out itself."""
    case, full, tuning = FULL_ROW_CASES[name]
    inputs = _make_inputs(dataclasses.replace(case, seed=hash(name) % 1000), torch.float32)
    assert all(
        not f or inputs.indices.shape[1] < n for f, n in zip(full, case.seqlens)
    )  # the index row cannot hold it
    narrow, written = _with_full_rows(inputs, full)
    from dustin_hf.kernels import triton_verify

    config = None
    if case.num_splits is not None:
        config = triton_verify.launch_config(
            len(case.seqlens),
            case.n_kv_heads,
            case.group,
            case.n_queries,
            case.head_dim,
            triton_verify.sparse_loop_keys(case.width, case.n_queries),
            sm_count(inputs.q.device),
            sparse=True,
            num_splits=case.num_splits,
            block_n=case.block_n,
            merge=case.merge,
        )
    args = narrow.q, narrow.k_cache, narrow.v_cache, narrow.cache_seqlens
    out = triton_verify.verify_attention_triton(*args, **narrow.kwargs(), full_rows=True, tuning=tuning, config=config)
    _assert_matches_oracle(out, written, f"triton[full rows, {name}]")
    in_range = dataclasses.replace(narrow, indices=narrow.in_range_indices())  # the reference gathers every entry
    reference = verify_attention(*args, **in_range.kwargs(), full_rows=True, backend="reference")
    _assert_matches_oracle(reference, written, f"reference[full rows, {name}]")


def test_full_rows_written_out():
    """The dispatcher's rewrite for backends without the Triton kernel's full rows: rows whose count covers all
    they hold list ``0 .. L - 1`` in an index tensor widened to ``max_seqlen_k - Q``; the others keep theirs."""
    from dustin_hf.kernels import full_rows_written

    indices = torch.tensor([[3, 5, 9], [0, 1, 2]], dtype=torch.int32)
    counts = torch.tensor([2, 6], dtype=torch.int32)
    indices, counts = full_rows_written(indices, counts, torch.tensor([10, 6]), 12, 2)
    assert indices.shape == (2, 10) and counts.tolist() == [2, 6]
    assert indices[0, :2].tolist() == [3, 5] and indices[1, :6].tolist() == list(range(6))


@needs_triton
def test_triton_ticket_merge_leaves_its_counters_at_zero():
    """Every launch hands the ticket counters back at zero; a counter left behind would stop the next
    launch's merge (no split would draw the last ticket) and leave that output unwritten."""
    case = dataclasses.replace(TRITON_CASES["sparse-ticket-3-splits"], seed=3)
    inputs = _make_inputs(case, torch.float32)
    first = _run_triton(inputs, case)
    counters = tickets(inputs.q.device, 1)
    assert not counters.any()
    second = _run_triton(inputs, case)
    assert not counters.any()
    assert torch.equal(first, second)
    _assert_matches_oracle(second, inputs, "triton[ticket, second launch]")


def test_triton_schedule_on_sm90():
    """The kernel at the 72B / batch 16 / budget 512 point compiled for sm_90 without a GPU
    (``verify_ptx.py``, in a subprocess without the interpreter). With the heuristic's 5 stages the
    main loop keeps a K/V tile in flight (3 cp.async groups) while it computes one; with the 3 stages
    used before, Triton issued each tile's gathers only after the previous tile was done, every tile
    paid a full memory latency, and the kernel took 18 us on an H200 (15.4 us with 5 stages). The
    ticket merge's partial stores, barrier, atomic, barrier and loads come in that order."""
    launches = {launch["label"]: launch for launch in sm90_ptx_report("verify_ptx.py")}
    heuristic, ticket = launches["heuristic"], launches["ticket"]
    for launch in (heuristic, ticket):  # 5 stages: one tile in flight
        assert launch["max_wait_group"] >= 3, launch
    for launch in (heuristic, ticket):
        assert launch["cp_async_16"] > 0 and launch["local"] == 0, launch  # 16-byte gathers, no spills
    assert ticket["release_order"] and ticket["acquire_order"], ticket


def test_triton_fits_the_shared_memory_of_smaller_gpus():
    """Compiled for sm_80 (A100) and sm_86 (RTX 30xx/40xx, A10, L4) without a GPU (``smem_report.py``, the public
    launchers on those GPUs simulated: each asks the device for its per-block limit): every heuristic launch
    there fits that limit, and each module's ``_shared_bytes`` bounds what the compiler allocates (exactly,
    for the GEMMs). Verification in fp32 with head dim 128 needed 115,200
    bytes sparse and 180,480 dense, over sm_86's 101,376 (and dense over an A100's 166,912): those take fewer
    stages or 32-key tiles there; a selection layer's dense call (writing the scores) as the plain one.
    ``gated_linear``'s 4 stages needed 110,592 / 122,880 bytes at 16 / 32 rows: 3 stages on sm_86."""
    report = sm90_ptx_report("smem_report.py")
    assert [r["kernel"] for r in report].count("verify") == 48 and len(report) == 72
    for row in report:
        assert row["shared"] <= row["estimate"] <= row["limit"], row
        if row["kernel"] != "verify":
            assert row["shared"] == row["estimate"], row
    verify = [r for r in report if r["kernel"] == "verify"]
    narrowed = {(r["cc"], r["head_dim"], r["n_queries"], r["sparse"]) for r in verify if r["block_n"] < 64}
    assert narrowed == {(86, 128, 5, True), (86, 128, 5, False)}  # fp32 only: 16-bit launches keep 64 keys
    gated = {(r["cc"], r["m"]): r["num_stages"] for r in report if r["kernel"] == "gated"}
    assert gated == {(80, 16): 4, (80, 32): 4, (86, 16): 3, (86, 32): 3}


def test_shared_memory_limit_changes_nothing_on_an_h100():
    """Under an H100/H200's 227 KiB per block the heuristic configs are the ones chosen without a limit
    (the benchmarks' launches are unchanged); under 99 KiB fp32 head dim 128 changes, 16 bits do not."""
    from dustin_hf.kernels.triton_verify import launch_config

    sm90, sm86 = 232448, 101376
    for elem_bytes, head_dim, n_queries, sparse, batch in itertools.product(
        (2, 4), (64, 128), (1, 5), (True, False), (1, 16)
    ):
        args = (batch, 8, 8, n_queries, head_dim, 517 if sparse else 32773, 132)
        free = launch_config(*args, sparse=sparse, elem_bytes=elem_bytes)
        assert launch_config(*args, sparse=sparse, elem_bytes=elem_bytes, smem_limit=sm90) == free
        small = launch_config(*args, sparse=sparse, elem_bytes=elem_bytes, smem_limit=sm86)
        over = elem_bytes == 4 and head_dim == 128 and not (sparse and n_queries == 1)  # one query sparse: 77 KiB
        assert (small != free) == over, (elem_bytes, head_dim, n_queries, sparse, batch)
    with pytest.raises(ValueError, match="shared memory"):
        launch_config(1, 8, 8, 5, 512, 32773, 132, elem_bytes=4, smem_limit=sm86)  # head dim 512 in fp32: nothing fits
    kept = launch_config(1, 8, 8, 5, 128, 32773, 132, elem_bytes=4, smem_limit=sm86, block_n=64, num_stages=3)
    assert (kept.block_n, kept.num_stages) == (64, 3)  # explicit choices are the caller's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_memory_limit_is_the_one_triton_checks_launches_against():
    """On a GPU the limit is the opt-in per-block maximum Triton's launcher compares a kernel's shared memory with
    (227 KiB on an H100/H200), not PyTorch's 48 KiB default."""
    from triton.compiler.compiler import max_shared_mem

    from dustin_hf.kernels._device import smem_limit

    device = torch.device("cuda", torch.cuda.current_device())
    assert smem_limit(device) == smem_limit(torch.device("cuda")) == max_shared_mem(device.index)
    assert smem_limit(device) > torch.cuda.get_device_properties(device).shared_memory_per_block
    if torch.cuda.get_device_capability(device) == (9, 0):
        assert smem_limit(device) == 227 * 1024


@needs_triton
def test_triton_public_entry_dense_without_max_seqlen_k():
    """The public function with the default heuristic; dense mode computes max_seqlen_k itself."""
    from dustin_hf.kernels.triton_verify import verify_attention_triton

    inputs = _make_inputs(Case(seqlens=(21, 3), n_queries=2, head_dim=32, seed=7), torch.float16)
    args = inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens
    out = verify_attention_triton(*args, **inputs.kwargs() | {"max_seqlen_k": None})
    _assert_matches_oracle(out, inputs, "triton[public dense]")


@needs_triton
def test_triton_rejects_mismatched_dtypes():
    from dustin_hf.kernels.triton_verify import verify_attention_triton

    inputs = _make_inputs(Case(seqlens=(5,), head_dim=16), torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        verify_attention_triton(
            inputs.q.float(), inputs.k_cache, inputs.v_cache, inputs.cache_seqlens, softmax_scale=1.0
        )


@needs_triton
def test_triton_split_heuristic_uses_host_sizes_only():
    from dustin_hf.kernels.triton_verify import launch_config

    small = launch_config(1, 8, 8, 5, 128, 1029, sm_count=132)  # 72B layout, batch 1, budget 1024
    assert small.num_splits > 1 and small.chunk % small.block_n == 0 and small.block_m == 64
    assert small.num_splits * small.chunk >= 1029 > (small.num_splits - 1) * small.chunk  # no empty split
    busy = launch_config(64, 8, 8, 5, 128, 1029, sm_count=132)  # enough programs already
    assert busy.num_splits == 1
    assert launch_config(1, 8, 8, 5, 128, 5, sm_count=132).num_splits == 1  # nothing to split
    # budget 512 + 5 new tokens: unsplit once the programs fill half the SMs (measured faster on the H200)
    assert launch_config(16, 8, 8, 5, 128, 517, sm_count=132).num_splits == 1
    assert launch_config(4, 8, 8, 5, 128, 517, sm_count=132).num_splits > 1
    # dense: 2 programs per SM, however long the keys (a finer split of 32k at batch 16 made exact mode's whole
    # step 2.7% slower on the H200)
    assert launch_config(16, 4, 7, 5, 128, 16389, sm_count=132).num_splits == 4  # 7B layout
    assert launch_config(16, 4, 7, 5, 128, 32773, sm_count=132).num_splits == 4
    assert launch_config(16, 8, 8, 5, 128, 32768, sm_count=132).num_splits == 2  # 72B layout
    # sparse: one program per SM (7B layout, batch 16: 64 programs -> 2 splits)
    assert launch_config(16, 4, 7, 5, 128, 517, sm_count=132, sparse=True).num_splits == 2
    assert (
        launch_config(
            16, 4, 7, 5, 128, 517, sm_count=132, sparse=True, tuning=VerifyTuning(sparse_programs_per_sm=2)
        ).num_splits
        == 3
    )
    # one query (a draft's decode step, VerifyTuning.decode_*): a key tile per split, 2 warps, merged by a launch
    decode = launch_config(16, 2, 7, 1, 64, 521, sm_count=132, sparse=True)
    assert (decode.num_splits, decode.chunk, decode.num_warps, decode.merge) == (9, 64, 2, "kernel")
    assert (
        launch_config(
            16, 2, 7, 1, 64, 521, sm_count=132, sparse=True, tuning=VerifyTuning(decode_programs_per_sm=1)
        ).num_splits
        == 3
    )  # one program per SM
    assert launch_config(64, 2, 7, 1, 64, 521, sm_count=132, sparse=True).num_splits == 1  # 128 programs: short range
    # dense with more than 64 (query, head) rows of head dim 128 (a confirming step's 13 queries, 7-head group): 8
    # warps (62% of the copy bandwidth on an H200, 4 warps 40%); 9 queries (63 rows) and sparse calls keep 4
    assert launch_config(16, 4, 7, 13, 128, 32781, sm_count=132).num_warps == 8
    assert launch_config(16, 4, 7, 9, 128, 32777, sm_count=132).num_warps == 4
    assert launch_config(16, 4, 7, 13, 128, 517, sm_count=132, sparse=True).num_warps == 4


@needs_triton
def test_triton_stages_heuristic():
    from dustin_hf.kernels.triton_verify import launch_config

    headline = launch_config(16, 8, 8, 5, 128, 517, sm_count=132, sparse=True)  # 72B layout, batch 16, budget 512
    assert (headline.num_splits, headline.num_stages) == (1, 5)  # a K/V tile in flight
    assert launch_config(16, 8, 8, 5, 128, 517, sm_count=132, sparse=True, elem_bytes=4).num_stages == 3  # fp32: smem
    assert launch_config(16, 8, 8, 5, 128, 32768, sm_count=132).num_stages == 3  # dense: no index load to pipeline


@needs_triton
def test_triton_merge_heuristic():
    from dustin_hf.kernels.triton_verify import _MAX_TICKET_SPLITS, launch_config

    assert launch_config(16, 8, 8, 5, 128, 517, sm_count=132, sparse=True).merge == "none"  # one split
    few = launch_config(1, 8, 8, 5, 128, 517, sm_count=132, sparse=True)
    assert 1 < few.num_splits <= _MAX_TICKET_SPLITS and few.merge == "ticket"
    many = launch_config(1, 8, 8, 5, 128, 32768, sm_count=132)
    assert many.num_splits > _MAX_TICKET_SPLITS and many.merge == "kernel"
    assert launch_config(1, 8, 8, 5, 128, 32768, sm_count=132, num_splits=4, merge="kernel").merge == "kernel"
    with pytest.raises(ValueError, match="at most"):
        launch_config(1, 8, 8, 5, 128, 32768, sm_count=132, merge="ticket")
    with pytest.raises(ValueError, match="merge"):
        launch_config(1, 8, 8, 5, 128, 32768, sm_count=132, num_splits=2, merge="atomic")


@needs_cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_triton_large_on_gpu(sparse):
    """Qwen2.5-72B head layout at a few thousand keys with the default heuristic (several splits)."""
    case = Case(
        seqlens=(3000, 17, 4093),
        group=8,
        n_kv_heads=8,
        head_dim=128,
        width=1000 if sparse else None,
        short_rows=sparse,
        seed=11,
    )
    inputs = _make_inputs(case, torch.bfloat16)
    from dustin_hf.kernels.triton_verify import verify_attention_triton

    out = verify_attention_triton(inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens, **inputs.kwargs())
    _assert_matches_oracle(out, inputs, "triton[large]")


@needs_cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_triton_is_cuda_graph_capturable(sparse):
    """No host sync: capture one call, refill the inputs in place, replay, compare with an eager call."""
    from dustin_hf.kernels.triton_verify import verify_attention_triton

    case = Case(seqlens=(700, 0, 1500), group=7, n_kv_heads=4, head_dim=128, width=300 if sparse else None, seed=3)
    inputs = _make_inputs(case, torch.bfloat16)
    fresh = _make_inputs(dataclasses.replace(case, seed=4), torch.bfloat16)
    args = inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens

    def call():
        return verify_attention_triton(*args, **inputs.kwargs())

    graph, captured = capture_graph(call)
    for name in ("q", "k_cache", "v_cache", "indices", "num_indices"):
        if getattr(inputs, name) is not None:
            getattr(inputs, name).copy_(getattr(fresh, name))
    eager = call()
    for _ in range(3):  # the split merge's counters must be back at zero after every replay
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, rtol=0, atol=0)
    _assert_matches_oracle(captured, inputs, "triton[graph]")


@needs_cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("n_queries", [1, 9])
def test_triton_full_rows_on_gpu_under_a_graph(n_queries):
    """Qwen2.5-7B's attention layout, batch 8, a few thousand keys, 256 selected, the default heuristic: one call
    with ``full_rows`` captured while rows 0 and 3 read in full, replayed with other data where rows 1, 2 and 5 do
    (which rows read in full is read on the device), against the oracle on the reads written out."""
    from dustin_hf.kernels.triton_verify import verify_attention_triton

    case = Case(
        seqlens=(3000, 4093, 1700, 2500, 900, 4000, 2048, 3333),
        n_queries=n_queries,
        group=7,
        n_kv_heads=4,
        head_dim=128,
        width=256,
        short_rows=True,
        seed=5,
    )
    inputs, fresh = (_make_inputs(dataclasses.replace(case, seed=s), torch.bfloat16) for s in (5, 6))
    narrow, _ = _with_full_rows(inputs, (True, False, False, True, False, False, False, False))
    after, after_written = _with_full_rows(fresh, (False, True, True, False, False, True, False, False))
    args = narrow.q, narrow.k_cache, narrow.v_cache, narrow.cache_seqlens

    def call():
        return verify_attention_triton(*args, **narrow.kwargs(), full_rows=True)

    graph, captured = capture_graph(call)
    for name in ("q", "k_cache", "v_cache", "indices", "num_indices"):
        getattr(narrow, name).copy_(getattr(after, name))
    eager = call()
    for _ in range(2):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, rtol=0, atol=0)
    _assert_matches_oracle(captured, after_written, "triton[full rows, graph]")


@needs_cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_triton_ticket_merge_under_load(num_splits):
    """Qwen2.5-72B layout, batch 16, 512 of 4096 positions, 2-6 splits over the whole GPU, 20 launches
    alternating two inputs: the in-kernel merge equals the merge kernel's. A merge that read a partial
    before its split's release (or a stale line) would see the other input's or unwritten values."""
    from dustin_hf.kernels import triton_verify

    cases = [Case(seqlens=(4096,) * 16, group=8, n_kv_heads=8, head_dim=128, width=512, seed=seed) for seed in (1, 2)]
    sets = [_make_inputs(case, torch.bfloat16) for case in cases]

    def run(x, merge):
        config = triton_verify.launch_config(
            16,
            8,
            8,
            5,
            128,
            512 + 5,
            sm_count(x.q.device),
            sparse=True,
            block_n=32,
            num_splits=num_splits,
            merge=merge,
        )
        return triton_verify.verify_attention_triton(
            x.q, x.k_cache, x.v_cache, x.cache_seqlens, **x.kwargs(), config=config
        )

    expected = [run(x, "kernel") for x in sets]
    for i in range(20):
        out = run(sets[i % 2], "ticket")
        torch.testing.assert_close(out, expected[i % 2], rtol=1e-2, atol=1e-2)
    assert not tickets(sets[0].q.device, 1).any()


# ----------------------------------------------------------------------------- varlen / flash-attn


def _fake_fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, scale, seqused_k=None):
    """FlashAttention-2 varlen semantics in fp64: per sequence, bottom-right causal, GQA, seqused_k."""
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_seqlens_q) - 1):
        q_lo, q_hi, k_lo = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cu_seqlens_k[b])
        n_k = int(seqused_k[b]) if seqused_k is not None else int(cu_seqlens_k[b + 1]) - k_lo
        assert n_k <= max_seqlen_k
        n_q = q_hi - q_lo
        keys = k[k_lo : k_lo + n_k].double().repeat_interleave(group, dim=1)  # (n_k, Hq, D)
        values = v[k_lo : k_lo + n_k].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].double(), keys) * scale
        visible = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q  # bottom-right
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def _fake_varlen_attn_new(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    assert window_size == (-1, 0) and isinstance(window_size, tuple)
    assert enable_gqa or query.shape[1] == key.shape[1]
    return _fake_fa2(query, key, value, cu_seq_q, cu_seq_k, max_k, scale, seqused_k)


def _fake_varlen_attn_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10 style: no scale, no GQA, causal by flag."""
    assert is_causal and query.shape[1] == key.shape[1]
    return _fake_fa2(query, key, value, cu_seq_q, cu_seq_k, max_k, query.shape[-1] ** -0.5)


def _fake_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    block_table=None,
):
    assert causal
    return _fake_fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale)


def _fake_flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False
):
    assert causal and k is None and cache_seqlens.dtype == torch.int32
    batch, n_q = q.shape[:2]
    out = torch.empty_like(q)
    for b in range(batch):
        n_k = int(cache_seqlens[b])
        cu = torch.tensor([0, n_q], dtype=torch.int32), torch.tensor([0, n_k], dtype=torch.int32)
        out[b] = _fake_fa2(q[b], k_cache[b, :n_k], v_cache[b, :n_k], *cu, n_k, softmax_scale)
    return out


VARLEN_CASES = {
    name: TRITON_CASES[name]
    for name in (
        "dense-ragged-splits",
        "dense-slice_t-g7",
        "dense-slice_b-int64",
        "dense-strided_d",
        "sparse-w-gt-block",
        "sparse-splits-g8",
        "sparse-slice_t-d80",
    )
}


@pytest.mark.parametrize("flavour", ["torch-new", "torch-old", "flash-attn"])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_packing_with_fake_kernels(name, flavour):
    """The gather/packing/argument logic on CPU, with fake kernels of FlashAttention-2 semantics."""
    kernels = {
        "flash-attn": (_fake_flash_attn_varlen_func, _fake_flash_attn_with_kvcache),
        "torch-new": (_fake_varlen_attn_new, None),
        "torch-old": (_fake_varlen_attn_old, None),
    }[flavour]
    inputs = _make_inputs(dataclasses.replace(VARLEN_CASES[name], seed=5), torch.float32, "cpu")
    args = inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens
    out = varlen.verify_attention_varlen(
        *args, **inputs.kwargs(), use_flash_attn=flavour == "flash-attn", kernels=kernels
    )
    _assert_matches_oracle(out, inputs, f"varlen[{flavour}]")


GPU_BACKENDS = [
    pytest.param("varlen", marks=pytest.mark.skipif(not varlen.torch_varlen_available(), reason="no varlen_attn")),
    pytest.param("flash_attn", marks=pytest.mark.skipif(not (HAS_CUDA and HAS_FLASH_ATTN), reason="no flash-attn")),
    pytest.param("triton", marks=needs_triton),
]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("name", list(TRITON_CASES))
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_match_oracle(backend, name, dtype):
    case = TRITON_CASES[name]
    if case.head_dim % 8 and backend != "triton":
        pytest.skip("FlashAttention-2 needs head dims that are multiples of 8")
    inputs = _make_inputs(dataclasses.replace(case, seed=9), dtype)
    args = inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens
    out = verify_attention(*args, **inputs.kwargs(), backend=resolve_backend(backend, DEVICE))
    _assert_matches_oracle(out, inputs, backend)


# ----------------------------------------------------------------------------- dispatcher


def test_auto_on_cpu_is_reference():
    assert resolve_backend("auto", "cpu") == "reference"


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError) as error:
        resolve_backend("flashy", "cpu")
    assert all(name in str(error.value) for name in BACKENDS)


@pytest.mark.parametrize("backend", ["triton", "varlen", "flash_attn"])
def test_gpu_backend_on_cpu_says_what_to_use(backend):
    with pytest.raises(ValueError, match="reference"):
        resolve_backend(backend, "cpu")


def test_dispatcher_reference_matches_oracle():
    inputs = _make_inputs(Case(seqlens=(13, 30), width=10, short_rows=True, seed=21), torch.float32, "cpu")
    kwargs = inputs.kwargs() | {"indices": inputs.in_range_indices()}
    out = verify_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens, **kwargs)
    _assert_matches_oracle(out, inputs, "dispatcher")


# ----------------------------------------------------------------------------- cache writes


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_triton_kv_write_equals_index_put(dtype, head_dim):
    """The one-launch K/V write stores exactly what ``cache[rows, slots] = states`` stores, and nothing else."""
    from dustin_hf.kernels.triton_cache import write_kv_triton

    gen = torch.Generator().manual_seed(head_dim)
    batch, rows, heads, n_new, capacity, row0 = 4, 2, 3, 5, 40, 1
    # states as attention layers produce them: (B', Q, H, D) projections viewed as (B', H, Q, D)
    keys = torch.randn(rows, n_new, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    values = torch.randn(rows, n_new, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    slots = torch.tensor([[3, 4, 5, 6, 7], [30, 31, 32, 33, 34]])
    k_cache = torch.randn(batch, capacity, heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(batch, capacity, heads, head_dim, generator=gen).to(dtype)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    row_ids = torch.arange(row0, row0 + rows)[:, None]
    expect_k[row_ids, slots] = keys.transpose(1, 2)
    expect_v[row_ids, slots] = values.transpose(1, 2)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv_triton(keys.to(DEVICE), values.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), row0)
    assert torch.equal(k_cache.cpu(), expect_k) and torch.equal(v_cache.cpu(), expect_v)


@needs_triton
def test_triton_kv_write_refuses_mismatched_shapes():
    from dustin_hf.kernels.triton_cache import write_kv_triton

    states = torch.zeros(1, 2, 3, 16, device=DEVICE)
    cache = torch.zeros(2, 8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slots"):
        write_kv_triton(states, states, cache, cache, torch.zeros(1, 4, dtype=torch.long, device=DEVICE), 0)
    with pytest.raises(ValueError, match="do not fit"):
        write_kv_triton(
            states, states, cache[..., :8], cache[..., :8], torch.zeros(1, 3, dtype=torch.long, device=DEVICE), 0
        )
