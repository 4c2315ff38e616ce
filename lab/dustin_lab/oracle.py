"""Oracle selections for the teacher-forced walk: the best read sets a step could have used.

An experiment, not part of the method. Dustin predicts one read set per row from cheap signals
(draft lookahead, target history) and shares it across every layer and head. To tell how much of its
loss comes from the prediction and how much from sharing one set, the walk can replace a method's
selection by one made from the *true* attention of the step's γ+1 verification queries (the dense
method's queries and keys at the same step, see :func:`dustin_hf.selection.recovery.position_weights`):

* ``"shared"``: the top ``budget`` positions of the attention averaged over all layers, heads and
  queries, one set read by every sparse layer (what a perfect Dustin scorer would pick; since
  recovery is linear, no shared set of that size captures more);
* ``"per-layer"``: each layer's own top ``budget`` positions of its attention averaged over its
  heads and queries.

Per-layer sets need a read set per layer, which the kernels do not take: :func:`layerwise_plan`
hands each layer its own indices on the plain-PyTorch path, through the plan's declared ``read_hook``
(:mod:`dustin_hf.experimental`); the tests check the routing against ``dense_layers``.
"""

from __future__ import annotations

import torch

from dustin_hf.experimental import DeviceTensors, ForwardPlan

__all__ = ["ORACLES", "layerwise_plan", "oracle_indices"]

ORACLES = ("shared", "per-layer")


def oracle_indices(weights: torch.Tensor, budget: int, kind: str) -> torch.Tensor:
    """The oracle's read set(s) from ``weights (n_layers, L)`` (per layer, attention over ``[0, L)``).

    Returns sorted int32 positions: ``(1, budget)`` for ``"shared"`` (one set for every layer),
    ``(n_layers, budget)`` for ``"per-layer"`` (row ``l``: layer ``l``'s set).
    """
    if kind not in ORACLES:
        raise ValueError(f"unknown oracle {kind!r}; choose one of {ORACLES}")
    scores = weights.mean(dim=0, keepdim=True) if kind == "shared" else weights  # (1 or n_layers, L)
    return scores.topk(budget, dim=1, sorted=False).indices.sort(dim=1).values.to(torch.int32)


def oracle_recovery(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per layer, the share of ``weights (n_layers, L)`` that ``indices`` (one row, or one per layer) capture."""
    return weights.gather(1, indices.long().expand(weights.shape[0], -1)).sum(dim=1)  # (n_layers,)


def layerwise_plan(layer_indices: dict[int, torch.Tensor], **plan_kwargs) -> ForwardPlan:
    """A one-row sparse :class:`ForwardPlan` (``plan_kwargs``) whose layer ``l`` reads ``layer_indices[l] (1, W)``
    int32 (layers not in it, or in ``dense_layers``, read as the base plan says). Plain-PyTorch path only."""
    if plan_kwargs.get("indices") is None or plan_kwargs["rows"].stop - plan_kwargs["rows"].start != 1:
        raise ValueError(
            "a layerwise plan is sparse (give indices for the layers it does not override) and has one row"
        )
    backend = plan_kwargs.get("backend", "reference")
    if backend != "reference":
        raise ValueError(f"per-layer read sets run on the 'reference' backend only, not {backend!r}")

    def read_hook(layer: int, tensors: DeviceTensors) -> DeviceTensors:
        own = layer_indices.get(layer)
        if own is None:
            return tensors
        device = tensors.cache_seqlens.device
        return DeviceTensors(
            tensors.cache_seqlens, own.to(device, torch.int32), torch.full_like(tensors.num_indices, own.shape[1])
        )

    return ForwardPlan(**plan_kwargs, read_hook=read_hook)
