"""What a user times: whole ``model.generate()`` calls, prefill included, first call and warm call apart.

Every call goes through the public API: ``dustin_hf.patch(target, config, hooks=...)`` and
``target.generate(input_ids, attention_mask=..., ...)``; nothing of the prompt is replaced, nothing is left out of
the clock. Target and draft have the real architectures (Qwen2.5-7B-Instruct and Qwen2.5-0.5B-Instruct, configs in
``e2e.py``) with random bf16 weights; one stand-in, printed with the results and saved in the JSON:

* ACCEPTANCE IS REPLAYED for dustin_hf's methods (``DecodeHooks.accept`` / ``confirm`` through ``patch(...,
  hooks=)``): each row walks the real Qwen2.5-Coder 1.5B/0.5B pair's teacher-forced predictions
  (``benchmarks/traces/*_predictions_*_ctx{4096,8192}_*.json``, :mod:`replay`), so every method keeps the drafts the
  real pair would on the same texts. Stock assisted decoding cannot be replayed: it is BRACKETED instead, run on a
  pair whose draft always predicts what the target does (every draft accepted: its best case) and on the random
  pair (no draft accepted: its worst).

Methods (``--methods``):
  generate          plain ``generate()`` (transformers' default cache), what users run without a draft
  stock_assisted    transformers' assisted decoding, ``assistant_model=draft`` (batch 1 only), bracketed as above
  classic           speculative decoding in dustin_hf's loop with dense verification (``cache_implementation=
                    "dustin"``, ``min_context`` past the context: no step is sparse)
  dustin_sparse_draft  Dustin, budget 512, the draft reading a selection too (``sparse_draft=True``)
  dustin_exact      exact mode (``mode="exact"``: the target's own tokens), its default budget (2048), sparse draft
  dustin_select     Dustin + ``sparse_draft`` with ``selection="verify"`` (not run by default), replaying the traces
                    recorded with the selection layers (``..._select.json``)
  dustin_exact_select  exact mode with ``selection="verify"`` (not run by default), from the same traces

Every method drafts 4 tokens a step (the draft's ``num_assistant_tokens``, constant schedule). Per (method,
context, batch) three calls run in one process: ``--new-tokens``' largest count twice (the ``first`` call, which
builds the workspace, captures the CUDA graphs and, for the process's first method, compiles the kernels; then the
``warm`` one) and each smaller count once (``warm``: it fits the first call's workspace); ``stock_assisted`` makes the
fewest tokens only, first and warm. ``prefill_seconds`` of
dustin_hf's methods is the loop's own (target and draft, ``stats``); of ``generate`` / ``stock_assisted`` it is a
``generate(max_new_tokens=1)`` call of the same shape, timed after the others. ``decode_seconds`` is the rest of
the call. ``x_vs_plain_generate`` divides plain ``generate()``'s seconds for the same context, batch, new tokens and
call kind (first / warm) by the method's.

    python benchmarks/whole_call.py --out benchmarks/results/whole_call_h200.json    # one H200, every shape
    python benchmarks/whole_call.py --smoke                                          # tiny, CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch
from e2e import GAMMA, SHAPES, Sources, build_model
from replay import load_predictions, synthetic_predictions

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.experimental import CACHE_KWARG, DecodeHooks

# ----------------------------------------------------------------------------- sweep constants
SHAPES_RUN = ((32768, 16), (8192, 16), (8192, 4), (32768, 1))  # (context, batch)
NEW_TOKENS = (1024, 256)  # the first is the count the first (and second) call makes
METHODS = (
    "generate",
    "stock_assisted",
    "classic",
    "dustin_sparse_draft",
    "dustin_exact",
    "dustin_select",
    "dustin_exact_select",
)
DEFAULT_METHODS = METHODS[:-2]
SMOKE = dict(shapes=((160, 2), (96, 1)), new_tokens=(24, 12), budget=32)
MATRIX_TFLOPS = 790  # the H200's bf16 matrix rate on random data, measured here (device KINDS.md)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def prefill_tflop(model, tokens_per_row: int, rows: int) -> float:
    """Matrix FLOPs (TFLOP) of a causal forward over ``rows`` prompts of ``tokens_per_row``: 2 per weight and token
    (the embedding table is read, not multiplied; the head runs on the last token only) and the attention's
    ``4 * heads * head_dim * T^2 / 2`` per layer."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)
    attention = 4 * cfg.num_attention_heads * head_dim * tokens_per_row**2 / 2 * cfg.num_hidden_layers
    return rows * (2 * weights * tokens_per_row + attention) / 1e12


class Runner:
    """Both models, the patch, and the calls, timed."""

    def __init__(self, target, draft, sources: Sources, device):
        self.target, self.draft, self.sources, self.device = target, draft, sources, device
        self.handle = dustin_hf.patch(target)
        for model in (target, draft):
            model.generation_config.pad_token_id = 0
            model.generation_config.eos_token_id = None
        # every method drafts GAMMA tokens a step, the loop's default drafting and stock's, made explicit
        draft.generation_config.num_assistant_tokens = GAMMA
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0

    def ids(self, context: int, batch: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        vocab = self.draft.config.vocab_size
        return torch.randint(0, vocab, (batch, context), generator=generator).to(self.device)

    def configure(self, method: str, context: int) -> None:
        """Patch the target with one of dustin_hf's methods: its config and its replayed acceptance."""
        spec = self.sources.method("spec_dense" if method == "classic" else method, context)
        config = spec.config or DustinConfig()
        if method == "classic":  # dustin_hf's loop, every step dense (its rows stay below min_context; one value
            config = config.replace(min_context=2**30)  # for every call, so that its calls share a workspace)
        dustin_hf.patch(self.target, config, hooks=DecodeHooks(**_replay_fields(spec)))

    def call(self, method: str, ids: torch.Tensor, new_tokens: int) -> dict:
        """One whole ``generate()`` call of ``method``: seconds, and the loop's prefill/decode split if it has one."""
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        if method in ("generate", "stock_assisted"):
            if method == "stock_assisted":
                kwargs["assistant_model"] = self.draft
            run = lambda: self.target.generate(ids, **kwargs)  # noqa: E731
        else:
            self.configure(method, ids.shape[1])
            kwargs.update(assistant_model=self.draft, cache_implementation="dustin", return_dict_in_generate=True)
            run = lambda: self.target.generate(ids, **kwargs)  # noqa: E731
        _release()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        _sync()
        start = time.perf_counter()
        out = run()
        _sync()
        seconds = time.perf_counter() - start
        record = dict(seconds=seconds, peak_gib=_peak_gib())
        if method not in ("generate", "stock_assisted"):
            stats = getattr(out, CACHE_KWARG).stats
            ends = stats["step_end_times"]
            durations = sorted(b - a for a, b in zip([0.0] + ends[:-1], ends))
            steady = durations[len(durations) // 2]  # the median step: replayed graphs, nothing built
            record.update(
                prefill_seconds=stats["prefill_seconds"],
                decode_seconds=seconds - stats["prefill_seconds"],
                loop_decode_seconds=stats["decode_seconds"],
                steps=stats["steps"],
                steady_step_ms=1e3 * steady,
                decode_over_steady=stats["decode_seconds"] / (len(ends) * steady) if ends else None,
                outside_loop_seconds=seconds - stats["prefill_seconds"] - stats["decode_seconds"],
                sparse_steps=stats["sparse_steps"],
                dense_steps=stats["dense_steps"],
                tokens_per_step=stats.get("mean_accepted_per_step"),
                workspace=stats["workspace"],
                cuda_graphs=stats["cuda_graphs"],
            )
            for report in ("exact",):
                if report in stats:
                    record[report] = stats[report]
            sequences = out.sequences
        else:
            sequences = out
        record["generated_tokens"] = int(sequences.shape[0] * (sequences.shape[1] - ids.shape[1]))
        del out
        return record


def _replay_fields(spec) -> dict:
    fields = {}
    for replay in spec.replays:
        fields.update(replay.hooks())
    return fields


def agreeing(models):
    """The models' final norms zeroed: every logit 0, so both predict token 0 at every position (every draft
    accepted). Returns a function that restores them."""
    saved = [(m.model.norm.weight, m.model.norm.weight.detach().clone()) for m in models]
    with torch.no_grad():
        for weight, _ in saved:
            weight.zero_()

    def restore():
        with torch.no_grad():
            for weight, value in saved:
                weight.copy_(value)

    return restore


def run_shape(runner: Runner, context: int, batch: int, methods, new_tokens, log, warmup: bool = False) -> list[dict]:
    records = []
    most, rest = new_tokens[0], new_tokens[1:]

    def add(method, call, n, record, pair=None):
        record = dict(method=method, context=context, batch=batch, new_tokens=n, call=call, **record)
        if pair:
            record["pair"] = pair
        records.append(record)
        log(record)

    for method in methods:
        if method == "stock_assisted":
            if batch != 1:
                continue
            for pair in ("every draft accepted", "no draft accepted"):
                restore = agreeing((runner.target, runner.draft)) if pair == "every draft accepted" else None
                try:  # the fewest new tokens only: at the most, its worst case alone takes minutes a call
                    ids, fewest = runner.ids(context, batch, seed=1), new_tokens[-1]
                    for call in ("first", "warm"):
                        add(method, call, fewest, runner.call(method, ids, fewest), pair)
                    prefill = runner.call(method, ids, 1)["seconds"]
                finally:
                    if restore:
                        restore()
                for r in records:
                    if r["method"] == method and r.get("pair") == pair:
                        r.update(prefill_seconds=prefill, decode_seconds=r["seconds"] - prefill)
            continue
        ids = runner.ids(context, batch, seed=1)
        if warmup and method not in ("generate", "stock_assisted"):
            runner.configure(method, context)
            _sync()
            start = time.perf_counter()
            runner.handle.warmup(runner.draft, batch, context + most, do_sample=False, return_dict_in_generate=True)
            _sync()
            warmed = time.perf_counter() - start
            add(method, "first_after_warmup", most, dict(runner.call(method, ids, most), warmup_seconds=warmed))
        for call in ("warm",) if warmup and method not in ("generate", "stock_assisted") else ("first", "warm"):
            add(method, call, most, runner.call(method, ids, most))
        for n in rest:
            add(method, "warm", n, runner.call(method, ids, n))
        if method == "generate":
            prefill = runner.call(method, ids, 1)["seconds"]
            for r in records:
                if r["method"] == "generate":
                    r.update(prefill_seconds=prefill, decode_seconds=r["seconds"] - prefill)
        runner.handle.release()  # the next method's workspace is built afresh (its first call pays it)
    plain = {(r["new_tokens"], r["call"]): r["seconds"] for r in records if r["method"] == "generate"}
    t_flop = prefill_tflop(runner.target, context, batch) + prefill_tflop(runner.draft, context - 1, batch)
    for r in records:
        base = plain.get((r["new_tokens"], r["call"]))
        r["x_vs_plain_generate"] = None if base is None else base / r["seconds"]
        if "prefill_seconds" in r and r["method"] not in ("generate", "stock_assisted"):
            r["prefill_tflops"] = t_flop / r["prefill_seconds"]  # target and draft prefill
    return records


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="CONTEXTxBATCH",
        help="e.g. 32768x16 8192x4 (default: " + " ".join(f"{c}x{b}" for c, b in SHAPES_RUN) + ")",
    )
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    parser.add_argument(
        "--new-tokens",
        type=int,
        nargs="+",
        default=None,
        help=f"tokens per row, largest first (default {' '.join(map(str, NEW_TOKENS))})",
    )
    parser.add_argument(
        "--predictions",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="the real pair's per-position predictions the replays walk (default: "
        "benchmarks/traces/*_predictions_*_ctx{4096,8192}_*.json)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models on the CPU, SYNTHETIC predictions: checks the script, measures nothing",
    )
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="dustin_hf's methods: time DustinPatch.warmup() for the shape, then a call after it "
        "(call 'first_after_warmup', with warmup_seconds) in place of the first call",
    )
    parser.add_argument("--out", default=None, help="save the results JSON here (rewritten after every shape)")
    return parser


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.smoke:
        device, dtype, sizes = torch.device("cpu"), torch.float32, ("tiny", "tiny-draft")
        shapes, new_tokens, budget = SMOKE["shapes"], SMOKE["new_tokens"], SMOKE["budget"]
        predictions = [
            synthetic_predictions(gamma=GAMMA, budget=b, seed=seed, selection=selection)
            for b, seed in ((budget, 0), (budget * 4, 1))
            for selection in ("dustin", "verify")
        ]
        acceptance = "SYNTHETIC predictions (--smoke): nothing here is a measurement"
    else:
        device, dtype, sizes = torch.device("cuda:0"), torch.bfloat16, ("7b", "0.5b")
        shapes, new_tokens, budget = SHAPES_RUN, NEW_TOKENS, 512
        paths = args.predictions or sorted(
            str(p) for c in (4096, 8192) for p in Path("benchmarks/traces").glob(f"*_predictions_*_ctx{c}_*.json")
        )
        predictions = load_predictions(paths, GAMMA)
        acceptance = (
            f"REPLAYED from the real pair's teacher-forced predictions ({len(paths)} files: "
            f"{', '.join(sorted({p.name for p in predictions}))}); stock_assisted BRACKETED "
            "(a pair that always agrees / the random pair)"
        )
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    new_tokens = tuple(sorted(args.new_tokens or new_tokens, reverse=True))
    sources = Sources(
        predictions,
        counts={},
        knob=None,
        knob_target=None,
        budget=budget,
        exact_budgets=(budget if args.smoke else DustinConfig(mode="exact").budget,),
        synthetic=args.smoke,
    )
    torch.manual_seed(0)
    target = build_model(sizes[0], [device], dtype)
    # the draft's embedding padded to the target's (Qwen2.5-0.5B has 151,936 rows, the 7B 152,064): generate() then
    # needs no tokenizers to check that they match (random weights have none); 0.1% more head for the draft
    draft = build_model(sizes[1], [device], dtype, vocab_size=SHAPES[sizes[0]]["vocab_size"])
    runner = Runner(target, draft, sources, device)
    result = dict(
        benchmark="whole_call",
        command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        pair=f"Qwen2.5-{sizes[0]} + {sizes[1]} shapes, random weights ({dtype})",
        acceptance=acceptance,
        gamma=GAMMA,
        budget=budget,
        machine=platform.node(),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        versions=versions(),
        records=[],
    )
    print(acceptance, flush=True)
    print(
        f"{'method':<22} {'ctx':>6} {'b':>3} {'new':>5} {'call':<5} {'s':>7} {'prefill':>8} {'decode':>7} "
        f"{'x gen':>6} {'GiB':>6}",
        flush=True,
    )

    def log(r):
        x = r.get("x_vs_plain_generate")
        name = r["method"] + (
            " (all)" if r.get("pair") == "every draft accepted" else " (none)" if r.get("pair") else ""
        )
        print(
            f"{name:<22} {r['context']:>6} {r['batch']:>3} {r['new_tokens']:>5} {r['call']:<5} {r['seconds']:>7.2f} "
            f"{r.get('prefill_seconds', float('nan')):>8.2f} {r.get('decode_seconds', float('nan')):>7.2f} "
            f"{'' if x is None else f'{x:.2f}':>6} {r['peak_gib'] or 0:>6.1f}",
            flush=True,
        )
        if "warmup_seconds" in r:
            print(f"{'':<22} after DustinPatch.warmup(): {r['warmup_seconds']:.2f} s", flush=True)
        if "steady_step_ms" in r:
            print(
                f"{'':<22} {r['steps']} steps, median {r['steady_step_ms']:.2f} ms: loop decode "
                f"{r['decode_over_steady']:.2f}x steps x median; {r['outside_loop_seconds']:.3f} s outside the loop; "
                f"prefill {r.get('prefill_tflops', 0):.0f} TFLOP/s",
                flush=True,
            )

    for context, batch in shapes:
        records = run_shape(runner, context, batch, args.methods, new_tokens, log, warmup=args.warmup)
        result["records"] += records
        for r in records:
            if r["method"] != "generate" and r["x_vs_plain_generate"] is not None:
                print(
                    f"  {r['method']} {r['new_tokens']} {r['call']}: x{r['x_vs_plain_generate']:.2f} vs generate()",
                    flush=True,
                )
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"records": len(result["records"])}))
    return result


def versions() -> dict:
    """The versions a whole-call record carries."""
    return {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "triton": _version("triton"),
        "dustin_hf": dustin_hf.__version__,
        "python": platform.python_version(),
    }


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
