"""Dense verification, and the protocol every verifier follows: steps 3 to 5 of the loop (:mod:`.run`).

A verifier (the :class:`Verifier` protocol) owns what a mode decides: where each row's block starts
(:meth:`~Verifier.positions`), what the verification reads (:meth:`~Verifier.reads`), how the target's
distributions judge the block (:meth:`~Verifier.verify`) and what a row keeps (:meth:`~Verifier.commit`). The dense
verifier reads every cached position: with it the loop is stock assisted decoding, batched. :mod:`.sparse` reads a
selection instead, :mod:`.exact` adds tentative tokens and dense confirmation; each is written as its difference
from the one before.

Acceptance (step 4, :mod:`.sampling`): greedy keeps d_i while d_i = argmax p_i; sampling keeps d_i with probability
min(1, p_i(d_i) / q_i(d_i)). Then one token of the target's own: greedy argmax p_{n+1}; sampling, after a rejection
at n+1, a draw from norm(max(0, p_{n+1} - q_{n+1})), after all γ kept a draw from p_{γ+1}. Commit (step 5): rows
advance by k = n+1 (or less when cut at EOS / length / a stopping criterion); both caches roll back the rest (the
target keeps x, d_1..d_n; the draft lags by one token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..runtime.plan import HostCopy, SelectLayers, device_tensor
from .drafter import Drafts
from .sampling import accept_greedy, accept_sampled

__all__ = ["DenseVerifier", "Footprint", "Step", "Verdict", "Verifier"]


@dataclass(frozen=True)
class Footprint:
    """What a mode asks of the caches and runners of a call (:mod:`.workspace`)."""

    extra_slots: int = 0  # slots a row may hold past its prompt, max_new and a step's γ + 2
    read_width: int = 0  # a sparse verification's read set (the target's one graphed sparse width)
    draft_width: int = 0  # a sparse draft forward's read set
    select: SelectLayers | None = None  # the selection layers of a sparse forward
    dense_layers: tuple[int, ...] = ()  # target layers that read everything on a sparse step too
    keeps_workspace: bool = True  # a call may leave its caches and graphs to the next


@dataclass(frozen=True)
class Step:
    """Where the rows stand when a step starts."""

    seqlens: list[int]  # L_b: target-cached positions before the block (its first input, x, is not cached)
    base: torch.Tensor  # the same on the device
    sparse: bool  # the step reads a selection for some row


@dataclass(frozen=True)
class Verdict:
    """Steps 3 and 4: what the target said of each row's block."""

    block: Drafts  # the proposals judged (the drafts; exact mode: tentative tokens, then drafts)
    raw: torch.Tensor  # (B, W+1, V) raw logits, or (B, W+1) argmax tokens when only tokens are needed
    scores: torch.Tensor | None  # processed scores (None with tokens only)
    captured: dict  # the target queries the forward kept ({layer: (B, W+1, heads, D)})
    n_accepted: torch.Tensor  # (B,) leading proposals kept
    new_tokens: torch.Tensor  # (B, W+1): the kept proposals, the target's own token, then garbage


class Verifier(Protocol):
    """What the loop asks of a mode: made per call as ``Mode(config, calibrate, max_gamma, window_slots)``."""

    queries_kept: dict  # the target's queries a verification keeps ({layer: heads})

    @staticmethod
    def footprint(config, max_gamma: int, do_sample: bool) -> Footprint: ...  # what the workspace must hold
    def attended(self, reads, seqlens: list[int], active: list[int]) -> list[tuple[float, bool]] | None:
        """Per active row of a step that read a selection: positions read per layer, and whether it read less than
        it holds (``None``: the step read everything)."""
        return None

    def prefill_plan(self, run) -> tuple[int | None, dict]: ...  # the prefill's chunk and kept target queries
    def start(self, run, kept_queries: list) -> None: ...  # after prefill
    def positions(self, run) -> Step: ...  # where the rows stand at a step's start
    def draft_capture(self, sparse: bool) -> dict: ...  # the draft queries a step keeps
    def draft_reads(self, run, sparse: bool): ...  # what a draft forward reads (None: everything)
    def reads(self, run, at: Step, drafts: Drafts): ...  # step 2: the verification's read set (None: everything)
    def verify(self, run, at: Step, drafts: Drafts, reads) -> Verdict: ...  # steps 3 and 4
    def commit(self, run, at: Step, verdict: Verdict, reads) -> None: ...  # step 5
    def graph_report(self) -> dict: ...  # the read-set choice's CUDA graphs
    def report(self, run) -> dict: ...  # what the mode adds to stats


class DenseVerifier:
    """The target reads every cached position. Made per call; holds nothing between steps."""

    queries_kept = {}  # the target's queries a verification keeps ({layer: heads})

    def __init__(self, config=None, calibrate=None, max_gamma: int = 0, window_slots=None):
        pass  # the other modes' arguments: a dense verification needs none of them

    @staticmethod
    def footprint(config, max_gamma: int, do_sample: bool) -> Footprint:
        return Footprint()

    def start(self, run, kept_queries: list) -> None:
        """After prefill (``kept_queries``: per row, the prefill's kept last queries)."""

    def positions(self, run) -> Step:
        seqlens = [n - 1 for n in run.rows.lens]  # the last committed token is not cached
        return Step(seqlens, device_tensor(seqlens, run.rows.tokens.device), sparse=False)

    def draft_capture(self, sparse: bool) -> dict:
        """The draft's queries a step keeps for scoring (``{layer: heads}``)."""
        return {}

    def draft_reads(self, run, sparse: bool):
        """What a draft forward reads when it was not queued ahead (``None``: everything)."""
        return None

    def reads(self, run, at: Step, drafts: Drafts):
        """Step 2: the read set of the verification (``None``: every cached position)."""
        return None

    def verify(self, run, at: Step, drafts: Drafts, reads) -> Verdict:
        """Steps 3 and 4: the target over ``[x, d_1..d_γ]`` at positions ``L..L+γ``; the drafts it keeps."""
        block = torch.cat([run.rows.tokens.gather(1, at.base[:, None]), drafts.tokens], dim=1)  # (B, γ+1)
        raw, captured = run.target.step(
            block, at.seqlens, keep=drafts.gamma + 1, capture=self.queries_kept, capture_last=False,
            selection=reads, query_counts=[g + 1 for g in drafts.row_gamma],
        )  # fmt: skip
        tokens = drafts.tokens.unbind(1)
        scores = None if run.settings.tokens_only else run.process(raw, lambda b, i: run.rows.history(b, tokens[:i]))
        run.clock.mark("verify")
        return self.judge(run, drafts, raw, scores, captured)

    def judge(self, run, block: Drafts, raw, scores, captured, replay=None) -> Verdict:
        """Step 4: ``n_accepted`` leading proposals kept per row and the target's own token after them
        (:func:`~dustin_hf.decode.sampling.accept_greedy` / :func:`~dustin_hf.decode.sampling.accept_sampled`);
        a replayed acceptance (``replay``, else :attr:`DecodeHooks.accept`) replaces the counts."""
        replay = replay or run.settings.hooks.accept
        target_tokens = raw if run.settings.tokens_only else None  # (B, γ+1), the target's argmax
        if target_tokens is None and (run.rng is None or replay is not None):
            target_tokens = scores.argmax(dim=-1)
        if run.rng is not None:
            unfinished = [not done for done in run.rows.finished]
            n_accepted, next_token = accept_sampled(
                block.tokens, block.probs, scores, run.rng, block.row_gamma, rows=unfinished
            )
        else:
            n_accepted, next_token = accept_greedy(block.tokens, target_tokens, block.row_gamma)
        if replay is not None:
            n_accepted = replay(n_accepted).clamp(0, block.gamma).to(n_accepted.device)
            if any(g != block.gamma for g in block.row_gamma):
                n_accepted = torch.minimum(n_accepted, device_tensor(block.row_gamma, n_accepted.device))
            next_token = target_tokens.gather(1, n_accepted[:, None]).squeeze(1)
        new_tokens = torch.cat([block.tokens, torch.zeros_like(block.tokens[:, :1])], dim=1)
        new_tokens.scatter_(1, n_accepted[:, None], next_token[:, None])  # kept proposals, next, garbage
        return Verdict(block, raw, scores, captured, n_accepted, new_tokens)

    def commit(self, run, at: Step, verdict: Verdict, reads) -> None:
        """Step 5: every row commits ``k = n + 1`` tokens (fewer where it stops); both caches roll back to match."""
        rows = run.rows
        rows.write_candidates(verdict.new_tokens)
        active = rows.active
        run.clock.mark("accept")
        host = HostCopy(torch.cat([verdict.n_accepted[:, None], verdict.new_tokens], dim=1))  # before the drafts
        self.queue_drafts(run, at.base, verdict.n_accepted, reads, at.seqlens)
        run.clock.mark("draft")
        host = host.tolist()  # the step's one device->host sync: it waits for the copy, not for those drafts
        accepted = [row[0] for row in host]
        counts = rows.commit(
            verdict.new_tokens, [row[1:] for row in host], verdict.raw, verdict.scores, [n + 1 for n in accepted]
        )
        run.drafter.update_schedule(verdict.block.row_gamma, accepted, active)
        run.keep_outputs(active, counts)
        self.settle(run, at.seqlens, counts, verdict.captured)  # keep x, d_1..d_{k-1}
        run.clock.mark("commit")
        run.stats.record_step(
            verdict.block.row_gamma, accepted, counts, active, sparse=reads is not None,
            attended=self.attended(reads, at.seqlens, active), seqlens=at.seqlens,
        )  # fmt: skip

    def queue_drafts(self, run, base: torch.Tensor, n_accepted: torch.Tensor, reads, seqlens: list[int]) -> None:
        """Queue the next step's first draft forwards (:meth:`Drafter.queue`): a dense step's next step is dense."""
        run.drafter.queue(run, base, n_accepted, sparse=False, capture={}, reads=None)

    def settle(self, run, starts: list[int], kept: list[int], captured: dict) -> None:
        """The target keeps the first ``kept[b]`` inputs of each row's block (from ``starts[b]``), the draft one
        position fewer, plus the slots the next step's queued draft forwards wrote."""
        target, draft, batch = run.target, run.draft, len(starts)
        target.cache.rollback([s + k for s, k in zip(starts, kept)])
        draft.cache.rollback([s + k - 1 for s, k in zip(starts, kept)])  # the draft lags by one token
        if run.drafter.ahead is not None:  # the queued forwards wrote the next 2, 3, ... slots of every row
            queued = len(run.drafter.ahead.outputs)
            draft.cache.advance(slice(0, batch), [queued + 1] * batch)
            run.stats.draft_forwards_ahead += queued
            run.stats.steps_drafted_ahead += 1

    def attended(self, reads, seqlens: list[int], active: list[int]) -> list[tuple[float, bool]] | None:
        """Per active row of a step that read a selection: positions read per layer, and whether it read less than
        it holds (``None``: the step read everything)."""
        return None

    def prefill_plan(self, run) -> tuple[int | None, dict]:
        """The prefill's chunk (``None``: from free memory) and the target queries it keeps (``{layer: heads}``)."""
        return None, {}

    def graph_report(self) -> dict:
        """The read-set choice's CUDA graphs (``stats["cuda_graphs"]["select"]``)."""
        return {"captured": 0, "failed": []}

    def report(self, run) -> dict:
        """What the mode adds to ``stats``."""
        return {}
