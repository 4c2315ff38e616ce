"""One ``generate()`` call of the decode loop: prefill, then the step until every row is done.

State at the start of every step, for row b with ``L = L_b`` target-cached positions:

    tokens[b, :L+1]   committed tokens (prompt + generated); the last one, x = tokens[b, L], is in no cache yet
    target cache      positions [0, L)
    draft cache       positions [0, L-1)

One step (:meth:`DecodeRun.step`), over explicit values, each mode's part decided by its verifier (:mod:`.dense`,
:mod:`.sparse`, :mod:`.exact`):

  1. draft (:mod:`.drafter`): d_1..d_γ per row from the draft's distributions q_1..q_γ;
  2. reads: what verification reads (every cached position, or the read-set policy's selection);
  3. verify: the target reads [x, d_1..d_γ] at positions L..L+γ, giving p_1..p_{γ+1};
  4. verdict: the drafts each row keeps, and the target's own token after them;
  5. commit: rows advance, both caches roll back the rest.

Performance notes, so the steps stay fast on a GPU: every forward after prefill has a fixed shape and is replayed
from a CUDA graph (:mod:`dustin_hf.runtime.graphs`); a greedy step at a constant γ makes one device->host copy,
queued before the next step's first draft forwards, so the GPU drafts while the host does its bookkeeping
(:meth:`~dustin_hf.decode.drafter.Drafter.queue`). A confidence threshold and the quality knob each wait for the
device once more per step (exact mode too, where a confirming row holds more than ``recent_tokens`` tentative tokens
and the sparse draft reads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..runtime.launch import prefer_cublaslt
from .cache import DustinCache
from .drafter import Drafter
from .hooks import DecodeHooks, PhaseClock, synchronize
from .masks import Batch, Prompt
from .outputs import OutputRecorder
from .processors import LogitsPipeline
from .rows import Rows
from .runner import ModelRunner
from .sampling import RowGenerators, pick_tokens
from .settings import GenerateSettings
from .stats import RunStats
from .workspace import Workspace

__all__ = ["CallSettings", "DecodeResult", "DecodeRun"]


@dataclass
class DecodeResult:
    sequences: torch.Tensor  # (B, prompt_len + max generated), the input layout + generated tokens
    scores: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) processed target scores
    logits: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) raw target logits
    attentions: tuple | None  # per generated index, per layer: stock's layout (see dustin_hf.decode.outputs)
    hidden_states: tuple | None
    stats: RunStats  # what the run did (``stats.as_dict()``; a returned cache's ``stats``)
    cache: DustinCache  # the target's cache (a workspace's: the next run of that workspace empties it)
    draft_cache: DustinCache
    generated: list[int]  # tokens each row generated
    draft_tokens: list[int] | None = None  # each row's draft length after the run (the draft schedule's state)
    prompts: list[Prompt] | None = None  # each row's prompt as the loop read it (where its slots were, its length)


@dataclass(frozen=True)
class CallSettings:
    """What a run reads of its decoder and never writes."""

    gen: GenerateSettings
    hooks: DecodeHooks
    tokens_only: bool  # the forwards hand out their argmax only (greedy, unprocessed, nothing but tokens returned)
    profile: str | None = None  # the phase clock's mode (None, "sync" or "events": hooks.PhaseClock)


class DecodeRun:
    """One call's state: its rows, the workspace's runners and caches, the drafter, the verifier, stats and clock.
    Made per call, dropped after it.

    Args:
        settings: what the run reads of its decoder (:class:`CallSettings`).
        workspace: the caches and runners of this run (:mod:`dustin_hf.decode.workspace`).
        drafter: the draft's side (:class:`~dustin_hf.decode.drafter.Drafter`).
        verifier: the mode's verifier (:mod:`.dense`, :mod:`.sparse`, :mod:`.exact`).
        inputs: the call's input as the loop reads it (:func:`~dustin_hf.decode.masks.read_batch`).
        max_new: tokens each row may generate.
    """

    def __init__(self, settings: CallSettings, workspace: Workspace, drafter: Drafter, verifier, inputs: Batch,
                 max_new: int):  # fmt: skip
        gen, prompts = settings.gen, inputs.prompts
        self.settings, self.workspace, self.drafter, self.verifier = settings, workspace, drafter, verifier
        self.inputs = inputs
        device = workspace.target.device
        workspace.target.record = (gen.output_attentions, gen.output_hidden_states)
        self.recorder = None
        if gen.recording:
            slots = [p.slots for p in prompts]
            self.recorder = OutputRecorder(slots, inputs.padded_len, gen.output_attentions, gen.output_hidden_states)
        self.stats = RunStats()
        self.rows = Rows(
            prompts, workspace.target.cache.capacity + 1, gen.pad, device, max_new, gen.eos, list(gen.row_criteria),
            gen.streamer, gen.output_scores, gen.output_logits,
        )  # fmt: skip
        pads = [p.pad for p in prompts]
        self.process = LogitsPipeline(gen.logits_processor, pads, min_length_from_new=gen.min_length_from_new)
        self.rng = RowGenerators(len(prompts), device) if gen.do_sample else None
        self.clock: PhaseClock | None = None  # started with the decode steps

    @property
    def target(self) -> ModelRunner:
        return self.workspace.target

    @property
    def draft(self) -> ModelRunner:
        return self.workspace.draft

    # ------------------------------------------------------------------------------------------ the call
    def decode(self, input_ids: torch.Tensor, step) -> DecodeResult:
        """Prefill, then ``step(self)`` until every row is done (or ``max_time`` is up); the call's result."""
        started = time.perf_counter()
        self.verifier.start(self, self.prefill())
        with prefer_cublaslt(self.target.device):  # the decode steps' GEMMs; the prompt's run faster on PyTorch's
            synchronize(self.target.device)
            decoding = time.perf_counter()
            self.clock = PhaseClock(self.target.device, self.settings.profile)
            step_ends, step_tokens = [], []
            rows, max_time = self.rows, self.settings.gen.max_time
            while not all(rows.finished):
                before = sum(rows.generated)
                step(self)
                step_ends.append(time.perf_counter())
                step_tokens.append(sum(rows.generated) - before)
                if max_time is not None and max_time(rows.tokens, None).all():
                    break
            if self.settings.gen.streamer is not None:
                self.settings.gen.streamer.end()
            return self._result(input_ids, started, decoding, step_ends, step_tokens)

    def prefill(self) -> list:
        """The target reads each prompt and names the first new token; the draft reads all but the last prompt
        token. Returns the target queries the verifier asked to keep (per row). A row whose last input slot was
        masked takes its first token from that slot's query instead
        (:meth:`~dustin_hf.decode.runner.ModelRunner.hidden_query`)."""
        target, rows, inputs = self.target, self.rows, self.inputs
        prompts, prefill = inputs.prompts, self.settings.hooks.prefill or ModelRunner.prefill
        chunk, capture = self.verifier.prefill_plan(self)

        def read(runner: ModelRunner, tokens: list[torch.Tensor], capture: dict, starts: list[int]) -> tuple:
            if any(starts):
                return prefill(runner, tokens, chunk, capture, starts=starts)
            return prefill(runner, tokens, chunk, capture)  # a prefill hook (benchmarks, the lab) reads whole prompts

        starts, draft_starts = [0] * len(prompts), [0] * len(prompts)
        if inputs.prefix is not None:  # stock's prompt reuse: the given cache's positions, then the rest
            target.cache.load_prefix(inputs.prefix, [p.slots for p in prompts], inputs.cached)
            starts = inputs.cached
        elif inputs.reused is not None:  # the held caches' last prompts: their leading positions are in place
            starts, draft_starts = inputs.reused
            target.cache.seq_lengths, self.draft.cache.seq_lengths = list(starts), list(draft_starts)
        last_logits, kept = read(target, [p.tokens[n:] for p, n in zip(prompts, starts)], capture, starts)
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
        # last id, as every later token does (Drafter.feed): its proposals there are poor, the output is the same
        vocab = self.drafter.vocab[0]
        read(
            self.draft, [p.tokens[n:-1].clamp_max(vocab - 1) for p, n in zip(prompts, draft_starts)], {}, draft_starts
        )
        # a later call whose rows begin with these tokens reuses their positions
        self.workspace.prefilled = [p.tokens for p in prompts] if inputs.plain else None
        return kept

    # ------------------------------------------------------------------------------------------ a step
    def step(self) -> None:
        """One draft -> reads -> verify -> verdict -> commit round for every row."""
        verifier, clock = self.verifier, self.clock
        at = verifier.positions(self)
        capture = verifier.draft_capture(at.sparse)
        drafts = self.drafter.draft(self, at.seqlens, at.base, at.sparse, capture,
                                    draft_reads=lambda: verifier.draft_reads(self, at.sparse))  # fmt: skip
        clock.mark("draft")
        reads = verifier.reads(self, at, drafts)
        clock.mark("score_select")
        verdict = verifier.verify(self, at, drafts, reads)
        verifier.commit(self, at, verdict, reads)
        clock.mark("bookkeeping")
        clock.end_step()

    def keep_outputs(self, active: list[int], counts: list[int]) -> None:
        """``output_attentions`` / ``output_hidden_states``: the verification queries that predicted kept tokens."""
        if self.recorder is not None:
            hidden, attentions = self.target.last_outputs
            for b in active:
                self.recorder.keep_step(b, counts[b], hidden, attentions)

    def _result(self, input_ids: torch.Tensor, started: float, decoding: float, step_ends: list[float],
                step_tokens: list[int]) -> DecodeResult:  # fmt: skip
        rows, stats, target, draft = self.rows, self.stats, self.target, self.draft
        stats.prefill_seconds = decoding - started
        stats.decode_seconds = (step_ends[-1] if step_ends else decoding) - decoding
        stats.generated_tokens = sum(rows.generated)
        stats.step_end_times, stats.step_tokens = [t - decoding for t in step_ends], step_tokens
        stats.reports["cuda_graphs"] = {
            "target": target.graph_report, "draft": draft.graph_report, "select": self.verifier.graph_report(),
        }  # fmt: skip
        if self.clock.mode:
            stats.reports.update(phase_seconds=self.clock.steps, phase_host_seconds=self.clock.host_steps)
        stats.reports.update(self.verifier.report(self))
        attentions, hidden = self.recorder.tuples(rows.generated) if self.recorder is not None else (None, None)
        return DecodeResult(
            rows.sequences(input_ids), rows.per_position(rows.scores), rows.per_position(rows.raw), attentions,
            hidden, stats, target.cache, draft.cache, list(rows.generated), list(self.drafter.row_gamma),
            self.inputs.prompts,
        )  # fmt: skip
