"""What calibration and evaluation read and how hard they search: plain settings, no torch.

The ``dustin-hf`` command builds its ``--help`` from these defaults, so this module imports nothing
heavy (``dustin-hf --help`` answers without loading torch or transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CalibrationSettings", "EvalSettings"]


@dataclass(frozen=True)
class CalibrationSettings:
    """What calibration reads and how hard it searches.

    Args:
        books: bundled books to take windows from (:func:`dustin_lab.texts.list_books`).
        context: tokens prefilled per book; steps sit between ``min_position`` and the window's end.
        steps_per_book: verification steps sampled per book, evenly spaced.
        min_position: earliest step position; keep it above the largest budget (else the step is dense).
        gamma: draft tokens per step (γ): the target verifies γ+1 queries.
        budgets: budgets the recovery is averaged over; ``profile_budget`` is the one written as ``budget``.
        max_draft_layers: draft scoring layers chosen at most (the paper uses 3).
        search_windows: also tune ``sink_tokens`` and ``recent_tokens`` (after the heads and ``m``).
        time_limit: seconds for the whole calibration (collection + search).
        offset: first token of each book window.
    """

    books: tuple[str, ...] = ("mobydick", "paradise_lost")
    context: int = 4096
    steps_per_book: int = 16
    min_position: int = 2048
    gamma: int = 4
    budgets: tuple[int, ...] = (256, 512, 1024)
    profile_budget: int = 512
    max_draft_layers: int = 3
    search_windows: bool = True
    time_limit: float = 1500.0
    offset: int = 0

    def __post_init__(self):
        if not self.books:
            raise ValueError("books must name at least one bundled book")
        if self.gamma < 1 or self.steps_per_book < 1 or self.max_draft_layers < 1:
            raise ValueError("gamma, steps_per_book and max_draft_layers must be >= 1")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"budgets must be positive ints, got {self.budgets}")
        if self.min_position <= max(self.budgets):
            raise ValueError(
                f"min_position ({self.min_position}) must exceed the largest budget ({max(self.budgets)}), "
                "or those steps would be verified densely"
            )
        if self.context < self.min_position + self.gamma + 2:
            raise ValueError(
                f"context ({self.context}) must exceed min_position + gamma + 1 ({self.min_position + self.gamma + 1})"
            )
        if self.time_limit <= 0:
            raise ValueError(f"time_limit must be positive seconds, got {self.time_limit}")


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate. Defaults are sized for a CPU (a 1.5B target prefills 4k tokens in minutes).

    Args:
        books: bundled books for continuations and the walk (one window per book and context).
        contexts: prompt lengths in tokens.
        budgets: Dustin budgets to compare with dense verification.
        targets: quality-knob targets (``min_recovery``) to compare as well, each with the floor ``target_budget``
            and the ceiling ``max_budget``; empty: none.
        target_budget: the knob's floor (its ``budget``).
        max_budget: the knob's ceiling (``None``: four times ``target_budget``).
        gamma: drafts per step (fixed).
        ppl_tokens: tokens after the prompt walked teacher-forced for perplexity (``(n-1)//(γ+1)`` steps).
        new_tokens: tokens generated per continuation (0: no continuations).
        offset: first token of each book window.
        needle_contexts, needle_depths, needle_books: the needle cases (their cross product).
        needle_new_tokens: answer length limit.
        exact: also continue each window in exact mode at every budget (``DustinConfig(mode="exact")``).
        recovery_every: measure recovery every this many walk steps (0: never).
        min_context: override the profile's ``min_context`` (``None``: keep it).
        criteria_budget: the budget the acceptance criteria are checked at.
        seed: needle passphrases and offsets.
    """

    books: tuple[str, ...] = ("emma",)
    contexts: tuple[int, ...] = (4096, 8192)
    budgets: tuple[int, ...] = (128, 256, 512, 1024)
    targets: tuple[float, ...] = ()
    target_budget: int = 512
    max_budget: int | None = None
    gamma: int = 4
    ppl_tokens: int = 256
    new_tokens: int = 48
    offset: int = 0
    needle_contexts: tuple[int, ...] = (4096, 8192)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_books: tuple[str, ...] = ("prideprejudice",)
    needle_new_tokens: int = 16
    exact: bool = True
    recovery_every: int = 1
    min_context: int | None = None
    criteria_budget: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.gamma < 1 or self.new_tokens < 0 or self.needle_new_tokens < 1:
            raise ValueError("gamma and needle_new_tokens must be >= 1, new_tokens >= 0")
        if self.ppl_tokens and self.ppl_tokens < self.gamma + 2:
            raise ValueError(f"ppl_tokens must be 0 (no walk) or >= gamma + 2 = {self.gamma + 2}")
        if not self.budgets or min(self.budgets) < 1 or not self.contexts or min(self.contexts) < 2:
            raise ValueError("budgets and contexts must be non-empty lists of positive ints")
        if any(not 0 < t <= 1 for t in self.targets):
            raise ValueError(f"targets are recovery shares in (0, 1] (e.g. 0.8,0.9,0.95), got {self.targets}")
