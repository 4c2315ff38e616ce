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

A model that accelerate split over several GPUs cannot be captured in one graph (a graph belongs to
one device; PyTorch cannot capture work on several, pytorch#153025). :class:`Pipeline` runs the
forward as one *stage* per run of consecutive modules on the same device (embedding and rotary
table, decoder layers, final norm, head), and each stage is captured in its own graph on its own
device. Between replays the few tensors that cross a device boundary (hidden states, the rotary
table) are copied into the next stage's input buffers. A model on one GPU is one stage.

Inside :func:`~dustin_hf.runtime.fused.fused_ops` the pipeline launches fewer kernels than the model's forward
would, computing the same bits (``tests/test_graphs.py`` compares them exactly, fp32 and bf16):

* a decoder layer registered by the context (transformers' standard pre-norm block, see
  :func:`~dustin_hf.runtime.fused.fused_decoder_layer`) runs submodule by submodule: each residual add happens
  inside the launch of the RMSNorm after it (:func:`~dustin_hf.runtime.fused.add_rms_norm`): the attention's add
  in the post-attention norm, the MLP's in the next layer's input norm or, after the last layer, in the
  final norm (on the kept positions only: only they are normalised and read). Two launches fewer per
  layer, and the last layer's add costs none either. The MLP output waits in the state as ``mlp_out``
  and crosses a stage boundary like ``h``; a layer that is not registered first adds it, then runs its
  own forward.
* a rotary module whose cos/sin do not depend on the sequence length (:func:`~dustin_hf.runtime.fused.static_rotary`)
  is run once per device for positions ``0..capacity-1`` (rebuilt when the cache grows; graphs are
  recaptured then anyway); each forward gathers its rows in one index launch instead of the module's
  ~13 kernels.
"""

from __future__ import annotations

import gc
import sys
import warnings
from dataclasses import dataclass

import torch

from ..compat import CACHE_KWARG
from ..kernels.tuning import KernelTuning
from . import fused, ops
from .plan import DeviceTensors, ForwardPlan

__all__ = ["GraphedCall", "GraphedForward", "Pipeline"]

_Step = str | int  # "embed", "rotary", a decoder layer's index, "norm", "head"


def _module_device(module: torch.nn.Module) -> torch.device:
    return next(iter([*module.parameters(), *module.buffers()])).device


@dataclass(frozen=True)
class Stage:
    """Consecutive steps of the forward whose modules all sit on ``device``."""

    device: torch.device
    steps: tuple[_Step, ...]


class Pipeline:
    """A decoder-only causal LM's forward (Llama, Mistral, Qwen2/3 families) as device stages.

    It calls the model's own modules in the order the model's forward does (embedding, rotary table,
    decoder layers, final norm on the kept positions, head) with the arguments the model passes them,
    so a stage computes what the model's forward computes; the tests check that logits match. ``tuning``: the
    kernels' launch heuristics (``None``: the defaults), of which the greedy head's argmax takes ``tuning.argmax``.
    """

    def __init__(self, model, tuning: KernelTuning | None = None):
        self.model, self.decoder = model, model.base_model
        self.tuning = tuning or KernelTuning()
        missing = [
            name for name in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(self.decoder, name)
        ]
        if missing or model.get_output_embeddings() is None:
            raise ValueError(
                f"{type(model).__name__} does not have the decoder layout CUDA graph capture follows (missing: "
                f"{', '.join(missing) or 'output embeddings'}); run with cuda_graphs=False"
            )
        self.layers = self.decoder.layers[: model.config.get_text_config().num_hidden_layers]
        self.head = model.get_output_embeddings()
        placed = [
            ("embed", _module_device(self.decoder.embed_tokens)),
            ("rotary", _module_device(self.decoder.rotary_emb)),
        ]
        placed += [(i, _module_device(layer)) for i, layer in enumerate(self.layers)]
        placed += [("norm", _module_device(self.decoder.norm)), ("head", _module_device(self.head))]
        stages: list[tuple[torch.device, list[_Step]]] = []
        for step, device in placed:
            if not stages or stages[-1][0] != device:
                stages.append((device, []))
            stages[-1][1].append(step)
        self.stages = tuple(Stage(device, tuple(steps)) for device, steps in stages)
        self.devices = tuple(dict.fromkeys(stage.device for stage in self.stages))
        self._rotary_tables: dict[torch.device, torch.Tensor] = {}  # per device: (2, capacity, D) cos/sin rows

    def run(
        self, stage: Stage, state: dict[str, torch.Tensor], plan: ForwardPlan, cache, keep: int, tokens: bool = False
    ) -> dict:
        """Run ``stage`` on ``state`` (its tensors on ``stage.device``); returns the next state.

        The state holds ``ids`` before the embedding, then ``h`` (hidden states: the residual stream) and,
        from the rotary step to the final norm, ``cos``/``sin``; after a fused decoder layer also ``mlp_out``,
        its MLP output not yet added to ``h`` (the next layer's input norm or the final norm adds it in the
        same launch); after the head only ``logits`` (the last ``keep`` positions, float32), or with
        ``tokens`` only their argmax, ``tokens (B, keep)``: taken on the head's own output (an fp32 copy
        of 16-bit logits has the same argmax), it spares the copy and reads half the bytes.
        """
        for step in stage.steps:
            if step == "embed":
                state = {"h": _embed(self.decoder.embed_tokens, state["ids"])}
            elif step == "rotary":
                cos, sin = self._position_embeddings(state["h"], plan.write_positions(stage.device), cache)
                state = {**state, "cos": cos, "sin": sin}
            elif step == "norm":
                state = {"h": self._final_norm(state, keep)}
            elif step == "head":
                logits = self.head(state["h"])
                state = {"tokens": fused.argmax(logits, self.tuning.argmax)} if tokens else {"logits": logits.float()}
            elif fused.fused_decoder_layer(self.layers[step]) and ops.triton_runs_on(state["h"].device):
                state = self._fused_layer(self.layers[step], state, plan, cache)
            else:
                state = _settled(state)
                hidden = self.layers[step](
                    state["h"],
                    attention_mask=None,
                    position_embeddings=(state["cos"], state["sin"]),
                    position_ids=plan.write_positions(stage.device),
                    use_cache=True,
                    dustin_plan=plan,
                    **{CACHE_KWARG: cache},
                )
                state = {**state, "h": hidden[0] if isinstance(hidden, tuple) else hidden}
        return state

    def _fused_layer(self, layer, state: dict, plan: ForwardPlan, cache) -> dict:
        """``layer``'s forward (transformers' standard block, :func:`~dustin_hf.runtime.fused.fused_decoder_layer`) from
        its submodules, each residual add in the RMSNorm launch after it; the MLP output is left pending."""
        h = state["h"]
        if "mlp_out" in state:  # the previous layer's residual add, with this layer's input norm
            normed, h = _add_norm(layer.input_layernorm, state["mlp_out"], h)
        else:
            normed = layer.input_layernorm(h)
        if fused.fused_attention(layer.self_attn) and cache.layers[layer.self_attn.layer_idx].is_initialized:
            attn = self._attention(layer.self_attn, normed, state, plan, cache)
        else:
            attn, _ = layer.self_attn(  # the arguments the layer's forward passes
                hidden_states=normed,
                attention_mask=None,
                position_ids=plan.write_positions(h.device),
                **{CACHE_KWARG: cache},
                use_cache=True,
                position_embeddings=(state["cos"], state["sin"]),
                dustin_plan=plan,
            )
        normed, h = _add_norm(layer.post_attention_layernorm, attn, h)
        return {**state, "h": h, "mlp_out": layer.mlp(normed)}

    def _attention(self, module, x: torch.Tensor, state: dict, plan: ForwardPlan, cache) -> torch.Tensor:
        """``module``'s forward (transformers' Qwen2 attention, :func:`~dustin_hf.runtime.fused.fused_attention`) from
        its pieces, the rotary embedding and the cache's K/V write in one launch
        (:func:`~dustin_hf.runtime.fused.rotary_write_kv`): the same projections, the same rotated q and written
        cache, the same attention call, so the same output."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        hidden_shape = (*x.shape[:-1], -1, module.head_dim)
        q = module.q_proj(x).view(hidden_shape)  # (B, T, H, D): transformers transposes these to (B, H, T, D)
        k = module.k_proj(x).view(hidden_shape)
        v = module.v_proj(x).view(hidden_shape)
        layer = cache.layers[module.layer_idx]
        keys, values = layer.buffers()
        q = fused.rotary_write_kv(
            q, k, v, state["cos"], state["sin"], keys, values, plan.write_positions(x.device), plan.rows.start
        )
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            module.config._attn_implementation, sys.modules[type(module).__module__].eager_attention_forward
        )
        out, _ = interface(  # what the cache's update returns: (B', H, capacity, D) views of the covered rows
            module,
            q.transpose(1, 2),
            layer.keys[plan.rows],
            layer.values[plan.rows],
            None,
            dropout=0.0 if not module.training else module.attention_dropout,
            scaling=module.scaling,
            sliding_window=module.sliding_window,
            dustin_plan=plan,
        )
        return module.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())

    def _final_norm(self, state: dict, keep: int) -> torch.Tensor:
        """The final norm of the last ``keep`` positions, adding a pending MLP output to them first."""
        h = state["h"][:, -keep:]
        if "mlp_out" not in state:
            return self.decoder.norm(h)
        return _add_norm(self.decoder.norm, state["mlp_out"][:, -keep:], h)[0]

    def _position_embeddings(self, h: torch.Tensor, positions: torch.Tensor, cache) -> tuple[torch.Tensor, ...]:
        """``rotary_emb(h, positions)``: with a position-static rotary module inside ``fused_ops``
        (:func:`~dustin_hf.runtime.fused.static_rotary`), rows gathered from a table the module computed once for
        positions ``0..capacity-1`` (one index launch instead of ~13 kernels), bit for bit its output."""
        module = self.decoder.rotary_emb
        if not (fused.static_rotary(module) and ops.triton_runs_on(h.device)):
            return module(h, positions)
        capacity = cache.capacity  # every position a forward writes is below it (the cache grew before)
        table = self._rotary_tables.get(h.device)
        if table is None or table.shape[1] < capacity or table.dtype != h.dtype:
            if h.is_cuda and torch.cuda.is_current_stream_capturing():
                return module(h, positions)  # never build it into a graph's pool (the first, eager call does)
            with torch.no_grad():
                cos, sin = module(h, torch.arange(capacity, device=h.device)[None])  # (1, capacity, D)
            table = self._rotary_tables[h.device] = torch.stack((cos[0], sin[0]))  # (2, capacity, D)
        both = table[:, positions]  # (2, B, Q, D)
        return both[0], both[1]

    def forward(self, ids: torch.Tensor, plan: ForwardPlan, cache, keep: int, tokens: bool = False) -> torch.Tensor:
        """All stages eagerly, moving the state across devices: the last ``keep`` logits (or, with ``tokens``,
        their argmax) on ``ids``' device."""
        state = {"ids": ids}
        for stage in self.stages:
            state = self.run(stage, {k: v.to(stage.device) for k, v in state.items()}, plan, cache, keep, tokens)
        return state["tokens" if tokens else "logits"].to(ids.device)


def _embed(embedding: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``embedding(ids)``; for a plain ``nn.Embedding`` without ``max_norm`` as ``weight[ids]`` (the same rows).

    ``F.embedding`` runs CUDA's ``index_select``, whose kernel for few indices walks them one after another
    (16 ids into Qwen2.5-0.5B's 151936 x 896 table), where the indexing kernel copies the rows in parallel."""
    if type(embedding) is torch.nn.Embedding and embedding.max_norm is None:
        return embedding.weight[ids]
    return embedding(ids)


def _settled(state: dict) -> dict:
    """``state`` with a pending MLP output added to ``h`` (before a step that reads ``h`` whole)."""
    if "mlp_out" not in state:
        return state
    state = dict(state)
    state["h"] = state["h"] + state.pop("mlp_out")  # the layer's ``residual + hidden_states``
    return state


def _add_norm(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``: one :func:`~dustin_hf.runtime.fused.add_rms_norm` launch when ``norm`` is a
    fused RMSNorm and the two tensors match, else the add and the norm module."""
    params = fused.fused_norm(norm)
    if params is not None and x.dtype == residual.dtype and x.shape == residual.shape and ops.triton_runs_on(x.device):
        return fused.add_rms_norm(x, residual, *params)
    total = residual + x
    return norm(total), total


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
