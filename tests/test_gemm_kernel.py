"""The decode-sized GEMM kernel against F.linear (interpreter on CPU, compiled on CUDA)."""

import pytest
import torch
from conftest import TRITON_RUNS

pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, n, k, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize(
    "m,n,k,bias,overrides",
    [
        (1, 40, 24, False, {}),  # one row, one partial tile each way
        (16, 96, 200, True, {}),  # K not a multiple of the tile
        (5, 70, 300, True, {"split_k": 3, "block_k": 64}),  # ticket merge over three splits, ragged last split
        (9, 130, 520, True, {"split_k": 4, "block_k": 32, "block_n": 32}),
        (16, 64, 256, False, {"split_k": 1}),
        (80, 40, 96, True, {}),  # 16 rows x 5 verified tokens: a 128-row tile, rows past 80 masked
        (33, 50, 160, False, {"split_k": 2, "block_k": 32}),  # a 64-row tile, split
    ],
)
def test_skinny_linear_matches_f_linear_in_float32(m, n, k, bias, overrides):
    from dustin_hf.kernels.triton_gemm import skinny_linear

    x, w, b = _operands(m, n, k, bias, torch.float32)
    out = skinny_linear(x, w, b, **overrides)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, skinny_linear(x, w, b, **overrides)), "a repeated launch must give the same bits"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_skinny_linear_in_16_bits_and_batched_shapes(dtype):
    from dustin_hf.kernels.triton_gemm import skinny_linear

    x, w, b = _operands(12, 72, 160, True, dtype, seed=1)
    x = x.reshape(3, 4, 160)  # (..., K) inputs keep their leading shape
    out = skinny_linear(x, w, b, split_k=2, block_k=32)
    ref = x.float() @ w.float().t() + b.float()  # exact, then one rounding: within one ulp of the output
    assert out.shape == (3, 4, 72) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=1e-3)


def test_skinny_linear_rejects_what_it_cannot_compute():
    from dustin_hf.kernels.triton_gemm import MAX_ROWS, skinny_linear

    x, w, _ = _operands(MAX_ROWS + 1, 8, 16, False, torch.float32)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match="weight must be"):
        skinny_linear(x[:2], w[:, :8])
    with pytest.raises(ValueError, match="share one of"):
        skinny_linear(x[:2], w.half())


@pytest.mark.parametrize(
    "m,n,k,overrides",
    [
        (1, 40, 24, {}),  # one row, partial tiles
        (16, 70, 200, {"block_n": 32, "block_k": 64}),  # K and N not multiples of the tiles
        (32, 64, 96, {"block_n": 16}),
        (40, 72, 136, {}),  # a large target's verification rows (8 x 5): a 64-row tile, rows past 40 masked
    ],
)
def test_gated_linear_is_silu_of_gate_times_up(m, n, k, overrides):
    """fp32: the SiLU-product of the two projections; the up rows are the second half of the weight."""
    from dustin_hf.kernels.triton_gemm import gated_linear

    x, w, _ = _operands(m, 2 * n, k, False, torch.float32, seed=m)
    out = gated_linear(x, w, **overrides)
    gate, up = torch.nn.functional.linear(x, w).chunk(2, dim=-1)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, torch.nn.functional.silu(up) * gate, atol=1e-3)  # halves told apart


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gated_linear_rounds_as_silu_mul(dtype):
    """16 bits: the projections rounded once to the dtype, then ``F.silu(gate) * up`` in PyTorch's roundings.
    The kernel's fp32 sums differ from exact ones in their last bits, which rarely moves a rounding: nearly
    every element is equal, none is off by more than two ulps."""
    from dustin_hf.kernels.triton_gemm import gated_linear

    x, w, _ = _operands(12, 2 * 48, 160, False, dtype, seed=5)
    x = x.reshape(3, 4, 160)
    out = gated_linear(x, w)
    assert out.shape == (3, 4, 48) and out.dtype == dtype
    gate, up = (x.double() @ w.double().t()).to(dtype).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out, want, rtol=2**-6 if dtype == torch.bfloat16 else 2**-9, atol=1e-3)
    assert (out == want).float().mean() > 0.95


def test_gemm_launch_fits_the_shared_memory_limit():
    """Under a per-block limit the heuristic drops stages, then tile width, to fit it; what the caller chose
    explicitly is kept, and a limit nothing fits is a clear error. (The launchers pass their device's limit:
    ``smem_report.py`` compiles them on simulated GPUs.)"""
    from dustin_hf.kernels.triton_gemm import launch_config

    def gated(limit, **overrides):  # the 16 x 896 input and [gate; up] weight of 2 x 64 rows, bf16
        config = launch_config(16, 64, 896, 1, 2, gated=True, smem_limit=limit, **overrides)
        return config.block_n, config.num_stages

    assert [gated(limit) for limit in (None, 101376, 60000)] == [(64, 4), (64, 3), (64, 2)]
    assert gated(60000, num_stages=4) == (16, 4)  # explicit stages kept: the tiles narrow instead
    with pytest.raises(ValueError, match="shared memory"):
        gated(1000)


def test_gemm_tiles_widen_past_32_rows():
    """32-column weight tiles up to a 32-row tile of x, 64 columns from a 64-row tile on (measured faster there)."""
    from dustin_hf.kernels.triton_gemm import launch_config

    tiles = [launch_config(m, 256, 512, 1, 2) for m in (16, 32, 33, 80)]
    assert [(t.block_m, t.block_n) for t in tiles] == [(16, 32), (32, 32), (64, 64), (128, 64)]


def test_gemm_tuning_sets_the_heuristic():
    """A GemmTuning changes the heuristic's stages, split aim and gated tiles; the defaults are GemmTuning()'s."""
    from dustin_hf.kernels.triton_gemm import launch_config
    from dustin_hf.kernels.tuning import GemmTuning

    default = launch_config(16, 896, 4864, 132, 2)  # the 0.5B draft's down projection on an H200
    assert launch_config(16, 896, 4864, 132, 2, tuning=GemmTuning()) == default
    assert (default.num_stages, default.split_k) == (6, 8)
    tuned = launch_config(16, 896, 4864, 132, 2, tuning=GemmTuning(num_stages=3, max_splits=4))
    assert (tuned.num_stages, tuned.split_k) == (3, 4)
    gated = launch_config(16, 4864, 896, 132, 2, gated=True, tuning=GemmTuning(gated_block_n=32, gated_num_stages=3))
    assert (gated.block_n, gated.num_stages, gated.split_k) == (32, 3, 1)
    with pytest.raises(ValueError, match="GemmTuning.num_stages must be an int >= 1"):
        GemmTuning(num_stages=0)


def test_gated_linear_rejects_what_it_cannot_compute():
    from dustin_hf.kernels.triton_gemm import MAX_ROWS, gated_linear

    x, w, _ = _operands(4, 8, 16, False, torch.float32)
    with pytest.raises(ValueError, match=r"\[gate; up\]"):
        gated_linear(x, w[:7])
    with pytest.raises(ValueError, match="does not split"):
        gated_linear(x, w, split_k=2)
    with pytest.raises(ValueError, match="at most"):
        gated_linear(torch.zeros(MAX_ROWS + 1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight must be"):
        gated_linear(x, w[:, :8])
