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
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["TRACE_FORMAT", "load_trace", "trace_filename", "trace_record", "write_trace"]

TRACE_FORMAT = "dustin_hf.acceptance_trace/1"


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


def load_trace(path: str | Path) -> dict:
    """Read a trace, checking its format tag."""
    record = json.loads(Path(path).read_text())
    if record.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a {TRACE_FORMAT} file (format={record.get('format')!r})")
    return record
