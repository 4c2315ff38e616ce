"""Per-forward metadata, built once by the decoding loop and shared by every layer.

A :class:`ForwardPlan` says which cache rows a forward covers, how many positions each row had
cached before it, how many new tokens each row brings, and (for sparse verification) which cached
positions each row attends to. It also names the layers whose query vectors must be kept for
scoring, and receives them. Layers only read it; device copies are made once per device (a model
split across GPUs by accelerate reads the copy on its own device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..kernels.tuning import KernelTuning

__all__ = ["DeviceTensors", "ForwardPlan", "SelectLayers", "device_tensor", "select_heads"]


@dataclass(frozen=True)
class DeviceTensors:
    """The plan's tensors on one device."""

    cache_seqlens: torch.Tensor  # (B',) int32: cached positions before this forward
    indices: torch.Tensor | None  # (B', W) int32: selected cached positions (sparse), else None
    num_indices: torch.Tensor | None  # (B',) int32
    query_counts: torch.Tensor | None = None  # (B',) int32: each row's own leading queries (selection layers)

    def to(self, device: torch.device) -> "DeviceTensors":
        return DeviceTensors(
            *(
                None if t is None else t.to(device, non_blocking=True)
                for t in (self.cache_seqlens, self.indices, self.num_indices, self.query_counts)
            )
        )

    def write_positions(self, q_len: int) -> torch.Tensor:
        """``(B', Q)`` int64 cache slots of the new tokens: ``cache_seqlens[b] + arange(Q)``."""
        return self.cache_seqlens.long()[:, None] + torch.arange(q_len, device=self.cache_seqlens.device)


@dataclass(frozen=True)
class SelectLayers:
    """Selection layers of a sparse forward (:mod:`dustin_hf.selection.layers`): each reads every cached position and
    chooses, per row, the read set of the layers after it (up to the next one).

    ``layers``: the selection layers, non-negative; ``sink_tokens`` / ``recent_tokens``: kept in every chosen set;
    ``queries``: the leading queries of each row that score positions (``None``: all of the forward's).
    """

    layers: tuple[int, ...]
    sink_tokens: int
    recent_tokens: int
    queries: int | None = None


@dataclass
class ForwardPlan:
    """What one forward of a model over a :class:`~dustin_hf.decode.cache.DustinCache` does.

    Args:
        rows: the cache rows this forward covers (its batch is ``rows.stop - rows.start``).
        cache_seqlens: cached positions per covered row before the forward (host ints).
        q_len: new tokens per row; they go to slots ``cache_seqlens[b] + arange(q_len)``.
        backend: concrete attention backend name (see :func:`dustin_hf.kernels.resolve_backend`).
        indices, num_indices: the sparse read set, ``(B', W)`` int32 and ``(B',)`` int32, on any
            device; ``None`` for dense attention.
        capture: ``{layer_idx: heads}``: keep these query heads of these layers for scoring.
        capture_last: keep only the last query of each row (drafting and prefill) instead of all.
        static: device tensors to use as they are, one set per device the model spans (CUDA graphs:
            persistent buffers refilled before each replay) instead of building them from
            ``cache_seqlens`` / ``indices``.
        key_bound: an upper bound on every row's keys for grid sizing (CUDA graphs: the cache capacity);
            default ``max(cache_seqlens) + q_len``.
        dense_layers: layers that ignore ``indices`` and read every cached position.
        positions: ``(B', > every slot)`` int64, on any device: the position id of each slot of the covered rows
            (a row whose last input slot was masked, or the caller's ``position_ids``:
            :func:`dustin_hf.decode.masks.position_table`); ``None``: position ids are the slots.
        hide_new: the new tokens attend to the cached positions only, not to each other or themselves (the
            query of a masked last input slot, which stock transformers never lets see itself).
        window_slots: ``(B', > every slot)`` int64, on any device: the index each slot of the covered rows has in
            stock's cache, which a sliding window counts (rows with masked input slots,
            :func:`dustin_hf.decode.masks.stock_slots`); ``None``: the slots themselves. Windowed layers then take the
            general masked path.
        read_budget: positions a sparse forward reads per row (the selection's width); a sliding-window layer
            whose window fits in it reads its whole window instead of the selection within it.
        full_rows: a row whose count covers all it holds reads everything, its index row not listing it
            (:attr:`~dustin_hf.selection.fill.Selection.full_rows`; the kernels' ``full_rows``).
        attention_weights: the attention function returns its probabilities (``output_attentions``; a slower path).
        tuning: the kernels' launch heuristics (``None``: the defaults).
        select: on a sparse forward, layers that read everything and choose the read set of the layers after them
            (:class:`SelectLayers`); ``None``: every sparse layer reads ``indices``.
        query_counts: per covered row, its own leading queries (host ints): a row that drafted fewer tokens than
            the longest one scores with its own queries only, never with the tokens after them. ``None``: all.
        read_hook: ``(layer_idx, tensors) -> tensors``: what each layer reads instead of what the plan gives it (an
            experiment's per-layer read sets, :mod:`dustin_hf.experimental`; the cache slots must stay); ``None``:
            the plan's.
        selection_hook: ``(layer_idx, tensors)``: told what each selection layer chose (an experiment's record of
            it, :mod:`dustin_hf.experimental`); ``None``: nobody is.
    """

    rows: slice
    cache_seqlens: list[int]
    q_len: int
    backend: str = "reference"
    indices: torch.Tensor | None = None
    num_indices: torch.Tensor | None = None
    capture: dict[int, tuple[int, ...]] = field(default_factory=dict)
    capture_last: bool = False
    static: tuple[DeviceTensors, ...] = ()
    key_bound: int | None = None
    dense_layers: tuple[int, ...] = ()
    positions: torch.Tensor | None = None
    hide_new: bool = False
    window_slots: torch.Tensor | None = None
    read_budget: int = 0
    full_rows: bool = False
    attention_weights: bool = False
    tuning: KernelTuning | None = None
    select: SelectLayers | None = None
    query_counts: list[int] | None = None
    read_hook: Callable[[int, DeviceTensors], DeviceTensors] | None = None
    selection_hook: Callable[[int, DeviceTensors], None] | None = None
    captured: dict[int, torch.Tensor] = field(default_factory=dict, init=False)
    # the read set a selection layer chose in this forward, per device; later layers read it instead of indices
    _selected: dict[torch.device, DeviceTensors] = field(default_factory=dict, init=False, repr=False)
    _on_device: dict[torch.device, DeviceTensors] = field(default_factory=dict, init=False, repr=False)
    _slots: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _positions: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _window_slots: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    # the layer the attention function is on (it keeps a layer's queries first), for the hooks
    _layer: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if len(self.cache_seqlens) != self.rows.stop - self.rows.start:
            raise ValueError(f"{len(self.cache_seqlens)} cache_seqlens for rows {self.rows}")
        if (self.indices is None) != (self.num_indices is None):
            raise ValueError("indices and num_indices go together")
        for tensors in self.static:
            self._on_device[tensors.cache_seqlens.device] = tensors

    @property
    def batch_size(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def is_sparse(self) -> bool:
        return self.indices is not None or any(t.indices is not None for t in self.static)

    @property
    def uniform_start(self) -> int | None:
        """The cached positions every covered row holds, when they all hold as many (host ints; a captured plan's
        rows vary, so ``None``)."""
        if self.static or len(set(self.cache_seqlens)) != 1:
            return None
        return self.cache_seqlens[0]

    @property
    def max_seqlen_k(self) -> int:
        """Longest key range of any row, new tokens included (host int: no device sync)."""
        return self.key_bound if self.key_bound is not None else max(self.cache_seqlens) + self.q_len

    @property
    def key_span(self) -> int:
        """Cached positions a selection layer scores per row: the longest row's (host ints), or every slot a
        captured forward's rows may hold."""
        return max(self.cache_seqlens) if not self.static else self.max_seqlen_k - self.q_len

    def selects_at(self, layer_idx: int) -> bool:
        """Whether ``layer_idx`` is a selection layer of this (sparse) forward."""
        return self.select is not None and layer_idx in self.select.layers and self.is_sparse

    def begin(self) -> None:
        """A forward starts: the layers before its first selection layer read ``indices`` again."""
        self._selected.clear()

    def keep_selection(self, tensors: DeviceTensors) -> None:
        """What a selection layer chose: the layers after it read ``tensors`` (on any device) until the next one."""
        self._selected.clear()
        self._selected[tensors.cache_seqlens.device] = tensors
        if self.selection_hook is not None:
            self.selection_hook(self._layer, tensors)

    def on(self, device: torch.device) -> DeviceTensors:
        """The plan's tensors on ``device``, built on first use and reused by every later layer (after a selection
        layer: the set it chose; with a :attr:`read_hook`: what it gives the current layer)."""
        tensors = self._tensors_on(device)
        return tensors if self.read_hook is None else self.read_hook(self._layer, tensors)

    def _tensors_on(self, device: torch.device) -> DeviceTensors:
        if self._selected:
            tensors = self._selected.get(device)
            if tensors is None:
                tensors = self._selected[device] = next(iter(self._selected.values())).to(device)
            return tensors
        tensors = self._on_device.get(device)
        if tensors is None:
            if self._on_device:  # copy from a device we already have, rather than from the host again
                tensors = next(iter(self._on_device.values())).to(device)
            else:
                seqlens = device_tensor(self.cache_seqlens, device, torch.int32)
                indices = None if self.indices is None else self.indices.to(device, torch.int32, non_blocking=True)
                num = None if self.num_indices is None else self.num_indices.to(device, torch.int32, non_blocking=True)
                counts = None if self.query_counts is None else device_tensor(self.query_counts, device, torch.int32)
                tensors = DeviceTensors(seqlens, indices, num, counts)
            self._on_device[device] = tensors
        return tensors

    def write_positions(self, device: torch.device) -> torch.Tensor:
        """``(B', Q)`` int64 cache slots of the new tokens on ``device`` (computed once per device)."""
        slots = self._slots.get(device)
        if slots is None:
            slots = self._slots[device] = self.on(device).write_positions(self.q_len)
        return slots

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """``(B', Q)`` int64 position ids of the new tokens: their slots, or what :attr:`positions` gives them."""
        if self.positions is None:
            return self.write_positions(device)
        positions = self._positions.get(device)
        if positions is None:
            table = self.positions.to(device, non_blocking=True)
            positions = self._positions[device] = table.gather(1, self.write_positions(device))
        return positions

    def window_slots_on(self, device: torch.device) -> torch.Tensor | None:
        """:attr:`window_slots` on ``device`` (copied once per device), or ``None``."""
        if self.window_slots is None:
            return None
        slots = self._window_slots.get(device)
        if slots is None:
            slots = self._window_slots[device] = self.window_slots.to(device, non_blocking=True)
        return slots

    def keep_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        """Store the scoring heads' queries of ``layer_idx`` if it is a capture layer.

        ``query``: ``(B', Q, nheads, headdim)``; stored as ``(B', Qc, len(heads), headdim)`` with
        ``Qc`` = 1 (``capture_last``) or ``Q``.
        """
        self._layer = layer_idx
        heads = self.capture.get(layer_idx)
        if heads is None:
            return
        kept = query[:, -1:] if self.capture_last else query
        self.captured[layer_idx] = select_heads(kept, heads).clone()


def select_heads(tensor: torch.Tensor, heads: tuple[int, ...], dim: int = 2) -> torch.Tensor:
    """``tensor`` restricted to ``heads`` along ``dim``: a view when the heads are evenly spaced.

    Other heads are stacked from views rather than gathered by an index tensor: that tensor would be
    copied from the host, which a CUDA graph capture (the decode loop keeps queries inside its graphs)
    does not permit.
    """
    heads = tuple(heads)
    step = heads[1] - heads[0] if len(heads) > 1 else 1
    if step > 0 and heads == tuple(range(heads[0], heads[-1] + 1, step)):
        index = [slice(None)] * tensor.dim()
        index[dim] = slice(heads[0], heads[-1] + 1, step)
        return tensor[tuple(index)]
    return torch.stack([tensor.select(dim, h) for h in heads], dim=dim)


class HostCopy:
    """``t.tolist()``, waiting only for ``t``: the copy to pinned host memory is queued at construction and
    :meth:`tolist` waits on an event recorded right after it, not on the stream.

    ``t.tolist()`` on a CUDA tensor synchronises the stream, so the host also waits for everything queued
    after ``t`` was computed (in the decode loop: the next step's draft forwards, queued so that the GPU has
    work while the host does its bookkeeping), and the GPU then idles until the host queues more.
    """

    def __init__(self, t: torch.Tensor):
        self._event = None
        if not t.is_cuda:
            self._host = t
            return
        with torch.cuda.device(t.device):
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def device_tensor(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without making the host wait for the device.

    ``torch.tensor(values, device=...)`` copies and then synchronises the stream (every copy that is not
    ``non_blocking`` does): in the decode loop the host would wait there for the work it has queued (a
    whole draft forward) before it could queue more, and the GPU would idle while it does. From pageable
    memory a ``non_blocking`` copy is staged by the driver before the call returns, so the host values
    may go at once.
    """
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
