"""Sparse verification (Dustin): the dense verifier, but a long row's verification reads a selection.

Its differences from :mod:`.dense`: a step is sparse once some row holds more than the budget and ``min_context``;
then the draft keeps its scoring queries, the read-set policy (:mod:`dustin_hf.selection`) chooses each row's set
from them and from the history (the target's query of each row's last committed token, kept by the verification
before), the target reads that set, and with ``sparse_draft`` the next step's draft reads it too. With a budget
covering the context every step is dense, so the output is exactly the dense verifier's.
"""

from __future__ import annotations

import logging

import torch

from ..compat import attention_scale, common_window, group_size
from ..config import ResolvedConfig
from ..runtime.plan import device_tensor, select_heads
from ..selection.draft_reads import DraftReads
from ..selection.fill import Selection, dense_rows
from ..selection.history import History
from ..selection.layers import select_spec
from ..selection.selector import Selector
from .dense import DenseVerifier, Footprint, Step
from .drafter import Drafts

__all__ = ["SparseVerifier"]

logger = logging.getLogger(__name__)
_LOGGED: set = set()  # what was logged once per process


class SparseVerifier(DenseVerifier):
    """Dense verification with Dustin's read sets past the budget.

    Args:
        config: the resolved Dustin settings (prompt calibration replaces them for the run, never the decoder's).
        calibrate: with ``calibration="prompt"``, the search run on the prompts after prefill.
        max_gamma: the most drafts a row proposes (the sparse draft's read width follows from it).
        window_slots: what sliding windows count where rows have holes (``None``: the slots themselves).
    """

    def __init__(self, config: ResolvedConfig, calibrate, max_gamma: int, window_slots: torch.Tensor | None):
        self.config, self.calibrate, self.max_gamma, self.window_slots = config, calibrate, max_gamma, window_slots
        self.history: History | None = None  # made after prefill
        self.policy: Selector | None = None  # made after prefill (prompt calibration may change the heads)
        self.last: tuple[Selection, list[int]] | None = None  # the last sparse step's read set, for the sparse draft
        self.target_layers = 0

    @staticmethod
    def footprint(config: ResolvedConfig, max_gamma: int, do_sample: bool, queries: int | None = None) -> Footprint:
        """``queries``: the leading queries of a block that score at the selection layers (``None``: all)."""
        read_width = max(config.budget, config.max_budget)
        draft_width = read_width + DraftReads.extra_for(config, max_gamma) if config.sparse_draft else 0
        return Footprint(
            read_width=read_width, draft_width=draft_width, select=select_spec(config, queries=queries),
            dense_layers=config.dense_layers,
            # prompt calibration picks other scoring heads each call, and every pick captures graphs of its own
            keeps_workspace=config.calibration != "prompt",
        )  # fmt: skip

    @property
    def queries_kept(self) -> dict:
        return {self.config.target_layer: self.config.target_heads}

    def prefill_plan(self, run) -> tuple[int | None, dict]:
        if self.config.calibration != "prompt":
            return self.config.prefill_chunk, self.queries_kept
        t_cfg = run.target.model.config.get_text_config()  # the scoring layer is chosen after prefill: keep all
        return self.config.prefill_chunk, {
            layer: tuple(range(t_cfg.num_attention_heads)) for layer in range(t_cfg.num_hidden_layers)
        }

    def start(self, run, kept_queries: list) -> None:
        """Prompt calibration (when asked), the first history (each prompt's last query), the policy."""
        prompt_lens = run.rows.prompt_lens
        calibrating = self.config.calibration == "prompt"  # the calibrated config says "none"
        if calibrating:
            self.config, report = self.calibrate(
                run.target, run.draft, run.rows.tokens, self.config, run.drafter.drafting.num_draft_tokens, prompt_lens
            )
            run.stats.reports["calibration"] = report
        layer, heads = self.config.target_layer, self.config.target_heads
        queries = torch.cat([k[layer][:, 0] for k in kept_queries])  # (B, kept heads, D)
        if calibrating:  # prefill kept every head
            queries = select_heads(queries, heads, dim=1)
        self.history = History(len(prompt_lens))
        self.history.keep(queries, [n - 1 for n in prompt_lens])
        self.policy = self._policy(run)
        self.target_layers = len(run.target.cache.layers)

    def _policy(self, run) -> Selector:
        """The workspace's policy when it was made for this run's settings, else a new one kept there."""
        workspace, policy = run.workspace, run.workspace.selector
        if policy is None or policy.config != self.config:
            target, draft = run.target.model, run.draft.model
            t_cfg, d_cfg = target.config.get_text_config(), draft.config.get_text_config()
            policy = workspace.selector = Selector(
                self.config, workspace.shape.backend, group_size(t_cfg), group_size(d_cfg),
                attention_scale(target, t_cfg), attention_scale(draft, d_cfg), graphs=workspace.shape.graphs[0],
                window=common_window(target), tuning=workspace.shape.tuning.kernels,
            )  # fmt: skip
        policy.budgets, policy.window_slots = run.settings.hooks.budgets, self.window_slots
        return policy

    def positions(self, run) -> Step:
        at = super().positions(run)
        return Step(at.seqlens, at.base, sparse=not all(dense_rows(at.seqlens, self.config)))

    def draft_capture(self, sparse: bool) -> dict:
        return dict(zip(self.config.draft_layers, self.config.draft_heads)) if sparse else {}

    def draft_reads(self, run, sparse: bool) -> DraftReads | None:
        if not (sparse and self.config.sparse_draft):
            return None
        return DraftReads.after(self.last, self.config, self.max_gamma, run.draft.cache.capacity)

    def choose(self, run, at: Step, queries: dict, gamma: int, row_gamma: list[int] | None) -> Selection:
        """The policy's read sets from the draft's kept ``queries`` and the history."""
        return self.policy.select(
            run.target, run.draft, at.seqlens, at.base, queries, gamma, row_gamma, history=self.history
        )

    def reads(self, run, at: Step, drafts: Drafts) -> Selection | None:
        selection = self.choose(run, at, drafts.queries, drafts.gamma, drafts.row_gamma) if at.sparse else None
        self.last = None if selection is None else (selection, at.seqlens)
        if selection is not None and selection.recovery is not None:
            run.stats.record_knob(selection.counts, selection.recovery, selection.fallback, run.rows.active)
        return selection

    def queue_drafts(self, run, base: torch.Tensor, n_accepted: torch.Tensor, reads, seqlens: list[int]) -> None:
        """A sparse step queues the next one's first draft forwards (a sparse step stays sparse); a dense step of
        a sparse run does not (the next may turn sparse, and its draft keep queries)."""
        if reads is None:
            return
        draft_reads = None
        if self.config.sparse_draft:
            draft_reads = DraftReads.after((reads, seqlens), self.config, self.max_gamma, run.draft.cache.capacity)
        run.drafter.queue(run, base, n_accepted, sparse=True, capture=self.draft_capture(True), reads=draft_reads)

    def settle(self, run, starts: list[int], kept: list[int], captured: dict) -> None:
        """The dense settle, and the last kept input's query on the scoring heads becomes the next history."""
        super().settle(run, starts, kept, captured)
        queries = captured[self.config.target_layer]  # (B, Q, heads, D)
        picked = device_tensor([max(k - 1, 0) for k in kept], queries.device)
        history = queries[torch.arange(len(starts), device=queries.device), picked]
        self.history.keep(history, [s + k - 1 for s, k in zip(starts, kept)])

    def attended(
        self, reads: Selection | None, seqlens: list[int], active: list[int]
    ) -> list[tuple[float, bool]] | None:
        """Per active row: the cached positions it read per layer (dense and selection layers read everything), and
        whether its read set held less than the row (a sparse row, not one read in full)."""
        if reads is None:
            return None
        cfg, layers = self.config, self.target_layers
        dense = len(set(cfg.dense_layers) | set(cfg.selection_layers))
        return [
            ((reads.counts[b] * (layers - dense) + seqlens[b] * dense) / layers, reads.counts[b] < seqlens[b])
            for b in active
        ]

    def graph_report(self) -> dict:
        return self.policy.graph_report

    def report(self, run) -> dict:
        return {"dense_rows": self._dense_rows(run.stats)}

    def _dense_rows(self, stats) -> dict:
        """Rows that never verified sparsely, by reason: the most positions they held at a verification within the
        budget, or past it but below ``min_context`` (a row past both that read everything at every step is the
        knob's, counted in its ``dense_fallbacks``). A call in which no row verified sparsely says so at INFO level
        (the ``dustin_hf`` logger), once per process and (budget, min_context)."""
        cfg = self.config
        dense = [n for b, n in enumerate(stats.held) if b not in stats.sparse_rows]
        counts = {
            "within_budget": sum(n <= cfg.budget for n in dense),
            "below_min_context": sum(cfg.budget < n < cfg.min_context for n in dense),
        }
        key = ("dense call", cfg.budget, cfg.min_context)
        if stats.sparse_steps == 0 and stats.held and key not in _LOGGED:
            _LOGGED.add(key)
            logger.info(
                "every step of this call verified densely: its rows held at most %d cached positions at a "
                "verification, and a row verifies sparsely only past budget=%d and min_context=%d "
                "(cache_config changes both)", max(stats.held), cfg.budget, cfg.min_context,
            )  # fmt: skip
        return counts
