"""The selection layers' policy (``selection="verify"``): the forward chooses the read set of the layers after them.

Dustin chooses a step's read set before the verification forward, from signals that only approximate its
queries (the last committed token's attention, the draft's). The forward itself computes the queries of the
very tokens it verifies. At a selection layer (``DustinConfig(selection="verify")``; TidalDecode's token-selection
layers) those γ+1 queries attend to every cached position, and each row's read set for the layers after it (up
to the next selection layer) becomes:

1. the first ``sink_tokens`` and the last ``recent_tokens`` cached positions;
2. the rest of the row's count by the layer's attention: per position, the mean over the layer's heads and the
   row's own queries (the tokens it verifies: a row that drafted fewer than the longest row's count scores without
   the tokens past its own) of each query's attention over the cached positions (its softmax over them alone, as
   :func:`dustin_hf.selection.recovery.position_weights` defines it, so that calibration scores sets the same way).

A row keeps its count (the budget, or the quality knob's count), so the later layers read as many positions as
they would have read of Dustin's set; a row that reads everything (its count covers what it holds) keeps doing so.
Layers before the first selection layer read the set chosen before the forward. Rows are independent; nothing
is read on the host, so a captured forward replays the choice. Where the selection layer's own sliding window cuts
the keys, it chooses inside that window (the window's first positions are its sinks), ranking positions by the
softmax over the whole cache (the same order as over the window alone, up to the positions it excludes); a model
mixing windowed and full layers chooses as its selection layer attends.

``backend="reference"`` is the PyTorch code below (the oracle, and the path on CPU). With ``backend="triton"``
the scoring runs in the project's scoring kernel (:mod:`dustin_hf.kernels.triton_score`: the keys read once in
their own dtype, where PyTorch makes an fp32 copy of the layer's keys and its logits), all heads of a KV head
packed in one program, a row's queries past its own count left out in the kernel, and the fill in the selection
kernel (:mod:`dustin_hf.kernels.triton_select`, with a history score only and per-row counts) instead of a
``topk`` over the whole span, a concatenation and a sort. The fill's tie rule is that kernel's (lowest positions
first; ``torch.topk`` takes any), and the kernel multiplies the queries in the keys' dtype as the attention does,
so at 16 bits the two paths may differ at a near-tie. Inside the decoding loop a selection layer on the Triton
backend goes further (:func:`selection_attention`): its dense attention kernel writes the scoring kernel's first
pass as it reads the keys, so the layer reads its keys once instead of twice.
"""

from __future__ import annotations

import torch

from ..kernels.tuning import ScoreTuning, SelectTuning
from ..runtime.plan import DeviceTensors, ForwardPlan, SelectLayers
from .scoring import attention_mass

__all__ = ["choose_in_forward", "choose_read_set", "layer_position_weights", "select_spec", "selection_attention"]


def choose_in_forward(
    plan: ForwardPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tensors: DeviceTensors,
    softmax_scale: float,
    window: int | None,
    masked: bool,
) -> torch.Tensor | None:
    """A selection layer of ``plan`` (:meth:`~dustin_hf.runtime.plan.ForwardPlan.selects_at`) in the attention
    function: chooses the read set of the layers after it and keeps it on the plan.

    Args:
        q: ``(B, Q, nheads, headdim)``; ``k_cache``, ``v_cache``: ``(B, capacity, nheads_k, headdim)``.
        tensors: the plan's tensors on the layer's device (the read set so far).
        window: the layer's sliding window where it cuts the keys or counts masked input slots (``None``: none).
        masked: the layer attends through the general masked path (a window, hidden new tokens, weights returned).

    Returns the layer's attention output where the Triton path computed it with the choice
    (:func:`selection_attention`: one read of the keys), else ``None``: the layer then attends to everything as a
    dense layer does.
    """
    tuning = plan.tuning
    if plan.backend == "triton" and not masked:
        out, chosen = selection_attention(
            q, k_cache, v_cache, tensors, plan.key_span, plan.max_seqlen_k, plan.select, softmax_scale, tuning=tuning
        )
        plan.keep_selection(chosen)
        return out
    chosen = choose_read_set(
        q,
        k_cache,
        tensors,
        plan.key_span,
        plan.select,
        softmax_scale,
        backend="triton" if plan.backend == "triton" else "reference",  # as Dustin's own scoring
        score_tuning=None if tuning is None else tuning.score,
        select_tuning=None if tuning is None else tuning.select,
        window=window,
        key_slots=plan.window_slots_on(q.device) if window is not None else None,
    )
    plan.keep_selection(chosen)
    return None


def layer_position_weights(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    span: int,
    softmax_scale: float,
    query_counts: torch.Tensor | None = None,
    *,
    backend: str = "reference",
    tuning: ScoreTuning | None = None,
) -> torch.Tensor:
    """Per row, the mean over heads and queries of each query's attention over the row's cached positions.

    Args:
        q: ``(B, Q, nheads, headdim)``, the scoring queries (post-RoPE).
        k_cache: ``(B, capacity, nheads_k, headdim)``, ``capacity >= span``.
        cache_seqlens: ``(B,)`` int, cached positions per row (``<= span``).
        span: positions scored per row (host int).
        query_counts: ``(B,)`` int, the leading queries of each row that count (at least 1); ``None``: all ``Q``.
        backend: ``"reference"`` (PyTorch) or ``"triton"`` (the scoring kernel; CUDA, or the Triton interpreter).
        tuning: the scoring kernel's launch heuristic (``None``: its defaults).

    Returns ``(B, span)`` float32, zero past each row's length (a row with nothing cached: all zero).
    """
    if backend == "triton":
        return _position_weights_triton(q, k_cache, cache_seqlens, span, softmax_scale, query_counts, tuning)
    if backend != "reference":
        raise ValueError(f"unknown selection backend {backend!r}; choose 'reference' or 'triton'")
    batch, n_q, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    # (B, Hkv, G*Q, D): the query heads of one key head together, each head's queries in a row
    queries = (
        q.float()
        .reshape(batch, n_q, n_kv, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, n_kv, group * n_q, head_dim)
    )
    keys = k_cache[:, :span].float().permute(0, 2, 3, 1)  # (B, Hkv, D, span)
    logits = torch.matmul(queries, keys).mul_(softmax_scale)  # (B, Hkv, G*Q, span)
    outside = torch.arange(span, device=q.device)[None, :] >= cache_seqlens.to(q.device).long()[:, None]  # (B, span)
    logits.masked_fill_(outside[:, None, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).nan_to_num_(0.0).view(batch, n_kv, group, n_q, span)
    if query_counts is None:
        return probs.mean(dim=(1, 2, 3))  # (B, span)
    counts = query_counts.to(q.device).long().clamp(1, n_q)  # (B,)
    own = (torch.arange(n_q, device=q.device)[None, :] < counts[:, None]).to(probs.dtype)  # (B, Q)
    return (probs * own[:, None, None, :, None]).sum(dim=(1, 2, 3)) / (n_heads * counts[:, None])  # (B, span)


def _position_weights_triton(q, k_cache, cache_seqlens, span, softmax_scale, query_counts, tuning) -> torch.Tensor:
    """:func:`layer_position_weights` through the scoring kernel (:func:`~.scoring.attention_mass`, as Dustin's own
    history scores): every query of row ``b`` sits at ``L_b - 1`` (it sees the cached positions and nothing new),
    given as a stride-0 view of the lengths and an offset, so nothing but the kernel's two passes and one division
    is launched."""
    batch, n_q, n_heads, _ = q.shape
    seqlens = cache_seqlens.to(k_cache.device)
    counts = _counted(query_counts, n_q, k_cache.device)
    mass = attention_mass(
        q,
        k_cache,
        seqlens[:, None].expand(batch, n_q),
        tuple(range(n_heads)),
        n_heads // k_cache.shape[2],
        softmax_scale,
        span,
        span,
        backend="triton",
        query_offset=-1,
        query_counts=counts,
        tuning=tuning,
    )  # (B, span), summed over heads and queries
    return _mean(mass, n_heads, n_q, counts)


def _counted(query_counts: torch.Tensor | None, n_q: int, device: torch.device) -> torch.Tensor | None:
    """Each row's scoring queries on ``device``, at least one and at most ``n_q`` (``None``: all of them)."""
    return None if query_counts is None else query_counts.to(device).clamp(1, n_q)


def _mean(mass: torch.Tensor, n_heads: int, n_q: int, counts: torch.Tensor | None) -> torch.Tensor:
    """``mass`` ``(B, span)``, summed over heads and each row's counted queries, divided in place into the mean."""
    return mass.div_(n_heads * n_q) if counts is None else mass.div_((n_heads * counts)[:, None])


def choose_read_set(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    tensors: DeviceTensors,
    span: int,
    spec: SelectLayers,
    softmax_scale: float,
    *,
    backend: str = "reference",
    score_tuning: ScoreTuning | None = None,
    select_tuning: SelectTuning | None = None,
    weights: torch.Tensor | None = None,
    window: int | None = None,
    key_slots: torch.Tensor | None = None,
) -> DeviceTensors:
    """The read set of the layers after a selection layer (module docstring), from the layer's queries and keys.

    Args:
        q: ``(B, Q, nheads, headdim)``, the forward's queries at the selection layer (post-RoPE).
        k_cache: ``(B, capacity, nheads_k, headdim)``, the layer's cache rows of the forward.
        tensors: the read set so far: ``indices (B, W)`` int32, ``num_indices (B,)`` int32 (each row's count, kept),
            and ``query_counts (B,)`` int32 (each row's own leading queries; ``None``: all score).
        span: cached positions scored per row, ``>= max(cache_seqlens)`` (host int).
        spec: the windows kept, and how many leading queries score.
        backend: ``"reference"`` (PyTorch) or ``"triton"`` (the scoring and selection kernels; the PyTorch fill
            where the span outgrows the selection kernel's pools). ``score_tuning`` / ``select_tuning``: their
            launch heuristics (``None``: the defaults).
        weights: ``(B, span)``, the layer's :func:`layer_position_weights` when already computed
            (:func:`selection_attention`); ``None``: computed here.
        window: the layer's sliding window where it cuts the keys (``None``: none): the choice stays inside what
            the step's first query sees, as :func:`~dustin_hf.selection.fill.select_positions` chooses (the sinks are
            the window's first positions), and a row whose count covers its window keeps its index row.
        key_slots: ``(B, capacity)``, the index the window counts for each slot where rows have masked input slots
            (:attr:`~dustin_hf.runtime.plan.ForwardPlan.window_slots`); ``None``: the slot itself.

    Returns the new :class:`DeviceTensors` (same ``cache_seqlens`` and ``num_indices``; sorted indices, the
    entries past a row's count 0, never read); a row whose count covers its length (or its window) keeps its index
    row.
    """
    seqlens = tensors.cache_seqlens.long()
    counts = tensors.num_indices.long()
    width = tensors.indices.shape[1]
    if weights is None:
        weights = layer_position_weights(
            q[:, : _score_queries(q, spec)],
            k_cache,
            seqlens,
            span,
            softmax_scale,
            tensors.query_counts,
            backend=backend,
            tuning=score_tuning,
        )  # (B, span)
    sink, recent = spec.sink_tokens, spec.recent_tokens
    low = torch.zeros_like(seqlens) if window is None else _window_start(seqlens, window, key_slots)
    full = (counts >= seqlens - low)[:, None]  # the whole window (or cache) fits the row's count: kept
    if window is None and backend == "triton" and _fills_in_kernel(span, width, sink, recent, select_tuning):
        return _fill_in_kernel(weights, tensors, sink, recent, full, select_tuning)
    return _fill(weights, tensors, span, sink, recent, low, full)


def _fill_in_kernel(
    weights: torch.Tensor,
    tensors: DeviceTensors,
    sink: int,
    recent: int,
    full: torch.Tensor,
    tuning: SelectTuning | None,
) -> DeviceTensors:
    """:func:`choose_read_set`'s fill in the selection kernel, with the history score alone (a draft share of 0) and
    each row's count; a ``full`` row keeps its index row."""
    from ..kernels import launch_device
    from ..kernels.triton_select import select_sparse_triton

    with launch_device(weights):
        chosen = select_sparse_triton(
            weights,
            weights,
            tensors.cache_seqlens.long(),
            sink=sink,
            recent=recent,
            share=0,
            fill=tensors.indices.shape[1] - sink - recent,
            counts=tensors.num_indices.long(),
            tuning=tuning,
        )
    return DeviceTensors(
        tensors.cache_seqlens, torch.where(full, tensors.indices, chosen), tensors.num_indices, tensors.query_counts
    )


def _window_start(seqlens: torch.Tensor, window: int, key_slots: torch.Tensor | None) -> torch.Tensor:
    """``(B,)``: each row's first cached position the step's first query (at position ``L``) sees through a sliding
    window: ``L - window + 1``, or, where ``key_slots`` gives the index the window counts (rows with masked input
    slots), the first position whose index is past the first query's minus the window."""
    if key_slots is None:
        return (seqlens - window + 1).clamp_min(0)
    index = key_slots.to(seqlens.device).long()
    first = index.gather(1, seqlens[:, None].clamp_max(index.shape[1] - 1))  # (B, 1)
    before = torch.arange(index.shape[1], device=index.device)[None, :] < seqlens[:, None]
    return ((index <= first - window) & before).sum(dim=1)  # indices only grow along a row


def _fill(
    weights: torch.Tensor,
    tensors: DeviceTensors,
    span: int,
    sink: int,
    recent: int,
    low: torch.Tensor,
    full: torch.Tensor,
) -> DeviceTensors:
    """:func:`choose_read_set`'s fill in PyTorch, inside each row's ``[low, L)`` (``low`` 0 but for a sliding
    window): its first ``sink`` positions, the last ``recent``, then the rest of the row's count by weight; a
    ``full`` row keeps its index row."""
    seqlens, counts, width = tensors.cache_seqlens.long(), tensors.num_indices.long(), tensors.indices.shape[1]
    positions = torch.arange(span, device=weights.device)[None, :]
    outside = (positions < low[:, None]) | (positions >= seqlens[:, None])
    taken = outside | (positions < low[:, None] + sink) | (positions >= seqlens[:, None] - recent)
    fill = min(max(width - sink - recent, 0), span)
    top = weights.masked_fill(taken, -1.0).topk(fill, dim=1).indices
    past = span + 1  # "not chosen": sorts last
    top = torch.where(torch.arange(fill, device=top.device)[None, :] < (counts - sink - recent)[:, None], top, past)
    chosen = torch.cat(
        [
            low[:, None] + torch.arange(sink, device=low.device),
            seqlens[:, None] - recent + torch.arange(recent, device=seqlens.device),
            top,
        ],
        dim=1,
    )
    chosen = chosen.sort(dim=1).values
    chosen = torch.where(chosen == past, 0, chosen)
    chosen = torch.nn.functional.pad(chosen, (0, width - chosen.shape[1]))[:, :width].to(torch.int32)
    return DeviceTensors(
        tensors.cache_seqlens, torch.where(full, tensors.indices, chosen), tensors.num_indices, tensors.query_counts
    )


def selection_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tensors: DeviceTensors,
    span: int,
    max_seqlen_k: int,
    spec: SelectLayers,
    softmax_scale: float,
    *,
    tuning=None,
) -> tuple[torch.Tensor, DeviceTensors]:
    """A selection layer on the Triton path: its dense attention and its choice from one read of its keys.

    The verification kernel writes the scores of the scoring queries as it attends
    (:func:`~dustin_hf.kernels.triton_verify.verify_attention_scores_triton`), so the scoring kernel's pass 1,
    which would read the keys a second time, is not run; its pass 2 and the fill follow as in
    :func:`choose_read_set`. The weights are :func:`layer_position_weights`'s, up to rounding (the product in the
    keys' dtype, the probabilities from 16-bit shifted scores, as the scoring kernel's).

    Args:
        q: ``(B, Q, nheads, headdim)``; ``k_cache``, ``v_cache``: ``(B, capacity, nheads_k, headdim)``.
        tensors, span, spec, softmax_scale: as :func:`choose_read_set`; ``max_seqlen_k``: as the dense call's.
        tuning: the kernels' :class:`~dustin_hf.kernels.tuning.KernelTuning` (``None``: the defaults).

    Returns the attention output ``(B, Q, nheads, headdim)`` and the read set of the layers after this one.
    """
    from ..kernels import launch_device
    from ..kernels.triton_score import attention_mass_from_scores
    from ..kernels.triton_verify import verify_attention_scores_triton

    n_q, n_heads = _score_queries(q, spec), q.shape[2]
    counts = _counted(tensors.query_counts, n_q, q.device)
    with launch_device(q):
        out, buffers = verify_attention_scores_triton(
            q,
            k_cache,
            v_cache,
            tensors.cache_seqlens,
            softmax_scale=softmax_scale,
            max_seqlen_k=max_seqlen_k,
            span=span,
            score_queries=n_q,
            query_counts=counts,
            tuning=None if tuning is None else tuning.verify,
            score_tuning=None if tuning is None else tuning.score,
        )
        mass = attention_mass_from_scores(buffers, tensors.cache_seqlens, counts)  # (B, span)
    chosen = choose_read_set(
        q,
        k_cache,
        tensors,
        span,
        spec,
        softmax_scale,
        backend="triton",
        select_tuning=None if tuning is None else tuning.select,
        weights=_mean(mass, n_heads, n_q, counts),
    )
    return out, chosen


def _score_queries(q: torch.Tensor, spec: SelectLayers) -> int:
    """The leading queries that score: all of ``q``'s, or ``spec.queries`` of them."""
    return q.shape[1] if spec.queries is None else min(spec.queries, q.shape[1])


def _fills_in_kernel(span: int, width: int, sink: int, recent: int, tuning: SelectTuning | None) -> bool:
    """Whether the selection kernel takes this fill (host ints): a width with room past the windows, and pools
    that fit one program. (A row with fewer candidates than its fill reads in full by its count: its index row
    is kept, whatever the kernel wrote.)"""
    from ..kernels.triton_select import supports

    fill = width - sink - recent
    return fill > 0 and supports(span, 0, fill, tuning)


def select_spec(config, queries: int | None = None) -> SelectLayers | None:
    """The :class:`SelectLayers` of a resolved config (``None``: Dustin's selection alone); ``queries``: the
    leading queries that score (``None``: all)."""
    if config is None or not config.selection_layers:
        return None
    return SelectLayers(config.selection_layers, config.sink_tokens, config.recent_tokens, queries)
