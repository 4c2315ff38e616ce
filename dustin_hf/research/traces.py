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

__all__ = ["KNOB_TRACE_FORMAT", "TRACE_FORMAT", "knob_trace_record", "load_knob_trace", "load_trace", "trace_filename",
           "trace_record", "write_knob_trace", "write_trace"]

TRACE_FORMAT = "dustin_hf.acceptance_trace/1"
KNOB_TRACE_FORMAT = "dustin_hf.knob_trace/1"


def trace_filename(pair: dict, task: str, context: int, gamma: int, method: str, budget: int | None) -> str:
    """``<target>+<draft>_<task>_ctx<context>_g<γ>_<method>[_b<budget>].json`` (file-system safe)."""
    slug = re.sub(r"[^A-Za-z0-9.+_-]", "_", f"{pair['target']}+{pair['draft']}")
    suffix = f"_b{budget}" if budget is not None else ""
    return f"{slug}_{task}_ctx{context}_g{gamma}_{method}{suffix}.json"


def trace_record(pair: dict, task: str, context: int, gamma: int, method: str, budget: int | None, config: dict | None,
                 max_new_tokens: int, dtype: str, device: str, sequences: list[dict]) -> dict:
    """The JSON object above; ``sequences`` hold ``source``, ``prompt_tokens``, ``generated_tokens``,
    ``gammas`` and ``accepted``."""
    steps = sum(len(s["accepted"]) for s in sequences)
    accepted = sum(sum(s["accepted"]) for s in sequences)
    return {
        "format": TRACE_FORMAT, "model_pair": pair, "task": task, "context": context, "gamma": gamma,
        "method": method, "budget": budget, "config": config, "max_new_tokens": max_new_tokens, "dtype": dtype,
        "device": device, "sequences": sequences,
        "summary": {"steps": steps, "mean_accepted_per_step": accepted / steps if steps else 0.0,
                    "mean_tokens_per_step": (accepted + steps) / steps if steps else 0.0},
    }


def write_trace(directory: str | Path, record: dict) -> Path:
    """Write ``record`` under ``directory`` with its canonical file name; return the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / trace_filename(record["model_pair"], record["task"], record["context"], record["gamma"],
                                      record["method"], record["budget"])
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def knob_trace_record(pair: dict, text: dict, context: int, gamma: int, config: dict, seqlens: list[list[int]],
                      counts: list[list[int]], accepted: list[list[int]], dtype: str, device: str) -> dict:
    """The knob trace above; ``config`` is the resolved settings (``min_recovery``, ``budget``, ``max_budget``)."""
    from .knob import budget_summary

    if not len(seqlens) == len(counts) == len(accepted):
        raise ValueError(f"a knob trace needs one entry per step in seqlens, counts and accepted, got "
                         f"{len(seqlens)}, {len(counts)}, {len(accepted)}")
    flat_accepted = [a for row in accepted for a in row]
    summary = budget_summary([c for row in counts for c in row], [n for row in seqlens for n in row])
    return {
        "format": KNOB_TRACE_FORMAT, "model_pair": pair, "task": "teacher-forced", "text": text, "context": context,
        "gamma": gamma, "min_recovery": config["min_recovery"], "budget": config["budget"],
        "max_budget": config["max_budget"], "config": config, "dtype": dtype, "device": device, "seqlens": seqlens,
        "counts": counts, "accepted": accepted,
        "summary": {**summary, "mean_accepted_per_step": sum(flat_accepted) / len(flat_accepted) if flat_accepted else 0.0},
    }


def write_knob_trace(directory: str | Path, record: dict) -> Path:
    """Write a knob trace as ``<target>+<draft>_knob_<text>_ctx<context>_g<γ>_r<min_recovery>.json``."""
    slug = re.sub(r"[^A-Za-z0-9.+_-]", "_", f"{record['model_pair']['target']}+{record['model_pair']['draft']}")
    text = re.sub(r"[^A-Za-z0-9._-]", "_", record["text"]["name"])
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
