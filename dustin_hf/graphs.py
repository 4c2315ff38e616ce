"""CUDA graphs for the decode loop's fixed-shape forwards (draft steps, verification).

A model forward in eager PyTorch costs milliseconds of Python and kernel launches; at batch 16 and
32k context a draft forward's GPU work is about a millisecond, so without graphs the loop would be
bound by the CPU. Every forward after prefill has the same shapes step after step: ``(B, Q)`` new
tokens at each row's next positions, dense or with a ``(B, W)`` read set. :class:`GraphedForward`
captures one such forward once and replays it with new inputs copied into persistent buffers.

What makes the forward capturable: the plan's device tensors are those buffers (``ForwardPlan.static``),
kernels size their grids by the cache capacity (``key_bound``) rather than this step's longest row,
and nothing inside reads device values on the host. The first call runs eagerly (it is a real step),
then captures; later calls replay.
"""

from __future__ import annotations

import gc
import warnings

import torch

from .plan import DeviceTensors, ForwardPlan

__all__ = ["GraphedForward"]


class GraphedForward:
    """One captured forward of a model over its :class:`~dustin_hf.cache.DustinCache`.

    Args:
        runner: the decoding loop's model wrapper (``.model``, ``.cache``, ``.device``, ``.backend``,
            ``.call(plan, input_ids, positions, keep)``).
        q_len: new tokens per row.
        width: columns of the sparse read set (0: dense).
        keep: logits kept per row (the last ``keep`` positions).
        capture, capture_last: scoring queries to keep (see :class:`~dustin_hf.plan.ForwardPlan`).
        pool: a CUDA graph memory pool shared by the loop's graphs.
    """

    def __init__(self, runner, q_len: int, width: int, keep: int, capture: dict, capture_last: bool, pool):
        batch, device = runner.cache.batch_size, runner.device
        self.runner, self.q_len, self.keep, self.pool = runner, q_len, keep, pool
        self.input_ids = torch.zeros(batch, q_len, dtype=torch.long, device=device)
        seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        indices = torch.zeros(batch, width, dtype=torch.int32, device=device) if width else None
        num_indices = torch.zeros(batch, dtype=torch.int32, device=device) if width else None
        self.tensors = DeviceTensors(seqlens, indices, num_indices)
        self.plan = ForwardPlan(
            rows=slice(0, batch), cache_seqlens=[0] * batch, q_len=q_len, backend=runner.backend,
            capture=dict(capture), capture_last=capture_last, static=self.tensors, key_bound=runner.cache.capacity,
            dense_layers=runner.dense_layers,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._capacity = runner.cache.capacity
        self.failed: str | None = None  # why capture failed; this shape then runs eagerly

    def __call__(self, input_ids: torch.Tensor, seqlens: list[int], indices=None, num_indices=None):
        """Run at ``seqlens``; returns ``(logits (B, keep, V) float32, captured queries)``, owned by the caller."""
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.tensors.cache_seqlens.copy_(torch.tensor(seqlens, dtype=torch.int32), non_blocking=True)
        if self.tensors.indices is not None:
            self.tensors.indices.copy_(indices, non_blocking=True)
            self.tensors.num_indices.copy_(num_indices, non_blocking=True)
        self.plan.cache_seqlens = list(seqlens)
        cache = self.runner.cache
        if self.graph is not None and self._capacity != cache.capacity:
            self.graph = None  # the buffers were reallocated: the recorded pointers are stale
        if self.graph is None:
            logits = self._eager()
            captured = dict(self.plan.captured)
            if not self.failed:
                self._capture()
        else:
            with cache.forward_plan(self.plan):
                self.graph.replay()
            # the next replay of this graph overwrites its outputs: hand out copies (kept queries of several
            # draft steps are stacked for scoring, logits may be kept as output scores)
            logits, captured = self.logits.clone(), {k: v.clone() for k, v in self.plan.captured.items()}
        cache.advance(self.plan.rows, [self.q_len] * self.plan.batch_size)
        return logits, captured

    def _forward(self) -> torch.Tensor:
        positions = self.plan.write_positions(self.runner.device)  # (B, Q): the new tokens' positions
        return self.runner.call(self.plan, self.input_ids, positions, self.keep)

    def _eager(self) -> torch.Tensor:
        """A real step run eagerly: the first call (it compiles every kernel before capture), or every call
        of a shape whose capture failed."""
        self.plan._slots.clear()  # slots from the static seqlens, computed now
        with self.runner.cache.forward_plan(self.plan):
            return self._forward().clone()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        cache = self.runner.cache
        self._capacity = self.plan.key_bound = cache.capacity
        self.plan._slots.clear()  # recompute slots inside the graph, from the static seqlens
        # No garbage collection while capturing: freeing an unreachable graph (an old decoder's) then is not
        # permitted and would invalidate this capture.
        gc.collect()
        gc.disable()
        try:
            with cache.forward_plan(self.plan), torch.cuda.graph(graph, pool=self.pool):
                self.logits = self._forward()
        except RuntimeError as error:  # e.g. an op that syncs with the host: run this shape eagerly, say so
            self.failed = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            warnings.warn(f"CUDA graph capture failed, running this forward eagerly: {self.failed}", stacklevel=2)
            torch.cuda.synchronize()
            self.plan._slots.clear()
            return
        finally:
            gc.enable()
        self.graph = graph
