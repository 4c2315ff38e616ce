"""The search behind calibration: which scoring heads and ``draft_share`` recover the most attention.

Offline calibration (the lab's :mod:`dustin_lab.calibrate`, over book windows) and prompt calibration
(:mod:`dustin_hf.calibration.prompt`, over the prompt itself) both collect verification-like steps and
hand them here:

- :func:`step_features`: one step at ``L`` cached positions, every head of every layer kept:
  ``W (layers, L)`` the reference attention of the γ+1 verification queries (renormalised over the
  cached positions, :mod:`dustin_hf.selection.recovery`), ``T (target layers, heads, L)`` each target head's
  history attention (query at ``L-1``), ``D (draft layers, heads, L)`` each draft head's lookahead
  attention (queries ``L..L+γ-1``);
- :func:`search`, greedy (recovery is linear in the selection, so a candidate costs one budget fill):
  target layer and heads with ``m = 0`` (singles, whole GQA groups, then greedy growth within a group
  for the best layers); then draft layers (up to three) with heads from one GQA group each, with ``m``
  at half the free budget; then ``m`` on a grid; then (optionally) the sink and recent windows, and
  ``m`` once more. Scores average the budgets asked for. The selection is
  :func:`dustin_hf.selection.fill.select_positions`, the decoder's own budget fill.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..compat import attention_scale, group_size
from ..config import DustinConfig, resolve
from ..runtime.plan import ForwardPlan
from ..selection.fill import select_positions
from ..selection.recovery import head_probabilities, position_weights

__all__ = [
    "Choice",
    "StepFeatures",
    "default_choice",
    "oracle_recovery",
    "recovery_of",
    "search",
    "stack_features",
    "step_features",
]

_SHARE_GRID = (0.0, 0.0625, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
_SINK_GRID = (1, 4, 16)
_RECENT_GRID = (16, 32, 64, 128)


@dataclass
class StepFeatures:
    """Per-step features of all collected steps, padded to the longest ``L`` (zeros past each row's ``L``)."""

    seqlens: list[int]
    weights: torch.Tensor  # (S, target layers, Lmax): reference attention per layer
    target: torch.Tensor  # (S, target layers, target heads, Lmax): history attention per head
    draft: torch.Tensor  # (S, draft layers, draft heads, Lmax): lookahead attention per head
    sources: list[dict] = field(default_factory=list)

    @functools.cached_property
    def mean_weights(self) -> torch.Tensor:
        return self.weights.mean(dim=1)  # (S, Lmax)

    def save(self, path) -> None:
        """Keep the features (hundreds of MB for a real pair) to search again without re-collecting."""
        torch.save(
            {
                "seqlens": self.seqlens,
                "weights": self.weights,
                "target": self.target,
                "draft": self.draft,
                "sources": self.sources,
            },
            path,
        )

    @classmethod
    def load(cls, path) -> "StepFeatures":
        data = torch.load(path, map_location="cpu")
        return cls(data["seqlens"], data["weights"], data["target"], data["draft"], data["sources"])


def _scale_and_config(model):
    cfg = model.config.get_text_config()
    return attention_scale(model, cfg), cfg


def step_features(target, draft, t_model, d_model, tokens, at, gamma, backend, row: int = 0):
    """Features of one verification-like step at ``L = at`` on cache row ``row``: ``(W, T, D)`` on the CPU.

    Both caches' ``row`` must hold exactly ``at - 1`` positions (the forwards write slots ``at-1 ..``
    and advance the row); ``tokens (n,)`` is the row's text, ``n >= at + gamma + 1``.
    """
    t_scale, t_cfg = _scale_and_config(target)
    d_scale, d_cfg = _scale_and_config(draft)
    t_heads, d_heads = tuple(range(t_cfg.num_attention_heads)), tuple(range(d_cfg.num_attention_heads))
    rows = slice(row, row + 1)
    plan = ForwardPlan(
        rows=rows,
        cache_seqlens=[at - 1],
        q_len=gamma + 2,
        backend=backend,
        capture={layer: t_heads for layer in range(t_cfg.num_hidden_layers)},
    )
    t_model.forward(plan, tokens[at - 1 : at + gamma + 1][None], keep=1)
    t_keys = {layer: t_model.cache.layer_buffers(layer)[0][row] for layer in plan.captured}  # (T, Hkv, D)
    weights = position_weights({l: q[0, 1:] for l, q in plan.captured.items()}, t_keys, at, t_scale)  # (layers, L)
    history_pos = torch.tensor([at - 1], device=tokens.device)
    target = torch.stack(
        [
            head_probabilities(plan.captured[l][0, :1], t_keys[l], history_pos, at, t_scale)
            for l in sorted(plan.captured)
        ]
    )  # (layers, heads, L)
    plan = ForwardPlan(
        rows=rows,
        cache_seqlens=[at - 1],
        q_len=gamma + 1,
        backend=backend,
        capture={layer: d_heads for layer in range(d_cfg.num_hidden_layers)},
    )
    # ids a smaller draft embedding cannot hold reach it as its last id, as in decoding
    d_model.forward(plan, tokens[at - 1 : at + gamma][None].clamp_max(d_cfg.vocab_size - 1), keep=1)
    query_pos = at + torch.arange(gamma, device=tokens.device)
    draft_feats = torch.stack(
        [
            head_probabilities(plan.captured[l][0, 1:], d_model.cache.layer_buffers(l)[0][row], query_pos, at, d_scale)
            for l in sorted(plan.captured)
        ]
    )  # (layers, heads, L)
    return weights.cpu(), target.cpu(), draft_feats.cpu()


def stack_features(rows, seqlens, sources) -> StepFeatures:
    """One :class:`StepFeatures` from :func:`step_features` results at ``seqlens`` positions."""
    width = max(seqlens)

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    return StepFeatures(
        seqlens=seqlens,
        weights=torch.stack([pad(w) for w, _, _ in rows]),
        target=torch.stack([pad(t) for _, t, _ in rows]),
        draft=torch.stack([pad(d) for _, _, d in rows]),
        sources=sources,
    )


@dataclass(frozen=True)
class Choice:
    """A candidate: target layer and heads, draft (layer, heads) pairs, and ``m`` as a share of the free budget."""

    target_layer: int
    target_heads: tuple[int, ...]
    draft: tuple[tuple[int, tuple[int, ...]], ...] = ()
    share: float = 0.0
    sink: int | None = None  # sink_tokens; None: the base config's
    recent: int | None = None  # recent_tokens; None: the base config's

    def windows(self, base: DustinConfig) -> tuple[int, int]:
        return (
            base.sink_tokens if self.sink is None else self.sink,
            base.recent_tokens if self.recent is None else self.recent,
        )

    def draft_share(self, base: DustinConfig, budget: int) -> int:
        sink, recent = self.windows(base)
        return int(round(self.share * (budget - sink - recent))) if self.draft else 0

    def replace(self, **changes) -> "Choice":
        return dataclasses.replace(self, **changes)

    def config(self, base: DustinConfig, budget: int) -> DustinConfig:
        sink, recent = self.windows(base)
        layers = tuple(sorted(self.draft))
        return base.replace(
            budget=budget,
            sink_tokens=sink,
            recent_tokens=recent,
            draft_share=self.draft_share(base, budget),
            target_layer=self.target_layer,
            target_heads=self.target_heads,
            draft_layers=tuple(l for l, _ in layers) or None,
            draft_heads=tuple(h for _, h in layers) or None,
        )


def recovery_of(features: StepFeatures, choice: Choice, budgets, base: DustinConfig, per_layer: bool = False):
    """Mean recovery of ``choice`` over the steps, per budget: ``{budget: share}`` (or per-layer lists)."""
    s_target = features.target[:, choice.target_layer, list(choice.target_heads)].sum(dim=1)  # (S, Lmax)
    s_draft = torch.zeros_like(s_target)
    for layer, heads in choice.draft:
        s_draft += features.draft[:, layer, list(heads)].sum(dim=1)
    weights = features.weights if per_layer else features.mean_weights[:, None]  # (S, layers or 1, Lmax)
    out = {}
    for budget in budgets:
        cfg = _Resolved(budget, *choice.windows(base), choice.draft_share(base, budget))
        sel = select_positions(features.seqlens, s_draft, s_target, [True] * len(features.seqlens), cfg)
        valid = torch.arange(sel.indices.shape[1])[None, :] < sel.num_indices[:, None].long()  # (S, W)
        idx = sel.indices.long()[:, None, :].expand(-1, weights.shape[1], -1)
        share = (weights.gather(2, idx) * valid[:, None]).sum(dim=2).mean(dim=0)  # (layers or 1,)
        out[budget] = [round(float(v), 5) for v in share] if per_layer else float(share[0])
    return out


def oracle_recovery(features: StepFeatures, budgets) -> dict:
    """The best mean recovery any set of ``budget`` positions reaches (the top positions of the reference
    attention itself; recovery is linear in the selection): ``{budget: share}``."""
    out = {}
    for budget in budgets:
        values = [
            1.0 if budget >= n else float(row[:n].topk(budget).values.sum())
            for row, n in zip(features.mean_weights, features.seqlens)
        ]
        out[budget] = sum(values) / len(values)
    return out


@dataclass(frozen=True)
class _Resolved:
    """The fields of :class:`~dustin_hf.config.ResolvedConfig` that ``select_positions`` reads."""

    budget: int
    sink_tokens: int
    recent_tokens: int
    draft_share: int
    min_context: int = 0


class _Search:
    """Scores candidates (mean recovery over budgets), remembers the best, and stops at the deadline."""

    def __init__(self, features, budgets, base, deadline, progress):
        self.features, self.budgets, self.base, self.deadline = features, budgets, base, deadline
        self.bar = tqdm(desc="calibrate: search", unit="cand", disable=not progress)
        self.evaluated = 0
        self.stopped_early = False

    def score(self, choice: Choice) -> float:
        self.evaluated += 1
        self.bar.update()
        values = recovery_of(self.features, choice, self.budgets, self.base)
        return sum(values.values()) / len(values)

    def out_of_time(self) -> bool:
        if time.perf_counter() > self.deadline:
            self.stopped_early = True
        return self.stopped_early

    def best(self, choices, current: tuple[float, Choice] | None = None) -> tuple[float, Choice] | None:
        for choice in choices:
            if current is not None and self.out_of_time():
                break
            value = self.score(choice)
            if current is None or value > current[0]:
                current = (value, choice)
                self.bar.set_postfix_str(f"best {value:.4f}")
        return current


def _group(head: int, group_size: int) -> tuple[int, ...]:
    first = head - head % group_size
    return tuple(range(first, first + group_size))


def search(
    features: StepFeatures,
    t_cfg,
    d_cfg,
    budgets,
    base: DustinConfig,
    deadline: float,
    progress: bool = True,
    max_draft_layers: int = 3,
    search_windows: bool = True,
) -> tuple[Choice, dict]:
    """The greedy search of the module docstring (recovery averaged over ``budgets``); returns the best
    choice and a log of each stage."""
    s = _Search(features, budgets, base, deadline, progress)
    log = {}
    value, target_choice = _search_target(s, t_cfg)
    log["target"] = {"recovery": value, "layer": target_choice.target_layer, "heads": list(target_choice.target_heads)}
    share = 0.5
    chosen_value, chosen = _search_draft(s, d_cfg, target_choice, share, max_draft_layers)
    log["draft"] = {"recovery": chosen_value, "layers": [[l, list(h)] for l, h in chosen.draft], "share": share}

    # Stage 3: m on a grid.
    final_value, final = s.best([chosen.replace(share=f) for f in _SHARE_GRID], (chosen_value, chosen))
    log["share"] = {"recovery": final_value, "share": final.share}

    # Stage 4 (optional): the sink and recent windows, then m again.
    if search_windows:
        limit = min(budgets) // 2
        windows = [(sink, recent) for sink in _SINK_GRID for recent in _RECENT_GRID if sink + recent <= limit]
        final_value, final = s.best([final.replace(sink=a, recent=b) for a, b in windows], (final_value, final))
        final_value, final = s.best([final.replace(share=f) for f in _SHARE_GRID], (final_value, final))
        log["windows"] = {
            "recovery": final_value,
            "sink_tokens": final.sink,
            "recent_tokens": final.recent,
            "share": final.share,
        }
    log["candidates_evaluated"] = s.evaluated
    log["stopped_early"] = s.stopped_early
    s.bar.close()
    return final, log


def _search_target(s: _Search, t_cfg) -> tuple[float, Choice]:
    """Stage 1: the target's layer and heads, m = 0 (the whole free budget by S_target)."""
    t_heads, t_group = t_cfg.num_attention_heads, group_size(t_cfg)
    singles = {}
    for layer in range(t_cfg.num_hidden_layers):
        for head in range(t_heads):
            if s.out_of_time() and singles:
                break
            singles[(layer, head)] = s.score(Choice(layer, (head,)))
    best = max(((v, Choice(l, (h,))) for (l, h), v in singles.items()), key=lambda x: x[0])
    groups = [
        Choice(l, _group(g, t_group)) for l in range(t_cfg.num_hidden_layers) for g in range(0, t_heads, t_group)
    ]
    best = s.best(groups, best)
    top_layers = sorted({l for l, _ in singles}, key=lambda l: -max(v for (ll, _), v in singles.items() if ll == l))[
        :4
    ]
    for layer in top_layers:
        head = max((h for (l, h) in singles if l == layer), key=lambda h: singles[(layer, h)])
        heads, value = (head,), singles[(layer, head)]
        while not s.out_of_time():
            options = [tuple(sorted(heads + (h,))) for h in _group(head, t_group) if h not in heads]
            if not options:
                break
            scored = s.best([Choice(layer, o) for o in options])
            if scored is None or scored[0] <= value:
                break
            value, heads = scored[0], scored[1].target_heads
            if value > best[0]:
                best = (value, scored[1])
    return best


def _search_draft(s: _Search, d_cfg, target_choice: Choice, share: float, max_layers: int) -> tuple[float, Choice]:
    """Stage 2: the draft's layers, one GQA group's heads (or its best few) each, m at ``share`` of the free
    budget."""
    d_heads, d_group = d_cfg.num_attention_heads, group_size(d_cfg)
    with_target = lambda draft: Choice(target_choice.target_layer, target_choice.target_heads, draft, share)  # noqa: E731
    d_singles = {}
    for layer in range(d_cfg.num_hidden_layers):
        for head in range(d_heads):
            if s.out_of_time() and d_singles:
                break
            d_singles[(layer, head)] = s.score(with_target(((layer, (head,)),)))
    candidates = {}
    for layer in {l for l, _ in d_singles}:
        options = [_group(g, d_group) for g in range(0, d_heads, d_group)]
        for g in range(0, d_heads, d_group):
            ranked = sorted(
                (h for h in _group(g, d_group) if (layer, h) in d_singles), key=lambda h: -d_singles[(layer, h)]
            )
            options += [tuple(sorted(ranked[:k])) for k in (2, 4) if len(ranked) >= k]
        scored = s.best([with_target(((layer, o),)) for o in options])
        if scored is not None:
            candidates[layer] = scored
    chosen_value, chosen = max(candidates.values(), key=lambda x: x[0]) if candidates else s.best([with_target(())])
    while len(chosen.draft) < max_layers and not s.out_of_time():
        used = {l for l, _ in chosen.draft}
        options = [with_target(chosen.draft + c.draft) for l, (_, c) in candidates.items() if l not in used]
        scored = s.best(options)
        if scored is None or scored[0] <= chosen_value:
            break
        chosen_value, chosen = scored
    return chosen_value, chosen


def default_choice(base: DustinConfig, t_cfg, d_cfg, budget: int) -> Choice:
    """``DustinConfig()``'s model-dependent defaults, as a :class:`Choice`."""
    resolved = resolve(
        base.replace(
            budget=budget, target_layer=None, target_heads=None, draft_layers=None, draft_heads=None, draft_share=None
        ),
        t_cfg,
        d_cfg,
    )
    free = budget - base.sink_tokens - base.recent_tokens
    return Choice(
        resolved.target_layer,
        resolved.target_heads,
        tuple(zip(resolved.draft_layers, resolved.draft_heads)),
        resolved.draft_share / free if free else 0.0,
    )
