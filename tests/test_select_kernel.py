"""The Triton selection kernel against ``select_positions``' PyTorch path and an explicit loop.

The loop below ranks candidates by (score descending, position ascending), the kernel's documented
tie rule, and shares no code with either path. Without ties at a threshold the kernel's chosen set
must equal the PyTorch path's; with ties it must equal the loop's, which is a valid top-k (the same
multiset of scores as ``torch.topk``). Small explicit chunks force several launch-1 programs per row,
which the heuristic would not pick at these sizes.

Triton runs on CUDA when there is one, otherwise in the Triton interpreter on CPU
(``TRITON_INTERPRET=1``, set by tiny_models (conftest imports it first) before triton is imported) with small shapes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_RUNS, capture_graph
from tiny_models import tiny_model

from dustin_hf.config import DustinConfig, resolve
from dustin_hf.selection.fill import select_positions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(not TRITON_RUNS, reason="needs triton: CUDA, or on CPU TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _config(**kwargs):
    model = tiny_model("qwen2", layers=2)
    return resolve(DustinConfig(min_context=0, **kwargs), model.config, model.config)


def _scores(seqlens, generator, draw=torch.rand):
    """``(B, max(seqlens))`` scores from ``draw``, zero past each row's end (as scoring returns them)."""
    scores = draw(len(seqlens), max(seqlens), generator=generator)
    for b, n in enumerate(seqlens):
        scores[b, n:] = 0
    return scores.to(DEVICE)


def _explicit(seqlens, draft, history, cfg) -> list[list[int]]:
    """Per row, the sorted read set with ties to the lowest positions: a Python loop over the candidates."""
    fill = cfg.budget - cfg.sink_tokens - cfg.recent_tokens - cfg.draft_share
    rows = []
    for b, n in enumerate(seqlens):
        d, h = draft[b].tolist(), history[b].tolist()
        candidates = range(cfg.sink_tokens, n - cfg.recent_tokens)
        by_draft = sorted(candidates, key=lambda p: (-d[p], p))[: cfg.draft_share]
        rest = sorted(set(candidates) - set(by_draft), key=lambda p: (-h[p], p))[:fill]
        rows.append(sorted([*range(cfg.sink_tokens), *by_draft, *rest, *range(n - cfg.recent_tokens, n)]))
    return rows


def _kernel_rows(seqlens, draft, history, cfg, chunk=None) -> list[list[int]]:
    """The kernel called directly (every row sparse); ``chunk`` overrides the heuristic's chunk size."""
    from dustin_hf.kernels import triton_select

    fill = cfg.budget - cfg.sink_tokens - cfg.recent_tokens - cfg.draft_share
    config = triton_select.launch_config(draft.shape[1], cfg.draft_share, fill, chunk=chunk)
    out = triton_select.select_sparse_triton(
        draft,
        history,
        torch.tensor(seqlens, device=DEVICE),
        sink=cfg.sink_tokens,
        recent=cfg.recent_tokens,
        share=cfg.draft_share,
        fill=fill,
        config=config,
    )
    assert out.dtype == torch.int32 and out.shape == (len(seqlens), cfg.budget)
    return out.tolist()


def _rows(selection) -> list[list[int]]:
    return [selection.indices[b, :n].tolist() for b, n in enumerate(selection.counts)]


def _reference_rows(seqlens, draft, target, cfg, has_history=None) -> list[list[int]]:
    has_history = has_history or [True] * len(seqlens)
    return _rows(select_positions(seqlens, draft, target, has_history, cfg, backend="reference"))


@pytest.mark.parametrize(
    "seqlens, budget, share, chunk",
    [
        ([700, 531, 650], 64, None, 128),  # several chunks per row, rows of different lengths
        ([1999, 1201], 256, 40, 256),  # odd lengths, uneven split (more fill than share)
        ([333], 96, 70, None),  # the heuristic's chunk: one per row
        ([900, 1500, 1023, 1024], 128, 100, 64),  # a chunk narrower than the history pick: kept whole
    ],
)
def test_same_set_as_pytorch_without_ties(seqlens, budget, share, chunk):
    generator = torch.Generator().manual_seed(sum(seqlens))
    cfg = _config(budget=budget, sink_tokens=4, recent_tokens=16, draft_share=share)
    draft, target = _scores(seqlens, generator), _scores(seqlens, generator)
    got = _kernel_rows(seqlens, draft, target, cfg, chunk)
    assert got == _reference_rows(seqlens, draft, target, cfg)  # both sorted: equal lists are equal sets
    assert got == _explicit(seqlens, draft.cpu(), target.cpu(), cfg)


@pytest.mark.parametrize("chunk", [128, None])
def test_ties_go_to_the_lowest_positions(chunk):
    """Integer scores tie everywhere: the kernel takes the lowest tied positions, a valid top-k."""
    seqlens = [600, 457]
    generator = torch.Generator().manual_seed(1)
    integers = lambda *shape, generator: torch.randint(0, 6, shape, generator=generator).float()  # noqa: E731
    draft, target = _scores(seqlens, generator, integers), _scores(seqlens, generator, integers)
    cfg = _config(budget=80, sink_tokens=4, recent_tokens=8, draft_share=30)
    got = _kernel_rows(seqlens, draft, target, cfg, chunk)
    assert got == _explicit(seqlens, draft.cpu(), target.cpu(), cfg)
    fill = cfg.budget - cfg.sink_tokens - cfg.recent_tokens - cfg.draft_share
    for b, n in enumerate(seqlens):  # each pick holds torch.topk's multiset of scores
        free = torch.arange(cfg.sink_tokens, n - cfg.recent_tokens)
        chosen = torch.tensor([p for p in got[b] if cfg.sink_tokens <= p < n - cfg.recent_tokens])
        by_draft = chosen[draft[b, chosen].cpu().sort(descending=True, stable=True).indices[: cfg.draft_share]]
        assert torch.equal(draft[b, by_draft].sort().values, draft[b, free].topk(cfg.draft_share).values.sort().values)
        rest = free[~torch.isin(free, by_draft)]
        by_history = chosen[~torch.isin(chosen, by_draft)]
        assert torch.equal(target[b, by_history].sort().values, target[b, rest].topk(fill).values.sort().values)


def test_rows_without_history_and_dense_rows():
    """Through ``select_positions``: rows without a history fill by the draft scores; short rows stay dense."""
    seqlens = [700, 40, 650, 520]
    generator = torch.Generator().manual_seed(2)
    draft, target = _scores(seqlens, generator), _scores(seqlens, generator)
    cfg = _config(budget=64, sink_tokens=4, recent_tokens=16, draft_share=20)
    has_history = [True, True, False, False]
    got = select_positions(seqlens, draft, target, has_history, cfg, backend="triton")
    want = select_positions(seqlens, draft, target, has_history, cfg, backend="reference")
    assert got.counts == want.counts == [64, 40, 64, 64]
    assert torch.equal(got.num_indices, want.num_indices) and got.indices.shape == want.indices.shape
    assert _rows(got) == _rows(want)
    assert _rows(got)[1] == list(range(40))
    assert _rows(got)[2:] == _explicit(seqlens[2:], draft[2:].cpu(), draft[2:].cpu(), cfg)


@pytest.mark.parametrize("share", [0, 44])  # all fill by history; all by the draft (fill = 0)
def test_one_sided_budget_splits(share):
    seqlens = [500, 301]
    generator = torch.Generator().manual_seed(3)
    draft, target = _scores(seqlens, generator), _scores(seqlens, generator)
    cfg = _config(budget=64, sink_tokens=4, recent_tokens=16, draft_share=share)
    assert _kernel_rows(seqlens, draft, target, cfg, chunk=128) == _reference_rows(seqlens, draft, target, cfg)


@pytest.mark.parametrize("share", [0, 20])
def test_per_row_counts_stop_the_history_fill(share):
    """``counts``: row b takes ``counts[b] - sink - recent - share`` positions by the history score (the draft's
    share and the windows whole), sorted, and 0 in its slots past ``counts[b]``; a row at the full budget takes
    what it takes without counts."""
    from dustin_hf.kernels import triton_select

    seqlens, counts = [700, 531, 650], [64, 45, 42]
    generator = torch.Generator().manual_seed(8)
    draft, target = _scores(seqlens, generator), _scores(seqlens, generator)
    fill = 64 - 4 - 16 - share
    out = triton_select.select_sparse_triton(
        draft,
        target,
        torch.tensor(seqlens, device=DEVICE),
        sink=4,
        recent=16,
        share=share,
        fill=fill,
        counts=torch.tensor(counts, device=DEVICE),
        config=triton_select.launch_config(700, share, fill, chunk=128),
    )
    assert out.shape == (3, 64)
    for b, count in enumerate(counts):
        cfg = _config(budget=count, sink_tokens=4, recent_tokens=16, draft_share=share)
        assert (
            out[b, :count].tolist()
            == _explicit(seqlens[b : b + 1], draft[b : b + 1].cpu(), target[b : b + 1].cpu(), cfg)[0]
        ), f"row {b}"
        assert (out[b, count:] == 0).all(), f"row {b}"


def test_signed_and_low_precision_scores():
    """Negative scores (both picks end among them), -0.0 against +0.0 (one score), and fp16 inputs keep the
    float order."""
    seqlens = [400, 390]
    generator = torch.Generator().manual_seed(4)
    signed = lambda *shape, generator: torch.randn(shape, generator=generator) - 1.5  # noqa: E731
    draft, target = _scores(seqlens, generator, signed), _scores(seqlens, generator, signed)
    draft[0, 100:130] = -0.0
    draft[0, 130:160] = 0.0
    cfg = _config(budget=96, sink_tokens=2, recent_tokens=6, draft_share=60)
    for d, t in ((draft, target), (draft.half(), target.half())):
        assert _kernel_rows(seqlens, d, t, cfg, chunk=128) == _explicit(seqlens, d.float().cpu(), t.float().cpu(), cfg)


def test_backend_choice():
    from dustin_hf.kernels import triton_select

    seqlens = [300]
    scores = _scores(seqlens, torch.Generator().manual_seed(5))
    cfg = _config(budget=32, sink_tokens=4, recent_tokens=4)
    with pytest.raises(ValueError, match="unknown selection backend"):
        select_positions(seqlens, scores, scores, [True], cfg, backend="cuda")
    assert triton_select.supports(32768, 246, 246) and not triton_select.supports(2**22, 246, 246)
    wide = torch.zeros(1, 2**22, device=DEVICE)
    with pytest.raises(ValueError, match="backend='reference'"):
        triton_select.select_sparse_triton(
            wide, wide, torch.tensor([2**22], device=DEVICE), sink=4, recent=16, share=246, fill=246
        )


@pytest.mark.gpu
@needs_cuda
def test_qwen_sizes_on_cuda():
    """B = 16, 32k positions, budget 512: ``"auto"`` takes the kernel on CUDA, and it agrees with PyTorch."""
    seqlens = [32768 - 97 * b for b in range(16)]
    generator = torch.Generator().manual_seed(6)
    draft, target = _scores(seqlens, generator), _scores(seqlens, generator)
    cfg = _config(budget=512, sink_tokens=4, recent_tokens=16)
    got = select_positions(seqlens, draft, target, [True] * 16, cfg)
    assert _rows(got) == _reference_rows(seqlens, draft, target, cfg)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay():
    """Captured once, replayed on new scores and lengths: the selection follows the inputs."""
    from dustin_hf.kernels.triton_select import select_sparse_triton

    seqlens = [3000, 2500, 2900]
    generator = torch.Generator().manual_seed(7)
    draft, target = _scores(seqlens, generator), _scores(seqlens, generator)
    lengths = torch.tensor(seqlens, device=DEVICE)
    cfg = _config(budget=128, sink_tokens=4, recent_tokens=16)
    fill = cfg.budget - cfg.sink_tokens - cfg.recent_tokens - cfg.draft_share
    graph, out = capture_graph(
        lambda: select_sparse_triton(draft, target, lengths, sink=4, recent=16, share=cfg.draft_share, fill=fill)
    )
    seqlens = [2999, 2100, 3000]
    draft.copy_(_scores(seqlens, generator))
    target.copy_(_scores(seqlens, generator))
    lengths.copy_(torch.tensor(seqlens))
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == _reference_rows(seqlens, draft, target, cfg)
