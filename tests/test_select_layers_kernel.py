"""The selection layers' Triton path (``choose_read_set(..., backend="triton")``) against its PyTorch path and an
explicit float64 loop.

The loop below takes, per (row, counted query, head), the softmax over the row's cached positions and averages the
probabilities over heads and the row's own queries; it shares no code with ``selection/layers.py`` or the kernels.
fp32 must match it and the PyTorch path to ``rtol 1e-4 / atol 1e-6``; fp16 follows flash-attn's rule: the kernel's
max abs error against the loop may be at most twice the error of PyTorch's own fp16 path (the same mean, from fp16
logits), plus ``1e-6``. The chosen sets must equal the PyTorch path's where no scores tie (random fp32 inputs).

Triton runs on CUDA when there is one, otherwise in the Triton interpreter on CPU (``TRITON_INTERPRET=1``, set by
tiny_models, which conftest imports first, before triton is imported) with small shapes. Small launch settings
force several splits per row in the scoring kernel and several chunks per row in the selection kernel, which the
heuristics would not pick here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_RUNS

from dustin_hf.kernels.tuning import ScoreTuning, SelectTuning
from dustin_hf.runtime.plan import DeviceTensors, SelectLayers
from dustin_hf.selection.layers import choose_read_set, layer_position_weights
from dustin_hf.selection.scoring import attention_mass

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.skipif(not TRITON_RUNS, reason="needs triton: CUDA, or on CPU TRITON_INTERPRET=1"),
    # the scoring kernel's pass 2 loads whole tiles, cells pass 1 never wrote included, and drops them with
    # tl.where; the interpreter's numpy still warns when that garbage overflows
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

SCALE = 0.3
SPAN = 90
SINK, RECENT = 2, 4
SMALL_SCORE = ScoreTuning(programs_per_sm=64, tile_bytes=512, min_blocks_per_split=1)  # 3 splits of one tile
SMALL_SELECT = SelectTuning(min_chunk=32)  # several launch-1 chunks per row


def _inputs(dtype: torch.dtype, group: int, n_q: int = 5, seed: int = 0):
    """``(q, keys, seqlens)``: ragged rows (one sees only 3 positions), keys with room past the span."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim = 2, 16
    q = 1.5 * torch.randn(4, n_q, kv_heads * group, dim, generator=gen)  # peakier than N(0, 1) logits
    keys = torch.randn(4, SPAN + 7, kv_heads, dim, generator=gen)
    seqlens = torch.tensor([SPAN, 3, 41, 77], dtype=torch.int32)
    return q.to(DEVICE, dtype), keys.to(DEVICE, dtype), seqlens.to(DEVICE)


def _explicit(q, keys, seqlens, counts=None) -> torch.Tensor:
    """The oracle: float64, one (row, counted query, head) softmax at a time; ``(B, SPAN)``."""
    q, keys = q.cpu().double(), keys.cpu().double()
    batch, n_q, heads = q.shape[:3]
    group = heads // keys.shape[2]
    out = torch.zeros(batch, SPAN, dtype=torch.float64)
    for b in range(batch):
        length = int(seqlens[b])
        own = n_q if counts is None else max(1, min(int(counts[b]), n_q))
        for j in range(own):
            for h in range(heads):
                out[b, :length] += (keys[b, :length, h // group] @ q[b, j, h] * SCALE).softmax(0)
        out[b] /= own * heads
    return out


def _low_precision_pytorch(q, keys, seqlens, counts=None) -> torch.Tensor:
    """The same mean through PyTorch's logits in the inputs' dtype (``attention_mass``'s reference path)."""
    n_q, heads = q.shape[1], q.shape[2]
    own = None if counts is None else counts.long().clamp(1, n_q)
    mass = attention_mass(
        q,
        keys,
        (seqlens.long() - 1)[:, None].expand(-1, n_q),
        tuple(range(heads)),
        heads // keys.shape[2],
        SCALE,
        SPAN,
        SPAN,
        query_counts=own,
    )
    return (mass / (heads * (n_q if own is None else own[:, None]))).double().cpu()


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_weights_equal_the_reference_and_the_explicit_loop(group, counted):
    """fp32 and fp16, the heuristic launch and a small one; with ``counted`` each row scores with its own leading
    queries only (5, 2, 1 and 3 of them)."""
    for dtype in (torch.float32, torch.float16):
        q, keys, seqlens = _inputs(dtype, group, seed=group + 10 * counted)
        counts = torch.tensor([5, 2, 1, 3], dtype=torch.int32, device=DEVICE) if counted else None
        exact = _explicit(q, keys, seqlens, counts)
        for tuning in (None, SMALL_SCORE):
            got = layer_position_weights(q, keys, seqlens, SPAN, SCALE, counts, backend="triton", tuning=tuning)
            assert got.dtype == torch.float32 and got.shape == (4, SPAN) and not torch.isnan(got).any()
            label = f"group {group} counted {counted} {dtype} tuning {tuning}"
            if dtype == torch.float32:
                torch.testing.assert_close(
                    got.double().cpu(), exact, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label}: {m}"
                )
                want = layer_position_weights(q, keys, seqlens, SPAN, SCALE, counts)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} vs reference: {m}")
                continue
            baseline = (_low_precision_pytorch(q, keys, seqlens, counts) - exact).abs().max().item()
            err = (got.double().cpu() - exact).abs().max().item()
            assert err <= 2 * baseline + 1e-6, f"{label}: max abs error {err:.3g} > 2 x {baseline:.3g} + 1e-6"


def test_queries_past_a_rows_count_change_nothing():
    """A row's queries past its own count (``query_counts``) may take any value: the kernel's weights stay as they
    were, and they differ from what all the queries give."""
    q, keys, seqlens = _inputs(torch.float32, 2, seed=3)
    counts = torch.tensor([1, 2, 4, 3], dtype=torch.int32, device=DEVICE)
    before = layer_position_weights(q, keys, seqlens, SPAN, SCALE, counts, backend="triton")
    moved = q.clone()
    for b, n in enumerate(counts.tolist()):
        moved[b, n:] = 3 * torch.randn_like(moved[b, n:])
    torch.testing.assert_close(
        layer_position_weights(moved, keys, seqlens, SPAN, SCALE, counts, backend="triton"),
        before,
        rtol=1e-5,
        atol=1e-7,
    )
    everything = layer_position_weights(q, keys, seqlens, SPAN, SCALE, None, backend="triton")
    assert (everything - before).abs().max() > 1e-3


def _read_set_inputs(seed: int):
    """Four rows: two sparse ones of different counts (the quality knob's), one sparse of the full width, and one
    whose count covers its length (read in full: its index row is kept)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 5, 4, 16, generator=gen).to(DEVICE)
    keys = torch.randn(4, 300, 2, 16, generator=gen).to(DEVICE)
    seqlens = torch.tensor([200, 250, 40, 180], dtype=torch.int32, device=DEVICE)
    width = 64
    indices = torch.arange(width, dtype=torch.int32, device=DEVICE).expand(4, width).contiguous()
    counts = torch.tensor([64, 50, 64, 30], dtype=torch.int32, device=DEVICE)
    return (
        q,
        keys,
        DeviceTensors(seqlens, indices, counts, torch.tensor([5, 2, 5, 1], dtype=torch.int32, device=DEVICE)),
    )


@pytest.mark.parametrize("queries", [None, 1])
@pytest.mark.parametrize("counted", [False, True])
def test_chosen_sets_equal_the_reference(counted, queries):
    """The kernels' read set (scoring and fill) is the PyTorch path's, entries past each row's count 0 included,
    with or without per-row query counts, all queries or the first one only."""
    q, keys, tensors = _read_set_inputs(seed=5 + counted)
    if not counted:
        tensors = DeviceTensors(tensors.cache_seqlens, tensors.indices, tensors.num_indices)
    spec = SelectLayers((1,), SINK, RECENT, queries)
    want = choose_read_set(q, keys, tensors, 250, spec, SCALE)
    for score, select in ((None, None), (SMALL_SCORE, SMALL_SELECT)):
        got = choose_read_set(
            q, keys, tensors, 250, spec, SCALE, backend="triton", score_tuning=score, select_tuning=select
        )
        assert got.indices.dtype == torch.int32 and got.indices.shape == want.indices.shape
        assert torch.equal(got.indices, want.indices), (score, select)
        assert got.num_indices is tensors.num_indices and got.cache_seqlens is tensors.cache_seqlens


def test_the_fill_past_the_selection_kernels_pools_runs_in_pytorch(monkeypatch):
    """A span whose pools would not fit one program takes the PyTorch fill (the scoring kernel still runs)."""
    from dustin_hf.kernels import triton_select

    q, keys, tensors = _read_set_inputs(seed=7)
    spec = SelectLayers((1,), SINK, RECENT)
    monkeypatch.setattr(triton_select, "select_sparse_triton", None)  # calling it would raise
    tiny_pools = SelectTuning(min_chunk=16384, target_pool=1)
    monkeypatch.setattr(triton_select, "_MAX_POOL", 16)
    got = choose_read_set(q, keys, tensors, 250, spec, SCALE, backend="triton", select_tuning=tiny_pools)
    assert torch.equal(got.indices, choose_read_set(q, keys, tensors, 250, spec, SCALE).indices)
