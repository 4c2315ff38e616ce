"""What a decode run did: step counts, acceptance, reads, timing and reports, returned with its tokens.

The loop fills one :class:`RunStats` per ``generate`` call and hands it back in its result; a returned cache's
``stats`` (``out.past_key_values.stats``, ``out.cache.stats`` from transformers 5.24) and a patched model's held
workspace (``handle.workspaces.held.last_stats``) show the same numbers, as a plain dict
(:meth:`RunStats.as_dict`, the documented keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunStats"]


@dataclass
class RunStats:
    """Counters of one decode run. ``as_dict`` is the user-facing view (``cache.stats``)."""

    sparse_steps: int = 0  # verification forwards that read a selection (for at least one row)
    dense_steps: int = 0
    attended_sum: float = 0.0  # sum over sparse steps of the mean cached positions read per row and layer
    sparse_attended_sum: float = 0.0  # sum over sparse row-steps (rows reading less than they hold) of the same
    sparse_row_steps: int = 0
    verified_tokens: int = 0  # draft tokens proposed to the target (unfinished rows)
    accepted_tokens: int = 0  # draft tokens the target kept
    steps: int = 0  # verification forwards
    draft_sparse_forwards: int = 0  # draft forwards that read a selection (DustinConfig.sparse_draft)
    draft_forwards_ahead: int = 0  # first draft forwards queued by the step before, ahead of its sync
    steps_drafted_ahead: int = 0  # steps that queued the next step's first draft forwards (the last step's go unused)
    trace: list = field(default_factory=list)  # per step: (γ, drafts each row accepted; -1: row finished)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    generated_tokens: int = 0
    step_end_times: list[float] = field(default_factory=list)  # host clock after each step's sync, from decode start
    step_tokens: list[int] = field(default_factory=list)  # tokens all rows committed at each step
    reports: dict = field(default_factory=dict)  # "cuda_graphs", "fused_ops", "calibration", "phase_seconds", ...
    budgets: list[int] = field(default_factory=list)  # the quality knob: positions each row read, per sparse step
    recoveries: list[float] = field(default_factory=list)  # ... and its estimated recovery
    fallbacks: int = 0  # ... row-steps read in full because the ceiling fell short of the target
    held: list[int] = field(default_factory=list)  # per row: the most cached positions it held at a verification
    sparse_rows: set[int] = field(default_factory=set)  # rows that read less than they held at some step

    def record_knob(self, counts: list[int], recovery: list[float], fallback: list[bool], active: list[int]) -> None:
        """The quality knob's read sets of one step, for the rows that were unfinished before it."""
        self.budgets += [counts[b] for b in active]
        self.recoveries += [recovery[b] for b in active]
        self.fallbacks += sum(fallback[b] for b in active)

    def record_step(
        self,
        row_gamma: list[int],
        accepted: list[int],
        committed: list[int],
        active: list[int],
        sparse: bool,
        attended: list[tuple[float, bool]] | None,
        seqlens: list[int],
    ) -> None:
        """Count one step: ``row_gamma[b]`` drafts proposed, ``accepted[b]`` kept and ``committed[b]`` tokens
        appended per row; ``active``: the rows that were unfinished before it; ``attended``: on a sparse step, per
        active row, the mean cached positions it read per layer and whether it read less than it holds;
        ``seqlens``: the cached positions each row held at the verification."""
        if not self.held:
            self.held = [0] * len(seqlens)
        for b in active:
            self.held[b] = max(self.held[b], seqlens[b])
        if attended is not None:
            self.sparse_rows.update(b for b, (_, partial) in zip(active, attended) if partial)
        self.steps += 1
        self.verified_tokens += sum(row_gamma[b] for b in active)
        self.accepted_tokens += sum(committed[b] - 1 for b in active if committed[b])  # the drafts kept
        self.trace.append((max(row_gamma), [accepted[b] if b in active else -1 for b in range(len(accepted))]))
        if sparse:
            self.sparse_steps += 1
            self.attended_sum += sum(reads for reads, _ in attended) / max(len(attended), 1)
            sparse_reads = [reads for reads, partial in attended if partial]
            self.sparse_attended_sum += sum(sparse_reads)
            self.sparse_row_steps += len(sparse_reads)
        else:
            self.dense_steps += 1

    def as_dict(self) -> dict:
        sparse = self.sparse_steps
        return {
            "sparse_steps": sparse,
            "dense_steps": self.dense_steps,
            "mean_attended": self.attended_sum / sparse if sparse else 0.0,
            "mean_attended_sparse": self.sparse_attended_sum / self.sparse_row_steps if self.sparse_row_steps else 0.0,
            "steps": self.steps,
            "draft_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0,
            "mean_accepted_per_step": (self.accepted_tokens / self.steps) if self.steps else 0.0,
            "draft_sparse_forwards": self.draft_sparse_forwards,
            "draft_forwards_ahead": self.draft_forwards_ahead,
            "steps_drafted_ahead": self.steps_drafted_ahead,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "generated_tokens": self.generated_tokens,
            "step_end_times": list(self.step_end_times),
            "step_tokens": list(self.step_tokens),
            **({"knob": self._knob()} if self.budgets else {}),
            **self.reports,
        }

    def _knob(self) -> dict:
        """The realised budgets: mean, median, 95th percentile, max; the mean estimated recovery; dense fallbacks."""
        ordered = sorted(self.budgets)

        def quantile(q: float) -> int:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {
            "budget_mean": sum(ordered) / len(ordered),
            "budget_p50": quantile(0.5),
            "budget_p95": quantile(0.95),
            "budget_max": ordered[-1],
            "estimated_recovery": sum(self.recoveries) / len(self.recoveries),
            "dense_fallbacks": self.fallbacks,
            "row_steps": len(ordered),
        }
