"""A decoder-only causal LM's forward as device stages, what the decode loop's CUDA graphs capture
(:mod:`dustin_hf.runtime.graphs`).

A model that accelerate split over several GPUs cannot be captured in one graph (a graph belongs to
one device; PyTorch cannot capture work on several, pytorch#153025). :class:`Pipeline` runs the
forward as one *stage* per run of consecutive modules on the same device (embedding and rotary
embedding, decoder layers, final norm, head), and each stage is captured in its own graph on its own
device. Between replays the few tensors that cross a device boundary (hidden states, the rotary
cos/sin) are copied into the next stage's input buffers. A model on one GPU is one stage.

Inside :func:`~dustin_hf.runtime.fused.fused_ops` the pipeline launches fewer kernels than the model's forward
would, computing the same bits (``tests/test_graphs.py`` compares them exactly, fp32 and bf16): a decoder layer
registered by the context (transformers' standard pre-norm block, see
:func:`~dustin_hf.runtime.fused.fused_decoder_layer`) runs submodule by submodule: each residual add happens inside
the launch of the RMSNorm after it (:func:`~dustin_hf.runtime.fused.add_rms_norm`): the attention's add in the
post-attention norm, the MLP's in the next layer's input norm or, after the last layer, in the final norm (on the
kept positions only: only they are normalised and read). Two launches fewer per layer, and the last layer's add costs
none either. The MLP output waits in the state as ``mlp_out`` and crosses a stage boundary like ``h``; a layer that
is not registered first adds it, then runs its own forward. The path is switched by
:class:`~dustin_hf.runtime.projections.FusedTuning` (``layers``); off, the pipeline calls the layer itself, under the
same graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compat import CACHE_KWARG
from ..kernels.tuning import KernelTuning
from . import fused, ops
from .plan import ForwardPlan

__all__ = ["Pipeline", "Stage"]

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

    It calls the model's own modules in the order the model's forward does (embedding, rotary embedding,
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
                cos, sin = self.decoder.rotary_emb(state["h"], plan.write_positions(stage.device))
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
        """``layer``'s forward (transformers' standard block, :func:`~.fused.fused_decoder_layer`) from its
        submodules, each residual add in the RMSNorm launch after it; the MLP output is left pending."""
        h = state["h"]
        if "mlp_out" in state:  # the previous layer's residual add, with this layer's input norm
            normed, h = _add_norm(layer.input_layernorm, state["mlp_out"], h)
        else:
            normed = layer.input_layernorm(h)
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

    def _final_norm(self, state: dict, keep: int) -> torch.Tensor:
        """The final norm of the last ``keep`` positions, adding a pending MLP output to them first."""
        h = state["h"][:, -keep:]
        if "mlp_out" not in state:
            return self.decoder.norm(h)
        return _add_norm(self.decoder.norm, state["mlp_out"][:, -keep:], h)[0]

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
    """``(norm(residual + x), residual + x)``: one :func:`~.fused.add_rms_norm` launch when ``norm`` is a fused
    RMSNorm and the two tensors match, else the add and the norm module."""
    params = fused.fused_norm(norm)
    if params is not None and x.dtype == residual.dtype and x.shape == residual.shape and ops.triton_runs_on(x.device):
        return fused.add_rms_norm(x, residual, *params)
    total = residual + x
    return norm(total), total
