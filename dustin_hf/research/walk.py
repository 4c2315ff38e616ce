"""Teacher-forced verification walk: perplexity and attention recovery under sparse verification.

Speculative decoding verifies γ+1 tokens per step; with Dustin each step reads only a selected set
of cached positions. To measure what that costs in quality without sampling noise, the walk feeds
the *true* continuation of a text through verification-shaped steps, as if the draft had proposed
exactly the next γ tokens and all were accepted. Step ``s`` at ``L = C + s(γ+1)`` cached positions:

  1. draft: reads ``tokens[L-1 : L+γ]`` at positions ``L-1 ..`` (one forward; the decoder feeds the
     same tokens over γ forwards) and keeps its queries at ``L .. L+γ-1`` on the scoring layers;
  2. select (per budget): ``S_draft`` from those queries, ``S_target`` from the target's query of
     the last committed token (kept by the previous step), budget fill by ``select_positions``,
     exactly as :meth:`SpeculativeDecoder._select` does;
  3. verify: the target reads ``tokens[L : L+γ+1]`` against the selection (dense: everything); its
     logits give the NLL of ``tokens[L+1 : L+γ+2]``, and its query at ``L+γ`` becomes the history.

Besides perplexity, each step compares greedy predictions on the same true prefix: the target's
against the draft's (teacher-forced acceptance: how many leading drafts a greedy target would keep
if the draft guessed each next token from the true text) and against the dense target's (top-1
agreement). Unlike free-running generation, these compare every method on the same text.

Every method (dense, each budget) keeps its own target cache (sparse steps write keys and values
computed from sparse attention, as in decoding) and its own history; the draft cache is shared (the
draft attends densely), except for a ``sparse_draft`` method: its own draft reads that method's last
selection plus the positions written since, as the decoder's draft does. Attention recovery is measured against the dense method's queries
and keys at the same step: for the selection each budget actually used, and for selections made
from the dense method's signals by any number of extra configurations (e.g. the default heads),
and the oracle: the top positions of the reference attention itself (recovery is linear in the
selection, so no set of that size captures more).

A method whose config sets ``min_recovery`` (the quality knob) reads, at each step, the smallest set whose
estimated recovery reaches its target (:func:`~dustin_hf.selection.select_by_recovery`), as the decoder does.
Per step and sparse method the walk records the positions read, the selection's estimated recovery (the
scoring heads' share, :func:`~dustin_hf.selection.estimated_mass`) and its true recovery (over every layer,
head and query of the dense method, when measured): the knob's cost and the estimate against the truth.

An ``oracle`` method (an experiment, :mod:`dustin_hf.research.oracle`) verifies, at each step, with read sets taken
from that reference attention instead of its own signals: one set shared by all layers, or one per layer.
Its gap to dense is the loss a perfect scorer would still have with sets of that shape and size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..runner import ModelRunner, attention_scale, group_size, model_device
from ..draft_reads import DraftReads
from ..config import ResolvedConfig
from ..kernels import resolve_backend
from .oracle import ORACLES, LayerwisePlan, oracle_indices, oracle_recovery
from ..plan import ForwardPlan, select_heads
from .prefilled import Prefilled, clone_cache, dustin_attention_on
from ..recovery import position_weights, selection_recovery
from ..scoring import draft_lookahead_scores, target_history_scores
from ..selection import Selection, dense_rows, estimated_mass, select_by_recovery, select_positions

__all__ = ["DenseStep", "WalkResult", "teacher_forced_walk"]


@dataclass
class WalkResult:
    """Per method: summed NLL over ``tokens`` evaluated positions, perplexity; recovery means."""

    tokens: int
    steps: int
    nll: dict[str, float]
    ppl: dict[str, float]
    recovery: dict[str, float] = field(default_factory=dict)  # method -> mean share (actual selections)
    recovery_per_layer: dict[str, list[float]] = field(default_factory=dict)
    # "<config>@<budget>" -> mean share; "oracle@<budget>": the best any set of that size can reach
    recovery_dense_signals: dict[str, float] = field(default_factory=dict)
    sparse_steps: dict[str, int] = field(default_factory=dict)
    # teacher-forced greedy acceptance: per step, the leading positions where the draft's and the target's
    # greedy predictions (given the true prefix) agree, averaged over steps; and the per-token agreement rate
    accepted: dict[str, float] = field(default_factory=dict)
    draft_agreement: dict[str, float] = field(default_factory=dict)
    accepted_trace: dict[str, list[int]] = field(default_factory=dict)  # per step, the leading agreements
    top1_agreement_with_dense: dict[str, float] = field(default_factory=dict)  # target argmax vs the dense method's
    # per step of each sparse method: positions read (the context on a dense step), the read set's estimated recovery
    # and its true recovery (None: a dense step, or recovery not measured at that step; an oracle has no estimate)
    read_counts: dict[str, list[int]] = field(default_factory=dict)
    estimated_recovery: dict[str, list[float | None]] = field(default_factory=dict)
    true_recovery: dict[str, list[float | None]] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class _Method:
    """One verification method's target state along the walk."""

    def __init__(self, name: str, config: ResolvedConfig | None, model: ModelRunner, history: torch.Tensor | None,
                 draft: ModelRunner | None = None):
        self.name, self.config, self.model, self.history = name, config, model, history
        self.draft = draft  # its own draft (``sparse_draft``: what the draft reads follows this method's selections)
        self.last_selection = None  # (selection, [L]) of its last sparse step
        self.trace: list[int] = []  # per step: leading drafts a greedy target keeps
        self.nll = 0.0
        self.sparse_steps = 0
        self.agreed = 0  # positions where the draft's and the target's greedy predictions agree
        self.same_as_dense = 0  # positions where the target's greedy prediction equals the dense method's
        self.recovery: list[torch.Tensor] = []  # per recovery step: (n_layers,)
        self.read: list[int] = []  # per step: positions read
        self.estimates: list[float | None] = []  # per step: the read set's estimated recovery
        self.truths: list[float | None] = []  # per step: its true recovery, mean over layers


@dataclass(frozen=True)
class DenseStep:
    """What the dense method saw at one step, handed to :func:`teacher_forced_walk`'s ``probe``.

    ``at`` is ``L``, the cached positions; ``weights`` the reference attention ``(n_layers, L)``
    (:func:`~dustin_hf.recovery.position_weights`). Keys are row 0's cache buffers, ``(T, Hkv, D)`` with
    ``T > L + γ``: a probe reads ``[:L]`` (the draft's ``[:L + γ]``) and must not keep them past the call.
    """

    step: int
    at: int
    weights: torch.Tensor
    target_keys: dict[int, torch.Tensor]  # every target layer
    history: dict[int, torch.Tensor]  # per target layer, (H, D): the query of the token at L - 1 (step 0: prefill's)
    draft_keys: dict[int, torch.Tensor]  # the draft layers of ``draft_queries``
    draft_queries: dict[int, torch.Tensor]  # per draft layer, (γ, H, D): the queries at L .. L+γ-1
    target_scale: float
    draft_scale: float


def teacher_forced_walk(
    target,
    draft,
    state: Prefilled,
    continuation: torch.Tensor,
    gamma: int,
    methods: dict[str, ResolvedConfig | None],
    recovery_configs: dict[str, ResolvedConfig] | None = None,
    recovery_every: int = 1,
    progress: bool = True,
    desc: str = "walk",
    refresh_every: dict[str, int] | None = None,
    oracle: dict[str, str] | None = None,
    probe: Callable[[DenseStep], None] | None = None,
) -> WalkResult:
    """Walk ``continuation (N,)`` after ``state``'s prompt in steps of γ+1 teacher-forced tokens.

    Args:
        methods: name -> resolved Dustin config, or ``None`` for dense verification (needed whenever
            recovery is measured: it provides the reference attention).
        recovery_configs: name -> config whose selection, made from the *dense* method's signals,
            is scored for recovery at each recovery step (e.g. ``{"default@512": ...}``).
        recovery_every: measure recovery every this many steps (0: never).
        refresh_every: name -> N, an experiment beyond the paper: every N steps that method rewrites the
            keys and values of the positions verified since its last refresh with one dense forward over
            them, so that error written by sparse steps is not carried further than N steps.
        oracle: name -> ``"shared"`` or ``"per-layer"``, an experiment: on its sparse steps that method reads
            the top ``budget`` positions of the dense method's true attention at the step (over all layers, or
            each layer its own; :mod:`dustin_hf.research.oracle`) instead of its own selection. Its config still decides
            when a step is sparse and which layers read densely. Needs a dense method; recovery is then
            measured every step.
        probe: called at every step with the dense method's :class:`DenseStep` (every target layer's history
            query, every draft layer's queries), e.g. to study estimators of recovery offline. Needs a dense
            method; recovery is then measured every step.

    Returns a :class:`WalkResult` over ``(N - 1) // (γ+1)`` steps.
    """
    recovery_configs = recovery_configs or {}
    refresh_every, oracle = refresh_every or {}, oracle or {}
    sparse_names = {n for n, c in methods.items() if c is not None}
    if unknown := set(refresh_every) - sparse_names:
        raise ValueError(f"refresh_every names {sorted(unknown)}, which are not sparse methods")
    if unknown := set(oracle) - sparse_names:
        raise ValueError(f"oracle names {sorted(unknown)}, which are not sparse methods")
    if unknown := set(oracle.values()) - set(ORACLES):
        raise ValueError(f"unknown oracle kinds {sorted(unknown)}; choose from {ORACLES}")
    device = model_device(target)
    tokens = torch.cat([state.tokens, continuation.to(device)])
    context = state.tokens.numel()
    steps = (continuation.numel() - 1) // (gamma + 1)
    if steps < 1:
        raise ValueError(f"a continuation of {continuation.numel()} tokens is too short for one step of γ+1={gamma + 1}")
    dense_name = next((n for n, c in methods.items() if c is None), None)
    if (recovery_every or recovery_configs or oracle or probe) and dense_name is None:
        raise ValueError("measuring recovery, oracles and probes need a dense method (a name mapped to None) in methods")
    t_cfg, d_cfg = target.config.get_text_config(), draft.config.get_text_config()
    t_group, d_group = group_size(t_cfg), group_size(d_cfg)
    t_scale, d_scale = attention_scale(target, t_cfg), attention_scale(draft, d_cfg)
    backend = resolve_backend("auto", device)
    all_t_heads = tuple(range(t_cfg.num_attention_heads))
    all_configs = [c for c in methods.values() if c is not None] + list(recovery_configs.values())
    d_layers = range(d_cfg.num_hidden_layers) if probe else sorted({l for c in all_configs for l in c.draft_layers})
    d_capture = {layer: tuple(range(d_cfg.num_attention_heads)) for layer in d_layers}
    capacity = context + continuation.numel() + 1

    draft_model = ModelRunner(draft, clone_cache(state.draft_cache, capacity), backend)
    runs = []
    for name, cfg in methods.items():
        history = None if cfg is None else select_heads(state.history[cfg.target_layer][:, None], cfg.target_heads)[:, 0]
        runner = ModelRunner(target, clone_cache(state.target_cache, capacity), backend)
        own_draft = None
        if cfg is not None and cfg.sparse_draft:
            own_draft = ModelRunner(draft, clone_cache(state.draft_cache, capacity), backend)
        runs.append(_Method(name, cfg, runner, history, own_draft))
    dense_history = {layer: state.history[layer] for c in recovery_configs.values() for layer in [c.target_layer]}
    signals_recovery: dict[str, list[float]] = {name: [] for name in recovery_configs}
    probe_history = {layer: q[0] for layer, q in state.history.items()}  # every layer's, once the dense method has run

    start = time.perf_counter()
    with torch.no_grad(), dustin_attention_on(target, draft):
        for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress):
            at = context + step * (gamma + 1)  # L: cached positions of every target cache
            base = torch.tensor([at], device=device)
            # 1. the draft reads the true next tokens; its queries at L .. L+γ-1 score positions
            draft_next, s_draft = _draft_step(draft_model, None, tokens, at, gamma, backend, d_capture, base, d_group,
                                              d_scale)
            dense_next = None
            measure = bool(oracle) or probe is not None or (bool(recovery_every) and step % recovery_every == 0)
            verify_in = tokens[at : at + gamma + 1][None]
            labels = tokens[at + 1 : at + gamma + 2]
            weights = None
            for run in sorted(runs, key=lambda r: r.config is not None):  # dense first: its attention is the reference
                selection = None
                cfg = run.config
                run_draft_next, run_s_draft = draft_next, s_draft
                if run.draft is not None:  # a sparse draft: reads this method's last selection + what came since
                    reads = DraftReads.after(run.last_selection, cfg, gamma, capacity)
                    run_draft_next, run_s_draft = _draft_step(run.draft, None if reads is None else reads.at([at - 1]),
                                                              tokens, at, gamma, backend, d_capture, base, d_group,
                                                              d_scale)
                layer_indices, estimate = None, None
                if cfg is not None and not all(dense_rows([at], cfg)) and run.name in oracle:
                    selection, layer_indices = _oracle_selection(weights, cfg, oracle[run.name])
                    run.sparse_steps += 1
                elif cfg is not None and not all(dense_rows([at], cfg)):
                    selection, estimate = _select(run, cfg, run_s_draft, base, t_group, t_scale, at)
                    run.sparse_steps += 1
                if run.draft is not None:
                    run.last_selection = None if selection is None else (selection, [at])
                capture = {cfg.target_layer: cfg.target_heads} if cfg is not None else {}
                if cfg is None and measure:
                    capture = {layer: all_t_heads for layer in range(t_cfg.num_hidden_layers)}
                elif cfg is None:
                    capture = {layer: all_t_heads for layer in dense_history}
                plan_kwargs = dict(
                    rows=slice(0, 1), cache_seqlens=[at], q_len=gamma + 1, backend=backend,
                    indices=None if selection is None else selection.indices,
                    num_indices=None if selection is None else selection.num_indices, capture=capture,
                    dense_layers=() if cfg is None else cfg.dense_layers,
                )
                if layer_indices is None:
                    plan = ForwardPlan(**plan_kwargs)
                else:  # per-layer read sets: the plain-PyTorch path
                    plan = LayerwisePlan(**{**plan_kwargs, "backend": "reference"}, layer_indices=layer_indices)
                logits = run.model.forward(plan, verify_in, keep=gamma + 1)[0]  # (γ+1, V)
                run.nll += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
                target_next = logits.argmax(dim=-1)  # (γ+1,)
                agree = (target_next[:gamma] == run_draft_next.to(target_next.device)).long()
                run.agreed += int(agree.sum())
                run.trace.append(int(agree.cumprod(0).sum()))
                if cfg is None:
                    dense_next = target_next
                run.same_as_dense += int((target_next == dense_next).sum()) if dense_next is not None else 0
                if run.name in refresh_every and (step + 1) % refresh_every[run.name] == 0:
                    _refresh(run.model, tokens, context + (step + 1 - refresh_every[run.name]) * (gamma + 1),
                             at + gamma + 1, backend)
                if cfg is not None:
                    run.history = plan.captured[cfg.target_layer][:, gamma]  # (1, heads, D): the query at L+γ
                    if weights is not None and layer_indices is not None:
                        run.recovery.append(oracle_recovery(weights, torch.cat(list(layer_indices.values()))))
                    elif weights is not None and selection is not None:
                        run.recovery.append(selection_recovery(weights, selection.indices[0], selection.counts[0]))
                    run.read.append(at if selection is None else selection.counts[0])
                    run.estimates.append(estimate)
                    run.truths.append(float(run.recovery[-1].mean()) if weights is not None and selection is not None
                                      else None)
                    continue
                if measure:  # dense: the reference attention of this step, then selections from dense signals
                    t_keys = {layer: run.model.cache.layer_buffers(layer)[0][0] for layer in plan.captured}
                    weights = position_weights({l: q[0] for l, q in plan.captured.items()}, t_keys, at, t_scale)
                    if probe is not None:
                        d_keys = {layer: draft_model.cache.layer_buffers(layer)[0][0] for layer in s_draft.queries}
                        probe(DenseStep(step, at, weights, t_keys, probe_history, d_keys,
                                        {layer: q[0] for layer, q in s_draft.queries.items()}, t_scale, d_scale))
                        probe_history = {layer: q[0, gamma] for layer, q in plan.captured.items()}
                    mean_weights = weights.mean(dim=0)  # (L,): recovery is linear, so its top-k is the best shared set
                    for budget in sorted({c.budget for c in recovery_configs.values()}):
                        best = 1.0 if budget >= at else float(mean_weights.topk(budget).values.sum())
                        signals_recovery.setdefault(f"oracle@{budget}", []).append(best)
                    for name, rcfg in recovery_configs.items():
                        sel = _select_from(rcfg, dense_history[rcfg.target_layer], run.model, s_draft, base, t_group,
                                           t_scale, at)
                        share = 1.0 if sel is None else float(selection_recovery(weights, sel.indices[0], sel.counts[0]).mean())
                        signals_recovery[name].append(share)
                dense_history = {layer: plan.captured[layer][:, gamma] for layer in dense_history}
            # teacher forcing keeps everything: the draft holds [0, L+γ), the targets [0, L+γ+1) = [0, L' ) of the next step

    evaluated = steps * (gamma + 1)
    result = WalkResult(
        tokens=evaluated, steps=steps,
        nll={r.name: r.nll for r in runs}, ppl={r.name: math.exp(r.nll / evaluated) for r in runs},
        sparse_steps={r.name: r.sparse_steps for r in runs}, seconds=time.perf_counter() - start,
        accepted={r.name: sum(r.trace) / steps for r in runs},
        accepted_trace={r.name: r.trace for r in runs},
        draft_agreement={r.name: r.agreed / (steps * gamma) for r in runs},
        top1_agreement_with_dense={r.name: r.same_as_dense / evaluated for r in runs} if dense_name else {},
        read_counts={r.name: r.read for r in runs if r.config is not None},
        estimated_recovery={r.name: r.estimates for r in runs if r.config is not None},
        true_recovery={r.name: r.truths for r in runs if r.config is not None},
    )
    for run in runs:
        if run.recovery:
            per_layer = torch.stack(run.recovery).mean(dim=0)
            result.recovery[run.name] = float(per_layer.mean())
            result.recovery_per_layer[run.name] = [round(float(v), 5) for v in per_layer]
    result.recovery_dense_signals = {n: sum(v) / len(v) for n, v in signals_recovery.items() if v}
    return result


class _DraftScores:
    """``S_draft`` of one step, computed once per distinct (draft layers, heads)."""

    def __init__(self, draft_model, queries, base, group, scale, span):
        self.model, self.queries, self.base, self.group, self.scale, self.span = draft_model, queries, base, group, scale, span
        self._memo: dict = {}

    def __call__(self, cfg: ResolvedConfig) -> torch.Tensor:
        key = (cfg.draft_layers, cfg.draft_heads)
        if key not in self._memo:
            keys = [self.model.cache.layer_buffers(layer)[0] for layer in cfg.draft_layers]
            queries = [select_heads(self.queries[layer], heads) for layer, heads in zip(cfg.draft_layers, cfg.draft_heads)]
            self._memo[key] = draft_lookahead_scores(queries, keys, self.base.to(keys[0].device), cfg.draft_heads,
                                                     self.group, self.scale, self.span).to(self.base.device)
        return self._memo[key]


def _refresh(model: ModelRunner, tokens: torch.Tensor, start: int, end: int, backend: str) -> None:
    """Rewrite ``model``'s keys and values at positions ``[start, end)`` with one dense forward over them."""
    model.cache.rollback([start])  # the positions are written again, by the same tokens
    plan = ForwardPlan(rows=slice(0, 1), cache_seqlens=[start], q_len=end - start, backend=backend)
    model.forward(plan, tokens[start:end][None], keep=1)


def _draft_step(draft_model, selection, tokens, at, gamma, backend, d_capture, base, d_group, d_scale):
    """The draft over ``tokens[L-1 : L+γ]`` (all it has cached, or ``selection`` for a sparse draft): its greedy
    guesses ``(γ,)`` for ``tokens[L+1 : L+γ+1]`` and its ``S_draft`` from the queries at ``L .. L+γ-1``."""
    plan = ForwardPlan(rows=slice(0, 1), cache_seqlens=[at - 1], q_len=gamma + 1, backend=backend, capture=d_capture,
                       indices=None if selection is None else selection.indices,
                       num_indices=None if selection is None else selection.num_indices)
    logits = draft_model.forward(plan, tokens[at - 1 : at + gamma][None], keep=gamma + 1)[0]
    queries = {layer: q[:, 1:] for layer, q in plan.captured.items()}  # (1, γ, H, D)
    return logits[1:].argmax(dim=-1), _DraftScores(draft_model, queries, base, d_group, d_scale, at)


def _select(run: _Method, cfg, s_draft, base, t_group, t_scale, at) -> tuple[Selection, float]:
    """The read set ``cfg`` makes from ``run``'s history and ``s_draft`` (the knob's with ``min_recovery``), and its
    estimated recovery (:func:`~dustin_hf.selection.estimated_mass` summed over the set)."""
    keys = run.model.cache.layer_buffers(cfg.target_layer)[0]
    s_target = target_history_scores(run.history.to(keys.device), keys, base.to(keys.device), cfg.target_heads,
                                     t_group, t_scale, at).to(base.device)
    if cfg.min_recovery is not None:
        selection = select_by_recovery([at], s_draft(cfg), s_target, [True], cfg)
        return selection, selection.recovery[0]
    selection = select_positions([at], s_draft(cfg), s_target, [True], cfg)
    mass = estimated_mass(s_draft(cfg), s_target, [True], base)[0]
    return selection, float(mass[selection.indices[0, : selection.counts[0]].long()].sum())


def _oracle_selection(weights, cfg, kind):
    """The oracle's :class:`Selection` and, for ``"per-layer"``, each layer's own indices ``{layer: (1, budget)}``."""
    indices = oracle_indices(weights, cfg.budget, kind)  # (1 or n_layers, budget) int32
    count = torch.tensor([cfg.budget], dtype=torch.int32)
    selection = Selection(indices[:1], count, [cfg.budget])  # per-layer: layer 0's set stands for the base plan
    per_layer = None if kind == "shared" else {layer: row[None] for layer, row in enumerate(indices)}
    return selection, per_layer


def _select_from(cfg, history_all_heads, model, s_draft, base, t_group, t_scale, at):
    """The selection ``cfg`` would make from the dense method's state (``None``: ``cfg`` reads densely)."""
    if all(dense_rows([at], cfg)):
        return None
    run = _Method("", cfg, model, select_heads(history_all_heads[:, None], cfg.target_heads)[:, 0])
    return _select(run, cfg, s_draft, base, t_group, t_scale, at)[0]
