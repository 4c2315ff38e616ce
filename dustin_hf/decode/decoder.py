"""Batched speculative decoding with dense or Dustin (sparse) verification: the decoder a call is run with.

This is the loop behind the patched ``generate(..., assistant_model=draft)``: any batch size, prompts of
different lengths (left or right padding, taken from the attention mask), ragged acceptance (each row keeps its
own number of tokens per step), greedy or sampling.

:class:`SpeculativeDecoder` holds what a decoder is set up with (the models, :class:`GenerateSettings`, the
Dustin settings, :class:`Drafting`, :class:`RuntimeOptions`, hooks) and, per ``generate()`` call, finds the
caches and CUDA graphs of the call (:mod:`dustin_hf.decode.workspace`) and runs a
:class:`~dustin_hf.decode.run.DecodeRun`, which holds everything of that call and its decode step, with the verifier
of the mode (:data:`VERIFIERS`). Prompt calibration is handed in (``calibrate``), so the loop stays below the
calibration search.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from transformers import GenerationConfig

from ..compat import model_device, window_cuts
from ..config import ResolvedConfig
from ..kernels import resolve_backend
from ..runtime.fused import fused_ops, fused_ops_available
from ..runtime.launch import all_on_cuda
from .dense import DenseVerifier
from .drafter import Drafter
from .exact import ExactVerifier
from .hooks import DecodeHooks, PhaseClock
from .masks import read_batch
from .run import CallSettings, DecodeResult, DecodeRun
from .settings import DRAFT_SCHEDULES, Drafting, GenerateSettings, RuntimeOptions
from .sparse import SparseVerifier
from .workspace import Shape, capacity_for, workspace_for

__all__ = ["DRAFT_SCHEDULES", "DecodeResult", "SpeculativeDecoder"]  # the settings live in .settings

logger = logging.getLogger(__name__)

VERIFIERS = {None: DenseVerifier, "sparse": SparseVerifier, "exact": ExactVerifier}  # DustinConfig.mode -> its own


class SpeculativeDecoder:
    """Speculative decoding of a batch with a target and a draft model sharing a tokenizer.

    Args:
        target, draft: causal LMs whose attention is routed to ``"dustin"`` for the call's duration.
        generation: what ``generate()`` prepared (:meth:`GenerateSettings.from_generate`), or a bare
            ``GenerationConfig`` (no logits processors, no stopping criteria besides its length and EOS).
        dustin_config: resolved Dustin settings, or ``None`` for dense verification.
        drafting: γ, its schedule and the confidence stop (:class:`Drafting`; ``None``: 4 drafts, constant).
        runtime: backend, CUDA graphs, fused ops, tuning and workspaces (:class:`RuntimeOptions`; ``None``: the
            defaults, each GPU feature on where the models and backend allow it).
        hooks: what a benchmark or an evaluation plugs in (:class:`~dustin_hf.decode.hooks.DecodeHooks`: replayed
            acceptance, a stored prefill, phase timing); ``None`` for none.
        calibrate: with ``calibration="prompt"``, the search run on the prompts after prefill:
            ``calibrate(target runner, draft runner, tokens (B, T), config, γ, prompt lengths) -> (config, report)``
            (``generate()`` passes :func:`dustin_hf.calibration.prompt.calibrate_on_prompts`).

    ``generate`` returns a :class:`~dustin_hf.decode.run.DecodeResult` whose ``stats`` (``stats.as_dict()``) say
    what the run did: step counts, acceptance, positions read, ``prefill_seconds``,
    ``decode_seconds``, ``step_end_times`` (host clock, each after the step's device sync), ``step_tokens`` (tokens
    committed by all rows at each step) and reports (``cuda_graphs``, ``fused_ops``, ``calibration``, phase times).
    """

    def __init__(
        self,
        target,
        draft,
        generation: GenerateSettings | GenerationConfig,
        dustin_config: ResolvedConfig | None = None,
        drafting: Drafting | None = None,
        runtime: RuntimeOptions | None = None,
        hooks: DecodeHooks | None = None,
        calibrate: Callable | None = None,
    ):
        if not isinstance(generation, GenerateSettings):
            generation = GenerateSettings.from_generate(generation)
        if dustin_config is not None and dustin_config.calibration == "prompt" and calibrate is None:
            raise ValueError(
                "calibration='prompt' needs the search to run on the prompts: pass "
                "calibrate=dustin_hf.calibration.prompt.calibrate_on_prompts"
            )
        self.target, self.draft = target, draft
        self.generation, self.dustin_config, self.calibrate = generation, dustin_config, calibrate
        self.mode = VERIFIERS[dustin_config.mode if dustin_config is not None else None]
        self.drafting = drafting or Drafting()
        self.runtime = runtime or RuntimeOptions()
        self.hooks = hooks or DecodeHooks()
        self.backend = resolve_backend(
            dustin_config.backend if dustin_config is not None else self.runtime.backend, model_device(target)
        )
        # graphs need all of a model's parameters on CUDA devices (one graph per device) and a graph-safe kernel
        cuda_graphs, fused = self.runtime.cuda_graphs, self.runtime.fused_ops
        self.graphs = {
            role: (self.backend == "triton" and all_on_cuda(model)) if cuda_graphs is None else cuda_graphs
            for role, model in (("target", target), ("draft", draft))
        }
        self.fused = {
            role: (self.backend == "triton" and fused_ops_available(model)) if fused is None else fused
            for role, model in (("target", target), ("draft", draft))
        }
        for role, model in (("target", target), ("draft", draft)):
            if fused is None and self.backend == "triton" and not self.fused[role]:
                logger.info(
                    "fused decode ops are off for the %s (%s): its layers run transformers' own forwards",
                    role,
                    type(model).__name__,
                )
        self.profile = PhaseClock.mode_of(self.hooks.profile, model_device(target))  # None, "sync" or "events"
        # greedy, unprocessed and nothing returned but tokens: the forwards hand out their logits' argmax only
        self.tokens_only = not (
            generation.do_sample
            or self.drafting.confidence_threshold is not None
            or len(generation.logits_processor)
            or generation.output_scores
            or generation.output_logits
            or generation.recording
        )

    def decode_step(self, run: DecodeRun) -> None:
        """One step of ``run`` (:meth:`DecodeRun.step <dustin_hf.decode.run.DecodeRun.step>`). A profiler may wrap
        it on an instance."""
        run.step()

    # ------------------------------------------------------------------------------------------ a run
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
    ) -> DecodeResult:
        """``cache``: a transformers cache of the input's leading slots (stock's prompt reuse,
        :meth:`DustinCache.check_prefix`): the target reads only the rest of each prompt; the cache is only read."""
        run, keep = self._start(input_ids, attention_mask, position_ids, cache)
        workspace, workspaces = run.workspace, self.runtime.workspaces
        fused = [model for role, model in (("target", self.target), ("draft", self.draft)) if self.fused[role]]
        # without a holder the context makes the fused weights and gives the layers their storage back after
        weights = None if workspaces is None else workspaces.fused
        generation = None if weights is None else weights.generation
        try:
            # entered before any graph is captured: graphs keep the fused kernels and read the fused weights
            tuning = self.runtime.tuning
            with fused_ops(*fused, tuning=tuning.fused, gemm=tuning.kernels.gemm, weights=weights) as report:
                if workspace.fingerprint is None:
                    workspace.seal()
                elif weights.generation != generation:  # fits() compared the addresses the graphs read
                    raise RuntimeError("a reused workspace's fused weights were made anew; this is a bug in dustin_hf")
                result = run.decode(input_ids, self.decode_step)
        except BaseException:
            workspace.release()  # a run that failed part-way may have left a graph or the caches half made
            raise
        if workspaces is not None and keep:
            workspaces.keep(workspace)
        else:
            workspace.release()
        fused_report = {name: getattr(report, name) for name in ("norms", "mlps", "qkv")}
        result.stats.reports["fused_ops"] = {**fused_report, "rotary": list(report.rotary_modules)}
        result.stats.reports["workspace"] = {"runs": workspace.runs, "capacity": workspace.capacity}
        workspace.last_stats = result.stats
        return result

    def _start(self, input_ids: torch.Tensor, attention_mask, position_ids, cache) -> tuple[DecodeRun, bool]:
        """The call's run: its input read (:func:`~dustin_hf.decode.masks.read_batch`), the workspace it runs in
        (the held one when it fits, emptied: :mod:`dustin_hf.decode.workspace`), its drafter and the mode's
        verifier; and whether the workspace may be kept for the next call."""
        batch, padded_len = input_ids.shape
        max_length = self.generation.config.max_length
        max_new = max_length - padded_len
        if max_new < 1:
            raise ValueError(f"max_length {max_length} leaves no room after the {padded_len}-token input")
        if self.generation.streamer is not None and batch > 1:
            raise ValueError("streaming is supported for batch size 1 only")
        footprint = self.mode.footprint(self.dustin_config, self.drafting.max_gamma, self.generation.do_sample)
        room = max_new + self.drafting.max_gamma + 2 + footprint.extra_slots  # slots a row needs past its prompt
        workspaces, width = self.runtime.workspaces, capacity_for(padded_len + room)
        if workspaces is not None and workspaces.held is not None:  # the tables span the caches a run may reuse
            width = max(width, workspaces.held.capacity)
        t_cfg, d_cfg = self.target.config.get_text_config(), self.draft.config.get_text_config()
        inputs = read_batch(input_ids, attention_mask, position_ids, t_cfg.vocab_size, width, prefix=cache)
        needed = max(p.length for p in inputs.prompts) + room
        slots = inputs.slots
        span = needed if slots is None else int(slots[:, :needed].max()) + 1  # the longest distance a window sees
        windowed = [window_cuts(model, span) for model in (self.target, self.draft)]
        # captured forwards take position ids from the slots and run the fast kernels only: position ids that are
        # not the slots (a masked last input slot, the caller's position_ids), a sliding window that can cut, or
        # attentions and hidden states to return run eagerly
        eager = inputs.positions is not None or self.generation.recording
        graphs = tuple(self.graphs[role] and not eager and not cut for role, cut in zip(("target", "draft"), windowed))
        shape = Shape(
            batch=batch, backend=self.backend, graphs=graphs, fused=(self.fused["target"], self.fused["draft"]),
            tokens_only=self.tokens_only, widths=(footprint.read_width, footprint.draft_width),
            dustin_config=self.dustin_config, tuning=self.runtime.tuning, select=footprint.select,
            dense_layers=footprint.dense_layers,
        )  # fmt: skip
        workspace = workspace_for(workspaces, self.target, self.draft, shape, needed)
        window_slots = tuple(slots if cut else None for cut in windowed)
        workspace.start_run(inputs.positions, window_slots)  # tables at least as wide as its caches
        reuse = self.dustin_config is None or self.dustin_config.reuse_prefix
        # read by the loop's own prefill; prompt outputs to return come from a whole prefill
        plain = inputs.plain and not self.generation.recording
        if reuse and cache is None and plain and self.hooks.prefill is None:
            inputs = dataclasses.replace(inputs, reused=workspace.reusable([p.tokens for p in inputs.prompts]))
        settings = CallSettings(self.generation, self.hooks, self.tokens_only, self.profile)
        drafter = Drafter(self.drafting, batch, (d_cfg.vocab_size, t_cfg.vocab_size), self.tokens_only)
        verifier = self.mode(self.dustin_config, self.calibrate, self.drafting.max_gamma, window_slots[0])
        return DecodeRun(settings, workspace, drafter, verifier, inputs, max_new), footprint.keeps_workspace
