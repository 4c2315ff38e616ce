"""Budget fill: which cached positions each sequence's verification reads this step.

Per row, one index set shared by all layers and heads (DESIGN.md section 2):

1. sinks: the first ``sink_tokens`` positions, and the ``recent_tokens`` most recent ones;
2. the top ``draft_share`` positions by the draft's lookahead attention ``S_draft``;
3. the rest of the budget by the target's attention history ``S_target``, among positions not yet
   chosen (rows without a history, e.g. after a rollback past it, fill by ``S_draft`` instead).

A row is read densely (all of ``[0, L)``) when its context fits the budget or is shorter than
``min_context``. Indices come out sorted (sequential reads), as ``(B, W)`` int32 with a per-row
count; ``W`` is the budget, or longer when a dense row is listed (the decode loop's selections name such a row
by its count instead: :attr:`Selection.full_rows`).

``backend="reference"`` is the PyTorch code below (the oracle, and the path on CPU);
``backend="triton"`` runs :mod:`dustin_hf.kernels.triton_select` (two launches instead of about ten,
no host sync); ``"auto"`` takes Triton for scores on CUDA. The two agree except where scores tie at
a threshold: Triton takes the lowest tied positions, ``torch.topk`` any of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import ResolvedConfig
from ..kernels import available_backends
from ..kernels.tuning import SelectTuning
from ..runtime.plan import device_tensor

__all__ = [
    "Selection",
    "dense_rows",
    "per_row",
    "select_positions",
    "truncated",
    "with_dense_rows",
]


@dataclass(frozen=True)
class Selection:
    indices: torch.Tensor  # (B, W) int32, sorted valid entries first
    num_indices: torch.Tensor  # (B,) int32
    counts: list[int]  # num_indices on the host
    recovery: list[float] | None = None  # the quality knob: each row's estimated recovery (1.0: read in full)
    fallback: list[bool] | None = None  # the quality knob: rows read in full because the ceiling fell short
    # some row reads everything it holds through its count alone (count >= its cached length), its index row not
    # listing it: the attention kernels' ``full_rows`` (one fixed width, so a CUDA graph, whatever the mix of rows)
    full_rows: bool = False


def dense_rows(seqlens: list[int], config: ResolvedConfig) -> list[bool]:
    """Rows that verification reads in full: context within the budget or below ``min_context``."""
    return [length <= config.budget or length < config.min_context for length in seqlens]


def select_positions(
    seqlens: list[int],
    draft_scores: torch.Tensor,
    target_scores: torch.Tensor | None,
    has_history: list[bool],
    config: ResolvedConfig,
    lengths: torch.Tensor | None = None,
    backend: str = "auto",
    window: int | list[int] | None = None,
    tuning: SelectTuning | None = None,
    full_rows: bool = False,
) -> Selection:
    """Choose each row's read set: ``budget`` positions, or everything for a row :func:`dense_rows` reads in
    full, which lists ``0 .. L_b - 1`` (``W`` widened to the longest), or with ``full_rows`` beside sparse rows is
    named by its count alone (:attr:`Selection.full_rows`: ``W`` stays the budget, so the decode loop's forwards
    keep their CUDA graphs).

    Args:
        seqlens: cached positions ``L_b`` per row (host ints).
        draft_scores: ``(B, max(seqlens))`` float, ``S_draft`` (zero past each row's length).
        target_scores: ``(B, max(seqlens))`` float, ``S_target``; ``None`` if no row has a history.
        has_history: per row, whether ``target_scores`` holds a valid history for it.
        config: the resolved budget, windows and ``draft_share``.
        lengths: ``seqlens`` as a device tensor, if the caller has one (saves a host->device copy).
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (CUDA, or the Triton interpreter on CPU).
        window: a sliding window every layer has: the step's first query (at position ``L``) sees cached positions
            ``[L - window + 1, L)`` only, and the read set is chosen there, sinks and recent ones included (a
            window the budget covers is read whole); one per row where rows differ (masked input slots take
            places in stock's windows, :func:`dustin_hf.selection.request.row_windows`). ``None``: the whole
            context.
        tuning: the Triton selection's launch heuristic (``None``: the default).
        full_rows: name rows read in full by their counts (outside sliding windows, as above).
    """
    windows = per_row(window, len(seqlens))
    if windows is not None and any(n - w + 1 > 0 for n, w in zip(seqlens, windows)):
        return _select_in_window(seqlens, draft_scores, target_scores, has_history, config, backend, windows, tuning)
    device = draft_scores.device
    batch = draft_scores.shape[0]
    dense = dense_rows(seqlens, config)
    counts = [n if d else config.budget for n, d in zip(seqlens, dense)]
    width = max(counts)
    if all(dense):
        indices = torch.arange(width, device=device, dtype=torch.int32).expand(batch, width).contiguous()
        return Selection(indices, device_tensor(counts, device, torch.int32), counts)
    lengths = device_tensor(seqlens, device) if lengths is None else lengths.to(device)
    indices = _sparse_fill(draft_scores, target_scores, has_history, config, lengths, backend, tuning)  # (B, budget)
    if any(dense) and full_rows:  # named by their counts, their index rows never read
        return Selection(indices, device_tensor(counts, device, torch.int32), counts, full_rows=True)
    if any(dense):  # rows read in full: positions 0..L-1 (valid entries first, as counts say)
        if width > indices.shape[1]:
            indices = torch.nn.functional.pad(indices, (0, width - indices.shape[1]))
        dense_idx = torch.arange(width, device=device, dtype=torch.int32).expand(batch, width)
        indices = torch.where(device_tensor(dense, device)[:, None], dense_idx, indices)
        num_indices = device_tensor(counts, device, torch.int32)
    else:
        num_indices = torch.full((batch,), config.budget, dtype=torch.int32, device=device)
    return Selection(indices=indices, num_indices=num_indices, counts=counts)


def _sparse_fill(draft_scores, target_scores, has_history, config, lengths, backend, tuning) -> torch.Tensor:
    """Every row's sparse read set, ``(B, budget)`` int32 sorted: the Triton fill or the PyTorch one."""
    sink, recent, share = config.sink_tokens, config.recent_tokens, config.draft_share
    fill = config.budget - sink - recent - share
    history = _history_scores(draft_scores, target_scores, has_history)
    if _resolve_backend(backend, draft_scores, share, fill, tuning) != "triton":
        return _select_sparse_reference(draft_scores, history, lengths, sink, recent, share, fill)
    from ..kernels import launch_device
    from ..kernels.triton_select import select_sparse_triton

    with launch_device(draft_scores):
        return select_sparse_triton(
            draft_scores.contiguous(),
            history.contiguous(),
            lengths,
            sink=sink,
            recent=recent,
            share=share,
            fill=fill,
            tuning=tuning,
        )


def per_row(window: int | list[int] | None, batch: int) -> list[int] | None:
    return None if window is None else [window] * batch if isinstance(window, int) else list(window)


def _select_in_window(
    seqlens, draft_scores, target_scores, has_history, config, backend, windows, tuning
) -> Selection:
    """:func:`select_positions` over each row's window ``[lo, L)``: the scores shifted by ``lo``, the selection
    made as for a context of ``L - lo`` positions (a row below ``min_context`` reads its whole window), and
    shifted back."""
    lows = [max(0, n - w + 1) for n, w in zip(seqlens, windows)]
    spans = [n - lo for n, lo in zip(seqlens, lows)]
    device = draft_scores.device
    low = device_tensor(lows, device)[:, None]
    columns = torch.arange(max(spans), device=device)[None, :]
    inside = columns < device_tensor(spans, device)[:, None]
    take = (low + columns).clamp_max(draft_scores.shape[1] - 1)

    def shifted(scores):
        return None if scores is None else scores.gather(1, take) * inside

    whole = dataclasses.replace(config, min_context=0)
    chosen = select_positions(
        spans, shifted(draft_scores), shifted(target_scores), has_history, whole, backend=backend, tuning=tuning
    )
    counts = [span if n < config.min_context else c for n, span, c in zip(seqlens, spans, chosen.counts)]
    indices = chosen.indices
    if counts != chosen.counts:  # rows below min_context: their whole window
        width = max(indices.shape[1], max(spans))
        indices = torch.nn.functional.pad(indices, (0, width - indices.shape[1]))
        everything = torch.arange(width, device=device, dtype=indices.dtype).expand_as(indices)
        short = device_tensor([n < config.min_context for n in seqlens], device)[:, None]
        indices = torch.where(short, everything, indices)
    return Selection(
        (indices + low.to(indices.dtype)).contiguous(), device_tensor(counts, device, torch.int32), counts
    )


def _history_scores(
    draft_scores: torch.Tensor, target_scores: torch.Tensor | None, has_history: list[bool]
) -> torch.Tensor:
    """The fill's scores per row: ``S_target`` where the row has a history, else ``S_draft``."""
    if target_scores is None:
        return draft_scores
    if all(has_history):
        return target_scores
    use_target = device_tensor(has_history, draft_scores.device)[:, None]
    return torch.where(use_target, target_scores, draft_scores)


def _resolve_backend(
    backend: str, draft_scores: torch.Tensor, share: int, fill: int, tuning: SelectTuning | None = None
) -> str:
    """``"auto"``: Triton for scores on CUDA (when triton is installed and its pools hold the span)."""
    if backend not in ("auto", "reference", "triton"):
        raise ValueError(f"unknown selection backend {backend!r}; choose 'auto', 'reference' or 'triton'")
    if backend == "auto":
        if "triton" not in available_backends(draft_scores.device):
            return "reference"
        from ..kernels.triton_select import supports

        return "triton" if supports(draft_scores.shape[1], share, fill, tuning) else "reference"
    return backend


def _select_sparse_reference(draft_scores, history, lengths, sink, recent, share, fill) -> torch.Tensor:
    """The PyTorch budget fill for every row: ``(B, budget)`` int32, sorted (see the module docstring)."""
    device = draft_scores.device
    batch, span = draft_scores.shape
    lengths = lengths[:, None]  # (B, 1)
    positions = torch.arange(span, device=device)
    # candidates for the two top-k fills: in range, not a sink, not in the recent window
    taken = (positions < sink) | (positions >= lengths - recent) | (positions >= lengths)  # (B, span)
    neg_inf = torch.finfo(torch.float32).min
    parts = [positions[:sink].expand(batch, sink), lengths - recent + positions[:recent]]  # (B, s), (B, r)
    by_draft = draft_scores.float().masked_fill(taken, neg_inf)
    top_draft = by_draft.topk(share, dim=1, sorted=False).indices  # (B, m)
    parts.append(top_draft)
    if fill:
        by_history = history.float().masked_fill(taken, neg_inf).scatter_(1, top_draft, neg_inf)
        parts.append(by_history.topk(fill, dim=1, sorted=False).indices)  # (B, budget - s - r - m)
    return torch.cat(parts, dim=1).sort(dim=1).values.to(torch.int32)  # (B, budget)


def truncated(selection: Selection, limits: list[int], seqlens: list[int], recent: int) -> Selection:
    """``selection`` (made for rows of ``seqlens`` positions) with each row's entries at positions ``>= limits[b]``
    dropped (indices are sorted, so what is kept is a prefix): the read set a row still has after its positions
    from ``limits[b]`` on are rewritten.

    The counts follow on the host where every cut falls inside its row's ``recent`` window (``limits[b] >=
    seqlens[b] - recent``: those positions are always selected, so exactly the ``seqlens[b] - limits[b]`` entries
    above the cut go; a sliding window shorter than that is selected whole) or the row reads in full; otherwise
    they are read back from the device, a sync."""
    device = selection.indices.device
    counts = []
    for count, n, limit in zip(selection.counts, seqlens, limits):
        if count >= n:  # read in full: 0 .. n-1
            counts.append(min(limit, n))
        elif limit >= n - min(recent, count):  # a window shorter than recent_tokens is selected whole
            counts.append(count - max(n - limit, 0))
        else:
            break
    if len(counts) == len(limits):
        return Selection(
            selection.indices, device_tensor(counts, device, torch.int32), counts, full_rows=selection.full_rows
        )
    column = torch.arange(selection.indices.shape[1], device=device)[None, :]
    keep = (column < selection.num_indices[:, None].to(device)) & (
        selection.indices < device_tensor(limits, device)[:, None]
    )
    counts_t = keep.sum(dim=1).to(torch.int32)
    full = [count >= n for count, n in zip(selection.counts, seqlens)]
    if any(full):  # read in full (perhaps not listed: full_rows): 0 .. limit - 1
        whole = device_tensor([min(limit, n) for limit, n in zip(limits, seqlens)], device, torch.int32)
        counts_t = torch.where(device_tensor(full, device), whole, counts_t)
    return Selection(selection.indices, counts_t, [int(c) for c in counts_t.tolist()], full_rows=selection.full_rows)


def with_dense_rows(selection: Selection, starts: list[int], dense: list[bool]) -> Selection:
    """The read sets of a step where some rows read everything they hold (``starts[b]`` positions) and the others
    their selection: a dense row's count is ``starts[b]`` (:attr:`Selection.full_rows`), the index tensor keeps its
    width."""
    counts = [s if d else c for s, c, d in zip(starts, selection.counts, dense)]
    return Selection(
        selection.indices,
        device_tensor(counts, selection.indices.device, torch.int32),
        counts,
        full_rows=selection.full_rows or any(dense),
    )
