"""Teacher-forced verification walk: perplexity and attention recovery under sparse verification.

Speculative decoding verifies γ+1 tokens per step; with Dustin each step reads only a selected set
of cached positions. To measure what that costs in quality without sampling noise, the walk feeds
the *true* continuation of a text through verification-shaped steps, as if the draft had proposed
exactly the next γ tokens and all were accepted. Step ``s`` at ``L = C + s(γ+1)`` cached positions:

  1. draft: reads ``tokens[L-1 : L+γ]`` at positions ``L-1 ..`` (one forward; the decoder feeds the
     same tokens over γ forwards) and keeps its queries at ``L .. L+γ-1`` on the scoring layers;
  2. select (per budget): ``S_draft`` from those queries, ``S_target`` from the target's query of
     the last committed token (kept by the previous step), budget fill by ``select_positions``,
     exactly as the decoder's selector does (:meth:`dustin_hf.selection.selector.Selector.select`);
  3. verify: the target reads ``tokens[L : L+γ+1]`` against the selection (dense: everything); its
     logits give the NLL of ``tokens[L+1 : L+γ+2]``, and its query at ``L+γ`` becomes the history.

Besides perplexity, each step compares greedy predictions on the same true prefix: the target's
against the draft's (teacher-forced acceptance: how many leading drafts a greedy target would keep
if the draft guessed each next token from the true text) and against the dense target's (top-1
agreement). Unlike free-running generation, these compare every method on the same text. The walk
also keeps every prediction: per position ``C + j``, each method's target argmax and the argmax of
the draft it drafted with (the first one from the prefill, the draft's from step ``s``'s first query
at ``L - 1``), so that a replay can derive any method's acceptance from them
(:func:`dustin_lab.traces.prediction_record`).

Every method (dense, each budget) keeps its own row of one target cache (sparse steps write keys and
values computed from sparse attention, as in decoding) and its own history; the draft's row is shared
(the draft attends densely), except for a ``sparse_draft`` method: its own draft row reads that
method's last selection plus the positions written since, as the decoder's draft does. Each step runs
one forward of each model over all their rows (each row reading its own selection, a dense row
everything), since a forward's cost on a CPU is mostly reading the weights; methods with other dense
layers, and oracles, forward on their own. Attention recovery is measured against the dense method's queries
and keys at the same step: for the selection each budget actually used, and for selections made
from the dense method's signals by any number of extra configurations (e.g. the default heads),
and the oracle: the top positions of the reference attention itself (recovery is linear in the
selection, so no set of that size captures more).

A method whose config sets ``min_recovery`` (the quality knob) reads, at each step, the smallest set whose
estimated recovery reaches its target (:func:`~dustin_hf.selection.fill.select_by_recovery`), as the decoder does.
Per step and sparse method the walk records the positions read, the selection's estimated recovery (the
scoring heads' share, :func:`~dustin_hf.selection.fill.estimated_mass`) and its true recovery (over every layer,
head and query of the dense method, when measured): the knob's cost and the estimate against the truth.

An ``oracle`` method (an experiment, :mod:`dustin_lab.oracle`) verifies, at each step, with read sets taken
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

from dustin_hf.experimental import (
    DraftReads,
    ForwardPlan,
    ModelRunner,
    ResolvedConfig,
    Selection,
    attention_scale,
    dense_rows,
    device_tensor,
    draft_lookahead_scores,
    estimated_mass,
    group_size,
    model_device,
    position_weights,
    select_by_recovery,
    select_heads,
    select_positions,
    select_spec,
    selection_recovery,
    target_history_scores,
)
from dustin_hf.kernels import resolve_backend

from .oracle import ORACLES, layerwise_plan, oracle_indices, oracle_recovery
from .prefilled import Prefilled, clone_cache, dustin_attention_on

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
    # per position j < tokens (the token at C + j, predicted on the true prefix [0, C + j)): the true token, each
    # method's target argmax, and the argmax of the draft that method drafted with
    truth: list[int] = field(default_factory=list)
    predictions: dict[str, list[int]] = field(default_factory=dict)
    draft_predictions: dict[str, list[int]] = field(default_factory=dict)
    # per step of each sparse method: positions read (the context on a dense step), the read set's estimated recovery
    # and its true recovery (None: a dense step, or recovery not measured at that step; an oracle has no estimate)
    read_counts: dict[str, list[int]] = field(default_factory=dict)
    estimated_recovery: dict[str, list[float | None]] = field(default_factory=dict)
    true_recovery: dict[str, list[float | None]] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class _Method:
    """One verification method's state along the walk: its row of the shared target cache (and of the draft cache,
    0 for the shared dense draft) and what it measured."""

    def __init__(
        self, name: str, config: ResolvedConfig | None, row: int, history: torch.Tensor | None, draft_row: int
    ):
        self.name, self.config, self.row, self.history, self.draft_row = name, config, row, history, draft_row
        self.selection: Selection | None = None  # this step's read set (None: everything)
        self.layer_indices: dict | None = None  # an oracle's per-layer read sets this step
        self.estimate: float | None = None  # this step's read set's estimated recovery (None: dense, an oracle)
        self.last_selection = None  # (selection, [L]) of its last step, for its own draft (``sparse_draft``)
        self.trace: list[int] = []  # per step: leading drafts a greedy target keeps
        self.predictions: list[int] = []  # per position from C: the target's argmax
        self.draft_predictions: list[int] = []  # per position from C: its draft's argmax
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
    (:func:`~dustin_hf.selection.recovery.position_weights`). Keys are row 0's cache buffers, ``(T, Hkv, D)`` with
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
            each layer its own; :mod:`dustin_lab.oracle`) instead of its own selection. Its config still decides
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
    if chooses := sorted(n for n in oracle if methods[n].selection_layers):
        raise ValueError(
            f"oracle methods {chooses} have selection layers, which would replace the oracle's sets in "
            "the layers after them: resolve their configs with selection='dustin'"
        )
    device = model_device(target)
    tokens = torch.cat([state.tokens, continuation.to(device)])
    context = state.tokens.numel()
    steps = (continuation.numel() - 1) // (gamma + 1)
    if steps < 1:
        raise ValueError(
            f"a continuation of {continuation.numel()} tokens is too short for one step of γ+1={gamma + 1}"
        )
    dense_name = next((n for n, c in methods.items() if c is None), None)
    if (recovery_every or recovery_configs or oracle or probe) and dense_name is None:
        raise ValueError(
            "measuring recovery, oracles and probes need a dense method (a name mapped to None) in methods"
        )
    t_cfg, d_cfg = target.config.get_text_config(), draft.config.get_text_config()
    t_group, d_group = group_size(t_cfg), group_size(d_cfg)
    t_scale, d_scale = attention_scale(target, t_cfg), attention_scale(draft, d_cfg)
    backend = resolve_backend("auto", device)
    all_t_heads = tuple(range(t_cfg.num_attention_heads))
    all_configs = [c for c in methods.values() if c is not None] + list(recovery_configs.values())
    d_layers = range(d_cfg.num_hidden_layers) if probe else sorted({l for c in all_configs for l in c.draft_layers})
    d_capture = {layer: tuple(range(d_cfg.num_attention_heads)) for layer in d_layers}
    capacity = context + continuation.numel() + 1

    # rows: dense methods first, then the sparse ones grouped by their dense layers, oracles last (a forward covers
    # a contiguous slice of rows, and an oracle's per-layer read sets need a forward of its own)
    order = sorted(methods, key=lambda n: (n in oracle, methods[n] is not None, _layer_roles(methods[n])))
    own_drafts = [n for n in order if methods[n] is not None and methods[n].sparse_draft]
    target_model = ModelRunner(target, clone_cache(state.target_cache, capacity, rows=len(order)), backend)
    draft_model = ModelRunner(draft, clone_cache(state.draft_cache, capacity, rows=1 + len(own_drafts)), backend)
    runs = []
    for row, name in enumerate(order):
        cfg = methods[name]
        history = (
            None if cfg is None else select_heads(state.history[cfg.target_layer][:, None], cfg.target_heads)[:, 0]
        )
        runs.append(_Method(name, cfg, row, history, 1 + own_drafts.index(name) if name in own_drafts else 0))
    by_name = {run.name: run for run in runs}
    groups = _forward_groups(runs, oracle)
    dense_history = {layer: state.history[layer] for c in recovery_configs.values() for layer in [c.target_layer]}
    signals_recovery: dict[str, list[float]] = {name: [] for name in recovery_configs}
    scoring_layers = {c.target_layer for c in methods.values() if c is not None} | set(dense_history)
    probe_history = {layer: q[0] for layer, q in state.history.items()}  # every layer's, once the dense method has run

    for run in runs:  # the token at C: every method predicts it from the (dense) prefill
        run.predictions.append(int(state.last_logits.argmax()))
    start = time.perf_counter()
    with torch.no_grad(), dustin_attention_on(target, draft):
        for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress):
            at = context + step * (gamma + 1)  # L: cached positions of every target row
            base = torch.tensor([at], device=device)
            # 1. every draft row reads the true next tokens in one forward (the shared dense draft all it holds, a
            #    sparse draft its method's last selection + what came since); queries at L .. L+γ-1 score positions
            reads = [DraftReads.after(by_name[n].last_selection, methods[n], gamma, capacity) for n in own_drafts]
            guesses, s_draft = _draft_step(
                draft_model,
                [None] + [None if r is None else r.at([at - 1]) for r in reads],
                tokens,
                at,
                gamma,
                backend,
                d_capture,
                base,
                d_group,
                d_scale,
            )
            dense_next, weights = None, None
            measure = bool(oracle) or probe is not None or (bool(recovery_every) and step % recovery_every == 0)
            verify_in = tokens[at : at + gamma + 1][None]
            labels = tokens[at + 1 : at + gamma + 2]
            layers = set(range(t_cfg.num_hidden_layers)) if measure else scoring_layers
            for group in groups:  # the dense group first: its attention is the reference
                for run in group:  # 2. select (per method)
                    cfg, run.selection, run.layer_indices, run.estimate = run.config, None, None, None
                    if cfg is None or all(dense_rows([at], cfg)):
                        continue
                    run.sparse_steps += 1
                    if run.name in oracle:
                        run.selection, run.layer_indices = _oracle_selection(weights, cfg, oracle[run.name])
                    else:
                        keys = target_model.cache.layer_buffers(cfg.target_layer)[0][run.row : run.row + 1]
                        run.selection, run.estimate = _select(
                            run.history, cfg, keys, s_draft[run.draft_row], base, t_group, t_scale, at
                        )
                # 3. verify: one forward of the group's rows, each against its selection (dense: everything)
                logits, captured, chosen = _verify(
                    target_model, group, verify_in, at, gamma, backend, {layer: all_t_heads for layer in layers}
                )
                for i, run in enumerate(group):
                    if run.config is not None:
                        continue
                    dense_next = logits[i].argmax(dim=-1)
                    if measure:  # the reference attention of this step, then selections from dense signals
                        queries = {l: q[i] for l, q in captured.items()}
                        weights = _dense_recovery(
                            target_model,
                            run.row,
                            queries,
                            at,
                            t_scale,
                            recovery_configs,
                            dense_history,
                            s_draft[0],
                            base,
                            t_group,
                            signals_recovery,
                        )
                        if probe is not None:
                            t_keys = {layer: target_model.cache.layer_buffers(layer)[0][run.row] for layer in queries}
                            d_keys = {
                                layer: draft_model.cache.layer_buffers(layer)[0][0] for layer in s_draft[0].queries
                            }
                            probe(
                                DenseStep(
                                    step,
                                    at,
                                    weights,
                                    t_keys,
                                    probe_history,
                                    d_keys,
                                    {layer: q[0] for layer, q in s_draft[0].queries.items()},
                                    t_scale,
                                    d_scale,
                                )
                            )
                            probe_history = {layer: q[gamma] for layer, q in queries.items()}
                    dense_history = {layer: captured[layer][i : i + 1, gamma] for layer in dense_history}
                for i, run in enumerate(group):
                    cfg = run.config
                    run.nll += float(torch.nn.functional.cross_entropy(logits[i], labels, reduction="sum"))
                    target_next = logits[i].argmax(dim=-1)  # (γ+1,): guesses for tokens[L+1 : L+γ+2]
                    run.predictions.extend(target_next.tolist())
                    run.draft_predictions.extend(guesses[run.draft_row].tolist())
                    agree = (target_next[:gamma] == guesses[run.draft_row, 1:].to(target_next.device)).long()
                    run.agreed += int(agree.sum())
                    run.trace.append(int(agree.cumprod(0).sum()))
                    run.same_as_dense += int((target_next == dense_next).sum()) if dense_next is not None else 0
                    if run.draft_row:
                        run.last_selection = None if run.selection is None else (run.selection, [at])
                    if run.name in refresh_every and (step + 1) % refresh_every[run.name] == 0:
                        _refresh(
                            target_model,
                            run.row,
                            tokens,
                            context + (step + 1 - refresh_every[run.name]) * (gamma + 1),
                            at + gamma + 1,
                            backend,
                        )
                    if cfg is None:
                        continue
                    run.history = select_heads(captured[cfg.target_layer][i : i + 1, gamma], cfg.target_heads, dim=1)
                    if weights is not None and run.layer_indices is not None:
                        run.recovery.append(oracle_recovery(weights, torch.cat(list(run.layer_indices.values()))))
                    elif weights is not None and run.selection is not None and chosen:
                        run.recovery.append(_read_recovery(weights, cfg, run.selection, chosen, i))
                    elif weights is not None and run.selection is not None:
                        run.recovery.append(
                            selection_recovery(weights, run.selection.indices[0], run.selection.counts[0])
                        )
                    run.read.append(at if run.selection is None else run.selection.counts[0])
                    run.estimates.append(run.estimate)
                    run.truths.append(
                        float(run.recovery[-1].mean()) if weights is not None and run.selection is not None else None
                    )
            # teacher forcing keeps everything: the draft holds [0, L+γ), the targets [0, L+γ+1) = [0, L' ) of the
            # next step

    runs = [by_name[name] for name in methods]
    evaluated = steps * (gamma + 1)
    result = WalkResult(
        tokens=evaluated,
        steps=steps,
        nll={r.name: r.nll for r in runs},
        ppl={r.name: math.exp(r.nll / evaluated) for r in runs},
        sparse_steps={r.name: r.sparse_steps for r in runs},
        seconds=time.perf_counter() - start,
        accepted={r.name: sum(r.trace) / steps for r in runs},
        accepted_trace={r.name: r.trace for r in runs},
        draft_agreement={r.name: r.agreed / (steps * gamma) for r in runs},
        top1_agreement_with_dense={r.name: r.same_as_dense / evaluated for r in runs} if dense_name else {},
        truth=tokens[context : context + evaluated].tolist(),
        predictions={r.name: r.predictions[:evaluated] for r in runs},
        draft_predictions={r.name: r.draft_predictions for r in runs},
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
    """``S_draft`` of one draft row at one step, computed once per distinct (draft layers, heads)."""

    def __init__(self, draft_model, row, queries, base, group, scale, span):
        self.model, self.row, self.queries = draft_model, row, queries
        self.base, self.group, self.scale, self.span = base, group, scale, span
        self._memo: dict = {}

    def __call__(self, cfg: ResolvedConfig) -> torch.Tensor:
        key = (cfg.draft_layers, cfg.draft_heads)
        if key not in self._memo:
            keys = [self.model.cache.layer_buffers(layer)[0][self.row : self.row + 1] for layer in cfg.draft_layers]
            queries = [
                select_heads(self.queries[layer], heads) for layer, heads in zip(cfg.draft_layers, cfg.draft_heads)
            ]
            self._memo[key] = draft_lookahead_scores(
                queries, keys, self.base.to(keys[0].device), cfg.draft_heads, self.group, self.scale, self.span
            ).to(self.base.device)
        return self._memo[key]


def _dense_layers(cfg: ResolvedConfig | None) -> tuple[int, ...]:
    return () if cfg is None else cfg.dense_layers


def _layer_roles(cfg: ResolvedConfig | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a forward's layers do besides reading the selection: its dense layers and its selection layers."""
    return ((), ()) if cfg is None else (cfg.dense_layers, cfg.selection_layers)


def _read_recovery(
    weights: torch.Tensor, cfg: ResolvedConfig, before: Selection, chosen: dict[int, torch.Tensor], row: int
) -> torch.Tensor:
    """Per layer ``(n_layers,)``, the share of ``weights`` that what the layer read captures: a dense or selection
    layer everything, a layer before the first selection layer ``before`` (one row), a later one the set its
    selection layer chose for ``row`` of the forward (``before``'s count)."""
    count = before.counts[0]
    parts = []
    for layer in range(weights.shape[0]):
        last = max((s for s in chosen if s <= layer), default=None)
        if layer in cfg.dense_layers or layer in chosen:
            parts.append(weights.new_ones(()))
        else:
            indices = before.indices[0] if last is None else chosen[last][row]
            parts.append(selection_recovery(weights[layer : layer + 1], indices, count)[0])
    return torch.stack(parts)


def _forward_groups(runs: list[_Method], oracle: dict[str, str]) -> list[list[_Method]]:
    """Consecutive rows that share one target forward: the same dense and selection layers, no oracle (each its own
    forward)."""
    groups: list[list[_Method]] = []
    for run in runs:
        last = groups[-1][0] if groups else None
        if (
            last is not None
            and run.name not in oracle
            and last.name not in oracle
            and _layer_roles(last.config) == _layer_roles(run.config)
        ):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _stacked(selections: list[Selection | None], cached: list[int]) -> Selection | None:
    """One read set for a forward over several rows: each row's own one-row selection, or (``None``) all the
    ``cached[i]`` positions it holds; ``None`` when every row reads everything."""
    present = [sel for sel in selections if sel is not None]
    if not present:
        return None
    device = present[0].indices.device
    width = max([sel.indices.shape[1] for sel in present] + [n for sel, n in zip(selections, cached) if sel is None])
    every = torch.arange(width, device=device, dtype=torch.int32)
    # a row read in full lists its positions, then zeros (a selection wider than the row's cache, e.g. the knob's
    # ceiling, must not name positions past it)
    rows = [
        torch.where(every < n, every, 0)
        if sel is None
        else torch.nn.functional.pad(sel.indices[0], (0, width - sel.indices.shape[1]))
        for sel, n in zip(selections, cached)
    ]
    counts = [n if sel is None else sel.counts[0] for sel, n in zip(selections, cached)]
    return Selection(torch.stack(rows), device_tensor(counts, device, torch.int32), counts)


def _verify(model: ModelRunner, group: list[_Method], verify_in, at, gamma, backend, capture):
    """The target over ``tokens[L : L+γ+1]`` for the group's rows in one forward, each row reading its selection;
    returns ``(logits (rows, γ+1, V), captured queries {layer: (rows, γ+1, heads, D)})``."""
    first, rows = group[0].row, len(group)
    reads = _stacked([run.selection for run in group], [at] * rows)
    plan_kwargs = dict(
        rows=slice(first, first + rows),
        cache_seqlens=[at] * rows,
        q_len=gamma + 1,
        backend=backend,
        indices=None if reads is None else reads.indices,
        num_indices=None if reads is None else reads.num_indices,
        capture=capture,
        dense_layers=_dense_layers(group[0].config),
    )
    spec = select_spec(group[0].config)
    chosen = {}  # {selection layer: (B', W) int32}: what each chose, for the recovery of what the layers after read

    def keep_choice(layer: int, tensors) -> None:
        chosen[layer] = tensors.indices

    if spec is not None:
        plan = ForwardPlan(**plan_kwargs, select=spec, selection_hook=keep_choice)
    elif group[0].layer_indices is None:
        plan = ForwardPlan(**plan_kwargs)
    else:  # an oracle's per-layer read sets (a group of its own): the plain-PyTorch path
        plan = layerwise_plan(group[0].layer_indices, **{**plan_kwargs, "backend": "reference"})
    logits = model.forward(plan, verify_in.expand(rows, -1), keep=gamma + 1)
    return logits, plan.captured, chosen


def _dense_recovery(model, row, queries, at, scale, recovery_configs, dense_history, s_draft, base, group, signals):
    """The dense row's attention at this step ``(n_layers, L)`` (the reference for recovery and oracles); appends
    to ``signals`` the best recovery any set of each budget reaches and that of each recovery config's selection made
    from the dense row's own signals."""
    t_keys = {layer: model.cache.layer_buffers(layer)[0][row] for layer in queries}
    weights = position_weights(queries, t_keys, at, scale)
    mean_weights = weights.mean(dim=0)  # (L,): recovery is linear, so its top-k is the best shared set
    for budget in sorted({c.budget for c in recovery_configs.values()}):
        best = 1.0 if budget >= at else float(mean_weights.topk(budget).values.sum())
        signals.setdefault(f"oracle@{budget}", []).append(best)
    for name, cfg in recovery_configs.items():
        keys = model.cache.layer_buffers(cfg.target_layer)[0][row : row + 1]
        sel = _select_from(cfg, dense_history[cfg.target_layer], keys, s_draft, base, group, scale, at)
        signals[name].append(
            1.0 if sel is None else float(selection_recovery(weights, sel.indices[0], sel.counts[0]).mean())
        )
    return weights


def _refresh(model: ModelRunner, row: int, tokens: torch.Tensor, start: int, end: int, backend: str) -> None:
    """Rewrite row ``row``'s keys and values at positions ``[start, end)`` with one dense forward over them."""
    lengths = list(model.cache.seq_lengths)
    lengths[row] = start  # the positions are written again, by the same tokens
    model.cache.rollback(lengths)
    plan = ForwardPlan(rows=slice(row, row + 1), cache_seqlens=[start], q_len=end - start, backend=backend)
    model.forward(plan, tokens[start:end][None], keep=1)


def _draft_step(draft_model, selections, tokens, at, gamma, backend, d_capture, base, d_group, d_scale):
    """Every draft row over ``tokens[L-1 : L+γ]`` in one forward, each reading all it has cached or its own one-row
    selection (``selections[row]``): greedy guesses ``(rows, γ+1)`` for ``tokens[L : L+γ+1]`` (the first is not a
    draft: the decoder's step starts after the token at ``L``) and each row's ``S_draft`` from its queries at
    ``L .. L+γ-1``."""
    rows = len(selections)
    reads = _stacked(selections, [at - 1] * rows)
    plan = ForwardPlan(
        rows=slice(0, rows),
        cache_seqlens=[at - 1] * rows,
        q_len=gamma + 1,
        backend=backend,
        capture=d_capture,
        indices=None if reads is None else reads.indices,
        num_indices=None if reads is None else reads.num_indices,
    )
    logits = draft_model.forward(plan, tokens[at - 1 : at + gamma][None].expand(rows, -1), keep=gamma + 1)
    queries = {layer: q[:, 1:] for layer, q in plan.captured.items()}  # (rows, γ, H, D)
    scores = [
        _DraftScores(draft_model, r, {layer: q[r : r + 1] for layer, q in queries.items()}, base, d_group, d_scale, at)
        for r in range(rows)
    ]
    return logits.argmax(dim=-1), scores


def _select(history, cfg, keys, s_draft, base, t_group, t_scale, at) -> tuple[Selection, float]:
    """A method's selection at ``L`` (the knob's with ``min_recovery``): ``S_target`` from its ``history (1, heads,
    D)`` over ``keys (1, cap, H, D)``; and the set's estimated recovery
    (:func:`~dustin_hf.selection.fill.estimated_mass` summed over the set)."""
    s_target = target_history_scores(
        history.to(keys.device), keys, base.to(keys.device), cfg.target_heads, t_group, t_scale, at
    ).to(base.device)
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


def _select_from(cfg, history_all_heads, keys, s_draft, base, t_group, t_scale, at):
    """The selection ``cfg`` would make from the dense method's state (``None``: ``cfg`` reads densely)."""
    if all(dense_rows([at], cfg)):
        return None
    history = select_heads(history_all_heads[:, None], cfg.target_heads)[:, 0]
    return _select(history, cfg, keys, s_draft, base, t_group, t_scale, at)[0]
