"""``output_attentions`` / ``output_hidden_states``: per generated token, what stock assisted decoding returns.

Stock ``generate()`` returns one entry per generated token ``t``, each a tuple over layers (hidden states: the
embeddings, then every layer), laid out on the padded input:

- ``t = 0``: the prompt's forward: hidden states ``(B, T, hidden)``, attentions ``(B, heads, T, T)`` (``T``: the
  padded input width);
- ``t >= 1``: the query that predicted token ``t``: hidden states ``(B, 1, hidden)``, attentions ``(B, heads, 1,
  T + t)`` over the input slots and the tokens generated before it.

The decode loop keeps each row's prompt and generated tokens compactly (unmasked slots only); the query that
predicted a kept token is the verification query at its position, so :class:`OutputRecorder` keeps, per row
and kept token, that query's hidden states and attention weights (over cache slots, from
:mod:`dustin_hf.kernels.masked`) and lays them out at the end: a compact slot of the prompt goes to the padded
slot it came from, a generated token ``g`` to slot ``T + g``, and every slot the row never had (padding) is
zero. On a sparse step the weights cover the positions that step read and are zero elsewhere; with a budget
covering the context they are the dense target's.
"""

from __future__ import annotations

import torch

__all__ = ["OutputRecorder"]


class OutputRecorder:
    """Keeps the hidden states and attentions of each row's kept tokens; :meth:`tuples` lays them out as stock does.

    Args:
        prompt_slots: per row, the padded input slots of its unmasked tokens (``(n_b,)`` int).
        width: ``T``, the padded input width.
        attentions, hidden_states: which of the two to keep.
    """

    def __init__(self, prompt_slots: list[torch.Tensor], width: int, attentions: bool, hidden_states: bool):
        self.prompt_slots, self.width = prompt_slots, width
        self.want_attentions, self.want_hidden = attentions, hidden_states
        self.prompt: list[dict] = [{} for _ in prompt_slots]  # per row: "hidden" [(n, hidden)], "attn" [(H, n, n)]
        self.tokens: list[list[dict]] = [[] for _ in prompt_slots]  # per row, per token t >= 1: "hidden", "attn"

    def _slot_map(self, b: int, count: int) -> torch.Tensor:
        """Padded slots of row ``b``'s first ``count`` compact slots (prompt, then generated tokens)."""
        prompt = self.prompt_slots[b]
        n = prompt.numel()
        generated = self.width + torch.arange(max(0, count - n), device=prompt.device)
        return torch.cat([prompt, generated])[:count]

    def keep_prompt(self, b: int, hidden: tuple[torch.Tensor, ...] | None, attentions: tuple | None) -> None:
        """Row ``b``'s prefill: ``hidden`` per layer ``(1, n, hidden)``, ``attentions`` per layer ``(1, H, n, n)``."""
        if self.want_hidden and hidden is not None:
            self.prompt[b]["hidden"] = [h[0].detach() for h in hidden]
        if self.want_attentions and attentions is not None:
            self.prompt[b]["attn"] = [a[0].detach() for a in attentions]

    def keep_last_slot(self, b: int, hidden: tuple | None, attentions: tuple | None) -> None:
        """Row ``b``'s masked last input slot, whose query names the first new token (it is in stock's prompt
        entry too): ``hidden`` per layer ``(1, 1, hidden)``, ``attentions`` per layer ``(1, H, 1, S)`` over cache
        slots."""
        if self.want_hidden and hidden is not None:
            self.prompt[b]["last hidden"] = [h[0, 0].detach() for h in hidden]
        if self.want_attentions and attentions is not None:
            self.prompt[b]["last attn"] = [a[0, :, 0].detach() for a in attentions]

    def keep_step(self, b: int, positions: int, hidden: tuple | None, attentions: tuple | None) -> None:
        """Row ``b`` kept the tokens predicted by the first ``positions`` queries of a forward whose outputs are
        ``hidden`` per layer ``(B, Q, hidden)`` and ``attentions`` per layer ``(B, H, Q, S)`` (cache slots)."""
        for j in range(positions):
            record = {}
            if self.want_hidden:
                record["hidden"] = [h[b, j].detach() for h in hidden]
            if self.want_attentions:
                record["attn"] = [a[b, :, j].detach() for a in attentions]
            self.tokens[b].append(record)

    def tuples(self, generated: list[int]) -> tuple[tuple | None, tuple | None]:
        """``(attentions, hidden_states)`` as stock returns them for ``generated[b]`` tokens per row."""
        longest = max(generated)
        attentions = self._layout("attn", longest, generated) if self.want_attentions else None
        hidden = self._layout("hidden", longest, generated) if self.want_hidden else None
        return attentions, hidden

    def _layout(self, key: str, longest: int, generated: list[int]) -> tuple:
        rows = range(len(self.prompt_slots))
        template = next(self.prompt[b][key] for b in rows if key in self.prompt[b])
        out = []
        for t in range(longest):
            layers = []
            for layer, like in enumerate(template):
                if key == "hidden":
                    shape = (len(self.prompt_slots), self.width if t == 0 else 1, like.shape[-1])
                else:
                    shape = (len(self.prompt_slots), like.shape[0], self.width if t == 0 else 1, self.width + t)
                full = like.new_zeros(shape)
                for b in rows:
                    if t == 0:
                        self._place_prompt(full, key, b, layer)
                    elif t <= generated[b] - 1 and t - 1 < len(self.tokens[b]):
                        self._place_token(full, key, b, layer, self.tokens[b][t - 1][key][layer], t)
                layers.append(full)
            out.append(tuple(layers))
        return tuple(out)

    def _place_prompt(self, full: torch.Tensor, key: str, b: int, layer: int) -> None:
        if key not in self.prompt[b]:
            return
        value = self.prompt[b][key][layer]
        slots = self.prompt_slots[b]
        last = self.prompt[b].get(f"last {key}")
        if key == "hidden":  # (n, hidden) -> rows of the padded input
            full[b, slots] = value.to(full.dtype)
            if last is not None:
                full[b, -1] = last[layer].to(full.dtype)
        else:  # (H, n, n) -> (H, T, T) at the real slots
            full[b][:, slots[:, None], slots[None, :]] = value[:, :, : slots.numel()].to(full.dtype)
            if last is not None:  # (H, S): the last slot's query over the real slots
                full[b][:, -1, slots] = last[layer][:, : slots.numel()].to(full.dtype)

    def _place_token(self, full: torch.Tensor, key: str, b: int, layer: int, value: torch.Tensor, t: int) -> None:
        if key == "hidden":  # (hidden,)
            full[b, 0] = value.to(full.dtype)
            return
        # (H, S) over compact cache slots: the query of token t saw the prompt and the first t generated tokens
        count = self.prompt_slots[b].numel() + t
        slots = self._slot_map(b, count)
        full[b, :, 0, slots] = value[:, :count].to(full.dtype)
