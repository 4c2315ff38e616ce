"""What benchmarks and evaluation plug into a decode run: replayed acceptance, a stored prefill, phase timing.

The library never needs any of it: ``generate()`` runs without hooks. A benchmark passes one
:class:`DecodeHooks` to :class:`~dustin_hf.decode.decoder.SpeculativeDecoder` instead of reaching into the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["DecodeHooks", "PhaseClock", "synchronize"]


@dataclass(frozen=True)
class DecodeHooks:
    """Ways to observe or steer a decode run from outside it.

    Args:
        accept: replayed acceptance: maps the computed ``n_accepted (B,)`` (a device tensor) to the counts to
            keep (a device tensor, clamped to ``[0, γ]``); the target's own token follows them. GPU benchmarks use
            it to run random weights at the acceptance of a recorded trace.
        prefill: replaces :meth:`~dustin_hf.decode.runner.ModelRunner.prefill` (same signature and results), to start
            from a stored prefill (evaluation) or from random K/V (benchmarks).
        confirm: exact mode's replayed acceptance: ``confirm(n_accepted (B,), tentative (B,), dense (B,) bool)``
            where each row's block holds ``tentative[b]`` tentative tokens before its drafts (0 for a row not
            confirming this step) and ``dense[b]`` says whether the row's verification read everything this step;
            returns the counts to keep (a confirming row keeps ``min(n, tentative)`` of its tentative tokens, then
            drafts only if it kept them all). ``None``: ``accept`` serves exact mode too.
        budgets: the quality knob's replayed read-set sizes: ``budgets(seqlens)`` returns each row's count for
            this step (host ints), used instead of the counts the estimate would pick (clamped to the row's
            context); ``None``: the estimate picks.
        profile: record each step's time per phase in ``stats["phase_seconds"]`` (and the host's time between
            the same marks in ``stats["phase_host_seconds"]``): ``True`` or ``"sync"`` synchronises the device
            between phases (each phase's own cost; slows decoding), ``"events"`` reads CUDA events instead (the
            GPU timeline of undisturbed steps, idle time included). Leave it off when measuring throughput.
        queue_eagerly: queue the next step's first draft forwards even where no CUDA graph is captured, running
            them eagerly (:meth:`~dustin_hf.decode.runner.ModelRunner.step_ahead`): what the graphs do on a GPU,
            on any device, so that tests on the CPU run the queued path. A step then waits for the device.
    """

    accept: Callable[[torch.Tensor], torch.Tensor] | None = None
    confirm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    budgets: Callable[[list[int]], list[int]] | None = None
    prefill: Callable | None = None
    profile: bool | str | None = None
    queue_eagerly: bool = False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseClock:
    """Time per phase of each decode step, in one of two modes.

    ``"sync"`` synchronises the device at every mark and charges the wall time since the previous mark:
    each phase's own cost with nothing overlapping it, but the step is slower than undisturbed.
    ``"events"`` (CUDA only) records an event on the device's stream at every mark and charges the GPU
    timeline between consecutive events: an undisturbed step split where its time goes, including the
    stretches where the GPU waited for the host; the host's own time between marks is kept beside it
    (``host_steps``). Nothing synchronises until the times are read.
    """

    def __init__(self, device: torch.device, mode: str | None):
        self.device, self.mode = device, self.mode_of(mode, device)
        # a mark is (CUDA event or None, host time); per finished step: (phase, mark before, mark after) per phase
        self._steps: list[list[tuple[str, tuple, tuple]]] = []
        self._current: list[tuple[str, tuple, tuple]] = []
        self._last: tuple[object, float] = (self._stamp(), time.perf_counter())  # the clock starts when made

    @staticmethod
    def mode_of(profile, device: torch.device) -> str | None:
        """The mode a decoder's ``profile`` argument asks for (``False``/``None``: off, ``True``: ``"sync"``)."""
        mode = "sync" if profile is True else None if profile is False or profile is None else profile
        if mode not in (None, "sync", "events"):
            raise ValueError(f"profile must be False, True/'sync' or 'events', got {profile!r}")
        if mode == "events" and device.type != "cuda":
            raise ValueError("profile='events' times the GPU timeline and needs a CUDA device")
        return mode

    def _stamp(self):
        if self.mode != "events":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to ``phase`` of the current step."""
        if self.mode is None:
            return
        if self.mode == "sync":
            synchronize(self.device)
        self._current.append((phase, self._last, (self._stamp(), time.perf_counter())))
        self._last = self._current[-1][2]

    def end_step(self) -> None:
        if self.mode is not None:
            self._steps.append(self._current)
            self._current = []

    @property
    def steps(self) -> list[dict[str, float]]:
        """Seconds per phase, one dict per finished step: wall time (``"sync"``) or GPU timeline (``"events"``)."""
        if self.mode == "events":
            synchronize(self.device)
            return [self._sum(step, lambda a, b: a[0].elapsed_time(b[0]) / 1e3) for step in self._steps]
        return self.host_steps

    @property
    def host_steps(self) -> list[dict[str, float]]:
        """Host seconds between the marks, one dict per finished step."""
        return [self._sum(step, lambda a, b: b[1] - a[1]) for step in self._steps]

    @staticmethod
    def _sum(step, elapsed) -> dict[str, float]:
        out: dict[str, float] = {}
        for phase, begin, end in step:
            out[phase] = out.get(phase, 0.0) + elapsed(begin, end)
        return out
