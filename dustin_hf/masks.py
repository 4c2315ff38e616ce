"""From ``generate()``'s ``input_ids`` and ``attention_mask`` to each row's prompt, read as stock transformers reads it.

Stock ``generate()`` (decoder-only, transformers 5.17-5.24) keeps every input slot: a slot whose mask is 0 is
never attended to by any query, its position id is 0, and every other slot's position id is the number of
unmasked slots before it (``cumsum(mask) - 1``). The first new token is predicted by the *last* slot's query,
masked or not, and the new tokens take position ids ``last slot's position + 1, + 2, ...``.

A row therefore decodes exactly as its unmasked tokens alone would (positions ``0 .. n-1``), with two
exceptions when its last slot is masked (right padding, or the ``tril`` masks of transformers' own tests): the
first new token comes from that slot's token at position 0, attending to the unmasked tokens but not to
itself; and the generated tokens' positions start at 1 instead of at ``n``. :class:`Prompt` records both, and
what logits processors see of the row: the input from its first unmasked slot on, masked slots included, as
stock would hand it to them were the row passed alone (left padding is what batching adds; the rest is the
row's own).

The caches hold the unmasked tokens only, but stock's cache keeps every input slot, and a sliding window counts
cache indices (transformers' ``sliding_window_overlay``: key visible iff ``kv_idx > q_idx - window``), so a masked
slot inside a window takes a place in it. :func:`stock_slots` maps each cache position to its index in stock's
cache, for the windows to count as stock does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Prompt", "check_token_ids", "prompts_from_mask", "stock_slots"]


@dataclass(frozen=True)
class Prompt:
    """One row of the input, as the decode loop keeps it.

    ``tokens`` are the unmasked ids (what the caches hold, at positions ``0 .. n-1``); ``pad`` the leading masked
    slots (left padding); ``view`` the ids from the first unmasked slot on, when they differ from ``tokens`` (a row
    with masked slots after its first real token), else ``None``; ``last`` the masked last slot's token id when
    the first new token comes from it (else ``None``); ``first_position`` the position id of the first new token;
    ``slots`` the input slots the tokens came from.
    """

    tokens: torch.Tensor
    pad: int
    view: torch.Tensor | None = None
    last: int | None = None
    first_position: int | None = None
    slots: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.tokens.numel()

    @property
    def position_shift(self) -> int:
        """What the new tokens' position ids add to their cache slots (0 for a row whose last slot is real)."""
        return 0 if self.first_position is None else self.first_position - self.length


def prompts_from_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[Prompt]:
    """Each row's :class:`Prompt`. A row with no unmasked slot is an error (stock would attend to nothing)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return [Prompt(ids, 0, slots=torch.arange(ids.numel(), device=ids.device)) for ids in input_ids]
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
        tokens = ids[where]
        view = ids[start:] if (stop - start != where.numel() or stop < ids.numel()) else None
        if stop == ids.numel():
            prompts.append(Prompt(tokens, start, view, slots=where))
        else:  # the last slot is masked: its query (position 0) names the first new token, which sits at 1
            prompts.append(Prompt(tokens, start, view, last=int(ids[-1]), first_position=1, slots=where))
    return prompts


def stock_slots(prompts: list[Prompt], width: int, capacity: int) -> torch.Tensor | None:
    """``(B, capacity)`` int64 on the CPU: the index each row's cache position has in stock's cache, where every
    input slot keeps its place, masked or not, and the new tokens follow the ``width`` input slots: prompt token
    ``c`` at its input slot ``slots[c]``, the new token at cache position ``n + k`` at ``width + k``. The indices
    only grow along a row. ``None`` where every row's indices are its cache positions plus one offset (no masked
    slot after a row's first real token: left padding moves a whole row alike, and distances stay the cache's)."""
    table = torch.arange(capacity).repeat(len(prompts), 1)
    for b, p in enumerate(prompts):
        table[b, p.length :] += width - p.length
        table[b, : p.length] = p.slots.cpu()
    offsets = table - torch.arange(capacity)
    return None if bool((offsets == offsets[:, :1]).all()) else table


def check_token_ids(prompts: list[Prompt], vocab: int) -> None:
    """Every prompt id must be one the target can embed (an id past its embedding would fail deep in its forward)."""
    for b, p in enumerate(prompts):
        low, high = int(p.tokens.min()), int(p.tokens.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids row {b} holds token id {low if low < 0 else high}, outside the target's "
                             f"vocabulary [0, {vocab})")
