"""From ``generate()``'s ``input_ids`` and ``attention_mask`` to each row's prompt tokens."""

from __future__ import annotations

import torch

__all__ = ["prompts_from_mask"]


def prompts_from_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real tokens: the positions where ``attention_mask`` is 1 (one contiguous run per row).

    Left padding is what decoder-only generation expects; right padding is accepted too (the mask
    says where the prompt is). A row with no tokens, or with holes in its mask, is an error.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return list(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids shape {tuple(input_ids.shape)}"
        )
    prompts = []
    for b, (ids, mask) in enumerate(zip(input_ids, attention_mask.bool())):
        where = mask.nonzero().flatten()
        if where.numel() == 0:
            raise ValueError(f"row {b} of the batch has an empty prompt (its attention_mask is all zeros)")
        start, stop = int(where[0]), int(where[-1]) + 1
        if stop - start != where.numel():
            raise ValueError(f"row {b}: attention_mask has holes; only left (or right) padding is supported")
        prompts.append(ids[start:stop])
    return prompts
