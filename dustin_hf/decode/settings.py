"""What a :class:`~dustin_hf.decode.decoder.SpeculativeDecoder` is set up with, in three small groups.

- :class:`GenerateSettings`: what ``generate()`` prepared (logits processors, stopping criteria, EOS and pad ids,
  which outputs to return, the streamer), read once from the generation config;
- :class:`Drafting`: how the draft proposes (γ, its schedule, the confidence stop);
- :class:`RuntimeOptions`: how the loop runs on the hardware (attention backend, CUDA graphs, fused ops, launch
  tuning, and the workspaces that keep caches and graphs between calls).

Each is fixed for the decoder's life; what changes per call lives on the run (:mod:`dustin_hf.decode.run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from ..runtime.tuning import Tuning
from .rows import token_ids
from .workspace import Workspaces

__all__ = ["DRAFT_SCHEDULES", "Drafting", "GenerateSettings", "RuntimeOptions"]

DRAFT_SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# a row's draft length under the "heuristic" schedule grows by 2 after a step that kept all its drafts; it stops
# growing here (every length is a forward shape, and a CUDA graph each)
_HEURISTIC_MAX = 16


@dataclass(frozen=True)
class Drafting:
    """How the draft proposes.

    Args:
        num_draft_tokens: γ, draft tokens per step (each row's starting length under a schedule).
        confidence_threshold: a row stops drafting after a draft whose probability under the draft's processed
            distribution is below it (transformers' ``ConfidenceCriteria``, per row); ``None`` never stops early.
        schedule: ``"constant"`` (every row drafts ``num_draft_tokens``), or ``"heuristic"`` /
            ``"heuristic_transient"`` (transformers' schedule, per row: +2 after a step that kept all the row's
            drafts, else -1, at least 1, at most 16). A run's result holds the rows' lengths after it.
    """

    num_draft_tokens: int = 4
    confidence_threshold: float | None = None
    schedule: str = "constant"

    def __post_init__(self):
        gamma = self.num_draft_tokens
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
            raise ValueError(
                f"num_draft_tokens (the draft's generation_config.num_assistant_tokens) must be an int "
                f">= 1, got {gamma!r}"
            )
        if self.schedule not in DRAFT_SCHEDULES:
            raise ValueError(f"num_assistant_tokens_schedule must be one of {DRAFT_SCHEDULES}, got {self.schedule!r}")
        if self.confidence_threshold is not None and not 0 <= self.confidence_threshold <= 1:
            raise ValueError(
                f"assistant_confidence_threshold must be in [0, 1] or None, got {self.confidence_threshold!r}"
            )

    @property
    def max_gamma(self) -> int:
        """The most drafts any row proposes in a step: caches and the sparse draft's read sets are sized by it."""
        return self.num_draft_tokens if self.schedule == "constant" else max(self.num_draft_tokens, _HEURISTIC_MAX)


@dataclass(frozen=True)
class RuntimeOptions:
    """How the loop runs on the hardware.

    Args:
        backend: attention backend for dense verification (Dustin uses its config's ``backend``).
        cuda_graphs: capture the fixed-shape forwards in CUDA graphs (a model split over GPUs: one graph per
            device, see :class:`~dustin_hf.runtime.pipeline.Pipeline`); ``None``: for each model whose parameters
            are all on CUDA, when the backend is graph-safe (``"triton"``).
        fused_ops: run the models' RMSNorms, rotary embeddings and SiLU·mul through one-launch Triton kernels
            and their q/k/v and gate/up projections as one GEMM each (:mod:`dustin_hf.runtime.fused`; rotary
            bit-exact, RMSNorm within 2 ulps, fused GEMMs may round differently); ``None``: for each model
            whose parameters are all on CUDA, when the backend is ``"triton"``. ``tuning.fused`` turns each fused
            path off on its own (:class:`~dustin_hf.runtime.projections.FusedTuning`).
        tuning: the GPU path's launch heuristics and fused projections (:class:`~dustin_hf.runtime.tuning.Tuning`);
            ``None``: the measured defaults. Benchmarks compare variants by passing their own.
        workspaces: where a run takes the caches, CUDA graphs and fused weights of an earlier run of the same
            shape and leaves its own for the next (:mod:`dustin_hf.decode.workspace`; a patched model's
            ``DustinPatch.workspaces``); ``None``: built for each run and released after it.
    """

    backend: str = "auto"
    cuda_graphs: bool | None = None
    fused_ops: bool | None = None
    tuning: Tuning = field(default_factory=Tuning)
    workspaces: Workspaces | None = None

    def __post_init__(self):
        if self.tuning is None:
            object.__setattr__(self, "tuning", Tuning())


@dataclass(frozen=True)
class GenerateSettings:
    """What ``generate()`` prepared, as the loop reads it (build with :meth:`from_generate`)."""

    config: object  # the target's prepared GenerationConfig
    logits_processor: list  # as generate() prepared it (a LogitsProcessorList; empty: none)
    min_length_from_new: bool  # min_new_tokens was set (generate() turned it into a padded-width min_length)
    do_sample: bool
    eos: list[int]
    pad: int  # the id written after a row stops
    max_time: MaxTimeCriteria | None  # checked after every step, for the whole batch
    row_criteria: tuple  # other stopping criteria, evaluated per row and token (EOS and length are native)
    output_scores: bool
    output_logits: bool
    output_attentions: bool
    output_hidden_states: bool
    streamer: object | None  # receives each step's new tokens (batch size 1 only)

    @classmethod
    def from_generate(
        cls, generation_config, logits_processor=None, stopping_criteria=None, streamer=None
    ) -> GenerateSettings:
        """From ``generate()``'s prepared config, processors and criteria (each may be ``None``)."""
        eos = token_ids(getattr(generation_config, "_eos_token_tensor", None), generation_config.eos_token_id)
        pad = token_ids(getattr(generation_config, "_pad_token_tensor", None), generation_config.pad_token_id)
        max_time, row_criteria = None, []
        for criterion in stopping_criteria or []:
            if isinstance(criterion, MaxTimeCriteria):
                max_time = criterion
            elif not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
                row_criteria.append(criterion)
        returned = bool(generation_config.return_dict_in_generate)
        return cls(
            config=generation_config,
            logits_processor=logits_processor if logits_processor is not None else [],
            min_length_from_new=getattr(generation_config, "min_new_tokens", None) is not None,
            do_sample=bool(generation_config.do_sample),
            eos=eos,
            pad=pad[0] if pad else (eos[0] if eos else 0),
            max_time=max_time,
            row_criteria=tuple(row_criteria),
            output_scores=returned and bool(generation_config.output_scores),
            output_logits=returned and bool(generation_config.output_logits),
            output_attentions=returned and bool(generation_config.output_attentions),
            output_hidden_states=returned and bool(generation_config.output_hidden_states),
            streamer=streamer,
        )

    @property
    def recording(self) -> bool:
        """Attentions or hidden states are returned (such runs run eagerly)."""
        return self.output_attentions or self.output_hidden_states
