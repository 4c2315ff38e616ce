"""Verification attention on one GPU: the best dense kernel against Dustin's sparse kernel.

One verification step of speculative decoding runs ``Q = gamma + 1`` new queries per sequence
through every layer. Dense verification reads the whole KV cache of every layer; Dustin reads a
budget of selected positions (plus the new tokens) and pays for scoring and selection once per step.
This script times, for each (model layout, batch, context):

* the copy bandwidth of the card (one large device-to-device copy, bytes read + written), the
  yardstick for a memory-bound kernel;
* dense kernels, each timed in the same run: PyTorch SDPA forced to its flash backend (bottom-right
  causal via ``causal_lower_right``; GQA native or with pre-expanded heads), the ``varlen`` backend
  (``seqused_k`` over the cache when this torch has it), flash-attn's ``flash_attn_with_kvcache`` if
  installed, and the Triton split-K kernel in dense mode;
* sparse kernels per budget: the fused Triton kernel over random sorted unique indices, and
  gather + varlen;
* :func:`selection_cost_ms`: scoring + selection from ``dustin_hf.experimental`` (the library's scoring and fill)
  (recorded as "not measured" when those cannot be called; never estimated).

Inputs are random (never zeros) in caches sized exactly to ``context + Q``; when one input set fits
in L2 the timed function rotates among several. ``sdpa_flash(expanded)`` materialises K/V with the
query head count once, outside the timing (G x the cache in memory, G x the bytes read).
Per kernel it reports time (median, L2 flushed between runs by ``triton.testing.do_bench``), the
bytes it must move (K and V of the attended positions, Q and the output), achieved GB/s and the
fraction of the copy bandwidth; each output's batch row 0 is checked against ``kernels/reference.py``.
Speedup per verification step = best dense x layers / (best sparse x layers + scoring + selection).

    python benchmarks/attention.py --out benchmarks/results/attention_h200.json
    python benchmarks/attention.py --smoke      # seconds, on CPU (reference + Triton interpreter)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import platform
import sys
import time
from typing import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel runs in the interpreter on CPU

import torch.nn.functional as F  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int


# ----------------------------------------------------------------------------- sweep constants
CONTEXTS = (8192, 16384, 32768, 65536)
BATCHES = (1, 8, 16)
LAYOUTS = (Layout("qwen2.5-7b", 28, 4, 128, 28), Layout("qwen2.5-72b", 64, 8, 128, 80))
DRAFT_LAYOUT = Layout("qwen2.5-0.5b", 14, 2, 64, 24)  # the draft whose attention scores positions
N_QUERIES = 5  # gamma + 1, gamma = 4 draft tokens
BUDGETS = (256, 512, 1024)
DTYPE = torch.bfloat16
L2_BYTES = 60 * 2**20  # H200; below this working set the inputs rotate among several buffers
MAX_ROTATION = 8
COPY_PROBE_BYTES = 2 * 2**30
WARMUP_MS, REP_MS = 25, 100
# --sweep-triton: every combination of these launch_config overrides (None = the heuristic's choice); merge is
# "ticket" (the last split merges, same launch) or "kernel" (a second launch), used only with splits.
# --sweep replaces TRITON_SWEEPS with one such dict per ';'-separated spec (the union of their products).
TRITON_SWEEP = dict(
    block_n=(16, 32, 64), num_splits=(None, 1, 2, 4, 8), num_stages=(3, 5, 7), num_warps=(4, 8), merge=(None,)
)
TRITON_SWEEPS = [TRITON_SWEEP]
CHECK_ATOL = 2e-2  # outputs vs kernels/reference.py (bf16); larger differences are flagged MISMATCH

SMOKE = dict(
    contexts=(96, 200),
    batches=(1, 2),
    layouts=(Layout("tiny", 4, 2, 16, 2),),
    draft=Layout("tiny-draft", 4, 2, 16, 4),
    budgets=(24, 40),
    dtype=torch.float16,  # interpreter: no bf16 dot
    copy_bytes=2**24,
)


class Unavailable(Exception):
    """A kernel that cannot run here; the message says why."""


# ----------------------------------------------------------------------------- timing and bandwidth


def _time_ms(fn: Callable[[], object], device: torch.device, timer: str) -> float:
    """Median milliseconds of ``fn`` after warm-up (GPU: ``do_bench`` or ``do_bench_cudagraph``)."""
    if device.type != "cuda":
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return sorted(samples)[1]
    import triton.testing

    if timer == "cudagraph":
        return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def measure_copy_bandwidth(device: torch.device, nbytes: int, timer: str) -> float:
    """GB/s of one large copy done by a kernel on the SMs, counting bytes read plus bytes written.

    Not ``dst.copy_(src)``: captured in a CUDA graph (the ``cudagraph`` timer) that becomes a memcpy node,
    which an H200 ran at 2775 GB/s where the same copy as a kernel, or ``copy_`` timed eagerly, ran at
    ~4260 GB/s (torch 2.11); attention kernels read through the SMs, so the kernel copy is their bound.
    """
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: torch.mul(src, 1.0, out=dst), device, timer)
    return 2 * nbytes / ms / 1e6


def _bytes_moved(layout: Layout, batch: int, n_keys: int, elt: int) -> int:
    """K and V rows of ``n_keys`` attended positions per (row, kv head), plus Q read and the output written."""
    kv = 2 * batch * n_keys * layout.n_kv_heads * layout.head_dim * elt
    return kv + 2 * batch * N_QUERIES * layout.n_heads * layout.head_dim * elt


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor  # (B, Q, Hq, D)
    k_cache: torch.Tensor  # (B, context + Q, Hkv, D); the Q new tokens already written at the end
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor  # (B,) int32, = context
    indices: dict[int, torch.Tensor]  # budget -> (B, budget) int32, sorted unique in [0, context)
    counts: dict[int, torch.Tensor]  # budget -> (B,) int32, the valid entries of each indices row (all of them)

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.cache_seqlens


def _make_inputs(layout, batch, context, budgets, device, dtype, gen) -> Inputs:
    """Random (never zero) data; the cache holds exactly ``context + Q`` positions."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    cache_shape = (batch, context + N_QUERIES, layout.n_kv_heads, layout.head_dim)
    q = randn(batch, N_QUERIES, layout.n_heads, layout.head_dim)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    indices = {}
    for budget in budgets:
        scores = torch.rand(batch, context, generator=gen, device=device)
        indices[budget] = scores.topk(min(budget, context), dim=1).indices.sort(dim=1).values.to(torch.int32)
    # made once here, as a decode step's selection makes them once for all layers: a tensor made inside the
    # timed call would add its fill kernel to every timed layer
    counts = {
        budget: torch.full((batch,), ids.shape[1], dtype=torch.int32, device=device) for budget, ids in indices.items()
    }
    return Inputs(q, randn(*cache_shape), randn(*cache_shape), seqlens, indices, counts)


def _rotation(layout, batch, context, elt) -> int:
    """Input sets to rotate among: several when one set's cache fits in L2, else one."""
    cache_bytes = 2 * batch * (context + N_QUERIES) * layout.n_kv_heads * layout.head_dim * elt
    return 1 if cache_bytes > L2_BYTES else min(MAX_ROTATION, max(2, math.ceil(2 * L2_BYTES / cache_bytes)))


def _rotating(sets: list[Inputs], call: Callable[[Inputs], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A no-argument function that runs ``call`` on the next input set each time."""
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % len(sets)
        return call(sets[state["i"]])

    return fn


# ----------------------------------------------------------------------------- kernels


def _scale(layout: Layout) -> float:
    return layout.head_dim**-0.5


def dense_kernels(layout: Layout, device: torch.device, sweep: bool) -> dict[str, Callable[[Inputs], torch.Tensor]]:
    """Dense baselines, name -> call(inputs) -> (B, Q, Hq, D); each may raise."""
    from dustin_hf.experimental import verify_attention_reference

    scale = _scale(layout)
    kernels = {}
    if device.type != "cuda":
        kernels["reference"] = lambda x: verify_attention_reference(*x.args(), softmax_scale=scale)
    kernels["sdpa_flash(gqa)"] = lambda x: _sdpa_flash(x, scale, expand_heads=False)
    kernels["sdpa_flash(expanded)"] = _sdpa_flash_expanded(scale)
    kernels[f"varlen[{_varlen_flavour()}]"] = lambda x: _varlen(x, scale, None, use_flash_attn=False)
    kernels["flash_attn_with_kvcache"] = lambda x: _flash_with_kvcache(x, scale)
    return kernels | _triton_variants(scale, None, sweep)


def sparse_kernels(layout: Layout, budget: int, sweep: bool) -> dict[str, Callable[[Inputs], torch.Tensor]]:
    scale = _scale(layout)
    return _triton_variants(scale, budget, sweep) | {
        "gather+varlen": lambda x: _varlen(x, scale, budget, use_flash_attn=False),
        "gather+flash_attn_varlen": lambda x: _varlen(x, scale, budget, use_flash_attn=True),
    }


def _triton_variants(scale: float, budget: int | None, sweep: bool) -> dict[str, Callable[[Inputs], torch.Tensor]]:
    """The Triton kernel with its heuristic config, plus every ``TRITON_SWEEPS`` combination if ``sweep``."""
    kernels = {"triton": functools.partial(_triton, scale=scale, budget=budget)}
    if sweep:
        combinations = [values for spec in TRITON_SWEEPS for values in itertools.product(*spec.values())]
        for values in dict.fromkeys(combinations):  # first occurrence of each, in order
            overrides = dict(zip(TRITON_SWEEP, values))
            label = ",".join(f"{key.replace('num_', '')}={value or 'auto'}" for key, value in overrides.items())
            kernels[f"triton[{label}]"] = functools.partial(_triton, scale=scale, budget=budget, overrides=overrides)
    return kernels


def _sdpa_flash(x: Inputs, scale: float, expand_heads: bool, kv=None) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q = x.q.transpose(1, 2)  # (B, Hq, Q, D)
    k, v = kv if kv is not None else (x.k_cache.transpose(1, 2), x.v_cache.transpose(1, 2))  # (B, H, T, D)
    mask = causal_lower_right(q.shape[2], k.shape[2])
    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=not expand_heads and q.shape[1] != k.shape[1]
        )
    return out.transpose(1, 2)


def _sdpa_flash_expanded(scale: float) -> Callable[[Inputs], torch.Tensor]:
    """SDPA on K/V heads expanded to the query heads; the expansion is made once, outside the timing."""
    expanded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def call(x: Inputs) -> torch.Tensor:
        if id(x) not in expanded:
            group = x.q.shape[2] // x.k_cache.shape[2]
            expanded[id(x)] = tuple(c.transpose(1, 2).repeat_interleave(group, dim=1) for c in (x.k_cache, x.v_cache))
        return _sdpa_flash(x, scale, expand_heads=True, kv=expanded[id(x)])

    return call


def _varlen(x: Inputs, scale: float, budget: int | None, use_flash_attn: bool) -> torch.Tensor:
    from dustin_hf.experimental import torch_varlen_available, verify_attention_varlen

    if not x.q.is_cuda:
        raise Unavailable("needs CUDA")
    if use_flash_attn and not _has_flash_attn():
        raise Unavailable("flash-attn not installed")
    if not use_flash_attn and not torch_varlen_available():
        raise Unavailable("torch.nn.attention.varlen.varlen_attn missing")
    sparse = {} if budget is None else {"indices": x.indices[budget], "num_indices": x.counts[budget]}
    return verify_attention_varlen(
        *x.args(), softmax_scale=scale, max_seqlen_k=x.k_cache.shape[1], use_flash_attn=use_flash_attn, **sparse
    )


def _flash_with_kvcache(x: Inputs, scale: float) -> torch.Tensor:
    if not x.q.is_cuda or not _has_flash_attn():
        raise Unavailable("flash-attn not installed" if x.q.is_cuda else "needs CUDA")
    from flash_attn import flash_attn_with_kvcache

    lengths = x.cache_seqlens + N_QUERIES  # flash-attn counts the new tokens in cache_seqlens
    return flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=lengths, softmax_scale=scale, causal=True)


def _triton(x: Inputs, scale: float, budget: int | None, overrides: dict | None = None) -> torch.Tensor:
    """The Triton kernel; ``overrides`` (launch keywords of its ``launch_config``) replace heuristic choices."""
    from dustin_hf.experimental import launch_config, sparse_loop_keys, verify_attention_triton

    sparse = {} if budget is None else {"indices": x.indices[budget], "num_indices": x.counts[budget]}
    max_seqlen_k = x.k_cache.shape[1]
    config = None
    if overrides:
        batch, n_queries, n_heads, head_dim = x.q.shape
        n_kv_heads = x.k_cache.shape[2]
        n_keys = max_seqlen_k if budget is None else sparse_loop_keys(x.indices[budget].shape[1], n_queries)
        config = launch_config(
            batch,
            n_kv_heads,
            n_heads // n_kv_heads,
            n_queries,
            head_dim,
            n_keys,
            sm_count(x.q.device),
            sparse=budget is not None,
            elem_bytes=x.q.element_size(),
            **overrides,
        )
    return verify_attention_triton(*x.args(), softmax_scale=scale, max_seqlen_k=max_seqlen_k, config=config, **sparse)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA: the Triton interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _varlen_flavour() -> str:
    """How the ``varlen`` backend runs dense mode with this torch: over the cache, or gathered first."""
    from dustin_hf.experimental import torch_varlen_flavour

    return torch_varlen_flavour()


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _reference_row0(x: Inputs, layout: Layout, budget: int | None) -> torch.Tensor:
    """``kernels/reference.py`` on batch row 0 only (its GQA path expands K/V heads: keep that small)."""
    from dustin_hf.experimental import verify_attention_reference

    row0 = [t[:1] for t in x.args()]
    sparse = {} if budget is None else {"indices": x.indices[budget][:1], "num_indices": x.counts[budget][:1]}
    return verify_attention_reference(*row0, softmax_scale=_scale(layout), max_seqlen_k=x.k_cache.shape[1], **sparse)


# ----------------------------------------------------------------------------- scoring + selection hook


def selection_cost_ms(
    layout: Layout,
    batch: int,
    context: int,
    budget: int,
    *,
    draft: Layout = DRAFT_LAYOUT,
    device: torch.device | None = None,
    dtype: torch.dtype = DTYPE,
    timer: str = "do_bench",
) -> dict:
    """Per-step cost of Dustin's scoring and selection, timed from the scoring and fill of ``dustin_hf.experimental``.

    Times nothing else: the target-history scores (one target layer, its default scoring heads), the
    draft-lookahead scores (the default draft layers/heads of ``draft``, gamma = Q - 1 queries) and
    ``select_positions`` over them, all with the Triton kernels on CUDA (PyTorch on CPU). If those names or the APIs
    this hook was written against are missing, returns ``{"status": "not measured: <why>"}`` with ``None`` times: no
    estimate is made.
    """
    device = device or torch.device("cuda")
    try:
        from dustin_hf.experimental import (  # noqa: F401
            draft_lookahead_scores,
            resolve,
            select_positions,
            target_history_scores,
        )
    except ImportError as error:
        return {"scoring_ms": None, "selection_ms": None, "status": f"not measured: {error}"}
    try:
        return _time_scoring_and_selection(layout, draft, batch, context, budget, device, dtype, timer)
    except (AttributeError, TypeError, ValueError) as error:  # API drift: report, never guess
        return {"scoring_ms": None, "selection_ms": None, "status": f"not measured: {type(error).__name__}: {error}"}


def _time_scoring_and_selection(layout, draft, batch, context, budget, device, dtype, timer) -> dict:
    step = ScoringStep.build(layout, draft, batch, context, budget, device, dtype)
    backend = "triton" if torch.device(device).type == "cuda" else "reference"  # scoring and selection alike
    score = lambda: (step.score_target(backend), step.score_draft(backend))  # noqa: E731
    target, drafted = score()
    select = lambda: step.select(target, drafted, backend)  # noqa: E731
    return {
        "scoring_ms": _time_ms(score, device, timer),
        "selection_ms": _time_ms(select, device, timer),
        "status": f"measured (draft layout {draft.name}, scoring and selection backend {backend})",
    }


@dataclasses.dataclass
class ScoringStep:
    """One verification step's scoring inputs: random keys, and kept queries on the default scoring heads
    (one target layer; the default draft layers/heads of ``draft``, gamma = Q - 1 queries per row)."""

    layout: Layout
    draft: Layout
    cfg: object  # dustin_hf.experimental.ResolvedConfig
    seqlens_host: list[int]
    seqlens: torch.Tensor  # (B,) int32, = context
    target_keys: torch.Tensor  # (B, context + Q, Hkv, D)
    history_q: torch.Tensor  # (B, len(target_heads), D)
    draft_keys: list[torch.Tensor]  # per draft scoring layer: (B, context + Q, Hkv_draft, D_draft)
    draft_q: list[torch.Tensor]  # per draft scoring layer: (B, gamma, len(heads), D_draft)

    @classmethod
    def build(cls, layout, draft, batch, context, budget, device, dtype) -> ScoringStep:
        from types import SimpleNamespace

        from dustin_hf import DustinConfig
        from dustin_hf.experimental import resolve

        def model(lay):
            return SimpleNamespace(
                num_hidden_layers=lay.n_layers, num_attention_heads=lay.n_heads, num_key_value_heads=lay.n_kv_heads
            )

        cfg = resolve(DustinConfig(budget=budget, min_context=min(2048, context)), model(layout), model(draft))
        capacity = context + N_QUERIES

        def randn(*shape):
            return torch.randn(*shape, device=device).to(dtype)

        return cls(
            layout,
            draft,
            cfg,
            [context] * batch,
            torch.full((batch,), context, dtype=torch.int32, device=device),
            randn(batch, capacity, layout.n_kv_heads, layout.head_dim),
            randn(batch, len(cfg.target_heads), layout.head_dim),
            [randn(batch, capacity, draft.n_kv_heads, draft.head_dim) for _ in cfg.draft_layers],
            [randn(batch, N_QUERIES - 1, len(h), draft.head_dim) for h in cfg.draft_heads],
        )

    def score_target(self, backend: str) -> torch.Tensor:
        from dustin_hf.experimental import target_history_scores

        lay = self.layout
        return target_history_scores(
            self.history_q,
            self.target_keys,
            self.seqlens,
            self.cfg.target_heads,
            lay.n_heads // lay.n_kv_heads,
            lay.head_dim**-0.5,
            max(self.seqlens_host),
            backend=backend,
        )

    def score_draft(self, backend: str) -> torch.Tensor:
        from dustin_hf.experimental import draft_lookahead_scores

        lay = self.draft
        return draft_lookahead_scores(
            self.draft_q,
            self.draft_keys,
            self.seqlens,
            self.cfg.draft_heads,
            lay.n_heads // lay.n_kv_heads,
            lay.head_dim**-0.5,
            max(self.seqlens_host),
            backend=backend,
        )

    def select(self, target: torch.Tensor, drafted: torch.Tensor, backend: str):
        from dustin_hf.experimental import select_positions

        return select_positions(
            self.seqlens_host,
            drafted,
            target,
            [True] * len(self.seqlens_host),
            self.cfg,
            lengths=self.seqlens,
            backend=backend,
        )


# ----------------------------------------------------------------------------- the sweep


def _measure(name, mode, call, sets, layout, batch, context, budget, n_keys, copy_gbps, device, timer, expected):
    """One result row: time, bytes, GB/s, fraction of copy bandwidth, max abs diff to the reference."""
    row = dict(layout=layout.name, batch=batch, context=context, budget=budget, mode=mode, kernel=name)
    try:
        out = call(sets[0])
        diff = (out[:1].float() - expected.float()).abs().max().item()  # batch row 0 vs the reference
        ms = _time_ms(_rotating(sets, call), device, timer)
    except Unavailable as why:
        return row | dict(ms=None, status=f"n/a: {why}")
    except Exception as error:  # a baseline that cannot express this problem: report the reason
        return row | dict(ms=None, status=f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
    nbytes = _bytes_moved(layout, batch, n_keys, sets[0].q.element_size())
    gbps = nbytes / ms / 1e6
    status = "ok" if diff <= CHECK_ATOL else f"MISMATCH (max abs diff {diff:.3g})"
    return row | dict(ms=ms, bytes=nbytes, gbps=gbps, frac_copy=gbps / copy_gbps, max_abs_diff=diff, status=status)


def _sweep_point(
    layout, batch, context, budgets, device, dtype, timer, copy_gbps, draft, gen, sweep_triton
) -> tuple[list, list]:
    """All kernels at one (layout, batch, context): result rows and per-budget speedup summaries."""
    n_sets = _rotation(layout, batch, context, torch.finfo(dtype).bits // 8)
    sets = [_make_inputs(layout, batch, context, budgets, device, dtype, gen) for _ in range(n_sets)]
    rows = []
    dense_ref = _reference_row0(sets[0], layout, None)
    for name, call in dense_kernels(layout, device, sweep_triton).items():
        rows.append(
            _measure(
                name,
                "dense",
                call,
                sets,
                layout,
                batch,
                context,
                None,
                context + N_QUERIES,
                copy_gbps,
                device,
                timer,
                dense_ref,
            )
        )
    del dense_ref
    ok_dense = [r for r in rows if r.get("status") == "ok" and r["kernel"] != "reference"] or [
        r for r in rows if r.get("status") == "ok"
    ]
    best_dense = min(ok_dense, key=lambda r: r["ms"]) if ok_dense else None
    summaries = []
    for budget in budgets:
        sparse_ref = _reference_row0(sets[0], layout, budget)
        sparse_rows = [
            _measure(
                name,
                "sparse",
                call,
                sets,
                layout,
                batch,
                context,
                budget,
                budget + N_QUERIES,
                copy_gbps,
                device,
                timer,
                sparse_ref,
            )
            for name, call in sparse_kernels(layout, budget, sweep_triton).items()
        ]
        rows += sparse_rows
        cost = selection_cost_ms(layout, batch, context, budget, draft=draft, device=device, dtype=dtype, timer=timer)
        summaries.append(_summary(layout, batch, context, budget, best_dense, sparse_rows, cost))
    return rows, summaries


def _summary(layout, batch, context, budget, best_dense, sparse_rows, cost) -> dict:
    ok = [r for r in sparse_rows if r.get("status") == "ok"]
    best_sparse = min(ok, key=lambda r: r["ms"]) if ok else None
    summary = dict(
        layout=layout.name,
        batch=batch,
        context=context,
        budget=budget,
        best_dense=best_dense and best_dense["kernel"],
        dense_ms=best_dense and best_dense["ms"],
        best_sparse=best_sparse and best_sparse["kernel"],
        sparse_ms=best_sparse and best_sparse["ms"],
        scoring_ms=cost.get("scoring_ms"),
        selection_ms=cost.get("selection_ms"),
        selection_status=cost.get("status"),
        speedup_attention=None,
        speedup_step=None,
    )
    if best_dense and best_sparse:
        dense_step = best_dense["ms"] * layout.n_layers
        summary["speedup_attention"] = best_dense["ms"] / best_sparse["ms"]
        if cost.get("scoring_ms") is not None and cost.get("selection_ms") is not None:
            sparse_step = best_sparse["ms"] * layout.n_layers + cost["scoring_ms"] + cost["selection_ms"]
            summary["speedup_step"] = dense_step / sparse_step
    return summary


def _print_rows(rows: list[dict]) -> None:
    width = max([26] + [len(r["kernel"]) + 2 for r in rows])
    print(
        f"{'layout':<13}{'B':>3}{'ctx':>7}{'budget':>7}  {'kernel':<{width}}{'ms':>10}{'GB/s':>10}{'%copy':>7}  status"
    )
    for r in rows:
        ms = f"{r['ms']:.4g}" if r.get("ms") is not None else "-"
        gbps = f"{r['gbps']:.4g}" if r.get("gbps") else "-"
        frac = f"{100 * r['frac_copy']:.0f}%" if r.get("frac_copy") else "-"
        budget = r["budget"] if r["budget"] is not None else "dense"
        print(
            f"{r['layout']:<13}{r['batch']:>3}{r['context']:>7}{budget:>7}  {r['kernel']:<{width}}{ms:>10}{gbps:>10}"
            f"{frac:>7}  {r['status']}"
        )


def _print_summaries(summaries: list[dict]) -> None:
    dense_w = max([24] + [len(str(s["best_dense"])) + 2 for s in summaries])
    sparse_w = max([16] + [len(str(s["best_sparse"])) + 2 for s in summaries])
    print(
        f"\n{'layout':<13}{'B':>3}{'ctx':>7}{'budget':>7}  {'best dense':<{dense_w}}{'best sparse':<{sparse_w}}"
        f"{'attn x':>8}{'step x':>8}  scoring+selection"
    )
    for s in summaries:
        attn = f"{s['speedup_attention']:.3g}" if s["speedup_attention"] else "-"
        step = f"{s['speedup_step']:.3g}" if s["speedup_step"] else "-"
        extra = (
            f"{s['scoring_ms']:.3f}+{s['selection_ms']:.3f} ms"
            if s["scoring_ms"] is not None
            else s["selection_status"]
        )
        print(
            f"{s['layout']:<13}{s['batch']:>3}{s['context']:>7}{s['budget']:>7}  {str(s['best_dense']):<{dense_w}}"
            f"{str(s['best_sparse']):<{sparse_w}}{attn:>8}{step:>8}  {extra}"
        )


def _versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "flash_attn"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return versions


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Sweeps CONTEXTS x BATCHES x LAYOUTS x BUDGETS (constants at the top of the file); "
        "prints a table, a speedup summary, then one JSON line.",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs in seconds on CPU (Triton interpreter)")
    parser.add_argument("--contexts", type=int, nargs="+", help=f"override CONTEXTS {CONTEXTS}")
    parser.add_argument("--batches", type=int, nargs="+", help=f"override BATCHES {BATCHES}")
    parser.add_argument("--budgets", type=int, nargs="+", help=f"override BUDGETS {BUDGETS}")
    parser.add_argument("--layouts", nargs="+", choices=[lay.name for lay in LAYOUTS], help="subset of LAYOUTS")
    parser.add_argument(
        "--timer",
        choices=("do_bench", "cudagraph"),
        default="do_bench",
        help="triton.testing.do_bench (L2 flushed per run; default) or do_bench_cudagraph "
        "(no launch overhead; kernels that sync with the host show as n/a)",
    )
    parser.add_argument(
        "--sweep-triton",
        action="store_true",
        help="also time the Triton kernel under every TRITON_SWEEP combination of block_n, num_splits, "
        "num_stages, num_warps, merge (many rows; narrow the sweep with --contexts etc.)",
    )
    parser.add_argument(
        "--sweep",
        metavar="SPEC",
        default=None,
        help="like --sweep-triton over the given values instead of TRITON_SWEEP, e.g. "
        "'block_n=32,64 num_splits=1,2,4 num_stages=5,7 num_warps=4 merge=ticket,kernel' "
        "(0 or auto = the heuristic, as is a key left out); several specs separated by ';' "
        "time the union of their combinations",
    )
    parser.add_argument("--out", help="save a JSON with the command line, GPU, versions, copy bandwidth and all rows")
    args = parser.parse_args(argv)
    if args.sweep:
        try:
            specs = parse_sweep(args.sweep, TRITON_SWEEP)
            TRITON_SWEEPS[:] = [dict.fromkeys(TRITON_SWEEP, (None,)) | spec for spec in specs]
        except ValueError as error:
            parser.error(str(error))
        args.sweep_triton = True
    return args


def parse_sweep(text: str, keys) -> list[dict[str, tuple]]:
    """``"key=v1,v2 key2=v3; key=v4"`` -> one ``{key: values}`` per ``;``-separated spec (``keys``: the
    accepted ones). A value is an int, a name (``merge=ticket``), or ``None`` for the heuristic's (0 or auto)."""
    specs = []
    for part in text.split(";"):
        spec = {}
        for item in part.split():
            key, _, values = item.partition("=")
            if key not in keys or not values:
                raise ValueError(f"--sweep: {item!r} is not key=v1,v2,... with a key from {list(keys)}")
            spec[key] = tuple(_sweep_value(v) for v in values.split(","))
        if spec:
            specs.append(spec)
    return specs


def _sweep_value(text: str) -> int | str | None:
    value = int(text) if text.lstrip("-").isdigit() else text
    return None if value in (0, "auto") else value


def main(argv=None) -> None:
    args = _parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        contexts, batches, layouts, budgets = SMOKE["contexts"], SMOKE["batches"], SMOKE["layouts"], SMOKE["budgets"]
        draft, dtype, copy_bytes = SMOKE["draft"], SMOKE["dtype"], SMOKE["copy_bytes"]
    else:
        if device.type != "cuda":
            sys.exit("the full sweep needs a CUDA GPU; use --smoke on CPU")
        contexts, batches, budgets, draft, dtype = CONTEXTS, BATCHES, BUDGETS, DRAFT_LAYOUT, DTYPE
        copy_bytes = COPY_PROBE_BYTES
        layouts = LAYOUTS if not args.layouts else tuple(lay for lay in LAYOUTS if lay.name in args.layouts)
    contexts, batches, budgets = args.contexts or contexts, args.batches or batches, args.budgets or budgets

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'unknown'})"
    copy_gbps = measure_copy_bandwidth(device, copy_bytes, args.timer)
    print(f"{gpu}: copy bandwidth {copy_gbps:.0f} GB/s (read + written, {copy_bytes / 2**30:.2f} GiB copy)\n")
    gen = torch.Generator(device=device).manual_seed(0)
    rows, summaries = [], []
    for layout in layouts:
        for batch in batches:
            for context in contexts:
                point_rows, point_summaries = _sweep_point(
                    layout,
                    batch,
                    context,
                    budgets,
                    device,
                    dtype,
                    args.timer,
                    copy_gbps,
                    draft,
                    gen,
                    args.sweep_triton,
                )
                rows += point_rows
                summaries += point_summaries
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    _print_rows(rows)
    _print_summaries(summaries)
    result = dict(
        command=" ".join([sys.executable] + sys.argv),
        gpu=gpu,
        versions=_versions(),
        copy_gbps=copy_gbps,
        dtype=str(dtype),
        n_queries=N_QUERIES,
        timer=args.timer,
        rows=rows,
        summaries=summaries,
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(dict(gpu=gpu, copy_gbps=round(copy_gbps, 1), summaries=summaries)))


if __name__ == "__main__":
    main()
