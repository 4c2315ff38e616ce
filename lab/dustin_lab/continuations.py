"""Greedy continuations by speculative decoding, dense or Dustin, from a stored prefill.

One function runs :class:`~dustin_hf.decode.decoder.SpeculativeDecoder` on one prompt with a fixed γ (no
confidence-based early stop, so every step proposes γ drafts and traces are comparable) and returns
the generated tokens, the cache's stats, the per-step acceptance trace and timings. Another compares
two continuations token by token.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig

from dustin_hf.experimental import ResolvedConfig

from .prefilled import PrefillStore, dustin_attention_on, speculative_decoder

__all__ = ["eos_ids", "speculative_continuation", "token_agreement"]


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the model's generation config's and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def speculative_continuation(
    target,
    draft,
    prompt: torch.Tensor,
    *,
    config: ResolvedConfig | None,
    gamma: int,
    max_new_tokens: int,
    eos_token_ids: list[int],
    store: PrefillStore | None = None,
) -> dict:
    """Greedy speculative decoding of ``prompt (C,)`` for up to ``max_new_tokens``.

    ``config=None`` verifies densely (classic speculative decoding); otherwise Dustin with ``config``.
    Returns ``tokens`` (generated ids), ``stats`` (the target cache's, minus per-step clock times),
    ``accepted``/``gammas`` (per step), ``seconds`` (the whole call) and ``decode_seconds``.
    """
    pad = eos_token_ids[0] if eos_token_ids else 0
    generation_config = GenerationConfig(
        do_sample=False,
        max_length=prompt.numel() + max_new_tokens,
        eos_token_id=eos_token_ids or None,
        pad_token_id=pad,
    )
    decoder = speculative_decoder(target, draft, generation_config, dustin_config=config, gamma=gamma, store=store)
    device = target.get_input_embeddings().weight.device
    start = time.perf_counter()
    with torch.no_grad(), dustin_attention_on(target, draft):
        result = decoder.generate(prompt.to(device)[None])
    seconds = time.perf_counter() - start
    stats = {k: v for k, v in result.stats.as_dict().items() if k not in ("step_end_times", "phase_seconds")}
    trace = result.stats.trace
    generated = result.sequences[0, prompt.numel() :].tolist()
    decode_seconds = float(stats.get("decode_seconds", seconds))
    return {
        "tokens": generated,
        "stats": stats,
        "accepted": [int(counts[0]) for _, counts in trace],
        "gammas": [int(g) for g, _ in trace],
        "seconds": seconds,
        "decode_seconds": decode_seconds,
        "tokens_per_s": len(generated) / decode_seconds if decode_seconds > 0 else float("nan"),
    }


def token_agreement(reference: list[int], other: list[int]) -> dict:
    """``prefix``: tokens equal before the first difference; ``agreement``: share of equal positions
    over the shorter length (after a divergence the texts usually differ, so ``prefix`` is the stricter)."""
    n = min(len(reference), len(other))
    prefix = next((i for i in range(n) if reference[i] != other[i]), n)
    same = sum(reference[i] == other[i] for i in range(n))
    return {"prefix": prefix, "agreement": same / n if n else 1.0, "compared": n, "identical": reference == other}
