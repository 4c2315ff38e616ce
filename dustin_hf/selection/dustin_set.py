"""The paper's read-set policy: a fixed budget filled by the draft's lookahead and the target's history.

Each row reads ``budget`` positions (:func:`~dustin_hf.selection.fill.select_positions`): the sinks and the recent
window, the top ``draft_share`` positions by the draft's lookahead attention, the rest by the target's history
attention (:class:`~dustin_hf.selection.request.Scorer`). One sorted index set per row, shared by every layer and head
of the target; with ``selection="verify"`` it is what the layers before the first selection layer read
(:mod:`dustin_hf.selection.layers`).

With the Triton backend the scores span the cache capacity, a size fixed for the whole generation (each row's
kernels stop at its own length), so the steady step (every row sparse and with a history, one device) is
captured once as a CUDA graph and replayed; the eager calls before it run the very same kernels and splits.
The graph spares the host a millisecond or more of launches a step, which could otherwise leave the GPU
waiting before verification.
"""

from __future__ import annotations

import torch

from ..config import ResolvedConfig
from ..runtime.graphs import GraphedCall
from .fill import Selection, dense_rows, select_positions
from .request import ReadRequest, ScoreInputs, Scorer

__all__ = ["DustinSet"]


class DustinSet:
    """``selection="dustin"`` (and the set before the forward of ``selection="verify"``) at a fixed budget.

    Args:
        scorer: the two signals' settings (its ``config`` is the policy's).
        graphs: capture the steady step (needs the target's graph pools).
    """

    def __init__(self, scorer: Scorer, graphs: bool):
        self.scorer, self.graphs = scorer, graphs
        self._graphs: dict[tuple, GraphedCall] = {}  # the steady step, per γ and cache buffers

    @staticmethod
    def applies(config: ResolvedConfig) -> bool:
        return True  # the default: the registry asks it last

    @property
    def config(self) -> ResolvedConfig:
        return self.scorer.config

    def select(self, request: ReadRequest) -> Selection:
        inputs = self.scorer.inputs(request)

        def read_set(*tensors) -> Selection:
            *queries, lengths, history_queries = tensors
            s_draft, s_target = self.scorer.scores(inputs, queries, lengths, history_queries)
            # the Triton selection with the Triton backend (unless the span outgrows its pools), else PyTorch
            return select_positions(
                request.seqlens,
                s_draft,
                s_target,
                inputs.has_history,
                self.config,
                lengths=lengths,
                backend="auto" if self.scorer.triton else "reference",
                window=request.window,
                tuning=self.scorer.tuning.select,
                full_rows=True,
            )

        if not self._steady(request, inputs):
            return read_set(*inputs.draft_queries, request.base, inputs.history_queries)
        # the steady step: what the graph replays is fixed by the step's shapes (γ) and the cache buffers
        key = (request.gamma, tuple(k.data_ptr() for k in (*inputs.draft_keys, inputs.target_keys)))
        call = self._graphs.get(key)
        if call is None:

            def graphed(*tensors) -> tuple[torch.Tensor, torch.Tensor]:
                selection = read_set(*tensors)
                return selection.indices, selection.num_indices

            device = request.base.device
            call = self._graphs[key] = GraphedCall(graphed, device, request.target.graph_pools[device][0])
        indices, num_indices = call(*inputs.draft_queries, request.base, inputs.history_queries)
        return Selection(indices.clone(), num_indices.clone(), [self.config.budget] * len(request.seqlens))

    def _steady(self, request: ReadRequest, inputs: ScoreInputs) -> bool:
        """Whether the step is the one the graph replays: every row sparse and with a history, every draft
        counted, the scores on one device."""
        return (
            self.scorer.triton
            and self.graphs
            and all(inputs.has_history)
            and len(inputs.devices | {request.base.device}) == 1
            and inputs.query_counts is None
            and not any(dense_rows(request.seqlens, self.config))
        )

    @property
    def graph_report(self) -> dict:
        return {
            "captured": sum(c.graph is not None for c in self._graphs.values()),
            "failed": [c.failed for c in self._graphs.values() if c.failed],
        }
