"""Step 1 of every mode: the draft proposes γ tokens per row, and each row's draft length for the next step.

A step's first draft forward feeds each row's tokens at ``L-1`` and ``L`` (the draft cache lags the target's by one
token, so every row feeds the same count), then γ-1 single tokens. A step queues the next step's first forwards
before its one device->host copy (:meth:`Drafter.queue`): the GPU drafts while the host does its bookkeeping.
What the draft reads (everything, or with ``sparse_draft`` the last read set: :mod:`dustin_hf.selection.draft_reads`)
and which of its queries it keeps for scoring are the verifier's to say; the drafter only runs the forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runtime.plan import device_tensor
from ..selection.draft_reads import DraftReads
from .sampling import pick_tokens
from .settings import Drafting

__all__ = ["Drafter", "Drafts", "QueuedDraft"]


@dataclass(frozen=True)
class Drafts:
    """Step 1's output: every row's drafts, the draft's distributions and the scoring queries it kept."""

    tokens: torch.Tensor  # (B, γ): γ is the longest row's count; a row's drafts past its own count are ignored
    probs: torch.Tensor | None  # (B, γ, V): the draft's processed distributions q on the target's vocabulary
    queries: dict  # {draft scoring layer: [(B, heads, D)] * γ}: the queries that produced the drafts
    row_gamma: list[int]  # the drafts each row proposed (finished rows: γ, of no consequence)

    @property
    def gamma(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class QueuedDraft:
    """A step's first draft forwards, queued by the step before (:meth:`Drafter.queue`)."""

    outputs: tuple[tuple[torch.Tensor, dict], ...]  # per forward: logits (B, 1, Vd) float32 (or, from a
    # tokens_only runner, tokens (B, 1)) and the kept scoring queries
    sparse: bool  # the step it was queued for was expected to be sparse
    reads: DraftReads | None  # what it read (sparse draft); the step's later forwards read the same


class Drafter:
    """The draft's side of a run: its forwards, each row's draft length, and the next step's queued forwards.

    Args:
        drafting: γ, its schedule and the confidence stop.
        batch: rows.
        vocab: the draft's and the target's vocabulary sizes (a draft may pad its embedding less; same tokenizer).
        tokens_only: the forwards hand out their argmax tokens, not logits (greedy, unprocessed).
    """

    def __init__(self, drafting: Drafting, batch: int, vocab: tuple[int, int], tokens_only: bool):
        self.drafting, self.vocab, self.tokens_only = drafting, vocab, tokens_only
        self.row_gamma = [drafting.num_draft_tokens] * batch  # each row's draft length next step (the schedule)
        self.ahead: QueuedDraft | None = None  # the next step's first draft forwards, already queued

    def draft(
        self,
        run,
        seqlens: list[int],
        base: torch.Tensor,
        sparse: bool,
        capture: dict,
        draft_reads: Callable[[], DraftReads | None],
    ) -> Drafts:
        """Up to γ draft forwards at ``seqlens`` (``base`` on the device); ``capture``: the draft queries to keep
        (``{layer: heads}``); ``draft_reads()``: what a forward not queued ahead reads (``None``: everything).

        Each row drafts its own count: its schedule's length, cut after a draft below the confidence threshold.
        The forwards run while some unfinished row is still drafting; a row's drafts past its own count are
        computed with the others' but never verified, scored or accepted, so the row's tokens depend on its own
        prompt only."""
        rows, runner = run.rows, run.draft
        planned = [0 if done else g for g, done in zip(self.row_gamma, rows.finished)]
        ahead, self.ahead = self.ahead, None  # the first forwards, queued by the last step before its sync
        assert ahead is None or ahead.sparse == sparse  # committed lengths only grow: sparse steps stay sparse
        queued, read_set = (ahead.outputs, ahead.reads) if ahead is not None else ((), draft_reads())
        feed = None if ahead is not None else self.feed(rows.tokens, base - 1)
        tokens, probs, kept_queries = [], [], {layer: [] for layer in capture}
        drafted, drafting = [0] * rows.batch_size, [g > 0 for g in planned]
        for i in range(max(planned)):
            at = [n - 1 + i + (1 if i else 0) for n in seqlens]
            if i < len(queued):
                raw, captured = queued[i]
            else:
                selection = None if read_set is None else read_set.at(at)
                raw, captured = runner.step(feed, at, keep=1, capture=capture, capture_last=True, selection=selection)
            token, q = self._pick(run, raw, tokens, drafting, i)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            for layer, query in captured.items():
                kept_queries[layer].append(query[:, 0])  # (B, heads, D)
            feed = token[:, None]
            confident = self._confident(probs, token, i + 1 < max(planned))
            for b in range(rows.batch_size):
                if drafting[b]:
                    drafted[b] += 1
                    drafting[b] = drafted[b] < planned[b] and (confident is None or confident[b])
            if not any(drafting):
                break
        if read_set is not None:
            run.stats.draft_sparse_forwards += len(tokens)
        row_gamma = [len(tokens) if done else n for n, done in zip(drafted, rows.finished)]
        return Drafts(
            torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, kept_queries, row_gamma
        )

    def _pick(self, run, raw: torch.Tensor, tokens: list, drafting: list[bool], i: int):
        """The i-th draft token of every row from one forward's output, and q_i where sampling or a threshold
        needs it."""
        rows, device = run.rows, run.rows.tokens.device
        if self.tokens_only:
            return raw[:, 0].to(device), None
        draft_vocab, target_vocab = self.vocab
        if raw.shape[-1] < target_vocab:  # processors are built for the target's vocabulary
            raw = torch.nn.functional.pad(raw, (0, target_vocab - raw.shape[-1]), value=float("-inf"))
        scores = run.process(raw, lambda b, _: rows.history(b, tokens[:i]))
        token = pick_tokens(scores[:, 0], run.rng, drafting).to(device)
        needs_q = run.rng is not None or self.drafting.confidence_threshold is not None
        return token, scores[:, 0].softmax(dim=-1) if needs_q else None

    def _confident(self, probs: list, token: torch.Tensor, more: bool) -> list[bool] | None:
        """Per row, whether q_i(d_i) of its own draft reaches the threshold (transformers' ``ConfidenceCriteria``);
        ``None`` without a threshold or after the last planned draft (there is nothing to stop)."""
        threshold = self.drafting.confidence_threshold
        if threshold is None or not more:
            return None
        return (probs[-1].gather(1, token[:, None]).squeeze(1) >= threshold).tolist()

    def feed(self, tokens: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """``(B, 2)``: each row's committed tokens at ``before`` and ``before + 1`` (the draft's first input)."""
        feed = tokens.gather(1, before[:, None] + torch.arange(2, device=before.device))
        return feed.clamp_max(self.vocab[0] - 1)  # the target's padding ids, which the draft cannot embed

    def update_schedule(self, row_gamma: list[int], accepted: list[int], active: list[int]) -> None:
        """transformers' ``num_assistant_tokens_schedule``, each row on its own: a row that kept all the drafts it
        proposed drafts 2 more next step, any other 1 fewer (at least 1)."""
        if self.drafting.schedule == "constant":
            return
        top = self.drafting.max_gamma
        for b in active:
            grew = accepted[b] >= row_gamma[b]
            self.row_gamma[b] = min(top, self.row_gamma[b] + 2) if grew else max(1, self.row_gamma[b] - 1)

    def queue(
        self, run, base: torch.Tensor, n_accepted: torch.Tensor, sparse: bool, capture: dict, reads: DraftReads | None
    ) -> None:
        """Queue the next step's first draft forward before this step's one sync, from device values alone; when
        the forwards hand out tokens (nothing on the host between them) all γ.

        The step's copy to the host is queued before them and the host waits for that copy alone
        (:class:`~dustin_hf.runtime.plan.HostCopy`), so it queues the rest of the next step while the GPU runs
        these. A row that commits ``k = n + 1`` tokens holds ``L + k - 1`` draft positions next step and feeds its
        tokens at ``L + k - 1`` and ``L + k``; a row finished before this step commits ``k = 0``. Rows that finish
        on this step are cut on the host only, their drafts never used: their positions are capped so that the
        slots written stay inside the cache (a row still running next step holds fewer than
        ``capacity - max_gamma - 1`` positions). Only replayable graphs queue; else fewer forwards, or none."""
        runner, rows = run.draft, run.rows
        kept = n_accepted  # k - 1
        if any(rows.finished):
            kept = torch.where(device_tensor(rows.finished, base.device), -1, n_accepted)
        before = (base + kept).clamp_max(runner.cache.capacity - 1 - self.drafting.max_gamma)  # L + k - 1
        feed, outputs = self.feed(rows.tokens, before), []
        for i in range(max(self.row_gamma) if self.tokens_only else 1):
            cached = before if i == 0 else before + 1 + i  # the forward's rows hold this many positions
            out = runner.step_ahead(
                feed, cached.to(torch.int32), keep=1, capture=capture, capture_last=True,
                indices=None if reads is None else reads.indices,
                num_indices=None if reads is None else reads.ahead(cached - base),
                full_rows=reads is not None and reads.full_rows, eager=run.settings.hooks.queue_eagerly,
            )  # fmt: skip
            if out is None:  # this shape has no graph yet
                break
            outputs.append(out)
            feed = out[0]  # (B, 1) tokens
        self.ahead = QueuedDraft(tuple(outputs), sparse=sparse, reads=reads) if outputs else None
