"""The attention function registered in transformers under the name ``"dustin"``.

transformers calls it from every attention layer with the layer's post-RoPE queries and what the
cache's ``update`` returned (views of the full preallocated buffers). Everything else it needs,
each row's length, the step's sparse read set, which queries to keep for scoring, comes from the
:class:`~dustin_hf.runtime.plan.ForwardPlan` the decoding loop passes to the model as the keyword
argument ``dustin_plan`` (transformers forwards unknown keyword arguments down to attention).

No attention mask is registered for this name, so transformers builds none; causality (bottom-right:
query i sees cached positions and new tokens up to itself) is the kernel's job.

A sliding-window layer (``module.sliding_window``, Mistral's and Qwen2's windowed layers) whose window can cut
the keys of this forward, or whose rows count masked input slots in their windows as stock does
(``ForwardPlan.window_slots``), runs the general masked path (:mod:`dustin_hf.kernels.masked`): every query sees only
its window; on a sparse step the layer reads its whole window when the window fits the read budget (so a budget
covering the window is exact), else the selection within it. The same path serves the hidden query of a masked
last input slot (``ForwardPlan.hide_new``) and ``output_attentions`` (``ForwardPlan.attention_weights``).

A selection layer of a sparse forward (``ForwardPlan.select``) reads every cached position and hands the choice of
the read set of the layers after it to the selection layers' policy
(:func:`~dustin_hf.selection.layers.choose_in_forward`), which on the Triton backend may compute the layer's attention
with it (its keys read once).
"""

from __future__ import annotations

import torch

from ..kernels import full_rows_written, verify_attention
from ..kernels.masked import masked_attention
from ..kernels.reference import prefill_attention
from ..runtime.plan import ForwardPlan
from ..selection.layers import choose_in_forward

__all__ = ["ATTENTION_NAME", "dustin_attention"]

# Never put "flash" in this name: transformers switches on it for flash-specific mask handling.
ATTENTION_NAME = "dustin"
# Dense forwards with more new tokens than this (prefill chunks) go to PyTorch's SDPA (cuDNN or flash kernels on
# CUDA); the decode-style backends pack G*Q query rows per program and are built for a few queries.
_MAX_DECODE_QUERIES = 64


def dustin_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dustin_plan: ForwardPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query (B, Hq, Q, D)``, ``key/value (B, Hkv, capacity, D)`` -> ``(B, Q, Hq, D)`` and, only when the plan asks
    for them, the weights ``(B, Hq, Q, max cached + Q)`` over cache slots."""
    _check_supported(module, dropout, softcap, dustin_plan)
    plan = dustin_plan
    q = query.transpose(1, 2)  # (B, Q, Hq, D)
    k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)  # (B, capacity, Hkv, D): the cache's own layout
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    plan.keep_queries(module.layer_idx, q)
    tensors = plan.on(q.device)
    sparse = tensors.indices is not None and module.layer_idx not in plan.dense_layers
    window = None  # a window that cuts this forward's keys, or one that counts masked input slots too
    if sliding_window is not None and (sliding_window < plan.max_seqlen_k or plan.window_slots is not None):
        window = sliding_window
    masked = window is not None or plan.hide_new or plan.attention_weights
    if plan.selects_at(module.layer_idx):  # reads everything and chooses what the layers after it read
        sparse = False
        out = choose_in_forward(plan, q, k_cache, v_cache, tensors, scale, window, masked)
        if out is not None:
            return out, None
    if masked:
        return _masked(plan, q, k_cache, v_cache, tensors, scale, window, sparse)
    prompt = not plan.is_sparse and plan.q_len > _MAX_DECODE_QUERIES
    if prompt and plan.uniform_start is not None:  # a prompt chunk of rows that all hold as many positions
        return prefill_attention(q, k_cache, v_cache, plan.uniform_start, softmax_scale=scale), None
    out = verify_attention(
        q,
        k_cache,
        v_cache,
        tensors.cache_seqlens,
        softmax_scale=scale,
        indices=tensors.indices if sparse else None,
        num_indices=tensors.num_indices if sparse else None,
        max_seqlen_k=plan.max_seqlen_k,
        full_rows=sparse and plan.full_rows,
        backend="reference" if prompt else plan.backend,
        tuning=None if plan.tuning is None else plan.tuning.verify,
    )
    return out, None


def _check_supported(module: torch.nn.Module, dropout: float, softcap: float | None, plan: ForwardPlan | None) -> None:
    if plan is None:
        raise RuntimeError(
            "the 'dustin' attention runs only inside dustin_hf's decoding loop; call "
            "model.generate(..., assistant_model=draft, cache_implementation='dustin'), or restore the model's "
            "attention with the handle returned by dustin_hf.patch(model)"
        )
    if softcap is not None:
        raise NotImplementedError(
            f"layer {module.layer_idx} uses attention softcapping, which Dustin does not support; use a model without "
            "it (Llama, Mistral, Qwen2/2.5/3)"
        )
    if module.training and dropout:
        raise NotImplementedError("Dustin attention is for inference; call model.eval() first")


def _masked(plan: ForwardPlan, q, k_cache, v_cache, tensors, scale: float, window: int | None, sparse: bool):
    """The general masked path (module docstring): a sparse layer reads its whole window where the window fits the
    read budget, else the selection within it."""
    sparse = sparse and not (window is not None and window <= plan.read_budget)
    indices, num_indices = (tensors.indices, tensors.num_indices) if sparse else (None, None)
    if sparse and plan.full_rows:  # the masked path reads listed positions only
        indices, num_indices = full_rows_written(
            indices, num_indices, tensors.cache_seqlens, plan.max_seqlen_k, plan.q_len
        )
    return masked_attention(
        q,
        k_cache,
        v_cache,
        tensors.cache_seqlens,
        softmax_scale=scale,
        indices=indices,
        num_indices=num_indices,
        window=window,
        key_slots=plan.window_slots_on(q.device),
        hide_new=plan.hide_new,
        return_weights=plan.attention_weights,
    )
