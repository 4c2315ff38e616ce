"""Dustin's settings: one frozen dataclass, validated at construction, loadable from a profile.

``DustinConfig`` holds what the user chooses (budget, window sizes, scoring heads, backend). Values
that depend on the model pair (the default scoring heads, ``draft_share`` when unset) are resolved
separately by :func:`~dustin_hf.resolved.resolve` (re-exported here), never by mutating the config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DustinConfig", "ResolvedConfig", "resolve"]

from .resolved import ResolvedConfig, resolve  # noqa: E402  the pair-dependent half, re-exported where it was

_BACKENDS = ("auto", "reference", "triton", "flash_attn", "varlen")
_MODES = ("sparse", "exact")
# budget=None's value, in both modes. On the real Qwen2.5-Coder pair at 32k (benchmarks/results/real_pair_*.json)
# 2048 positions read by the selection layers retrieve every key plain greedy retrieves and keep teacher-forced
# perplexity within 1.2% of dense verification, where 512 of Dustin's set miss 6 keys of 32 and cost +12%; a sparse
# step reading 2048 of 32k positions costs little more than one reading 512. Exact mode's speed is the share of
# tentative tokens the dense check confirms, which rises with the budget
DEFAULT_BUDGET = 2048
_CALIBRATIONS = ("none", "prompt")
_SELECTIONS = ("dustin", "verify")
# what prompt calibration searches, and all it replaces in the user's config
SEARCHED_FIELDS = ("target_layer", "target_heads", "draft_layers", "draft_heads", "draft_share")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int_tuple(value: Any, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a sequence of ints (e.g. (0, 1, 2, 3)), got {value!r}")
    result = tuple(value)
    if not result:
        raise ValueError(f"{name} must not be empty; leave it None for the default choice")
    if min(result) < 0 or len(set(result)) != len(result):
        raise ValueError(f"{name} must hold distinct non-negative indices, got {result!r}")
    return result


@dataclass(frozen=True)
class DustinConfig:
    """What Dustin keeps in the verification read set, and how it scores positions.

    Args:
        budget: cached positions each sparse verification step attends to per sequence (the γ+1
            new tokens come on top). Contexts that fit in the budget are verified densely. ``None``: the
            default, 2048 (:data:`DEFAULT_BUDGET`; the paper's 512 costs fidelity at 32k, see the README).
        sink_tokens: first positions always kept (attention sinks).
        recent_tokens: most recent cached positions always kept.
        draft_share: ``m``, positions chosen by the draft's lookahead attention; the rest of the
            budget is filled by the target's attention history. ``None``: half of what remains
            after sinks and the recent window.
        target_layer: target layer whose attention (of the last committed token) scores positions.
            ``None``: the middle layer.
        target_heads: query heads of ``target_layer`` used for scoring. ``None``: the query heads of
            the first KV group (they share one key head, so scoring reads one head's keys).
        draft_layers: draft layers whose attention (of the γ draft queries) scores positions.
            ``None``: layers at 1/4, 1/2 and 3/4 of the depth.
        draft_heads: query heads used on each draft layer: one tuple shared by all layers, or one
            tuple per entry of ``draft_layers``. ``None``: the first KV group's query heads.
        dense_layers: target layers that read every cached position even on sparse steps (the
            others read the selection). Negative indices count from the last layer. ``()``: none,
            the paper's method. A fidelity guard for models whose attention is too diffuse in a few
            layers for one shared set (``dustin-hf eval`` shows per-layer recovery); each dense layer
            reads the whole cache, so it costs as much as ``context / budget`` sparse layers.
        selection: who chooses what the sparse layers read. ``"dustin"``: the set chosen before the verification
            forward from the target's history and the draft's lookahead (the paper's), read by every sparse layer.
            ``"verify"``: at ``selection_layers`` the verification forward's own queries attend to every cached
            position and choose, per row, the set the layers after them read (sinks, the recent window, then the
            positions with the most attention; :mod:`dustin_hf.selection.layers`); the layers before the first one
            read Dustin's set (or everything, when listed in ``dense_layers``). Each selection layer reads the whole
            cache, as a dense layer does. ``"verify"`` is the default: on the real pair at 32k Dustin's set at any
            budget up to 2048 missed keys plain greedy retrieved and made the target copy more of its context
            (``benchmarks/results/README.md``, "The real pair at 32k").
        selection_layers: the target layers that choose when ``selection="verify"`` (negative indices count from
            the last layer; unused by ``"dustin"``, so a profile can record its calibrated ones for either).
            ``None``: the default (:func:`resolve`).
        calibration: ``"none"``: score with the heads above (or their defaults). ``"prompt"``: after
            prefill, search the scoring heads and ``draft_share`` on a few verification-like steps
            replayed inside the prompt (seconds; see :mod:`dustin_hf.calibration.prompt`); the
            searched fields must then be left ``None``.
        sparse_draft: the draft also reads a selection on sparse steps: the positions the previous
            step verified against plus those written since, instead of its whole cache (its scoring
            layers still score every position). Cuts the draft's cache reads, which at long context
            cost as much as dense verification. The drafts change (so the acceptance can), and so do
            the draft queries that score positions, so the selection and the output can shift too.
            ``False``: the paper's dense draft.
        mode: the guarantee verification gives. ``"sparse"``: what a sparse step accepts is committed (Dustin's
            method: the output is the sparse target's, close to the target's but not equal). ``"exact"``: what a
            sparse step accepts is tentative, and a later dense verification confirms it (greedy: the longest
            prefix the dense target agrees with; sampling: each token with probability ``min(1, p / p~)``, a
            rejection redrawn from ``norm(max(0, p - p~))``); only confirmed tokens are committed, so the output
            is the target's own at any budget (greedy: token for token; sampling: in law).
        confirm_tokens: exact mode: a row confirms once it holds this many tentative tokens (the most; the loop
            lowers a row's own limit after a confirmation that rejected some, and raises it back after ones that
            kept all). ``0``: every verification is dense (with ``sparse_draft``: the lossless sparse-draft
            baseline, MagicDec's method). 4 rather than 8: a confirming step verifies
            ``1 + confirm_tokens + γ`` queries per row, and past 9 the dense kernel reads at two thirds of its
            bandwidth, which costs more than the longer schedule saves.
        confirm_every: exact mode: a row confirms at the latest this many sparse steps after its last one.
        min_recovery: the quality knob: each row and step reads the smallest set whose *estimated recovery* (the
            share of the scoring heads' attention mass it holds: the mean of the target history's and the draft
            lookahead's, each normalised over the cached positions) reaches this value, between ``budget`` positions
            (the floor) and ``max_budget`` (the ceiling); a row whose estimate stays below it at ``max_budget``
            reads everything that step. Positions join by estimated mass (sinks and the recent window first),
            which for a sum of per-position masses is the smallest set that reaches it. ``None``: every row reads
            ``budget`` positions (the paper's fixed budget). ``1.0``: every step dense.
        max_budget: the knob's ceiling; ``None``: four times ``budget``.
        min_context: a sequence with fewer cached positions is verified densely.
        backend: attention kernel: ``"auto"`` (fastest available), ``"reference"`` (PyTorch),
            ``"triton"``, ``"flash_attn"`` or ``"varlen"``.
        prefill_chunk: prompt tokens per forward during prefill (bounds activation memory). ``None``: on CUDA
            as many as half the free device memory holds (a whole prompt, as a rule: its attention is then one
            square causal call, the fastest kernel SDPA has), elsewhere 4096
            (:func:`dustin_hf.decode.runner.prefill_chunk`).
        reuse_prefix: a call whose rows begin with the prompt tokens the model's held caches were last prefilled
            with reads only the rest (a follow-up turn on the same document); ``False``: every call reads its
            whole prompt. Only positions a prompt's dense forward wrote are reused, never the decode steps'.
    """

    budget: int | None = None
    sink_tokens: int = 4
    recent_tokens: int = 16
    draft_share: int | None = None
    target_layer: int | None = None
    target_heads: tuple[int, ...] | None = None
    draft_layers: tuple[int, ...] | None = None
    draft_heads: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None
    dense_layers: tuple[int, ...] = ()
    selection: str = "verify"
    selection_layers: tuple[int, ...] | None = None
    calibration: str = "none"
    sparse_draft: bool = False
    mode: str = "sparse"
    confirm_tokens: int = 4
    confirm_every: int = 4
    min_recovery: float | None = None
    max_budget: int | None = None
    min_context: int = 2048
    backend: str = "auto"
    prefill_chunk: int | None = None
    reuse_prefix: bool = True

    def __post_init__(self):
        if self.budget is None:  # kept as an int: every reader of budget sees one
            object.__setattr__(self, "budget", DEFAULT_BUDGET)
        self._check_sizes()
        self._check_layers()
        self._check_choices()
        self._check_knob()

    def _check_sizes(self) -> None:
        for name in ("budget", "sink_tokens", "recent_tokens", "min_context", "confirm_tokens", "confirm_every"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.confirm_every < 1:
            raise ValueError(
                f"confirm_every must be >= 1 (sparse steps between confirmations), got {self.confirm_every}"
            )
        chunk = self.prefill_chunk
        if chunk is not None and (not _is_int(chunk) or chunk < 1):
            raise ValueError(f"prefill_chunk must be an int >= 1 or None (chosen from free memory), got {chunk!r}")
        fixed = self.sink_tokens + self.recent_tokens
        if fixed > self.budget:
            raise ValueError(
                f"sink_tokens + recent_tokens ({fixed}) exceeds budget ({self.budget}); raise budget or shrink the "
                "windows"
            )
        if self.draft_share is not None and not (
            _is_int(self.draft_share) and 0 <= self.draft_share <= self.budget - fixed
        ):
            raise ValueError(
                "draft_share must be an int in [0, budget - sink_tokens - recent_tokens] = "
                f"[0, {self.budget - fixed}], got {self.draft_share!r}"
            )

    def _check_layers(self) -> None:
        if self.target_layer is not None and (not isinstance(self.target_layer, int) or self.target_layer < 0):
            raise ValueError(f"target_layer must be a non-negative int or None, got {self.target_layer!r}")
        object.__setattr__(self, "target_heads", _as_int_tuple(self.target_heads, "target_heads"))
        object.__setattr__(self, "draft_layers", _as_int_tuple(self.draft_layers, "draft_layers"))
        object.__setattr__(self, "draft_heads", self._normalized_draft_heads())
        layers = self.dense_layers
        if isinstance(layers, int) or not all(map(_is_int, layers)) or len(set(layers)) != len(tuple(layers)):
            raise ValueError(f"dense_layers must be a sequence of distinct ints (e.g. (0, -1)), got {layers!r}")
        object.__setattr__(self, "dense_layers", tuple(layers))
        chosen = self.selection_layers
        if chosen is not None:
            if (
                isinstance(chosen, int)
                or not chosen
                or not all(map(_is_int, chosen))
                or len(set(chosen)) != len(chosen)
            ):
                raise ValueError(
                    "selection_layers must be a non-empty sequence of distinct ints (e.g. (2,)) or None, "
                    f"got {chosen!r}"
                )
            object.__setattr__(self, "selection_layers", tuple(chosen))

    def _check_choices(self) -> None:
        for name, allowed in (("selection", _SELECTIONS), ("calibration", _CALIBRATIONS), ("backend", _BACKENDS),
                              ("mode", _MODES)):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("sparse_draft", "reuse_prefix"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.calibration == "prompt" and self.sink_tokens + self.recent_tokens == self.budget:
            raise ValueError(
                f"calibration='prompt' searches the scoring heads and draft_share that fill budget - sink_tokens - "
                f"recent_tokens positions; with budget == sink_tokens + recent_tokens ({self.budget}) nothing is left "
                "to fill: raise budget, shrink the windows, or use calibration='none'"
            )
        given = [name for name in SEARCHED_FIELDS if getattr(self, name) is not None]
        if self.calibration == "prompt" and given:
            raise ValueError(
                f"calibration='prompt' searches {', '.join(SEARCHED_FIELDS)}; leave them None "
                f"(got {given}), or use calibration='none' to keep them"
            )

    def _check_knob(self) -> None:
        share = self.min_recovery
        if share is not None and not (
            isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1
        ):
            raise ValueError(
                f"min_recovery must be a share in (0, 1] (e.g. 0.9) or None for the fixed budget, got {share!r}"
            )
        ceiling = self.max_budget
        if ceiling is not None and (not _is_int(ceiling) or ceiling < self.budget):
            raise ValueError(
                f"max_budget must be an int >= budget ({self.budget}) or None (4 x budget), got {ceiling!r}"
            )
        if ceiling is not None and share is None:
            raise ValueError(
                "max_budget is the ceiling of the quality knob: set min_recovery too (or leave "
                "max_budget None for the fixed budget)"
            )

    def _normalized_draft_heads(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...] | None:
        heads = self.draft_heads
        if heads is None or all(isinstance(h, int) for h in heads):
            return _as_int_tuple(heads, "draft_heads")
        per_layer = tuple(_as_int_tuple(h, "draft_heads[i]") for h in heads)
        if self.draft_layers is None or len(per_layer) != len(self.draft_layers):
            raise ValueError(
                "draft_heads given per layer needs draft_layers of the same length "
                f"(got {len(per_layer)} head tuples for draft_layers={self.draft_layers})"
            )
        return per_layer

    def replace(self, **changes: Any) -> "DustinConfig":
        """A copy with ``changes`` applied (and validated); unknown names raise ``ValueError``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(
                f"unknown DustinConfig field(s) {sorted(unknown)}; valid: {[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_profile(cls, path: str | Path, **overrides: Any) -> "DustinConfig":
        """Load the ``"config"`` section of a calibration profile written by ``dustin-hf calibrate``."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"calibration profile {str(path)!r} not found: a config path must name a JSON profile written by "
                "`dustin-hf calibrate` (or pass a DustinConfig)"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not a calibration profile (invalid JSON: {error})") from None
        fields = data.get("config", data) if isinstance(data, dict) else None
        if not isinstance(fields, dict):
            raise ValueError(f"{path}: expected a JSON object with a 'config' section")
        return cls().replace(**{**_lists_to_tuples(fields), **overrides})


def _lists_to_tuples(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists_to_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_lists_to_tuples(v) for v in value)
    return value
