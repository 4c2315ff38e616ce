"""Replayed outcomes for the end-to-end benchmark: what each step keeps, from traces of the real pair.

The GPU benchmark runs random-weight models of the real shapes, whose drafts are meaningless, so every
step's outcome is replayed through :class:`~dustin_hf.decode.hooks.DecodeHooks` while all compute stays real.
One small class per kind of outcome:

* :class:`CountReplay`: per-step accepted counts cycled from acceptance traces
  (``dustin_hf.acceptance_trace/1``) or the paper's mean; a row's counts do not depend on its text.
* :class:`AcceptReplay`: plain speculative steps (classic, Dustin, a knob step). Each row walks a recorded
  text; at its position ``p`` the drafts kept are the longest ``i``-prefix on which the draft's prediction
  equals the verifier's at ``p + i``; the row then moves ``kept + 1`` positions on.
* :class:`ExactReplay`: exact mode (and its ``confirm_tokens=0`` form, the lossless sparse-draft baseline).
  Each row keeps a committed pointer and a tentative end: a sparse step checks drafts against the sparse
  target from the tentative end (what it keeps turns tentative), a dense step against the dense target (what
  it keeps is committed), a confirmation checks the tentative tokens (the sparse target's predictions) against
  the dense target's from the committed pointer, then, if all survive, the drafts after them.
* :class:`BudgetReplay`: the quality knob's per-step read-set sizes, recorded at a short context and scaled to
  the benchmark's.

The per-position predictions come from ``dustin_hf.prediction_trace/1`` files (:func:`load_predictions`):
teacher-forced on a book or source text, entry ``j`` of each list is about the token at ``context + j``,
predicted on the true prefix by the dense target, the sparse target (``budget`` positions), the dense draft and
the sparse draft. Teacher forcing walks the recorded text rather than the text a method generates, so every
method is replayed on the same tokens. Acceptance and confirmation run on the device from the hooks' device
tensors (no host sync beyond the loop's own).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from dustin_hf.experimental import device_tensor
from dustin_lab import traces  # the trace formats and their readers, written by the lab
from dustin_lab.traces import PREDICTION_FORMAT, PREDICTION_KEYS

__all__ = [
    "AcceptReplay",
    "BudgetReplay",
    "CountReplay",
    "ExactReplay",
    "PAPER_COUNTS",
    "PREDICTION_FORMAT",
    "PREDICTION_KEYS",
    "Predictions",
    "at_budget",
    "load_budgets",
    "load_predictions",
    "synthetic_budgets",
    "synthetic_predictions",
]

PAPER_COUNTS = (1, 1, 1, 1, 2)  # drafts accepted per step: the paper's mean of 2.2 tokens per step


def _cycled(values, batch: int, step: int) -> list:
    """Entry ``step`` of each row's walk through ``values``: row ``b`` starts at ``b * n // batch``, cycling.

    Evenly spaced starts give every row the whole sequence (consecutive entries handed across the rows would
    give row ``b`` only the entries at ``b mod batch`` whenever the length is a multiple of the batch)."""
    n = len(values)
    return [values[(b * n // batch + step) % n] for b in range(batch)]


def _prefix(match: torch.Tensor) -> torch.Tensor:
    """``(B,)`` length of each row's leading run of ``True`` in ``match (B, W)``."""
    return match.long().cumprod(dim=1).sum(dim=1)


# ----------------------------------------------------------------------------- accepted counts
@dataclass(frozen=True)
class CountReplay:
    """Per step and row, the drafts accepted, cycled from acceptance traces (or the paper's mean)."""

    counts: tuple[int, ...]
    source: str

    @classmethod
    def load(cls, paths: list[str] | None, gamma: int) -> "CountReplay":
        """Pool the per-step accepted counts of ``paths`` (``dustin_hf.acceptance_trace/1``); none: the paper's."""
        if not paths:
            return cls(
                PAPER_COUNTS,
                f"fixed pattern {list(PAPER_COUNTS)}, mean "
                f"{statistics.mean(PAPER_COUNTS) + 1:.1f} tokens per step (paper)",
            )
        from dustin_lab.traces import load_trace

        flat, names = [], []
        for path in paths:
            record = load_trace(path)
            if record["gamma"] != gamma:
                raise ValueError(f"{path}: recorded with γ={record['gamma']}, the benchmark runs γ={gamma}")
            flat += [n for seq in record["sequences"] for n in seq["accepted"]]
            names.append(Path(path).name)
        if not flat:
            raise ValueError(f"{paths}: no accepted counts")
        return cls(
            tuple(flat),
            f"recorded traces {', '.join(names)} ({len(flat)} steps, mean "
            f"{statistics.mean(flat) + 1:.2f} tokens/step; each row replays them in order from "
            "its own offset, cycled)",
        )

    def hooks(self) -> dict:
        """Fresh :class:`~dustin_hf.decode.hooks.DecodeHooks` fields for one run: ``accept``."""
        step = [0]

        def accept(n_accepted: torch.Tensor) -> torch.Tensor:
            values = _cycled(self.counts, n_accepted.shape[0], step[0])
            step[0] += 1
            return device_tensor(values, n_accepted.device)  # no host sync: the loop's own stays the only one

        return {"accept": accept}


# ----------------------------------------------------------------------------- per-position predictions
@dataclass(frozen=True)
class Predictions:
    """One prediction trace: per position after ``context``, each model's teacher-forced argmax."""

    name: str
    context: int
    gamma: int
    budget: int
    tokens: dict  # key (PREDICTION_KEYS) -> list[int], all the same length
    pair: str = "the real pair"  # whose predictions they are, in words
    selection: str = "dustin"  # who chose the sparse target's read sets (DustinConfig.selection)

    def __len__(self) -> int:
        return len(self.tokens["truth"])


def load_predictions(paths: list[str], gamma: int) -> list[Predictions]:
    """Read ``dustin_hf.prediction_trace/1`` files (extra keys are ignored), checking their tag, γ and lists."""
    out = []
    for path in paths:
        record = traces.load_predictions(path)  # its tag, its lists of one length
        if record.get("gamma") != gamma:
            raise ValueError(f"{path}: recorded with γ={record.get('gamma')}, the benchmark runs γ={gamma}")
        lists = record["predictions"]
        if not lists["truth"]:
            raise ValueError(f"{path}: the prediction lists are empty")
        pair = record.get("model_pair") or {}
        out.append(
            Predictions(
                Path(path).name,
                int(record["context"]),
                gamma,
                int(record["budget"]),
                {key: [int(t) for t in lists[key]] for key in PREDICTION_KEYS},
                " + ".join(str(v) for v in pair.values()) or "the real pair",
                traces.selection_of(record.get("config")),
            )
        )
    return out


def at_budget(traces: list[Predictions], budget: int, selection: str = "dustin") -> list[Predictions]:
    """The traces whose sparse predictions read ``budget`` positions chosen by ``selection`` (an error naming what
    there is)."""
    chosen = [t for t in traces if t.budget == budget and t.selection == selection]
    if not chosen:
        recorded = sorted({(t.selection, t.budget) for t in traces})
        raise ValueError(
            f"no prediction trace recorded at budget {budget} with selection {selection!r} (recorded: "
            f"{', '.join(f'{s} {b}' for s, b in recorded)}); record one or change the method's budget"
        )
    return chosen


def synthetic_predictions(
    length: int = 512, gamma: int = 4, budget: int = 32, seed: int = 0, selection: str = "dustin"
) -> Predictions:
    """A SYNTHETIC trace (not the real pair) for checks without recorded files: the dense target follows the
    text 9 times in 10, the sparse target the dense one 9 in 10, the drafts their verifiers 7 in 10; ``selection``:
    whose read sets it stands for."""
    rng = random.Random(seed)

    def follow(tokens, p):
        return [t if rng.random() < p else rng.randrange(1000) for t in tokens]

    truth = [rng.randrange(1000) for _ in range(length)]
    dense = follow(truth, 0.9)
    sparse = follow(dense, 0.9)
    draft = follow(dense, 0.7)
    draft_sparse = follow(draft, 0.95)
    lists = dict(truth=truth, dense=dense, sparse=sparse, draft=draft, draft_sparse=draft_sparse)
    return Predictions("synthetic", 4096, gamma, budget, lists, "SYNTHETIC texts (not the real pair)", selection)


class _Walks:
    """Several recorded texts' predictions as one tensor per key, and each row's cyclic walk over one text.

    Row ``b`` of a batch starts at the evenly spaced offset ``b * N // batch`` of the concatenated texts (so rows
    cover them in proportion to their lengths) and cycles inside the text it starts in."""

    def __init__(self, traces: list[Predictions], keys: tuple[str, ...]):
        self.keys = keys
        self.lengths = [len(t) for t in traces]
        self.table = {key: torch.tensor([tok for t in traces for tok in t.tokens[key]]) for key in keys}
        self.names = [t.name for t in traces]
        self.pairs = sorted({t.pair for t in traces})
        self._on: dict = {}

    @property
    def positions(self) -> int:
        return sum(self.lengths)

    def rows(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(first, length, offset)``, each ``(B,)`` on ``device``: where each row's text starts in the table,
        its length, and the row's starting position in it."""
        first, length, offset = [], [], []
        for b in range(batch):
            at, start = b * self.positions // batch, 0
            for n in self.lengths:
                if at < start + n:
                    break
                start += n
            first.append(start)
            length.append(n)
            offset.append(at - start)
        return tuple(device_tensor(v, device, torch.long) for v in (first, length, offset))

    def agree(self, a: str, b: str, first, length, pos, width: int) -> torch.Tensor:
        """``(B, width)``: whether predictions ``a`` and ``b`` agree at each row's positions ``pos .. pos+width-1``."""
        if pos.device not in self._on:
            self._on[pos.device] = {key: t.to(pos.device) for key, t in self.table.items()}
        table = self._on[pos.device]
        index = first[:, None] + (pos[:, None] + torch.arange(width, device=pos.device)) % length[:, None]
        return table[a][index] == table[b][index]

    def describe(self) -> str:
        """Whose predictions, on which files, in words."""
        return (
            f"teacher-forced predictions of {', '.join(self.pairs)} ({', '.join(self.names)}; {self.positions} "
            "positions)"
        )


class AcceptReplay:
    """Plain speculative steps: the drafts the ``verifier`` keeps of the ``draft``'s, on each row's text.

    Args:
        traces: the recorded texts (:func:`load_predictions`).
        draft: the prediction key of the drafts (``"draft"`` or ``"draft_sparse"``).
        verifier: the prediction key of the verifying target (``"dense"`` or ``"sparse"``).
        gamma: drafts per step.
        note: appended to :attr:`source` (what the replay stands in for, if not plain).
    """

    def __init__(self, traces: list[Predictions], draft: str, verifier: str, gamma: int, note: str = ""):
        self.walks, self.draft, self.verifier, self.gamma = _Walks(traces, (draft, verifier)), draft, verifier, gamma
        budget = f" at budget {traces[0].budget}" if "sparse" in (draft + verifier) else ""
        self.source = (
            f"{self.walks.describe()}: drafts kept = the longest prefix where the {draft} argmax equals "
            f"the {verifier} target's{budget}, each row walking one recorded text from its own offset (mean "
            f"{self.mean_tokens_per_step():.2f} tokens/step){note}"
        )

    def hooks(self) -> dict:
        """Fresh :class:`~dustin_hf.decode.hooks.DecodeHooks` fields for one run: ``accept``."""
        state = {}

        def accept(n_accepted: torch.Tensor) -> torch.Tensor:
            if not state:
                state["first"], state["length"], state["pos"] = self.walks.rows(n_accepted.shape[0], n_accepted.device)
            kept = _prefix(
                self.walks.agree(self.draft, self.verifier, state["first"], state["length"], state["pos"], self.gamma)
            )
            state["pos"] = state["pos"] + kept + 1
            return kept

        return {"accept": accept}

    def mean_tokens_per_step(self, batch: int = 16, steps: int = 256) -> float:
        """Tokens per step the replay hands out, walked on the CPU as a run of ``batch`` rows would."""
        accept = self.hooks()["accept"]
        zeros = torch.zeros(batch, dtype=torch.long)
        return statistics.mean(float(accept(zeros).float().mean()) + 1 for _ in range(steps))


class ExactReplay:
    """Exact mode's outcomes (:attr:`~dustin_hf.decode.hooks.DecodeHooks.confirm`) on each row's recorded text.

    A row with ``tentative[b] = t > 0`` confirms: its tentative tokens are the sparse target's predictions at
    the committed pointer ``c .. c+t-1``; it keeps the longest prefix ``j`` the dense target agrees with and
    returns ``j < t``, or, all kept, ``t + m`` with ``m`` the drafts the dense target keeps after them; both
    pointers move to ``c + kept + 1``. A row with ``t = 0`` verifies its drafts from its tentative end ``e``:
    against the dense target when ``dense[b]`` (committed: both pointers move on), else against the sparse
    target (tentative: only ``e`` moves).

    Args:
        traces: the recorded texts at the method's budget (:func:`load_predictions`).
        draft: the drafts' prediction key (``"draft_sparse"`` with ``sparse_draft=True``).
        gamma: drafts per step.
        max_tentative: the most tentative tokens a row can hold (the confirm check's static width).
        note: appended to :attr:`source`.
    """

    def __init__(self, traces: list[Predictions], draft: str, gamma: int, max_tentative: int, note: str = ""):
        self.walks = _Walks(traces, (draft, "sparse", "dense"))
        self.draft, self.gamma, self.width = draft, gamma, max_tentative
        self.source = (
            f"{self.walks.describe()}, budget "
            f"{traces[0].budget}: sparse steps keep the longest prefix where the {draft} argmax equals "
            f"the sparse target's (tentative), dense steps where it equals the dense target's; a "
            f"confirmation keeps the tentative tokens while the sparse and dense targets' argmax agree, "
            f"then the drafts the dense target keeps; each row walks one recorded text from its own "
            f"offset with a committed and a tentative pointer{note}"
        )

    def hooks(self) -> dict:
        """Fresh :class:`~dustin_hf.decode.hooks.DecodeHooks` fields for one run: ``confirm``."""
        state = {}

        def confirm(n_accepted: torch.Tensor, tentative: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
            device = n_accepted.device
            if not state:
                state["first"], state["length"], state["committed"] = self.walks.rows(n_accepted.shape[0], device)
                state["end"] = state["committed"].clone()
            first, length, c, e = state["first"], state["length"], state["committed"], state["end"]
            t, dense = tentative.to(device).long(), dense.to(device).bool()
            agree = lambda a, b, pos, width: self.walks.agree(a, b, first, length, pos, width)  # noqa: E731
            # a confirmation: the tentative tokens c..c+t-1 survive while the two targets agree, then the drafts
            beyond = torch.arange(self.width, device=device)[None, :] >= t[:, None]
            kept = torch.minimum(_prefix(agree("sparse", "dense", c, self.width) | beyond), t)
            after = _prefix(agree(self.draft, "dense", c + t, self.gamma))
            confirmed = torch.where(kept < t, kept, t + after)
            # no tentative tokens: drafts from the tentative end against the dense or the sparse target
            plain = torch.where(
                dense,
                _prefix(agree(self.draft, "dense", e, self.gamma)),
                _prefix(agree(self.draft, "sparse", e, self.gamma)),
            )
            confirming = t > 0
            out = torch.where(confirming, confirmed, plain)
            committed = torch.where(confirming, c + out + 1, torch.where(dense, e + out + 1, c))
            state["end"] = torch.where(confirming | dense, committed, e + out + 1)
            state["committed"] = committed
            return out

        return {"confirm": confirm}


# ----------------------------------------------------------------------------- the knob's budgets
@dataclass(frozen=True)
class BudgetReplay:
    """The quality knob's read-set sizes (:attr:`~dustin_hf.decode.hooks.DecodeHooks.budgets`), cycled per row.

    ``counts`` are already scaled to the benchmark's context; ``floor`` and ``ceiling`` are the run's
    ``budget`` and ``max_budget``; ``min_recovery`` the recorded target."""

    counts: tuple[int, ...]
    floor: int
    ceiling: int
    min_recovery: float
    source: str

    def hooks(self) -> dict:
        """Fresh :class:`~dustin_hf.decode.hooks.DecodeHooks` fields for one run: ``budgets``."""
        step = [0]

        def budgets(seqlens: list[int]) -> list[int]:
            values = _cycled(self.counts, len(seqlens), step[0])
            step[0] += 1
            return values

        return {"budgets": budgets}

    @property
    def mean(self) -> float:
        """Mean positions read over the replayed steps that did not read their row in full."""
        sparse = [c for c in self.counts if c != _FULL]
        return statistics.mean(sparse) if sparse else float("nan")

    @property
    def read_in_full(self) -> float:
        """The share of replayed row-steps that read their row in full (dense fallbacks)."""
        return sum(c == _FULL for c in self.counts) / len(self.counts)


_FULL = 2**31 - 1  # a replayed count that reads the row in full: it reaches any row's cached positions


def load_budgets(paths: list[str], context: int, min_recovery: float | None = None) -> BudgetReplay:
    """Read ``dustin_hf.knob_trace/1`` files and scale their per-step counts to ``context``.

    Each count recorded at context ``C`` becomes ``round(count * context / C)``, clamped to ``[budget,
    max_budget * context / C]`` (the recorded floor stays the floor); a step that read its row in full (a dense
    fallback: the count reached the row's recorded ``seqlens``) reads the benchmark's row in full too (``context``
    and more). ``min_recovery``: use only the files recorded at that target (``None``: every file must share
    one). The files are :func:`dustin_lab.traces.knob_trace_record`'s."""
    records = [(Path(path).name, traces.load_knob_trace(path)) for path in paths]  # each checks its tag
    if min_recovery is not None:
        records = [(name, r) for name, r in records if r["min_recovery"] == min_recovery]
    targets = sorted({r["min_recovery"] for _, r in records})
    floors = sorted({r["budget"] for _, r in records})
    if len(targets) != 1 or len(floors) != 1:
        raise ValueError(
            f"knob traces {[name for name, _ in records]} must share one min_recovery and one budget "
            f"(got targets {targets}, budgets {floors}); pick a target with --knob-target"
        )
    floor, counts, ceilings = floors[0], [], []
    for _, record in records:
        scale = context / record["context"]
        ceiling = max(floor, round(record["max_budget"] * scale))
        ceilings.append(ceiling)
        steps = list(zip(record["counts"], record["seqlens"]))
        rows = max((len(step) for step, _ in steps), default=0)
        for r in range(rows):  # each recorded row's steps in order, rows one after another
            counts += [
                _FULL if step[r] >= seqlens[r] else min(max(round(step[r] * scale), floor), ceiling)
                for step, seqlens in steps
                if r < len(step) and step[r] is not None
            ]
    if not counts:
        raise ValueError(f"knob traces {[name for name, _ in records]}: no counts")
    full = sum(c == _FULL for c in counts)
    names = ", ".join(name for name, _ in records)
    scales = ", ".join(sorted({f"{context}/{r['context']}" for _, r in records}))
    pairs = sorted({" + ".join(str(v) for v in r["model_pair"].values()) for _, r in records if r.get("model_pair")})
    return BudgetReplay(
        tuple(counts),
        floor,
        max(ceilings),
        float(targets[0]),
        f"knob budgets recorded{' on ' + ', '.join(pairs) if pairs else ''} at min_recovery="
        f"{targets[0]} ({names}; {len(counts)} row-steps), scaled by {scales} and clamped to [{floor}, "
        f"{max(ceilings)}]: mean {statistics.mean([c for c in counts if c != _FULL] or [0]):.0f} "
        f"positions over the steps that did not read in full, {full} of {len(counts)} row-steps read in full (dense "
        "fallbacks), each row cycling from its own offset",
    )


def synthetic_budgets(context: int, floor: int, ceiling: int, seed: int = 0) -> BudgetReplay:
    """SYNTHETIC knob budgets (not the real pair), uniform in ``[floor, ceiling]``, for checks without traces."""
    rng = random.Random(seed)
    counts = tuple(rng.randint(floor, ceiling) for _ in range(97))
    return BudgetReplay(
        counts,
        floor,
        ceiling,
        0.9,
        f"SYNTHETIC knob budgets uniform in [{floor}, {ceiling}] at context {context} (not the real pair)",
    )
