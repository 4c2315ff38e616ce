"""One tree's side of the old-vs-new A/B (``benchmarks/ab_trees.sh``): decode rate and whole calls, one JSON line.

Run from a tree that ``ab_trees.sh prepare`` laid out (``.ab/<label>/``: a commit's ``dustin_hf/``, its ``patches/``
inside as ``dustin_hf/patches/``, its ``benchmarks/`` and this file), with ``PYTHONPATH=.ab/<label>``: Python puts this
file's folder first, so ``e2e``, ``whole_call`` and ``replay`` are that commit's, and ``dustin_hf`` (with
``dustin_hf.patches``) comes from ``PYTHONPATH`` before any installed copy; the line says which files ran.

Per shape, the tree's own measurements at 7B + 0.5B shapes (random bf16 weights), Dustin with the sparse draft
(budget 512), acceptance replayed from the paper's fixed pattern (2.2 tokens a step):

* **decode**: ``e2e.run_speculative`` (prompt replaced by random K/V) twice, the second rated: tokens/s after the
  warm-up steps;
* **call**: a whole ``generate()`` call through the public API (``whole_call.Runner.call``), prefill included,
  after ``DustinPatch.warmup()`` built its workspace and graphs on a short prompt (``whole_call.py --warmup``'s
  sequence: the call reuses them, as a warm call does, without a second 32k prefill).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import e2e
import torch
import whole_call
from replay import CountReplay

METHOD = "dustin_sparse_draft"
SHAPES = ((32768, 16), (8192, 4))  # (context, batch)
DECODE_TOKENS = 128  # per row, a decode run (~50 steps at 2.2 tokens a step)
CALL_TOKENS = 64  # per row, a whole call
SMOKE = dict(shapes=("160x2", "96x1"), budget=32, decode_tokens=24, call_tokens=12)


def measure(runner, sources, context: int, batch: int, dtype, decode_tokens: int, call_tokens: int) -> dict:
    """One shape: the second of two decode runs, then ``DustinPatch.warmup()`` for the call's shape (its workspace
    and graphs, on a short prompt) and the whole call that reuses them."""
    method = sources.method(METHOD, context)
    runs = [
        e2e.run_speculative(runner.target, runner.draft, batch, context, method, dtype, decode_tokens)
        for _ in range(2)
    ]
    ids = runner.ids(context, batch, seed=1)
    runner.configure(METHOD, context)
    whole_call._sync()
    start = time.perf_counter()
    runner.handle.warmup(runner.draft, batch, context + call_tokens, do_sample=False, return_dict_in_generate=True)
    whole_call._sync()
    warmup = time.perf_counter() - start
    call = runner.call(METHOD, ids, call_tokens)
    runner.handle.release()  # the next shape builds its own workspace
    return dict(
        context=context,
        batch=batch,
        decode_tokens_per_s=runs[1]["tokens_per_s"],
        decode_warmup_tokens_per_s=runs[0]["tokens_per_s"],
        call_seconds=call["seconds"],
        call_prefill_seconds=call["prefill_seconds"],
        call_steady_step_ms=call["steady_step_ms"],
        warmup_seconds=warmup,
        call_workspace=call["workspace"],
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the tree's name in the A/B (old, new)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="CONTEXTxBATCH", help="default 32768x16 8192x4")
    parser.add_argument("--decode-tokens", type=int, default=None, help=f"default {DECODE_TOKENS}")
    parser.add_argument("--call-tokens", type=int, default=None, help=f"default {CALL_TOKENS}")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the A/B's mechanics")
    args = parser.parse_args(argv)
    files = _sources()
    tree = Path(__file__).resolve().parents[1]
    for name, file in files.items():
        if tree not in Path(file).resolve().parents:
            raise SystemExit(f"{name} comes from {file}, not from {tree}: set PYTHONPATH={tree}")
    if args.smoke:
        device, dtype, sizes, budget = torch.device("cpu"), torch.float32, ("tiny", "tiny-draft"), SMOKE["budget"]
        shapes, decode_tokens, call_tokens = SMOKE["shapes"], SMOKE["decode_tokens"], SMOKE["call_tokens"]
    else:
        device, dtype, sizes, budget = torch.device("cuda:0"), torch.bfloat16, ("7b", "0.5b"), e2e.BUDGET
        shapes, decode_tokens, call_tokens = [f"{c}x{b}" for c, b in SHAPES], DECODE_TOKENS, CALL_TOKENS
    shapes, decode_tokens = args.shapes or shapes, args.decode_tokens or decode_tokens
    call_tokens = args.call_tokens or call_tokens
    torch.manual_seed(0)
    target = e2e.build_model(sizes[0], [device], dtype)
    draft = e2e.build_model(sizes[1], [device], dtype, vocab_size=e2e.SHAPES[sizes[0]]["vocab_size"])
    sources = e2e.Sources(None, {METHOD: CountReplay.load(None, e2e.GAMMA)}, None, None, budget, (budget,))
    runner = whole_call.Runner(target, draft, sources, device)
    points = []
    for shape in shapes:
        context, batch = (int(v) for v in shape.split("x"))
        points.append(measure(runner, sources, context, batch, dtype, decode_tokens, call_tokens))
        print(f"{args.label}: {points[-1]}", file=sys.stderr, flush=True)
    result = dict(
        label=args.label,
        dustin_hf=files["dustin_hf"],
        patches=files["dustin_hf.patches"],
        benchmarks=files["e2e"],
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        versions=e2e._versions(),
        decode_tokens=decode_tokens,
        call_tokens=call_tokens,
        points=points,
    )
    print("AB " + json.dumps(result), flush=True)
    return result


def _sources() -> dict[str, str]:
    """The files the library, its patches and the benchmark modules load from (the package's and its patches'
    as the import system finds them: the check needs where they come from, nothing of theirs)."""
    found = {name: importlib.util.find_spec(name).origin for name in ("dustin_hf", "dustin_hf.patches")}
    return found | {"e2e": e2e.__file__, "whole_call": whole_call.__file__}


if __name__ == "__main__":
    main()
