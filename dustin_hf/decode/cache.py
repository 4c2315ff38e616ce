"""The KV cache Dustin verifies against: full, preallocated, one length per sequence.

``DynamicCache`` concatenates the whole cache on every forward (an O(length) copy per layer per
step) and keeps one length for the whole batch. ``DustinCache`` keeps every position (nothing is
evicted; only the reads are sparse) in buffers that grow in chunks, and one length per row, so the
rows of a batch accept different numbers of draft tokens without padding holes: a rejected token's
slot is simply overwritten by the next step.

Physical layout per layer: ``(batch, capacity, kv_heads, head_dim)`` (flash-attn's ``k_cache``
layout); ``update`` returns ``(batch, kv_heads, capacity, head_dim)`` views, transformers' layout.
Which slots a forward writes comes from the active :class:`~dustin_hf.runtime.plan.ForwardPlan`.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from ..runtime.plan import ForwardPlan
from .stats import RunStats

__all__ = ["DustinCache", "DustinLayer", "GeneratedCache"]

_GROW_CHUNK = 256


class DustinLayer(CacheLayerMixin):
    """One layer's keys and values, ``(batch, capacity, kv_heads, head_dim)``, written at per-row slots."""

    is_sliding = False
    is_croppable = True

    def __init__(self, owner: "DustinCache"):
        super().__init__()
        self._owner = owner
        self._k: torch.Tensor | None = None  # (B, T, H, D)
        self._v: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        shape = (self._owner.batch_size, self._owner.capacity, heads, head_dim)
        self._k = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        self._v = torch.zeros(
            shape[:3] + (value_states.shape[-1],), dtype=value_states.dtype, device=value_states.device
        )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._sync_views()

    def _sync_views(self) -> None:
        # transformers reads `keys`/`values` as (batch, heads, seq, head_dim): expose views of the buffers.
        self.keys = self._k.transpose(1, 2)
        self.values = self._v.transpose(1, 2)

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` slots, keeping the contents (amortised by growing in chunks)."""
        if self._k is None or capacity <= self.capacity:
            return
        new_k = self._k.new_zeros((self._k.shape[0], capacity) + self._k.shape[2:])
        new_v = self._v.new_zeros((self._v.shape[0], capacity) + self._v.shape[2:])
        new_k[:, : self.capacity] = self._k
        new_v[:, : self.capacity] = self._v
        self._k, self._v = new_k, new_v
        self._sync_views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: ForwardPlan):
        """Write the new tokens at the plan's slots; return ``(B', H, capacity, D)`` views of the covered rows."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = plan.rows
        slots = plan.write_positions(key_states.device)  # (B', Q)
        if plan.backend == "triton" and key_states.is_cuda and key_states.dtype == self._k.dtype:
            from ..kernels import launch_device
            from ..kernels.triton_cache import write_kv_triton

            with launch_device(key_states):
                write_kv_triton(key_states, value_states, self._k, self._v, slots, rows.start)  # one launch, not three
            return self.keys[rows], self.values[rows]
        row_ids = torch.arange(rows.start, rows.stop, device=key_states.device)[:, None]
        self._k[row_ids, slots] = key_states.transpose(1, 2).to(self._k.dtype)  # (B', Q, H, D)
        self._v[row_ids, slots] = value_states.transpose(1, 2).to(self._v.dtype)
        return self.keys[rows], self.values[rows]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:  # lengths live in the owner; nothing per layer
        pass

    def reset(self) -> None:
        if self.is_initialized:
            self._k.zero_()
            self._v.zero_()

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[rows], self._v[rows]
            self._sync_views()

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw ``(B, capacity, H, D)`` key and value buffers (for kernels and scoring)."""
        if self._k is None:
            raise RuntimeError("this cache layer has not been written yet")
        return self._k, self._v


class DustinCache(Cache):
    """Full KV cache with per-row lengths and chunked growth, for the target or the draft.

    Args:
        num_layers: decoder layers of the model it serves.
        batch_size: rows (sequences); fixed for the cache's life.
        capacity: initial slots per row; grows in chunks of 256 when a forward needs more.

    ``seq_lengths`` holds each row's cached positions; nothing else of a run is kept here (its statistics are on
    its result, the history queries with the sparse verifier).
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int = _GROW_CHUNK):
        super().__init__(layers=[DustinLayer(self) for _ in range(num_layers)])
        self._batch_size = batch_size
        self.capacity = max(1, capacity)
        self.seq_lengths: list[int] = [0] * batch_size
        # transformers releases whose attention layers pass their keyword arguments to ``update`` (from 5.24) hand it
        # the forward's plan there; older ones pass nothing, and ``update`` reads the plan the runner made active
        self.active_plan: ForwardPlan | None = None

    # -- what transformers calls -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        plan = (kwargs.get("kwargs") or {}).get("dustin_plan") or self.active_plan
        if plan is None:
            raise RuntimeError(
                "DustinCache is written only inside dustin_hf's decoding loop (a ForwardPlan must be active); "
                "use model.generate(..., assistant_model=draft, cache_implementation='dustin')"
            )
        return self.layers[layer_idx].update(key_states, value_states, plan)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row's cached positions (rows differ; see ``seq_lengths``)."""
        return max(self.seq_lengths) if self.seq_lengths else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, max_length: int) -> None:
        """transformers' contract, applied to every row: negative removes that many positions from each
        row's end; non-negative keeps at most ``max_length`` positions."""
        self.rollback([max(0, n + max_length) if max_length < 0 else min(n, max_length) for n in self.seq_lengths])

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.seq_lengths = [0] * self.batch_size

    def clear(self) -> None:
        """Hold nothing, keeping the buffers (a new run over the same buffers: slots are written before read)."""
        self.seq_lengths = [0] * self.batch_size
        self.active_plan = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        keep = indices.tolist()
        for layer in self.layers:
            layer.select_rows(indices)
        self.seq_lengths = [self.seq_lengths[i] for i in keep]
        self._batch_size = len(keep)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    # -- what the decoding loop calls ----------------------------------------------------------
    @contextlib.contextmanager
    def forward_plan(self, plan: ForwardPlan):
        """Make ``plan`` the one ``update`` writes by, for the duration of one model forward."""
        if plan.rows.stop > self.batch_size or plan.rows.start < 0:
            raise ValueError(f"plan rows {plan.rows} outside the cache's {self.batch_size} rows")
        for row, length in zip(range(plan.rows.start, plan.rows.stop), plan.cache_seqlens):
            if length != self.seq_lengths[row]:
                raise RuntimeError(
                    f"plan says row {row} holds {length} positions, the cache says {self.seq_lengths[row]}"
                )
        self.ensure_capacity(plan.max_seqlen_k)
        plan.begin()
        self.active_plan = plan
        try:
            yield plan
        finally:
            self.active_plan = None

    def ensure_capacity(self, needed: int) -> None:
        """Grow every layer so that ``needed`` slots fit (in chunks, so growth is rare)."""
        if needed <= self.capacity:
            return
        self.capacity = max(needed, self.capacity + max(_GROW_CHUNK, self.capacity // 4))
        for layer in self.layers:
            layer.grow(self.capacity)

    def advance(self, rows: slice, new_tokens: list[int]) -> None:
        """Record that rows ``rows`` now also hold their first ``new_tokens[i]`` written tokens."""
        for row, n in zip(range(rows.start, rows.stop), new_tokens):
            self.seq_lengths[row] += n

    def rollback(self, lengths: list[int]) -> None:
        """Set every row's length (only ever shorter or equal); later slots are overwritten by later writes."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"rollback needs {self.batch_size} lengths, got {len(lengths)}")
        for row, (old, new) in enumerate(zip(self.seq_lengths, lengths)):
            if new > old or new < 0:
                raise ValueError(f"row {row}: cannot roll back from {old} to {new} positions")
        self.seq_lengths = list(lengths)

    @staticmethod
    def check_prefix(source: Cache, input_ids: torch.Tensor, text_config) -> None:
        """What :meth:`load_prefix` reads must hold a prefix of ``input_ids`` in stock's layout, of a model shaped as
        ``text_config``'s: one row per input row, every layer (all of them, with its key/value heads and head size)
        the same leading input slots, fewer than the input's (stock ``generate()`` feeds the uncached tokens only; a
        cache as long as the input or longer would be fed again, silently wrong there)."""
        batch, width = input_ids.shape
        held = source.get_seq_length()
        heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None)
        head_dim = head_dim or text_config.hidden_size // text_config.num_attention_heads
        shapes = {(layer.keys.shape[1], layer.keys.shape[-1]) for layer in source.layers if _holds(layer)}
        if len(source.layers) != text_config.num_hidden_layers or shapes != {(heads, head_dim)}:
            raise ValueError(
                f"the given cache holds {len(source.layers)} layers of (heads, head size) {sorted(shapes)}; the "
                f"target has {text_config.num_hidden_layers} of {(heads, head_dim)}: a prompt cache is the target's"
            )
        lengths = {layer.keys.shape[-2] for layer in source.layers if _holds(layer)}
        rows = {layer.keys.shape[0] for layer in source.layers if _holds(layer)}
        if rows != {batch}:
            raise ValueError(f"the given cache holds {sorted(rows)} rows, input_ids has {batch}: a prompt cache is "
                             "made by a forward over the same rows' leading tokens")  # fmt: skip
        if lengths != {held}:
            raise ValueError(
                f"the given cache's layers hold {sorted(lengths)} positions: dustin_hf's loop reuses a cache whose "
                "every layer holds the same leading input slots (a sliding-window cache drops them; build it with "
                "DynamicCache(config=...) from a full-attention forward, or pass none)"
            )
        if held >= width:
            raise ValueError(
                f"the given cache holds {held} input slots and input_ids has {width}: a prompt cache holds a prefix "
                "of input_ids and leaves at least its last token to read (pass the full sequence as input_ids, or "
                "the cache of a shorter prefix, e.g. copy.deepcopy of the cache made from the shared prompt)"
            )

    def load_prefix(self, source: Cache, slots: list[torch.Tensor], counts: list[int]) -> None:
        """Hold each row's first ``counts[b]`` positions as ``source`` holds them: a transformers cache in stock's
        layout (every input slot, masked ones too; ``(B, kv_heads, slots, D)`` per layer), row ``b``'s positions at
        its input slots ``slots[b]`` (:attr:`~dustin_hf.decode.masks.Prompt.slots`). ``source`` is only read."""
        for layer, given in zip(self.layers, source.layers):
            keys, values = given.keys, given.values
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            k_buffer, v_buffer = layer.buffers()
            for b, (row, n) in enumerate(zip(slots, counts)):
                where = row[:n].to(keys.device)
                k_buffer[b, :n] = keys[b, :, where].transpose(0, 1).to(k_buffer)  # (n, H, D)
                v_buffer[b, :n] = values[b, :, where].transpose(0, 1).to(v_buffer)
        self.seq_lengths = list(counts)

    def to_dynamic(
        self, config, slots: list[torch.Tensor], padded_len: int, lengths: list[int], stats: RunStats
    ) -> "GeneratedCache":
        """The cached positions in stock ``generate()``'s layout, a copy: what stock returns after the same call.

        Args:
            config: the model's config (sliding-window layers keep their window, as stock's layers do).
            slots: per row, the input slots its prompt's cached positions came from (``Prompt.slots``): stock
                keeps every input slot, masked ones included, where this cache keeps the unmasked tokens only.
            padded_len: the input's width; a row's generated tokens follow it.
            lengths: per row, the positions to return (its prompt and every generated token but the last).
            stats: what the run did, which the returned cache's :attr:`~GeneratedCache.stats` reads.

        Stock's ``(B, kv_heads, padded_len + longest generated - 1, D)`` keys and values per layer; a masked input
        slot and the slots past a row's end hold zeros (stock: the keys of the tokens there, which no query
        reads)."""
        width = padded_len + max(n - len(s) for n, s in zip(lengths, slots))
        out = GeneratedCache(config=config)
        for layer_idx, layer in enumerate(self.layers):
            keys, values = layer.buffers()  # (B, capacity, H, D)
            k_out = keys.new_zeros(keys.shape[0], width, *keys.shape[2:])
            v_out = values.new_zeros(values.shape[0], width, *values.shape[2:])
            for b, (row_slots, n) in enumerate(zip(slots, lengths)):
                where = torch.cat(
                    [
                        row_slots.to(keys.device),
                        torch.arange(padded_len, padded_len + n - len(row_slots), device=keys.device),
                    ]
                )
                k_out[b, where] = keys[b, :n]
                v_out[b, where] = values[b, :n]
            out.update(k_out.transpose(1, 2), v_out.transpose(1, 2), layer_idx)
        out.run_stats = stats
        return out

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx].buffers()

    def __repr__(self):
        return (
            f"DustinCache(layers={len(self.layers)}, batch_size={self.batch_size}, capacity={self.capacity}, "
            f"seq_lengths={self.seq_lengths})"
        )


def _holds(layer) -> bool:
    """Whether a transformers cache layer holds keys (an unwritten one holds none)."""
    return getattr(layer, "keys", None) is not None


class GeneratedCache(DynamicCache):
    """The cache ``generate(..., cache_implementation="dustin")`` returns: transformers' ``DynamicCache`` in stock's
    layout (:meth:`DustinCache.to_dynamic`, a copy: the decode loop keeps its own buffers for the next call), with
    what the run did in :attr:`stats`."""

    run_stats: RunStats
    # per row, its leading positions a dense forward wrote (the rest a sparse verification's): what a later call
    # given this cache reuses as a prompt cache (DustinCache.load_prefix); None: all of them
    dense_positions: list[int] | None = None

    @property
    def stats(self) -> dict:
        """:meth:`dustin_hf.decode.stats.RunStats.as_dict` of the run that made it (``sparse_steps``,
        ``mean_attended``, acceptance counters, timings and reports: ``docs/usage.md``)."""
        return self.run_stats.as_dict()
