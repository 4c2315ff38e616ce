"""transformers' logits processors applied per row of a ragged batch, each row seen as if decoded alone.

``generate()`` builds its processors for the padded batch: a few of them hold a length counted on the padded input
(``MinNewTokensLengthLogitsProcessor.prompt_length_to_skip``, the ``min_length`` it derives from ``min_new_tokens``,
``SuppressTokensAtBeginLogitsProcessor.begin_index``, ``ForcedEOSTokenLogitsProcessor.max_length``,
``ExponentialDecayLengthPenalty.regulation_start``, an integer ``RepetitionPenaltyLogitsProcessor.
prompt_ignore_length``), one a per-row tensor of the padded batch
(``RepetitionPenaltyLogitsProcessor.prompt_ignore_length`` built from the mask) and one a row index
(``PrefixConstrainedLogitsProcessor``'s ``batch_id``). The decode loop hands every processor one row's history at
a time, without its left padding (row ``b``'s tokens as stock ``generate()`` would see them were that row passed
alone), so :class:`LogitsPipeline` gives each row its own copies of those processors with the lengths shifted
by the row's left padding, the per-row tensor narrowed to the row, and the row index bound. Every other
processor depends only on the history it is handed (or on nothing): one instance serves all rows.

History-free processors (temperature, top-k/p, ...) run once on all rows and positions at once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers.generation import logits_process as lp

__all__ = ["LogitsPipeline"]

# Processors whose output depends only on the scores, never on the token history: they can run on all rows and
# positions of a ragged batch at once.
_HISTORY_FREE = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.InfNanRemoveLogitsProcessor,
    lp.LogitNormalization,
    lp.SuppressTokensLogitsProcessor,
) + tuple(getattr(lp, name) for name in ("TopHLogitsWarper",) if hasattr(lp, name))


def _for_row(processor, b: int, pad: int, min_length_from_new: bool):
    """``processor`` as it would have been built for row ``b`` alone (``pad``: the row's left padding), or the
    processor itself when nothing in it depends on the padded batch. ``min_length_from_new``: ``generate()`` set
    ``min_length`` to ``min_new_tokens`` + the padded width (a ``min_length`` of the user's own is a total
    length, the row's alone too)."""
    if isinstance(processor, lp.MinLengthLogitsProcessor) and min_length_from_new:
        return _shifted(processor, "min_length", pad)
    if isinstance(processor, lp.MinNewTokensLengthLogitsProcessor):
        return _shifted(processor, "prompt_length_to_skip", pad)
    if isinstance(processor, lp.SuppressTokensAtBeginLogitsProcessor):
        return _shifted(processor, "begin_index", pad)
    if isinstance(processor, lp.ForcedEOSTokenLogitsProcessor):
        return _shifted(processor, "max_length", pad)
    if isinstance(processor, lp.ExponentialDecayLengthPenalty):
        return _shifted(processor, "regulation_start", pad)
    if isinstance(processor, lp.RepetitionPenaltyLogitsProcessor):
        ignore = getattr(processor, "prompt_ignore_length", None)
        if isinstance(
            ignore, torch.Tensor
        ):  # per padded row: how many leading ids to ignore (the padding, by default)
            row = copy.copy(processor)
            row.prompt_ignore_length = max(0, int(ignore[b]) - pad)
            return row
        return _shifted(processor, "prompt_ignore_length", pad) if isinstance(ignore, int) else processor
    if isinstance(processor, lp.PrefixConstrainedLogitsProcessor):
        row = copy.copy(processor)
        fn = processor._prefix_allowed_tokens_fn
        row._prefix_allowed_tokens_fn = lambda _batch_id, ids: fn(b, ids)  # the row's own index, not 0
        return row
    return processor


def _shifted(processor, name: str, pad: int):
    row = copy.copy(processor)
    setattr(row, name, max(0, getattr(processor, name) - pad))
    return row


class LogitsPipeline:
    """transformers' logits processors applied to ``(B, n, V)`` logits of a ragged batch.

    Args:
        processors: the list ``generate()`` prepared for the padded batch.
        pads: each row's left padding in that batch (``None``: no padding).
        min_length_from_new: the generation config set ``min_new_tokens`` (``generate()`` then turned it into a
            ``min_length`` counted on the padded width).

    History-free processors run once on all rows and positions; any other processor sees the exact token
    history of each row and position, as if that row were decoded alone: one call per row and position.
    """

    def __init__(
        self,
        processors: lp.LogitsProcessorList | None,
        pads: list[int] | None = None,
        min_length_from_new: bool = False,
    ):
        self.processors = processors if processors is not None else lp.LogitsProcessorList()
        self.min_length_from_new = min_length_from_new
        self.history_free = all(isinstance(p, _HISTORY_FREE) for p in self.processors)
        self._rows: list[lp.LogitsProcessorList] = []
        if pads is not None:
            self.for_batch(pads)

    def for_batch(self, pads: list[int]) -> None:
        """Make each row's processor list for a batch whose rows carry ``pads`` tokens of left padding."""
        self._rows = [
            lp.LogitsProcessorList([_for_row(p, b, pad, self.min_length_from_new) for p in self.processors])
            for b, pad in enumerate(pads)
        ]

    def __call__(self, logits: torch.Tensor, history: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """``logits (B, n, V)`` float32; ``history(b, i)`` is row b's ``(1, len)`` token ids before position i."""
        if not self.processors:
            return logits
        batch, n, vocab = logits.shape
        if self.history_free:
            dummy = torch.zeros(batch * n, 1, dtype=torch.long, device=logits.device)
            return self.processors(dummy, logits.reshape(batch * n, vocab)).reshape(batch, n, vocab)
        out = torch.empty_like(logits)
        for b in range(batch):
            processors = self._rows[b] if self._rows else self.processors
            for i in range(n):
                out[b, i] = processors(history(b, i), logits[b, i][None])[0]
        return out
