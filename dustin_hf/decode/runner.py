"""A model and its Dustin cache, as the decode loop drives it: one forward per plan, eager or from a CUDA graph."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ..compat import CACHE_KWARG, model_device, window_cuts
from ..kernels.tuning import KernelTuning
from ..runtime.graphs import GraphedForward
from ..runtime.pipeline import Pipeline
from ..runtime.plan import ForwardPlan, SelectLayers
from ..selection.fill import Selection
from .cache import DustinCache

__all__ = ["ModelRunner", "prefill_chunk"]


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class ModelRunner:
    """A model with its cache: one forward = one plan, and the rows advance by the plan's tokens.

    ``step`` runs the decode loop's fixed-shape forwards; with ``cuda_graphs`` they are captured once
    per shape and replayed (see :mod:`dustin_hf.runtime.graphs`). :attr:`positions` (``(B, capacity)``,
    :func:`dustin_hf.decode.masks.position_table`) gives the position id of each cache slot where they are not the
    slots; :attr:`window_slots` (``(B, capacity)``, :func:`dustin_hf.decode.masks.stock_slots`) is what the sliding
    windows count in rows with masked input slots. Such forwards run eagerly (the captured forward takes position ids
    from the slots and runs the fast kernels only).
    """

    def __init__(
        self,
        model,
        cache: DustinCache,
        backend: str,
        cuda_graphs: bool = False,
        graph_width: int = 0,
        dense_layers: tuple[int, ...] = (),
        tokens_only: bool = False,
        tuning: KernelTuning | None = None,
        select: SelectLayers | None = None,
    ):
        self.model, self.cache, self.backend, self.tuning = model, cache, backend, tuning
        self.select = select  # selection layers of the sparse steps (ForwardPlan.select)
        self.tokens_only = tokens_only  # step() returns the argmax tokens (B, keep), not the logits
        self.dense_layers = dense_layers  # read in full even on sparse steps
        self.graph_width = graph_width  # the one sparse width worth a graph (the read width: budget or knob ceiling)
        self.device = model_device(model)
        self._logits_to_keep = _accepts_logits_to_keep(model)
        self.positions: torch.Tensor | None = None
        self.window_slots: torch.Tensor | None = None
        # output_attentions / output_hidden_states: each forward keeps them in last_outputs (eager forwards only),
        # prefill per row in prompt_outputs
        self.record: tuple[bool, bool] = (False, False)
        self.last_outputs: tuple | None = None
        self.prompt_outputs: list[tuple] = []
        self._graphs: dict | None = {} if cuda_graphs else None
        if cuda_graphs:
            self.pipeline = Pipeline(model, tuning)
            # per device the model spans: one memory pool shared by all graphs, and a stream to capture on
            self.graph_pools = {
                device: (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)) for device in self.pipeline.devices
            }

    def drop_graphs(self) -> None:
        """Forget every captured graph (its memory pool goes with it); later forwards capture anew."""
        if self._graphs is not None:
            self._graphs.clear()

    def reset(self) -> None:
        """Empty the cache and forget the last run's per-run settings; the buffers and the graphs stay."""
        self.cache.clear()
        self.positions = self.window_slots = None
        self.record = (False, False)
        self.last_outputs, self.prompt_outputs = None, []

    def call(self, plan: ForwardPlan, input_ids: torch.Tensor, positions: torch.Tensor, keep: int) -> torch.Tensor:
        """The model forward itself: the last ``keep`` logits ``(B', keep, V)`` as float32."""
        extra = {"logits_to_keep": keep} if self._logits_to_keep else {}
        attentions, hidden = self.record
        if attentions or hidden:
            plan.attention_weights = attentions
            extra.update(output_attentions=attentions, output_hidden_states=hidden)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            dustin_plan=plan,
            **{CACHE_KWARG: self.cache},
            **extra,
        )
        if attentions or hidden:
            self.last_outputs = (out.hidden_states if hidden else None, out.attentions if attentions else None)
        return out.logits[:, -keep:].float()

    def forward(self, plan: ForwardPlan, input_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """Run ``input_ids (B', Q)`` at the plan's positions (eagerly) and advance the covered rows."""
        with self.cache.forward_plan(plan):
            logits = self.call(plan, input_ids.to(self.device), plan.position_ids(self.device), keep)
        self.cache.advance(plan.rows, [plan.q_len] * plan.batch_size)
        return logits

    def step(
        self,
        input_ids: torch.Tensor,
        seqlens: list[int],
        keep: int,
        capture: dict,
        capture_last: bool,
        selection=None,
        query_counts: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """Every row's next ``Q`` tokens at ``seqlens``; returns ``(logits (B, keep, V) float32, kept queries)``,
        or with :attr:`tokens_only` ``(argmax tokens (B, keep), kept queries)``. ``query_counts``: each row's own
        leading tokens of the ``Q`` (its selection layers score with those alone; ``None``: all)."""
        indices, num_indices = (None, None) if selection is None else (selection.indices, selection.num_indices)
        full_rows = selection is not None and selection.full_rows
        if selection is not None:  # a count past the width reads past the index rows (a GPU: illegal access)
            over = [
                (b, c)
                for b, (c, n) in enumerate(zip(selection.counts, seqlens))
                if c > indices.shape[1] and not (full_rows and c >= n)
            ]
            if over:
                raise RuntimeError(
                    f"read set rows (row, count) {over[:4]} count more entries than its "
                    f"{indices.shape[1]} columns and do not read in full (full_rows={full_rows}); "
                    "this is a bug in dustin_hf"
                )
        graphed = self._graphed(input_ids, indices, keep, capture, capture_last, create=True, full_rows=full_rows)
        if graphed is None:  # no graphs, or a rare width: not worth a graph
            plan = ForwardPlan(
                rows=slice(0, len(seqlens)),
                cache_seqlens=seqlens,
                q_len=input_ids.shape[1],
                backend=self.backend,
                indices=indices,
                num_indices=num_indices,
                full_rows=full_rows,
                capture=capture,
                capture_last=capture_last,
                dense_layers=self.dense_layers,
                select=self.select,
                query_counts=query_counts if self.select is not None else None,
                key_bound=self.cache.capacity,  # kernels split the keys exactly as a replayed graph does
                positions=self.positions,
                window_slots=self.window_slots,
                read_budget=self.graph_width,
                tuning=self.tuning,
            )
            logits = self.forward(plan, input_ids, keep)
            return (logits.argmax(dim=-1) if self.tokens_only else logits), plan.captured
        return graphed(input_ids, seqlens, indices, num_indices, query_counts)

    def step_ahead(
        self,
        input_ids: torch.Tensor,
        seqlens: torch.Tensor,
        keep: int,
        capture: dict,
        capture_last: bool,
        indices: torch.Tensor | None = None,
        num_indices: torch.Tensor | None = None,
        *,
        full_rows: bool,
        eager: bool = False,
    ):
        """:meth:`step` with the rows' cached lengths as a device tensor (int32), so it can be queued before
        the host knows them. Only a shape already captured runs this way; ``None`` otherwise (nothing
        queued: run :meth:`step` once the lengths are known), unless ``eager``
        (:attr:`~dustin_hf.decode.hooks.DecodeHooks.queue_eagerly`): then it runs eagerly as the graph would, the
        lengths read from the device. ``full_rows`` is :attr:`Selection.full_rows` of the read set (no default: a
        count past the width without it reads past the index rows)."""
        graphed = self._graphed(input_ids, indices, keep, capture, capture_last, create=False, full_rows=full_rows)
        if graphed is not None and graphed.replayable:
            return graphed(input_ids, seqlens, indices, num_indices)
        if not eager:
            return None
        lengths = seqlens.tolist()
        self.cache.seq_lengths = list(lengths)  # a replay reads the device's lengths; the host settles them later
        selection = (
            None if indices is None else Selection(indices, num_indices, num_indices.tolist(), full_rows=full_rows)
        )
        return self.step(input_ids, lengths, keep, capture, capture_last, selection=selection)

    def _graphed(
        self, input_ids, indices, keep: int, capture: dict, capture_last: bool, create: bool, full_rows: bool
    ) -> GraphedForward | None:
        """The graph of this forward's shape (made if ``create``), or ``None``: no graphs, or a sparse width other
        than :attr:`graph_width` (rare, not worth a graph). A sparse forward whose rows may read in full
        (``full_rows``) runs other launches: a graph of its own, whichever rows they are."""
        width = 0 if indices is None else indices.shape[1]
        if (
            self._graphs is None
            or width not in (0, self.graph_width)
            or self.positions is not None
            or self.window_slots is not None
            or any(self.record)
        ):
            return None
        key = input_ids.shape[1], width, keep, tuple(sorted(capture.items())), capture_last, full_rows and width > 0
        if key not in self._graphs and create:
            self._graphs[key] = GraphedForward(
                self, input_ids.shape[1], width, keep, capture, capture_last, full_rows=full_rows and width > 0
            )
        return self._graphs.get(key)

    @property
    def graph_report(self) -> dict:
        """Shapes captured and replayed (``full_rows``: of them, sparse ones whose rows may read in full), and why
        any capture failed (those shapes ran eagerly)."""
        graphs = self._graphs or {}
        return {
            "captured": sum(g.graphs is not None for g in graphs.values()),
            "full_rows": sum(g.graphs is not None and g.plan.full_rows for g in graphs.values()),
            "failed": [g.failed for g in graphs.values() if g.failed],
        }

    def prefill(
        self,
        rows: list[torch.Tensor],
        chunk: int | None,
        capture: dict,
        on_chunk: Callable[[int], None] | None = None,
        starts: list[int] | None = None,
    ) -> tuple[list[torch.Tensor], list]:
        """Write each row's tokens; return each row's last logits and kept queries. ``starts``: positions each row
        already holds (a reused prompt prefix, :meth:`DustinCache.load_prefix`); its tokens go after them.

        A forward holds at most ``chunk`` tokens (``None``: :func:`prefill_chunk`'s choice from free memory). A row
        that fits reads its whole prompt in one forward: its attention is square and causal, which SDPA runs on
        its fastest kernel (cuDNN's on an H100/H200, :func:`~dustin_hf.kernels.reference.prefill_attention`); a
        longer row goes ``chunk`` at a time, each chunk attending to the ones before (sliding windows that cut the
        prompt: at most 4096 at a time, their masked path's tensors grow with queries times keys). Neighbouring rows
        of one length share a forward while they hold at most ``max(chunk, 8192)`` tokens together, since short
        forwards leave the GPU's GEMMs underfed. ``on_chunk`` is
        told each forward's token count once it is written (a progress bar)."""
        longest = max(ids.numel() for ids in rows)
        if chunk is None:
            chunk = prefill_chunk(self.model, longest)
            if window_cuts(self.model, longest):  # windowed layers run the masked path: (Q, keys) tensors
                chunk = min(chunk, _MASKED_CHUNK)
        last_logits, kept = [], []
        self.prompt_outputs = []
        group = max(chunk, _GROUP_TOKENS)  # short prompts share a forward up to this many tokens
        starts = starts or [0] * len(rows)
        for first, stop in _row_groups([ids.numel() for ids in rows], group, any(self.record), starts):
            ids = torch.stack(rows[first:stop])  # (n, T): the rows of a group have one length (T > group: alone)
            logits, captured, pieces = None, {}, []
            for start in range(0, ids.shape[1], chunk):
                piece = ids[:, start : start + chunk]
                plan = ForwardPlan(
                    rows=slice(first, stop),
                    cache_seqlens=[starts[first] + start] * (stop - first),
                    q_len=piece.shape[1],
                    backend=self.backend,
                    capture=capture,
                    capture_last=True,
                    tuning=self.tuning,
                    positions=None if self.positions is None else self.positions[first:stop],
                    window_slots=None if self.window_slots is None else self.window_slots[first:stop],
                )
                logits = self.forward(plan, piece, keep=1)[:, -1]  # (n, V)
                captured = plan.captured
                if any(self.record):
                    pieces.append(self.last_outputs)
                if on_chunk is not None:
                    on_chunk(piece.numel())
            for i in range(stop - first):  # an empty row (a draft's one-token prompt) ran no forward: no logits
                last_logits.append(None if logits is None else logits[i])
                kept.append({layer: q[i : i + 1] for layer, q in captured.items()})
            if any(self.record):
                self.prompt_outputs.append(_joined(pieces, ids.shape[1]))
        return last_logits, kept

    def hidden_query(self, row: int, token: int, position: int) -> torch.Tensor:
        """The logits ``(V,)`` of ``token`` at ``position`` in ``row``, attending to the row's cached positions
        only, not to itself, and leaving the cache as it was: the query of a masked last input slot, which names
        the first new token in stock ``generate()`` (see :mod:`dustin_hf.decode.masks`)."""
        held = self.cache.seq_lengths[row]
        slots = None
        if self.window_slots is not None:  # the masked slot sits in stock's cache just before the first new token
            slots = self.window_slots[row : row + 1].clone()
            slots[0, held] -= 1
        plan = ForwardPlan(
            rows=slice(row, row + 1),
            cache_seqlens=[held],
            q_len=1,
            backend="reference",
            positions=torch.full((1, held + 1), position, device=self.device),
            hide_new=True,
            window_slots=slots,
        )
        ids = torch.tensor([[token]], device=self.device)
        with self.cache.forward_plan(plan):  # writes slot `held` (overwritten by the next forward), not counted
            return self.call(plan, ids, plan.position_ids(self.device), keep=1)[0, -1]


# A forward of the masked attention path (sliding windows that cut) holds (queries, keys) index and mask tensors:
# its prompt chunks stay this short whatever the free memory.
_MASKED_CHUNK = 4096
# Rows of one length share a prefill forward while their tokens fit in this (or the chunk, if larger): a forward of
# a few hundred tokens leaves the GPU's GEMMs underfed.
_GROUP_TOKENS = 8192


def prefill_chunk(model, longest: int) -> int:
    """Prompt tokens per prefill forward for ``model`` when the config leaves it to the free memory.

    On CUDA: as many as half the device's free memory holds at the forward's activation bytes per token
    (:func:`_activation_bytes`), at least 1024 and no more than ``longest`` (one forward per row when it fits,
    which also makes the row's attention one square causal call). Elsewhere 4096: on a CPU the forward's speed
    hardly depends on it, and its attention's transient memory grows with its square.
    """
    device = model_device(model)
    if device.type != "cuda":
        return max(1, min(longest, 4096))
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached blocks serve too
    fits = free // 2 // _activation_bytes(model.config.get_text_config(), model.dtype)
    return max(1024, min(longest, fits))


def _activation_bytes(text_config, dtype: torch.dtype) -> int:
    """An upper bound on one prompt token's transient activations in a decoder layer's forward: the MLP's
    ``[gate; up]`` output and its product (3 intermediate widths), the residual stream, norms, q/k/v and the
    attention output (8 hidden widths), with a width to spare."""
    return torch.tensor([], dtype=dtype).element_size() * (
        4 * text_config.intermediate_size + 8 * text_config.hidden_size
    )


def _row_groups(
    lengths: list[int], chunk: int, one_each: bool, starts: list[int] | None = None
) -> list[tuple[int, int]]:
    """``(first, stop)`` row ranges for prefill forwards: neighbouring rows of one length and one start while their
    tokens fit in ``chunk`` tokens (``one_each``: every row alone)."""
    starts = starts or [0] * len(lengths)
    groups: list[tuple[int, int]] = []
    for b, n in enumerate(lengths):
        if groups and not one_each:
            first, stop = groups[-1]
            alike = lengths[first] == n and starts[first] == starts[b]
            if stop == b and alike and (stop - first + 1) * n <= chunk:
                groups[-1] = (first, b + 1)
                continue
        groups.append((b, b + 1))
    return groups


def _joined(pieces: list[tuple], length: int) -> tuple:
    """One prompt's ``(hidden states, attentions)`` from its prefill chunks: hidden ``(1, n, hidden)`` per layer,
    attentions ``(1, H, n, n)`` per layer (each chunk's weights span the slots it saw, the rest is zero)."""
    hidden = None if pieces[0][0] is None else tuple(torch.cat(parts, dim=1) for parts in zip(*(p[0] for p in pieces)))
    attentions = None
    if pieces[0][1] is not None:
        attentions = []
        for parts in zip(*(p[1] for p in pieces)):
            rows = [torch.nn.functional.pad(a, (0, length - a.shape[-1])) for a in parts]
            attentions.append(torch.cat(rows, dim=2))
        attentions = tuple(attentions)
    return hidden, attentions
