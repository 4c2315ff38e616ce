"""Batched speculative decoding with dense or Dustin (sparse) verification.

This is the loop behind the patched ``generate(..., assistant_model=draft)``: any batch size,
prompts of different lengths (left or right padding, taken from the attention mask), ragged
acceptance (each row keeps its own number of tokens per step), greedy or sampling.

State at the start of every step, for row b with ``L = L_b`` target-cached positions:

    tokens[b, :L+1]   committed tokens (prompt + generated); the last one, x = tokens[b, L],
                      is not in any cache yet
    target cache      positions [0, L)
    draft cache       positions [0, L-1)

One step:
  1. draft: feed tokens[b, L-1:L+1] (2 tokens, so that every row feeds the same count), then γ-1
     single tokens, drawing d_1..d_γ;
  2. select (Dustin only): score positions from the kept queries, fill the budget per row;
  3. verify: the target reads [x, d_1..d_γ] at positions L..L+γ against the selection (or everything);
  4. accept per row: n drafts kept, plus the target's own next token; cut at EOS / max_new_tokens;
  5. commit: rows advance by k = n+1 (or less when cut); both caches roll back the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from .cache import DustinCache
from .config import ResolvedConfig
from .draft_reads import DraftReads
from .kernels import resolve_backend
from .masks import prompts_from_mask
from .plan import HostCopy, device_tensor, select_heads
from .prompt_calibration import calibrate_on_prompts
from .runner import ModelRunner, attention_scale, group_size, model_device
from .runtime.fused import fused_ops, fused_ops_available
from .runtime.graphs import GraphedCall
from .runtime.launch import all_on_cuda, prefer_cublaslt
from .sampling import LogitsPipeline, accept_greedy, accept_sampled, pick_tokens
from .scoring import draft_lookahead_scores, target_history_scores
from .selection import Selection, dense_rows, select_positions
from .telemetry import PhaseClock, synchronize

__all__ = ["DecodeResult", "SpeculativeDecoder"]


@dataclass
class DecodeResult:
    sequences: torch.Tensor  # (B, prompt_len + max generated), the input layout + generated tokens
    scores: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) processed target scores
    logits: tuple[torch.Tensor, ...] | None  # per generated index: (B, V) raw target logits
    cache: DustinCache  # the target's cache (``.stats``)
    draft_cache: DustinCache


@dataclass(frozen=True)
class _QueuedDraft:
    """A step's first draft forwards, queued by the step before (:meth:`SpeculativeDecoder._queue_drafts`)."""

    outputs: tuple[tuple[torch.Tensor, dict], ...]  # per forward: logits (B, 1, Vd) float32 (or, from a
    # tokens_only runner, tokens (B, 1)) and the kept scoring queries
    sparse: bool  # the step it was queued for was expected to be sparse
    reads: "DraftReads | None"  # what it read (sparse draft); the step's later forwards read the same


class SpeculativeDecoder:
    """Speculative decoding of a batch with a target and a draft model sharing a tokenizer.

    Args:
        target, draft: causal LMs whose attention is routed to ``"dustin"`` for the call's duration.
        generation_config: the target's prepared config (``do_sample``, ``max_length``, EOS/pad ids).
        logits_processor, stopping_criteria: as prepared by ``generate()``.
        dustin: resolved Dustin settings, or ``None`` for dense verification.
        num_draft_tokens: γ, draft tokens per step.
        confidence_threshold: stop drafting early once every unfinished row's draft confidence
            (its top probability) falls below it; ``None`` never stops early.
        streamer: receives each step's new tokens (batch size 1 only).
        backend: attention backend for dense verification (Dustin uses ``dustin.backend``).
        cuda_graphs: capture the fixed-shape forwards in CUDA graphs (a model split over GPUs: one graph per
            device, see :class:`~dustin_hf.runtime.graphs.Pipeline`); ``None``: for each model whose parameters are
            all on CUDA, when the backend is graph-safe (``"triton"``).
        fused_ops: run the models' RMSNorms, rotary embeddings and SiLU·mul through one-launch Triton kernels
            and their q/k/v and gate/up projections as one GEMM each (:mod:`dustin_hf.runtime.fused`; rotary
            bit-exact, RMSNorm within 2 ulps, fused GEMMs may round differently); ``None``: for each model
            whose parameters are all on CUDA, when the backend is ``"triton"``.
        accept_override: benchmarks only: maps the computed ``n_accepted (B,)`` to replayed counts;
            the target's own token follows them.
        prefill: replaces ``ModelRunner.prefill`` (same signature and results); benchmarks and evaluation
            use it to start from a stored prefill.
        profile: record each step's time per phase in ``stats["phase_seconds"]`` (and the host's time
            between the same marks in ``stats["phase_host_seconds"]``): ``True`` or ``"sync"``
            synchronises the device between phases (each phase's own cost; slows decoding),
            ``"events"`` reads CUDA events instead (the GPU timeline of undisturbed steps, idle time
            included). Leave it off when measuring throughput.

    After ``generate``, the target cache's ``stats`` also hold ``prefill_seconds``,
    ``decode_seconds``, ``step_end_times`` (host clock, each after the step's device sync) and
    ``step_tokens`` (tokens committed by all rows at each step).
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
        streamer=None,
        backend: str = "auto",
        cuda_graphs: bool | None = None,
        fused_ops: bool | None = None,
        accept_override=None,
        prefill=None,
        profile: bool | str = False,
    ):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.target, self.draft = target, draft
        self.config = generation_config
        self.process = LogitsPipeline(logits_processor)
        self.do_sample = bool(generation_config.do_sample)
        self.dustin = dustin
        self.gamma = num_draft_tokens
        self.threshold = confidence_threshold
        self.streamer = streamer
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
        self.accept_override = accept_override
        self.prefill = prefill or ModelRunner.prefill
        self.profile = PhaseClock.mode_of(profile, model_device(target))  # None, "sync" or "events"
        self.eos = _token_ids(getattr(generation_config, "_eos_token_tensor", None), generation_config.eos_token_id)
        pad = _token_ids(getattr(generation_config, "_pad_token_tensor", None), generation_config.pad_token_id)
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
        # greedy, unprocessed and nothing returned but tokens: the forwards hand out their logits' argmax only
        self._tokens_only = not (self.do_sample or self.threshold is not None or self.process.processors
                                 or self.output_scores or self.output_logits)

    # ------------------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DecodeResult:
        fused = [model for role, model in (("target", self.target), ("draft", self.draft)) if self.fused[role]]
        # both entered before any graph is captured: graphs keep the fused kernels and the GEMMs cuBLASLt picked
        with fused_ops(*fused) as report, prefer_cublaslt(model_device(self.target)):
            result = self._generate(input_ids, attention_mask)
        result.cache.counters.extra["fused_ops"] = {"norms": report.norms, "rotary": list(report.rotary_modules),
                                                     "mlps": report.mlps, "qkv": report.qkv,
                                                     "outputs": report.outputs, "attentions": report.attentions}
        return result

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> DecodeResult:
        prompts = prompts_from_mask(input_ids, attention_mask)
        batch, padded_len = input_ids.shape
        max_new = self.config.max_length - padded_len
        if max_new < 1:
            raise ValueError(f"max_length {self.config.max_length} leaves no room after the {padded_len}-token input")
        if self.streamer is not None and batch > 1:
            raise ValueError("streaming is supported for batch size 1 only")
        device = model_device(self.target)
        prompt_lens = [p.numel() for p in prompts]
        capacity = max(prompt_lens) + max_new + self.gamma + 2
        t_cfg, d_cfg = self.target.config.get_text_config(), self.draft.config.get_text_config()
        width = self.dustin.budget if self.dustin is not None else 0
        target = ModelRunner(self.target, DustinCache(t_cfg.num_hidden_layers, batch, capacity), self.backend,
                             self.graphs["target"], graph_width=width,
                             dense_layers=self.dustin.dense_layers if self.dustin is not None else (),
                             tokens_only=self._tokens_only)
        draft_width = self.dustin.budget + DraftReads.extra(self.gamma) if self._sparse_draft else 0
        draft = ModelRunner(self.draft, DustinCache(d_cfg.num_hidden_layers, batch, capacity), self.backend,
                            self.graphs["draft"], graph_width=draft_width, tokens_only=self._tokens_only)
        self._last_selection = None  # (selection, seqlens) of the last sparse step, for the sparse draft
        self._ahead: _QueuedDraft | None = None  # the next step's first draft forwards, already queued
        self._select_graphs: dict[tuple, GraphedCall] = {}  # scoring + selection of the steady step, per γ
        self._t_group, self._d_group = group_size(t_cfg), group_size(d_cfg)
        self._t_layers = t_cfg.num_hidden_layers
        self._draft_vocab = d_cfg.vocab_size  # a draft may pad its embedding less than the target (same tokenizer)
        self._t_scale = attention_scale(self.target, t_cfg)
        self._d_scale = attention_scale(self.draft, d_cfg)

        tokens = torch.full((batch, capacity + 1), self.pad, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            tokens[b, : p.numel()] = p.to(device)
        self._tokens, self._lens = tokens, list(prompt_lens)  # committed tokens per row
        self._generated = [0] * batch
        self._finished = [False] * batch
        self._max_new = max_new
        self._scores = [[] for _ in range(batch)] if self.output_scores else None
        self._raw = [[] for _ in range(batch)] if self.output_logits else None
        self._clock = PhaseClock(device, self.profile)
        started = time.perf_counter()

        chunk = self.dustin.prefill_chunk if self.dustin is not None else 4096
        # Prefill: the target reads each prompt (keeping the last query on the scoring heads as the first
        # history) and names the first new token; the draft reads all but the last prompt token.
        calibrate = self.dustin is not None and self.dustin.calibration == "prompt"
        if calibrate:  # the target layer is chosen after prefill: keep every layer's last query
            t_capture = {layer: tuple(range(t_cfg.num_attention_heads)) for layer in range(t_cfg.num_hidden_layers)}
        else:
            t_capture = {self.dustin.target_layer: self.dustin.target_heads} if self.dustin is not None else {}
        last_logits, kept = self.prefill(target, prompts, chunk, t_capture)
        first_raw = torch.stack(last_logits)[:, None]  # (B, 1, V)
        first_scores = self.process(first_raw, lambda b, i: tokens[b : b + 1, : self._lens[b]])
        first = pick_tokens(first_scores[:, 0], self.do_sample)
        self._write_candidates(first[:, None])
        self._commit(first[:, None], first[:, None].tolist(), first_raw, first_scores, [1] * batch)
        self.prefill(draft, [p[:-1] for p in prompts], chunk, {})
        if calibrate:
            self.dustin, report = calibrate_on_prompts(target, draft, tokens, self.dustin, self.gamma, prompt_lens)
            target.cache.counters.extra["calibration"] = report
        if self.dustin is not None:
            layer, heads = self.dustin.target_layer, self.dustin.target_heads
            history = torch.cat([k[layer][:, 0] for k in kept])  # (B, kept heads, D)
            if calibrate:
                history = select_heads(history, heads, dim=1)
            target.cache.set_history(history, [n - 1 for n in prompt_lens])
        synchronize(device)
        decoding = time.perf_counter()
        self._clock.restart()
        step_ends, step_tokens = [], []

        while not all(self._finished):
            before = sum(self._generated)
            self._step(target, draft)
            step_ends.append(time.perf_counter())
            step_tokens.append(sum(self._generated) - before)
            if self.max_time is not None and self.max_time(tokens, None).all():
                break
        if self.streamer is not None:
            self.streamer.end()
        target.cache.counters.extra.update(
            prefill_seconds=decoding - started, decode_seconds=(step_ends[-1] if step_ends else decoding) - decoding,
            generated_tokens=sum(self._generated), step_end_times=[t - decoding for t in step_ends],
            step_tokens=step_tokens,
            cuda_graphs={"target": target.graph_report, "draft": draft.graph_report,
                         "select": {"captured": sum(c.graph is not None for c in self._select_graphs.values()),
                                    "failed": [c.failed for c in self._select_graphs.values() if c.failed]}},
            **({"phase_seconds": self._clock.steps, "phase_host_seconds": self._clock.host_steps}
               if self.profile else {}),
        )
        return self._result(input_ids, target.cache, draft.cache)

    # ------------------------------------------------------------------------------------------
    def _step(self, target: ModelRunner, draft: ModelRunner) -> None:
        """One draft -> (select) -> verify -> accept -> commit round for every row."""
        batch = len(self._lens)
        seqlens = [n - 1 for n in self._lens]  # L_b: target-cached positions (the last token is not cached)
        device = self._tokens.device
        base = device_tensor(seqlens, device)
        sparse = self.dustin is not None and not all(dense_rows(seqlens, self.dustin))

        # 1. Draft γ tokens. The first forward feeds [tokens[L-1], tokens[L]] so that every row feeds two;
        #    the draft cache holds L-1 positions, then L+1, L+2, ... after each forward. With sparse_draft
        #    the draft reads the last selection plus the positions written since (DraftReads).
        d_capture = self._draft_capture(sparse)
        ahead, self._ahead = self._ahead, None  # the first forwards, queued by the last step before its sync
        assert ahead is None or ahead.sparse == sparse  # rows only grow: a sparse step is followed by sparse ones
        if ahead is not None:
            queued, reads, feed = ahead.outputs, ahead.reads, None
        else:
            queued = ()
            reads = DraftReads.after(self._last_selection, self.dustin, self.gamma, draft.cache.capacity) \
                if sparse and self._sparse_draft else None
            feed = self._draft_feed(base - 1)
        drafts, draft_probs, kept_queries = [], [], {layer: [] for layer in d_capture}
        for i in range(self.gamma):
            at = [n - 1 + i + (1 if i else 0) for n in seqlens]
            if i < len(queued):
                raw, captured = queued[i]
            else:
                raw, captured = draft.step(feed, at, keep=1, capture=d_capture, capture_last=True,
                                           selection=None if reads is None else reads.at(at))  # (B, 1, Vd)
            if self._tokens_only:
                token = raw[:, 0].to(device)
            else:
                scores = self.process(raw, lambda b, _, i=i: self._history(b, drafts[:i]))
                token = pick_tokens(scores[:, 0], self.do_sample).to(device)
            drafts.append(token)
            if self.do_sample or self.threshold is not None:
                draft_probs.append(scores[:, 0].softmax(dim=-1))
            for layer, q in captured.items():
                kept_queries[layer].append(q[:, 0])  # (B, heads, D)
            feed = token[:, None]
            if self.threshold is not None and i + 1 < self.gamma:
                confident = draft_probs[-1].max(dim=-1).values >= self.threshold
                if not any(c for c, done in zip(confident.tolist(), self._finished) if not done):
                    break
        gamma = len(drafts)
        draft_tokens = torch.stack(drafts, dim=1)  # (B, γ)
        if reads is not None:
            target.cache.counters.draft_sparse_forwards += gamma
        self._clock.mark("draft")

        # 2. Select what verification reads (Dustin, once some row is long enough).
        selection = self._select(target, draft, seqlens, base, kept_queries) if sparse else None
        self._last_selection = None if selection is None else (selection, seqlens)
        self._clock.mark("score_select")

        # 3. Verify [x, d_1..d_γ] at positions L..L+γ against the selection (or everything).
        t_capture = {self.dustin.target_layer: self.dustin.target_heads} if self.dustin is not None else {}
        verify_in = torch.cat([self._tokens.gather(1, base[:, None]), draft_tokens], dim=1)  # (B, γ+1)
        raw, captured = target.step(verify_in, seqlens, keep=gamma + 1, capture=t_capture, capture_last=False,
                                    selection=selection)  # (B, γ+1, V)
        scores = None if self._tokens_only else self.process(raw, lambda b, i: self._history(b, drafts[:i]))
        self._clock.mark("verify")

        # 4. Accept: greedy keeps the agreeing prefix; sampling applies the speculative rejection rule.
        if self._tokens_only:
            target_tokens = raw  # (B, γ+1), the target's argmax
        elif not self.do_sample or self.accept_override is not None:
            target_tokens = scores.argmax(dim=-1)
        if self.do_sample:
            n_accepted, next_token = accept_sampled(draft_tokens, torch.stack(draft_probs, dim=1), scores)
        else:
            n_accepted, next_token = accept_greedy(draft_tokens, target_tokens)
        if self.accept_override is not None:  # benchmarks: a recorded acceptance, the target's own next token
            n_accepted = self.accept_override(n_accepted).clamp(0, gamma).to(device)
            next_token = target_tokens.gather(1, n_accepted[:, None]).squeeze(1)

        # 5. Commit: k_b tokens per row (the kept drafts + the target's token, cut at EOS / length).
        new_tokens = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)
        new_tokens.scatter_(1, n_accepted[:, None], next_token[:, None])  # (B, γ+1): d_1..d_n, next, garbage
        self._write_candidates(new_tokens)
        active = [b for b in range(batch) if not self._finished[b]]
        self._clock.mark("accept")
        host = HostCopy(torch.cat([n_accepted[:, None], new_tokens], dim=1))  # queued before the next drafts
        self._ahead = self._queue_drafts(draft, base, n_accepted, selection, seqlens)
        self._clock.mark("draft")
        host = host.tolist()  # the step's one device->host sync: it waits for the copy, not for those drafts
        accepted = [row[0] for row in host]
        counts = self._commit(new_tokens, [row[1:] for row in host], raw, scores, [n + 1 for n in accepted])
        target.cache.rollback([L + k for L, k in zip(seqlens, counts)])  # keep x, d_1..d_{k-1}
        draft.cache.rollback([L + k - 1 for L, k in zip(seqlens, counts)])  # the draft lags by one token
        if self._ahead is not None:  # the queued forwards wrote the next 2, 3, ... slots of every row
            queued = len(self._ahead.outputs)
            draft.cache.advance(slice(0, batch), [queued + 1] * batch)
            target.cache.counters.draft_forwards_ahead += queued
        if self.dustin is not None:
            queries = captured[self.dustin.target_layer]  # (B, γ+1, heads, D)
            picked = device_tensor([k - 1 for k in counts], queries.device)  # the last committed token
            history = queries[torch.arange(batch, device=queries.device), picked]
            target.cache.set_history(history, [L + k - 1 for L, k in zip(seqlens, counts)])
        self._clock.mark("commit")

        stats = target.cache.counters
        stats.steps += 1
        stats.verified_tokens += gamma * len(active)
        stats.accepted_tokens += sum(counts[b] - 1 for b in active)
        stats.trace.append((gamma, [accepted[b] if b in active else -1 for b in range(batch)]))
        if selection is not None:
            stats.sparse_steps += 1
            layers, dense = self._t_layers, len(self.dustin.dense_layers)  # per layer: dense layers read everything
            stats.attended_sum += sum((selection.counts[b] * (layers - dense) + seqlens[b] * dense) / layers
                                      for b in active) / max(len(active), 1)
        else:
            stats.dense_steps += 1
        self._clock.mark("bookkeeping")
        self._clock.end_step()

    def _draft_capture(self, sparse: bool) -> dict:
        """The draft's scoring queries to keep on a step: its scoring layers' heads when the step is sparse."""
        return dict(zip(self.dustin.draft_layers, self.dustin.draft_heads)) if sparse else {}

    def _draft_feed(self, before: torch.Tensor) -> torch.Tensor:
        """``(B, 2)``: each row's committed tokens at ``before`` and ``before + 1`` (the draft's first input)."""
        feed = self._tokens.gather(1, before[:, None] + torch.arange(2, device=before.device))
        return feed.clamp_max(self._draft_vocab - 1)  # the target's padding ids, which the draft cannot embed

    def _queue_drafts(self, draft: ModelRunner, base, n_accepted, selection, seqlens) -> "_QueuedDraft | None":
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
        than ``capacity - γ - 1`` positions). Queued only when the next step reads what this one did (a
        sparse step stays sparse; a dense Dustin step may turn sparse) and the forwards' graphs are captured;
        else ``None`` (or fewer forwards) and the next step runs the rest.
        """
        if self.dustin is not None and selection is None:
            return None
        sparse = selection is not None
        kept = n_accepted  # k - 1
        if any(self._finished):
            kept = torch.where(device_tensor(self._finished, base.device), -1, n_accepted)
        before = (base + kept).clamp_max(draft.cache.capacity - 1 - self.gamma)  # L + k - 1
        reads = DraftReads.after((selection, seqlens), self.dustin, self.gamma, draft.cache.capacity) \
            if sparse and self._sparse_draft else None
        capture, feed, outputs = self._draft_capture(sparse), self._draft_feed(before), []
        for i in range(self.gamma if self._tokens_only else 1):
            cached = before if i == 0 else before + 1 + i  # the forward's rows hold this many positions
            out = draft.step_ahead(feed, cached.to(torch.int32), keep=1, capture=capture, capture_last=True,
                                   indices=None if reads is None else reads.indices,
                                   num_indices=None if reads is None else reads.ahead(cached - base))
            if out is None:  # this shape has no graph yet
                break
            outputs.append(out)
            feed = out[0]  # (B, 1) tokens
        return _QueuedDraft(tuple(outputs), sparse=sparse, reads=reads) if outputs else None

    def _select(self, target: ModelRunner, draft: ModelRunner, seqlens, base, kept_queries) -> Selection:
        """Score every cached position (draft lookahead + target history) and choose each row's read set.

        With the Triton backend the scores span the cache capacity, a size fixed for the whole generation
        (each row's kernels stop at its own length), so the steady step (every row sparse, every row with a
        history, one device) is captured once as a CUDA graph and replayed, and the eager calls before it
        run the very same kernels and splits. The graph saves the host 0.8-1.6 ms of launches a step (7B +
        0.5B, batch 16, H200 hosts), which could leave the GPU waiting before verification.
        """
        cfg, t_cache = self.dustin, target.cache
        d_queries = [torch.stack(kept_queries[layer], dim=1) for layer in cfg.draft_layers]  # (B, γ, h, D)
        has_history = [pos == n - 1 for pos, n in zip(t_cache.history_pos, seqlens)]
        triton = self.backend == "triton"
        # every row's L is below capacity - γ - 2 (see _generate), and the draft queries see up to L + γ - 1
        span = t_cache.capacity - self.gamma if triton else max(seqlens)
        d_keys = [draft.cache.layer_buffers(layer)[0] for layer in cfg.draft_layers]
        t_keys = t_cache.layer_buffers(cfg.target_layer)[0]
        history = t_cache.history_queries if any(has_history) else None

        def score_select(*tensors) -> Selection:
            *queries, lengths, history_queries = tensors
            return self._score_select(queries, d_keys, t_keys, history_queries, lengths, seqlens, has_history, span,
                                      triton)

        devices = {base.device, t_keys.device, *(k.device for k in d_keys)}
        if not (triton and self.graphs["target"] and all(has_history) and len(devices) == 1
                and not any(dense_rows(seqlens, cfg))):
            return score_select(*d_queries, base, history)
        # the steady step: what the graph replays is fixed by the step's shapes (γ) and the cache buffers
        key = (len(kept_queries[cfg.draft_layers[0]]), tuple(k.data_ptr() for k in (*d_keys, t_keys)))
        call = self._select_graphs.get(key)
        if call is None:
            def read_set(*tensors) -> tuple[torch.Tensor, torch.Tensor]:
                selection = score_select(*tensors)
                return selection.indices, selection.num_indices

            call = self._select_graphs[key] = GraphedCall(read_set, base.device, target.graph_pools[base.device][0])
        indices, num_indices = call(*d_queries, base, history)
        return Selection(indices.clone(), num_indices.clone(), [cfg.budget] * len(seqlens))

    def _score_select(self, d_queries, d_keys, t_keys, history_queries, lengths, seqlens, has_history, span: int,
                      triton: bool) -> Selection:
        """:func:`select_positions` from the draft queries and the target history queries (``None``: none)."""
        cfg = self.dustin
        score_backend = "triton" if triton else "reference"
        s_draft = draft_lookahead_scores(d_queries, d_keys, lengths.to(d_keys[0].device), cfg.draft_heads,
                                         self._d_group, self._d_scale, span, backend=score_backend).to(lengths.device)
        s_target = None
        if history_queries is not None:
            s_target = target_history_scores(history_queries.to(t_keys.device), t_keys, lengths.to(t_keys.device),
                                             cfg.target_heads, self._t_group, self._t_scale, span,
                                             backend=score_backend).to(lengths.device)
        # the Triton selection with the Triton backend (unless the span outgrows its pools), else PyTorch
        return select_positions(seqlens, s_draft, s_target, has_history, cfg, lengths=lengths,
                                backend="auto" if triton else "reference")

    # ------------------------------------------------------------------------------------------
    def _history(self, b: int, drafts: list[torch.Tensor]) -> torch.Tensor:
        """Row b's committed tokens followed by its first drafts: what a processor sees, as ``(1, len)``."""
        committed = self._tokens[b : b + 1, : self._lens[b]]
        if not drafts:
            return committed
        return torch.cat([committed, torch.stack([d[b] for d in drafts])[None]], dim=1)

    def _write_candidates(self, new_tokens: torch.Tensor) -> None:
        """Write every row's candidates ``(B, n)`` after its committed tokens (one scatter; :meth:`_commit`
        then makes the first ``k_b`` of them committed)."""
        slots = device_tensor(self._lens, new_tokens.device)[:, None] + torch.arange(new_tokens.shape[1],
                                                                                     device=new_tokens.device)
        self._tokens.scatter_(1, slots.clamp_max(self._tokens.shape[1] - 1), new_tokens)

    def _commit(self, new_tokens, host_tokens: list[list[int]], raw, scores, proposed: list[int]) -> list[int]:
        """Append up to ``proposed[b]`` of ``new_tokens[b]`` (already written by :meth:`_write_candidates`) to
        each unfinished row, cut at EOS, length and stopping criteria; return the counts appended (0 for rows
        already finished)."""
        streaming = self.streamer is not None and not self._finished[0]
        starts = list(self._lens)
        counts = []
        for b, k in enumerate(proposed):
            if self._finished[b]:
                counts.append(0)
                continue
            k = min(k, self._max_new - self._generated[b])
            for j, token in enumerate(host_tokens[b][:k]):
                if token in self.eos:
                    k = j + 1
                    self._finished[b] = True
                    break
            if self.row_criteria:
                k = self._apply_row_criteria(b, starts[b], k)
            self._lens[b] += k
            self._generated[b] += k
            if self._generated[b] >= self._max_new:
                self._finished[b] = True
            if self._scores is not None:
                self._scores[b].extend(scores[b, :k])
            if self._raw is not None:
                self._raw[b].extend(raw[b, :k])
            counts.append(k)
        if streaming:
            # from the host copy: new_tokens.cpu() would wait for the draft forwards queued after it
            self.streamer.put(torch.tensor(host_tokens[0][: counts[0]], dtype=new_tokens.dtype))
        return counts

    def _apply_row_criteria(self, b: int, start: int, k: int) -> int:
        for j in range(1, k + 1):
            ids = self._tokens[b : b + 1, : start + j]
            if any(bool(criterion(ids, None)[0]) for criterion in self.row_criteria):
                self._finished[b] = True
                return j
        return k

    def _result(self, input_ids: torch.Tensor, cache: DustinCache, draft_cache: DustinCache) -> DecodeResult:
        batch, padded_len = input_ids.shape
        longest = max(self._generated)
        out = torch.full((batch, padded_len + longest), self.pad, dtype=torch.long, device=input_ids.device)
        out[:, :padded_len] = input_ids
        for b in range(batch):
            start = self._lens[b] - self._generated[b]
            out[b, padded_len : padded_len + self._generated[b]] = self._tokens[b, start : self._lens[b]].to(out.device)
        return DecodeResult(
            sequences=out,
            scores=_per_position(self._scores, longest),
            logits=_per_position(self._raw, longest),
            cache=cache,
            draft_cache=draft_cache,
        )


def _per_position(per_row: list[list[torch.Tensor]] | None, longest: int) -> tuple[torch.Tensor, ...] | None:
    """Row-wise score lists -> one ``(B, V)`` tensor per generated index (zeros past a row's end)."""
    if per_row is None:
        return None
    template = next(s for row in per_row for s in row)
    out = []
    for t in range(longest):
        out.append(torch.stack([row[t] if t < len(row) else torch.zeros_like(template) for row in per_row]))
    return tuple(out)


def _token_ids(tensor, fallback) -> list[int]:
    if tensor is not None:
        return [int(t) for t in torch.as_tensor(tensor).flatten().tolist()]
    if fallback is None:
        return []
    return [int(fallback)] if isinstance(fallback, int) else [int(t) for t in fallback]
