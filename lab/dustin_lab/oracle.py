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

Per-layer sets need a read set per layer, which the kernels do not take: :class:`LayerwisePlan`
hands each layer its own indices on the plain-PyTorch path. It relies on the attention function
calling :meth:`ForwardPlan.keep_queries` for a layer before :meth:`ForwardPlan.on` (as
:func:`dustin_hf.adapter.attention.dustin_attention` does); the tests check the routing against
``dense_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dustin_hf.runtime.plan import DeviceTensors, ForwardPlan

__all__ = ["ORACLES", "LayerwisePlan", "oracle_indices"]

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


@dataclass
class LayerwisePlan(ForwardPlan):
    """A one-row sparse :class:`ForwardPlan` whose layer ``l`` reads ``layer_indices[l] (1, W)`` int32
    (layers not in it, or in ``dense_layers``, read as the base plan says). Plain-PyTorch path only."""

    layer_indices: dict[int, torch.Tensor] = field(default_factory=dict)
    _layer: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.indices is None or self.batch_size != 1:
            raise ValueError(
                "a LayerwisePlan is sparse (give indices for the layers it does not override) and has one row"
            )
        if self.backend != "reference":
            raise ValueError(f"per-layer read sets run on the 'reference' backend only, not {self.backend!r}")

    def keep_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        self._layer = layer_idx  # the attention function asks for this layer's tensors next
        super().keep_queries(layer_idx, query)

    def on(self, device: torch.device) -> DeviceTensors:
        tensors = super().on(device)
        own = self.layer_indices.get(self._layer)
        if own is None:
            return tensors
        return DeviceTensors(
            tensors.cache_seqlens, own.to(device, torch.int32), torch.full_like(tensors.num_indices, own.shape[1])
        )
