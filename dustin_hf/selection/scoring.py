"""Importance of each cached position: attention probabilities on a few chosen heads.

Flash-style kernels never materialise attention probabilities, so Dustin recomputes them, but only
for the scoring heads (paper: 1 target layer x 4 heads, 3 draft layers x 4 heads). The query
vectors are kept during the forwards (see ``ForwardPlan.capture``); here they meet the keys:

- target history ``S_target[b, p]``: the last committed token's attention over the cached
  positions ``[0, L_b)`` (it sits at ``L_b - 1``, so it sees all of them), summed over heads;
- draft lookahead ``S_draft[b, p]``: the attention of the draft queries that produced the γ draft
  tokens (query i at position ``L_b + i`` sees ``[0, L_b + i]`` of the draft's cache), summed over
  queries, layers and heads, then restricted to ``[0, L_b)``.

Each query's softmax is normalised over everything it attends to, so the scores are true
probability masses. Heads that share a KV head are scored together: the key rows are read once.

``backend="reference"`` is the PyTorch code below (the oracle, and the path on CPU);
``backend="triton"`` runs :mod:`dustin_hf.kernels.triton_score` (same results, no host sync).
"""

from __future__ import annotations

import torch

from ..kernels.tuning import ScoreTuning

__all__ = ["attention_mass", "target_history_scores", "draft_lookahead_scores"]


def attention_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_pos: torch.Tensor,
    heads: tuple[int, ...],
    group_size: int,
    softmax_scale: float,
    num_positions: int,
    key_span: int,
    backend: str = "reference",
    query_offset: int = 0,
    query_step: int = 0,
    query_counts: torch.Tensor | None = None,
    tuning: ScoreTuning | None = None,
) -> torch.Tensor:
    """Summed attention probabilities of ``queries`` over key positions ``[0, num_positions)``.

    Args:
        queries: ``(B, n_q, len(heads), D)``, post-RoPE queries of query heads ``heads``.
        keys: ``(B, capacity, kv_heads, D)``, a cache buffer (post-RoPE keys).
        query_pos: ``(B, n_q)`` int; query j of row b sees key positions ``<= query_pos[b, j]``.
        heads: query head ids; head h reads KV head ``h // group_size``.
        softmax_scale: the model's attention scale.
        num_positions: how many leading key positions to score (host int).
        key_span: one past the last position any query sees (host int): every key it sees lies below.
        backend: ``"reference"`` (PyTorch) or ``"triton"`` (the fused kernel; CUDA, or the Triton
            interpreter on CPU).
        query_offset, query_step: query j of row b sits at ``query_pos[b, j] + query_offset + j *
            query_step`` (host ints); lets callers pass a stride-0 view of per-row lengths (the Triton
            path then launches nothing to make the positions).
        query_counts: ``(B,)`` int: row b counts only its first ``query_counts[b]`` queries (``None``: all).
        tuning: the Triton kernel's launch heuristic (``None``: the default).

    Returns:
        ``(B, num_positions)`` float32: per position, the probability mass it receives summed over
        queries and heads (positions a query cannot see get nothing from it).
    """
    args = (queries, keys, query_pos, heads, group_size, softmax_scale, num_positions, key_span)
    if backend == "triton":
        return _attention_mass_triton(*args, query_offset, query_step, query_counts, tuning)
    _check_backend(backend)
    return _attention_mass_reference(*args, query_offset, query_step, query_counts)


def _attention_mass_triton(
    queries, keys, query_pos, heads, group_size, softmax_scale, num_positions, key_span, offset, step, counts, tuning
) -> torch.Tensor:
    from ..kernels import launch_device
    from ..kernels.triton_score import attention_mass_triton

    with launch_device(queries):
        return attention_mass_triton(
            queries,
            keys,
            query_pos.to(keys.device),
            heads,
            group_size,
            softmax_scale,
            num_positions,
            key_span,
            query_offset=offset,
            query_step=step,
            query_counts=None if counts is None else counts.to(keys.device),
            tuning=tuning,
        )


def _attention_mass_reference(
    queries, keys, query_pos, heads, group_size, softmax_scale, num_positions, key_span, offset, step, counts
) -> torch.Tensor:
    """:func:`attention_mass` in PyTorch, one matmul per KV head over the query heads that read it."""
    batch, n_q = queries.shape[:2]
    query_pos = query_pos.long() + offset + step * torch.arange(n_q, device=query_pos.device)
    span = max(key_span, num_positions)
    total = torch.zeros(batch, num_positions, dtype=torch.float32, device=queries.device)
    # each query's softmax runs over everything it sees, which can reach past `num_positions`
    key_pos = torch.arange(span, device=queries.device)
    hidden = (key_pos[None, None, :] > query_pos[:, :, None].long())[:, :, None, :]  # (B, n_q, 1, span)
    for kv_head in sorted({h // group_size for h in heads}):
        members = [i for i, h in enumerate(heads) if h // group_size == kv_head]
        q = queries[:, :, members].to(keys.dtype).reshape(batch, n_q * len(members), -1)  # (B, n_q*n_h, D)
        k = keys[:, :span, kv_head]  # (B, span, D): a strided view, the key rows are read once by the matmul
        logits = torch.matmul(q, k.transpose(1, 2)).float().mul_(softmax_scale)  # (B, n_q*n_h, span)
        logits = logits.view(batch, n_q, len(members), span).masked_fill_(hidden, float("-inf"))
        probs = logits.softmax(dim=-1)  # (B, n_q, n_h, span)
        if counts is not None:  # a row's queries past its own count contribute nothing
            counted = torch.arange(n_q, device=probs.device)[None, :] < counts.to(probs.device)[:, None]
            probs = probs * counted[:, :, None, None]
        total += probs[..., :num_positions].sum(dim=(1, 2))
    return total


def target_history_scores(
    history_queries: torch.Tensor,
    keys: torch.Tensor,
    seqlens: torch.Tensor,
    heads: tuple[int, ...],
    group_size: int,
    softmax_scale: float,
    num_positions: int,
    backend: str = "reference",
    tuning: ScoreTuning | None = None,
) -> torch.Tensor:
    """``S_target``: ``history_queries (B, len(heads), D)`` of the token at ``seqlens - 1`` -> ``(B, num_positions)``.

    ``num_positions`` is ``max(seqlens)`` (host int); ``backend`` as in :func:`attention_mass`.
    """
    return attention_mass(  # the query sits at L_b - 1: a view of the lengths and an offset, nothing computed
        history_queries[:, None],
        keys,
        seqlens[:, None],
        heads,
        group_size,
        softmax_scale,
        num_positions,
        num_positions,
        backend=backend,
        query_offset=-1,
        tuning=tuning,
    )


def draft_lookahead_scores(
    draft_queries: list[torch.Tensor],
    draft_keys: list[torch.Tensor],
    seqlens: torch.Tensor,
    heads: tuple[tuple[int, ...], ...],
    group_size: int,
    softmax_scale: float,
    num_positions: int,
    backend: str = "reference",
    query_counts: torch.Tensor | None = None,
    tuning: ScoreTuning | None = None,
) -> torch.Tensor:
    """``S_draft`` summed over the draft scoring layers.

    Args:
        draft_queries: per scoring layer, ``(B, γ, len(heads[l]), D)``: query i sat at ``seqlens + i``.
        draft_keys: per scoring layer, the draft cache's key buffer ``(B, capacity, kv_heads, D)``.
        seqlens: ``(B,)`` the target's cached positions ``L_b`` (the draft's first query is at ``L_b``).
        num_positions: ``max(seqlens)`` (host int).
        backend: as in :func:`attention_mass`.
        query_counts: ``(B,)``: the drafts each row proposed (a row that stopped drafting early scores with its
            own queries only); ``None``: all γ. Given, the PyTorch path runs.
    """
    gamma = draft_queries[0].shape[1]
    if backend == "triton" and len({q.device for q in draft_queries}) == 1 and query_counts is None:
        return _draft_lookahead_triton(
            draft_queries, draft_keys, seqlens, heads, group_size, softmax_scale, num_positions, tuning
        )
    _check_backend(backend)
    query_pos = seqlens.long()[:, None] + torch.arange(gamma, device=seqlens.device)  # (B, γ)
    total = None
    for queries, keys, layer_heads in zip(draft_queries, draft_keys, heads):
        mass = attention_mass(
            queries,
            keys,
            query_pos.to(queries.device),
            layer_heads,
            group_size,
            softmax_scale,
            num_positions,
            num_positions + gamma,
            backend="reference" if query_counts is not None else backend,
            query_counts=query_counts,
        )
        total = mass if total is None else total + mass.to(total.device)
    # the draft tokens' own positions ([L_b, L_b + γ) of row b) are new tokens, not cached ones
    cached = torch.arange(num_positions, device=total.device)[None, :] < seqlens.to(total.device)[:, None]
    return total * cached


def _draft_lookahead_triton(
    draft_queries, draft_keys, seqlens, heads, group_size, softmax_scale, num_positions, tuning
) -> torch.Tensor:
    """The Triton path of :func:`draft_lookahead_scores`: one call for all layers (their scores summed in
    one pass 2, which also zeroes the draft tokens' own positions), the positions ``L_b + i`` taken from a
    view of the lengths: no elementwise kernels."""
    from ..kernels import launch_device
    from ..kernels.triton_score import attention_mass_layers_triton

    gamma = draft_queries[0].shape[1]
    seqlens = seqlens.to(draft_queries[0].device)
    with launch_device(draft_queries[0]):
        return attention_mass_layers_triton(
            draft_queries,
            draft_keys,
            seqlens[:, None].expand(-1, gamma),
            heads,
            group_size,
            softmax_scale,
            num_positions,
            num_positions + gamma,
            position_limit=seqlens,
            query_step=1,
            tuning=tuning,
        )


def _check_backend(backend: str) -> None:
    if backend not in ("reference", "triton"):
        raise ValueError(f"unknown scoring backend {backend!r}; choose 'reference' or 'triton'")
