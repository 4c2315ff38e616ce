"""What a decode run builds that the next run of the same shape reuses, instead of building it again.

A run's two :class:`~dustin_hf.decode.runner.ModelRunner` s own the KV caches (preallocated for the longest row) and
the CUDA graphs of every forward shape the loop replays; the read-set policy (:mod:`dustin_hf.selection.selector`) owns
the scoring step's graph; the graphs read the concatenated projection weights of
:class:`~dustin_hf.runtime.fused.FusedWeights`, which the holder keeps for the models. Capturing a shape costs an
eager forward and the capture itself, about a second a call at 7B / 32k / batch 16, so a patched model keeps one
:class:`Workspace` between calls (:class:`Workspaces`, on its :class:`~dustin_hf.adapter.patching.DustinPatch`) and
the next call takes it when it fits:

* the same two model objects, their parameters and buffers where they were (a replaced parameter, a model moved
  to another device or dtype never reuses graphs that read the old memory);
* the same :class:`Shape`: batch size, backend, graph and fused-op choices, read widths, the resolved Dustin
  settings and the tuning (the selector's and the graphs' shapes follow from these);
* a capacity at least the run's and at most :data:`SLACK` above what a new one would get (larger caches cost the
  kernels that size their grids by the capacity, and memory).

Anything else releases the held workspace before the new one is built, so two never coexist. What a workspace
holds (both caches, the graphs' memory pools) stays allocated between calls until :meth:`Workspaces.release`
(``DustinPatch.release()``, or ``unpatch()``), which also gives the layers their own weights back.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ..config import ResolvedConfig
from ..runtime.fused import FusedWeights
from ..runtime.plan import SelectLayers
from ..runtime.tuning import Tuning
from ..selection.selector import Selector
from .cache import DustinCache
from .runner import ModelRunner

__all__ = ["SLACK", "Shape", "Workspace", "Workspaces", "capacity_for", "workspace_for"]

logger = logging.getLogger(__name__)

# A held workspace serves a run that needs up to this many slots fewer than it holds (and at most 1/8 fewer):
# prompts of a server's traffic vary in length, and a capacity rounded up to 256 slots absorbs the rest.
SLACK = 4096
_ROUND = 256
_HEADROOM = 16  # a new workspace holds 1/16 more than its run needs
# a row reuses a shared prefix of at least this many tokens: a few tokens in common (two unrelated prompts opening
# alike) save nothing and would send the rest of the prompt through another prefill path than a fresh call's
_MIN_REUSED = 16


@dataclass(frozen=True)
class Shape:
    """What a run's runners, graphs and selector depend on, besides the models and the cache capacity."""

    batch: int
    backend: str
    graphs: tuple[bool, bool]  # target, draft
    fused: tuple[bool, bool]
    tokens_only: bool
    widths: tuple[int, int]  # the sparse read widths the target's and the draft's graphs are captured at
    dustin_config: ResolvedConfig | None
    tuning: Tuning
    select: SelectLayers | None = None  # the target's selection layers (their scoring queries differ by mode)
    dense_layers: tuple[int, ...] = ()  # target layers that read everything on sparse steps too


def capacity_for(needed: int) -> int:
    """The capacity a new workspace gets for a run that needs ``needed`` slots: 1/16 more, rounded up to 256. The
    sixteenth is a conversation's room: a follow-up turn resends the prompt with the answer and a question, and
    reuses the held caches' prompt (:meth:`Workspace.reusable`) only while it fits them (at 32k, five turns of
    ~400 tokens; the caches cost 1/16 more memory)."""
    return -(-(needed + needed // _HEADROOM) // _ROUND) * _ROUND


def _fingerprint(*models) -> tuple:
    """Where every parameter and buffer of ``models`` lives (captured graphs read those addresses), and its version
    (an in-place write bumps it: ``load_state_dict``, ``param.copy_`` under ``no_grad``; a write through ``.data``
    does not), so a workspace whose caches hold prompt values of older weights is never reused."""
    return tuple(
        (t.data_ptr(), t.dtype, t.device, None if t.is_inference() else t._version)
        for model in models
        for t in (*model.parameters(), *model.buffers())
    )


class Workspace:
    """Both models' runners (caches, graphs) and the read-set policy of one shape and capacity."""

    @classmethod
    def build(cls, target, draft, shape: Shape, capacity: int) -> "Workspace":
        """Empty caches of ``capacity`` slots a row and runners for both models; graphs are captured as each
        decode shape first runs."""
        runners = []
        for role, (model, graphs, width) in enumerate(zip((target, draft), shape.graphs, shape.widths)):
            layers = model.config.get_text_config().num_hidden_layers
            is_target = role == 0  # by role, not identity: a model may be its own draft
            runners.append(
                ModelRunner(
                    model,
                    DustinCache(layers, shape.batch, capacity),
                    shape.backend,
                    graphs,
                    graph_width=width,
                    dense_layers=shape.dense_layers if is_target else (),
                    tokens_only=shape.tokens_only,
                    tuning=shape.tuning.kernels,
                    select=shape.select if is_target else None,
                )  # fmt: skip
            )
        return cls(shape, *runners)

    def __init__(self, shape: Shape, target: ModelRunner, draft: ModelRunner):
        self.shape, self.target, self.draft = shape, target, draft
        self.selector: Selector | None = None  # made by the first run that selects
        self.fingerprint: tuple | None = None  # set once the fused weights are in place (:meth:`seal`)
        self.versioned = False  # every tensor of the models counts its writes (:meth:`seal`)
        self.runs = 0  # runs served, the first one included
        self.last_stats = None  # what the last run did (RunStats): a call that returns no cache still tells it
        # per row, the prompt tokens the last prefill wrote (positions 0.. of the target's cache; the draft's holds
        # all but the last): a dense forward's keys and values, which a later prompt beginning with them reuses
        self.prefilled: list[torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        return self.target.cache.capacity

    def seal(self) -> None:
        """Record where the models' tensors live once the run's fused weights are in place."""
        self.fingerprint = _fingerprint(self.target.model, self.draft.model)
        # an inference tensor (made under torch.inference_mode) keeps no version: a write to it would go unseen
        self.versioned = not any(version is None for *_, version in self.fingerprint)

    def fits(self, target, draft, shape: Shape, needed: int) -> bool:
        return (
            self.target.model is target
            and self.draft.model is draft
            and self.shape == shape
            and needed <= self.capacity <= capacity_for(needed) + min(SLACK, max(_ROUND, needed // 8))
            and self.fingerprint == _fingerprint(target, draft)
        )

    def start_run(self, positions: torch.Tensor | None, window_slots: tuple) -> None:
        """Empty both caches and forget the last run's per-run state (the buffers and graphs stay); the runners take
        this run's tables: ``positions`` (``(B, capacity)``: position ids where they are not the slots) and, per
        runner, ``window_slots`` (what its sliding windows count where rows have holes; ``None``: the slots)."""
        for runner, slots in zip((self.target, self.draft), window_slots):
            runner.reset()
            runner.positions = None if positions is None else positions.to(runner.device)  # to each device once
            runner.window_slots = None if slots is None else slots.to(runner.device)
        self.runs += 1

    def reusable(self, prompts: list[torch.Tensor]) -> tuple[list[int], list[int]] | None:
        """Per row of a new run, the leading positions of its prompt whose keys and values the caches hold from the
        last prefill (the target's, the draft's), leaving the target at least the row's last token to read; ``None``
        where no row reuses any. Only prefill positions count: a decode step's values are not a dense forward's."""
        held = self.prefilled
        if held is None or len(held) != len(prompts) or not self.versioned:
            return None
        target, draft = [], []
        for old, new in zip(held, prompts):
            n = min(old.numel(), new.numel())
            differs = (old[:n].to(new.device) != new[:n]).nonzero()
            common = int(differs[0]) if len(differs) else n
            common = common if common >= _MIN_REUSED else 0
            target.append(min(common, new.numel() - 1))
            draft.append(min(common, old.numel() - 1, new.numel() - 1))  # the draft held the old prompt but its last
        return (target, draft) if any(target) or any(draft) else None

    def release(self) -> None:
        """Drop the graphs (and their memory pools); the caches go with the last reference (a run's result may still
        read its target cache)."""
        self.selector = None
        for runner in (self.target, self.draft):
            runner.drop_graphs()


class Workspaces:
    """The one :class:`Workspace` a patched model keeps between ``generate()`` calls, and the models' fused weights.

    The fused weights (:class:`~dustin_hf.runtime.fused.FusedWeights`: the concatenated q/k/v and gate/up
    projections every held graph reads) belong to the models, not to one shape: the layers' parameters are views of
    them, so keeping them costs no memory, and a workspace of another shape captures its graphs over the same ones.
    """

    def __init__(self):
        self.held: Workspace | None = None
        self.fused = FusedWeights()

    def take(self, target, draft, shape: Shape, needed: int) -> Workspace | None:
        """The held workspace if it fits this run (it is handed out: keep it back with :meth:`keep`), else ``None``
        after releasing it."""
        if self.held is not None and self.held.fits(target, draft, shape, needed):
            held, self.held = self.held, None
            logger.info("reusing the held decode workspace (batch %d, %d slots a row)", shape.batch, held.capacity)
            return held
        self._drop()
        return None

    def keep(self, workspace: Workspace) -> None:
        if self.held is not None and self.held is not workspace:
            self.held.release()
        self.held = workspace

    def release(self) -> None:
        """Drop the held workspace (its caches and graphs) and the fused weights (the layers get their own back)."""
        self._drop()
        self.fused.release()

    def _drop(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            device = held.target.device
            held.release()
            del held
            _free_cached_memory(device)

    def __deepcopy__(self, memo) -> "Workspaces":
        # a copied model (copy.deepcopy of a patched one) starts with nothing held: the caches, graphs and the draft
        # are this model's, and CUDA graphs cannot be copied
        return Workspaces()


def workspace_for(workspaces: Workspaces | None, target, draft, shape: Shape, needed: int) -> Workspace:
    """The held workspace when it fits a run that needs ``needed`` slots a row, else a new one."""
    held = workspaces is not None and workspaces.held is not None
    workspace = None if workspaces is None else workspaces.take(target, draft, shape, needed)
    if workspace is None:
        logger.info(
            "building a decode workspace (batch %d, %d slots a row)%s: caches, and CUDA graphs as each decode shape "
            "first runs", shape.batch, capacity_for(needed),
            "; the held one was of another shape and is released" if held else "",
        )  # fmt: skip
        workspace = Workspace.build(target, draft, shape, capacity_for(needed))
    return workspace


def _free_cached_memory(device: torch.device) -> None:
    """Hand a dropped workspace's memory back to the device, so that the next workspace (or the user) can allocate
    it: its caches and graphs sit in reference cycles (a graph's plan points back at its runner) until collected."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
