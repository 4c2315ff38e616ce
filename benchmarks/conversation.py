"""A conversation over one long document: turn 0 asks about it, each follow-up adds the last answer and a question.

Each row holds a ``--contexts``-token document (random ids); turn 0's prompt is the document and a question of
``QUESTION_TOKENS``; follow-up turn ``k``'s prompt is turn ``k-1``'s, then that turn's answer (``NEW_TOKENS``) and a
new question. Every turn asks ``NEW_TOKENS`` new tokens. The transcript's answers are FIXED random tokens, the same
for every method: the random-weight models' own answers differ by method and mean nothing, and this way every method
reads the same prompts. Models and acceptance as in :mod:`whole_call` (random bf16 weights of Qwen2.5-7B/0.5B's
shapes; dustin_hf's acceptance REPLAYED from the real pair's teacher-forced predictions).

Methods (``--methods``), timed per turn (whole ``generate()`` calls, everything a user waits for):
  generate              plain ``generate()``, every turn's prompt read whole (no reuse)
  generate_reuse        plain ``generate()`` with transformers' prompt-reuse recipe: one forward over the document
                        fills a ``DynamicCache`` (``attention_mask``, ``position_ids=cumsum(mask)-1``), each call gets
                        ``copy.deepcopy`` of it as ``past_key_values`` (the copy is inside the clock) and reads the
                        rest. Kept simple: one cache of the document for every turn (not the last turn's prompt),
                        so turn ``k`` reads the questions and answers since the document. Turn 0's seconds include
                        the cache's forward (``prefix_cache_seconds``): the first question pays the document.
  stock_assisted_reuse  stock assisted decoding (``assistant_model=draft``, batch 1 only) with the same cache. Stock's
                        ``_assisted_decoding`` never slices the cached prefix: it feeds the whole prompt again on top
                        of the cache (``prefill_tokens`` shows it), so its TOKENS ARE NOT THE TARGET'S: records say
                        ``tokens_wrong_in_stock: true``. Timed as users would run it, on a pair whose draft always
                        predicts what the target does (every draft accepted: its best case; it cannot be replayed).
  dustin_sparse_draft   Dustin + ``sparse_draft`` (budget 512), ONE patched model over the turns: dustin_hf reuses,
                        by default, the prompt prefix its held caches were last prefilled with, so turn ``k`` reads
                        only turn ``k-1``'s answer and the new question.
  dustin_exact          exact mode (``mode="exact"``: the target's own tokens), the same automatic reuse.

The held caches serve a later call that fits the workspace the first call built (which holds 1/16 more slots than
that call needs: about five follow-ups at 32k). The dustin methods first run ``DustinPatch.warmup(draft, batch,
<the last turn's length>)`` (``warmup_seconds``, outside the turns' clocks), which pays kernel compilation and graph
capture, as a serving process would once, and sizes the workspace for the whole conversation. The plain methods
get one short untimed ``generate()`` first (CUDA and cuBLAS start-up).

Per record: ``turn``, ``method``, ``context``, ``batch``, ``prompt_tokens`` (a row's), ``seconds``,
``prefill_seconds`` (dustin_hf: the loop's own, target and draft; plain ``generate()``: start to the end of its first
forward; stock assisted: not known), ``prefill_tokens`` (the tokens the target read in forwards wider than a decode
step's, all rows), ``x_vs_plain_reuse`` (generate_reuse's seconds for the same turn, context and batch divided by the
method's: above 1 is faster than stock's reuse), ``peak_gib``.

    python benchmarks/conversation.py --out benchmarks/results/conversation_h200.json   # one H200
    python benchmarks/conversation.py --smoke                                          # tiny, CPU: checks the script
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from e2e import GAMMA, SHAPES, Sources, build_model
from replay import load_predictions, synthetic_predictions
from transformers import DynamicCache
from whole_call import Runner, _peak_gib, _release, _sync, agreeing, versions

from dustin_hf import DustinConfig
from dustin_hf.experimental import CACHE_KWARG

# ----------------------------------------------------------------------------- sweep constants
CONTEXTS = (32768,)  # the document's tokens per row
BATCHES = (1, 16)  # batch 1 first: its results land early
FOLLOW_UPS = 3  # turns after turn 0 (the issue asks 4: `--turns 4`; 3 keeps one H200 call under 9 minutes)
NEW_TOKENS = 256  # asked per turn
QUESTION_TOKENS = 150  # each turn's question
BUDGET = 512
METHODS = ("generate", "generate_reuse", "stock_assisted_reuse", "dustin_sparse_draft", "dustin_exact")
DUSTIN = ("dustin_sparse_draft", "dustin_exact")
# a document long enough that turn 0's workspace slack (at least 256 slots) spans the warmup's size for the last turn
SMOKE = dict(contexts=(320,), batches=(2, 1), follow_ups=2, new_tokens=12, question_tokens=16, budget=32)
# forwards wider than a decode step's (γ + 1; exact mode's confirming blocks 1 + confirm_tokens + γ) read prompts
PREFILL_WIDTH = 1 + DustinConfig().confirm_tokens + GAMMA


@dataclass(frozen=True)
class Conversation:
    """One transcript for every method: ``document (B, C)``, per turn a ``question (B, Q)``, per turn but the last
    a fixed ``answer (B, N)``."""

    document: torch.Tensor
    questions: list[torch.Tensor]
    answers: list[torch.Tensor]
    new_tokens: int

    @classmethod
    def random(cls, batch: int, context: int, turns: int, question: int, new_tokens: int, vocab: int, device):
        generator = torch.Generator().manual_seed(context * 31 + batch)

        def ids(n):
            return torch.randint(0, vocab, (batch, n), generator=generator).to(device)

        return cls(ids(context), [ids(question) for _ in range(turns)], [ids(new_tokens) for _ in range(turns - 1)],
                   new_tokens)  # fmt: skip

    def prompt(self, turn: int) -> torch.Tensor:
        pieces = [self.document]
        for k in range(turn + 1):
            pieces += [self.answers[k - 1]] if k else []
            pieces.append(self.questions[k])
        return torch.cat(pieces, dim=1)

    @property
    def longest(self) -> int:
        """The last turn's prompt and its answer: what the dustin methods' workspace is sized for."""
        return self.prompt(len(self.questions) - 1).shape[1] + self.new_tokens


class Watch:
    """Forward hooks on the target for one call: the tokens of its prompt forwards, and when its first forward
    ended (plain ``generate()``'s prefill; it synchronises once)."""

    def __init__(self, model, time_first: bool):
        self.tokens, self.first_end = 0, None
        self.hooks = [model.register_forward_pre_hook(self._count, with_kwargs=True)]
        if time_first:
            self.hooks.append(model.register_forward_hook(self._first, with_kwargs=True))

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > PREFILL_WIDTH:
            self.tokens += ids.numel()

    def _first(self, module, args, kwargs, output):
        if self.first_end is None:
            _sync()
            self.first_end = time.perf_counter()

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def prefix_cache(model, ids: torch.Tensor) -> DynamicCache:
    """transformers' recipe: one forward over the shared prefix fills a ``DynamicCache`` (mask and positions as
    ``generate()`` makes them, which padded rows need; these rows have none)."""
    mask = torch.ones_like(ids)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache}
        )
    return cache


def timed_call(runner: Runner, method: str, conv: Conversation, turn: int, cache=None) -> dict:
    """One whole ``generate()`` call of ``method`` on ``turn``'s prompt (``cache``: the document's, deep-copied
    inside the clock): seconds, prefill seconds where known, prompt tokens the target read."""
    ids = conv.prompt(turn)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=conv.new_tokens, do_sample=False)
    dustin = method in DUSTIN
    if dustin:
        runner.configure(method, conv.document.shape[1])  # fresh replay hooks: each turn's rows walk the traces anew
        kwargs.update(assistant_model=runner.draft, cache_implementation="dustin", return_dict_in_generate=True)
    elif method == "stock_assisted_reuse":
        kwargs.update(assistant_model=runner.draft)
    _release()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    watch = Watch(runner.target, time_first=method in ("generate", "generate_reuse"))
    try:
        _sync()
        start = time.perf_counter()
        if cache is not None:
            kwargs[CACHE_KWARG] = copy.deepcopy(cache)
        out = runner.target.generate(ids, **kwargs)
        _sync()
        seconds = time.perf_counter() - start
    finally:
        watch.remove()
    record = dict(seconds=seconds, prefill_tokens=watch.tokens, peak_gib=_peak_gib())
    if dustin:
        stats = getattr(out, CACHE_KWARG).stats
        record.update(prefill_seconds=stats["prefill_seconds"], steps=stats["steps"],
                      tokens_per_step=stats.get("mean_accepted_per_step"))  # fmt: skip
        out = out.sequences
    elif watch.first_end is not None:
        record["prefill_seconds"] = watch.first_end - start
    record["generated_tokens"] = int(out.shape[0] * (out.shape[1] - ids.shape[1]))
    return record


def run_plain(runner: Runner, method: str, conv: Conversation, add) -> None:
    """``generate`` / ``generate_reuse`` / ``stock_assisted_reuse`` over every turn."""
    cache, built = None, 0.0
    if method != "generate":
        _sync()
        start = time.perf_counter()
        cache = prefix_cache(runner.target, conv.document)
        _sync()
        built = time.perf_counter() - start
    restore = agreeing((runner.target, runner.draft)) if method == "stock_assisted_reuse" else None
    try:
        for turn in range(len(conv.questions)):
            record = timed_call(runner, method, conv, turn, cache)
            if cache is not None and turn == 0:  # the first question pays the document's forward
                record.update(prefix_cache_seconds=built, seconds=record["seconds"] + built)
                if "prefill_seconds" in record:
                    record["prefill_seconds"] += built
            if restore is not None:
                record.update(tokens_wrong_in_stock=True, pair="every draft accepted")
            add(method, turn, conv, record)
    finally:
        if restore is not None:
            restore()
        del cache
        _release()


def run_dustin(runner: Runner, method: str, conv: Conversation, add) -> None:
    """One patched model over every turn: the held caches carry the last prompt to the next call."""
    batch = conv.document.shape[0]
    runner.configure(method, conv.document.shape[1])
    _sync()
    start = time.perf_counter()
    runner.handle.warmup(runner.draft, batch, conv.longest, do_sample=False, return_dict_in_generate=True)
    _sync()
    warmed = time.perf_counter() - start
    for turn in range(len(conv.questions)):
        record = timed_call(runner, method, conv, turn)
        if turn == 0:
            record["warmup_seconds"] = warmed
        add(method, turn, conv, record)
    runner.handle.release()  # the next method's workspace is its own


def run_shape(runner: Runner, context: int, batch: int, methods, sizes: dict, log) -> list[dict]:
    vocab = runner.draft.config.vocab_size
    conv = Conversation.random(batch, context, sizes["follow_ups"] + 1, sizes["question_tokens"],
                               sizes["new_tokens"], vocab, runner.device)  # fmt: skip
    records = []

    def add(method, turn, conv, record):
        prompt = conv.prompt(turn).shape[1]
        record = dict(method=method, turn=turn, context=context, batch=batch, prompt_tokens=prompt,
                      new_tokens=conv.new_tokens, **record)  # fmt: skip
        records.append(record)
        log(record)

    for method in methods:
        if method == "stock_assisted_reuse" and batch != 1:
            continue
        (run_dustin if method in DUSTIN else run_plain)(runner, method, conv, add)
    base = {r["turn"]: r["seconds"] for r in records if r["method"] == "generate_reuse"}
    for r in records:
        r["x_vs_plain_reuse"] = base[r["turn"]] / r["seconds"] if r["turn"] in base else None
    return records


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help=f"document tokens (default {CONTEXTS})")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help=f"rows (default {BATCHES})")
    parser.add_argument("--turns", type=int, default=None, help=f"follow-up turns after turn 0 (default {FOLLOW_UPS})")
    parser.add_argument("--new-tokens", type=int, default=None, help=f"asked per turn (default {NEW_TOKENS})")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--predictions",
        nargs="+",
        default=None,
        metavar="TRACE",
        help="the real pair's per-position predictions (default benchmarks/traces/*_predictions_*_ctx{4096,8192}_*)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, SYNTHETIC predictions")
    parser.add_argument("--out", default=None, help="save the results JSON here (rewritten after every shape)")
    return parser


def _sources(args) -> tuple[Sources, dict, tuple, torch.device, torch.dtype, str]:
    """The replays, the sizes, the models' shapes, device and dtype, and the acceptance line."""
    if args.smoke:
        budget = SMOKE["budget"]
        predictions = [synthetic_predictions(gamma=GAMMA, budget=b, seed=s) for b, s in ((budget, 0), (budget * 4, 1))]
        acceptance = "SYNTHETIC predictions (--smoke): nothing here is a measurement"
        sizes, models, device, dtype = dict(SMOKE), ("tiny", "tiny-draft"), torch.device("cpu"), torch.float32
    else:
        budget = BUDGET
        paths = args.predictions or sorted(
            str(p) for c in (4096, 8192) for p in Path("benchmarks/traces").glob(f"*_predictions_*_ctx{c}_*.json")
        )
        predictions = load_predictions(paths, GAMMA)
        acceptance = (
            f"REPLAYED from the real pair's teacher-forced predictions ({len(paths)} files); stock_assisted_reuse "
            "on a pair that always agrees (its best case), its tokens wrong (the prompt fed again over the cache)"
        )
        sizes = dict(contexts=CONTEXTS, batches=BATCHES, follow_ups=FOLLOW_UPS, new_tokens=NEW_TOKENS,
                     question_tokens=QUESTION_TOKENS)  # fmt: skip
        models, device, dtype = ("7b", "0.5b"), torch.device("cuda:0"), torch.bfloat16
    for key, value in (("contexts", args.contexts), ("batches", args.batches), ("follow_ups", args.turns),
                       ("new_tokens", args.new_tokens)):  # fmt: skip
        if value is not None:
            sizes[key] = value
    exact = budget if args.smoke else DustinConfig(mode="exact").budget
    sources = Sources(predictions, counts={}, knob=None, knob_target=None, budget=budget, exact_budgets=(exact,),
                      synthetic=args.smoke)  # fmt: skip
    return sources, sizes, models, device, dtype, acceptance


def _print(r: dict) -> None:
    x, prefill = r.get("x_vs_plain_reuse"), r.get("prefill_seconds")
    note = "  TOKENS WRONG in stock (prompt fed again over the cache)" if r.get("tokens_wrong_in_stock") else ""
    note += f"  (warmup {r['warmup_seconds']:.2f} s)" if "warmup_seconds" in r else ""
    note += f"  (document cache {r['prefix_cache_seconds']:.2f} s)" if "prefix_cache_seconds" in r else ""
    print(
        f"{r['method']:<21} {r['context']:>6} {r['batch']:>3} {r['turn']:>4} {r['prompt_tokens']:>7} "
        f"{r['seconds']:>7.2f} {'' if prefill is None else f'{prefill:.2f}':>8} {r['prefill_tokens']:>9} "
        f"{'' if x is None else f'{x:.2f}':>7} {r['peak_gib'] or 0:>6.1f}{note}",
        flush=True,
    )


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    sources, sizes, models, device, dtype, acceptance = _sources(args)
    torch.manual_seed(0)
    target = build_model(models[0], [device], dtype)
    draft = build_model(models[1], [device], dtype, vocab_size=SHAPES[models[0]]["vocab_size"])  # as whole_call's
    runner = Runner(target, draft, sources, device)
    warm = torch.zeros(1, 64, dtype=torch.long, device=device)  # CUDA / cuBLAS start-up, outside every clock
    target.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
    result = dict(
        benchmark="conversation",
        command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        pair=f"Qwen2.5-{models[0]} + {models[1]} shapes, random weights ({dtype})",
        acceptance=acceptance,
        gamma=GAMMA,
        budget=sources.budget,
        sizes={k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
        machine=platform.node(),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        versions=versions(),
        records=[],
    )
    print(acceptance, flush=True)
    print(f"{'method':<21} {'ctx':>6} {'b':>3} {'turn':>4} {'prompt':>7} {'s':>7} {'prefill':>8} {'prefill_t':>9} "
          f"{'x reuse':>7} {'GiB':>6}", flush=True)  # fmt: skip
    try:
        _run_shapes(runner, sizes, args, result)
    finally:
        runner.handle.unpatch()  # the process (a test's, say) gets transformers' registrations back
    print(json.dumps({"records": len(result["records"])}))
    return result


def _run_shapes(runner: Runner, sizes: dict, args, result: dict) -> None:
    for context in sizes["contexts"]:
        for batch in sizes["batches"]:
            records = run_shape(runner, context, batch, args.methods, sizes, _print)
            result["records"] += records
            for r in records:
                if r["method"] != "generate_reuse" and r["x_vs_plain_reuse"] is not None:
                    print(
                        f"  {r['method']} turn {r['turn']}: x{r['x_vs_plain_reuse']:.2f} vs generate_reuse", flush=True
                    )
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
