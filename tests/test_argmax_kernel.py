"""The greedy heads' argmax kernel against ``torch.argmax`` (interpreter on CPU, compiled on CUDA): the same index
for every input, ties (the first) and NaN (the first NaN) included, however the rows are split."""

import pytest
import torch
from conftest import TRITON_RUNS

pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _argmax(x, **kw):
    from dustin_hf.kernels.triton_argmax import argmax_triton

    return argmax_triton(x, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 10000), (1, 1), (2, 4097), (2, 3, 33)])
@pytest.mark.parametrize("splits", [None, 1, 2, 3, 7])
def test_argmax_equals_torch(dtype, shape, splits):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(DEVICE, dtype)
    got = _argmax(x, splits=splits)
    assert got.dtype == torch.int64 and got.shape == shape[:-1]
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_argmax_ties_nan_and_inf_as_torch(splits):
    """Ties inside a tile, across tiles and across splits go to the first index; a NaN beats +inf (its first
    index wins, also against a later split's NaN); a row of -inf gives 0; -0.0 ties with +0.0."""
    x = torch.zeros(7, 9000)
    x[0, [100, 5000, 8000]] = 3.0  # tied maxima in three splits
    x[1, [4500, 8999]] = 2.0
    x[2, [7000, 8000]] = float("nan")
    x[3, 10], x[3, 20], x[3, 8500] = float("inf"), float("nan"), float("nan")
    x[4] = float("-inf")
    x[5, 17], x[5, 18] = 1.0, 1.0  # tied neighbours in one tile
    x[6], x[6, 30], x[6, 6000] = -1.0, -0.0, 0.0
    x = x.to(DEVICE)
    want = x.argmax(dim=-1)
    assert want.tolist() == [100, 4500, 7000, 20, 0, 17, 30]  # what torch does, which the kernel must follow
    assert torch.equal(_argmax(x, splits=splits), want)


def test_argmax_reads_strided_rows_and_is_replayable():
    """A view with a row stride (the last positions of a head's output) and a second launch of the same shape
    (the tickets were reset by the first) give the same result."""
    full = torch.randn(4, 3, 5000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = full[:, 1:]
    first, second = _argmax(x, splits=3), _argmax(x, splits=3)
    assert torch.equal(first, x.argmax(dim=-1)) and torch.equal(second, first)


def test_argmax_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        _argmax(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="non-empty"):
        _argmax(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="non-empty"):
        _argmax(torch.tensor(1.0, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [8, 16, 40, 80])
def test_argmax_of_a_vocabulary_in_a_cuda_graph(rows):
    """A 152k head in bf16 (ties are common there) captured in a graph and replayed on new logits."""
    x = torch.randn(rows, 152064, device="cuda").to(torch.bfloat16)
    out = _argmax(x)  # warm-up: compile, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _argmax(x)
    for seed in range(3):
        x.copy_(torch.randn(rows, 152064, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, x.argmax(dim=-1))
