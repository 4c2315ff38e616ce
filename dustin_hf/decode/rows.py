"""The committed tokens of a ragged batch: where each row stands, and what it appends at each step.

Row ``b`` holds ``lens[b]`` committed tokens in ``tokens[b, :lens[b]]`` (its prompt, then what it generated);
the rows of a batch advance by different counts every step and stop on their own (EOS, ``max_new_tokens``,
a stopping criterion). The decode loop writes a step's candidates after each row's committed tokens in one
scatter (:meth:`Rows.write_candidates`) and then makes the first ``k_b`` of them committed
(:meth:`Rows.commit`), cut where the row must stop.

In exact mode a row also holds ``tentative[b]`` tokens after its committed ones (accepted by sparse
verification, not yet confirmed by a dense one): they sit in ``tokens[b, lens[b] : lens[b] + tentative[b]]``,
processors see them as part of the row's history, and nothing else does (EOS, lengths, stopping criteria and
streamers see committed tokens only).
"""

from __future__ import annotations

import torch

from ..runtime.plan import device_tensor

__all__ = ["Rows", "token_ids"]


class Rows:
    """Committed tokens, lengths and stop state of every row, plus the scores/logits kept for the output.

    Args:
        prompts: each row's prompt (:class:`~dustin_hf.decode.masks.Prompt`: its tokens, and what processors see of
            it).
        width: token slots per row (the longest prompt + ``max_new`` + room for a step's candidates).
        pad: id written in unused slots and after a row's end in the returned sequences.
        max_new: tokens each row may generate.
        eos: ids that end a row (committed, then the row stops).
        row_criteria: stopping criteria evaluated per row and token (EOS and length are handled here natively).
        streamer: receives row 0's committed tokens at each step (batch size 1 only).
        output_scores, output_logits: keep each committed token's processed scores / raw logits.
    """

    def __init__(
        self,
        prompts: list,
        width: int,
        pad: int,
        device: torch.device,
        max_new: int,
        eos: list[int],
        row_criteria: list,
        streamer,
        output_scores: bool,
        output_logits: bool,
    ):
        batch = len(prompts)
        self.tokens = torch.full((batch, width), pad, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            self.tokens[b, : p.length] = p.tokens.to(device)
        self.lens = [p.length for p in prompts]
        self.tentative = [0] * batch
        self.prompt_lens = list(self.lens)
        # what processors and stopping criteria see of a prompt with masked slots after its first real token
        self.views = [None if p.view is None else p.view.to(device)[None] for p in prompts]
        self.generated = [0] * batch
        self.finished = [False] * batch
        self.pad, self.max_new, self.eos = pad, max_new, eos
        self.row_criteria, self.streamer = row_criteria, streamer
        self.scores = [[] for _ in range(batch)] if output_scores else None
        self.raw = [[] for _ in range(batch)] if output_logits else None

    @property
    def batch_size(self) -> int:
        return len(self.lens)

    @property
    def active(self) -> list[int]:
        """Rows still generating."""
        return [b for b, done in enumerate(self.finished) if not done]

    @property
    def held(self) -> list[int]:
        """Tokens each row holds: committed, then tentative."""
        return [n + t for n, t in zip(self.lens, self.tentative)]

    def history(self, b: int, drafts=(), upto: int | None = None) -> torch.Tensor:
        """Row b's tokens (the first ``upto``, default all it holds) followed by its first drafts, as stock
        ``generate()`` would hand them to a processor were the row alone: ``(1, len)``."""
        committed = self.tokens[b : b + 1, : self.lens[b] + self.tentative[b] if upto is None else upto]
        if self.views[b] is not None:
            committed = torch.cat([self.views[b], committed[:, self.prompt_lens[b] :]], dim=1)
        if not drafts:
            return committed
        return torch.cat([committed, torch.stack([d[b] for d in drafts])[None]], dim=1)

    def write_candidates(self, new_tokens: torch.Tensor, offsets: list[int] | None = None) -> None:
        """Write every row's candidates ``(B, n)`` after its committed tokens, or from ``offsets[b]`` (one scatter;
        :meth:`commit` then makes the first ``k_b`` of them committed)."""
        slots = device_tensor(self.lens if offsets is None else offsets, new_tokens.device)[:, None] + torch.arange(
            new_tokens.shape[1], device=new_tokens.device
        )
        self.tokens.scatter_(1, slots.clamp_max(self.tokens.shape[1] - 1), new_tokens)

    def commit(
        self, new_tokens: torch.Tensor, host_tokens: list[list[int]], raw, scores, proposed: list[int]
    ) -> list[int]:
        """Append up to ``proposed[b]`` of ``new_tokens[b]`` (already written by :meth:`write_candidates`) to
        each unfinished row, cut at EOS, length and stopping criteria; return the counts appended (0 for rows
        already finished). ``host_tokens`` is ``new_tokens`` on the host; ``raw``/``scores`` ``(B, n, V)`` are
        kept for the committed positions when the output asks for them."""
        streaming = self.streamer is not None and not self.finished[0]
        starts = list(self.lens)
        counts = []
        for b, k in enumerate(proposed):
            if self.finished[b]:
                counts.append(0)
                continue
            k = min(k, self.max_new - self.generated[b])
            for j, token in enumerate(host_tokens[b][:k]):
                if token in self.eos:
                    k = j + 1
                    self.finished[b] = True
                    break
            if self.row_criteria:
                k = self._apply_row_criteria(b, starts[b], k)
            self.lens[b] += k
            self.generated[b] += k
            if self.generated[b] >= self.max_new:
                self.finished[b] = True
            if self.scores is not None:
                self.scores[b].extend(scores[b, :k])
            if self.raw is not None:
                self.raw[b].extend(raw[b, :k])
            counts.append(k)
        if streaming and counts[0]:
            # from the host copy: new_tokens.cpu() would wait for the draft forwards queued after it
            self.streamer.put(torch.tensor(host_tokens[0][: counts[0]], dtype=new_tokens.dtype))
        return counts

    def would_stop(self, b: int, new: list[int]) -> bool:
        """Whether row ``b`` would end within the tentative tokens it holds (EOS, length or a stopping criterion)
        were they all committed, given the ``new`` ones (host ints, already counted in ``tentative[b]``; the
        earlier ones were checked when they were new): in exact mode such a row confirms next."""
        held = self.lens[b] + self.tentative[b]
        if self.generated[b] + self.tentative[b] >= self.max_new or any(token in self.eos for token in new):
            return True
        return bool(self.row_criteria) and any(
            bool(criterion(self.history(b, upto=held - len(new) + j), None)[0])
            for j in range(1, len(new) + 1)
            for criterion in self.row_criteria
        )

    def _apply_row_criteria(self, b: int, start: int, k: int) -> int:
        for j in range(1, k + 1):
            ids = self.history(b, upto=start + j)
            if any(bool(criterion(ids, None)[0]) for criterion in self.row_criteria):
                self.finished[b] = True
                return j
        return k

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, padded_len + longest)``: the input layout, then each row's generated tokens (``pad`` after its
        end)."""
        batch, padded_len = input_ids.shape
        longest = max(self.generated)
        out = torch.full((batch, padded_len + longest), self.pad, dtype=torch.long, device=input_ids.device)
        out[:, :padded_len] = input_ids
        for b in range(batch):
            start = self.lens[b] - self.generated[b]
            out[b, padded_len : padded_len + self.generated[b]] = self.tokens[b, start : self.lens[b]].to(out.device)
        return out

    def per_position(self, per_row: list[list[torch.Tensor]] | None) -> tuple[torch.Tensor, ...] | None:
        """Row-wise score lists -> one ``(B, V)`` tensor per generated index (zeros past a row's end)."""
        if per_row is None:
            return None
        template = next(s for row in per_row for s in row)
        return tuple(
            torch.stack([row[t] if t < len(row) else torch.zeros_like(template) for row in per_row])
            for t in range(max(self.generated))
        )


def token_ids(tensor, fallback) -> list[int]:
    """Token ids from a prepared tensor (``generation_config._eos_token_tensor``) or a config value (int or list)."""
    if tensor is not None:
        return [int(t) for t in torch.as_tensor(tensor).flatten().tolist()]
    if fallback is None:
        return []
    return [int(fallback)] if isinstance(fallback, int) else [int(t) for t in fallback]
