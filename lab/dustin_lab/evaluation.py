"""Fidelity of Dustin against dense verification, on a real target/draft pair.

For each book window and context ``C`` (one prefill, reused by every run below):

* **continuations**: greedy speculative decoding of ``new_tokens`` tokens, dense and with Dustin at
  each budget (fixed γ, no early stop): mean accepted drafts per step, tokens per step, token
  agreement with the dense continuation, decode tokens/s; per-step acceptance traces are saved;
  with ``settings.exact`` also Dustin's exact mode at each budget (the same selection, sparse steps
  confirmed by dense ones): its continuation must be the dense one, and its confirm stats are kept;
* **teacher-forced walk** (:mod:`dustin_lab.walk`) over the next ``ppl_tokens`` tokens of the book:
  perplexity per budget and its ratio to dense; attention recovery of the selections actually made,
  and of the calibrated and the default heads' selections from the same (dense) signals.

With ``targets``, the quality knob (``min_recovery``, floor ``target_budget``, ceiling ``max_budget``) runs beside
the budgets at each target: in the continuations, and in the walk, where it also reports the positions read per
step (mean, p50, p95, max, dense fallbacks) and, for every sparse method, the per-step estimated recovery
beside the true one and their correlation (:mod:`dustin_lab.knob`).

Then **needles** (:mod:`dustin_lab.needle`): accuracy of dense and of each budget.

``criteria`` checks the targets at ``criteria_budget`` (512) for every context evaluated:
perplexity within 1% of dense, mean accepted length >= 97% of dense (in free-running generation,
where the Dustin and dense texts may diverge, and teacher-forced on the same text), needle accuracy
equal to dense, calibrated recovery above the default heads', and exact mode's continuations
identical to dense. ``knob_criteria`` checks every knob target the same way (perplexity within 1%,
teacher-forced acceptance >= 97% of dense) and its mean realised budget against ``knob_budget_limit`` (1024).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict

from tqdm.auto import tqdm

from dustin_hf import DustinConfig
from dustin_hf.experimental import config_for_budget, resolve

from .continuations import eos_ids, speculative_continuation, token_agreement
from .knob import budget_summary, correlation
from .needle import make_needles, needle_found
from .prefilled import PrefillStore, prefill_pair
from .settings import EvalSettings
from .texts import token_window
from .traces import trace_record, write_trace
from .walk import teacher_forced_walk

__all__ = ["EvalSettings", "evaluate"]

REPORT_FORMAT = "dustin_hf.fidelity/1"
KNOB_BUDGET_LIMIT = 1024  # the knob's mean realised budget the criteria ask for at most


def _resolved(config: DustinConfig, fraction, budget, min_context, target, draft, **knob):
    cfg = config_for_budget(config, fraction, budget).replace(**knob)
    if min_context is not None:
        cfg = cfg.replace(min_context=min_context)
    return resolve(cfg, target.config.get_text_config(), draft.config.get_text_config())


class _Traces:
    """Collects per-sequence acceptance into one trace record per (task, context, method, budget)."""

    def __init__(self, pair_names, gamma, dtype, device):
        self.pair, self.gamma, self.dtype, self.device = pair_names, gamma, dtype, device
        self.records: dict[tuple, dict] = {}

    def add(self, task, context, budget, config, max_new, source, prompt_tokens, run):
        key = (task, context, budget)
        if key not in self.records:
            method = "dense" if budget is None else "dustin"
            self.records[key] = trace_record(
                self.pair,
                task,
                context,
                self.gamma,
                method,
                budget,
                None if config is None else asdict(config),
                max_new,
                self.dtype,
                self.device,
                [],
            )
        self.records[key]["sequences"].append(
            {
                "source": source,
                "prompt_tokens": prompt_tokens,
                "generated_tokens": len(run["tokens"]),
                "gammas": run["gammas"],
                "accepted": run["accepted"],
            }
        )

    def write(self, directory) -> list[str]:
        paths = []
        for record in self.records.values():
            fresh = trace_record(
                record["model_pair"],
                record["task"],
                record["context"],
                record["gamma"],
                record["method"],
                record["budget"],
                record["config"],
                record["max_new_tokens"],
                record["dtype"],
                record["device"],
                record["sequences"],
            )  # recomputes the summary
            paths.append(str(write_trace(directory, fresh)))
        return paths


def _acceptance(runs: list[dict]) -> dict:
    steps = sum(len(r["accepted"]) for r in runs)
    accepted = sum(sum(r["accepted"]) for r in runs)
    tokens = sum(len(r["tokens"]) for r in runs)
    seconds = sum(r["decode_seconds"] for r in runs)
    return {
        "steps": steps,
        "mean_accepted_per_step": accepted / steps if steps else 0.0,
        "mean_tokens_per_step": (accepted + steps) / steps if steps else 0.0,
        "generated_tokens": tokens,
        "decode_tokens_per_s": tokens / seconds if seconds else 0.0,
        "sparse_steps": sum(r["stats"].get("sparse_steps", 0) for r in runs),
        "mean_attended": _mean([r["stats"].get("mean_attended", 0.0) for r in runs if r["stats"].get("sparse_steps")]),
    }


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def evaluate(
    pair,
    config: DustinConfig,
    draft_share_fraction: float | None,
    settings: EvalSettings,
    traces_dir=None,
    progress: bool = True,
    checkpoint=None,
    walk_probe=None,
) -> dict:
    """Run everything in the module docstring; returns the JSON-able report (traces written to ``traces_dir``).

    Work goes context by context (book windows, then that context's needles), so the shorter contexts'
    results come first; ``checkpoint(report)``, if given, receives the partial report after each unit.
    ``walk_probe(book, context)``, if given, returns the ``probe`` for that window's walk (or ``None``).
    """
    run = _Evaluation(pair, config, draft_share_fraction, settings, progress, walk_probe)
    needles = run.needles
    for context in settings.contexts:
        for book in settings.books:
            run.book_window(book, context)
            _checkpoint(run, checkpoint, traces_dir)
        for needle in [n for n in needles if n.context == context]:
            run.needle(needle)
            _checkpoint(run, checkpoint, traces_dir)
    for needle in [n for n in needles if n.context not in settings.contexts]:
        run.needle(needle)
        _checkpoint(run, checkpoint, traces_dir)
    run.bar.close()
    return run.finish(traces_dir)


def _checkpoint(run, checkpoint, traces_dir) -> None:
    if checkpoint is not None:
        checkpoint({**run.finish(traces_dir), "partial": True})


class _Evaluation:
    """The state of one :func:`evaluate` call: models, resolved configs, the report being filled."""

    def __init__(self, pair, config, fraction, settings: EvalSettings, progress: bool, walk_probe=None):
        self.pair, self.settings, self.progress, self.walk_probe = pair, settings, progress, walk_probe
        target, draft, tok = pair.target, pair.draft, pair.tokenizer
        self.start = time.perf_counter()
        self.budgets = budgets = sorted(settings.budgets)
        self.profile = {b: _resolved(config, fraction, b, settings.min_context, target, draft) for b in budgets}
        self.targets = targets = sorted(settings.targets)
        self.knob = {
            t: _resolved(
                config,
                fraction,
                settings.target_budget,
                settings.min_context,
                target,
                draft,
                min_recovery=t,
                max_budget=settings.max_budget,
            )
            for t in targets
        }
        default_base = DustinConfig(
            sink_tokens=config.sink_tokens,
            recent_tokens=config.recent_tokens,
            min_context=config.min_context,
            prefill_chunk=config.prefill_chunk,
        )
        self.default = {b: _resolved(default_base, None, b, settings.min_context, target, draft) for b in budgets}
        self.history_layers = tuple(
            sorted({self.profile[budgets[0]].target_layer, self.default[budgets[0]].target_layer})
        )
        self.chunk = config.prefill_chunk
        self.eos = eos_ids(target, tok)
        names = pair.describe()
        self.traces = _Traces(
            {"target": names["target"]["name"], "draft": names["draft"]["name"]},
            settings.gamma,
            names["dtype"],
            names["device"],
        )
        self.store = PrefillStore(target, draft)
        self.needles = (
            make_needles(
                tok,
                list(settings.needle_books),
                list(settings.needle_contexts),
                list(settings.needle_depths),
                settings.seed,
            )
            if settings.needle_contexts
            else []
        )
        self.methods = [None] + budgets
        self.exact = {b: dataclasses.replace(self.profile[b], mode="exact") for b in budgets} if settings.exact else {}
        per_window = ((len(self.methods) + len(self.exact) + len(targets)) if settings.new_tokens else 0) + (
            1 if settings.ppl_tokens else 0
        )
        total = len(settings.books) * len(settings.contexts) * per_window + len(self.needles) * len(self.methods)
        self.bar = tqdm(total=total, desc="eval", unit="run", disable=not progress)
        self.report = {
            "format": REPORT_FORMAT,
            "model_pair": names,
            "settings": _settings_dict(settings),
            "profile_config": config.to_dict(),
            "draft_share_fraction": fraction,
            "resolved": {str(b): asdict(self.profile[b]) for b in budgets},
            "default_resolved": {str(b): asdict(self.default[b]) for b in budgets},
            "knob_resolved": {str(t): asdict(self.knob[t]) for t in targets},
            "continuations": [],
            "perplexity": [],
            "needles": [],
            "prefill_seconds": [],
        }

    def _prefill(self, prompt, what):
        self.bar.set_postfix_str(f"{what}: prefill")
        state = prefill_pair(
            self.pair.target,
            self.pair.draft,
            prompt.to(self.pair.device),
            self.history_layers,
            self.chunk,
            progress=self.progress,
        )
        self.report["prefill_seconds"].append({"what": what, "seconds": state.seconds})
        return self.store.add(state)

    def _generate(self, prompt, budget, max_new, what, target=None, exact=False):
        """A continuation: dense (``budget`` and ``target`` ``None``), at ``budget`` (in exact mode with ``exact``),
        or with the knob at ``target``."""
        label = f"target {target}" if target is not None else "dense" if budget is None else f"budget {budget}"
        self.bar.set_postfix_str(f"{what}: {label}{' exact' if exact else ''}")
        config = (
            self.knob[target]
            if target is not None
            else None
            if budget is None
            else (self.exact if exact else self.profile)[budget]
        )
        out = speculative_continuation(
            self.pair.target,
            self.pair.draft,
            prompt,
            config=config,
            gamma=self.settings.gamma,
            max_new_tokens=max_new,
            eos_token_ids=self.eos,
            store=self.store,
        )
        self.bar.update()
        return out

    def book_window(self, book: str, context: int) -> None:
        """Continuations (dense and each budget) and the teacher-forced walk from one prefill."""
        s, tok = self.settings, self.pair.tokenizer
        window = token_window(tok, book, context + max(s.ppl_tokens, 1), s.offset)
        prompt = window[:context]
        what = f"{book}@{context}"
        state = self._prefill(prompt, what)
        if s.new_tokens:
            self._continuations(book, context, prompt, what)
        if s.ppl_tokens:
            self.bar.set_postfix_str(f"{what}: teacher-forced walk")
            walk = teacher_forced_walk(
                self.pair.target,
                self.pair.draft,
                state,
                window[context:],
                s.gamma,
                {
                    "dense": None,
                    **{f"b{b}": self.profile[b] for b in self.budgets},
                    **{f"t{t}": self.knob[t] for t in self.targets},
                },
                recovery_configs={
                    **{f"calibrated@{b}": self.profile[b] for b in self.budgets},
                    **{f"default@{b}": self.default[b] for b in self.budgets},
                },
                recovery_every=s.recovery_every,
                progress=self.progress,
                desc=f"walk {what}",
                probe=None if self.walk_probe is None else self.walk_probe(book, context),
            )
            self.bar.update()
            self.report["perplexity"].append(_walk_entry(book, context, walk, self.budgets, self.targets, s.gamma))
        self.store.clear()

    def _continuations(self, book, context, prompt, what) -> None:
        s, tok = self.settings, self.pair.tokenizer
        runs = {b: self._generate(prompt, b, s.new_tokens, what) for b in self.methods}
        knob = {t: self._generate(prompt, None, s.new_tokens, what, target=t) for t in self.targets}
        entry = {
            "book": book,
            "context": context,
            "dense": _acceptance([runs[None]]),
            "budgets": {},
            "targets": {},
            "dense_text": tok.decode(runs[None]["tokens"]),
        }
        for b in self.methods:
            self.traces.add(
                "continuation",
                context,
                b,
                None if b is None else self.profile[b],
                s.new_tokens,
                {"book": book, "offset": s.offset},
                context,
                runs[b],
            )
        for key, out, run in [(str(b), entry["budgets"], runs[b]) for b in self.budgets] + [
            (str(t), entry["targets"], knob[t]) for t in self.targets
        ]:
            out[key] = {
                **_acceptance([run]),
                **token_agreement(runs[None]["tokens"], run["tokens"]),
                "text": tok.decode(run["tokens"]),
                **({"knob": run["stats"]["knob"]} if "knob" in run["stats"] else {}),
            }
        for b in self.exact:
            run = self._generate(prompt, b, s.new_tokens, what, exact=True)
            entry["budgets"][str(b)]["exact"] = {
                **_acceptance([run]),
                **token_agreement(runs[None]["tokens"], run["tokens"]),
                "stats": run["stats"]["exact"],
            }
        self.report["continuations"].append(entry)

    def needle(self, needle) -> None:
        """Answer one needle question densely and at each budget, from one prefill."""
        what = f"needle {needle.book}@{needle.context}/{needle.depth}"
        self._prefill(needle.prompt_ids, what)
        case = {**needle.describe(), "results": {}}
        for b in self.methods:
            out = self._generate(needle.prompt_ids, b, self.settings.needle_new_tokens, what)
            answer = self.pair.tokenizer.decode(out["tokens"], skip_special_tokens=True)
            case["results"]["dense" if b is None else str(b)] = {
                "answer": answer,
                "found": needle_found(answer, needle),
            }
            self.traces.add(
                "needle",
                needle.context,
                b,
                None if b is None else self.profile[b],
                self.settings.needle_new_tokens,
                needle.describe(),
                needle.prompt_ids.numel(),
                out,
            )
        self.report["needles"].append(case)
        self.store.clear()

    def finish(self, traces_dir) -> dict:
        """The report so far, with traces written, the summary and the elapsed time."""
        report = dict(self.report)
        report["trace_files"] = self.traces.write(traces_dir) if traces_dir is not None else []
        report["traces"] = {
            f"{k[0]}@{k[1]}/{'dense' if k[2] is None else k[2]}": v["summary"] for k, v in self.traces.records.items()
        }
        report["summary"] = summarize(report, self.settings)
        report["seconds"] = time.perf_counter() - self.start
        return report


def _walk_entry(book, context, walk, budgets, targets=(), gamma=4) -> dict:
    dense = walk.ppl["dense"]
    entry = {
        "book": book,
        "context": context,
        "tokens": walk.tokens,
        "steps": walk.steps,
        "dense_ppl": dense,
        "dense_tf_accepted": walk.accepted.get("dense"),
        "dense_draft_agreement": walk.draft_agreement.get("dense"),
        "dense_accepted_trace": walk.accepted_trace.get("dense"),
        "seconds": walk.seconds,
        "budgets": {},
        "targets": {},
    }
    contexts = [context + step * (gamma + 1) for step in range(walk.steps)]  # L at each step
    for key, name, out in [(str(b), f"b{b}", entry["budgets"]) for b in budgets] + [
        (str(t), f"t{t}", entry["targets"]) for t in targets
    ]:
        out[key] = {
            "ppl": walk.ppl[name],
            "ratio": walk.ppl[name] / dense,
            "sparse_steps": walk.sparse_steps[name],
            "recovery": walk.recovery.get(name),
            "recovery_per_layer": walk.recovery_per_layer.get(name),
            "tf_accepted": walk.accepted.get(name),
            "draft_agreement": walk.draft_agreement.get(name),
            "top1_agreement_with_dense": walk.top1_agreement_with_dense.get(name),
            "read": budget_summary(walk.read_counts[name], contexts),
            "estimated_recovery": _mean(e for e in walk.estimated_recovery[name] if e is not None),
            "steps_read": walk.read_counts[name],
            "steps_estimated_recovery": _rounded(walk.estimated_recovery[name]),
            "steps_true_recovery": _rounded(walk.true_recovery[name]),
            "accepted_trace": walk.accepted_trace[name],
        }
    for b in budgets:
        entry["budgets"][str(b)].update(
            {
                "recovery_calibrated_dense_signals": walk.recovery_dense_signals.get(f"calibrated@{b}"),
                "recovery_default_dense_signals": walk.recovery_dense_signals.get(f"default@{b}"),
                "recovery_oracle": walk.recovery_dense_signals.get(f"oracle@{b}"),
            }
        )
    return entry


def _rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 5) for v in values]


def summarize(report: dict, settings: EvalSettings) -> dict:
    """Per context and budget: PPL ratio, acceptance ratio, needle accuracy, recovery; then the criteria."""
    budgets = sorted(settings.budgets)
    out = {"per_context": {}, "knob": {}, "estimate_vs_truth": {}, "needle_accuracy": {}, "criteria": {}}
    for context in settings.contexts:
        walks = [w for w in report["perplexity"] if w["context"] == context]
        conts = [c for c in report["continuations"] if c["context"] == context]
        row = {}
        dense_acc = _pool([c["dense"] for c in conts])
        for b in budgets:
            key = str(b)
            acc = _pool([c["budgets"][key] for c in conts])
            row[key] = {
                "ppl_ratio": _mean(w["budgets"][key]["ratio"] for w in walks),
                "ppl": _mean(w["budgets"][key]["ppl"] for w in walks),
                "dense_ppl": _mean(w["dense_ppl"] for w in walks),
                "mean_accepted_per_step": acc["mean_accepted_per_step"],
                "dense_mean_accepted_per_step": dense_acc["mean_accepted_per_step"],
                "accepted_ratio": _ratio(acc["mean_accepted_per_step"], dense_acc["mean_accepted_per_step"]),
                "tokens_per_step_ratio": _ratio(acc["mean_tokens_per_step"], dense_acc["mean_tokens_per_step"]),
                "token_agreement": _mean(c["budgets"][key]["agreement"] for c in conts),
                "prefix_match": _mean(c["budgets"][key]["prefix"] for c in conts),
                "recovery": _mean(
                    w["budgets"][key]["recovery"] for w in walks if w["budgets"][key]["recovery"] is not None
                ),
                "recovery_calibrated": _mean(
                    w["budgets"][key]["recovery_calibrated_dense_signals"]
                    for w in walks
                    if w["budgets"][key]["recovery_calibrated_dense_signals"] is not None
                ),
                "recovery_default": _mean(
                    w["budgets"][key]["recovery_default_dense_signals"]
                    for w in walks
                    if w["budgets"][key]["recovery_default_dense_signals"] is not None
                ),
                "recovery_oracle": _mean(
                    w["budgets"][key].get("recovery_oracle")
                    for w in walks
                    if w["budgets"][key].get("recovery_oracle") is not None
                ),
                "tf_accepted": _mean(
                    w["budgets"][key].get("tf_accepted")
                    for w in walks
                    if w["budgets"][key].get("tf_accepted") is not None
                ),
                "dense_tf_accepted": _mean(
                    w.get("dense_tf_accepted") for w in walks if w.get("dense_tf_accepted") is not None
                ),
                "top1_agreement_with_dense": _mean(
                    w["budgets"][key].get("top1_agreement_with_dense")
                    for w in walks
                    if w["budgets"][key].get("top1_agreement_with_dense") is not None
                ),
                **_exact_summary([c["budgets"][key]["exact"] for c in conts if "exact" in c["budgets"][key]]),
            }
            row[key]["tf_accepted_ratio"] = _ratio(row[key]["tf_accepted"], row[key]["dense_tf_accepted"])
        out["per_context"][str(context)] = row
        if settings.targets and walks:
            out["knob"][str(context)] = _knob_rows(walks, conts, settings)
        if walks and "steps_read" in next(iter(walks[0]["budgets"].values())):
            out["estimate_vs_truth"][str(context)] = _estimate_vs_truth(walks, settings)
    for context in sorted({n["context"] for n in report["needles"]}):
        cases = [n for n in report["needles"] if n["context"] == context]
        out["needle_accuracy"][str(context)] = {
            m: sum(c["results"][m]["found"] for c in cases) / len(cases) for m in ["dense"] + [str(b) for b in budgets]
        }
    out["criteria"] = _criteria(out, settings)
    out["knob_criteria"] = _knob_criteria(out["knob"])
    return out


def _step_contexts(walk: dict, gamma: int) -> list[int]:
    return [walk["context"] + step * (gamma + 1) for step in range(walk["steps"])]


def _knob_rows(walks: list[dict], conts: list[dict], settings: EvalSettings) -> dict:
    """Per target: perplexity and teacher-forced acceptance against dense, the positions read (pooled over the
    windows' steps), the estimated and the true recovery; free-running acceptance if continuations ran."""
    dense_tf = _mean(w["dense_tf_accepted"] for w in walks)
    dense_acc = _pool([c["dense"] for c in conts])
    rows = {}
    for t in sorted(settings.targets):
        key = str(t)
        runs = [w["targets"][key] for w in walks]
        steps_read = [n for r in runs for n in r["steps_read"]]
        contexts = [n for w in walks for n in _step_contexts(w, settings.gamma)]
        tf = _mean(r["tf_accepted"] for r in runs)
        rows[key] = {
            "ppl_ratio": _mean(r["ratio"] for r in runs),
            "tf_accepted": tf,
            "dense_tf_accepted": dense_tf,
            "tf_accepted_ratio": _ratio(tf, dense_tf),
            "read": budget_summary(steps_read, contexts),
            "mean_read": budget_summary(steps_read, contexts)["mean"],
            "estimated_recovery": _mean(r["estimated_recovery"] for r in runs if r["estimated_recovery"] is not None),
            "recovery": _mean(r["recovery"] for r in runs if r["recovery"] is not None),
            "top1_agreement_with_dense": _mean(r["top1_agreement_with_dense"] for r in runs),
        }
        if conts:
            acc = _pool([c["targets"][key] for c in conts])
            rows[key]["accepted_ratio"] = _ratio(acc["mean_accepted_per_step"], dense_acc["mean_accepted_per_step"])
    return rows


def _estimate_vs_truth(walks: list[dict], settings: EvalSettings) -> dict:
    """Per method (and the fixed budgets pooled), over the steps whose read set was not the whole context:
    Pearson and Spearman of the estimated against the true recovery, and the mean of truth minus estimate."""
    groups = {f"budget {b}": [("budgets", str(b))] for b in sorted(settings.budgets)}
    groups.update({f"target {t}": [("targets", str(t))] for t in sorted(settings.targets)})
    groups["fixed budgets pooled"] = [("budgets", str(b)) for b in sorted(settings.budgets)]
    out = {}
    for group, members in groups.items():
        pairs = [
            (e, r)
            for w in walks
            for kind, key in members
            for e, r, n, at in zip(
                w[kind][key]["steps_estimated_recovery"],
                w[kind][key]["steps_true_recovery"],
                w[kind][key]["steps_read"],
                _step_contexts(w, settings.gamma),
            )
            if e is not None and r is not None and n < at
        ]
        if pairs:
            estimate, truth = [p[0] for p in pairs], [p[1] for p in pairs]
            out[group] = {**correlation(estimate, truth), "mean_estimate": _mean(estimate), "mean_truth": _mean(truth)}
    return out


def _knob_criteria(knob: dict) -> dict:
    """Per context and target: perplexity within 1% of dense, teacher-forced acceptance >= 97% of dense, and the
    mean positions read within ``KNOB_BUDGET_LIMIT``."""
    out = {}
    for context, rows in knob.items():
        out[context] = {}
        for target, r in rows.items():
            checks = {
                "ppl_within_1pct": r["ppl_ratio"] is not None and abs(r["ppl_ratio"] - 1) <= 0.01,
                "tf_accepted_ge_97pct": r["tf_accepted_ratio"] is not None and r["tf_accepted_ratio"] >= 0.97,
                f"mean_read_le_{KNOB_BUDGET_LIMIT}": r["mean_read"] <= KNOB_BUDGET_LIMIT,
            }
            out[context][target] = {
                **checks,
                "pass": all(checks.values()),
                "ppl_ratio": r["ppl_ratio"],
                "tf_accepted_ratio": r["tf_accepted_ratio"],
                "mean_read": r["mean_read"],
            }
    return out


def _exact_summary(runs: list[dict]) -> dict:
    """Exact mode's continuations at one budget and context: agreement with dense (1.0 unless exact mode is
    broken), tokens per step, and the confirm stats pooled."""
    if not runs:
        return {}
    stats = [r["stats"] for r in runs]
    checked = sum(s["tentative_confirmed"] + s["tentative_rejected"] for s in stats)
    confirmations = sum(s["confirmations"] for s in stats)
    return {
        "exact_token_agreement": _mean(r["agreement"] for r in runs),
        "exact_identical": all(r["identical"] for r in runs),
        "exact_tokens_per_step": _pool(runs)["mean_tokens_per_step"],
        "exact_confirmed_fraction": sum(s["tentative_confirmed"] for s in stats) / checked if checked else 1.0,
        "exact_tokens_per_confirmation": sum(s["tokens_per_confirmation"] * s["confirmations"] for s in stats)
        / confirmations
        if confirmations
        else 0.0,
        "exact_sparse_row_steps": sum(s["sparse_row_steps"] for s in stats),
    }


def _pool(entries: list[dict]) -> dict:
    steps = sum(e["steps"] for e in entries)
    if not steps:
        return {"mean_accepted_per_step": 0.0, "mean_tokens_per_step": 0.0}
    accepted = sum(e["mean_accepted_per_step"] * e["steps"] for e in entries)
    return {"mean_accepted_per_step": accepted / steps, "mean_tokens_per_step": (accepted + steps) / steps}


def _ratio(a, b):
    return a / b if b else None


def _criteria(summary: dict, settings: EvalSettings) -> dict:
    b = str(settings.criteria_budget)
    out = {}
    for context, row in summary["per_context"].items():
        if b not in row:
            continue
        r = row[b]
        checks = {}
        tf_ratio = (
            _ratio(r.get("tf_accepted"), r.get("dense_tf_accepted")) if r.get("tf_accepted") is not None else None
        )
        if tf_ratio is not None:
            checks["tf_accepted_ge_97pct"] = {
                "value": tf_ratio,
                "dustin": r["tf_accepted"],
                "dense": r["dense_tf_accepted"],
                "pass": tf_ratio >= 0.97,
            }
        if r["ppl_ratio"] is not None:
            checks["ppl_within_1pct"] = {"value": r["ppl_ratio"], "pass": abs(r["ppl_ratio"] - 1) <= 0.01}
        if r["accepted_ratio"] is not None:
            checks["accepted_ge_97pct"] = {
                "value": r["accepted_ratio"],
                "tokens_per_step_ratio": r["tokens_per_step_ratio"],
                "pass": r["accepted_ratio"] >= 0.97,
            }
        needles = summary["needle_accuracy"].get(context)
        if needles is not None:
            checks["needle_equal_dense"] = {
                "dense": needles["dense"],
                "dustin": needles[b],
                "pass": needles[b] >= needles["dense"],
            }
        if "exact_identical" in r:
            checks["exact_identical_to_dense"] = {"value": r["exact_token_agreement"], "pass": r["exact_identical"]}
        if r["recovery_calibrated"] is not None and r["recovery_default"] is not None:
            checks["recovery_above_default"] = {
                "calibrated": r["recovery_calibrated"],
                "default": r["recovery_default"],
                "pass": r["recovery_calibrated"] > r["recovery_default"],
            }
        out[context] = checks
    return out


def _settings_dict(settings: EvalSettings) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()}
