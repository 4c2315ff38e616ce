"""``dustin-hf demo``: one long prompt, continued by each entry of :func:`demo_runs` through ``model.generate``.

Every run is a public ``generate()`` call on the same patched target with the same draft, greedy and
with a fixed γ; what differs between runs is only the keyword arguments they add (a dense run adds
none: transformers' own assisted decoding). The runs are timed from outside, through public hooks
only: a streamer (``generate(streamer=...)``) sees each verification step's committed tokens, and
forward hooks on both models see when they finish reading the prompt. So decode tokens/s counts the
steps after the prompt was read, by both models, in every run alike.

What the numbers mean:

- **acceptance**: draft tokens the target kept per verification step (0 to γ); a step commits
  acceptance + 1 tokens (the kept drafts and the target's own next token).
- **agreement with the dense text**: tokens identical before the first difference. Greedy dense
  speculative decoding returns exactly the target's greedy text; Dustin's target reads only
  ``budget`` of the cached positions when it verifies, so its logits move a little, and where the
  top two candidates were close a greedy choice flips and the texts part ways from there. That is
  sparse verification by design (an approximation of the dense target), not an error: with a budget
  that covers the context the texts are identical.
- **exact mode** (``DustinConfig(mode="exact")``) reads the same selection, but what a sparse step
  accepts is only tentative until a dense verification confirms it, so its text is the dense one,
  token for token; its stats say how many tentative tokens the dense checks kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from dustin_hf import patch
from dustin_hf.experimental import CACHE_KWARG, synchronize

from .continuations import token_agreement

__all__ = ["DemoRun", "demo_runs", "run_demo"]


@dataclass(frozen=True)
class DemoRun:
    """One way to continue the prompt: a key for the JSON, a heading, and what it adds to ``generate()``."""

    name: str
    title: str
    generate_kwargs: dict = field(default_factory=dict)


def demo_runs(budget: int, context: int) -> list[DemoRun]:
    """The runs the demo compares, in order; the first is the reference the others' agreement is measured against."""
    return [
        DemoRun("dense", "classic speculative decoding (dense verification)"),
        DemoRun(
            "dustin", f"Dustin (budget {budget} of {context} cached positions)", {"cache_implementation": "dustin"}
        ),
        DemoRun(
            "exact",
            f"exact Dustin (budget {budget}, sparse steps confirmed by dense ones)",
            {"cache_implementation": "dustin", "cache_config": {"mode": "exact"}},
        ),
    ]


class _StepClock(BaseStreamer):
    """Times one ``generate()`` call: each step's committed tokens (as a streamer) and the end of the prompt's
    reading (forward hooks). Each model reads the prompt in forwards of more than ``γ + 1`` tokens before its first
    forward of at most ``γ + 1`` (so exact mode's wider confirming steps are steps); the first commit comes from the
    target's prompt forward (Dustin's loop reads the draft's prompt after it, transformers' before it)."""

    def __init__(self, target, draft, gamma: int):
        self.gamma = gamma
        self.device = target.get_input_embeddings().weight.device
        self.prompt_seen = False
        self.committed = False  # the first commit (the prompt forward's) has been streamed
        self.prefill_end = 0.0
        self.prompt_forwards = 0
        self._reading = {id(target): True, id(draft): True}  # the model has not yet run a step-sized forward
        self.steps: list[tuple[float, int]] = []  # (time, tokens committed) per verification step after prefill
        self._hooks = [m.register_forward_hook(self._forward_done, with_kwargs=True) for m in (target, draft)]

    def _forward_done(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        if ids.shape[-1] <= self.gamma + 1:
            self._reading[id(module)] = False
        elif self._reading[id(module)] and not self.steps:
            synchronize(self.device)
            self.prefill_end = time.perf_counter()
            self.prompt_forwards += 1

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() streams the prompt first
            self.prompt_seen = True
        elif not self.committed:  # committed by the forward that read the prompt
            self.committed = True
            self.prefill_end = max(self.prefill_end, time.perf_counter())
        else:
            self.steps.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def summary(self, started: float, finished: float) -> dict:
        tokens = sum(n for _, n in self.steps)
        seconds = (self.steps[-1][0] - self.prefill_end) if self.steps else 0.0
        return {
            "generate_seconds": finished - started,  # the whole call, prompt reading included
            "prefill_seconds": self.prefill_end - started,
            "decode_steps": len(self.steps),
            "decode_tokens": tokens,
            "decode_seconds": seconds,
            "decode_tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "prompt_forwards": self.prompt_forwards,  # forwards counted as reading the prompt (both models)
            "mean_accepted_per_step": tokens / len(self.steps) - 1 if self.steps else 0.0,
        }


def _generate(pair, run: DemoRun, prompt: torch.Tensor, gamma: int, new_tokens: int) -> dict:
    """One run: ``pair.target.generate`` on ``prompt (1, C)``, timed; returns the tokens, timings and stats."""
    clock = _StepClock(pair.target, pair.draft, gamma)
    try:
        synchronize(pair.device)
        started = time.perf_counter()
        out = pair.target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            assistant_model=pair.draft,
            do_sample=False,
            max_new_tokens=new_tokens,
            streamer=clock,
            return_dict_in_generate=True,
            **run.generate_kwargs,
        )
        synchronize(pair.device)
        finished = time.perf_counter()
    finally:
        clock.end()
    cache = getattr(out, CACHE_KWARG)
    stats = getattr(cache, "stats", None)  # Dustin's cache reports what verification did
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    result = {
        "title": run.title,
        "generate_kwargs": run.generate_kwargs,
        "text": pair.tokenizer.decode(tokens, skip_special_tokens=True),
        "tokens": tokens,
        **clock.summary(started, finished),
    }
    if stats is not None:
        result["stats"] = {
            k: v for k, v in stats.items() if k not in ("step_end_times", "step_tokens", "phase_seconds")
        }
    return result


def run_demo(pair, config, prompt: torch.Tensor, runs: list[DemoRun], gamma: int, new_tokens: int, say) -> dict:
    """Patch ``pair.target`` with ``config``, generate with every run in turn, unpatch; ``say`` prints a line."""
    pair.draft.generation_config.num_assistant_tokens = gamma  # γ, read from the draft as in transformers
    pair.draft.generation_config.num_assistant_tokens_schedule = "constant"
    pair.draft.generation_config.assistant_confidence_threshold = 0.0  # never stop drafting early
    prompt = prompt.to(pair.device)[None]
    results = {}
    with torch.no_grad(), patch(pair.target, config):
        for run in runs:
            say(f"generating {new_tokens} tokens: {run.title}...")
            results[run.name] = _generate(pair, run, prompt, gamma, new_tokens)
    reference = results[runs[0].name]["tokens"]
    for result in list(results.values())[1:]:
        result["agreement_with_" + runs[0].name] = token_agreement(reference, result["tokens"])
    return results


def print_runs(results: dict, gamma: int, say) -> None:
    """Each run's text, acceptance, speed and stats, then what the numbers mean."""
    for name, r in results.items():
        say(
            "",
            f"== {r['title']} ==",
            r["text"].strip(),
            "",
            f"  acceptance {r['mean_accepted_per_step']:.2f} drafts kept per step (of γ={gamma}), "
            f"{r['decode_steps']} steps after the prompt",
            f"  decode {r['decode_tokens_per_s']:.2f} tokens/s "
            f"({r['decode_tokens']} tokens in {r['decode_seconds']:.1f} s); "
            f"prompt read in {r['prefill_seconds']:.1f} s; generate() took {r['generate_seconds']:.1f} s in all",
        )
        for key, agreement in r.items():
            if key.startswith("agreement_with_"):
                say(
                    f"  agreement with the {key.removeprefix('agreement_with_')} text: {agreement['prefix']} of "
                    f"{agreement['compared']} tokens identical before the first difference"
                )
        if "stats" in r:
            s = r["stats"]
            say(
                f"  stats: sparse_steps {s['sparse_steps']}, dense_steps {s['dense_steps']}, mean_attended "
                f"{s['mean_attended']:.0f} cached positions read per sparse step, mean_accepted_per_step "
                f"{s['mean_accepted_per_step']:.2f}"
            )
            if "exact" in s:
                e = s["exact"]
                say(
                    f"  exact: {e['confirmations']} confirmations kept {e['tentative_confirmed']} tentative tokens "
                    f"and rejected {e['tentative_rejected']} (confirmed fraction {e['confirmed_fraction']:.2f}), "
                    f"{e['tokens_per_confirmation']:.1f} tokens committed per confirmation; "
                    f"{e['sparse_row_steps']} sparse and {e['dense_row_steps']} dense steps without tentative tokens"
                )
            if "calibration" in s:
                c = s["calibration"]
                say(
                    f"  calibrated on the prompt: {c['skipped']}"
                    if "skipped" in c
                    else f"  calibrated on the prompt in {c['seconds']:.1f} s ({c['steps']} steps): target layer "
                    f"{c['target_layer']} heads {c['target_heads']}, draft layers {c['draft_layers']}, "
                    f"m={c['draft_share']}; attention recovery {c['recovery']:.3f} (default heads "
                    f"{c['default_recovery']:.3f})"
                )
    say(
        "",
        "acceptance: drafts the target kept per verification step; each step commits acceptance + 1 tokens.",
        "agreement: tokens identical before the first difference. Dense speculative decoding returns the target's "
        "greedy text; Dustin's target reads only the budget's cached positions when it verifies, so where two "
        "candidates were close a greedy choice can flip and the texts part ways: sparse verification changes the "
        "text by design (with a budget covering the context it would not).",
        "three levels: the draft proposes, the sparse target (reading the budget's positions) verifies, the dense "
        "target (reading them all) confirms. Classic speculative decoding uses the dense target alone; Dustin "
        "commits what the sparse target accepts; exact Dustin holds it as tentative, and every few steps (once a row "
        "holds confirm_tokens tentative tokens, or confirm_every sparse steps after its last check) one dense "
        "verification keeps the longest prefix the dense target agrees with, puts the dense target's token at the "
        "first disagreement, and checks the new drafts after them. Only confirmed tokens are committed, so its text "
        "is the dense one at any budget; it is fast when most tentative tokens survive.",
        "decode tokens/s: tokens committed after both models read the prompt, over the time since.",
        "what this run can show: correctness, not speed. Exact mode's text equals the dense one token for token, and "
        "sparse mode's parts from it where a near-tie flipped: sparse mode is lossy at a small budget (a larger "
        "budget, dense_layers or exact mode narrow or remove the gap). What it cannot show: where Dustin pays. On a "
        "CPU at a few thousand tokens a step's time is the models' weights, not the reads of the cache, so sparse "
        "reads save little and exact mode's dense checks cost more than they save; Dustin pays on a GPU at long "
        "contexts (tens of thousands of tokens) and large batches, where reading the KV cache dominates the decode. "
        "The measured whole generate() calls are in benchmarks/results/README.md.",
    )
