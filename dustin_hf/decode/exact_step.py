"""Exact mode's decode step: the loop's five steps with tentative acceptance and dense confirmation.

:mod:`dustin_hf.decode.exact` holds exact mode's per-row schedule and block arithmetic; this module is the step that
uses them, run by :class:`~dustin_hf.decode.decoder.SpeculativeDecoder` in place of :meth:`DecodeRun.step
<dustin_hf.decode.run.DecodeRun.step>` when ``DustinConfig(mode="exact")``. It shares the run's draft, accept,
queue and settle phases with the plain step.
"""

from __future__ import annotations

import torch

from ..runtime.plan import HostCopy, device_tensor
from ..selection.fill import dense_rows, truncated, with_dense_rows
from .exact import block_proposals, blocks
from .run import DecodeRun, Drafts

__all__ = ["exact_step"]


def exact_step(run: DecodeRun) -> None:
    """One step of exact mode (:mod:`dustin_hf.decode.exact`): the same five steps, but a row verified sparsely
    accepts tentatively, and a confirming row's verification is dense with its tentative tokens in front of
    the new drafts: one speculative block ``[x, t_1..t_n, d_1..d_γ]`` from the row's last committed token x,
    whose proposal is p~ for the t's and q for the d's. What a confirming or dense row accepts is committed;
    what a sparse row accepts joins its tentative tokens."""
    rows, schedule, cfg = run.rows, run.confirm, run.dustin_config
    target, draft = run.target, run.draft
    batch, device = rows.batch_size, rows.tokens.device
    seqlens = [n - 1 for n in rows.held]  # L_b: cached positions (committed + tentative, the last not cached)
    base = device_tensor(seqlens, device)
    short = dense_rows(seqlens, cfg)  # read in full anyway: what they accept is exact and committed at once
    wanted = [not done and schedule.wants(b, rows.tentative[b]) for b, done in enumerate(rows.finished)]
    # greedy: one confirming row makes the step dense for it, and every row holding tentative tokens confirms
    # with it (a greedy row's tokens do not depend on when it confirms). Sampling: each row on its own schedule,
    # since when a row confirms decides which draws it makes
    confirming = wanted if run.do_sample else [rows.tentative[b] > 0 and any(wanted) for b in range(batch)]
    # greedy: a confirming step reads every row densely (one dense kernel, not a mixed step)
    everyone = not run.do_sample and any(confirming)
    dense = [s or c or everyone or schedule.dense(b) for b, (s, c) in enumerate(zip(short, confirming))]

    # 1. Draft d_1..d_γ after everything each row holds (its tentative tokens included).
    sparse = not all(short)
    drafts = run.draft_tokens(seqlens, base, sparse)
    run.clock.mark("draft")

    # 2. Select: the sparse rows' read sets (and, with sparse_draft, what the draft reads next); dense rows read
    #    everything they hold before the step's first query.
    starts = [L - n if c else L for L, n, c in zip(seqlens, rows.tentative, confirming)]
    selection = None
    if sparse and run.do_sample:
        # p~ must be a function of the prefix alone for p / p~ to confirm its samples exactly: score with the
        # draft's query of x only (the later queries were fed the very drafts p~ is about to judge)
        first = {layer: queries[:1] for layer, queries in drafts.queries.items()}
        selection = run.selector.select(target, draft, seqlens, base, first, 1)
    elif sparse:
        selection = run.selector.select(target, draft, seqlens, base, drafts.queries, drafts.gamma, drafts.row_gamma)
    if selection is not None and selection.recovery is not None:
        run.stats.record_knob(
            selection.counts, selection.recovery, selection.fallback, [b for b in rows.active if not dense[b]]
        )
    reads = None if all(dense) else with_dense_rows(selection, starts, dense)
    # what the sparse draft reads next: a confirming row rewrites its positions from its confirmed start, so it
    # keeps the part of this selection below that start and reads everything written from it on (without the
    # sparse draft only whether a selection exists matters)
    kept_from = [s if c else L for s, L, c in zip(starts, seqlens, confirming)]
    run.last_selection = (
        None
        if selection is None
        else (selection, seqlens)
        if not (any(confirming) and run.sparse_draft)
        else (truncated(selection, kept_from, seqlens, cfg.recent_tokens), kept_from)
    )
    run.clock.mark("score_select")

    # 3. Verify each row's block [x, proposal] from its start: a confirming row's x is its last committed
    #    token (its tentative tokens follow it as proposals), any other row's x is the last token it holds.
    tentative = [rows.tentative[b] if confirming[b] else 0 for b in range(batch)]
    # a confirming step's blocks take one width (one forward shape, one CUDA graph): the most tentative tokens
    # a row can hold (it confirms once it holds its limit <= confirm_tokens, after a step that added at most
    # γ+1, so confirm_tokens + γ), then as many of its new drafts as fit. Not confirm_tokens + 2γ: that many
    # queries pack more rows per KV head than the dense kernel reads at full bandwidth, and a row's drafts past
    # the width count only when every tentative token before them is confirmed
    width = cfg.confirm_tokens + run.max_gamma if any(confirming) else max(drafts.row_gamma)
    if max(tentative) > width:  # the schedule keeps every limit <= confirm_tokens; a block must hold them all
        raise RuntimeError(
            f"exact mode: a row holds {max(tentative)} tentative tokens, more than a confirming "
            f"block's {width}; this is a bug in dustin_hf"
        )
    verified = [min(g, width - n) for n, g in zip(tentative, drafts.row_gamma)]  # new drafts in each block
    gammas = [n + g for n, g in zip(tentative, verified)]
    inputs = blocks(rows.tokens, starts, tentative, drafts.tokens, 1 + width)  # (B, 1 + width): x, proposal
    proposal = inputs[:, 1:]
    target.cache.rollback(starts)  # a confirming row re-reads its tentative positions densely
    raw, captured = target.step(
        inputs,
        starts,
        keep=1 + width,
        capture=run.history_capture,
        capture_last=False,
        selection=reads,
        query_counts=[1 + g for g in gammas],
    )
    scores = None
    if not run.tokens_only:
        prefixes = [rows.history(b, upto=starts[b] + 1) for b in range(batch)]
        scores = run.process(raw, lambda b, i: torch.cat([prefixes[b], proposal[b : b + 1, :i]], dim=1))
    run.clock.mark("verify")

    # 4. Accept over each block: greedy, the agreeing prefix; sampling, min(1, p / proposal) with p~ as the
    #    proposal of tentative tokens and q as the drafts'.
    probs = None
    if run.do_sample:
        probs = block_proposals(drafts.probs, schedule.proposals, tentative, raw.shape[-1], width)
    block = Drafts(proposal, probs, drafts.queries, gammas)
    n_accepted, next_token = run.accept(block, raw, scores, tentative, dense)
    new_tokens = torch.cat([proposal, torch.zeros_like(proposal[:, :1])], dim=1)
    new_tokens.scatter_(1, n_accepted[:, None], next_token[:, None])  # (B, 1 + width)
    held = rows.held
    offsets = [rows.lens[b] if dense[b] else held[b] for b in range(batch)]  # committed: after lens
    rows.write_candidates(new_tokens, offsets)
    active = rows.active
    run.clock.mark("accept")

    # 5. Commit what dense and confirming rows accepted; a sparse row's accepted tokens turn tentative. Every
    #    row's next draft input follows from the device values, as in DecodeRun.step, counted from its block's start (a
    #    confirming row's last committed token): the next step's first draft forwards are queued before this
    #    step's one sync, reading what last_selection says the draft reads next. The next step is sparse as
    #    this one: a confirming row's start is past the budget and min_context (its committed tokens were, for
    #    its last sparse step), and committed lengths only grow.
    host = HostCopy(torch.cat([n_accepted[:, None], new_tokens], dim=1))
    run.ahead = run.queue_drafts(
        device_tensor(starts, device) if any(confirming) else base,
        n_accepted,
        *(run.last_selection or (None, seqlens)),
    )
    run.clock.mark("draft")
    host = host.tolist()
    accepted = [row[0] for row in host]
    committing = [n + 1 if dense[b] else 0 for b, n in enumerate(accepted)]
    counts = rows.commit(new_tokens, [row[1:] for row in host], raw, scores, committing)
    kept = []  # inputs of each block whose K/V stay cached: x and the proposals before the next token
    for b in range(batch):
        if b not in active:
            kept.append(0)
        elif dense[b]:
            kept.append(counts[b])
            if confirming[b]:
                schedule.after_confirm(b, tentative[b], min(accepted[b], tentative[b]), counts[b])
            else:
                schedule.after_dense(b)
            rows.tentative[b] = 0
        else:
            kept.append(accepted[b] + 1)
            if run.do_sample:  # p~ of each new tentative token: the sparse target's at its position
                schedule.proposals[b].extend(scores[b, : accepted[b] + 1].softmax(dim=-1))
            new = host[b][1 : accepted[b] + 2]  # the new tentative tokens, from the host copy
            rows.tentative[b] += accepted[b] + 1
            schedule.after_sparse(b, schedule.must[b] or rows.would_stop(b, new))
    run.update_schedule(
        verified,
        [min(max(n - t, 0), g) for n, t, g in zip(accepted, tentative, verified)],
        [b for b in active if verified[b]],
    )  # a block with no new drafts tells nothing
    if run.recorder is not None:
        hidden, attentions = target.last_outputs
        for b in active:
            run.recorder.keep_step(b, counts[b], hidden, attentions)
    run.settle(starts, kept, captured)
    if any(confirming):
        schedule.stats.confirm_steps += 1
    run.clock.mark("commit")

    run.stats.record_step(
        gammas,
        accepted,
        counts,
        active,
        sparse=reads is not None,
        attended=None if reads is None else run.attended(reads, starts, active),
        seqlens=starts,
    )
    run.clock.mark("bookkeeping")
    run.clock.end_step()
