"""Model surgery measured: what each fused path of ``fused_ops`` buys against transformers' own code, in one process.

Every path of :func:`dustin_hf.runtime.fused.fused_ops` (fused RMSNorm, rotary, MLP and q/k/v GEMMs, and the
CUDA-graph pipeline's hand-written decoder layer) has a switch on ``FusedTuning`` (``RuntimeOptions.tuning.fused``).
Each variant below turns one off (``none``: all of them, so every forward is transformers' own, under the same CUDA
graphs) and runs interleaved with every path on
(``on, v1, on, v2, ..., on``); a variant is compared with the mean of the two ``on`` runs beside it.

Two measures, each through e2e.py's random-weight 7B + 0.5B models (Qwen2.5 shapes, bf16), Dustin with the sparse
draft (budget 512), acceptance REPLAYED from the paper's fixed pattern (e2e.py's ``CountReplay``, 2.2 tokens a step):

* **decode step**: ``e2e.run_speculative`` (prompt replaced by random K/V), milliseconds per step after its warm-up
  steps (kernels compiled and graphs captured before);
* **whole call**: the decode loop's ``generate`` with its real prefill (what ``generate()`` hands it), the kernels
  compiled by the variant's decode run before; each call builds its caches and graphs (two workspaces of 32k x 16
  do not fit an H100 together, and a variant's graphs differ). Only the paths that run at prompt sizes
  (``CALL_VARIANTS``) get calls: the layers are the pipeline's, so their share of a call is its steps times their
  step delta.

A variant whose switch changes nothing on this install (the rotary without the ``kernels`` package from 0.19, see
:mod:`dustin_hf.runtime.rotary`) is listed and not timed. The verdict: a path buying under ``KEEP_PERCENT`` of a step
and of a call goes.

    bash benchmarks/surgery.sh OUT                                             # one GPU, 7B + 0.5B, 32k x 16
    TRITON_INTERPRET=1 python benchmarks/surgery.py --smoke                    # tiny, CPU: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import e2e
import torch
from replay import CountReplay

import dustin_hf
from dustin_hf.experimental import RuntimeOptions, fused_ops

TUNING = RuntimeOptions().tuning  # the measured defaults: every fused path on
# FusedTuning's switches (its bool fields), each turning one fused path off
SWITCHES = tuple(f.name for f in dataclasses.fields(TUNING.fused) if isinstance(getattr(TUNING.fused, f.name), bool))

# ----------------------------------------------------------------------------- sweep constants
SHAPE = (32768, 16)  # (context, batch) of both measures
METHOD = "dustin_sparse_draft"
NEW_TOKENS = 64  # per row, a decode run (~25 steps, 3 of them warm-up)
CALL_NEW_TOKENS = 32  # per row, a whole call: mostly its prefill, which the prompt-size paths change
VARIANTS = (*SWITCHES, "none")
CALL_VARIANTS = ("norms", "rotary", "mlps", "qkv", "none")
KEEP_PERCENT = 2.0
DEPENDENTS = "norms off turns layers off too (they need the fused norms)"
SMOKE = dict(shape=(160, 2), budget=32, new_tokens=24, call_new_tokens=12)


def variant_tuning(name: str):
    """The default tuning with one fused path off (``"on"``: none off, ``"none"``: every one off)."""
    tuning = TUNING
    for switch in () if name == "on" else SWITCHES if name == "none" else (name,):
        tuning = tuning.with_value(f"fused.{switch}", False)
    return tuning


def whole_call(target, draft, batch: int, context: int, method, new_tokens: int, tuning) -> dict:
    """One call of the decode loop on random prompts, its real prefill included: seconds, and the loop's split."""
    from transformers import GenerationConfig

    from dustin_hf.experimental import Drafting, SpeculativeDecoder, attention_routed, resolve

    e2e._release_memory()
    config = GenerationConfig(do_sample=False, max_length=context + new_tokens, pad_token_id=0)
    decoder = SpeculativeDecoder(
        target,
        draft,
        config,
        dustin_config=resolve(method.config, target.config, draft.config),
        drafting=Drafting(e2e.GAMMA),
        runtime=RuntimeOptions(tuning=tuning),
        hooks=method.hooks(),
    )
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, draft.config.vocab_size, (batch, context), generator=generator)
    ids = ids.to(target.get_input_embeddings().weight.device)
    _sync()
    start = time.perf_counter()
    with attention_routed(target, draft):
        stats = decoder.generate(ids).stats.as_dict()
    _sync()
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, prefill_seconds=stats["prefill_seconds"], steps=stats["steps"])


def decode_run(target, draft, batch: int, context: int, method, dtype, new_tokens: int, tuning) -> dict:
    """e2e.py's decode measurement: milliseconds per step after the warm-up steps."""
    row = e2e.run_speculative(target, draft, batch, context, method, dtype, new_tokens, tuning=tuning)
    return dict(step_ms=1e3 * row["seconds"] / row["steps"], steps=row["steps"], tokens_per_s=row["tokens_per_s"])


def interleaved(variants, measure, key: str, log, warmup: bool = False) -> dict[str, dict]:
    """``measure(name)`` for ``on, v1, on, v2, ..., on``; per variant its record, the mean of the two ``on`` records
    beside it (``on_<key>``) and its delta in percent of that (``delta_percent``: what turning the path off costs).
    ``warmup``: one ``on`` run first, not counted (the process's first run compiles the kernels)."""
    if not variants:
        return {}
    if warmup:
        measure("on")
    results, previous = {}, measure("on")
    log("on", previous)
    ons = [previous]
    for name in variants:
        record = measure(name)
        log(name, record)
        after = measure("on")
        log("on", after)
        ons.append(after)
        base = (previous[key] + after[key]) / 2
        results[name] = dict(record, **{f"on_{key}": base, "delta_percent": 100 * (record[key] / base - 1)})
        previous = after
    results["on"] = dict(ons[-1], **{f"runs_{key}": [r[key] for r in ons]})
    return results


def changed_paths(target, draft, names) -> dict[str, dict]:
    """Per variant, what ``fused_ops`` does with its tuning on these models (one dry context each): variants that
    change nothing against all-on are left out of the timing."""
    reports = {}
    for name in ("on", *names):
        with fused_ops(target, draft, tuning=variant_tuning(name).fused) as done:
            reports[name] = dataclasses.asdict(done)
    return reports


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _verdict(decode: dict | None, call: dict | None) -> str:
    """Keep a path whose removal slows a step or a call by at least KEEP_PERCENT; else it goes."""
    if decode is None:
        return "changes nothing here"
    buys = [r["delta_percent"] for r in (decode, call) if r is not None]
    return "keep" if max(buys) >= KEEP_PERCENT else f"goes (<{KEEP_PERCENT:g}%)"


def _rows(names, decode: dict, calls: dict, reports: dict) -> list[dict]:
    return [
        dict(
            variant=name,
            decode=decode.get(name),
            call=calls.get(name),
            fused_ops=reports.get(name),
            verdict=_verdict(decode.get(name), calls.get(name)),
        )
        for name in names
    ]


def _table(names, decode: dict, calls: dict, reports: dict) -> list[dict]:
    rows = _rows(names, decode, calls, reports)
    print(f"\n{'path off':<14}{'step ms':>9}{'on':>8}{'Δ step':>8}{'call s':>9}{'on':>8}{'Δ call':>8}  verdict")
    for row in rows:
        d, c = row["decode"], row["call"]
        step = f"{d['step_ms']:>9.3f}{d['on_step_ms']:>8.3f}{d['delta_percent']:>+7.2f}%" if d else f"{'-':>25}"
        call = f"{c['seconds']:>9.2f}{c['on_seconds']:>8.2f}{c['delta_percent']:>+7.2f}%" if c else f"{'-':>25}"
        print(f"{row['variant']:<14}{step}{call}  {row['verdict']}")
    print(f"({DEPENDENTS}; Δ: the variant's time over its on runs', what turning the path off costs)")
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--shape", default=None, help=f"CONTEXTxBATCH of both measures (default {SHAPE[0]}x{SHAPE[1]})"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--call-variants", nargs="*", default=list(CALL_VARIANTS), choices=VARIANTS)
    parser.add_argument("--new-tokens", type=int, default=None, help=f"per row, a decode run (default {NEW_TOKENS})")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script")
    parser.add_argument("--out", default=None, help="save the results JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        device, dtype, sizes, budget = torch.device("cpu"), torch.float32, ("tiny", "tiny-draft"), SMOKE["budget"]
        (context, batch), new_tokens, call_tokens = SMOKE["shape"], SMOKE["new_tokens"], SMOKE["call_new_tokens"]
    else:
        device, dtype, sizes, budget = torch.device("cuda:0"), torch.bfloat16, ("7b", "0.5b"), e2e.BUDGET
        (context, batch), new_tokens, call_tokens = SHAPE, NEW_TOKENS, CALL_NEW_TOKENS
    if args.shape:
        context, batch = (int(v) for v in args.shape.split("x"))
    new_tokens = args.new_tokens or new_tokens
    counts = CountReplay.load(None, e2e.GAMMA)
    sources = e2e.Sources(None, {METHOD: counts}, None, None, budget, (budget,))
    method = sources.method(METHOD, context)
    torch.manual_seed(0)
    target = e2e.build_model(sizes[0], [device], dtype)
    draft = e2e.build_model(sizes[1], [device], dtype, vocab_size=e2e.SHAPES[sizes[0]]["vocab_size"])
    dustin_hf.patch(target)  # registers the "dustin" attention, as a user's one line does
    names = list(dict.fromkeys(args.variants))
    reports = changed_paths(target, draft, names) if device.type == "cuda" else {}
    timed = [n for n in names if not reports or reports[n] != reports["on"]]

    def log(what):
        return lambda name, r: print(
            f"  {what} {name:<14} " + " ".join(f"{k}={v:.4g}" for k, v in r.items()), flush=True
        )

    decode = interleaved(
        timed,
        lambda name: decode_run(target, draft, batch, context, method, dtype, new_tokens, variant_tuning(name)),
        "step_ms",
        log("decode"),
        warmup=True,
    )
    provenance = dict(
        benchmark="surgery",
        command=" ".join(["benchmarks/surgery.py", *(sys.argv[1:] if argv is None else argv)]),
        pair=f"Qwen2.5-{sizes[0]} + {sizes[1]} shapes, random weights ({dtype})",
        method=f"{METHOD}, budget {budget}, gamma {e2e.GAMMA}",
        acceptance=f"REPLAYED: {counts.source}",
        dependents=DEPENDENTS,
        context=context,
        batch=batch,
        new_tokens={"decode": new_tokens, "call": call_tokens},
        machine=platform.node(),
        gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        versions=e2e._versions(),
    )
    _save(args.out, provenance, names, decode, {}, reports)  # a call phase cut short leaves the steps
    call_names = [n for n in timed if n in args.call_variants]
    if call_names:  # the prefill's kernels compiled at its shapes' specialisation, on a short prompt
        short = min(context, 2048)
        whole_call(target, draft, batch, short, sources.method(METHOD, short), call_tokens, variant_tuning("on"))
    calls = interleaved(
        call_names,
        lambda name: whole_call(target, draft, batch, context, method, call_tokens, variant_tuning(name)),
        "seconds",
        log("call"),
    )
    result = _save(args.out, provenance, names, decode, calls, reports, table=True)
    print(json.dumps({k: result[k] for k in ("benchmark", "gpu", "context", "batch", "versions")} | _summary(result)))
    return result


def _save(out, provenance: dict, names, decode: dict, calls: dict, reports: dict, table: bool = False) -> dict:
    """The results so far (with the table printed if ``table``), written to ``out`` when given."""
    rows = _table(names, decode, calls, reports) if table else _rows(names, decode, calls, reports)
    result = provenance | dict(on={"decode": decode.get("on"), "call": calls.get("on")}, rows=rows)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
    return result


def _summary(result: dict) -> dict:
    rows = result["rows"]
    return {
        "delta_percent": {
            r["variant"]: {k: r[k]["delta_percent"] for k in ("decode", "call") if r[k] is not None} for r in rows
        },
        "verdict": {r["variant"]: r["verdict"] for r in rows},
    }


if __name__ == "__main__":
    main()
