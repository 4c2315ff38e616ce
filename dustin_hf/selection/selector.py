"""Step 2 of a Dustin step: score every cached position and choose what each row's verification reads.

The two signals (:mod:`dustin_hf.selection.scoring`): the draft's lookahead attention (the queries that produced this
step's drafts, on the draft's scoring heads) and the target's history attention (the query of each row's last
committed token, kept by the previous verification). The budget fill (:mod:`dustin_hf.selection.fill`) turns them
into one sorted index set per row, shared by every layer and head of the target.

With the Triton backend the scores span the cache capacity, a size fixed for the whole generation (each row's
kernels stop at its own length), so the steady step (every row sparse and with a history, one device) is
captured once as a CUDA graph and replayed; the eager calls before it run the very same kernels and splits.
The graph spares the host a millisecond or more of launches a step, which could otherwise leave the GPU
waiting before verification.
"""

from __future__ import annotations

import torch

from ..config import ResolvedConfig
from ..kernels.tuning import KernelTuning
from ..runtime.graphs import GraphedCall
from .fill import Selection, dense_rows, select_by_recovery, select_positions
from .history import History
from .scoring import draft_lookahead_scores, target_history_scores

__all__ = ["Selector"]


class Selector:
    """Chooses each row's read set from the kept queries; kept with a workspace across decode runs (it owns the
    steady step's graph; its per-run hooks, ``budgets`` and ``window_slots``, are set by each run).

    Args:
        config: the resolved Dustin settings (scoring layers and heads, budget, windows).
        backend: the attention backend; ``"triton"`` scores and selects with the Triton kernels.
        t_group, d_group: query heads per key head of the target and the draft.
        t_scale, d_scale: their attention scales.
        graphs: capture the steady step (needs the target's graph pools).
        window: the sliding window every target layer has (Mistral-style models), else ``None``: the read set is
            chosen inside it (:func:`~dustin_hf.selection.fill.select_positions`).
        window_slots: ``(B, capacity)`` int64 on the CPU, what the window counts in rows with masked input slots
            (:func:`dustin_hf.decode.masks.stock_slots`), else ``None`` (the cache positions).
        budgets: the quality knob's replayed counts (:attr:`~dustin_hf.decode.hooks.DecodeHooks.budgets`).
        tuning: the kernels' launch heuristics (scoring and selection take theirs).
    """

    def __init__(
        self,
        config: ResolvedConfig,
        backend: str,
        t_group: int,
        d_group: int,
        t_scale: float,
        d_scale: float,
        graphs: bool,
        window: int | None = None,
        budgets=None,
        tuning: KernelTuning | None = None,
        window_slots: torch.Tensor | None = None,
    ):
        self.config, self.backend, self.graphs, self.window, self.budgets = config, backend, graphs, window, budgets
        self.window_slots = window_slots
        self.tuning = tuning or KernelTuning()
        self.t_group, self.d_group, self.t_scale, self.d_scale = t_group, d_group, t_scale, d_scale
        self._graphs: dict[tuple, GraphedCall] = {}  # the steady step, per γ and cache buffers

    def select(
        self,
        target,
        draft,
        seqlens: list[int],
        base: torch.Tensor,
        kept_queries: dict,
        gamma: int,
        row_gamma: list[int] | None = None,
        *,
        history: History | None = None,
    ) -> Selection:
        """The read sets of a step at ``seqlens`` (``base``: the same on the device) from the draft's kept
        queries (``{layer: [(B, heads, D)] * γ}``) and the target's ``history``; ``row_gamma``: the drafts each
        row proposed, when some row proposed fewer than γ (it scores with its own queries only).

        ``history=None`` reads the history the target cache still keeps, until the decode loop holds a
        :class:`History` of its own and passes it (then this bridge goes)."""
        cfg, t_cache = self.config, target.cache
        if history is None:
            history = History(len(seqlens))
            history.keep(t_cache.history_queries, t_cache.history_pos)
        d_queries = [torch.stack(kept_queries[layer], dim=1) for layer in cfg.draft_layers]  # (B, γ, h, D)
        has_history = history.rows_at(seqlens)
        triton = self.backend == "triton"
        # every row's L is below capacity - γ - 2 (the loop sizes the caches so), and the draft queries see up
        # to L + γ - 1
        span = t_cache.capacity - gamma if triton else max(seqlens)
        d_keys = [draft.cache.layer_buffers(layer)[0] for layer in cfg.draft_layers]
        t_keys = t_cache.layer_buffers(cfg.target_layer)[0]
        history_queries = history.queries if any(has_history) else None
        counts = None
        if row_gamma is not None and any(g != gamma for g in row_gamma):
            counts = torch.tensor(row_gamma).to(base.device, non_blocking=True)

        window = self._row_windows(seqlens)

        def score_select(*tensors) -> Selection:
            *queries, lengths, history_queries = tensors
            return self._score_select(
                queries, d_keys, t_keys, history_queries, lengths, seqlens, has_history, span, triton, counts, window
            )

        devices = {base.device, t_keys.device, *(k.device for k in d_keys)}
        if not (
            triton
            and self.graphs
            and all(has_history)
            and len(devices) == 1
            and counts is None
            and cfg.min_recovery is None
            and not any(dense_rows(seqlens, cfg))
        ):
            return score_select(*d_queries, base, history_queries)
        # the steady step: what the graph replays is fixed by the step's shapes (γ) and the cache buffers
        key = (gamma, tuple(k.data_ptr() for k in (*d_keys, t_keys)))
        call = self._graphs.get(key)
        if call is None:

            def read_set(*tensors) -> tuple[torch.Tensor, torch.Tensor]:
                selection = score_select(*tensors)
                return selection.indices, selection.num_indices

            call = self._graphs[key] = GraphedCall(read_set, base.device, target.graph_pools[base.device][0])
        indices, num_indices = call(*d_queries, base, history_queries)
        return Selection(indices.clone(), num_indices.clone(), [cfg.budget] * len(seqlens))

    def _row_windows(self, seqlens: list[int]) -> int | list[int] | None:
        """The window, or with :attr:`window_slots` each row's: the cache positions a window of stock's indices
        holds back from the step's first query (at position ``L``), so that ``[L - w + 1, L)`` is what it sees."""
        if self.window is None or self.window_slots is None:
            return self.window
        table = self.window_slots
        lengths = torch.tensor(seqlens)
        first = table.gather(1, lengths[:, None])  # (B, 1) the first query's index in stock's cache
        outside = (table[:, : max(seqlens)] <= first - self.window).sum(dim=1)  # indices only grow along a row
        return (lengths - outside + 1).tolist()

    def _score_select(
        self,
        d_queries,
        d_keys,
        t_keys,
        history_queries,
        lengths,
        seqlens,
        has_history,
        span: int,
        triton: bool,
        query_counts: torch.Tensor | None = None,
        window: int | list[int] | None = None,
    ) -> Selection:
        """:func:`select_positions` from the draft queries and the target history queries (``None``: none)."""
        cfg = self.config
        score_backend = "triton" if triton else "reference"
        s_draft = draft_lookahead_scores(
            d_queries,
            d_keys,
            lengths.to(d_keys[0].device),
            cfg.draft_heads,
            self.d_group,
            self.d_scale,
            span,
            backend=score_backend,
            query_counts=query_counts,
            tuning=self.tuning.score,
        ).to(lengths.device)
        s_target = None
        if history_queries is not None:
            s_target = target_history_scores(
                history_queries.to(t_keys.device),
                t_keys,
                lengths.to(t_keys.device),
                cfg.target_heads,
                self.t_group,
                self.t_scale,
                span,
                backend=score_backend,
                tuning=self.tuning.score,
            ).to(lengths.device)
        if cfg.min_recovery is not None:  # the quality knob: each row's own count, chosen in PyTorch
            counts = None if self.budgets is None else self.budgets(seqlens)
            # a row read in full by its count (one width, so the target's CUDA graph); within a sliding window a
            # row reads its window, which only a listing says
            return select_by_recovery(
                seqlens,
                s_draft,
                s_target,
                has_history,
                cfg,
                lengths=lengths,
                counts=counts,
                window=window,
                full_rows=self.window is None,
            )
        # the Triton selection with the Triton backend (unless the span outgrows its pools), else PyTorch
        return select_positions(
            seqlens,
            s_draft,
            s_target,
            has_history,
            cfg,
            lengths=lengths,
            backend="auto" if triton else "reference",
            window=window,
            tuning=self.tuning.select,
            full_rows=True,
        )

    @property
    def graph_report(self) -> dict:
        return {
            "captured": sum(c.graph is not None for c in self._graphs.values()),
            "failed": [c.failed for c in self._graphs.values() if c.failed],
        }
