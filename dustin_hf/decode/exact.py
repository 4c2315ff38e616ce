"""Exact mode's verifier: the sparse verifier, with tentative acceptance and dense confirmation.

Its differences from :mod:`.sparse` (the schedule and block arithmetic are in :mod:`.confirm`): a row verified
sparsely accepts *tentatively*; a confirming row's verification is dense, with its tentative tokens in front of
the new drafts: one speculative block ``[x, t_1..t_n, d_1..d_γ]`` from the row's last committed token x, whose
proposal is p~ (the sparse target) for the t's and q for the d's. What a confirming or dense row accepts is
committed; what a sparse row accepts joins its tentative tokens. So what is committed is the target's own output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..runtime.plan import HostCopy, device_tensor
from ..selection.fill import Selection, dense_rows, truncated, with_dense_rows
from .confirm import ConfirmSchedule, block_proposals, blocks
from .dense import Footprint, Step, Verdict
from .drafter import Drafts
from .sparse import SparseVerifier

__all__ = ["ExactVerifier"]


@dataclass(frozen=True)
class ExactStep(Step):
    """Where the rows stand, and which of them confirm or read everything this step."""

    confirming: list[bool] = ()  # the row's tentative tokens are checked densely this step
    dense: list[bool] = ()  # the row reads everything (confirming, short, at limit 0, or a greedy confirm step)
    starts: list[int] = ()  # cached positions before the row's block (a confirming row's last committed token)

    @property
    def tentative(self) -> list[int]:
        """Tentative tokens at the front of each row's block (a confirming row's)."""
        return [L - s for L, s in zip(self.seqlens, self.starts)]


class ExactVerifier(SparseVerifier):
    """Sparse verification whose sparse verdicts are tentative until a dense verification confirms them."""

    @staticmethod
    def footprint(config, max_gamma: int, do_sample: bool) -> Footprint:
        # sampling needs p~ to be a function of the prefix: only the first query (x's) scores at selection layers
        sparse = SparseVerifier.footprint(config, max_gamma, do_sample, queries=1 if do_sample else None)
        # tentative tokens past max_new, and a confirming step's wider blocks
        return dataclasses.replace(sparse, extra_slots=config.confirm_tokens + 2 * max_gamma + 2)

    def start(self, run, kept_queries: list) -> None:
        super().start(run, kept_queries)
        greedy = run.rng is None  # greedy rows never verify densely alone: sparse steps stay sparse for the batch
        self.schedule = ConfirmSchedule(
            run.rows.batch_size, self.config.confirm_tokens, self.config.confirm_every, min_limit=int(greedy)
        )

    def positions(self, run) -> ExactStep:
        rows, schedule = run.rows, self.schedule
        seqlens = [n - 1 for n in rows.held]  # committed + tentative (the last not cached)
        short = dense_rows(seqlens, self.config)  # read in full anyway: what they accept is exact, committed at once
        wanted = [not done and schedule.wants(b, rows.tentative[b]) for b, done in enumerate(rows.finished)]
        # greedy: one confirming row makes the step dense for it, and every row holding tentative tokens confirms
        # with it (a greedy row's tokens do not depend on when it confirms). Sampling: each row on its own
        # schedule, since when a row confirms decides which draws it makes
        sampling = run.rng is not None
        confirming = wanted if sampling else [t > 0 and any(wanted) for t in rows.tentative]
        everyone = not sampling and any(confirming)  # a greedy confirming step reads every row densely
        dense = [s or c or everyone or schedule.dense(b) for b, (s, c) in enumerate(zip(short, confirming))]
        starts = [L - n if c else L for L, n, c in zip(seqlens, rows.tentative, confirming)]
        base = device_tensor(seqlens, rows.tokens.device)
        return ExactStep(seqlens, base, not all(short), confirming, dense, starts)

    def reads(self, run, at: ExactStep, drafts: Drafts) -> Selection | None:
        """The sparse rows' read sets; dense rows read everything they hold before the step's first query."""
        selection = None
        if at.sparse and run.rng is not None:
            # p~ must be a function of the prefix alone for p / p~ to confirm its samples exactly: score with the
            # draft's query of x only (the later queries were fed the very drafts p~ is about to judge)
            first = {layer: queries[:1] for layer, queries in drafts.queries.items()}
            selection = self.choose(run, at, first, 1, None)
        elif at.sparse:
            selection = self.choose(run, at, drafts.queries, drafts.gamma, drafts.row_gamma)
        if selection is not None and selection.recovery is not None:
            sparse_rows = [b for b in run.rows.active if not at.dense[b]]
            run.stats.record_knob(selection.counts, selection.recovery, selection.fallback, sparse_rows)
        # what the sparse draft reads next: a confirming row rewrites its positions from its confirmed start, so it
        # keeps the part of this selection below that start and reads everything written from it on
        self.last = None if selection is None else (selection, at.seqlens)
        if selection is not None and any(at.confirming) and self.config.sparse_draft:
            kept_from = [s if c else L for s, L, c in zip(at.starts, at.seqlens, at.confirming)]
            self.last = (truncated(selection, kept_from, at.seqlens, self.config.recent_tokens), kept_from)
        return None if all(at.dense) else with_dense_rows(selection, at.starts, at.dense)

    def verify(self, run, at: ExactStep, drafts: Drafts, reads) -> Verdict:
        """Each row's block ``[x, proposals]`` from its start: a confirming row's x is its last committed token
        (its tentative tokens follow as proposals), any other row's the last token it holds."""
        rows, tentative = run.rows, at.tentative
        # a confirming step's blocks take one width (one forward shape, one CUDA graph): the most tentative tokens
        # a row can hold (it confirms once it holds its limit <= confirm_tokens, after a step that added at most
        # γ+1, so confirm_tokens + γ), then as many of its new drafts as fit. Not confirm_tokens + 2γ: that many
        # queries pack more rows per KV head than the dense kernel reads at full bandwidth, and a row's drafts past
        # the width count only when every tentative token before them is confirmed
        width = self.config.confirm_tokens + self.max_gamma if any(at.confirming) else max(drafts.row_gamma)
        if max(tentative) > width:  # the schedule keeps every limit <= confirm_tokens; a block must hold them all
            raise RuntimeError(
                f"exact mode: a row holds {max(tentative)} tentative tokens, more than a confirming block's "
                f"{width}; this is a bug in dustin_hf"
            )
        gammas = [n + min(g, width - n) for n, g in zip(tentative, drafts.row_gamma)]  # proposals in each block
        inputs = blocks(rows.tokens, at.starts, tentative, drafts.tokens, 1 + width)  # (B, 1 + width): x, proposals
        proposal = inputs[:, 1:]
        run.target.cache.rollback(at.starts)  # a confirming row re-reads its tentative positions densely
        raw, captured = run.target.step(
            inputs, at.starts, keep=1 + width, capture=self.queries_kept, capture_last=False, selection=reads,
            query_counts=[1 + g for g in gammas],
        )  # fmt: skip
        scores = None
        if not run.settings.tokens_only:
            prefixes = [rows.history(b, upto=at.starts[b] + 1) for b in range(rows.batch_size)]
            scores = run.process(raw, lambda b, i: torch.cat([prefixes[b], proposal[b : b + 1, :i]], dim=1))
        run.clock.mark("verify")
        # sampling: min(1, p / proposal) with p~ as the proposal of tentative tokens and q as the drafts'
        probs = None
        if run.rng is not None:
            probs = block_proposals(drafts.probs, self.schedule.proposals, tentative, raw.shape[-1], width)
        return self.judge(run, Drafts(proposal, probs, drafts.queries, gammas), raw, scores, captured,
                          replay=self._replay(run, tentative, at.dense, raw.device))  # fmt: skip

    def _replay(self, run, tentative: list[int], dense: list[bool], device):
        """A replayed exact-mode acceptance (:attr:`DecodeHooks.confirm`), told each block's tentative tokens."""
        confirm = run.settings.hooks.confirm
        if confirm is None:
            return None
        tentative_now, dense_now = device_tensor(tentative, device), device_tensor(dense, device)
        return lambda n: confirm(n, tentative_now, dense_now)

    def queue_drafts(self, run, base: torch.Tensor, n_accepted: torch.Tensor, reads, seqlens: list[int]) -> None:
        """As a sparse step, from what :attr:`last` says the draft reads next (not ``reads``, this step's
        verification's, which holds the dense rows in full). The next step is sparse as this one: a confirming
        row's start is past the budget and min_context (its committed tokens were, for its last sparse step), and
        committed lengths only grow."""
        selection, at = self.last or (None, seqlens)
        super().queue_drafts(run, base, n_accepted, selection, at)

    def commit(self, run, at: ExactStep, verdict: Verdict, reads) -> None:
        """Dense and confirming rows commit what they accepted; a sparse row's accepted tokens turn tentative."""
        rows, dense, tentative = run.rows, at.dense, at.tentative
        rows.write_candidates(verdict.new_tokens, [n if d else h for n, h, d in zip(rows.lens, rows.held, dense)])
        active = rows.active
        run.clock.mark("accept")
        host = HostCopy(torch.cat([verdict.n_accepted[:, None], verdict.new_tokens], dim=1))
        # each row's next draft input is counted from its block's start (a confirming row's last committed token)
        base = device_tensor(at.starts, at.base.device) if any(at.confirming) else at.base
        self.queue_drafts(run, base, verdict.n_accepted, reads, at.seqlens)
        run.clock.mark("draft")
        host = host.tolist()
        accepted = [row[0] for row in host]
        committing = [n + 1 if dense[b] else 0 for b, n in enumerate(accepted)]
        counts = rows.commit(verdict.new_tokens, [row[1:] for row in host], verdict.raw, verdict.scores, committing)
        kept = [
            self._keep(run, b, at, accepted[b], counts[b], host[b], verdict.scores) if b in active else 0
            for b in range(len(host))
        ]
        verified = [g - t for g, t in zip(verdict.block.row_gamma, tentative)]  # new drafts in each block
        run.drafter.update_schedule(
            verified, [min(max(n - t, 0), g) for n, t, g in zip(accepted, tentative, verified)],
            [b for b in active if verified[b]],  # a block with no new drafts tells nothing
        )  # fmt: skip
        run.keep_outputs(active, counts)
        self.settle(run, at.starts, kept, verdict.captured)
        if any(at.confirming):
            self.schedule.stats.confirm_steps += 1
        run.clock.mark("commit")
        attended = self.attended(reads, at.starts, active)
        run.stats.record_step(
            verdict.block.row_gamma, accepted, counts, active, sparse=reads is not None, attended=attended,
            seqlens=at.starts,
        )  # fmt: skip

    def _keep(self, run, b: int, at: ExactStep, accepted: int, count: int, host_row: list, scores) -> int:
        """Row ``b``'s schedule after the step, and how many inputs of its block keep their K/V cached: x and the
        proposals before the next token."""
        rows, schedule = run.rows, self.schedule
        if at.dense[b]:
            if at.confirming[b]:
                schedule.after_confirm(b, at.tentative[b], min(accepted, at.tentative[b]), count)
            else:
                schedule.after_dense(b)
            rows.tentative[b] = 0
            return count
        if run.rng is not None:  # p~ of each new tentative token: the sparse target's at its position
            schedule.proposals[b].extend(scores[b, : accepted + 1].softmax(dim=-1))
        rows.tentative[b] += accepted + 1
        schedule.after_sparse(b, schedule.must[b] or rows.would_stop(b, host_row[1 : accepted + 2]))
        return accepted + 1

    def report(self, run) -> dict:
        return {"exact": self.schedule.stats.as_dict(), **super().report(run)}
