"""From ``generate()``'s ``input_ids`` and ``attention_mask`` to each row's prompt, read as stock transformers reads
it.

Stock ``generate()`` (decoder-only, transformers 5.17-5.25) keeps every input slot: a slot whose mask is 0 is
never attended to by any query, its position id is 0, and every other slot's position id is the number of
unmasked slots before it (``cumsum(mask) - 1``). The first new token is predicted by the *last* slot's query,
masked or not, and the new tokens take position ids ``last slot's position + 1, + 2, ...``.

A row therefore decodes exactly as its unmasked tokens alone would (positions ``0 .. n-1``), with two
exceptions when its last slot is masked (right padding, or the ``tril`` masks of transformers' own tests): the
first new token comes from that slot's token at position 0, attending to the unmasked tokens but not to
itself; and the generated tokens' positions start at 1 instead of at ``n``. :class:`Prompt` records both, and
what logits processors (and stopping criteria) see of the row: in a batch, the input from its first unmasked slot
on, masked slots included, as stock would hand it to them were the row passed alone (left padding is what
batching adds; the rest is the row's own); at batch 1, the whole input, as stock hands it (nothing there was
added by batching, so leading masked slots are the row's own too).

Caller's ``position_ids`` (stock uses them as given for the input slots, and the new tokens continue from the last
slot's: ``position_ids[:, -1] + 1, + 2, ...``) replace ``cumsum(mask) - 1`` in the same places: each real token
keeps its slot's position id, the masked last slot's query takes that slot's, and the new tokens follow it.
:func:`position_table` gives every cache position its position id.

The caches hold the unmasked tokens only, but stock's cache keeps every input slot, and a sliding window counts
cache indices (transformers' ``sliding_window_overlay``: key visible iff ``kv_idx > q_idx - window``), so a masked
slot inside a window takes a place in it. :func:`stock_slots` maps each cache position to its index in stock's
cache, for the windows to count as stock does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Batch", "Prompt", "check_token_ids", "position_table", "prompts_from_mask", "read_batch", "stock_slots"]


@dataclass(frozen=True)
class Prompt:
    """One row of the input, as the decode loop keeps it.

    ``tokens`` are the unmasked ids (what the caches hold, at cache positions ``0 .. n-1``); ``pad`` the leading
    masked slots batching added (left padding; none at batch 1); ``view`` the ids from the slot after them on,
    when they differ from ``tokens`` (a row with masked slots after that), else ``None``; ``last`` the masked last
    slot's token id when the first new token comes from it (else ``None``); ``first_position`` the position id of
    the first new token, ``None`` when it is ``n``; ``positions`` the tokens' position ids, ``None`` when they are
    ``0 .. n-1``; ``slots`` the input slots the tokens came from.
    """

    tokens: torch.Tensor
    pad: int
    view: torch.Tensor | None = None
    last: int | None = None
    first_position: int | None = None
    slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.tokens.numel()

    @property
    def last_position(self) -> int:
        """The position id of the last input slot (the masked last slot's query runs there)."""
        return (self.length if self.first_position is None else self.first_position) - 1


def prompts_from_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
) -> list[Prompt]:
    """Each row's :class:`Prompt`. A row with no unmasked slot is an error (stock would attend to nothing).
    ``position_ids``: ``(batch, length)`` or ``(1, length)`` integers, stock's own (``cumsum(mask) - 1``, masked
    slots 0) when ``None``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if position_ids is None:
        position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)
    positions = _checked_positions(position_ids, input_ids).cpu()
    prompts = []
    for b, (ids, row_mask) in enumerate(zip(input_ids, mask)):
        where = row_mask.nonzero().flatten()
        if where.numel() == 0:
            raise ValueError(f"row {b} of the batch has an empty prompt (its attention_mask is all zeros)")
        start, stop = int(where[0]) if len(input_ids) > 1 else 0, int(where[-1]) + 1
        tokens = ids[where]
        view = ids[start:] if (stop - start != where.numel() or stop < ids.numel()) else None
        row = positions[b if positions.shape[0] > 1 else 0]
        own = row[where.cpu()]
        own = None if torch.equal(own, torch.arange(where.numel())) else own
        first = int(row[-1]) + 1  # stock: the new tokens continue from the last slot's position id
        first = None if first == where.numel() else first
        last = None if stop == ids.numel() else int(ids[-1])  # a masked last slot's query names the first new token
        prompts.append(Prompt(tokens, start, view, last=last, first_position=first, slots=where, positions=own))
    return prompts


def _checked_positions(position_ids: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``position_ids`` as int64, or a ``ValueError`` naming them where the decode loop cannot follow stock."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(f"position_ids must be an integer tensor, got {getattr(position_ids, 'dtype', position_ids)}")
    batch, width = input_ids.shape
    if position_ids.dim() != 2 or position_ids.shape[1] != width or position_ids.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} do not fit input_ids {tuple(input_ids.shape)}: "
            f"dustin_hf's decoding loop takes one position id per input slot, ({batch}, {width}) or (1, {width}) "
            "(multimodal 3-D position ids are not supported); leave position_ids unset for the positions stock "
            "derives from the attention mask"
        )
    return position_ids.long()


def position_table(prompts: list[Prompt], capacity: int) -> torch.Tensor | None:
    """``(B, capacity)`` int64 on the CPU: the position id of each row's cache position (its tokens' own, then the
    new tokens' from ``first_position`` on), or ``None`` where every row's are its cache positions."""
    if all(p.positions is None and p.first_position is None for p in prompts):
        return None
    table = torch.arange(capacity).repeat(len(prompts), 1)
    for b, p in enumerate(prompts):
        if p.positions is not None:
            table[b, : p.length] = p.positions
        if p.first_position is not None:
            table[b, p.length :] += p.first_position - p.length
    return table


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
            raise ValueError(
                f"input_ids row {b} holds token id {low if low < 0 else high}, outside the target's "
                f"vocabulary [0, {vocab})"
            )


@dataclass(frozen=True)
class Batch:
    """A call's input as the loop reads it: each row's prompt, and its tables over ``width`` cache slots a row."""

    prompts: list[Prompt]
    padded_len: int  # the input's width
    positions: torch.Tensor | None  # :func:`position_table`
    slots: torch.Tensor | None  # :func:`stock_slots`
    cached: list[int] | None = None  # per row, its leading tokens ``prefix`` holds and it does not prefill
    prefix: object | None = None  # a transformers cache of the input's first slots (stock's prompt reuse), or None
    # per row, the leading positions the held caches already hold from the last prefill (target's, draft's)
    reused: tuple[list[int], list[int]] | None = None

    @property
    def plain(self) -> bool:
        """Position ids are the cache slots and no masked slot sits inside a prompt (which a sliding window counts):
        a prompt forward's values here are those of any other call whose rows begin with the same tokens."""
        return self.positions is None and self.slots is None


def read_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, vocab: int,
    width: int, prefix=None,
) -> Batch:  # fmt: skip
    """Each row's prompt (ids checked against the target's ``vocab``) and the position and window tables of
    ``width`` slots a row (at least the caches' capacity). ``prefix``: a transformers cache holding the input's
    leading slots (stock's prompt reuse); each row then prefills only its tokens after them, and at least its last
    one (whose query names the first new token)."""
    prompts = prompts_from_mask(input_ids, attention_mask, position_ids)
    check_token_ids(prompts, vocab)
    padded_len = input_ids.shape[1]
    cached = None
    if prefix is not None:
        held = prefix.get_seq_length()
        cached = [min(int((p.slots < held).sum()), p.length - 1) for p in prompts]
        dense = getattr(prefix, "dense_positions", None)  # a returned cache: the decode steps' values stay out
        if dense is not None:
            cached = [min(n, d) for n, d in zip(cached, dense)]
    positions, slots = position_table(prompts, width), stock_slots(prompts, padded_len, width)
    return Batch(prompts, padded_len, positions, slots, cached, prefix)
