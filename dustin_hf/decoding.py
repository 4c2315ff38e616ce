"""Batched speculative decoding with dense or Dustin (sparse) verification.

This is the loop behind the patched ``generate(..., assistant_model=draft)``: any batch size, prompts of
different lengths (left or right padding, taken from the attention mask), ragged acceptance (each row keeps its
own number of tokens per step), greedy or sampling.

State at the start of every step, for row b with ``L = L_b`` target-cached positions:

    tokens[b, :L+1]   committed tokens (prompt + generated); the last one, x = tokens[b, L], is in no cache yet
    target cache      positions [0, L)
    draft cache       positions [0, L-1)

One step (:meth:`SpeculativeDecoder._step`):

  1. draft: feed tokens[b, L-1:L+1] (2 tokens, so that every row feeds the same count), then γ-1 single
     tokens, drawing d_1..d_γ from the draft's distributions q_1..q_γ;
  2. select (Dustin only): score positions from the kept queries, fill the budget per row (:mod:`selector`);
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
drafts while the host does its bookkeeping (:meth:`SpeculativeDecoder._queue_drafts`). A confidence threshold
reads each draft forward's confidences and the quality knob its counts: each one more wait for the device (exact
mode too, where a confirming row holds more than ``recent_tokens`` tentative tokens and the sparse draft reads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from .cache import DustinCache
from .config import ResolvedConfig
from .draft_reads import DraftReads
from .exact import ConfirmSchedule, block_proposals, blocks
from .kernels import resolve_backend
from .masks import Prompt, check_token_ids, position_table, prompts_from_mask, stock_slots
from .outputs import OutputRecorder
from .plan import HostCopy, device_tensor, select_heads
from .processors import LogitsPipeline
from .prompt_calibration import calibrate_on_prompts
from .rows import Rows, token_ids
from .runner import ModelRunner, attention_scale, common_window, group_size, model_device, window_cuts
from .runtime.fused import FusedWeights, fused_ops, fused_ops_available
from .runtime.launch import all_on_cuda, prefer_cublaslt
from .runtime.tuning import Tuning
from .sampling import RowGenerators, accept_greedy, accept_sampled, pick_tokens
from .selection import Selection, dense_rows, truncated, with_dense_rows
from .select_layers import select_spec
from .selector import Selector
from .stats import RunStats
from .telemetry import DecodeHooks, PhaseClock, synchronize
from .workspace import Shape, Workspace, Workspaces, capacity_for

__all__ = ["DRAFT_SCHEDULES", "DecodeResult", "SpeculativeDecoder"]

DRAFT_SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# a row's draft length under the "heuristic" schedule grows by 2 after a step that kept all its drafts; it stops
# growing here (every length is a forward shape, and a CUDA graph each)
_HEURISTIC_MAX = 16


@dataclass
class DecodeResult:
    sequences: torch.Tensor  # (B, prompt_len + max generated), the input layout + generated tokens
    scores: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) processed target scores
    logits: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) raw target logits
    attentions: tuple | None  # per generated index, per layer: stock's layout (see dustin_hf.outputs)
    hidden_states: tuple | None
    stats: RunStats  # what the run did (also ``cache.stats``, as a dict)
    cache: DustinCache  # the target's cache (a workspace's: the next run of that workspace empties it)
    draft_cache: DustinCache
    generated: list[int]  # tokens each row generated


@dataclass(frozen=True)
class _Drafts:
    """Step 1's output: every row's drafts, the draft's distributions and the scoring queries it kept."""

    tokens: torch.Tensor  # (B, γ): γ is the longest row's count; a row's drafts past its own count are ignored
    probs: torch.Tensor | None  # (B, γ, V): the draft's processed distributions q on the target's vocabulary
    queries: dict  # {draft scoring layer: [(B, heads, D)] * γ}: the queries that produced the drafts
    row_gamma: list[int]  # the drafts each row proposed (finished rows: γ, of no consequence)

    @property
    def gamma(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class _QueuedDraft:
    """A step's first draft forwards, queued by the step before (:meth:`SpeculativeDecoder._queue_drafts`)."""

    outputs: tuple[tuple[torch.Tensor, dict], ...]  # per forward: logits (B, 1, Vd) float32 (or, from a
    # tokens_only runner, tokens (B, 1)) and the kept scoring queries
    sparse: bool  # the step it was queued for was expected to be sparse
    reads: DraftReads | None  # what it read (sparse draft); the step's later forwards read the same


class SpeculativeDecoder:
    """Speculative decoding of a batch with a target and a draft model sharing a tokenizer.

    Args:
        target, draft: causal LMs whose attention is routed to ``"dustin"`` for the call's duration.
        generation_config: the target's prepared config (``do_sample``, ``max_length``, EOS/pad ids).
        logits_processor, stopping_criteria: as prepared by ``generate()``.
        dustin: resolved Dustin settings, or ``None`` for dense verification.
        num_draft_tokens: γ, draft tokens per step (each row's starting length under a schedule).
        confidence_threshold: a row stops drafting after a draft whose probability under the draft's processed
            distribution is below it (transformers' ``ConfidenceCriteria``, per row); ``None`` never stops early.
        draft_schedule: ``"constant"`` (every row drafts ``num_draft_tokens``), or ``"heuristic"`` /
            ``"heuristic_transient"`` (transformers' schedule, per row: +2 after a step that kept all the row's
            drafts, else -1, at least 1, at most 16). :attr:`final_draft_tokens` holds the rows' lengths after a run.
        streamer: receives each step's new tokens (batch size 1 only).
        backend: attention backend for dense verification (Dustin uses ``dustin.backend``).
        cuda_graphs: capture the fixed-shape forwards in CUDA graphs (a model split over GPUs: one graph per
            device, see :class:`~dustin_hf.runtime.graphs.Pipeline`); ``None``: for each model whose parameters
            are all on CUDA, when the backend is graph-safe (``"triton"``).
        fused_ops: run the models' RMSNorms, rotary embeddings and SiLU·mul through one-launch Triton kernels
            and their q/k/v and gate/up projections as one GEMM each (:mod:`dustin_hf.runtime.fused`; rotary
            bit-exact, RMSNorm within 2 ulps, fused GEMMs may round differently); ``None``: for each model
            whose parameters are all on CUDA, when the backend is ``"triton"``.
        hooks: what a benchmark or an evaluation plugs in (:class:`~dustin_hf.telemetry.DecodeHooks`: replayed
            acceptance, a stored prefill, phase timing); ``None`` for none.
        tuning: the GPU path's launch heuristics and fused projections (:class:`~dustin_hf.runtime.tuning.Tuning`);
            ``None``: the measured defaults. Benchmarks compare variants by passing their own.
        workspaces: where the run takes the caches, CUDA graphs and fused weights of an earlier run of the same
            shape and leaves its own for the next (:mod:`dustin_hf.workspace`; a patched model's
            ``DustinPatch.workspaces``); ``None``: built for this run and released after it.

    ``generate`` returns a :class:`DecodeResult` whose ``stats`` (also the target cache's ``stats``) say what
    the run did: step counts, acceptance, positions read, ``prefill_seconds``, ``decode_seconds``,
    ``step_end_times`` (host clock, each after the step's device sync), ``step_tokens`` (tokens committed by
    all rows at each step) and reports (``cuda_graphs``, ``fused_ops``, ``calibration``, phase times).
    """

    def __init__(
        self,
        target,
        draft,
        generation_config,
        logits_processor=None,
        stopping_criteria=None,
        dustin: ResolvedConfig | None = None,
        num_draft_tokens: int = 4,
        confidence_threshold: float | None = None,
        draft_schedule: str = "constant",
        streamer=None,
        backend: str = "auto",
        cuda_graphs: bool | None = None,
        fused_ops: bool | None = None,
        hooks: DecodeHooks | None = None,
        tuning: Tuning | None = None,
        workspaces: Workspaces | None = None,
    ):
        if not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens (the draft's generation_config.num_assistant_tokens) must be an int "
                             f">= 1, got {num_draft_tokens!r}")
        if draft_schedule not in DRAFT_SCHEDULES:
            raise ValueError(f"num_assistant_tokens_schedule must be one of {DRAFT_SCHEDULES}, got {draft_schedule!r}")
        if confidence_threshold is not None and not 0 <= confidence_threshold <= 1:
            raise ValueError(f"assistant_confidence_threshold must be in [0, 1] or None, got {confidence_threshold!r}")
        self.target, self.draft = target, draft
        self.config = generation_config
        self.process = LogitsPipeline(logits_processor,
                                      min_length_from_new=getattr(generation_config, "min_new_tokens", None) is not None)
        self.do_sample = bool(generation_config.do_sample)
        self.dustin = dustin
        self.gamma = num_draft_tokens
        self.threshold = confidence_threshold
        self.schedule = draft_schedule
        # the most drafts any row proposes in a step: caches and the sparse draft's read sets are sized by it
        self.max_gamma = num_draft_tokens if draft_schedule == "constant" else max(num_draft_tokens, _HEURISTIC_MAX)
        self.final_draft_tokens: list[int] = []
        self.streamer = streamer
        self.hooks = hooks or DecodeHooks()
        self.tuning = tuning or Tuning()
        self.workspaces = workspaces
        self.backend = resolve_backend(dustin.backend if dustin is not None else backend, model_device(target))
        # graphs need all of a model's parameters on CUDA devices (one graph per device) and a graph-safe kernel
        self.graphs = {
            role: (self.backend == "triton" and all_on_cuda(model)) if cuda_graphs is None else cuda_graphs
            for role, model in (("target", target), ("draft", draft))
        }
        self.fused = {
            role: (self.backend == "triton" and fused_ops_available(model)) if fused_ops is None else fused_ops
            for role, model in (("target", target), ("draft", draft))
        }
        self._sparse_draft = dustin is not None and dustin.sparse_draft
        self.profile = PhaseClock.mode_of(self.hooks.profile, model_device(target))  # None, "sync" or "events"
        self.eos = token_ids(getattr(generation_config, "_eos_token_tensor", None), generation_config.eos_token_id)
        pad = token_ids(getattr(generation_config, "_pad_token_tensor", None), generation_config.pad_token_id)
        self.pad = pad[0] if pad else (self.eos[0] if self.eos else 0)
        self.max_time = None
        self.row_criteria = []
        for criterion in stopping_criteria or []:
            if isinstance(criterion, MaxTimeCriteria):
                self.max_time = criterion
            elif not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
                self.row_criteria.append(criterion)  # evaluated per row and token (handled natively: EOS, length)
        self.output_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.output_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        returned = bool(generation_config.return_dict_in_generate)
        self.output_attentions = returned and bool(generation_config.output_attentions)
        self.output_hidden_states = returned and bool(generation_config.output_hidden_states)
        # greedy, unprocessed and nothing returned but tokens: the forwards hand out their logits' argmax only
        self._tokens_only = not (self.do_sample or self.threshold is not None or self.process.processors
                                 or self.output_scores or self.output_logits or self.output_attentions
                                 or self.output_hidden_states)

    # ------------------------------------------------------------------------------------------ a run
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> DecodeResult:
        prompts = prompts_from_mask(input_ids, attention_mask, position_ids)
        batch, padded_len = input_ids.shape
        max_new = self.config.max_length - padded_len
        if max_new < 1:
            raise ValueError(f"max_length {self.config.max_length} leaves no room after the {padded_len}-token input")
        if self.streamer is not None and batch > 1:
            raise ValueError("streaming is supported for batch size 1 only")
        check_token_ids(prompts, self.target.config.get_text_config().vocab_size)
        needed = max(p.length for p in prompts) + max_new + self.max_gamma + 2
        if self.dustin is not None and self.dustin.mode == "exact":  # tentative tokens past max_new, wider blocks
            needed += self.dustin.confirm_tokens + 2 * self.max_gamma + 2
        fused = [model for role, model in (("target", self.target), ("draft", self.draft)) if self.fused[role]]
        calibrating = self.dustin is not None and self.dustin.calibration == "prompt"  # _prefill replaces self.dustin
        workspace = None
        try:
            workspace = self._workspace(prompts, padded_len, needed)
            generation = workspace.fused.generation
            # entered before any graph is captured: graphs keep the fused kernels and read the fused weights
            with fused_ops(*fused, tuning=self.tuning.fused, gemm=self.tuning.kernels.gemm,
                           weights=workspace.fused) as report:
                if workspace.fingerprint is None:
                    workspace.seal()
                elif workspace.fused.generation != generation:  # fits() compared the addresses the graphs read
                    raise RuntimeError("a reused workspace's fused weights were made anew; this is a bug in dustin_hf")
                result = self._generate(input_ids, prompts, max_new, workspace)
        except BaseException:
            if workspace is not None:
                workspace.release()  # a run that failed part-way may have left a graph or the caches half made
            raise
        # prompt calibration picks other scoring heads each call, and every pick captures graphs of its own: such
        # runs keep nothing
        if self.workspaces is not None and not calibrating:
            self.workspaces.keep(workspace)
        else:
            workspace.release()
        result.stats.reports["fused_ops"] = {"norms": report.norms, "rotary": list(report.rotary_modules),
                                             "mlps": report.mlps, "qkv": report.qkv, "outputs": report.outputs,
                                             "attentions": report.attentions}
        result.stats.reports["workspace"] = {"runs": workspace.runs, "capacity": workspace.capacity}
        return result

    def _workspace(self, prompts: list[Prompt], padded_len: int, needed: int) -> Workspace:
        """The held workspace when it fits this run (emptied), else a new one (:mod:`dustin_hf.workspace`); its
        runners get this run's position and window tables."""
        recording = self.output_attentions or self.output_hidden_states
        capacity = capacity_for(needed)
        positions = position_table(prompts, needed)  # where position ids are not the cache slots
        slots = stock_slots(prompts, padded_len, needed)  # what sliding windows count where rows have holes
        span = needed if slots is None else int(slots.max()) + 1  # the longest distance a window may see
        windowed = {role: window_cuts(model, span) for role, model in (("target", self.target), ("draft", self.draft))}
        # captured forwards take position ids from the slots and run the fast kernels only: position ids that are
        # not the slots (a masked last input slot, the caller's position_ids), a sliding window that can cut, or
        # attentions and hidden states to return run eagerly
        graphs = tuple(self.graphs[role] and positions is None and not recording and not windowed[role]
                       for role in ("target", "draft"))
        cfg = self.dustin
        read_width = 0 if cfg is None else max(cfg.budget, cfg.max_budget)  # a sparse verification's read set
        draft_width = read_width + DraftReads.extra_for(cfg, self.max_gamma) if self._sparse_draft else 0
        # exact mode's sampling needs p~ to be a function of the prefix: only the first query (x's) scores there
        select = select_spec(cfg, queries=1 if self.do_sample and cfg.mode == "exact" else None) if cfg else None
        shape = Shape(batch=len(prompts), backend=self.backend, graphs=graphs,
                      fused=(self.fused["target"], self.fused["draft"]), tokens_only=self._tokens_only,
                      widths=(read_width, draft_width), dustin=cfg, tuning=self.tuning, select=select)
        held = None if self.workspaces is None else self.workspaces.take(self.target, self.draft, shape, needed)
        workspace = held
        if workspace is None:
            t_cfg, d_cfg = self.target.config.get_text_config(), self.draft.config.get_text_config()
            target = ModelRunner(self.target, DustinCache(t_cfg.num_hidden_layers, len(prompts), capacity),
                                 self.backend, graphs[0], graph_width=read_width,
                                 dense_layers=cfg.dense_layers if cfg is not None else (),
                                 tokens_only=self._tokens_only, tuning=self.tuning.kernels, select=select)
            draft = ModelRunner(self.draft, DustinCache(d_cfg.num_hidden_layers, len(prompts), capacity), self.backend,
                                graphs[1], graph_width=draft_width, tokens_only=self._tokens_only,
                                tuning=self.tuning.kernels)
            workspace = Workspace(shape, target, draft, FusedWeights())
        workspace.start_run()
        held_slots = workspace.capacity  # the tables span the caches, which may hold more than this run needs
        positions = position_table(prompts, held_slots)
        slots = stock_slots(prompts, padded_len, held_slots)
        for role, runner in (("target", workspace.target), ("draft", workspace.draft)):  # to each device once
            runner.positions = None if positions is None else positions.to(runner.device)
            runner.window_slots = slots.to(runner.device) if slots is not None and windowed[role] else None
        self.window_slots = slots if windowed["target"] else None
        return workspace

    def _generate(self, input_ids: torch.Tensor, prompts: list[Prompt], max_new: int,
                  workspace: Workspace) -> DecodeResult:
        batch, padded_len = input_ids.shape
        t_cfg, d_cfg = self.target.config.get_text_config(), self.draft.config.get_text_config()
        device = model_device(self.target)
        recording = self.output_attentions or self.output_hidden_states
        target, draft = workspace.target, workspace.draft
        capacity = target.cache.capacity
        cfg = self.dustin
        target.record = (self.output_attentions, self.output_hidden_states)
        self.recorder = OutputRecorder([p.slots for p in prompts], padded_len, self.output_attentions,
                                       self.output_hidden_states) if recording else None
        self.stats = target.cache.run_stats = RunStats()
        self.rows = Rows(prompts, capacity + 1, self.pad, device, max_new, self.eos, self.row_criteria, self.streamer,
                         self.output_scores, self.output_logits)
        self.process.for_batch([p.pad for p in prompts])
        self.rng = RowGenerators(batch, device) if self.do_sample else None
        self.row_gamma = [self.gamma] * batch  # each row's draft length for its next step (the schedule's state)
        self.confirm = ConfirmSchedule(batch, cfg.confirm_tokens, cfg.confirm_every,
                                       min_limit=0 if self.do_sample else 1) \
            if cfg is not None and cfg.mode == "exact" else None
        self._last_selection = None  # (selection, seqlens) of the last sparse step, for the sparse draft
        self._ahead: _QueuedDraft | None = None  # the next step's first draft forwards, already queued
        self._t_layers = t_cfg.num_hidden_layers
        self._draft_vocab = d_cfg.vocab_size  # a draft may pad its embedding less than the target (same tokenizer)
        self._target_vocab = t_cfg.vocab_size
        self._clock = PhaseClock(device, self.profile)
        started = time.perf_counter()

        self._prefill(target, draft, prompts, t_cfg)
        if self.dustin is not None:
            selector = workspace.selector
            if selector is None or selector.config != self.dustin:  # prompt calibration may have changed the heads
                selector = workspace.selector = Selector(
                    self.dustin, self.backend, group_size(t_cfg), group_size(d_cfg),
                    attention_scale(self.target, t_cfg), attention_scale(self.draft, d_cfg),
                    graphs=workspace.shape.graphs[0], window=common_window(self.target), tuning=self.tuning.kernels)
            selector.budgets, selector.window_slots = self.hooks.budgets, self.window_slots
            self.selector = selector
        with prefer_cublaslt(device):  # the decode steps' GEMMs; the prompt's run faster on PyTorch's default
            return self._decode(input_ids, target, draft, started)

    def _decode(self, input_ids: torch.Tensor, target: ModelRunner, draft: ModelRunner,
                started: float) -> DecodeResult:
        device = model_device(self.target)
        recording = self.recorder is not None
        synchronize(device)
        decoding = time.perf_counter()
        self._clock.restart()
        step_ends, step_tokens = [], []
        step = self._exact_step if self.confirm is not None else self._step
        while not all(self.rows.finished):
            before = sum(self.rows.generated)
            step(target, draft)
            step_ends.append(time.perf_counter())
            step_tokens.append(sum(self.rows.generated) - before)
            if self.max_time is not None and self.max_time(self.rows.tokens, None).all():
                break
        if self.streamer is not None:
            self.streamer.end()
        self.final_draft_tokens = list(self.row_gamma)

        stats = self.stats
        stats.prefill_seconds = decoding - started
        stats.decode_seconds = (step_ends[-1] if step_ends else decoding) - decoding
        stats.generated_tokens = sum(self.rows.generated)
        stats.step_end_times, stats.step_tokens = [t - decoding for t in step_ends], step_tokens
        stats.reports["cuda_graphs"] = {"target": target.graph_report, "draft": draft.graph_report,
                                        "select": self.selector.graph_report if self.dustin is not None
                                        else {"captured": 0, "failed": []}}
        if self.profile:
            stats.reports.update(phase_seconds=self._clock.steps, phase_host_seconds=self._clock.host_steps)
        if self.confirm is not None:
            stats.reports["exact"] = self.confirm.stats.as_dict()
        attentions, hidden = self.recorder.tuples(self.rows.generated) if recording else (None, None)
        return DecodeResult(self.rows.sequences(input_ids), self.rows.per_position(self.rows.scores),
                            self.rows.per_position(self.rows.raw), attentions, hidden, stats, target.cache, draft.cache,
                            list(self.rows.generated))

    def _prefill(self, target: ModelRunner, draft: ModelRunner, prompts: list[Prompt], t_cfg) -> None:
        """The target reads each prompt (keeping its last query on the scoring heads as the first history) and
        names the first new token; the draft reads all but the last prompt token. With ``calibration="prompt"``
        the scoring heads are searched on the prompts in between. A row whose last input slot was masked takes
        its first token from that slot's query instead (:meth:`~dustin_hf.runner.ModelRunner.hidden_query`)."""
        prefill = self.hooks.prefill or ModelRunner.prefill
        chunk = self.dustin.prefill_chunk if self.dustin is not None else None  # None: from free memory
        rows, prompt_lens = self.rows, [p.length for p in prompts]
        calibrate = self.dustin is not None and self.dustin.calibration == "prompt"
        if calibrate:  # the target layer is chosen after prefill: keep every layer's last query
            t_capture = {layer: tuple(range(t_cfg.num_attention_heads)) for layer in range(t_cfg.num_hidden_layers)}
        else:
            t_capture = self._history_capture
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
        # last id, as every later token does (_draft_feed): its proposals there are poor, the output is the same
        prefill(draft, [p.tokens[:-1].clamp_max(self._draft_vocab - 1) for p in prompts], chunk, {})
        if calibrate:
            self.dustin, report = calibrate_on_prompts(target, draft, rows.tokens, self.dustin, self.gamma,
                                                       prompt_lens)
            self.stats.reports["calibration"] = report
        if self.dustin is not None:
            layer, heads = self.dustin.target_layer, self.dustin.target_heads
            history = torch.cat([k[layer][:, 0] for k in kept])  # (B, kept heads, D)
            if calibrate:
                history = select_heads(history, heads, dim=1)
            target.cache.set_history(history, [n - 1 for n in prompt_lens])

    # ------------------------------------------------------------------------------------------ a step
    def _step(self, target: ModelRunner, draft: ModelRunner) -> None:
        """One draft -> select -> verify -> accept -> commit round for every row."""
        rows = self.rows
        seqlens = [n - 1 for n in rows.lens]  # L_b: target-cached positions (the last token is not cached)
        base = device_tensor(seqlens, rows.tokens.device)
        sparse = self.dustin is not None and not all(dense_rows(seqlens, self.dustin))

        # 1. Draft d_1..d_γ per row (the first forwards may have been queued by the last step).
        drafts = self._draft(draft, seqlens, base, sparse)
        self._clock.mark("draft")

        # 2. Select what verification reads (Dustin, once some row is long enough).
        selection = self.selector.select(target, draft, seqlens, base, drafts.queries, drafts.gamma,
                                         drafts.row_gamma) if sparse else None
        self._last_selection = None if selection is None else (selection, seqlens)
        if selection is not None and selection.recovery is not None:
            self.stats.record_knob(selection.counts, selection.recovery, selection.fallback, rows.active)
        self._clock.mark("score_select")

        # 3. Verify [x, d_1..d_γ] at positions L..L+γ against the selection (or everything): p_1..p_{γ+1}.
        raw, scores, captured = self._verify(target, drafts, seqlens, base, selection)
        self._clock.mark("verify")

        # 4. Accept n drafts per row and pick the target's own token after them.
        n_accepted, next_token = self._accept(drafts, raw, scores)
        new_tokens = torch.cat([drafts.tokens, torch.zeros_like(drafts.tokens[:, :1])], dim=1)
        new_tokens.scatter_(1, n_accepted[:, None], next_token[:, None])  # (B, γ+1): d_1..d_n, next, garbage
        rows.write_candidates(new_tokens)
        active = rows.active
        self._clock.mark("accept")

        # 5. Commit k = n + 1 tokens per row (fewer where a row stops), roll both caches back to match.
        host = HostCopy(torch.cat([n_accepted[:, None], new_tokens], dim=1))  # queued before the next drafts
        self._ahead = self._queue_drafts(draft, base, n_accepted, selection, seqlens)
        self._clock.mark("draft")
        host = host.tolist()  # the step's one device->host sync: it waits for the copy, not for those drafts
        accepted = [row[0] for row in host]
        counts = rows.commit(new_tokens, [row[1:] for row in host], raw, scores, [n + 1 for n in accepted])
        self._update_schedule(drafts.row_gamma, accepted, active)
        if self.recorder is not None:  # the verification queries that predicted the kept tokens
            hidden, attentions = target.last_outputs
            for b in active:
                self.recorder.keep_step(b, counts[b], hidden, attentions)
        self._settle(target, draft, seqlens, counts, captured)  # keep x, d_1..d_{k-1}
        self._clock.mark("commit")

        self.stats.record_step(drafts.row_gamma, accepted, counts, active, sparse=selection is not None,
                               attended=None if selection is None else self._attended(selection, seqlens, active))
        self._clock.mark("bookkeeping")
        self._clock.end_step()

    def _exact_step(self, target: ModelRunner, draft: ModelRunner) -> None:
        """One step of exact mode (:mod:`dustin_hf.exact`): the same five steps, but a row verified sparsely
        accepts tentatively, and a confirming row's verification is dense with its tentative tokens in front of
        the new drafts: one speculative block ``[x, t_1..t_n, d_1..d_γ]`` from the row's last committed token x,
        whose proposal is p~ for the t's and q for the d's. What a confirming or dense row accepts is committed;
        what a sparse row accepts joins its tentative tokens."""
        rows, schedule, cfg = self.rows, self.confirm, self.dustin
        batch, device = rows.batch_size, rows.tokens.device
        seqlens = [n - 1 for n in rows.held]  # L_b: cached positions (committed + tentative, the last not cached)
        base = device_tensor(seqlens, device)
        short = dense_rows(seqlens, cfg)  # read in full anyway: what they accept is exact and committed at once
        wanted = [not done and schedule.wants(b, rows.tentative[b]) for b, done in enumerate(rows.finished)]
        # greedy: one confirming row makes the step dense for it, and every row holding tentative tokens confirms
        # with it (a greedy row's tokens do not depend on when it confirms). Sampling: each row on its own schedule,
        # since when a row confirms decides which draws it makes
        confirming = wanted if self.do_sample else [rows.tentative[b] > 0 and any(wanted) for b in range(batch)]
        # greedy: a confirming step reads every row densely (one dense kernel, not a mixed step)
        everyone = not self.do_sample and any(confirming)
        dense = [s or c or everyone or schedule.dense(b) for b, (s, c) in enumerate(zip(short, confirming))]

        # 1. Draft d_1..d_γ after everything each row holds (its tentative tokens included).
        sparse = not all(short)
        drafts = self._draft(draft, seqlens, base, sparse)
        self._clock.mark("draft")

        # 2. Select: the sparse rows' read sets (and, with sparse_draft, what the draft reads next); dense rows read
        #    everything they hold before the step's first query.
        starts = [L - n if c else L for L, n, c in zip(seqlens, rows.tentative, confirming)]
        selection = None
        if sparse and self.do_sample:
            # p~ must be a function of the prefix alone for p / p~ to confirm its samples exactly: score with the
            # draft's query of x only (the later queries were fed the very drafts p~ is about to judge)
            first = {layer: queries[:1] for layer, queries in drafts.queries.items()}
            selection = self.selector.select(target, draft, seqlens, base, first, 1)
        elif sparse:
            selection = self.selector.select(target, draft, seqlens, base, drafts.queries, drafts.gamma,
                                             drafts.row_gamma)
        if selection is not None and selection.recovery is not None:
            self.stats.record_knob(selection.counts, selection.recovery, selection.fallback,
                                   [b for b in rows.active if not dense[b]])
        reads = None if all(dense) else with_dense_rows(selection, starts, dense)
        # what the sparse draft reads next: a confirming row rewrites its positions from its confirmed start, so it
        # keeps the part of this selection below that start and reads everything written from it on (without the
        # sparse draft only whether a selection exists matters)
        kept_from = [s if c else L for s, L, c in zip(starts, seqlens, confirming)]
        self._last_selection = None if selection is None else (selection, seqlens) \
            if not (any(confirming) and self._sparse_draft) else \
            (truncated(selection, kept_from, seqlens, cfg.recent_tokens), kept_from)
        self._clock.mark("score_select")

        # 3. Verify each row's block [x, proposal] from its start: a confirming row's x is its last committed
        #    token (its tentative tokens follow it as proposals), any other row's x is the last token it holds.
        tentative = [rows.tentative[b] if confirming[b] else 0 for b in range(batch)]
        # a confirming step's blocks take one width (one forward shape, one CUDA graph): the most tentative tokens
        # a row can hold (it confirms once it holds its limit <= confirm_tokens, after a step that added at most
        # γ+1, so confirm_tokens + γ), then as many of its new drafts as fit. Not confirm_tokens + 2γ: that many
        # queries pack more rows per KV head than the dense kernel reads at full bandwidth (a 7-head group: 13
        # queries take about 1.6x the time of 9), and a row's
        # drafts past the width count only when every tentative token before them is confirmed
        width = cfg.confirm_tokens + self.max_gamma if any(confirming) else max(drafts.row_gamma)
        if max(tentative) > width:  # the schedule keeps every limit <= confirm_tokens; a block must hold them all
            raise RuntimeError(f"exact mode: a row holds {max(tentative)} tentative tokens, more than a confirming "
                               f"block's {width}; this is a bug in dustin_hf")
        verified = [min(g, width - n) for n, g in zip(tentative, drafts.row_gamma)]  # new drafts in each block
        gammas = [n + g for n, g in zip(tentative, verified)]
        inputs = blocks(rows.tokens, starts, tentative, drafts.tokens, 1 + width)  # (B, 1 + width): x, proposal
        proposal = inputs[:, 1:]
        target.cache.rollback(starts)  # a confirming row re-reads its tentative positions densely
        raw, captured = target.step(inputs, starts, keep=1 + width, capture=self._history_capture,
                                    capture_last=False, selection=reads, query_counts=[1 + g for g in gammas])
        scores = None
        if not self._tokens_only:
            prefixes = [rows.history(b, upto=starts[b] + 1) for b in range(batch)]
            scores = self.process(raw, lambda b, i: torch.cat([prefixes[b], proposal[b : b + 1, :i]], dim=1))
        self._clock.mark("verify")

        # 4. Accept over each block: greedy, the agreeing prefix; sampling, min(1, p / proposal) with p~ as the
        #    proposal of tentative tokens and q as the drafts'.
        probs = None
        if self.do_sample:
            probs = block_proposals(drafts.probs, schedule.proposals, tentative, raw.shape[-1], width)
        block = _Drafts(proposal, probs, drafts.queries, gammas)
        n_accepted, next_token = self._accept(block, raw, scores, tentative, dense)
        new_tokens = torch.cat([proposal, torch.zeros_like(proposal[:, :1])], dim=1)
        new_tokens.scatter_(1, n_accepted[:, None], next_token[:, None])  # (B, 1 + width)
        held = rows.held
        offsets = [rows.lens[b] if dense[b] else held[b] for b in range(batch)]  # committed: after lens
        rows.write_candidates(new_tokens, offsets)
        active = rows.active
        self._clock.mark("accept")

        # 5. Commit what dense and confirming rows accepted; a sparse row's accepted tokens turn tentative. Every
        #    row's next draft input follows from the device values, as in _step, counted from its block's start (a
        #    confirming row's last committed token): the next step's first draft forwards are queued before this
        #    step's one sync, reading what _last_selection says the draft reads next. The next step is sparse as
        #    this one: a confirming row's start is past the budget and min_context (its committed tokens were, for
        #    its last sparse step), and committed lengths only grow.
        host = HostCopy(torch.cat([n_accepted[:, None], new_tokens], dim=1))
        self._ahead = self._queue_drafts(draft, device_tensor(starts, device) if any(confirming) else base,
                                         n_accepted, *(self._last_selection or (None, seqlens)))
        self._clock.mark("draft")
        host = host.tolist()
        accepted = [row[0] for row in host]
        committing = [n + 1 if dense[b] else 0 for b, n in enumerate(accepted)]
        counts = rows.commit(new_tokens, [row[1:] for row in host], raw, scores, committing)
        kept = []  # inputs of each block whose K/V stay cached: x and the proposals before the next token
        for b in range(batch):
            if b not in active:
                kept.append(0)
            elif dense[b]:
                kept.append(counts[b])
                if confirming[b]:
                    schedule.after_confirm(b, tentative[b], min(accepted[b], tentative[b]), counts[b])
                else:
                    schedule.after_dense(b)
                rows.tentative[b] = 0
            else:
                kept.append(accepted[b] + 1)
                if self.do_sample:  # p~ of each new tentative token: the sparse target's at its position
                    schedule.proposals[b].extend(scores[b, : accepted[b] + 1].softmax(dim=-1))
                new = host[b][1 : accepted[b] + 2]  # the new tentative tokens, from the host copy
                rows.tentative[b] += accepted[b] + 1
                schedule.after_sparse(b, schedule.must[b] or rows.would_stop(b, new))
        self._update_schedule(verified, [min(max(n - t, 0), g) for n, t, g in zip(accepted, tentative, verified)],
                              [b for b in active if verified[b]])  # a block with no new drafts tells nothing
        if self.recorder is not None:
            hidden, attentions = target.last_outputs
            for b in active:
                self.recorder.keep_step(b, counts[b], hidden, attentions)
        self._settle(target, draft, starts, kept, captured)
        if any(confirming):
            schedule.stats.confirm_steps += 1
        self._clock.mark("commit")

        self.stats.record_step(gammas, accepted, counts, active,
                               sparse=reads is not None,
                               attended=None if reads is None else self._attended(reads, starts, active))
        self._clock.mark("bookkeeping")
        self._clock.end_step()

    def _settle(self, target: ModelRunner, draft: ModelRunner, starts: list[int], kept: list[int], captured) -> None:
        """After a step: the target keeps the first ``kept[b]`` inputs of each row's block (from ``starts[b]``), the
        draft one position fewer, plus the slots the next step's queued draft forwards wrote; the last kept
        input's query on the scoring heads becomes the next step's target history."""
        batch = len(starts)
        target.cache.rollback([s + k for s, k in zip(starts, kept)])
        draft.cache.rollback([s + k - 1 for s, k in zip(starts, kept)])  # the draft lags by one token
        if self._ahead is not None:  # the queued forwards wrote the next 2, 3, ... slots of every row
            queued = len(self._ahead.outputs)
            draft.cache.advance(slice(0, batch), [queued + 1] * batch)
            self.stats.draft_forwards_ahead += queued
            self.stats.steps_drafted_ahead += 1
        if self.dustin is not None:
            queries = captured[self.dustin.target_layer]  # (B, Q, heads, D)
            picked = device_tensor([max(k - 1, 0) for k in kept], queries.device)
            history = queries[torch.arange(batch, device=queries.device), picked]
            target.cache.set_history(history, [s + k - 1 for s, k in zip(starts, kept)])

    def _draft(self, draft: ModelRunner, seqlens: list[int], base: torch.Tensor, sparse: bool) -> _Drafts:
        """Step 1: up to γ draft forwards. The first feeds [tokens[L-1], tokens[L]] so that every row feeds two;
        the draft cache holds L-1 positions, then L+1, L+2, ... after each forward. With ``sparse_draft`` the draft
        reads the last selection plus the positions written since (:class:`~dustin_hf.draft_reads.DraftReads`).

        Each row drafts its own count: its schedule's length, cut after a draft below the confidence threshold.
        The forwards run while some unfinished row is still drafting; a row's drafts past its own count are
        computed with the others' but never verified, scored or accepted, so the row's tokens depend on its own
        prompt only."""
        rows = self.rows
        planned = [0 if done else g for g, done in zip(self.row_gamma, rows.finished)]
        d_capture = self._draft_capture(sparse)
        ahead, self._ahead = self._ahead, None  # the first forwards, queued by the last step before its sync
        assert ahead is None or ahead.sparse == sparse  # committed lengths only grow: sparse steps stay sparse
        if ahead is not None:
            queued, reads, feed = ahead.outputs, ahead.reads, None
        else:
            queued = ()
            reads = DraftReads.after(self._last_selection, self.dustin, self.max_gamma, draft.cache.capacity) \
                if sparse and self._sparse_draft else None
            feed = self._draft_feed(base - 1)
        device = rows.tokens.device
        tokens, probs, kept_queries = [], [], {layer: [] for layer in d_capture}
        drafted = [0] * rows.batch_size
        drafting = [g > 0 for g in planned]
        for i in range(max(planned)):
            at = [n - 1 + i + (1 if i else 0) for n in seqlens]
            if i < len(queued):
                raw, captured = queued[i]
            else:
                raw, captured = draft.step(feed, at, keep=1, capture=d_capture, capture_last=True,
                                           selection=None if reads is None else reads.at(at))  # (B, 1, Vd)
            if self._tokens_only:
                token = raw[:, 0].to(device)
            else:
                if raw.shape[-1] < self._target_vocab:  # processors are built for the target's vocabulary
                    raw = torch.nn.functional.pad(raw, (0, self._target_vocab - raw.shape[-1]), value=float("-inf"))
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
        return _Drafts(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, kept_queries,
                       row_gamma=row_gamma)

    def _update_schedule(self, row_gamma: list[int], accepted: list[int], active: list[int]) -> None:
        """transformers' ``num_assistant_tokens_schedule``, each row on its own: a row that kept all the drafts it
        proposed drafts 2 more next step, any other 1 fewer (at least 1)."""
        if self.schedule == "constant":
            return
        for b in active:
            grew = accepted[b] >= row_gamma[b]
            self.row_gamma[b] = min(self.max_gamma, self.row_gamma[b] + 2) if grew else max(1, self.row_gamma[b] - 1)

    def _verify(self, target: ModelRunner, drafts: _Drafts, seqlens: list[int], base: torch.Tensor,
                selection: Selection | None):
        """Step 3: the target over [x, d_1..d_γ]; returns raw logits ``(B, γ+1, V)`` (or their argmax ``(B, γ+1)``
        when only tokens are needed), processed scores (``None`` then) and the kept history queries."""
        verify_in = torch.cat([self.rows.tokens.gather(1, base[:, None]), drafts.tokens], dim=1)  # (B, γ+1)
        raw, captured = target.step(verify_in, seqlens, keep=drafts.gamma + 1, capture=self._history_capture,
                                    capture_last=False, selection=selection,
                                    query_counts=[g + 1 for g in drafts.row_gamma])
        tokens = drafts.tokens.unbind(1)
        scores = None if self._tokens_only else self.process(raw, lambda b, i: self.rows.history(b, tokens[:i]))
        return raw, scores, captured

    def _accept(self, drafts: _Drafts, raw: torch.Tensor, scores: torch.Tensor | None,
                tentative: list[int] | None = None, dense: list[bool] | None = None):
        """Step 4: ``n_accepted (B,)`` leading drafts kept and the target's ``next_token (B,)`` after them
        (:func:`~dustin_hf.sampling.accept_greedy` / :func:`~dustin_hf.sampling.accept_sampled`); a replayed
        acceptance (:attr:`DecodeHooks.accept`; in exact mode :attr:`DecodeHooks.confirm`, told how many of each
        block's proposals are tentative tokens) replaces the counts, the target's own token follows them."""
        replay = self.hooks.accept
        if tentative is not None and self.hooks.confirm is not None:
            confirm = self.hooks.confirm
            tentative_now, dense_now = device_tensor(tentative, raw.device), device_tensor(dense, raw.device)
            replay = lambda n: confirm(n, tentative_now, dense_now)  # noqa: E731
        target_tokens = raw if self._tokens_only else None  # (B, γ+1), the target's argmax
        if target_tokens is None and (not self.do_sample or replay is not None):
            target_tokens = scores.argmax(dim=-1)
        if self.do_sample:
            n_accepted, next_token = accept_sampled(drafts.tokens, drafts.probs, scores, self.rng, drafts.row_gamma,
                                                    rows=[not done for done in self.rows.finished])
        else:
            n_accepted, next_token = accept_greedy(drafts.tokens, target_tokens, drafts.row_gamma)
        if replay is not None:
            n_accepted = replay(n_accepted).clamp(0, drafts.gamma).to(n_accepted.device)
            if any(g != drafts.gamma for g in drafts.row_gamma):
                n_accepted = torch.minimum(n_accepted, device_tensor(drafts.row_gamma, n_accepted.device))
            next_token = target_tokens.gather(1, n_accepted[:, None]).squeeze(1)
        return n_accepted, next_token

    def _attended(self, selection: Selection, seqlens: list[int], active: list[int]) -> list[tuple[float, bool]]:
        """Per active row: the cached positions it read per layer (dense and selection layers read everything), and
        whether its read set held less than the row (a sparse row, not one read in full)."""
        layers, dense = self._t_layers, len(set(self.dustin.dense_layers) | set(self.dustin.selection_layers))
        return [((selection.counts[b] * (layers - dense) + seqlens[b] * dense) / layers,
                 selection.counts[b] < seqlens[b]) for b in active]

    @property
    def _history_capture(self) -> dict:
        """The target's scoring queries to keep on a verification: its scoring layer's heads (Dustin only)."""
        return {self.dustin.target_layer: self.dustin.target_heads} if self.dustin is not None else {}

    def _draft_capture(self, sparse: bool) -> dict:
        """The draft's scoring queries to keep on a step: its scoring layers' heads when the step is sparse."""
        return dict(zip(self.dustin.draft_layers, self.dustin.draft_heads)) if sparse else {}

    def _draft_feed(self, before: torch.Tensor) -> torch.Tensor:
        """``(B, 2)``: each row's committed tokens at ``before`` and ``before + 1`` (the draft's first input)."""
        feed = self.rows.tokens.gather(1, before[:, None] + torch.arange(2, device=before.device))
        return feed.clamp_max(self._draft_vocab - 1)  # the target's padding ids, which the draft cannot embed

    def _queue_drafts(self, draft: ModelRunner, base, n_accepted, selection, seqlens) -> _QueuedDraft | None:
        """Queue the next step's first draft forward before this step's one sync, from device values alone;
        when the forwards hand out tokens (:attr:`_tokens_only`: nothing on the host between them) all γ.

        The step's copy to the host is queued before them and the host waits for that copy alone
        (:class:`~dustin_hf.plan.HostCopy`), so it does its bookkeeping and queues the rest of the next step
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
        if self.dustin is not None and selection is None:
            return None
        sparse = selection is not None
        kept = n_accepted  # k - 1
        if any(self.rows.finished):
            kept = torch.where(device_tensor(self.rows.finished, base.device), -1, n_accepted)
        before = (base + kept).clamp_max(draft.cache.capacity - 1 - self.max_gamma)  # L + k - 1
        reads = DraftReads.after((selection, seqlens), self.dustin, self.max_gamma, draft.cache.capacity) \
            if sparse and self._sparse_draft else None
        capture, feed, outputs = self._draft_capture(sparse), self._draft_feed(before), []
        for i in range(max(self.row_gamma) if self._tokens_only else 1):
            cached = before if i == 0 else before + 1 + i  # the forward's rows hold this many positions
            out = draft.step_ahead(feed, cached.to(torch.int32), keep=1, capture=capture, capture_last=True,
                                   indices=None if reads is None else reads.indices,
                                   num_indices=None if reads is None else reads.ahead(cached - base),
                                   full_rows=reads is not None and reads.full_rows)
            if out is None:  # this shape has no graph yet
                break
            outputs.append(out)
            feed = out[0]  # (B, 1) tokens
        return _QueuedDraft(tuple(outputs), sparse=sparse, reads=reads) if outputs else None
