"""End-to-end decoding throughput: plain generate(), classic speculative decoding, Dustin, exact mode, the knob.

Target and draft have the real architectures (Qwen2.5-7B/32B/72B-Instruct and Qwen2.5-0.5B-Instruct,
configs written below) with random bf16 weights: speed does not depend on weight values. Everything
the GPU does is real (drafting, verification forwards, scoring, selection, cache work), with two
stand-ins, both printed with the results:

* each step's outcome is REPLAYED (:mod:`replay`): random weights make the draft's proposals meaningless.
  With ``--predictions`` (teacher-forced per-position predictions of the real Qwen2.5-Coder 1.5B/0.5B pair,
  ``benchmarks/traces/*_predictions_*.json``) every method's drafts kept, tentative tokens confirmed and
  confirmations come from the same recorded texts; without it the classic methods cycle the accepted counts
  of acceptance traces (``--trace-dense`` / ``--trace-dustin``) or a fixed pattern with the paper's mean of 2.2
  tokens per step. The quality knob's read-set sizes are replayed from recorded per-step budgets
  (``--knob-traces``), scaled to the context;
* prefill is REPLACED by filling the caches with random keys/values of the right shapes: the
  benchmark measures decoding at a given context; prefill costs the same for every method.

Methods, each timed in the same run:
  hf_dynamic   plain ``generate()`` with transformers' default cache (what users run today)
  hf_static    plain ``generate()`` with ``cache_implementation="static"`` (preallocated cache)
  spec_dense   classic batched speculative decoding, dense verification (dustin_hf's loop, no sparsity)
  dustin       the same loop with Dustin's sparse verification (``--budget``, 512)
  dustin_sparse_draft  Dustin whose draft also reads a selection (``DustinConfig(sparse_draft=True)``)
  spec_sparse_draft    lossless, MagicDec-style: the sparse draft, every verification dense
                       (``DustinConfig(mode="exact", confirm_tokens=0, sparse_draft=True)``)
  dustin_exact  exact mode at ``DustinConfig(mode="exact")``'s budget (2048) and confirm schedule, with the sparse
                draft; ``--exact-budget 2048 512`` adds a row per budget (``dustin_exact@512``), and the first budget
                is spec_sparse_draft's too
  dustin_select        dustin_sparse_draft with the selection layers (``selection="verify"``), replayed from the
                       traces recorded with them (``..._select.json``) when given, else from Dustin's set's (said)
  dustin_exact_select  dustin_exact with the selection layers, replayed from the ``..._select.json`` traces
  dustin_knob   Dustin + sparse draft with the quality knob (``min_recovery``), budgets replayed

Decode tokens/s counts the tokens every row commits after the first steps (compilation and CUDA
graph capture are excluded), over the host-clock time the loop took for them, until the last row has
its tokens; the steady rate counts only the steps before any row finished (every row committing),
since rows that finish early leave the batch's later steps partly idle. Plain ``generate()`` runs
``--baseline-runs`` times (default 3) and is rated by its median run (every run's rate is kept). A
profiling pass per speculative method splits a step into phases: by default from CUDA events on the GPU timeline (an
undisturbed step, idle stretches where the GPU waited for the host included; the host's own time
per phase beside it), or ``--profile-mode sync``, synchronising between phases (each phase's own cost).
The hardware bound per step is (weight bytes + KV bytes read) / the measured copy bandwidth, with the
positions each run's verifications actually read.

    python benchmarks/e2e.py --out benchmarks/results/e2e_h200.json          # one H200, 7B + 0.5B
    python benchmarks/e2e.py --pair 72b --batches 8 --out e2e_h200x2.json  # two H200s
    python benchmarks/e2e.py --smoke                                          # tiny, CPU, every method
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from replay import (
    AcceptReplay,
    BudgetReplay,
    CountReplay,
    ExactReplay,
    at_budget,
    load_budgets,
    load_predictions,
    synthetic_budgets,
    synthetic_predictions,
)
from transformers import StoppingCriteria

from dustin_hf import DustinConfig
from dustin_hf.experimental import CACHE_KWARG, DecodeHooks

# ----------------------------------------------------------------------------- sweep constants
CONTEXTS = (8192, 16384, 32768)
BATCHES = (1, 8, 16)
GAMMA = 4
BUDGET = 512
NEW_TOKENS = 256  # per row, speculative methods (--new-tokens)
AR_TOKENS = 24  # per row, plain generate() (slow at long context)
WARMUP_STEPS = 3  # decode steps excluded from the rate (compilation, graph capture)
METHODS = (
    "spec_dense",
    "dustin",
    "dustin_sparse_draft",
    "dustin_select",
    "spec_sparse_draft",
    "dustin_exact",
    "dustin_exact_select",
    "dustin_knob",
    "hf_dynamic",
    "hf_static",
)
DEFAULT_METHODS = ("spec_dense", "dustin", "dustin_sparse_draft", "hf_dynamic", "hf_static")
# the methods that replay from per-position predictions only (exact mode's outcomes, the knob's step)
PREDICTED_ONLY = ("spec_sparse_draft", "dustin_exact", "dustin_exact_select", "dustin_knob")
# --smoke: tiny models on the CPU at contexts past a small budget, so that every sparse path runs
SMOKE_CONTEXTS, SMOKE_BUDGET, SMOKE_TOKENS = (96, 160), 32, 48
# Run order: plain generate() first, in the fresh process's memory state a user's generate() runs in; the
# static cache last (it may compile). generate()'s dynamic cache concatenates every layer's K/V each token
# (tens of GB at 32k), and its speed depends on what the caching allocator holds: 72B over two H200s,
# 32k, batch 8, it read 31.1 and 40.0 tok/s as a process's first run and 41.8 to 47.2 after the
# speculative runs, so compare ratios against it with that spread.
RUN_ORDER = (
    "hf_dynamic",
    "spec_dense",
    "dustin",
    "dustin_sparse_draft",
    "dustin_select",
    "spec_sparse_draft",
    "dustin_exact",
    "dustin_exact_select",
    "dustin_knob",
    "hf_static",
)
# transformers compiles the forward for static caches (a fresh compile per batch/context shape, minutes
# each at these sizes); --compile-static turns that on, the default measures the static cache eagerly.
COMPILE_STATIC = False

QWEN = dict(
    rope_theta=1e6,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SHAPES = {  # Qwen2.5-*-Instruct config.json values that set the cost
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "32b": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "72b": dict(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    "tiny-draft": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}


# ----------------------------------------------------------------------------- models
def build_model(
    size: str,
    devices: list[torch.device],
    dtype: torch.dtype,
    layers: int | None = None,
    vocab_size: int | None = None,
):
    """A Qwen2 causal LM with ``size``'s shapes and random weights, its layers split evenly over ``devices``;
    ``layers``: only that many decoder layers (a slice of the model, e.g. one pipeline stage's share);
    ``vocab_size``: another embedding size (a draft padded to its target's, so generate() needs no tokenizers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    overrides = ({"num_hidden_layers": layers} if layers else {}) | ({"vocab_size": vocab_size} if vocab_size else {})
    config = Qwen2Config(**QWEN, **(SHAPES[size] | overrides))
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    n_layers = config.num_hidden_layers
    placement = {"model.embed_tokens": devices[0], "model.norm": devices[-1], "lm_head": devices[-1]}
    for i in range(n_layers):
        placement[f"model.layers.{i}"] = devices[i * len(devices) // n_layers]
    for name, device in placement.items():
        model.get_submodule(name).to_empty(device=device)
    for param in model.parameters():
        param.data.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(
        devices[0]
    )  # a real inv_freq, not to_empty garbage
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    if len(devices) > 1:
        from accelerate import dispatch_model

        device_map = {name: device.index for name, device in placement.items()}
        device_map["model.rotary_emb"] = devices[0].index
        model = dispatch_model(model, device_map=device_map)
    return model


def pair_name(size: str, layers: int | None) -> str:
    """``size``, or for a slice of its layers ``"72b (PROXY: 40 of 80 layers)"``."""
    total = SHAPES[size]["num_hidden_layers"]
    return size if layers in (None, total) else f"{size} (PROXY: {layers} of {total} layers)"


def layer_device(model, layer: int) -> torch.device:
    return model.model.layers[layer].self_attn.k_proj.weight.device


def random_kv(model, batch: int, length: int, layer: int, dtype: torch.dtype):
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    shape = (batch, cfg.num_key_value_heads, length, head_dim)
    device = layer_device(model, layer)
    return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)


# ----------------------------------------------------------------------------- methods and their replays
@dataclass(frozen=True)
class Method:
    """One speculative method as the benchmark runs it: its Dustin settings and what replays its outcomes."""

    name: str
    config: DustinConfig | None  # None: dense verification (classic speculative decoding)
    replays: tuple  # replay objects (module ``replay``), each giving some DecodeHooks fields

    def hooks(self, **fields) -> DecodeHooks:
        """Fresh hooks for one run: each replay's (new state per run) and ``fields`` (prefill, profile)."""
        for replay in self.replays:
            fields.update(replay.hooks())
        return DecodeHooks(**fields)

    @property
    def acceptance(self) -> str:
        """What is replayed, in words (printed and saved with the results)."""
        return "; ".join(replay.source for replay in self.replays)


@dataclass(frozen=True)
class Sources:
    """Where the methods' replayed outcomes come from, and the budgets the methods run at.

    ``predictions``: per-position predictions of the real pair (``None``: the classic methods cycle ``counts``,
    acceptance counts, and the methods in ``PREDICTED_ONLY`` cannot run); ``knob``: the knob traces' paths,
    loaded per context (``None`` with ``synthetic``: SYNTHETIC budgets); ``budget``: dustin's and
    dustin_sparse_draft's; ``exact_budgets``: exact mode's, one dustin_exact row each
    (``DustinConfig(mode="exact").budget`` unless overridden), the first also spec_sparse_draft's draft reads."""

    predictions: list | None
    counts: dict
    knob: list[str] | None
    knob_target: float | None
    budget: int
    exact_budgets: tuple[int, ...]
    synthetic: bool = False
    confirm: tuple[int, int] | None = None  # exact mode's (confirm_tokens, confirm_every); None: DustinConfig()'s

    @property
    def exact_budget(self) -> int:
        return self.exact_budgets[0]

    def method(self, name: str, context: int, exact_budget: int | None = None) -> Method:
        """``name``'s settings and replays at ``context`` (dustin_exact: at ``exact_budget``, default the first)."""
        plain = DustinConfig(
            budget=self.budget,
            selection="dustin",  # Dustin's set; the _select methods name theirs
            min_context=min(DustinConfig().min_context, context),
        )
        if name == "spec_dense":
            return Method(name, None, (self._accept(name, "draft", "dense"),))
        if name == "dustin":
            return Method(name, plain, (self._accept(name, "draft", "sparse"),))
        if name == "dustin_sparse_draft":
            return Method(name, plain.replace(sparse_draft=True), (self._accept(name, "draft_sparse", "sparse"),))
        if name == "dustin_select":
            config = plain.replace(sparse_draft=True, selection="verify")
            return Method(name, config, (self._accept_select(),))
        if self.predictions is None:
            raise ValueError(
                f"{name} replays exact mode's or the knob's outcomes from per-position predictions: pass "
                "--predictions benchmarks/traces/*_predictions_*.json"
            )
        exact = plain.replace(budget=exact_budget or self.exact_budget, mode="exact", sparse_draft=True)
        if self.confirm is not None:
            exact = exact.replace(confirm_tokens=self.confirm[0], confirm_every=self.confirm[1])
        if name in ("spec_sparse_draft", "dustin_exact", "dustin_exact_select"):
            config = exact.replace(confirm_tokens=0) if name == "spec_sparse_draft" else exact
            if name == "dustin_exact_select":
                config = config.replace(selection="verify")
            width = config.confirm_tokens + 2 * GAMMA + 2  # the most tentative tokens a row holds, with room
            return Method(
                name,
                config,
                (
                    ExactReplay(
                        at_budget(self.predictions, config.budget, config.selection), "draft_sparse", GAMMA, width
                    ),
                ),
            )
        if name == "dustin_knob":
            budgets = self._budgets(context)
            config = plain.replace(
                budget=budgets.floor, min_recovery=budgets.min_recovery, max_budget=budgets.ceiling, sparse_draft=True
            )
            accept = AcceptReplay(
                at_budget(self.predictions, budgets.floor),
                "draft_sparse",
                "sparse",
                GAMMA,
                note=" (the sparse target at the knob's floor: the knob's read sets hold at least as many positions)",
            )
            return Method(name, config, (accept, budgets))
        raise ValueError(f"not a speculative method: {name!r}")

    def _accept(self, name: str, draft: str, verifier: str):
        if self.predictions is None:
            return self.counts[name]
        return AcceptReplay(at_budget(self.predictions, self.budget), draft, verifier, GAMMA)

    def _accept_select(self):
        """dustin_select's acceptance: from the traces recorded with the selection layers (``..._select.json``) at
        the budget; without any, Dustin's set's (the sparse draft's), which the replay's source then says."""
        if self.predictions is not None and any(t.selection == "verify" for t in self.predictions):
            return AcceptReplay(at_budget(self.predictions, self.budget, "verify"), "draft_sparse", "sparse", GAMMA)
        note = " (Dustin's set's acceptance: no trace recorded with the selection layers given)"
        if self.predictions is None:
            counts = self.counts["dustin_sparse_draft"]
            return CountReplay(counts.counts, counts.source + note)
        return AcceptReplay(at_budget(self.predictions, self.budget), "draft_sparse", "sparse", GAMMA, note=note)

    def _budgets(self, context: int) -> BudgetReplay:
        if self.knob:
            return load_budgets(self.knob, context, self.knob_target)
        if self.synthetic:
            return synthetic_budgets(context, self.budget, min(context, 2 * self.budget))
        raise ValueError(
            "dustin_knob replays recorded knob budgets: pass --knob-traces benchmarks/traces/*_knob_*.json"
        )


# ----------------------------------------------------------------------------- methods
class _Clock(StoppingCriteria):
    """A stopping criterion that only records when each token was produced (generate() syncs every step)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf(target, batch: int, context: int, static: bool, dtype) -> dict:
    """Plain generate() from a cache already holding ``context - 1`` random positions."""
    from transformers import DynamicCache, StaticCache, StoppingCriteriaList

    _release_memory()  # each run starts by freeing what earlier runs left
    cfg = target.config
    n_new = AR_TOKENS
    if static:
        cache = StaticCache(config=cfg, max_cache_len=context + n_new + 1)
    else:
        cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        k, v = random_kv(target, batch, context - 1, layer, dtype)
        cache.update(k, v, layer)
        del k, v
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device=target.get_input_embeddings().weight.device)
    clock = _Clock()
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **{CACHE_KWARG: cache},
        max_new_tokens=n_new,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([clock]),
        disable_compile=not COMPILE_STATIC,
    )
    times = clock.times[WARMUP_STEPS:]
    seconds = times[-1] - times[0]
    tokens = batch * (len(times) - 1)
    return dict(
        tokens_per_s=tokens / seconds,
        seconds=seconds,
        tokens=tokens,
        steps=len(times) - 1,
        tokens_per_step=1.0,
        peak_gib=_peak_gib(),
        steady_tokens_per_s=tokens / seconds,
    )


def run_hf_repeated(target, batch: int, context: int, static: bool, dtype, runs: int) -> dict:
    """:func:`run_hf` once to warm up, then ``runs`` times: the run with the median rate, and every rate.

    The first ``generate()`` at a shape is not a fair baseline: on the H200 (7B, batch 16) it ran at 212
    tok/s at 32k where the two after it read 508 and 509, and at 288 at 16k after the 8k runs (then 784),
    so the warm-up run is timed but not rated (its rate is kept as ``warmup_tokens_per_s``). Later runs
    with the default dynamic cache still vary with the allocator's state (the cache re-concatenates
    every layer's K/V each token); the speedups use the median run.
    """
    warmup = run_hf(target, batch, context, static, dtype)
    results = sorted(
        (run_hf(target, batch, context, static, dtype) for _ in range(runs)), key=lambda r: r["tokens_per_s"]
    )
    median = dict(results[(len(results) - 1) // 2])  # the lower middle for an even count
    median["runs_tokens_per_s"] = [r["tokens_per_s"] for r in results]
    median["warmup_tokens_per_s"] = warmup["tokens_per_s"]
    peaks = [r["peak_gib"] for r in results if r["peak_gib"] is not None]  # None off CUDA
    median["peak_gib"] = max(peaks) if peaks else None
    return median


def _random_prefill(dtype):
    """A stand-in for ``ModelRunner.prefill``: random keys/values in every row's slots, random last logits/queries."""

    def prefill(runner, rows, chunk, capture):
        cache = runner.cache
        model = runner.model
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        lengths = [r.numel() for r in rows]
        for layer_idx, layer in enumerate(cache.layers):
            device = layer_device(model, layer_idx)
            if not layer.is_initialized:
                fake = torch.zeros(cache.batch_size, cfg.num_key_value_heads, 0, head_dim, device=device, dtype=dtype)
                layer.lazy_initialization(fake, fake)
            keys, values = layer.buffers()
            keys[:, : max(lengths)].normal_()
            values[:, : max(lengths)].normal_()
        cache.advance(slice(0, len(rows)), lengths)
        device = runner.device
        last = [torch.randn(cfg.vocab_size, device=device) for _ in rows]
        kept = [
            {
                layer: torch.randn(1, 1, len(heads), head_dim, device=layer_device(model, layer), dtype=dtype)
                for layer, heads in capture.items()
            }
            for _ in rows
        ]
        return last, kept

    return prefill


def run_speculative(
    target,
    draft,
    batch: int,
    context: int,
    method: Method,
    dtype,
    new_tokens: int = NEW_TOKENS,
    profile: bool | str = False,
    torch_trace: str | None = None,
    tuning=None,
) -> dict:
    from transformers import GenerationConfig

    from dustin_hf.experimental import Drafting, RuntimeOptions, SpeculativeDecoder, attention_routed, resolve

    _release_memory()  # an earlier run's cache (in reference cycles with its CUDA graphs) must not linger
    config = GenerationConfig(do_sample=False, max_length=context + new_tokens, pad_token_id=0)
    resolved = None if method.config is None else resolve(method.config, target.config, draft.config)
    decoder = SpeculativeDecoder(
        target,
        draft,
        config,
        dustin_config=resolved,
        drafting=Drafting(GAMMA),
        runtime=RuntimeOptions(tuning=tuning),
        hooks=method.hooks(prefill=_random_prefill(dtype), profile=profile),
    )
    ids = torch.randint(
        0, draft.config.vocab_size, (batch, context), device=target.get_input_embeddings().weight.device
    )
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    if torch_trace:
        _trace_steps(decoder, torch_trace)
    with attention_routed(target, draft):
        result = decoder.generate(ids)
    stats = result.stats.as_dict()
    ends, committed = stats["step_end_times"], stats["step_tokens"]
    steps = range(WARMUP_STEPS, len(ends))
    tokens = sum(committed[i] for i in steps)
    seconds = ends[-1] - ends[WARMUP_STEPS - 1]
    # the warm-up steps' time: the generate() call's CUDA-graph captures (made per call) and, in the process's
    # first run of a shape, kernel compilation; a user pays it once per call, the rate above leaves it out
    out = dict(
        tokens_per_s=tokens / seconds,
        seconds=seconds,
        warmup_seconds=ends[WARMUP_STEPS - 1],
        tokens=tokens,
        steps=len(steps),
        tokens_per_step=tokens / len(steps) / batch,
        peak_gib=_peak_gib(),
        graphs=stats["cuda_graphs"],
        backend=decoder.backend,
        sparse_steps=stats["sparse_steps"],
        dense_steps=stats["dense_steps"],
        mean_attended=stats["mean_attended"],
    )
    for report in ("exact", "knob"):  # exact mode's confirmations, the knob's realised budgets
        if report in stats:
            out[report] = stats[report]
    # Steady state: the steps before any row reached its token limit (every row committing its replayed
    # count). Later steps cost the same (fixed shapes) while finished rows commit nothing, so the
    # all-steps rate above depends on how unevenly the replayed counts land on the rows.
    full = next((i for i, (_, rows) in enumerate(result.stats.trace) if -1 in rows), len(ends))
    full = min(full, len(ends)) - 1  # the step before the first one with a finished row may have cut a row
    if full > WARMUP_STEPS:
        steady = sum(committed[i] for i in range(WARMUP_STEPS, full))
        out["steady_tokens_per_s"] = steady / (ends[full - 1] - ends[WARMUP_STEPS - 1])
        out["steady_steps"] = full - WARMUP_STEPS
        out["steady_tokens_per_step"] = steady / out["steady_steps"] / batch
    if profile:  # steps after the warm-up ones (the first steps compile kernels and capture graphs)
        timed = stats["phase_seconds"][WARMUP_STEPS:]
        out["phase_ms_per_step"] = _mean_ms(timed)
        out["host_ms_per_step"] = _mean_ms(stats["phase_host_seconds"][WARMUP_STEPS:])
    return out


def _mean_ms(steps: list[dict[str, float]]) -> dict[str, float]:
    return {k: 1e3 * sum(step.get(k, 0.0) for step in steps) / len(steps) for k in steps[0]}


def _trace_steps(decoder, path: str, steps: int = 8) -> None:
    """Record ``steps`` decode steps (``decoder.decode_step``, wrapped on the instance) after the warm-up ones with
    torch.profiler; save a gzipped Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    step, done = decoder.decode_step, [0]

    def traced(run):
        if done[0] == WARMUP_STEPS:
            prof.start()
        step(run)
        done[0] += 1
        if done[0] == WARMUP_STEPS + steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.stop()
            prof.export_chrome_trace(path.removesuffix(".gz"))
            import gzip
            import shutil

            with open(path.removesuffix(".gz"), "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            Path(path.removesuffix(".gz")).unlink()

    decoder.decode_step = traced  # this decoder instance only


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return sum(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**30


# ----------------------------------------------------------------------------- hardware bound
def param_bytes(model) -> int:
    """Bytes of the weights one forward reads: every parameter once, except an input embedding table not
    tied to the head (a forward gathers a few of its rows, not the table)."""
    embedding = model.get_input_embeddings().weight
    skip = {embedding.data_ptr()} - {model.get_output_embeddings().weight.data_ptr()}
    seen, total = set(skip), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_position(model, elt: int = 2) -> int:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * elt  # K and V, all layers


def step_bound_ms(
    method: Method | None, row: dict, target, draft, batch: int, context: int, copy_gbps: float
) -> float:
    """Fewest bytes one step must read (weights once per forward, KV it attends), over copy bandwidth.

    ``method``: ``None`` for plain ``generate()``; a speculative method's verifications read what its run
    measured (``row``: the mean positions of its sparse steps, every position on its dense ones), and a sparse
    draft reads the last selection plus the positions written since."""
    t_w, d_w = param_bytes(target), param_bytes(draft)
    t_kv, d_kv = kv_bytes_per_position(target), kv_bytes_per_position(draft)
    if method is None:
        return (t_w + batch * context * t_kv) / copy_gbps / 1e6
    cfg = method.config
    sparse, dense = row.get("sparse_steps", 0), row.get("dense_steps", 0)
    read = (sparse * row.get("mean_attended", 0.0) + dense * context) / max(sparse + dense, 1)
    if cfg is not None and cfg.sparse_draft:
        draft_attended = (row["mean_attended"] if sparse else cfg.budget) + 2 * GAMMA + 1
    else:
        draft_attended = context + 1
    total = GAMMA * (d_w + batch * draft_attended * d_kv) + t_w + batch * (read + GAMMA + 1) * t_kv
    if cfg is not None:  # scoring: one target layer and three draft layers' keys of one KV head
        t_cfg, d_cfg = target.config, draft.config
        total += (
            batch
            * context
            * 2
            * (t_cfg.hidden_size // t_cfg.num_attention_heads + 3 * d_cfg.hidden_size // d_cfg.num_attention_heads)
        )
    return total / copy_gbps / 1e6


def measure_copy_gbps(device: torch.device) -> float:
    src = torch.randn(2**28, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 20 * 2 * src.numel() * 4 / (time.perf_counter() - start) / 1e9


# ----------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--pair", default="7b", choices=("7b", "32b", "72b"), help="target size (draft: 0.5b)")
    parser.add_argument("--devices", type=int, default=None, help="GPUs to split the target over (default: all)")
    parser.add_argument(
        "--target-layers",
        type=int,
        default=None,
        metavar="N",
        help="build the target with only N decoder layers (a PROXY, said in the output's pair: "
        "e.g. --pair 72b --target-layers 40 --devices 1 is one of two pipeline stages, to "
        "profile a stage on one GPU); ratios against generate() then describe the slice, "
        "not the model",
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=DEFAULT_METHODS,
        choices=METHODS,
        help=f"default: {' '.join(DEFAULT_METHODS)}; {', '.join(PREDICTED_ONLY)} need --predictions",
    )
    parser.add_argument(
        "--budget", type=int, default=None, help=f"dustin's fixed budget (default {BUDGET}, --smoke {SMOKE_BUDGET})"
    )
    parser.add_argument(
        "--exact-budget",
        type=int,
        nargs="+",
        default=None,
        help="exact mode's budget (dustin_exact's sparse steps and draft reads; the first also "
        "spec_sparse_draft's draft reads); several: one dustin_exact@BUDGET row each, in the same "
        "run; default: DustinConfig(mode='exact')'s (2048), printed",
    )
    parser.add_argument(
        "--confirm",
        type=int,
        nargs=2,
        default=None,
        metavar=("TOKENS", "EVERY"),
        help="dustin_exact's confirm_tokens and confirm_every; default: DustinConfig()'s, printed",
    )
    parser.add_argument(
        "--predictions",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="per-position predictions of the real pair (benchmarks/traces/*_predictions_*.json, "
        "dustin_hf.prediction_trace/1): every method replays its outcomes from them, each from "
        "the files recorded at its budget",
    )
    parser.add_argument(
        "--knob-traces",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="the knob's recorded per-step budgets (benchmarks/traces/*_knob_*.json, "
        "dustin_hf.knob_trace/1), replayed by dustin_knob scaled to the context",
    )
    parser.add_argument(
        "--knob-target",
        type=float,
        default=None,
        help="use the knob traces recorded at this min_recovery (default: DustinConfig()'s if set, "
        "else the one target the traces share)",
    )
    parser.add_argument(
        "--trace-dense",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="without --predictions: acceptance traces (benchmarks/traces/*_dense.json) replayed by "
        "spec_dense; default: the paper's mean",
    )
    parser.add_argument(
        "--trace-dustin",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="without --predictions: acceptance traces (benchmarks/traces/*_dustin_b512.json) "
        "replayed by dustin; default: the paper's mean",
    )
    parser.add_argument(
        "--trace-dustin-sparse-draft",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="without --predictions: acceptance traces replayed by dustin_sparse_draft; default: the "
        "--trace-dustin traces, which is said in the output",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help=f"tokens per row for the speculative methods (default {NEW_TOKENS}, --smoke "
        f"{SMOKE_TOKENS}); the all-steps rate includes the tail where rows that finished early "
        "idle, which weighs less the more tokens each row makes",
    )
    parser.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the per-phase profiling pass (run at the largest batch of each context)",
    )
    parser.add_argument(
        "--profile-mode",
        choices=("events", "sync"),
        default="events",
        help="phases from CUDA events on the GPU timeline of undisturbed steps (default), or with "
        "the device synchronised between phases (each phase's own cost; CPU runs use sync)",
    )
    parser.add_argument(
        "--compile-static",
        action="store_true",
        help="let transformers compile hf_static's forward (recompiles per shape; slow)",
    )
    parser.add_argument(
        "--torch-trace",
        default=None,
        metavar="DIR",
        help="also record 8 decode steps of each speculative run with torch.profiler "
        "(DIR/<method>_<context>_<batch>.json.gz, Chrome trace format)",
    )
    parser.add_argument(
        "--baseline-runs",
        type=int,
        default=3,
        metavar="N",
        help="run plain generate() (hf_dynamic, hf_static) once to warm up, then N times, and rate "
        "it by the median of the N runs; all rates are kept in the row (default 3)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny models on CPU at contexts {list(SMOKE_CONTEXTS)}, budget {SMOKE_BUDGET}, batch 2 (unless "
        "--contexts / --batches / --budget say otherwise); given no "
        "traces at all, every method replays SYNTHETIC ones (checks the script)",
    )
    parser.add_argument("--out", default=None, help="save the results JSON here")
    parser.add_argument("--plot", default=None, help="save a PNG of tokens/s vs context (largest batch) here")
    return parser


def sources(args, parser=None) -> Sources:
    """The replays' inputs and the methods' budgets from the command line (``--smoke``: SYNTHETIC by default)."""
    fail = parser.error if parser is not None else _raise
    if (args.trace_dense is None) != (args.trace_dustin is None):
        fail("pass --trace-dense and --trace-dustin together (or neither, for the paper's mean)")
    counts = {
        "spec_dense": CountReplay.load(args.trace_dense, GAMMA),
        "dustin": CountReplay.load(args.trace_dustin, GAMMA),
    }
    counts["dustin_sparse_draft"] = CountReplay.load(args.trace_dustin_sparse_draft or args.trace_dustin, GAMMA)
    if args.trace_dustin_sparse_draft is None:
        counts["dustin_sparse_draft"] = CountReplay(
            counts["dustin_sparse_draft"].counts,
            counts["dustin_sparse_draft"].source + " (Dustin's traces: the sparse draft's own acceptance not given)",
        )
    predictions = load_predictions(args.predictions, GAMMA) if args.predictions else None
    budget = args.budget if args.budget is not None else SMOKE_BUDGET if args.smoke else BUDGET
    synthetic = args.smoke and predictions is None and args.trace_dense is None  # nothing recorded given
    if synthetic:
        predictions = [
            synthetic_predictions(gamma=GAMMA, budget=budget, selection=selection)
            for selection in ("dustin", "verify")
        ]
    exact_budgets = tuple(args.exact_budget or (budget if args.smoke else DustinConfig(mode="exact").budget,))
    knob_target = args.knob_target if args.knob_target is not None else DustinConfig().min_recovery
    return Sources(
        predictions,
        counts,
        args.knob_traces,
        knob_target,
        budget,
        exact_budgets,
        synthetic=synthetic,
        confirm=None if args.confirm is None else tuple(args.confirm),
    )


def _raise(message: str):
    raise ValueError(message)


def main(argv=None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.baseline_runs < 1:
        parser.error(f"--baseline-runs must be at least 1, got {args.baseline_runs}")
    if args.target_layers is not None and not 1 <= args.target_layers <= SHAPES[args.pair]["num_hidden_layers"]:
        parser.error(
            f"--target-layers must be 1..{SHAPES[args.pair]['num_hidden_layers']} for {args.pair}, "
            f"got {args.target_layers}"
        )

    global COMPILE_STATIC
    COMPILE_STATIC = args.compile_static
    dtype = torch.bfloat16
    if args.smoke:
        devices, sizes = [torch.device("cpu")], ("tiny", "tiny-draft")
        if args.contexts == CONTEXTS:
            args.contexts = list(SMOKE_CONTEXTS)
        if args.batches == BATCHES:  # tiny rows; an explicit --batches still holds (a replay's outcomes at batch 16)
            args.batches = [2]
        dtype = torch.float32
        args.methods = [m for m in args.methods if m != "hf_static"]
    else:
        n = args.devices or torch.cuda.device_count()
        devices, sizes = [torch.device(f"cuda:{i}") for i in range(n)], (args.pair, "0.5b")
    new_tokens = args.new_tokens or (SMOKE_TOKENS if args.smoke else NEW_TOKENS)
    plan = sources(args, parser)
    defaults = DustinConfig()
    confirm = plan.confirm or (defaults.confirm_tokens, defaults.confirm_every)
    exact_source = (
        'DustinConfig(mode="exact") defaults'
        + (", budget from --exact-budget" if args.exact_budget else ", --smoke's budget" if args.smoke else "")
        + (", schedule from --confirm" if plan.confirm else "")
    )
    print(
        f"exact mode ({exact_source}): budget {', '.join(map(str, plan.exact_budgets))}, "
        f"confirm_tokens {confirm[0]}, "
        f"confirm_every {confirm[1]}",
        flush=True,
    )
    # every method at every context before any model is built: a missing trace fails in seconds, not minutes
    try:
        methods = {
            (name, context): _variants(plan, name, context)
            for name in args.methods
            if not name.startswith("hf")
            for context in args.contexts
        }
    except ValueError as error:  # a trace missing or recorded at another budget
        parser.error(str(error))
    torch.manual_seed(0)
    layers = None if args.smoke else args.target_layers
    target = build_model(sizes[0], devices, dtype, layers)
    draft = build_model(sizes[1], devices[:1], dtype)
    if layers:
        print(f"target: {pair_name(sizes[0], layers)}; every rate below is the slice's, not the model's")
    import dustin_hf

    dustin_hf.patch(target)  # registers the "dustin" attention, as a user's one line does
    copy_gbps = measure_copy_gbps(devices[0]) if devices[0].type == "cuda" else 1.0
    profile_mode = args.profile_mode if devices[0].type == "cuda" else "sync"

    rows = []
    for name in sorted(args.methods, key=RUN_ORDER.index):  # method-major, in RUN_ORDER
        for context in args.contexts:
            for batch, (label, method) in itertools.product(
                args.batches, methods.get((name, context), [(name, None)])
            ):
                row = dict(method=label, context=context, batch=batch)
                try:
                    if method is None:
                        row.update(
                            run_hf_repeated(target, batch, context, name == "hf_static", dtype, args.baseline_runs)
                        )
                    else:
                        row.update(
                            _run_method(
                                target,
                                draft,
                                batch,
                                context,
                                method,
                                dtype,
                                new_tokens,
                                args,
                                profile_mode if batch == max(args.batches) else None,
                            )
                        )
                    bound_ms = step_bound_ms(method, row, target, draft, batch, context, copy_gbps)
                    row["bound_tokens_per_s"] = batch * row["tokens_per_step"] / (bound_ms / 1e3)
                    row["fraction_of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
                except torch.OutOfMemoryError as error:
                    where = traceback.extract_tb(error.__traceback__)[-3:]
                    row["error"] = f"out of memory: {str(error).splitlines()[0]} at " + " <- ".join(
                        f"{Path(f.filename).name}:{f.lineno}" for f in reversed(where)
                    )
                    row.pop("tokens_per_s", None)  # a later pass of this row failed: no partial result
                rows.append(row)
                _print_row(row)
    _add_ratios(rows)
    acceptance = {}
    for variants in methods.values():
        for label, method in variants:
            acceptance.setdefault(label, method.acceptance)
    result = dict(
        command=" ".join([Path(sys.executable).name] + sys.argv),
        pair=f"{pair_name(sizes[0], layers)} + {sizes[1]}",
        gpus=[torch.cuda.get_device_name(d) for d in devices] if devices[0].type == "cuda" else ["cpu"],
        versions=_versions(),
        copy_gbps=copy_gbps,
        gamma=GAMMA,
        budget=plan.budget,
        exact_mode=dict(
            budget=list(plan.exact_budgets), confirm_tokens=confirm[0], confirm_every=confirm[1], source=exact_source
        ),
        new_tokens={"speculative": new_tokens, "generate": AR_TOKENS},
        acceptance=acceptance,
        prefill="replaced by random K/V of the same shapes (decode-only measurement)",
        hf_static="torch.compile by transformers" if COMPILE_STATIC else "eager (transformers' auto-compile disabled)",
        rows=rows,
    )
    _print_table(rows, acceptance)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        _plot(rows, args.plot, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"} | {"summary": _summary(rows)}))
    return result


def _variants(plan: Sources, name: str, context: int) -> list[tuple[str, Method]]:
    """``(row label, method)`` of each row ``name`` runs as: dustin_exact and dustin_exact_select one per exact
    budget when several (``dustin_exact@BUDGET``), any other method one."""
    if name in ("dustin_exact", "dustin_exact_select") and len(plan.exact_budgets) > 1:
        return [(f"{name}@{b}", plan.method(name, context, b)) for b in plan.exact_budgets]
    return [(name, plan.method(name, context))]


def _run_method(
    target, draft, batch: int, context: int, method: Method, dtype, new_tokens: int, args, profile_mode: str | None
) -> dict:
    """One speculative row: the timed run, then (``profile_mode``) a profiling pass and (``--torch-trace``) a
    traced one, neither timed."""
    row = run_speculative(target, draft, batch, context, method, dtype, new_tokens)
    row["acceptance"] = method.acceptance
    row["config"] = _changed(method.config)
    if profile_mode and not args.no_profile:
        prof = run_speculative(target, draft, batch, context, method, dtype, new_tokens, profile=profile_mode)
        row["phase_ms_per_step"] = prof["phase_ms_per_step"]
        row["host_ms_per_step"] = prof["host_ms_per_step"]
        row["phase_mode"] = profile_mode
    if profile_mode and args.torch_trace:
        Path(args.torch_trace).mkdir(parents=True, exist_ok=True)
        run_speculative(
            target,
            draft,
            batch,
            context,
            method,
            dtype,
            new_tokens,
            torch_trace=f"{args.torch_trace}/{method.name}_{context}_{batch}.json.gz",
        )
    return row


def _changed(config: DustinConfig | None) -> dict | None:
    """The fields of ``config`` that differ from ``DustinConfig()``'s (``None``: dense verification)."""
    if config is None:
        return None
    defaults = DustinConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != defaults[k]}


# the references each row is rated against: plain generate(), classic speculative decoding, the lossless baseline
_REFERENCES = ("hf_dynamic", "spec_dense", "spec_sparse_draft")


def _add_ratios(rows: list[dict]) -> None:
    """``x_vs_<reference>`` (and ``steady_x_vs_<reference>``) for each row with a rate, against the same
    context and batch (``None`` where the reference did not run)."""
    for row in rows:
        if "tokens_per_s" not in row:
            continue
        for reference in _REFERENCES:
            ref = next(
                (
                    r
                    for r in rows
                    if r["method"] == reference
                    and r["context"] == row["context"]
                    and r["batch"] == row["batch"]
                    and "tokens_per_s" in r
                ),
                None,
            )
            row[f"x_vs_{reference}"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref else None
            if "steady_tokens_per_s" in row:  # every row active: the rate a server sees between arrivals
                row[f"steady_x_vs_{reference}"] = (
                    row["steady_tokens_per_s"] / ref["steady_tokens_per_s"]
                    if ref and "steady_tokens_per_s" in ref
                    else None
                )


def _versions() -> dict:
    import transformers

    out = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__)
    for name in ("triton", "kernels"):  # kernels decides how the fused rotary installs (runtime/rotary.py)
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def _print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['method']:<20} ctx {row['context']:>6} B {row['batch']:>3}  {row['error']}", flush=True)
        return
    print(
        f"{row['method']:<20} ctx {row['context']:>6} B {row['batch']:>3}  {row['tokens_per_s']:9.1f} tok/s  "
        f"{row['tokens_per_step']:.2f} tok/step/row  bound {row['bound_tokens_per_s']:9.1f}  "
        f"({100 * row['fraction_of_bound']:.0f}%)  steady {row.get('steady_tokens_per_s', float('nan')):9.1f} tok/s  "
        f"peak {row['peak_gib'] or 0:.1f} GiB" + _runs(row) + _outcomes(row),
        flush=True,
    )


def _runs(row: dict) -> str:
    """The rates of a repeated baseline's runs, for its printed row."""
    if "runs_tokens_per_s" not in row:
        return ""
    rates = ", ".join(f"{rate:.1f}" for rate in row["runs_tokens_per_s"])
    return f"  median of {rates} (warm-up run {row['warmup_tokens_per_s']:.1f}, not rated)"


def _outcomes(row: dict) -> str:
    """Exact mode's confirmations and the knob's realised budgets, for a printed row."""
    out = ""
    if "exact" in row:
        e = row["exact"]
        out += (
            f"\n    exact: {e['confirmations']} confirmations, {100 * e['confirmed_fraction']:.0f}% of tentative "
            f"tokens confirmed, {e['tokens_per_confirmation']:.2f} tokens per confirmation, row-steps "
            f"{e['sparse_row_steps']} sparse / {e['dense_row_steps']} dense"
        )
    if "knob" in row:
        k = row["knob"]
        out += (
            f"\n    knob: budget mean {k['budget_mean']:.0f}, p50 {k['budget_p50']}, p95 {k['budget_p95']}, max "
            f"{k['budget_max']}, {k['dense_fallbacks']} dense fallbacks of {k['row_steps']} row-steps"
        )
    return out


def _summary(rows: list[dict]) -> list[dict]:
    keys = (
        "method",
        "context",
        "batch",
        "tokens_per_s",
        "tokens_per_step",
        "fraction_of_bound",
        "steady_tokens_per_s",
        *(f"{prefix}x_vs_{ref}" for prefix in ("", "steady_") for ref in _REFERENCES),
    )
    return [{k: row.get(k) for k in keys} for row in rows if "tokens_per_s" in row]


def _print_table(rows: list[dict], acceptance: dict[str, str]) -> None:
    """The rows with their ratios (x classic: vs spec_dense; x ssd: vs spec_sparse_draft), then what each method
    replays."""
    ratios = (
        "x_vs_hf_dynamic",
        "x_vs_spec_dense",
        "x_vs_spec_sparse_draft",
        "steady_x_vs_spec_dense",
        "steady_x_vs_spec_sparse_draft",
    )
    print(
        f"\n{'method':<20}{'ctx':>7}{'B':>4}{'tok/s':>10}{'tok/step':>9}{'x hf_dyn':>9}{'x classic':>10}{'x ssd':>7}"
        f"{'%bound':>7}{'steady':>9}{'x classic':>10}{'x ssd':>7}  phases (ms/step)"
    )
    for row in rows:
        if "tokens_per_s" not in row:
            continue
        phases = " ".join(f"{k}={v:.2f}" for k, v in row.get("phase_ms_per_step", {}).items())
        ratio = {k: f"{row[k]:.2f}" if row.get(k) else "-" for k in ratios}
        steady = f"{row['steady_tokens_per_s']:.1f}" if "steady_tokens_per_s" in row else "-"
        print(
            f"{row['method']:<20}{row['context']:>7}{row['batch']:>4}{row['tokens_per_s']:>10.1f}"
            f"{row['tokens_per_step']:>9.2f}{ratio['x_vs_hf_dynamic']:>9}{ratio['x_vs_spec_dense']:>10}"
            f"{ratio['x_vs_spec_sparse_draft']:>7}{100 * row['fraction_of_bound']:>6.0f}%{steady:>9}"
            f"{ratio['steady_x_vs_spec_dense']:>10}{ratio['steady_x_vs_spec_sparse_draft']:>7}  {phases}"
        )
    print("\nreplayed outcomes (the models have random weights):")
    for name, source in acceptance.items():
        print(f"  {name}: {source}")


def _plot(rows: list[dict], path: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = max(r["batch"] for r in rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        pts = sorted(
            (r["context"], r["tokens_per_s"])
            for r in rows
            if r["method"] == method and r["batch"] == batch and "tokens_per_s" in r
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"decode tokens/s (batch {batch})")
    ax.set_title(f"{result['pair']} on {', '.join(result['gpus'])}\nacceptance replayed; see JSON", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
