"""Acceptance traces: how many draft tokens each verification step accepted, saved for replay.

Acceptance depends on real weights, which only the CPU machine has; the GPU benchmark runs the same
architectures with random weights and replays recorded acceptance (``SpeculativeDecoder``'s
``accept_override``). One JSON file per (model pair, task, context, γ, method, budget):

    {
      "format": "dustin_hf.acceptance_trace/1",
      "model_pair": {"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct"},
      "task": "continuation" | "needle",
      "context": 4096,              # prompt tokens (needles: the asked context; each sequence has its own)
      "gamma": 4,                   # drafts proposed per step (fixed; no early stop)
      "method": "dense" | "dustin",
      "budget": 512 | null,         # null for dense verification
      "config": {...} | null,       # the resolved Dustin settings (target/draft heads, draft_share, ...)
      "max_new_tokens": 48,
      "dtype": "float32", "device": "cpu",
      "sequences": [
        {"source": {"book": "emma", "offset": 0, ...}, "prompt_tokens": 4096, "generated_tokens": 48,
         "gammas": [4, 4, ...], "accepted": [2, 0, 4, ...]}
      ],
      "summary": {"steps": 17, "mean_accepted_per_step": 1.82, "mean_tokens_per_step": 2.82}
    }

``accepted[i]`` is the number of drafts (0..γ) the target kept at step ``i`` of that sequence, before
the cut at EOS or ``max_new_tokens`` (each step commits ``accepted + 1`` tokens until then).
Sequences were decoded one at a time (batch 1); a batched replay can stack them as rows.

Methods whose steps mix verifiers (exact mode: sparse steps, then dense confirmations) cannot be
replayed from counts recorded with one verifier. A **prediction trace** keeps, per position of a
teacher-forced walk (:mod:`dustin_lab.walk`), every model's greedy prediction on the true
prefix, so that a replay derives any method's acceptance:

    {
      "format": "dustin_hf.prediction_trace/1",
      "model_pair": {"target": ..., "draft": ...},
      "text": {"kind": "book", "name": "emma", "offset": 0, ...},   # or a python-source file (path, sha256)
      "context": 4096, "gamma": 4, "budget": 512,
      "config": {...},                  # the resolved settings of the sparse methods (sparse_draft=True)
      "positions": 400,
      "predictions": {                  # entry j: the token at position context + j, predicted on [0, context + j)
        "truth": [...],                 # the text's own token
        "dense": [...],                 # the target's argmax, reading every cached position
        "sparse": [...],                # the target's argmax, reading Dustin's selection of `budget` positions
                                        # (config naming "selection_layers": those layers' sets instead)
        "draft": [...],                 # the draft's argmax, reading its whole cache
        "draft_sparse": [...]           # the draft's argmax, reading the previous selection + what came since
      },
      "agreement": {"sparse_vs_dense": 0.86, ...}, "dtype": "float32", "device": "cpu"
    }

Acceptance of d drafts proposed from position p against a verifier v is the longest prefix i <= d with
``draft[p + i] == v[p + i]``. Entry 0 of every target list comes from the prefill (dense for all); the
sparse target's entries after it were predicted by sparse steps of γ+1 queries each (the walk's step
boundaries: a replay whose steps fall elsewhere reads them as the sparse target's at that position).

**Knob traces** record what the quality knob (``min_recovery``) read at each step of a teacher-forced walk,
for a benchmark to replay the budgets (``DecodeHooks.budgets``) scaled to its own context:

    {
      "format": "dustin_hf.knob_trace/1",
      "model_pair": {...}, "task": "teacher-forced", "text": {"name": "emma", "offset": 0, ...},
      "context": 4096, "gamma": 4,
      "min_recovery": 0.9, "budget": 512, "max_budget": 2048,    # the target, floor and ceiling
      "config": {...},                   # the resolved Dustin settings
      "dtype": "float32", "device": "cpu",
      "seqlens":  [[4096], [4101], ...], # per step, per row: cached positions L before the step
      "counts":   [[812], [1024], ...],  # per step, per row: positions read (== L: read in full, a dense fallback)
      "accepted": [[2], [0], ...],       # per step, per row: drafts a greedy target kept (teacher-forced)
      "summary": {"steps": 51, "mean": 903.2, "p50": ..., "p95": ..., "max": ..., "read_in_full": 0,
                  "mean_share_of_context": 0.21, "mean_accepted_per_step": 1.1}
    }
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = [
    "KNOB_TRACE_FORMAT",
    "PREDICTION_FORMAT",
    "PREDICTION_KEYS",
    "TRACE_FORMAT",
    "knob_trace_record",
    "load_knob_trace",
    "load_predictions",
    "load_trace",
    "prediction_record",
    "selection_of",
    "trace_filename",
    "trace_record",
    "write_knob_trace",
    "write_predictions",
    "write_trace",
]

TRACE_FORMAT = "dustin_hf.acceptance_trace/1"
PREDICTION_FORMAT = "dustin_hf.prediction_trace/1"
KNOB_TRACE_FORMAT = "dustin_hf.knob_trace/1"
PREDICTION_KEYS = ("truth", "dense", "sparse", "draft", "draft_sparse")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", text)


def trace_filename(pair: dict, task: str, context: int, gamma: int, method: str, budget: int | None) -> str:
    """``<target>+<draft>_<task>_ctx<context>_g<γ>_<method>[_b<budget>].json`` (file-system safe)."""
    slug = _slug(f"{pair['target']}+{pair['draft']}")
    suffix = f"_b{budget}" if budget is not None else ""
    return f"{slug}_{task}_ctx{context}_g{gamma}_{method}{suffix}.json"


def trace_record(
    pair: dict,
    task: str,
    context: int,
    gamma: int,
    method: str,
    budget: int | None,
    config: dict | None,
    max_new_tokens: int,
    dtype: str,
    device: str,
    sequences: list[dict],
) -> dict:
    """The JSON object above; ``sequences`` hold ``source``, ``prompt_tokens``, ``generated_tokens``,
    ``gammas`` and ``accepted``."""
    steps = sum(len(s["accepted"]) for s in sequences)
    accepted = sum(sum(s["accepted"]) for s in sequences)
    return {
        "format": TRACE_FORMAT,
        "model_pair": pair,
        "task": task,
        "context": context,
        "gamma": gamma,
        "method": method,
        "budget": budget,
        "config": config,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "device": device,
        "sequences": sequences,
        "summary": {
            "steps": steps,
            "mean_accepted_per_step": accepted / steps if steps else 0.0,
            "mean_tokens_per_step": (accepted + steps) / steps if steps else 0.0,
        },
    }


def write_trace(directory: str | Path, record: dict) -> Path:
    """Write ``record`` under ``directory`` with its canonical file name; return the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / trace_filename(
        record["model_pair"], record["task"], record["context"], record["gamma"], record["method"], record["budget"]
    )
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def knob_trace_record(
    pair: dict,
    text: dict,
    context: int,
    gamma: int,
    config: dict,
    seqlens: list[list[int]],
    counts: list[list[int]],
    accepted: list[list[int]],
    dtype: str,
    device: str,
) -> dict:
    """The knob trace above; ``config`` is the resolved settings (``min_recovery``, ``budget``, ``max_budget``)."""
    from .knob import budget_summary

    if not len(seqlens) == len(counts) == len(accepted):
        raise ValueError(
            f"a knob trace needs one entry per step in seqlens, counts and accepted, got "
            f"{len(seqlens)}, {len(counts)}, {len(accepted)}"
        )
    flat_accepted = [a for row in accepted for a in row]
    summary = budget_summary([c for row in counts for c in row], [n for row in seqlens for n in row])
    return {
        "format": KNOB_TRACE_FORMAT,
        "model_pair": pair,
        "task": "teacher-forced",
        "text": text,
        "context": context,
        "gamma": gamma,
        "min_recovery": config["min_recovery"],
        "budget": config["budget"],
        "max_budget": config["max_budget"],
        "config": config,
        "dtype": dtype,
        "device": device,
        "seqlens": seqlens,
        "counts": counts,
        "accepted": accepted,
        "summary": {
            **summary,
            "mean_accepted_per_step": sum(flat_accepted) / len(flat_accepted) if flat_accepted else 0.0,
        },
    }


def write_knob_trace(directory: str | Path, record: dict) -> Path:
    """Write a knob trace as ``<target>+<draft>_knob_<text>_ctx<context>_g<γ>_r<min_recovery>.json``."""
    slug = _slug(f"{record['model_pair']['target']}+{record['model_pair']['draft']}")
    text = _slug(record["text"]["name"])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{slug}_knob_{text}_ctx{record['context']}_g{record['gamma']}_r{record['min_recovery']}.json"
    path.write_text(json.dumps(record) + "\n")
    return path


def load_trace(path: str | Path) -> dict:
    """Read an acceptance trace, checking its format tag."""
    return _load(path, TRACE_FORMAT)


def load_knob_trace(path: str | Path) -> dict:
    """Read a knob trace, checking its format tag."""
    return _load(path, KNOB_TRACE_FORMAT)


def _load(path: str | Path, expected: str) -> dict:
    record = json.loads(Path(path).read_text())
    if record.get("format") != expected:
        raise ValueError(f"{path}: not a {expected} file (format={record.get('format')!r})")
    return record


def prediction_record(
    pair: dict,
    text: dict,
    context: int,
    gamma: int,
    budget: int,
    config: dict,
    predictions: dict[str, list[int]],
    dtype: str,
    device: str,
) -> dict:
    """The prediction-trace object above; ``predictions`` holds the five lists of :data:`PREDICTION_KEYS`, of one
    length. ``agreement`` summarises them: per position, the share where two lists agree."""
    lengths = {key: len(predictions[key]) for key in PREDICTION_KEYS}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"prediction lists must have one length, got {lengths}")
    p = predictions

    def share(a, b):
        return sum(x == y for x, y in zip(p[a], p[b])) / len(p[a]) if p[a] else 1.0

    agreement = {
        "sparse_vs_dense": share("sparse", "dense"),
        "draft_vs_dense": share("draft", "dense"),
        "draft_vs_sparse": share("draft", "sparse"),
        "draft_sparse_vs_dense": share("draft_sparse", "dense"),
        "draft_sparse_vs_sparse": share("draft_sparse", "sparse"),
        "dense_vs_truth": share("dense", "truth"),
    }
    return {
        "format": PREDICTION_FORMAT,
        "model_pair": pair,
        "text": text,
        "context": context,
        "gamma": gamma,
        "budget": budget,
        "config": config,
        "positions": lengths["truth"],
        "predictions": {key: list(p[key]) for key in PREDICTION_KEYS},
        "agreement": agreement,
        "dtype": dtype,
        "device": device,
    }


def write_predictions(directory: str | Path, record: dict) -> Path:
    """Write a prediction trace as ``<target>+<draft>_predictions_<text>_ctx<C>_g<γ>_b<budget>.json``
    (``..._select.json`` when its sparse target read the selection layers' sets); return the path.
    Each list goes on one line, so a diff shows which changed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pair, text = record["model_pair"], record["text"]
    selected = "_select" if selection_of(record.get("config")) == "verify" else ""  # beside Dustin's set's traces
    name = (
        f"{_slug(pair['target'] + '+' + pair['draft'])}_predictions_{_slug(text['name'])}_ctx{record['context']}"
        f"_g{record['gamma']}_b{record['budget']}{selected}.json"
    )
    head = {k: v for k, v in record.items() if k != "predictions"}
    lists = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in record["predictions"].items())
    body = json.dumps(head, indent=1)[:-2] + ',\n "predictions": {\n' + lists + "\n }\n}\n"
    path = directory / name
    path.write_text(body)
    return path


def selection_of(config: dict | None) -> str:
    """Who chose a prediction trace's sparse read sets, from its recorded (resolved) config: ``"verify"`` where it
    names selection layers, else ``"dustin"``."""
    config = config or {}
    return "verify" if config.get("selection") == "verify" or config.get("selection_layers") else "dustin"


def load_predictions(path: str | Path) -> dict:
    """Read a prediction trace, checking its format tag and that it holds every list of :data:`PREDICTION_KEYS`,
    of one length (extra keys are ignored)."""
    record = _load(path, PREDICTION_FORMAT)
    lists = record.get("predictions", {})
    missing = [key for key in PREDICTION_KEYS if key not in lists]
    if missing:
        raise ValueError(f"{path}: predictions lack {missing} (need {list(PREDICTION_KEYS)})")
    lengths = {key: len(lists[key]) for key in PREDICTION_KEYS}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{path}: prediction lists must have one length, got {lengths}")
    return record
