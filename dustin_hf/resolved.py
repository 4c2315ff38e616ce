"""Dustin's settings resolved for one target/draft pair: the defaults that depend on the models, filled and checked.

:class:`~dustin_hf.config.DustinConfig` holds what the user chooses; :func:`resolve` turns it into a
:class:`ResolvedConfig` for a pair (the default scoring layers and heads, ``draft_share``, layer indices made
non-negative), never by mutating the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ResolvedConfig", "resolve"]

# selection="verify"'s first layer when neither the config nor a profile names the layers (a second one at half the
# depth re-selects): an early layer's choice serves the layers after it better than a middle one's, although
# attention recovery ranks early layers last; calibration picks the layers per pair by agreement with dense
_SELECTION_FIRST = 2


@dataclass(frozen=True)
class ResolvedConfig:
    """``DustinConfig`` with every model-dependent choice made concrete for one target/draft pair."""

    budget: int
    sink_tokens: int
    recent_tokens: int
    draft_share: int
    min_context: int
    backend: str
    prefill_chunk: int | None
    target_layer: int
    target_heads: tuple[int, ...]
    draft_layers: tuple[int, ...]
    draft_heads: tuple[tuple[int, ...], ...]
    dense_layers: tuple[int, ...] = ()  # non-negative, sorted
    selection_layers: tuple[int, ...] = ()  # selection="verify": non-negative, sorted (): the paper's selection
    calibration: str = "none"  # "prompt": the decoder searches the heads above after prefill
    sparse_draft: bool = False  # the draft reads the previous selection + what was written since
    mode: str = "sparse"  # "exact": sparse steps accept tentatively, dense verifications confirm
    confirm_tokens: int = 4
    confirm_every: int = 4
    min_recovery: float | None = None  # the quality knob's target (None: the fixed budget)
    max_budget: int = 0  # its ceiling (0 without the knob)
    reuse_prefix: bool = True  # a call reads only what the held caches' prefilled prompts do not hold


def _first_group_heads(num_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    return tuple(range(num_heads // num_kv_heads))


def _check_heads(heads: tuple[int, ...], num_heads: int, what: str) -> None:
    if max(heads) >= num_heads:
        raise ValueError(f"{what} {heads} out of range: the model has {num_heads} attention heads")


def _default_selection_layers(num_layers: int) -> tuple[int, ...]:
    """The selection layers of ``selection="verify"`` when neither the config nor a profile names them: an early
    one, and one at half the depth when that is between it and the last layer (which chooses for nobody)."""
    first, second = min(_SELECTION_FIRST, max(num_layers - 2, 0)), num_layers // 2
    return (first, second) if first < second < num_layers - 1 else (first,)


def resolve(config: Any, target_config: Any, draft_config: Any) -> ResolvedConfig:
    """Fill the model-dependent defaults of ``config`` (a :class:`~dustin_hf.config.DustinConfig`) for a
    target/draft pair and check ranges.

    ``target_config``/``draft_config`` are transformers text configs (``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``).
    """
    t_layers, t_heads = target_config.num_hidden_layers, target_config.num_attention_heads
    t_kv = getattr(target_config, "num_key_value_heads", None) or t_heads
    target_layer = t_layers // 2 if config.target_layer is None else config.target_layer
    if target_layer >= t_layers:
        raise ValueError(f"target_layer {target_layer} out of range: the target has {t_layers} layers")
    target_heads = config.target_heads or _first_group_heads(t_heads, t_kv)
    _check_heads(target_heads, t_heads, "target_heads")
    draft_layers, draft_heads = _draft_scoring(config, draft_config)
    selection_layers = ()
    if config.selection == "verify":
        given = config.selection_layers or _default_selection_layers(t_layers)
        selection_layers = _layer_set(given, t_layers, "selection_layers")
        if config.selection_layers and t_layers > 1 and selection_layers[-1] == t_layers - 1:
            raise ValueError(
                f"selection_layers {given}: the last layer ({t_layers - 1}) has no layer after it to choose "
                f"for; the latest useful one is {t_layers - 2}"
            )
    free = config.budget - config.sink_tokens - config.recent_tokens
    return ResolvedConfig(
        **{name: getattr(config, name) for name in _AS_GIVEN},
        draft_share=free // 2 if config.draft_share is None else config.draft_share,
        target_layer=target_layer,
        target_heads=tuple(target_heads),
        draft_layers=draft_layers,
        draft_heads=draft_heads,
        dense_layers=_layer_set(config.dense_layers, t_layers, "dense_layers"),
        selection_layers=selection_layers,
        min_recovery=None if config.min_recovery is None else float(config.min_recovery),
        max_budget=0 if config.min_recovery is None else (config.max_budget or 4 * config.budget),
    )


# the DustinConfig fields a ResolvedConfig takes as they are
_AS_GIVEN = ("budget", "sink_tokens", "recent_tokens", "min_context", "backend", "prefill_chunk", "calibration",
             "sparse_draft", "mode", "confirm_tokens", "confirm_every", "reuse_prefix")  # fmt: skip


def _draft_scoring(config: Any, draft_config: Any) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The draft's scoring layers (default: a quarter, half and three quarters deep) and each one's heads."""
    d_layers, d_heads = draft_config.num_hidden_layers, draft_config.num_attention_heads
    d_kv = getattr(draft_config, "num_key_value_heads", None) or d_heads
    draft_layers = config.draft_layers or tuple(sorted({d_layers // 4, d_layers // 2, (3 * d_layers) // 4}))
    if max(draft_layers) >= d_layers:
        raise ValueError(f"draft_layers {draft_layers} out of range: the draft has {d_layers} layers")
    heads = config.draft_heads or _first_group_heads(d_heads, d_kv)
    per_layer = heads if isinstance(heads[0], tuple) else tuple(heads for _ in draft_layers)
    if len(per_layer) != len(draft_layers):
        raise ValueError(f"draft_heads has {len(per_layer)} entries for {len(draft_layers)} draft_layers")
    for layer_heads in per_layer:
        _check_heads(layer_heads, d_heads, "draft_heads")
    return tuple(draft_layers), tuple(tuple(h) for h in per_layer)


def _layer_set(given: tuple[int, ...], layers: int, what: str) -> tuple[int, ...]:
    """``given`` layer indices (negative from the end) as sorted non-negative ones, each once."""
    chosen = tuple(sorted({layer % layers for layer in given}))
    if any(not -layers <= layer < layers for layer in given) or len(chosen) != len(given):
        raise ValueError(f"{what} {given} out of range or repeated: the target has {layers} layers")
    return chosen
