"""Exact mode: sparse verification accepts tentatively, dense verification confirms; the output is the target's.

Greedy: token for token plain greedy decoding, at budgets far below the context, where sparse mode's output
differs. Sampling: the committed tokens' law is the target's, where sparse mode's measurably is not, and a
broken hierarchical rule is caught by the same check.
"""

import pytest
import torch
from conftest import joint_law, law_pvalue, tiled_prefill
from tiny_models import PAD, left_pad, noisy_copy, random_prompt, set_gamma, tiny_model
from transformers import GenerationConfig

import dustin_hf
from dustin_hf.adapter.assisted import attention_routed
from dustin_hf.config import resolve
from dustin_hf.decode import decoder as decoding
from dustin_hf.decode import exact as exact_mode
from dustin_hf.decode.confirm import ConfirmSchedule, blocks
from dustin_hf.decode.hooks import DecodeHooks
from dustin_hf.decode.settings import Drafting

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only wait on each other

P_VALUE = 1e-3
CASES = [  # (family, budget, γ, prompt lengths)
    ("llama", 8, 1, (900, 260, 530, 340)),
    ("qwen2", 32, 4, (1500, 400, 760, 610)),
    ("qwen3", 128, 6, (2100, 700, 1300, 980)),
]


def _early_eos(target, row) -> int:
    """The 5th token of ``row``'s greedy continuation: as EOS it ends that row early (others may end too)."""
    return int(target.generate(row[None], max_new_tokens=5, do_sample=False, pad_token_id=PAD)[0, -1])


def _decode_case(family, budget, gamma, lengths) -> bool:
    """Exact mode equals greedy on this case (asserted); returns whether sparse mode differs from greedy."""
    target = tiny_model(family, layers=2, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target, noise=0.02), gamma)
    rows = [random_prompt(n, seed=n)[0] for n in lengths]
    ids, mask = left_pad(rows)
    eos = _early_eos(target, rows[1])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD, eos_token_id=eos)
    greedy = target.generate(ids, **kwargs)
    assert (greedy[1, ids.shape[1] :] == PAD).any()  # row 1 stops early at its EOS
    config = dict(budget=budget, min_context=64, sink_tokens=2, recent_tokens=4)
    outs, stats = {}, {}
    with dustin_hf.patch(target):
        for mode in ("sparse", "exact"):
            out = target.generate(
                ids,
                assistant_model=draft,
                cache_implementation="dustin",
                return_dict_in_generate=True,
                cache_config={**config, "mode": mode},
                **kwargs,
            )
            outs[mode], stats[mode] = out.sequences, out.past_key_values.stats
    assert torch.equal(outs["exact"], greedy)
    exact = stats["exact"]["exact"]
    assert stats["exact"]["sparse_steps"] > 0 and exact["sparse_row_steps"] > 0 and exact["confirmations"] > 0
    assert exact["tentative_rejected"] > 0  # the dense check really had something to correct
    assert stats["sparse"]["sparse_steps"] > 0
    return not torch.equal(outs["sparse"], greedy)


def test_exact_greedy_equals_greedy_where_sparse_does_not():
    """Ragged left-padded batches of 4 (one row stops early at its EOS), budgets 8-128 far below the contexts:
    exact mode equals plain greedy decoding for every row, with sparse steps and rejected tentative tokens
    really happening, while sparse mode's output differs in some case (so the comparison can fail)."""
    differs = [_decode_case(*case) for case in CASES]
    assert any(differs)


@pytest.mark.parametrize("sparse_draft, sample", [(False, False), (True, False), (True, True)])
def test_confirming_steps_queue_the_next_drafts_too(sparse_draft, sample):
    """The next step's first draft forwards, queued before a step's sync (CUDA graphs; run eagerly here), are
    queued after a confirming step as after a sparse one, from each row's block start, with rows that rejected
    tentative tokens and a row ending early: every step queues them, and the output is still greedy's (sampling:
    the same draws as without queueing)."""
    target = tiny_model("qwen2", layers=2, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target, noise=0.02), 3)
    rows = [random_prompt(n, seed=n)[0] for n in (1500, 400, 760, 610)]
    ids, mask = left_pad(rows)
    kwargs = dict(
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=24,
        pad_token_id=PAD,
        eos_token_id=_early_eos(target, rows[1]),
    )
    greedy = target.generate(ids, **kwargs)
    kwargs["do_sample"] = sample
    # recent_tokens 4 < confirm_tokens + γ: some cuts lie below a recent window (counted on the device)
    config = dict(budget=32, min_context=64, sink_tokens=2, recent_tokens=4, mode="exact", sparse_draft=sparse_draft)
    runs = []
    with dustin_hf.patch(target) as handle:
        for ahead in (False, True):
            handle.hooks = DecodeHooks(queue_eagerly=ahead)  # what the CUDA graphs queue, on the CPU
            torch.manual_seed(3)
            out = target.generate(
                ids,
                assistant_model=draft,
                cache_implementation="dustin",
                return_dict_in_generate=True,
                cache_config=config,
                **kwargs,
            )
            assert sample or torch.equal(out.sequences, greedy)
            runs.append((out.sequences, out.past_key_values.stats, out.past_key_values.run_stats.trace))
    (seq_after, after, trace_after), (seq_ahead, ahead, trace_ahead) = runs
    assert torch.equal(seq_ahead, seq_after)
    assert ahead["exact"]["confirm_steps"] > 0 and ahead["exact"]["tentative_rejected"] > 0
    assert after["steps_drafted_ahead"] == 0 and ahead["steps_drafted_ahead"] == ahead["steps"]  # the last one too
    # the queued forwards drafted what the forwards after the sync did: every step kept the same drafts
    assert trace_ahead == trace_after and ahead["exact"] == after["exact"]


def test_confirm_tokens_zero_verifies_densely_every_step():
    """The lossless sparse-draft baseline: no tentative token ever, the draft reads its selections."""
    target = tiny_model("qwen2", layers=2, hidden=32)
    draft = set_gamma(noisy_copy(target, noise=0.02), 3)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (600, 350)])
    greedy = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD)
    with dustin_hf.patch(
        target,
        dustin_hf.DustinConfig(
            budget=16,
            min_context=64,
            sink_tokens=2,
            recent_tokens=4,
            mode="exact",
            confirm_tokens=0,
            sparse_draft=True,
        ),
    ):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=PAD,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert torch.equal(out.sequences, greedy)
    assert stats["sparse_steps"] == 0 and stats["exact"]["sparse_row_steps"] == 0
    assert stats["draft_sparse_forwards"] > 0


def test_exact_mode_settings_are_validated():
    with pytest.raises(ValueError, match="mode must be one of"):
        dustin_hf.DustinConfig(mode="lossless")
    with pytest.raises(ValueError, match="confirm_every must be >= 1"):
        dustin_hf.DustinConfig(mode="exact", confirm_every=0)
    with pytest.raises(ValueError, match="confirm_tokens must be a non-negative int"):
        dustin_hf.DustinConfig(mode="exact", confirm_tokens=-1)


def _joint_law_case():
    """A 6-token vocabulary, a 60-token prompt read through 4 positions: the sparse target's next-token law is
    far from the dense one. Returns the models, the prompt and the dense law of the first two new tokens."""
    vocab = 6
    target = tiny_model("qwen2", layers=2, hidden=32, vocab=vocab, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)  # spread out, not uniform
    draft = set_gamma(noisy_copy(target, noise=0.5), 2)
    prompt = torch.randint(0, vocab, (1, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        p0 = target(prompt).logits[0, -1].softmax(-1)
        following = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p1 = target(following).logits[:, -1].softmax(-1)
    return target, draft, prompt, (p0[:, None] * p1).flatten()


def _pvalue(target, draft, prompt, law, mode, draws=2000, **settings) -> float:
    """The chi-square p-value of ``draws`` sampled (t0, t1) pairs against ``law`` (the decoder run directly, its
    prefill copied from one row: the rows are one prompt); ``settings``: more :class:`DustinConfig` fields."""
    torch.manual_seed(0)
    config = resolve(
        dustin_hf.DustinConfig(budget=4, min_context=0, sink_tokens=1, recent_tokens=1, mode=mode, **settings),
        target.config,
        draft.config,
    )
    generation = GenerationConfig(do_sample=True, top_k=0, max_length=prompt.shape[1] + 2, pad_token_id=0)
    with dustin_hf.patch(target), attention_routed(target, draft):
        decoder = decoding.SpeculativeDecoder(
            target,
            draft,
            generation,
            dustin_config=config,
            drafting=Drafting(2),
            hooks=DecodeHooks(prefill=tiled_prefill(1)),
        )
        out = decoder.generate(prompt.expand(draws, -1)).sequences
    return law_pvalue(out[:, prompt.shape[1] :], law, int(round(law.numel() ** 0.5)))


def test_exact_sampling_follows_the_targets_law(monkeypatch):
    """Sparse mode's law of the first two tokens measurably differs from the target's; exact mode's matches it;
    exact mode with a broken hierarchical rule (tentative tokens checked against the draft's q instead of the
    sparse target's p~) is rejected by the same check."""
    target, draft, prompt, law = _joint_law_case()
    assert _pvalue(target, draft, prompt, law, "sparse") < P_VALUE
    assert _pvalue(target, draft, prompt, law, "exact") > P_VALUE

    right = exact_mode.block_proposals

    def wrong(draft_probs, tentative_probs, tentative, vocab, width):
        """The tentative tokens' proposal replaced by the uniform law: not what they were drawn from."""
        out = right(draft_probs, tentative_probs, tentative, vocab, width)
        for b, n in enumerate(tentative):
            out[b, :n] = 1.0 / vocab
        return out

    monkeypatch.setattr(exact_mode, "block_proposals", wrong)  # the loop's own reference
    assert _pvalue(target, draft, prompt, law, "exact") < P_VALUE


# ---- the law over several confirmations per row ----------------------------------------------------------------
# Vocabulary 3 and 5 tokens: a joint law of 243 sequences (~100 expected 5+ times in 3000 draws), which 3000 draws pin
# down (each run ~3 s on one core). Budget 4 of a 60-token prompt makes the sparse target p~ far from the dense p,
# and confirm_tokens=1, confirm_every=1 make a row confirm right after each sparse step: two confirmations in
# the 4 tokens after the first (which the prefill draws from p), so every row's second confirmation checks its
# tentative tokens against the p~ it holds since its first. lm_head x5 spreads the law over the cells; at x30
# the target nearly always picks one sequence and a broken rule has little to move. Stale proposals (a row's
# tentative distributions kept past a confirmation) give p ~ 1e-22 here, a broken residual p ~ 1e-200.
LAW_VOCAB, LAW_TOKENS, LAW_DRAWS = 3, 5, 3000
LAW_CONFIG = dict(budget=4, sink_tokens=1, recent_tokens=1, mode="exact", confirm_tokens=1, confirm_every=1)


def _law_pair():
    target = tiny_model("qwen2", layers=2, hidden=32, vocab=LAW_VOCAB, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    return target, set_gamma(noisy_copy(target, noise=0.5), 1)


def _exact_samples(target, draft, prompts: list[torch.Tensor], draws: int, **config):
    """``draws`` rows that repeat ``prompts`` in turn, sampled in exact mode for LAW_TOKENS tokens: the new tokens
    ``(draws, LAW_TOKENS)`` and ``stats["exact"]``."""
    torch.manual_seed(0)
    ids, mask = left_pad(prompts * (draws // len(prompts)), pad_id=0)
    config = resolve(dustin_hf.DustinConfig(**{**LAW_CONFIG, **config}), target.config, draft.config)
    generation = GenerationConfig(do_sample=True, top_k=0, max_length=ids.shape[1] + LAW_TOKENS, pad_token_id=0)
    with dustin_hf.patch(target), attention_routed(target, draft):
        decoder = decoding.SpeculativeDecoder(
            target,
            draft,
            generation,
            dustin_config=config,
            drafting=Drafting(1),
            hooks=DecodeHooks(prefill=tiled_prefill(len(prompts))),
        )
        result = decoder.generate(ids, mask)
    return result.sequences[:, ids.shape[1] :], result.stats.reports["exact"]


def _keeping_stale_proposals(monkeypatch):
    """A confirmation that no longer clears the row's tentative distributions (the bug this law test guards)."""
    confirm = ConfirmSchedule.after_confirm

    def stale(self, b, *args, **kwargs):
        held = self.proposals[b]
        confirm(self, b, *args, **kwargs)
        self.proposals[b] = held

    monkeypatch.setattr(ConfirmSchedule, "after_confirm", stale)


def test_exact_sampling_follows_the_targets_law_over_several_confirmations(monkeypatch):
    """The joint law of a row's first 5 tokens, through two confirmations per row, is the target's; the same
    check rejects confirmations that keep a row's stale tentative distributions."""
    target, draft = _law_pair()
    prompt = torch.randint(0, LAW_VOCAB, (60,), generator=torch.Generator().manual_seed(5))
    law = joint_law(target, prompt[None], LAW_TOKENS)
    tokens, stats = _exact_samples(target, draft, [prompt], LAW_DRAWS, min_context=0)
    assert stats["confirmations"] >= 1.9 * LAW_DRAWS and stats["tentative_rejected"] > 0.1 * LAW_DRAWS, stats
    p = law_pvalue(tokens, law, LAW_VOCAB)
    assert p > P_VALUE, f"the first {LAW_TOKENS} tokens do not follow the target's law: p = {p:.3g}"

    _keeping_stale_proposals(monkeypatch)
    tokens, _ = _exact_samples(target, draft, [prompt], LAW_DRAWS, min_context=0)
    p = law_pvalue(tokens, law, LAW_VOCAB)
    assert p < P_VALUE, f"stale proposals pass the law test: p = {p:.3g}"


def test_exact_sampling_follows_the_targets_law_with_rows_confirming_at_different_steps(monkeypatch):
    """A batch alternating two prompts, 60 and 41 tokens, with min_context 42: the short rows verify their first
    step densely (committed at once) and confirm one step after the long ones, so every confirming step confirms
    half the batch while the other half verifies sparsely. Each prompt's rows follow the target's joint law of
    5 tokens."""
    target, draft = _law_pair()
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, LAW_VOCAB, (n,), generator=generator) for n in (60, 41)]
    first_confirmation = {}  # row: the index among confirming steps of its first
    confirm = ConfirmSchedule.after_confirm

    def recording(self, b, *args, **kwargs):
        first_confirmation.setdefault(b, self.stats.confirm_steps)  # counted once the step is done
        confirm(self, b, *args, **kwargs)

    monkeypatch.setattr(ConfirmSchedule, "after_confirm", recording)
    tokens, stats = _exact_samples(target, draft, prompts, LAW_DRAWS, min_context=42)
    assert {first_confirmation[b] for b in range(0, LAW_DRAWS, 2)} == {0}  # the long rows, at the first
    assert min(first_confirmation[b] for b in range(1, LAW_DRAWS, 2)) == 1  # the short ones, a step later
    assert stats["confirmations"] >= 1.5 * LAW_DRAWS, stats
    for i, prompt in enumerate(prompts):
        p = law_pvalue(tokens[i::2], joint_law(target, prompt[None], LAW_TOKENS), LAW_VOCAB)
        assert p > P_VALUE, (
            f"the rows of the {prompt.numel()}-token prompt do not follow the target's law: p = {p:.3g}"
        )


def test_sampled_exact_scores_with_the_prefix_alone(monkeypatch):
    """p~ judges the tentative tokens' proposals, so it must not depend on them: a sampled exact step scores
    positions with the draft's query of x alone (its later queries were fed the drafts p~ is about to judge);
    greedy exact mode and sparse mode score with all γ."""
    from dustin_hf.selection.selector import Selector

    seen = []
    real = Selector.select

    def recording(self, target, draft, seqlens, base, kept_queries, gamma, row_gamma=None, **kwargs):
        seen.append((gamma, {len(queries) for queries in kept_queries.values()}))
        return real(self, target, draft, seqlens, base, kept_queries, gamma, row_gamma, **kwargs)

    monkeypatch.setattr(Selector, "select", recording)
    target = tiny_model("qwen2", layers=2, hidden=32)
    draft = set_gamma(noisy_copy(target, noise=0.3), 3)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (300, 200)])
    config = dict(budget=8, min_context=16, sink_tokens=1, recent_tokens=1)
    with dustin_hf.patch(target):
        for mode, sample in (("exact", True), ("exact", False), ("sparse", True)):
            seen.clear()
            target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                do_sample=sample,
                max_new_tokens=8,
                pad_token_id=PAD,
                cache_implementation="dustin",
                cache_config={**config, "mode": mode},
            )
            assert seen, mode
            expected = (1, {1}) if (mode, sample) == ("exact", True) else (3, {3})
            assert all(call == expected for call in seen), (mode, sample, seen)


def test_a_partial_rejection_never_raises_the_limit_past_confirm_tokens():
    """A row that held confirm_tokens + γ - 1 tentative tokens and kept all but one drops its limit to what it
    kept, capped at confirm_tokens: with a larger limit it would next hold more tentative tokens than a
    confirming block has room for."""
    schedule = ConfirmSchedule(batch=1, confirm_tokens=4, confirm_every=4)
    schedule.after_confirm(0, tentative=8, kept=7, committed=8)
    assert schedule.limit == [4]
    schedule.after_confirm(0, tentative=4, kept=2, committed=3)
    assert schedule.limit == [2]
    schedule.after_confirm(0, tentative=3, kept=3, committed=5)
    assert schedule.limit == [4]  # doubled, capped


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_rows_never_hold_more_tentative_tokens_than_a_confirming_block(sample):
    """Replayed outcomes that maximise the tentative count: sparse steps keep every draft, a confirmation
    rejects only the last tentative token (so the row's limit would follow what it kept). The loop checks on
    the host that each confirming row's tentative tokens fit the block; sampling's proposals would not fit
    either."""
    target = tiny_model("qwen2", layers=2, hidden=32)
    draft = set_gamma(noisy_copy(target, noise=0.02), 4)
    ids, mask = left_pad([random_prompt(300, seed=300)[0]])
    config = resolve(
        dustin_hf.DustinConfig(
            budget=16, min_context=16, sink_tokens=2, recent_tokens=4, mode="exact", confirm_tokens=4, confirm_every=4
        ),
        target.config,
        draft.config,
    )
    calls = [0]

    def confirm(n, tentative, dense):
        calls[0] += 1
        return torch.where(tentative > 0, tentative - 1, torch.full_like(n, 2 if calls[0] == 1 else 99))

    gen = GenerationConfig(do_sample=sample, max_length=ids.shape[1] + 40, pad_token_id=PAD)
    with dustin_hf.patch(target), attention_routed(target, draft):
        decoder = decoding.SpeculativeDecoder(
            target, draft, gen, dustin_config=config, drafting=Drafting(4), hooks=DecodeHooks(confirm=confirm)
        )
        result = decoder.generate(ids, mask)
    assert result.stats.reports["exact"]["tentative_rejected"] > 0 and calls[0] > 4


def _blocks_by_row(tokens, starts, tentative, drafts, width):
    """The verification inputs spelled out row by row: x, its tentative tokens, its drafts; cut or padded with the
    row's last input to ``width``."""
    out = []
    for b, (start, n) in enumerate(zip(starts, tentative)):
        row = torch.cat([tokens[b, start : start + 1 + n], drafts[b]])[:width]
        out.append(torch.cat([row, row[-1:].expand(width - row.numel())]))
    return torch.stack(out)


@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_blocks_lay_out_each_row_from_its_own_start(gamma):
    gen = torch.Generator().manual_seed(gamma)
    for trial in range(50):
        batch, held = 5, 40
        tokens = torch.randint(0, 1000, (batch, held), generator=gen)
        drafts = torch.randint(1000, 2000, (batch, gamma), generator=gen)
        tentative = torch.randint(0, 7, (batch,), generator=gen).tolist()
        starts = [int(torch.randint(0, held - 1 - n, (1,), generator=gen)) for n in tentative]
        width = int(torch.randint(1, 14, (1,), generator=gen))  # shorter than some rows, longer than others
        assert torch.equal(
            blocks(tokens, starts, tentative, drafts, width), _blocks_by_row(tokens, starts, tentative, drafts, width)
        ), (trial, starts, tentative, width)
