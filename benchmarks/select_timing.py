"""Old vs new cost of Dustin's per-step selection, and the cost of its scoring, on one GPU.

At the issue's point (Qwen2.5-72B target layout: 64 q / 8 kv heads, head dim 128; the Qwen2.5-0.5B draft:
14 q / 2 kv heads, head dim 64; batch 16, 32k context, budget 512, gamma 4; scoring heads and layers as
the default config resolves them), on random keys, with :class:`attention.ScoringStep`'s inputs:

* selection: ``select_positions`` on the same scores with the PyTorch path (two ``topk`` over the
  whole span, a cat and a sort) and with the Triton kernel (two launches); also whether both chose
  the same positions (they differ only where scores tie at a threshold);
* scoring: the target-history and the draft-lookahead scores with the PyTorch reference and with the
  Triton kernel, plus the key bytes the Triton kernel must read (each scoring key once) and its GB/s;
* per kernel: GPU microseconds per call of every kernel the Triton paths launch (``torch.profiler``,
  eager), to show where the time goes (scoring pass 1 / pass 2, the two selection launches).

Times are medians under CUDA graphs (``triton.testing.do_bench_cudagraph``), as ``attention.py
--timer cudagraph``. Prints a table, then one JSON line.

``--sweep SPEC`` instead times the scoring kernel under every combination of overrides (fields of
:class:`~dustin_hf.kernels.tuning.ScoreTuning` and launch keywords of ``triton_score.launch_config``, 0 = the
heuristic's value), called as the library calls it, after the heuristic itself: per row the
GPU microseconds of pass 1 and pass 2 per step (``torch.profiler``, both scoring calls: every launch of
``_score_pass1_kernel``, which also merges its splits, and of ``_score_pass2_kernel``), pass 1's key
GB/s, and the max abs error against an fp32 oracle (the PyTorch reference on fp32 copies of the same
inputs), flagged ``ERR`` where it exceeds twice the error of the PyTorch reference in the inputs'
dtype + 1e-5 (the tests' rule). The heuristic and the fastest passing row are then timed end to end
under CUDA graphs.

    python benchmarks/select_timing.py                  # the point above (CUDA)
    python benchmarks/select_timing.py --smoke          # tiny sizes on CPU (reference + Triton interpreter)
    python benchmarks/select_timing.py --sweep "programs_per_sm=2,4,8 num_stages=2,3,4 num_warps=4,8; tile_bytes=8192,32768"
    python benchmarks/select_timing.py --sweep "num_stages_reduce=1,2,3 pass2_programs_per_sm=1,2,4; layers_per_pass2=1"
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import sys

import torch

from attention import DRAFT_LAYOUT, LAYOUTS, SMOKE, ScoringStep, _time_ms, _versions, parse_sweep

from dustin_hf.kernels.tuning import ScoreTuning

TARGET_LAYOUT = next(lay for lay in LAYOUTS if lay.name == "qwen2.5-72b")
BATCH, CONTEXT, BUDGET = 16, 32768, 512
PROFILED_CALLS = 20
# --sweep keys: fields of ScoreTuning (programs_per_sm, tile_bytes) and launch keywords of triton_score.launch_config
SWEEP_KEYS = ("programs_per_sm", "tile_bytes", "block_n", "num_splits", "num_stages", "num_warps",  # pass 1
              "pass2_programs_per_sm", "tile", "block_p", "block_r", "num_warps_reduce", "num_stages_reduce",  # 2
              "layers_per_pass2")


def _timed(fn, device: torch.device, timer: str) -> float | str:
    """Median milliseconds of ``fn``, or why it could not be timed."""
    try:
        return _time_ms(fn, device, timer)
    except Exception as error:  # e.g. a path that cannot be captured in a graph: report it, keep going
        return f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


def kernel_us(fn, calls: int = PROFILED_CALLS) -> dict[str, float]:
    """GPU microseconds per call of ``fn`` for each kernel it launches (eager, after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.self_device_time_total / calls, 2) for e in prof.key_averages() if e.self_device_time_total}


def _key_bytes(step: ScoringStep) -> int:
    """Bytes of the scoring keys: per scoring layer, the KV heads its scoring heads read, over the span."""
    def layer_bytes(keys, heads, layout, span):
        group = layout.n_heads // layout.n_kv_heads
        kv_heads = len({h // group for h in heads})
        return keys.shape[0] * span * kv_heads * keys.shape[3] * keys.element_size()

    context = max(step.seqlens_host)
    gamma = step.draft_q[0].shape[1]
    total = layer_bytes(step.target_keys, step.cfg.target_heads, step.layout, context)
    for keys, heads in zip(step.draft_keys, step.cfg.draft_heads):
        total += layer_bytes(keys, heads, step.draft, context + gamma)
    return total


def measure(batch: int, context: int, budget: int, target, draft, device: torch.device, dtype: torch.dtype,
            timer: str) -> dict:
    """Every timing of the module docstring at one point; ``None``/``"n/a: ..."`` where not measured."""
    step = ScoringStep.build(target, draft, batch, context, budget, device, dtype)
    backends = ("reference", "triton")
    result = {}
    for backend in backends:
        result[f"scoring_target_ms_{backend}"] = _timed(lambda: step.score_target(backend), device, timer)
        result[f"scoring_draft_ms_{backend}"] = _timed(lambda: step.score_draft(backend), device, timer)
        result[f"scoring_ms_{backend}"] = _timed(lambda: (step.score_target(backend), step.score_draft(backend)),
                                                 device, timer)
    scores = step.score_target("triton"), step.score_draft("triton")
    picks = {}
    for backend in backends:
        result[f"selection_ms_{backend}"] = _timed(lambda: step.select(*scores, backend), device, timer)
        picks[backend] = step.select(*scores, backend).indices
    result["selection_same_positions"] = torch.equal(picks["reference"], picks["triton"])
    result["scoring_key_bytes"] = _key_bytes(step)
    if isinstance(result["scoring_ms_triton"], float):
        result["scoring_key_gbps_triton"] = result["scoring_key_bytes"] / result["scoring_ms_triton"] / 1e6
    if device.type == "cuda":
        result["kernels_us_scoring_triton"] = kernel_us(lambda: (step.score_target("triton"), step.score_draft("triton")))
        result["kernels_us_selection_triton"] = kernel_us(lambda: step.select(*scores, "triton"))
    return result


# ----------------------------------------------------------------------------- --sweep


def score_triton(step: ScoringStep, overrides: dict[str, int]) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    """Both scorings of ``step`` through the Triton kernels, called as :mod:`dustin_hf.scoring` calls them, with the
    sweep row's ``overrides`` (0 keeps the heuristic's value): :class:`ScoreTuning` fields go into the tuning, the
    rest are launch keywords of ``call_config`` (with those, a call's layers share its one config). Returns the
    (target, draft) scores and the launch config per head dim."""
    from dustin_hf.kernels import triton_score

    given = {key: value for key, value in overrides.items() if value}
    fields = {field.name for field in dataclasses.fields(ScoreTuning)}
    tuning = ScoreTuning(**{key: value for key, value in given.items() if key in fields})
    launch = {key: value for key, value in given.items() if key not in fields}
    n, gamma = max(step.seqlens_host), step.draft_q[0].shape[1]
    target_q = [step.history_q[:, None]]  # the query at L_b - 1: the lengths with an offset of -1
    calls = {
        "target": (step.layout, target_q, [step.target_keys], step.seqlens[:, None], [step.cfg.target_heads], n,
                   dict(query_offset=-1)),
        "draft": (step.draft, step.draft_q, step.draft_keys, step.seqlens[:, None].expand(-1, gamma),
                  step.cfg.draft_heads, n + gamma, dict(position_limit=step.seqlens, query_step=1)),
    }
    scores, configs = [], {}
    for layout, queries, keys, query_pos, heads, span, extra in calls.values():
        group = layout.n_heads // layout.n_kv_heads
        config = triton_score.call_config(queries, keys, heads, group, n, span, tuning=tuning, **launch)
        configs[layout.head_dim] = config
        scores.append(triton_score.attention_mass_layers_triton(
            queries, keys, query_pos, heads, group, layout.head_dim**-0.5, n, span, tuning=tuning,
            config=config if launch else None, **extra))
    return (scores[0], scores[1]), configs


def _oracle(step: ScoringStep) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft scores of the PyTorch reference on fp32 copies of ``step``'s inputs (exact products)."""
    exact = dataclasses.replace(step, target_keys=step.target_keys.float(), history_q=step.history_q.float(),
                                draft_keys=[k.float() for k in step.draft_keys],
                                draft_q=[q.float() for q in step.draft_q])
    return exact.score_target("reference"), exact.score_draft("reference")


def _max_err(got, want) -> float:
    return max((g.double() - w.double()).abs().max().item() for g, w in zip(got, want))


def _short(config) -> str:
    return (f"n{config.block_n}/s{config.num_splits}/w{config.num_warps}/st{config.num_stages}"
            f"|t{config.tile}/p{config.block_p}/r{config.block_r}/w{config.num_warps_reduce}"
            f"/st{config.num_stages_reduce}/l{config.layers_per_pass2}")


def sweep(step: ScoringStep, combos: list[dict], device: torch.device, timer: str) -> dict:
    """One row per launch override (the heuristic first), then CUDA-graph times of the heuristic and the best row."""
    oracle = _oracle(step)
    ref_err = _max_err((step.score_target("reference"), step.score_draft("reference")), oracle)
    key_bytes = _key_bytes(step)
    rows = []
    for overrides in [{}] + combos:
        row = dict(overrides=overrides or "heuristic")
        try:
            scores, chosen = score_triton(step, overrides)
            err = _max_err(scores, oracle)
            us = kernel_us(lambda: score_triton(step, overrides)) if device.type == "cuda" else {}
        except Exception as error:  # e.g. out of shared memory: report it, keep going
            rows.append(row | dict(status=f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:100]}"))
            continue
        pass1 = sum(t for name, t in us.items() if name.startswith("_score_pass1"))
        pass2 = sum(t for name, t in us.items() if name.startswith("_score_pass2"))
        rows.append(row | dict(
            configs={f"d{d}": _short(c) for d, c in sorted(chosen.items())}, pass1_us=pass1, pass2_us=pass2,
            pass1_key_gbps=key_bytes / pass1 / 1e3 if pass1 else None, max_err=err,
            status="ok" if err <= 2 * ref_err + 1e-5 else f"ERR > 2 x {ref_err:.3g} + 1e-5"))
    passing = [r for r in rows[1:] if r.get("status") == "ok" and r["pass1_us"]]
    best = min(passing, key=lambda r: r["pass1_us"] + r["pass2_us"], default=None)
    graph_ms = {}
    for label, row in (("heuristic", rows[0]), ("best", best)):
        if row is not None and row.get("status") == "ok":
            overrides = row["overrides"] if isinstance(row["overrides"], dict) else {}
            graph_ms[label] = _timed(lambda: score_triton(step, overrides)[0], device, timer)
    return dict(scoring_key_bytes=key_bytes, reference_max_err=ref_err, sweep=rows, best=best,
                scoring_ms_triton_graph=graph_ms)


def _print_sweep(result: dict) -> None:
    print(f"key bytes {result['scoring_key_bytes'] / 1e6:.0f} MB; PyTorch reference (inputs' dtype) max err "
          f"{result['reference_max_err']:.3g}")
    print("configs per head dim: pass 1 tile n/splits s/warps w/stages st | pass 2 tile t/step p/row block r/"
          "warps w/stages st/layers per launch l (0: all)")
    print(f"{'overrides':<56}{'configs':<100}{'pass1 us':>9}{'pass2 us':>9}"
          f"{'key GB/s':>9}{'max err':>10}  status")
    for row in result["sweep"]:
        label = row["overrides"] if isinstance(row["overrides"], str) else " ".join(
            f"{k}={v}" for k, v in row["overrides"].items())
        if "pass1_us" not in row:
            print(f"{label:<56}{'':<100}{'':>37}  {row['status']}")
            continue
        configs = " ".join(f"{k}:{v}" for k, v in row["configs"].items())
        gbps = f"{row['pass1_key_gbps']:>9.0f}" if row["pass1_key_gbps"] else f"{'n/a':>9}"
        print(f"{label:<56}{configs:<100}{row['pass1_us']:>9.1f}{row['pass2_us']:>9.1f}{gbps}"
              f"{row['max_err']:>10.2e}  {row['status']}")
    print(f"CUDA-graph ms per step (target + draft scoring): {result['scoring_ms_triton_graph']}")


def _print_table(result: dict) -> None:
    print(f"{'ms per step':<18}{'PyTorch':>10}{'Triton':>10}")
    for what in ("selection", "scoring", "scoring_target", "scoring_draft"):
        cells = [result[f"{what}_ms_{b}"] for b in ("reference", "triton")]
        print(f"{what:<18}" + "".join(f"{c:>10.4f}" if isinstance(c, float) else f"{'n/a':>10}" for c in cells))
    print(f"same positions: {result['selection_same_positions']}")
    for name in ("kernels_us_scoring_triton", "kernels_us_selection_triton"):
        for kernel, us in result.get(name, {}).items():
            print(f"  {name.removeprefix('kernels_us_'):<18}{us:>9.2f} us  {kernel[:90]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Prints a table, then one JSON line.")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--budget", type=int, default=BUDGET)
    parser.add_argument("--timer", choices=("cudagraph", "do_bench"), default="cudagraph",
                        help="do_bench_cudagraph (default; no launch overhead) or do_bench (L2 flushed per run)")
    parser.add_argument("--smoke", action="store_true", help="tiny layouts and sizes; runs on CPU")
    parser.add_argument("--sweep", metavar="SPEC", default=None,
                        help="only the scoring kernel, under every combination of ScoreTuning fields and "
                             "triton_score.launch_config keywords, e.g. 'programs_per_sm=2,4 num_stages=3,4' (0 = heuristic); keys: "
                             + ", ".join(SWEEP_KEYS))
    args = parser.parse_args(argv)
    try:
        combos = [dict(zip(spec, values)) for spec in parse_sweep(args.sweep, SWEEP_KEYS)
                  for values in itertools.product(*spec.values())] if args.sweep else None
    except ValueError as error:
        parser.error(str(error))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, draft, dtype = TARGET_LAYOUT, DRAFT_LAYOUT, torch.bfloat16
    if args.smoke:
        target, draft, dtype = SMOKE["layouts"][0], SMOKE["draft"], SMOKE["dtype"]
        args.batch, args.context, args.budget = 2, 2100, 64
    elif device.type != "cuda":
        sys.exit("needs a CUDA GPU; use --smoke on CPU")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'unknown'})"
    if combos is not None:
        step = ScoringStep.build(target, draft, args.batch, args.context, args.budget, device, dtype)
        result = sweep(step, combos, device, args.timer)
        _print_sweep(result)
    else:
        result = measure(args.batch, args.context, args.budget, target, draft, device, dtype, args.timer)
        _print_table(result)
    print(json.dumps(dict(command=" ".join([sys.executable] + sys.argv), gpu=gpu, versions=_versions(),
                          timer=args.timer, target=target.name, draft=draft.name, batch=args.batch,
                          context=args.context, budget=args.budget, dtype=str(dtype), **result)))


if __name__ == "__main__":
    main()
