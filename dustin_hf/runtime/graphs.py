"""CUDA graphs for the decode loop's fixed-shape forwards (draft steps, verification) and its other calls.

A model forward in eager PyTorch costs milliseconds of Python and kernel launches; at batch 16 and
32k context a draft forward's GPU work is about a millisecond, so without graphs the loop would be
bound by the CPU. Every forward after prefill has the same shapes step after step: ``(B, Q)`` new
tokens at each row's next positions, dense or with a ``(B, W)`` read set. :class:`GraphedForward`
captures one such forward once and replays it with new inputs copied into persistent buffers; the
forward is the model's :class:`~dustin_hf.runtime.pipeline.Pipeline`, one graph per device stage.

What makes the forward capturable: the plan's device tensors are those buffers (``ForwardPlan.static``),
kernels size their grids by the cache capacity (``key_bound``) rather than this step's longest row,
and nothing inside reads device values on the host. The first call runs eagerly (it is a real step),
then captures; later calls replay. :class:`GraphedCall` does the same for a function of device tensors
(the loop's scoring and selection).
"""

from __future__ import annotations

import gc
import warnings

import torch

from .plan import DeviceTensors, ForwardPlan

__all__ = ["GraphedCall", "GraphedForward"]


class GraphedForward:
    """One captured forward of a model over its :class:`~dustin_hf.decode.cache.DustinCache`, one graph per stage.

    Args:
        runner: the decoding loop's model wrapper (``.pipeline``, ``.cache``, ``.device``, ``.backend``,
            ``.dense_layers``, ``.select``, ``.graph_pools``: per device, a memory pool and a capture stream shared by
            the loop's graphs).
        q_len: new tokens per row.
        width: columns of the sparse read set (0: dense).
        keep: logits kept per row (the last ``keep`` positions).
        capture, capture_last: scoring queries to keep (see :class:`~dustin_hf.runtime.plan.ForwardPlan`).
        full_rows: rows may read in full through their counts (:attr:`~dustin_hf.runtime.plan.ForwardPlan.full_rows`).
    """

    def __init__(
        self, runner, q_len: int, width: int, keep: int, capture: dict, capture_last: bool, full_rows: bool = False
    ):
        batch, pipeline = runner.cache.batch_size, runner.pipeline
        self.runner, self.q_len, self.keep = runner, q_len, keep
        self.input_ids = torch.zeros(batch, q_len, dtype=torch.long, device=pipeline.stages[0].device)
        self.tensors = tuple(
            DeviceTensors(
                torch.zeros(batch, dtype=torch.int32, device=device),
                torch.zeros(batch, width, dtype=torch.int32, device=device) if width else None,
                torch.zeros(batch, dtype=torch.int32, device=device) if width else None,
                torch.zeros(batch, dtype=torch.int32, device=device) if width and runner.select is not None else None,
            )
            for device in pipeline.devices
        )
        self.plan = ForwardPlan(
            rows=slice(0, batch),
            cache_seqlens=[0] * batch,
            q_len=q_len,
            backend=runner.backend,
            capture=dict(capture),
            capture_last=capture_last,
            static=self.tensors,
            key_bound=runner.cache.capacity,
            dense_layers=runner.dense_layers,
            read_budget=runner.graph_width,
            tuning=runner.tuning,
            select=runner.select,
            full_rows=full_rows,
        )
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.inputs: list[dict[str, torch.Tensor]] = []  # per stage: the buffers its input state is copied into
        self.outputs: list[dict[str, torch.Tensor]] = []  # per stage: what its graph writes
        self._capacity = runner.cache.capacity
        self._output = "tokens" if runner.tokens_only else "logits"  # what the last stage's graph writes
        self.failed: str | None = None  # why capture failed; this shape then runs eagerly

    @property
    def replayable(self) -> bool:
        """Captured, and the cache buffers the graphs point into are still the current ones."""
        return self.graphs is not None and self._capacity == self.runner.cache.capacity

    def __call__(
        self,
        input_ids: torch.Tensor,
        seqlens: list[int] | torch.Tensor,
        indices=None,
        num_indices=None,
        query_counts: list[int] | None = None,
    ):
        """Run at ``seqlens``; returns ``(logits (B, keep, V) float32, captured queries)``, owned by the caller;
        for a runner that decodes greedily (``runner.tokens_only``) ``(B, keep)`` argmax tokens instead of logits.
        ``query_counts``: each row's own leading queries, for selection layers (``None``: all).

        ``seqlens`` is a host list, or (only once :attr:`replayable`) a device tensor: then nothing is read
        from the host, so the replay can be queued before the host knows where the rows stand.
        """
        on_device = isinstance(seqlens, torch.Tensor)
        if on_device and not self.replayable:
            raise RuntimeError("device-side seqlens need a captured graph (the eager pass reads them on the host)")
        self.input_ids.copy_(input_ids, non_blocking=True)
        source = seqlens if on_device else torch.tensor(seqlens, dtype=torch.int32)
        for tensors in self.tensors:
            tensors.cache_seqlens.copy_(source, non_blocking=True)
            if tensors.indices is not None:
                tensors.indices.copy_(indices, non_blocking=True)
                tensors.num_indices.copy_(num_indices, non_blocking=True)
            if tensors.query_counts is not None:
                tensors.query_counts.copy_(
                    torch.tensor(query_counts or [self.q_len] * len(tensors.query_counts), dtype=torch.int32),
                    non_blocking=True,
                )
        if not on_device:
            self.plan.cache_seqlens = list(seqlens)
        cache = self.runner.cache
        if not self.replayable:
            self.graphs = None  # the buffers were reallocated (or nothing was captured yet)
        if self.graphs is None:
            logits = self._eager()
            captured = dict(self.plan.captured)
            if not self.failed:
                self._capture()
        else:
            self._replay()
            # the next replay of this graph overwrites its outputs: hand out copies (kept queries of several
            # draft steps are stacked for scoring, logits may be kept as output scores)
            logits = self.outputs[-1][self._output].to(self.runner.device, copy=True)
            captured = {k: v.clone() for k, v in self.plan.captured.items()}
        cache.advance(self.plan.rows, [self.q_len] * self.plan.batch_size)
        return logits, captured

    def _eager(self) -> torch.Tensor:
        """A real step run eagerly: the first call (it compiles every kernel before capture), or every call
        of a shape whose capture failed."""
        self.plan._slots.clear()  # slots from the static seqlens, computed now
        cache = self.runner.cache
        with cache.forward_plan(self.plan):
            return self.runner.pipeline.forward(
                self.input_ids, self.plan, cache, self.keep, self.runner.tokens_only
            ).to(self.runner.device)

    def _replay(self) -> None:
        for stage, graph, inputs, previous in zip(
            self.runner.pipeline.stages, self.graphs, self.inputs, [{}] + self.outputs[:-1]
        ):
            for name, buffer in inputs.items():  # across the device boundary, ordered on both devices' streams
                buffer.copy_(previous[name], non_blocking=True)
            with torch.cuda.device(stage.device):
                graph.replay()

    def _capture(self) -> None:
        cache, pipeline = self.runner.cache, self.runner.pipeline
        self._capacity = self.plan.key_bound = cache.capacity
        self.plan._slots.clear()  # recompute slots inside the graphs, from the static seqlens
        graphs, inputs, outputs = [], [], []
        state = {"ids": self.input_ids}
        gc.collect()
        gc.disable()  # see _capture_failed
        try:
            with cache.forward_plan(self.plan):
                for i, stage in enumerate(pipeline.stages):
                    # the first stage reads the input ids in place; a later one, buffers on its device
                    static = {} if i == 0 else {k: torch.empty_like(v, device=stage.device) for k, v in state.items()}
                    pool, stream = self.runner.graph_pools[stage.device]
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        state = pipeline.run(
                            stage, static or state, self.plan, cache, self.keep, self.runner.tokens_only
                        )
                    graphs.append(graph)
                    inputs.append(static)
                    outputs.append(state)
        except RuntimeError as error:  # e.g. an op that syncs with the host: run this shape eagerly, say so
            self.failed = _capture_failed(error, "forward", pipeline.devices)
            self.plan._slots.clear()
            return
        finally:
            gc.enable()
        self.graphs, self.inputs, self.outputs = graphs, inputs, outputs


class GraphedCall:
    """A function of device tensors captured once and replayed: the decode loop's scoring and selection.

    ``fn(*tensors)`` must read nothing from the host that changes between calls (sizes from host ints
    fixed for the decoder's life, such as the cache capacity) and return a tuple of tensors. The first
    call runs eagerly (a real call, which also compiles the kernels) and captures; later calls copy their
    arguments into the captured buffers, replay, and return the captured outputs, which the next replay
    overwrites (copy what must outlive it). Capture failing (an op that syncs with the host) leaves the
    function eager, with a warning naming the reason (:attr:`failed`).
    """

    def __init__(self, fn, device: torch.device, pool):
        self.fn, self.device, self.pool = fn, device, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.failed: str | None = None

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.graph is None:
            outputs = self.fn(*tensors)
            if not self.failed:
                self._capture(tensors)
            return outputs
        for buffer, tensor in zip(self.inputs, tensors):
            buffer.copy_(tensor, non_blocking=True)
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.outputs

    def _capture(self, tensors) -> None:
        inputs = tuple(t.clone() for t in tensors)
        graph = torch.cuda.CUDAGraph()
        gc.collect()
        gc.disable()  # see _capture_failed
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
                outputs = self.fn(*inputs)
        except RuntimeError as error:
            self.failed = _capture_failed(error, "call", (self.device,))
            return
        finally:
            gc.enable()
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


def _capture_failed(error: RuntimeError, what: str, devices) -> str:
    """Warn that a capture failed (what then runs eagerly), wait for the devices it left work on; the reason.

    Captures run with Python's garbage collection off: freeing an unreachable graph (an old decoder's)
    during a capture is not permitted and would invalidate it.
    """
    reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    warnings.warn(f"CUDA graph capture failed, running this {what} eagerly: {reason}", stacklevel=3)
    for device in devices:
        torch.cuda.synchronize(device)
    return reason
