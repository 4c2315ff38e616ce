"""One ``generate()`` call of the decode loop: its state, and the step that drafts, verifies and commits.

:class:`~dustin_hf.decode.decoder.SpeculativeDecoder` holds what it was set up with and makes a :class:`DecodeRun` per
call: the rows, the runners and caches of the call, its stats, schedules, last selection and queued drafts. The
run prefills, then calls its step until every row is done.

State at the start of every step, for row b with ``L = L_b`` target-cached positions:

    tokens[b, :L+1]   committed tokens (prompt + generated); the last one, x = tokens[b, L], is in no cache yet
    target cache      positions [0, L)
    draft cache       positions [0, L-1)

One step (:meth:`DecodeRun.step`; exact mode's in :mod:`dustin_hf.decode.exact_step`):

  1. draft: feed tokens[b, L-1:L+1] (2 tokens, so that every row feeds the same count), then γ-1 single
     tokens, drawing d_1..d_γ from the draft's distributions q_1..q_γ;
  2. select (Dustin only): score positions from the kept queries, fill the budget per row
     (:mod:`dustin_hf.selection.selector`);
  3. verify: the target reads [x, d_1..d_γ] at positions L..L+γ against the selection (or everything),
     giving its distributions p_1..p_{γ+1} (p_i predicts the token after the i-th input);
  4. accept per row (:mod:`sampling`): greedy keeps d_i while d_i = argmax p_i; sampling keeps d_i with
     probability min(1, p_i(d_i) / q_i(d_i)). Then one token of the target's own: greedy argmax p_{n+1};
     sampling, after a rejection at n+1, a draw from norm(max(0, p_{n+1} - q_{n+1})), after all γ kept a draw
     from p_{γ+1}. With a budget covering the context p is the dense target's, so the output is exactly
     greedy decoding (greedy) or exactly distributed as the target (sampling);
  5. commit: rows advance by k = n+1 (or less when cut at EOS / length / a stopping criterion); both caches
     roll back the rest (the target keeps x, d_1..d_n; the draft lags by one token).

Performance notes, so the steps above stay fast on a GPU: every forward after prefill has a fixed shape and is
replayed from a CUDA graph (:mod:`dustin_hf.runtime.graphs`); a greedy step at a constant γ makes one
device->host copy (accepted counts and tokens), queued before the next step's first draft forwards, so the GPU
drafts while the host does its bookkeeping (:meth:`DecodeRun.queue_drafts`). A confidence threshold reads each
draft forward's confidences and the quality knob its counts: each one more wait for the device (exact mode too,
where a confirming row holds more than ``recent_tokens`` tentative tokens and the sparse draft reads).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compat import attention_scale, common_window, group_size, model_device
from ..config import ResolvedConfig
from ..runtime.launch import prefer_cublaslt
from ..runtime.plan import HostCopy, device_tensor, select_heads
from ..selection.draft_reads import DraftReads
from ..selection.fill import Selection, dense_rows
from ..selection.selector import Selector
from .cache import DustinCache
from .exact import ConfirmSchedule
from .hooks import PhaseClock, synchronize
from .masks import Prompt
from .outputs import OutputRecorder
from .processors import LogitsPipeline
from .rows import Rows
from .runner import ModelRunner
from .sampling import RowGenerators, accept_greedy, accept_sampled, pick_tokens
from .stats import RunStats
from .workspace import Workspace

logger = logging.getLogger(__name__)
_LOGGED: set = set()  # what was logged once per process

__all__ = ["DecodeResult", "DecodeRun", "Drafts"]


@dataclass
class DecodeResult:
    sequences: torch.Tensor  # (B, prompt_len + max generated), the input layout + generated tokens
    scores: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) processed target scores
    logits: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) raw target logits
    attentions: tuple | None  # per generated index, per layer: stock's layout (see dustin_hf.decode.outputs)
    hidden_states: tuple | None
    stats: RunStats  # what the run did (also ``cache.stats``, as a dict)
    cache: DustinCache  # the target's cache (a workspace's: the next run of that workspace empties it)
    draft_cache: DustinCache
    generated: list[int]  # tokens each row generated
    draft_tokens: list[int] | None = None  # each row's draft length after the run (the draft schedule's state)


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
    """A step's first draft forwards, queued by the step before (:meth:`DecodeRun.queue_drafts`)."""

    outputs: tuple[tuple[torch.Tensor, dict], ...]  # per forward: logits (B, 1, Vd) float32 (or, from a
    # tokens_only runner, tokens (B, 1)) and the kept scoring queries
    sparse: bool  # the step it was queued for was expected to be sparse
    reads: DraftReads | None  # what it read (sparse draft); the step's later forwards read the same


class DecodeRun:
    """One call's state: rows, runners and caches, stats, draft schedules, exact mode's confirm schedule, the last
    selection and the next step's queued draft forwards. Made per call, dropped after it.

    Args:
        decoder: the :class:`~dustin_hf.decode.decoder.SpeculativeDecoder` whose settings the run reads (never writes).
        workspace: the caches and runners of this run (:mod:`dustin_hf.decode.workspace`).
        prompts: each row's prompt (:func:`~dustin_hf.decode.masks.prompts_from_mask`); ``padded_len`` their input width.
        max_new: tokens each row may generate.
        window_slots: what sliding windows count where rows have holes (``None``: the slots themselves).
    """

    def __init__(
        self,
        decoder,
        workspace: Workspace,
        prompts: list[Prompt],
        padded_len: int,
        max_new: int,
        window_slots: torch.Tensor | None,
    ):
        gen, drafting = decoder.generation, decoder.drafting
        self.gen, self.hooks, self.calibrate = gen, decoder.hooks, decoder.calibrate
        self.dustin_config: ResolvedConfig | None = (
            decoder.dustin_config
        )  # prompt calibration replaces it for this run
        self.backend, self.kernel_tuning = decoder.backend, decoder.runtime.tuning.kernels
        self.do_sample, self.tokens_only = gen.do_sample, decoder.tokens_only
        self.gamma, self.threshold = drafting.num_draft_tokens, drafting.confidence_threshold
        self.schedule, self.max_gamma = drafting.schedule, drafting.max_gamma
        self.sparse_draft = self.dustin_config is not None and self.dustin_config.sparse_draft
        self.workspace, self.target, self.draft = workspace, workspace.target, workspace.draft
        self.window_slots = window_slots
        t_cfg = self.target.model.config.get_text_config()
        d_cfg = self.draft.model.config.get_text_config()
        self.device = device = model_device(self.target.model)
        batch = len(prompts)

        self.target.record = (gen.output_attentions, gen.output_hidden_states)
        self.recorder = (
            OutputRecorder([p.slots for p in prompts], padded_len, gen.output_attentions, gen.output_hidden_states)
            if gen.recording
            else None
        )
        self.stats = self.target.cache.run_stats = RunStats()
        self.rows = Rows(
            prompts,
            self.target.cache.capacity + 1,
            gen.pad,
            device,
            max_new,
            gen.eos,
            list(gen.row_criteria),
            gen.streamer,
            gen.output_scores,
            gen.output_logits,
        )
        self.process = LogitsPipeline(
            gen.logits_processor, [p.pad for p in prompts], min_length_from_new=gen.min_length_from_new
        )
        self.rng = RowGenerators(batch, device) if self.do_sample else None
        self.row_gamma = [self.gamma] * batch  # each row's draft length for its next step (the schedule's state)
        cfg = self.dustin_config
        self.confirm = (
            ConfirmSchedule(batch, cfg.confirm_tokens, cfg.confirm_every, min_limit=0 if self.do_sample else 1)
            if cfg is not None and cfg.mode == "exact"
            else None
        )
        self.selector: Selector | None = None  # made after prefill (prompt calibration may change the heads)
        self.last_selection = None  # (selection, seqlens) of the last sparse step, for the sparse draft
        self.ahead: QueuedDraft | None = None  # the next step's first draft forwards, already queued
        self.target_layers = t_cfg.num_hidden_layers
        self.draft_vocab = d_cfg.vocab_size  # a draft may pad its embedding less than the target (same tokenizer)
        self.target_vocab = t_cfg.vocab_size
        self.clock = PhaseClock(device, decoder.profile)

    # ------------------------------------------------------------------------------------------ the call
    def decode(
        self, input_ids: torch.Tensor, prompts: list[Prompt], step: Callable[[DecodeRun], None]
    ) -> DecodeResult:
        """Prefill, then ``step(self)`` until every row is done (or ``max_time`` is up); the call's result."""
        started = time.perf_counter()
        self.prefill(prompts)
        if self.dustin_config is not None:
            self.selector = self._selector()
        with prefer_cublaslt(self.device):  # the decode steps' GEMMs; the prompt's run faster on PyTorch's default
            synchronize(self.device)
            decoding = time.perf_counter()
            self.clock.restart()
            step_ends, step_tokens = [], []
            rows, max_time = self.rows, self.gen.max_time
            while not all(rows.finished):
                before = sum(rows.generated)
                step(self)
                step_ends.append(time.perf_counter())
                step_tokens.append(sum(rows.generated) - before)
                if max_time is not None and max_time(rows.tokens, None).all():
                    break
            if self.gen.streamer is not None:
                self.gen.streamer.end()
            return self._result(input_ids, started, decoding, step_ends, step_tokens)

    def _selector(self) -> Selector:
        """The workspace's selector when it was made for this run's settings, else a new one kept there."""
        selector = self.workspace.selector
        if selector is None or selector.config != self.dustin_config:  # prompt calibration may have changed the heads
            target, draft = self.target.model, self.draft.model
            t_cfg, d_cfg = target.config.get_text_config(), draft.config.get_text_config()
            selector = self.workspace.selector = Selector(
                self.dustin_config,
                self.backend,
                group_size(t_cfg),
                group_size(d_cfg),
                attention_scale(target, t_cfg),
                attention_scale(draft, d_cfg),
                graphs=self.workspace.shape.graphs[0],
                window=common_window(target),
                tuning=self.kernel_tuning,
            )
        selector.budgets, selector.window_slots = self.hooks.budgets, self.window_slots
        return selector

    def _result(
        self, input_ids: torch.Tensor, started: float, decoding: float, step_ends: list[float], step_tokens: list[int]
    ) -> DecodeResult:
        rows, stats, target, draft = self.rows, self.stats, self.target, self.draft
        stats.prefill_seconds = decoding - started
        stats.decode_seconds = (step_ends[-1] if step_ends else decoding) - decoding
        stats.generated_tokens = sum(rows.generated)
        stats.step_end_times, stats.step_tokens = [t - decoding for t in step_ends], step_tokens
        stats.reports["cuda_graphs"] = {
            "target": target.graph_report,
            "draft": draft.graph_report,
            "select": self.selector.graph_report if self.dustin_config is not None else {"captured": 0, "failed": []},
        }
        if self.clock.mode:
            stats.reports.update(phase_seconds=self.clock.steps, phase_host_seconds=self.clock.host_steps)
        if self.confirm is not None:
            stats.reports["exact"] = self.confirm.stats.as_dict()
        if self.dustin_config is not None:
            stats.reports["dense_rows"] = self._dense_rows()
        attentions, hidden = self.recorder.tuples(rows.generated) if self.recorder is not None else (None, None)
        return DecodeResult(
            rows.sequences(input_ids),
            rows.per_position(rows.scores),
            rows.per_position(rows.raw),
            attentions,
            hidden,
            stats,
            target.cache,
            draft.cache,
            list(rows.generated),
            draft_tokens=list(self.row_gamma),
        )

    def _dense_rows(self) -> dict:
        """Rows that never verified sparsely, by reason: the most positions they held at a verification within the
        budget, or past it but below ``min_context`` (a row past both that read everything at every step is the
        knob's, counted in its ``dense_fallbacks``). A call in which no row verified sparsely says so at INFO level
        (the ``dustin_hf`` logger), once per process and (budget, min_context)."""
        cfg, stats = self.dustin_config, self.stats
        dense = [n for b, n in enumerate(stats.held) if b not in stats.sparse_rows]
        counts = {
            "within_budget": sum(n <= cfg.budget for n in dense),
            "below_min_context": sum(cfg.budget < n < cfg.min_context for n in dense),
        }
        if stats.sparse_steps == 0 and stats.held and ("dense call", cfg.budget, cfg.min_context) not in _LOGGED:
            _LOGGED.add(("dense call", cfg.budget, cfg.min_context))
            logger.info(
                "every step of this call verified densely: its rows held at most %d cached positions at a "
                "verification, and a row verifies sparsely only past budget=%d and min_context=%d "
                "(cache_config changes both)",
                max(stats.held),
                cfg.budget,
                cfg.min_context,
            )
        return counts

    def prefill(self, prompts: list[Prompt]) -> None:
        """The target reads each prompt (keeping its last query on the scoring heads as the first history) and
        names the first new token; the draft reads all but the last prompt token. With ``calibration="prompt"``
        the scoring heads are searched on the prompts in between (by the search the decoder was handed,
        ``calibrate``). A row whose last input slot was masked takes its first token from that slot's query
        instead (:meth:`~dustin_hf.decode.runner.ModelRunner.hidden_query`)."""
        target, draft = self.target, self.draft
        prefill = self.hooks.prefill or ModelRunner.prefill
        chunk = self.dustin_config.prefill_chunk if self.dustin_config is not None else None  # None: from free memory
        rows, prompt_lens = self.rows, [p.length for p in prompts]
        calibrate = self.dustin_config is not None and self.dustin_config.calibration == "prompt"
        if calibrate:  # the target layer is chosen after prefill: keep every layer's last query
            t_cfg = target.model.config.get_text_config()
            t_capture = {layer: tuple(range(t_cfg.num_attention_heads)) for layer in range(t_cfg.num_hidden_layers)}
        else:
            t_capture = self.history_capture
        last_logits, kept = prefill(target, [p.tokens for p in prompts], chunk, t_capture)
        if self.recorder is not None:
            for b, (hidden, attentions) in enumerate(target.prompt_outputs):
                self.recorder.keep_prompt(b, hidden, attentions)
        for b, p in enumerate(prompts):
            if p.last is not None:  # stock: the masked slot's token at its own position, seeing the real tokens only
                last_logits[b] = target.hidden_query(b, p.last, position=p.last_position)
                if self.recorder is not None:
                    self.recorder.keep_last_slot(b, *target.last_outputs)
        first_raw = torch.stack(last_logits)[:, None]  # (B, 1, V)
        first_scores = self.process(first_raw, lambda b, i: rows.history(b))
        first = pick_tokens(first_scores[:, 0], self.rng)
        rows.write_candidates(first[:, None])
        rows.commit(first[:, None], first[:, None].tolist(), first_raw, first_scores, [1] * len(prompts))
        # ids the draft cannot embed (a draft whose embedding is smaller than the shared tokenizer) reach it as its
        # last id, as every later token does (draft_feed): its proposals there are poor, the output is the same
        prefill(draft, [p.tokens[:-1].clamp_max(self.draft_vocab - 1) for p in prompts], chunk, {})
        if calibrate:
            self.dustin_config, report = self.calibrate(
                target, draft, rows.tokens, self.dustin_config, self.gamma, prompt_lens
            )
            self.stats.reports["calibration"] = report
        if self.dustin_config is not None:
            layer, heads = self.dustin_config.target_layer, self.dustin_config.target_heads
            history = torch.cat([k[layer][:, 0] for k in kept])  # (B, kept heads, D)
            if calibrate:
                history = select_heads(history, heads, dim=1)
            target.cache.set_history(history, [n - 1 for n in prompt_lens])

    # ------------------------------------------------------------------------------------------ a step
    def step(self) -> None:
        """One draft -> select -> verify -> accept -> commit round for every row."""
        rows, target, draft = self.rows, self.target, self.draft
        seqlens = [n - 1 for n in rows.lens]  # L_b: target-cached positions (the last token is not cached)
        base = device_tensor(seqlens, rows.tokens.device)
        sparse = self.dustin_config is not None and not all(dense_rows(seqlens, self.dustin_config))

        # 1. Draft d_1..d_γ per row (the first forwards may have been queued by the last step).
        drafts = self.draft_tokens(seqlens, base, sparse)
        self.clock.mark("draft")

        # 2. Select what verification reads (Dustin, once some row is long enough).
        selection = (
            self.selector.select(target, draft, seqlens, base, drafts.queries, drafts.gamma, drafts.row_gamma)
            if sparse
            else None
        )
        self.last_selection = None if selection is None else (selection, seqlens)
        if selection is not None and selection.recovery is not None:
            self.stats.record_knob(selection.counts, selection.recovery, selection.fallback, rows.active)
        self.clock.mark("score_select")

        # 3. Verify [x, d_1..d_γ] at positions L..L+γ against the selection (or everything): p_1..p_{γ+1}.
        raw, scores, captured = self.verify(drafts, seqlens, base, selection)
        self.clock.mark("verify")

        # 4. Accept n drafts per row and pick the target's own token after them.
        n_accepted, next_token = self.accept(drafts, raw, scores)
        new_tokens = torch.cat([drafts.tokens, torch.zeros_like(drafts.tokens[:, :1])], dim=1)
        new_tokens.scatter_(1, n_accepted[:, None], next_token[:, None])  # (B, γ+1): d_1..d_n, next, garbage
        rows.write_candidates(new_tokens)
        active = rows.active
        self.clock.mark("accept")

        # 5. Commit k = n + 1 tokens per row (fewer where a row stops), roll both caches back to match.
        host = HostCopy(torch.cat([n_accepted[:, None], new_tokens], dim=1))  # queued before the next drafts
        self.ahead = self.queue_drafts(base, n_accepted, selection, seqlens)
        self.clock.mark("draft")
        host = host.tolist()  # the step's one device->host sync: it waits for the copy, not for those drafts
        accepted = [row[0] for row in host]
        counts = rows.commit(new_tokens, [row[1:] for row in host], raw, scores, [n + 1 for n in accepted])
        self.update_schedule(drafts.row_gamma, accepted, active)
        if self.recorder is not None:  # the verification queries that predicted the kept tokens
            hidden, attentions = target.last_outputs
            for b in active:
                self.recorder.keep_step(b, counts[b], hidden, attentions)
        self.settle(seqlens, counts, captured)  # keep x, d_1..d_{k-1}
        self.clock.mark("commit")

        self.stats.record_step(
            drafts.row_gamma,
            accepted,
            counts,
            active,
            sparse=selection is not None,
            attended=None if selection is None else self.attended(selection, seqlens, active),
            seqlens=seqlens,
        )
        self.clock.mark("bookkeeping")
        self.clock.end_step()

    def settle(self, starts: list[int], kept: list[int], captured) -> None:
        """After a step: the target keeps the first ``kept[b]`` inputs of each row's block (from ``starts[b]``), the
        draft one position fewer, plus the slots the next step's queued draft forwards wrote; the last kept
        input's query on the scoring heads becomes the next step's target history."""
        target, draft = self.target, self.draft
        batch = len(starts)
        target.cache.rollback([s + k for s, k in zip(starts, kept)])
        draft.cache.rollback([s + k - 1 for s, k in zip(starts, kept)])  # the draft lags by one token
        if self.ahead is not None:  # the queued forwards wrote the next 2, 3, ... slots of every row
            queued = len(self.ahead.outputs)
            draft.cache.advance(slice(0, batch), [queued + 1] * batch)
            self.stats.draft_forwards_ahead += queued
            self.stats.steps_drafted_ahead += 1
        if self.dustin_config is not None:
            queries = captured[self.dustin_config.target_layer]  # (B, Q, heads, D)
            picked = device_tensor([max(k - 1, 0) for k in kept], queries.device)
            history = queries[torch.arange(batch, device=queries.device), picked]
            target.cache.set_history(history, [s + k - 1 for s, k in zip(starts, kept)])

    def draft_tokens(self, seqlens: list[int], base: torch.Tensor, sparse: bool) -> Drafts:
        """Step 1: up to γ draft forwards. The first feeds [tokens[L-1], tokens[L]] so that every row feeds two;
        the draft cache holds L-1 positions, then L+1, L+2, ... after each forward. With ``sparse_draft`` the draft
        reads the last selection plus the positions written since (:class:`~dustin_hf.selection.draft_reads.DraftReads`).

        Each row drafts its own count: its schedule's length, cut after a draft below the confidence threshold.
        The forwards run while some unfinished row is still drafting; a row's drafts past its own count are
        computed with the others' but never verified, scored or accepted, so the row's tokens depend on its own
        prompt only."""
        draft = self.draft
        rows = self.rows
        planned = [0 if done else g for g, done in zip(self.row_gamma, rows.finished)]
        d_capture = self.draft_capture(sparse)
        ahead, self.ahead = self.ahead, None  # the first forwards, queued by the last step before its sync
        assert ahead is None or ahead.sparse == sparse  # committed lengths only grow: sparse steps stay sparse
        if ahead is not None:
            queued, reads, feed = ahead.outputs, ahead.reads, None
        else:
            queued = ()
            reads = (
                DraftReads.after(self.last_selection, self.dustin_config, self.max_gamma, draft.cache.capacity)
                if sparse and self.sparse_draft
                else None
            )
            feed = self.draft_feed(base - 1)
        device = rows.tokens.device
        tokens, probs, kept_queries = [], [], {layer: [] for layer in d_capture}
        drafted = [0] * rows.batch_size
        drafting = [g > 0 for g in planned]
        for i in range(max(planned)):
            at = [n - 1 + i + (1 if i else 0) for n in seqlens]
            if i < len(queued):
                raw, captured = queued[i]
            else:
                raw, captured = draft.step(
                    feed,
                    at,
                    keep=1,
                    capture=d_capture,
                    capture_last=True,
                    selection=None if reads is None else reads.at(at),
                )  # (B, 1, Vd)
            if self.tokens_only:
                token = raw[:, 0].to(device)
            else:
                if raw.shape[-1] < self.target_vocab:  # processors are built for the target's vocabulary
                    raw = torch.nn.functional.pad(raw, (0, self.target_vocab - raw.shape[-1]), value=float("-inf"))
                scores = self.process(raw, lambda b, _, i=i: rows.history(b, tokens[:i]))
                token = pick_tokens(scores[:, 0], self.rng, drafting).to(device)
            tokens.append(token)
            if self.do_sample or self.threshold is not None:
                probs.append(scores[:, 0].softmax(dim=-1))  # q_i
            for layer, q in captured.items():
                kept_queries[layer].append(q[:, 0])  # (B, heads, D)
            feed = token[:, None]
            confident = None
            if self.threshold is not None and i + 1 < max(planned):  # q_i(d_i) of each row's own draft
                # (transformers' ConfidenceCriteria); after the last planned draft there is nothing to stop
                confident = (probs[-1].gather(1, token[:, None]).squeeze(1) >= self.threshold).tolist()
            for b in range(rows.batch_size):
                if drafting[b]:
                    drafted[b] += 1
                    drafting[b] = drafted[b] < planned[b] and (confident is None or confident[b])
            if not any(drafting):
                break
        if reads is not None:
            self.stats.draft_sparse_forwards += len(tokens)
        gamma = len(tokens)
        row_gamma = [n if not done else gamma for n, done in zip(drafted, rows.finished)]
        return Drafts(
            torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, kept_queries, row_gamma=row_gamma
        )

    def update_schedule(self, row_gamma: list[int], accepted: list[int], active: list[int]) -> None:
        """transformers' ``num_assistant_tokens_schedule``, each row on its own: a row that kept all the drafts it
        proposed drafts 2 more next step, any other 1 fewer (at least 1)."""
        if self.schedule == "constant":
            return
        for b in active:
            grew = accepted[b] >= row_gamma[b]
            self.row_gamma[b] = min(self.max_gamma, self.row_gamma[b] + 2) if grew else max(1, self.row_gamma[b] - 1)

    def verify(self, drafts: Drafts, seqlens: list[int], base: torch.Tensor, selection: Selection | None):
        """Step 3: the target over [x, d_1..d_γ]; returns raw logits ``(B, γ+1, V)`` (or their argmax ``(B, γ+1)``
        when only tokens are needed), processed scores (``None`` then) and the kept history queries."""
        target = self.target
        verify_in = torch.cat([self.rows.tokens.gather(1, base[:, None]), drafts.tokens], dim=1)  # (B, γ+1)
        raw, captured = target.step(
            verify_in,
            seqlens,
            keep=drafts.gamma + 1,
            capture=self.history_capture,
            capture_last=False,
            selection=selection,
            query_counts=[g + 1 for g in drafts.row_gamma],
        )
        tokens = drafts.tokens.unbind(1)
        scores = None if self.tokens_only else self.process(raw, lambda b, i: self.rows.history(b, tokens[:i]))
        return raw, scores, captured

    def accept(
        self,
        drafts: Drafts,
        raw: torch.Tensor,
        scores: torch.Tensor | None,
        tentative: list[int] | None = None,
        dense: list[bool] | None = None,
    ):
        """Step 4: ``n_accepted (B,)`` leading drafts kept and the target's ``next_token (B,)`` after them
        (:func:`~dustin_hf.decode.sampling.accept_greedy` / :func:`~dustin_hf.decode.sampling.accept_sampled`); a replayed
        acceptance (:attr:`DecodeHooks.accept`; in exact mode :attr:`DecodeHooks.confirm`, told how many of each
        block's proposals are tentative tokens) replaces the counts, the target's own token follows them."""
        replay = self.hooks.accept
        if tentative is not None and self.hooks.confirm is not None:
            confirm = self.hooks.confirm
            tentative_now, dense_now = device_tensor(tentative, raw.device), device_tensor(dense, raw.device)
            replay = lambda n: confirm(n, tentative_now, dense_now)  # noqa: E731
        target_tokens = raw if self.tokens_only else None  # (B, γ+1), the target's argmax
        if target_tokens is None and (not self.do_sample or replay is not None):
            target_tokens = scores.argmax(dim=-1)
        if self.do_sample:
            n_accepted, next_token = accept_sampled(
                drafts.tokens,
                drafts.probs,
                scores,
                self.rng,
                drafts.row_gamma,
                rows=[not done for done in self.rows.finished],
            )
        else:
            n_accepted, next_token = accept_greedy(drafts.tokens, target_tokens, drafts.row_gamma)
        if replay is not None:
            n_accepted = replay(n_accepted).clamp(0, drafts.gamma).to(n_accepted.device)
            if any(g != drafts.gamma for g in drafts.row_gamma):
                n_accepted = torch.minimum(n_accepted, device_tensor(drafts.row_gamma, n_accepted.device))
            next_token = target_tokens.gather(1, n_accepted[:, None]).squeeze(1)
        return n_accepted, next_token

    def attended(self, selection: Selection, seqlens: list[int], active: list[int]) -> list[tuple[float, bool]]:
        """Per active row: the cached positions it read per layer (dense and selection layers read everything), and
        whether its read set held less than the row (a sparse row, not one read in full)."""
        layers, dense = (
            self.target_layers,
            len(set(self.dustin_config.dense_layers) | set(self.dustin_config.selection_layers)),
        )
        return [
            ((selection.counts[b] * (layers - dense) + seqlens[b] * dense) / layers, selection.counts[b] < seqlens[b])
            for b in active
        ]

    @property
    def history_capture(self) -> dict:
        """The target's scoring queries to keep on a verification: its scoring layer's heads (Dustin only)."""
        return (
            {self.dustin_config.target_layer: self.dustin_config.target_heads}
            if self.dustin_config is not None
            else {}
        )

    def draft_capture(self, sparse: bool) -> dict:
        """The draft's scoring queries to keep on a step: its scoring layers' heads when the step is sparse."""
        return dict(zip(self.dustin_config.draft_layers, self.dustin_config.draft_heads)) if sparse else {}

    def draft_feed(self, before: torch.Tensor) -> torch.Tensor:
        """``(B, 2)``: each row's committed tokens at ``before`` and ``before + 1`` (the draft's first input)."""
        feed = self.rows.tokens.gather(1, before[:, None] + torch.arange(2, device=before.device))
        return feed.clamp_max(self.draft_vocab - 1)  # the target's padding ids, which the draft cannot embed

    def queue_drafts(self, base, n_accepted, selection, seqlens) -> QueuedDraft | None:
        """Queue the next step's first draft forward before this step's one sync, from device values alone;
        when the forwards hand out tokens (:attr:`tokens_only`: nothing on the host between them) all γ.

        The step's copy to the host is queued before them and the host waits for that copy alone
        (:class:`~dustin_hf.runtime.plan.HostCopy`), so it does its bookkeeping and queues the rest of the next step
        while the GPU runs these forwards, instead of the GPU idling until the host has queued more. A row
        that commits ``k = n + 1`` tokens (``n`` drafts accepted) holds ``L + k - 1`` draft positions next
        step, feeds its tokens at ``L + k - 1`` and ``L + k``, then its drafts; a row finished before this
        step commits ``k = 0``. The host cuts ``k`` further only for rows that finish on this step (EOS,
        length, a stopping criterion), whose drafts are never used: their positions are capped so that the
        slots written stay inside the cache (a row still running next step is never capped: it holds fewer
        than ``capacity - max_gamma - 1`` positions). Queued only when the next step reads what this one did (a
        sparse step stays sparse; a dense Dustin step may turn sparse) and the forwards' graphs are captured;
        else ``None`` (or fewer forwards) and the next step runs the rest.
        """
        draft = self.draft
        if self.dustin_config is not None and selection is None:
            return None
        sparse = selection is not None
        kept = n_accepted  # k - 1
        if any(self.rows.finished):
            kept = torch.where(device_tensor(self.rows.finished, base.device), -1, n_accepted)
        before = (base + kept).clamp_max(draft.cache.capacity - 1 - self.max_gamma)  # L + k - 1
        reads = (
            DraftReads.after((selection, seqlens), self.dustin_config, self.max_gamma, draft.cache.capacity)
            if sparse and self.sparse_draft
            else None
        )
        capture, feed, outputs = self.draft_capture(sparse), self.draft_feed(before), []
        for i in range(max(self.row_gamma) if self.tokens_only else 1):
            cached = before if i == 0 else before + 1 + i  # the forward's rows hold this many positions
            out = draft.step_ahead(
                feed,
                cached.to(torch.int32),
                keep=1,
                capture=capture,
                capture_last=True,
                indices=None if reads is None else reads.indices,
                num_indices=None if reads is None else reads.ahead(cached - base),
                full_rows=reads is not None and reads.full_rows,
            )
            if out is None:  # this shape has no graph yet
                break
            outputs.append(out)
            feed = out[0]  # (B, 1) tokens
        return QueuedDraft(tuple(outputs), sparse=sparse, reads=reads) if outputs else None
