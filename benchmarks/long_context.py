"""The real pair at 16k and 32k on one GPU: retrieval, free-running text, teacher-forced fidelity, whole calls.

Every other GPU figure runs random weights and replays acceptance recorded on the CPU at 4k/8k; this runs the real
Qwen2.5-Coder 1.5B (target) / 0.5B (draft) pair, bf16, at the paper's lengths, in four phases (``--phases``):

* ``retrieval``: needle prompts (:mod:`dustin_lab.needle`, chat template, a passphrase at depths spread over the
  haystack), left-padded batches of ``--batch``: plain greedy ``generate()`` (stock; its batches hold at most 8 rows,
  since stock's padded prefill builds a (rows, prompt, prompt) mask), then every setting through ``generate(...,
  assistant_model=draft)``. Per prompt and method: the answer, whether it holds the passphrase, whether its tokens
  equal plain greedy's.
* ``free``: free-running continuations of raw text windows (the books and a Python source file, ``--rows`` offsets
  spread over the texts), end-of-text not stopping, greedy (and sampling with ``--sampling``): per row and method
  the repetition of the text (distinct 4-grams, the longest span that occurs twice, whether the tail loops, the share
  of 8-grams copied from the prompt), the mean NLL of the text under the dense target, where it leaves plain greedy's
  text, and the drafts kept per step.
* ``fidelity``: the teacher-forced walk (:mod:`dustin_lab.walk`) on each text: perplexity ratio and top-1
  agreement against dense verification, per method (Dustin's set, the selection layers, the oracle set); it writes
  the prediction traces (``--traces``) that the 7B-shape benchmarks replay (``e2e.py --predictions``).
* ``calls``: whole warm ``generate()`` calls, nothing replayed or stored: plain, stock assisted (batch 1), classic
  speculative decoding, the default (``DustinConfig()``), Dustin's set at 512 + ``sparse_draft``, exact mode with
  Dustin's set; seconds and drafts kept per step.

The settings (``--settings``, :data:`SETTINGS`; ``--extra NAME=JSON`` adds one) are ``cache_config`` overrides of
``DustinConfig()`` — what ``dustin_hf.patch(model)`` gives a user — or ``dense`` (the loop, dense verification).
``--phases check`` compares the converted pair with the CPU conversion (``docs/real_pair_on_gpu.md``); ``rescore``
derives the records' answers and summaries again from their stored tokens; ``--publish DIR`` merges the phase files
of one or more runs into ``DIR/real_pair_*.json``, without the free-running token lists.
Retrieval and free-running text read each prompt once: the prompts of a batch are prefilled by the loop's own
prefill (:func:`dustin_lab.prefilled.prefill_pair`) and every setting starts from a copy
(:class:`~dustin_lab.prefilled.PrefillStore` through ``patch(..., hooks=)``), which the test
``test_stored_prefills_serve_a_left_padded_batch_through_generate`` shows gives the tokens of the same call prefilled
by the loop. Records go to ``--out`` after every batch; a phase run again with the same ``--out`` skips what is
there (a GPU call cut at its time limit resumes).

    python benchmarks/long_context.py --phases free --contexts 32768 --out DIR  # one GPU, the real pair
    python benchmarks/long_context.py --smoke --out /tmp/lc                     # tiny models, CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.experimental import DecodeHooks, resolve
from dustin_lab.models import fetch_pair
from dustin_lab.needle import make_needles, needle_found
from dustin_lab.pair import describe_machine, load_pair
from dustin_lab.prefilled import PrefillStore, dustin_attention_on, prefill_pair
from dustin_lab.texts import book_tokens, describe_text, token_window
from dustin_lab.traces import prediction_record, write_predictions
from dustin_lab.walk import teacher_forced_walk

GAMMA = 4  # drafts a step: the library's default when the draft's generation config names none
TEXTS = ("emma", "mobydick", "prideprejudice", "stdlib:_pydecimal")
NEEDLE_BOOKS = ("emma", "mobydick", "prideprejudice", "paradise_lost")
STOCK_BATCH = 8  # plain greedy's padded prefill materialises a (rows, prompt, prompt) boolean mask
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.8)  # the Qwen2.5-Instruct recommendation

# name -> cache_config overrides of DustinConfig() ("dense": dense verification in the loop, no cache_config); each
# names its selection, so a name means what it meant in the recorded results whatever the library's default
_DUSTIN, _VERIFY = {"selection": "dustin"}, {"selection": "verify"}
SETTINGS: dict[str, dict | None] = {
    "dense": None,
    "sparse512": {"budget": 512, **_DUSTIN},
    "sparse512_r128": {"budget": 512, "recent_tokens": 128, **_DUSTIN},
    "sparse512_r256": {"budget": 512, "recent_tokens": 256, **_DUSTIN},
    "sparse1024": {"budget": 1024, **_DUSTIN},
    "sparse1024_r128": {"budget": 1024, "recent_tokens": 128, **_DUSTIN},
    "sparse2048": {"budget": 2048, **_DUSTIN},
    "sparse2048_r128": {"budget": 2048, "recent_tokens": 128, **_DUSTIN},
    "sparse512_history": {"budget": 512, "draft_share": 0, **_DUSTIN},  # the fill by the target's history alone
    "sparse512_lookahead": {"budget": 512, "draft_share": 492, **_DUSTIN},  # by the draft's lookahead alone
    "select512": {"budget": 512, **_VERIFY},
    "select1024": {"budget": 1024, **_VERIFY},
    "select2048": {"budget": 2048, **_VERIFY},  # the library's default since the 32k study
    "select2048_sd": {"budget": 2048, "sparse_draft": True, **_VERIFY},
    "sparse512_sd": {"budget": 512, "sparse_draft": True, **_DUSTIN},  # the headline setting before the 32k study
    "sparse512_sd_r128": {"budget": 512, "sparse_draft": True, "recent_tokens": 128, **_DUSTIN},
    "exact": {"mode": "exact", "sparse_draft": True, "budget": 2048, **_DUSTIN},
    "exact_r128": {"mode": "exact", "sparse_draft": True, "budget": 2048, "recent_tokens": 128, **_DUSTIN},
}


# ----------------------------------------------------------------------------- text measures


def distinct(tokens: list[int], n: int = 4) -> float:
    """Distinct ``n``-grams over all ``n``-grams of ``tokens`` (1.0: none repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def longest_repeat(tokens: list[int]) -> int:
    """The longest span of ``tokens`` that occurs at least twice (the occurrences may overlap)."""
    t = torch.tensor(tokens)
    best = 0
    for shift in range(1, t.numel()):
        same = (t[shift:] == t[:-shift]).int()
        if not same.any():
            continue
        # longest run of ones: positions since the last zero
        idx = torch.arange(same.numel())
        last_zero = torch.cummax(torch.where(same == 0, idx, torch.full_like(idx, -1)), dim=0).values
        best = max(best, int((idx - last_zero).max()))
    return best


def loop_period(tokens: list[int], tail: int = 64, max_period: int = 128) -> int | None:
    """The shortest period ``p <= max_period`` with which the last ``tail`` tokens repeat the ``tail`` before them
    shifted by ``p`` (the text ends in a loop), else ``None``."""
    for p in range(1, max_period + 1):
        if len(tokens) < tail + p:
            break
        if tokens[-tail:] == tokens[len(tokens) - tail - p : len(tokens) - p]:
            return p
    return None


def copied_share(tokens: list[int], prompt: list[int], n: int = 8) -> float:
    """The share of the text's ``n``-grams that occur in the prompt (verbatim copying of the context)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    return sum(g in seen for g in grams) / len(grams)


def first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# ----------------------------------------------------------------------------- the run


class Study:
    """The loaded pair, the patch with its prefill store, and the records of one ``--out`` folder."""

    def __init__(self, args):
        self.args = args
        if args.smoke:
            from dustin_lab.tiny import tiny_pair

            target_dir, draft_dir = tiny_pair()
        else:
            target_dir, draft_dir = fetch_pair(progress=not args.quiet)
        self.pair = load_pair(target_dir, draft_dir, args.device, args.dtype)
        self.target, self.draft, self.tok = self.pair.target, self.pair.draft, self.pair.tokenizer
        self.draft.generation_config.num_assistant_tokens = GAMMA
        self.draft.generation_config.num_assistant_tokens_schedule = "constant"
        self.draft.generation_config.assistant_confidence_threshold = None
        self.device = self.pair.device
        self.store = PrefillStore(self.target, self.draft)
        self.handle = dustin_hf.patch(self.target, hooks=DecodeHooks(prefill=self.store.hook()))
        self.settings = {**{n: SETTINGS[n] for n in args.settings}, **args.extra}
        if args.min_context is not None:  # below the library's 2048 (short smoke prompts)
            self.settings = {
                n: c if c is None else {"min_context": args.min_context, **c} for n, c in self.settings.items()
            }
        t_cfg, d_cfg = self.target.config.get_text_config(), self.draft.config.get_text_config()
        self.resolved = {
            n: None if c is None else resolve(DustinConfig().replace(**c), t_cfg, d_cfg)
            for n, c in self.settings.items()
        }
        # the scoring layers every setting's history reads (prefilled once for all)
        self.history_layers = tuple(sorted({r.target_layer for r in self.resolved.values() if r is not None}))
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()

    def time_left(self) -> bool:
        return self.args.time_limit is None or time.perf_counter() - self.started < self.args.time_limit

    # -- records
    def path(self, phase: str) -> Path:
        return self.out / f"{phase}.json"

    def load(self, phase: str) -> dict:
        """The phase's report so far (a run cut at its time limit resumes it), with this run's command and
        settings added to its ``runs``."""
        path = self.path(phase)
        run = {"command": " ".join([Path(sys.executable).name] + sys.argv), "settings": self.settings}
        if path.is_file():
            report = json.loads(path.read_text())
            runs = report.setdefault("runs", [{"command": report.get("command"), "settings": report.get("settings")}])
            if runs[-1] != run:
                runs.append(run)
            return report
        return {
            **run,
            "machine": describe_machine(self.device),
            "model_pair": self.pair.describe(),
            "gamma": GAMMA,
            "runs": [run],
            "records": [],
        }

    def save(self, phase: str, report: dict) -> None:
        self.path(phase).write_text(json.dumps(report, indent=1) + "\n")

    # -- generation
    def generate(self, ids, mask, setting: str | None, new_tokens: int, sampling: bool, seed: int):
        """``generate()`` of the batch: plain (``setting=None``), or with the draft and a setting's cache_config
        (:meth:`call`)."""
        kwargs = {}
        if setting is not None:
            kwargs["assistant_model"] = self.draft
            if self.settings[setting] is not None:
                kwargs.update(cache_implementation="dustin", cache_config=dict(self.settings[setting]))
        return self.call(ids, mask, kwargs, new_tokens, sampling, seed)

    def call(self, ids, mask, kwargs: dict, new_tokens: int, sampling: bool = False, seed: int = 0):
        """One timed ``generate()`` of the batch with ``kwargs`` (the draft, the cache implementation and config).
        End-of-text never stops a row. Returns (tokens per row, the loop's stats or None, seconds)."""
        config = GenerationConfig(
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=self.pad,
            **(SAMPLING if sampling else dict(do_sample=False)),
        )
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        out = self.target.generate(ids, attention_mask=mask, generation_config=config, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        # the loop runs with "dustin", or with a draft for more than one row (one row with a draft: stock's own)
        looped = "cache_implementation" in kwargs or "assistant_model" in kwargs and ids.shape[0] > 1
        return out[:, ids.shape[1] :].tolist(), self.loop_stats(looped), seconds

    def loop_stats(self, looped: bool) -> dict | None:
        """The stats of the last call's decode loop, read from the caches the patch keeps for the next call (a
        returned cache would be a stock-layout copy of the whole KV cache); ``None`` for stock's own calls."""
        held = self.handle.workspaces.held
        return held.last_stats.as_dict() if looped and held is not None else None

    @property
    def pad(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    def prefill_rows(self, rows: list[torch.Tensor]) -> None:
        """Both models read each prompt once; every setting then starts from a copy. The stored caches keep room
        for the generated text (:class:`_Scorer` reads it there)."""
        self.release()
        for ids in rows:
            self.store.add(
                prefill_pair(
                    self.target,
                    self.draft,
                    ids.to(self.device),
                    self.history_layers,
                    chunk=None,
                    capacity=self.args.new_tokens + 1,
                )
            )

    def release(self) -> None:
        """Drop the stored prefills and the loop's held caches and graphs (before stock's own prefill, say)."""
        self.store.clear()
        self.handle.release()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _padded(rows: list[torch.Tensor], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.numel() :] = r
        mask[b, width - r.numel() :] = 1
    return ids.to(device), mask.to(device)


def _summary(stats: dict | None) -> dict:
    if stats is None:
        return {}
    keep = (
        "sparse_steps",
        "dense_steps",
        "mean_attended",
        "mean_accepted_per_step",
        "prefill_seconds",
        "decode_seconds",
    )
    return {k: stats.get(k) for k in keep if k in stats} | ({"exact": stats["exact"]} if "exact" in stats else {})


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ----------------------------------------------------------------------------- retrieval


def retrieval(study: Study, context: int) -> None:
    args, tok = study.args, study.tok
    report = study.load("retrieval")
    done = {(r["context"], r["method"], r["prompt"]) for r in report["records"]}
    depths = [i / (args.prompts - 1) for i in range(args.prompts)]
    needles = make_needles(tok, list(NEEDLE_BOOKS), [context], depths, seed=args.seed)
    methods = ["plain", *study.settings]
    for first in range(0, len(needles), args.batch):
        batch = needles[first : first + args.batch]
        todo = [m for m in methods if any((context, m, first + i) not in done for i in range(len(batch)))]
        if not todo or not study.time_left():
            continue
        plain = {
            r["prompt"]: r["tokens"] for r in report["records"] if r["context"] == context and r["method"] == "plain"
        }
        if "plain" in todo:  # stock, in batches of at most STOCK_BATCH rows
            study.release()
            for part in range(0, len(batch), STOCK_BATCH):
                rows = [n.prompt_ids for n in batch[part : part + STOCK_BATCH]]
                tokens, _, seconds = study.generate(
                    *_padded(rows, study.pad, study.device), None, args.answer_tokens, False, args.seed
                )
                for i, t in enumerate(tokens):
                    plain[first + part + i] = t
                    report["records"].append(
                        _needle_record(
                            tok, batch[part + i], first + part + i, context, "plain", t, None, seconds, None
                        )
                    )
            study.save("retrieval", report)
        study.prefill_rows([n.prompt_ids for n in batch])
        ids, mask = _padded([n.prompt_ids for n in batch], study.pad, study.device)
        for method in todo:
            if method == "plain" or not study.time_left():
                continue
            tokens, stats, seconds = study.generate(ids, mask, method, args.answer_tokens, False, args.seed)
            for i, t in enumerate(tokens):
                report["records"].append(
                    _needle_record(tok, batch[i], first + i, context, method, t, plain.get(first + i), seconds, stats)
                )
            correct = sum(r["correct"] for r in report["records"][-len(batch) :])
            print(
                f"retrieval {context} prompts {first}-{first + len(batch) - 1} {method}: {correct}/{len(batch)} "
                f"correct, {seconds:.1f} s",
                flush=True,
            )
            study.save("retrieval", report)
    study.store.clear()
    report["summary"] = _retrieval_summary(report["records"])
    study.save("retrieval", report)


def _reply(tok, tokens: list[int]) -> list[int]:
    """The answer's tokens: up to the first special token (end of text or of the turn), where ``generate()`` with
    the model's end-of-text ids would have stopped; the runs generate past it so that every row makes the same
    number of tokens."""
    special = set(tok.all_special_ids)
    return next((tokens[:i] for i, t in enumerate(tokens) if t in special), tokens)


def _needle_record(tok, needle, index, context, method, tokens, plain, seconds, stats) -> dict:
    reply = _reply(tok, tokens)
    answer = tok.decode(reply, skip_special_tokens=True)
    return {
        "context": context,
        "method": method,
        "prompt": index,
        **needle.describe(),
        "answer": answer,
        "tokens": tokens,
        "correct": needle_found(answer, needle),
        "same_as_plain": None if plain is None else reply == _reply(tok, plain),
        "seconds": seconds,
        **_summary(stats),
    }


def rescore(study: Study) -> None:
    """Derive the retrieval records' answers, correctness and agreement with plain greedy again from their stored
    tokens (after a change to how an answer is read), and every summary."""
    report = study.load("retrieval")
    plain = {(r["context"], r["prompt"]): r["tokens"] for r in report["records"] if r["method"] == "plain"}
    for r in report["records"]:
        reply = _reply(study.tok, r["tokens"])
        r["answer"] = study.tok.decode(reply, skip_special_tokens=True)
        r["correct"] = r["passphrase"].lower() in r["answer"].lower()
        ref = plain.get((r["context"], r["prompt"]))
        r["same_as_plain"] = None if ref is None or r["method"] == "plain" else reply == _reply(study.tok, ref)
    report["summary"] = _retrieval_summary(report["records"])
    study.save("retrieval", report)
    free = study.load("free")
    free["summary"] = _free_summary(free["records"], study.args.batch)
    study.save("free", free)


def _retrieval_summary(records: list[dict]) -> dict:
    out = {}
    for r in records:
        entry = out.setdefault(
            f"{r['context']}/{r['method']}",
            {"prompts": 0, "correct": 0, "same_as_plain": 0, "missed_where_plain_found": []},
        )
        entry["prompts"] += 1
        entry["correct"] += bool(r["correct"])
        entry["same_as_plain"] += bool(r["same_as_plain"]) or r["method"] == "plain"
    plain_found = {(r["context"], r["prompt"]) for r in records if r["method"] == "plain" and r["correct"]}
    for r in records:
        if r["method"] != "plain" and not r["correct"] and (r["context"], r["prompt"]) in plain_found:
            out[f"{r['context']}/{r['method']}"]["missed_where_plain_found"].append(round(r["depth"], 3))
    return out


# ----------------------------------------------------------------------------- free-running text


def windows(study: Study, context: int) -> list[tuple[str, int, torch.Tensor]]:
    """``--rows`` windows of ``context`` tokens, offsets spread over each text, the texts taking turns (every batch
    mixes them)."""
    args = study.args
    per_text = math.ceil(args.rows / len(args.texts))
    by_text = []
    for text in args.texts:
        total = book_tokens(study.tok, text).numel()
        room = total - context - args.new_tokens
        if room < 0:
            raise ValueError(f"{text} has {total:,} tokens: too short for {context:,}-token windows")
        offsets = [room * i // max(per_text - 1, 1) for i in range(per_text)]
        by_text.append([(text, offset, token_window(study.tok, text, context, offset)) for offset in offsets])
    return [rows[i] for i in range(per_text) for rows in by_text][: args.rows]


def free_running(study: Study, context: int) -> None:
    args = study.args
    report = study.load("free")
    done = {(r["context"], r["method"], r["sampling"], r["row"]) for r in report["records"]}
    rows = windows(study, context)
    modes = [False, True] if args.sampling else [False]
    for first in range(0, len(rows), args.batch):
        batch = rows[first : first + args.batch]
        index = range(first, first + len(batch))
        jobs = [
            (m, s)
            for s in modes
            for m in (["plain"] if not s else []) + list(study.settings)
            if (not s or m in args.sampling) and any((context, m, s, i) not in done for i in index)
        ]
        if not jobs or not study.time_left():
            continue
        ids = torch.stack([w for _, _, w in batch]).to(study.device)
        mask = torch.ones_like(ids)
        reference = {
            r["row"]: r["tokens"]
            for r in report["records"]
            if r["context"] == context and r["method"] == "plain" and not r["sampling"]
        }
        if ("plain", False) in jobs:
            study.release()
            tokens, _, seconds = study.generate(ids, mask, None, args.new_tokens, False, args.seed)
            for i, t in zip(index, tokens):
                reference[i] = t
            report["records"] += _free_records(
                study, batch, index, context, "plain", False, tokens, None, seconds, reference, None
            )
            study.save("free", report)
            print(f"free {context} rows {first}-{index[-1]} plain: {seconds:.1f} s", flush=True)
        study.prefill_rows([w for _, _, w in batch])
        scorer = _Scorer(study, batch)
        for method, sampling in jobs:
            if method == "plain" or not study.time_left():
                continue
            tokens, stats, seconds = study.generate(ids, mask, method, args.new_tokens, sampling, args.seed + first)
            nll = scorer.nll(tokens)
            report["records"] += _free_records(
                study, batch, index, context, method, sampling, tokens, stats, seconds, reference, nll
            )
            study.save("free", report)
            looped = sum(loop_period(t) is not None for t in tokens)
            print(
                f"free {context} rows {first}-{index[-1]} {method}{' sampling' if sampling else ''}: "
                f"distinct-4 {sum(map(distinct, tokens)) / len(tokens):.3f}, {looped} looping, "
                f"NLL {sum(nll) / len(nll):.3f}, {seconds:.1f} s",
                flush=True,
            )
        del scorer
        study.store.clear()
    report["summary"] = _free_summary(report["records"], args.batch)
    study.save("free", report)


class _Scorer:
    """The mean NLL of each row's text under the dense target, from the stored prefills: a dense forward over each
    row's text in the slots its stored cache reserves past the prompt (the prompt is not read again, and the stored
    positions stay as they were: only the row's length moves, and it is set back)."""

    def __init__(self, study: Study, batch):
        from dustin_hf.experimental import ModelRunner
        from dustin_hf.kernels import resolve_backend

        self.study = study
        backend = resolve_backend("auto", study.device)
        states = [study.store.find(w.to(study.device)) for _, _, w in batch]
        self.rows = [
            (s.tokens.numel(), s.last_logits.float(), ModelRunner(study.target, s.target_cache, backend))
            for s in states
        ]

    def nll(self, tokens: list[list[int]]) -> list[float]:
        from dustin_hf.experimental import ForwardPlan

        out = []
        with torch.no_grad(), dustin_attention_on(self.study.target, self.study.draft):
            for (context, first, runner), row in zip(self.rows, tokens):
                ids = torch.tensor(row, device=self.study.device)
                plan = ForwardPlan(
                    rows=slice(0, 1), cache_seqlens=[context], q_len=ids.numel() - 1, backend=runner.backend
                )
                logits = runner.forward(plan, ids[None, :-1], keep=ids.numel() - 1)[0].float()  # (n-1, V)
                runner.cache.rollback([context])
                logits = torch.cat([first[None].to(logits.device), logits])
                out.append(float(torch.nn.functional.cross_entropy(logits, ids)))
        return out


def _free_records(study, batch, index, context, method, sampling, tokens, stats, seconds, reference, nll) -> list:
    records = []
    for j, (i, t) in enumerate(zip(index, tokens)):
        text, offset, window = batch[j]
        ref = reference.get(i)
        records.append(
            {
                "context": context,
                "method": method,
                "sampling": sampling,
                "row": i,
                "text": text,
                "offset": offset,
                "budget": None if study.settings.get(method) is None else study.resolved[method].budget,
                "distinct4": distinct(t),
                "longest_repeat": longest_repeat(t),
                "loop_period": loop_period(t),
                "copied8": copied_share(t, window.tolist()),
                "nll": None if nll is None else nll[j],
                "leaves_plain_at": None if ref is None or sampling else first_difference(t, ref),
                "seconds": seconds,
                "batch_rows": len(batch),
                **_summary(stats),
                "tokens": t,
            }
        )
    return records


REFERENCES = ("plain", "dense", "exact")  # the target's own text: stock greedy, the dense loop, exact mode


def _free_summary(records: list[dict], batch: int = 16) -> dict:
    """Per context, method and decoding: the means over rows, and per context and decoding the dense references'
    spread (the least and the most of each measure over :data:`REFERENCES`, greedy; the dense loop alone samples
    the target's own law). ``drafts_kept_per_step`` is per row (a record's batch holds ``batch_rows``, else
    ``batch``)."""
    groups = {}
    for r in records:
        groups.setdefault((r["context"], r["method"], "sampling" if r["sampling"] else "greedy"), []).append(r)
    summary = {}
    for (context, method, mode), rs in groups.items():
        n = len(rs)
        leaves = sorted(r["leaves_plain_at"] for r in rs if r["leaves_plain_at"] is not None)
        nll = [r["nll"] for r in rs if r["nll"] is not None]
        kept = [
            r["mean_accepted_per_step"] / r.get("batch_rows", batch)
            for r in rs
            if r.get("mean_accepted_per_step") is not None
        ]
        summary[f"{context}/{method}/{mode}"] = {
            "rows": n,
            "distinct4": sum(r["distinct4"] for r in rs) / n,
            "rows_distinct4_under_0.3": sum(r["distinct4"] < 0.3 for r in rs),
            "rows_looping": sum(r["loop_period"] is not None for r in rs),
            "longest_repeat_median": sorted(r["longest_repeat"] for r in rs)[n // 2],
            "copied8": sum(r["copied8"] for r in rs) / n,
            "nll": sum(nll) / len(nll) if nll else None,
            "leaves_plain_median": leaves[len(leaves) // 2] if leaves else None,
            "drafts_kept_per_step_per_row": sum(kept) / len(kept) if kept else None,
            "distinct4_by_text": {
                t: sum(r["distinct4"] for r in rs if r["text"] == t) / sum(r["text"] == t for r in rs)
                for t in sorted({r["text"] for r in rs})
            },
        }
    for context in sorted({c for c, _, _ in groups}):
        refs = [summary[f"{context}/{m}/greedy"] for m in REFERENCES if f"{context}/{m}/greedy" in summary]
        if refs:
            summary[f"{context}/dense_spread/greedy"] = {
                key: [min(r[key] for r in refs if r[key] is not None), max(r[key] for r in refs if r[key] is not None)]
                for key in (
                    "distinct4",
                    "rows_distinct4_under_0.3",
                    "rows_looping",
                    "longest_repeat_median",
                    "copied8",
                    "nll",
                )
                if any(r[key] is not None for r in refs)
            }
    return summary


# ----------------------------------------------------------------------------- teacher-forced fidelity


def fidelity(study: Study, context: int) -> None:
    """The walk per text: dense, every sparse setting of ``--walk-settings``, and the oracle set at each budget."""
    args = study.args
    report = study.load("fidelity")
    done = {(r["context"], r["text"]) for r in report["records"]}
    t_cfg, d_cfg = study.target.config.get_text_config(), study.draft.config.get_text_config()
    methods = {"dense": None}
    for name in args.walk_settings:
        methods[name] = resolve(
            DustinConfig(min_context=args.min_context or 1024).replace(**{**SETTINGS, **args.extra}[name]),
            t_cfg,
            d_cfg,
        )
    oracle = {}
    for budget in args.oracle_budgets:
        methods[f"oracle{budget}"] = resolve(
            DustinConfig(budget=budget, min_context=args.min_context or 1024, selection="dustin"), t_cfg, d_cfg
        )  # reads its own sets
        oracle[f"oracle{budget}"] = "shared"
    layers = tuple(sorted({m.target_layer for m in methods.values() if m is not None}))
    names = study.pair.describe()
    pair_names = {"target": names["target"]["name"], "draft": names["draft"]["name"]}
    for text in args.texts:
        if (context, text) in done or not study.time_left():
            continue
        window = token_window(study.tok, text, context + args.walk_tokens, args.walk_offset)
        started = time.perf_counter()
        state = prefill_pair(study.target, study.draft, window[:context].to(study.device), layers, chunk=None)
        walk = teacher_forced_walk(
            study.target,
            study.draft,
            state,
            window[context:],
            GAMMA,
            methods,
            recovery_every=1 if oracle else 0,
            oracle=oracle,
            progress=not args.quiet,
            desc=f"walk {text}@{context}",
        )
        dense = walk.predictions["dense"]
        record = {
            "context": context,
            "text": text,
            "offset": args.walk_offset,
            "positions": walk.tokens,
            "seconds": time.perf_counter() - started,
            "dense_ppl": walk.ppl["dense"],
            "dense_tf_accepted": walk.accepted["dense"],
            "methods": {},
        }
        for name, cfg in methods.items():
            if cfg is None:
                continue
            record["methods"][name] = {
                "budget": cfg.budget,
                "ppl_ratio": walk.ppl[name] / walk.ppl["dense"],
                "top1_agreement": walk.top1_agreement_with_dense[name],
                "tf_accepted": walk.accepted[name],
                "recovery": walk.recovery.get(name),
                "config": {
                    k: v
                    for k, v in asdict(cfg).items()
                    if k in ("budget", "recent_tokens", "sink_tokens", "selection_layers", "sparse_draft")
                },
            }
            if args.traces and name not in oracle and cfg.sparse_draft:  # what e2e.py --predictions replays
                predictions = {
                    "truth": walk.truth,
                    "dense": dense,
                    "sparse": walk.predictions[name],
                    "draft": walk.draft_predictions["dense"],
                    "draft_sparse": walk.draft_predictions[name],
                }
                trace = prediction_record(
                    pair_names,
                    {**describe_text(text), "offset": args.walk_offset},
                    context,
                    GAMMA,
                    cfg.budget,
                    asdict(cfg),
                    predictions,
                    names["dtype"],
                    names["device"],
                )
                record["methods"][name]["trace"] = str(write_predictions(Path(args.traces) / name, trace))
        report["records"].append(record)
        print(
            f"fidelity {context} {text}: "
            + ", ".join(
                f"{n} ppl x{m['ppl_ratio']:.3f} top1 {m['top1_agreement']:.3f}" for n, m in record["methods"].items()
            ),
            flush=True,
        )
        study.save("fidelity", report)
        del state, walk
        gc.collect()
    study.save("fidelity", report)


# ----------------------------------------------------------------------------- whole calls


def calls(study: Study, context: int) -> None:
    """Whole warm calls, nothing stored or replayed: each method twice (first, warm) per batch size."""
    args = study.args
    report = study.load("calls")
    study.store.clear()
    floor = {} if args.min_context is None else {"min_context": args.min_context}
    loop = {  # cache_config of each of the loop's methods (classic: dense, no row reaching min_context)
        "classic": {"min_context": 2**30},
        "default": floor,  # the default: DustinConfig() as it comes
        "dustin_sparse_draft": {**SETTINGS["sparse512_sd"], **floor},
        "exact": {**SETTINGS["exact"], **floor},
    }
    rows = windows(study, context)
    hooks, study.handle.hooks = study.handle.hooks, None  # no stored prefill: the call reads its prompt
    try:
        for batch_size in args.call_batches:
            ids = torch.stack([w for _, _, w in rows[:batch_size]]).to(study.device)
            mask = torch.ones_like(ids)
            for method in ("plain", "stock_assisted", *loop):
                if method == "stock_assisted" and batch_size > 1 or not study.time_left():
                    continue
                if any(
                    r["context"] == context and r["batch"] == batch_size and r["method"] == method
                    for r in report["records"]
                ):
                    continue
                kwargs = {} if method == "plain" else dict(assistant_model=study.draft)
                if method in loop:
                    kwargs.update(cache_implementation="dustin", cache_config=dict(loop[method]))
                for kind in ("first", "warm"):
                    _, stats, seconds = study.call(ids, mask, kwargs, args.call_tokens)
                    out = {"seconds": seconds, **_summary(stats)}
                    report["records"].append(
                        {
                            "context": context,
                            "batch": batch_size,
                            "method": method,
                            "call": kind,
                            "new_tokens": args.call_tokens,
                            **out,
                        }
                    )
                    print(f"call {context}x{batch_size} {method} {kind}: {out['seconds']:.2f} s", flush=True)
                    study.save("calls", report)
    finally:
        study.handle.hooks = hooks
    plain = {(r["batch"], r["call"]): r["seconds"] for r in report["records"] if r["method"] == "plain"}
    for r in report["records"]:
        r["x_vs_plain"] = plain[(r["batch"], r["call"])] / r["seconds"] if (r["batch"], r["call"]) in plain else None
    study.save("calls", report)


# ----------------------------------------------------------------------------- the converted pair


CHECK_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
CHECK_TOKENS = 32


def check(study: Study) -> dict:
    """The converted pair against the CPU conversion: the sha256 of each model folder's weights (the safetensors'
    tensors by name, as stored) and the target's first greedy tokens on a fixed chat prompt, in float32 (and in the
    run's dtype). With ``--check-reference`` (a file written by a CPU run of this phase) says whether both match."""
    from safetensors.torch import load_file

    def digest(folder: Path) -> str:
        sha = hashlib.sha256()
        for file in sorted(folder.glob("*.safetensors")):
            tensors = load_file(file)
            for name in sorted(tensors):
                sha.update(name.encode())
                sha.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
        return sha.hexdigest()

    tok = study.tok
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": CHECK_PROMPT}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    else:  # the smoke test's tiny tokenizer
        ids = tok(CHECK_PROMPT, return_tensors="pt")["input_ids"]
    ids = ids.to(study.device)
    greedy = {}
    for dtype in (torch.float32, study.target.dtype):
        model = study.target.to(dtype)
        config = GenerationConfig(
            max_new_tokens=CHECK_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=study.pad
        )
        tokens = model.generate(ids, generation_config=config)[0, ids.shape[1] :]
        greedy[str(dtype).removeprefix("torch.")] = tokens.tolist()
    study.target.to(study.pair.dtype)
    result = {
        "prompt": CHECK_PROMPT,
        "device": str(study.device),
        "machine": describe_machine(study.device),
        "weights_sha256": {"target": digest(study.pair.target_dir), "draft": digest(study.pair.draft_dir)},
        "greedy": greedy,
    }
    if study.args.check_reference:
        reference = json.loads(Path(study.args.check_reference).read_text())
        result["reference"] = study.args.check_reference
        result["weights_match"] = reference["weights_sha256"] == result["weights_sha256"]
        result["float32_greedy_match"] = reference["greedy"]["float32"] == greedy["float32"]
        result["bfloat16_greedy_same_tokens"] = first_difference(
            reference["greedy"]["float32"], greedy.get("bfloat16", greedy["float32"])
        )
    (study.out / "check.json").write_text(json.dumps(result, indent=1) + "\n")
    print("check:", json.dumps({k: v for k, v in result.items() if k != "machine"}), flush=True)
    return result


# ----------------------------------------------------------------------------- publishing


PHASES = ("retrieval", "free", "fidelity", "calls", "check")


def publish(sources: list[Path], dest: Path, prefix: str = "real_pair_") -> list[Path]:
    """The phase files of one or more ``--out`` folders (runs of the same study, e.g. a later call adding settings),
    merged and written to ``dest/<prefix><phase>.json`` without the per-token lists of the free-running records
    (they stay in the sources; every summary is kept). Fidelity records of the same context and text merge their
    methods; other records are concatenated, a record already there from an earlier source skipped."""
    written = []
    dest.mkdir(parents=True, exist_ok=True)
    for phase in PHASES:
        files = [src / f"{phase}.json" for src in sources]
        reports = [json.loads(file.read_text()) for file in files if file.is_file()]
        if not reports:
            continue
        merged = reports[0]
        if phase != "check":
            merged["sources"] = [r.get("command") for r in reports]
            merged["runs"] = [run for r in reports for run in r.get("runs", [])]
            keys = {}
            for report in reports:
                for record in report.get("records", []):
                    key = _record_key(phase, record)
                    if phase == "fidelity" and key in keys:
                        keys[key]["methods"].update(record["methods"])
                    elif key not in keys:
                        keys[key] = record
            merged["records"] = list(keys.values())
            if phase == "free":
                merged["records"] = [{k: v for k, v in r.items() if k != "tokens"} for r in merged["records"]]
                merged["summary"] = reports[-1].get("summary", merged.get("summary"))
            elif phase == "retrieval":
                merged["summary"] = _retrieval_summary(merged["records"])
        path = dest / f"{prefix}{phase}.json"
        path.write_text(json.dumps(merged, indent=1) + "\n")
        written.append(path)
    return written


def _record_key(phase: str, record: dict) -> tuple:
    if phase == "fidelity":
        return record["context"], record["text"]
    if phase == "calls":
        return record["context"], record["batch"], record["method"], record["call"]
    if phase == "retrieval":
        return record["context"], record["method"], record["prompt"]
    return record["context"], record["method"], record["sampling"], record["row"]


# ----------------------------------------------------------------------------- main


def _extra(text: str) -> tuple[str, dict]:
    name, _, body = text.partition("=")
    if not name or not body:
        raise argparse.ArgumentTypeError(f"--extra takes NAME=JSON (cache_config overrides), got {text!r}")
    return name, json.loads(body)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        default=["retrieval", "free"],
        choices=("check", "retrieval", "free", "fidelity", "calls", "rescore"),
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--extra",
        type=_extra,
        nargs="*",
        default=[],
        metavar="NAME=JSON",
        help="more settings: cache_config overrides of DustinConfig(), e.g. 'r64={\"recent_tokens\": 64}'",
    )
    parser.add_argument(
        "--sampling",
        nargs="*",
        default=[],
        metavar="SETTING",
        help="free: also sample with these settings ('dense' is the target's own law)",
    )
    parser.add_argument("--texts", nargs="+", default=list(TEXTS))
    parser.add_argument("--rows", type=int, default=64, help="free: windows per context")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256, help="free: tokens per row")
    parser.add_argument("--prompts", type=int, default=32, help="retrieval: needle prompts per context")
    parser.add_argument("--answer-tokens", type=int, default=24, help="retrieval: answer tokens")
    parser.add_argument(
        "--walk-settings",
        nargs="+",
        default=["sparse512", "sparse1024", "sparse2048", "select512", "select1024", "select2048"],
    )
    parser.add_argument("--oracle-budgets", type=int, nargs="*", default=[512, 1024, 2048])
    parser.add_argument("--walk-tokens", type=int, default=1001, help="fidelity: teacher-forced tokens per text")
    parser.add_argument("--walk-offset", type=int, default=0)
    parser.add_argument(
        "--traces", default=None, help="fidelity: write the sparse-draft methods' prediction traces here"
    )
    parser.add_argument("--call-batches", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--call-tokens", type=int, default=256)
    parser.add_argument("--check-reference", default=None, help="check: the CPU run's check.json to compare with")
    parser.add_argument(
        "--min-context",
        type=int,
        default=None,
        help="every setting's min_context (default: the library's, 2048; the walk's 1024)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=None, help="seconds: start nothing new after this")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--smoke", action="store_true", help="tiny random models on the CPU, small sizes")
    parser.add_argument("--out", required=True, help="folder of the phase files (retrieval.json, free.json, ...)")
    parser.add_argument(
        "--publish",
        default=None,
        metavar="DIR",
        help="instead of running: merge the phase files of --out (and --also) into "
        "DIR/real_pair_*.json without the free-running token lists",
    )
    parser.add_argument("--also", nargs="*", default=[], metavar="OUT", help="--publish: more --out folders to merge")
    args = parser.parse_args(argv)
    if args.publish:
        for path in publish([Path(args.out), *map(Path, args.also)], Path(args.publish)):
            print("wrote", path)
        return
    args.extra = dict(args.extra)
    if args.smoke:
        args.contexts, args.rows, args.batch, args.new_tokens, args.prompts = [600], 4, 2, 24, 4
        args.walk_tokens, args.oracle_budgets, args.call_batches, args.call_tokens = 21, [64], [2, 1], 8
        args.answer_tokens, args.texts = 6, ["emma", "stdlib:typing"]
        args.min_context, args.sampling = 64, ["dense", "small"]
        args.extra = {
            **args.extra,
            "small": {"budget": 64, **_DUSTIN},
            "small_sd": {"budget": 64, "sparse_draft": True, **_DUSTIN},
            "small_select": {"budget": 64, **_VERIFY},
        }
        args.walk_settings, args.settings = ["small", "small_sd", "small_select"], ["dense", "exact"]
    unknown = [s for s in args.sampling if s not in args.settings and s not in args.extra]
    if unknown:
        raise SystemExit(f"--sampling names settings not run: {unknown}")
    bars = hf_logging.is_progress_bar_enabled()
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    if args.quiet:
        hf_logging.disable_progress_bar()
    study = Study(args)
    phases = {"retrieval": retrieval, "free": free_running, "fidelity": fidelity, "calls": calls}
    try:
        if "check" in args.phases:
            check(study)
        if "rescore" in args.phases:
            rescore(study)
        for phase in (p for p in args.phases if p not in ("check", "rescore")):
            for context in args.contexts:
                phases[phase](study, context)
    finally:  # the process may go on (a test): what this changed goes back
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        torch.set_grad_enabled(grad)
        study.release()
        study.handle.unpatch()


if __name__ == "__main__":
    main()
