"""Speculative sampling: the committed tokens follow the target's distribution exactly.

Chi-square tests with fixed seeds. Each test also runs a deliberately wrong residual rule through
the same check and asserts that it is rejected, so the check has the power to catch a broken rule.
"""

import pytest
import torch
from conftest import joint_law, law_pvalue, tiled_prefill
from scipy.stats import chisquare
from tiny_models import noisy_copy, set_gamma, tiny_model

import dustin_hf
from dustin_hf.decode.sampling import RowGenerators, accept_greedy, accept_sampled

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only wait on each other

P_VALUE = 1e-3


def _right_rule(draft_tokens, draft_probs, target_scores):
    return accept_sampled(
        draft_tokens, draft_probs, target_scores, RowGenerators(len(draft_tokens), torch.device("cpu"))
    )


def _wrong_rule(draft_tokens, draft_probs, target_scores):
    """Accepts like the right rule but replaces a rejected token with a draw from p (not the residual)."""
    n, _ = _right_rule(draft_tokens, draft_probs, target_scores)
    p = target_scores.softmax(-1)
    rows = torch.arange(len(n))
    return n, torch.multinomial(p[rows, n], 1).squeeze(1)


def _first_emitted(rule, p_logits, q, draws, seed):
    torch.manual_seed(seed)
    batch_p = p_logits.expand(draws, -1, -1)
    batch_q = q.expand(draws, -1, -1)
    drafts = torch.multinomial(batch_q.reshape(-1, q.shape[-1]), 1).reshape(draws, -1)
    n, nxt = rule(drafts, batch_q, batch_p)
    return torch.where(n > 0, drafts[:, 0], nxt)


@pytest.mark.parametrize("seed", [0, 1])
def test_first_committed_token_follows_the_target(seed):
    torch.manual_seed(100 + seed)
    vocab, gamma, draws = 6, 3, 40000
    p_logits = torch.randn(1, gamma + 1, vocab) * 1.5
    q = (torch.randn(1, gamma, vocab) * 1.5).softmax(-1)
    expected = p_logits[0, 0].double().softmax(-1) * draws
    right = torch.bincount(_first_emitted(_right_rule, p_logits, q, draws, seed), minlength=vocab)
    wrong = torch.bincount(_first_emitted(_wrong_rule, p_logits, q, draws, seed), minlength=vocab)
    assert chisquare(right.numpy(), expected.numpy()).pvalue > P_VALUE
    assert chisquare(wrong.numpy(), expected.numpy()).pvalue < P_VALUE


def test_identical_distributions_accept_everything():
    probs = torch.tensor([[0.5, 0.3, 0.2]]).expand(1000, 2, 3)
    drafts = torch.multinomial(probs.reshape(-1, 3), 1).reshape(1000, 2)
    scores = torch.cat([probs, probs[:, :1]], dim=1).log()
    n, _ = _right_rule(drafts, probs, scores)
    assert bool((n == 2).all())


def test_greedy_acceptance_counts_the_agreeing_prefix():
    scores = torch.full((3, 4, 5), -1.0)
    for b, tokens in enumerate([[1, 2, 3, 4], [1, 0, 3, 4], [0, 2, 3, 4]]):
        scores[b, torch.arange(4), torch.tensor(tokens)] = 1.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    n, nxt = accept_greedy(drafts, scores.argmax(dim=-1))
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [4, 0, 0]


def test_generate_samples_the_targets_joint_law():
    """Batch of identical prompts through the patched generate(): (t0, t1) ~ p(t0) p(t1 | t0)."""
    vocab, draws = 6, 3000
    target = tiny_model("qwen2", layers=2, hidden=32, vocab=vocab)
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)  # a spread-out but not uniform next-token law
    draft = set_gamma(noisy_copy(target, noise=0.5), 3)
    prompt = torch.tensor([[1, 4, 2]])
    with torch.no_grad():
        p0 = target(prompt).logits[0, -1].softmax(-1)
        nxt = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p1 = target(nxt).logits[:, -1].softmax(-1)
    expected = (p0[:, None] * p1).flatten() * draws
    torch.manual_seed(0)
    with dustin_hf.patch(target):
        out = target.generate(
            prompt.expand(draws, -1),
            attention_mask=torch.ones(draws, 3, dtype=torch.long),
            assistant_model=draft,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=2,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    pairs = out.sequences[:, 3] * vocab + out.sequences[:, 4]
    counts = torch.bincount(pairs, minlength=vocab * vocab).double()
    keep = expected > 5  # chi-square needs populated cells; pool the rest
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    wanted = torch.cat([expected[keep], expected[~keep].sum()[None]]).double()
    assert chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue > P_VALUE
    assert out.past_key_values.stats["steps"] >= 1


def test_generate_samples_the_processed_law_over_several_steps():
    """With a budget covering the context, ``do_sample=True, temperature=0.5, top_p=0.8`` through the patched
    generate(): the joint law of the first 5 tokens is the target's as those processors shape it (stock
    sampling's), over 2 steps of 2 drafts each. The test above stops at the first draft of the first step, at
    temperature 1, where the draft's processed distribution q is its raw softmax.

    Why sharp: vocabulary 4 and 5 tokens (1024 sequences, ~130 expected 5+ times in 3000 draws); ``lm_head`` x3
    spreads the law over them; a noisy copy (noise 0.05) keeps all its drafts ~2/5 of the time, so the bonus token
    (drawn from p after the last draft) and second steps are common; at temperature 0.5 q differs from the draft's
    raw softmax, and top-p 0.8 gives sequences of probability 0. Accepting with q from the raw logits gives
    p ~ 1e-42; a bonus drawn from the last draft's p draws sequences top-p excludes (p = 0)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    from dustin_hf.decode.hooks import DecodeHooks

    vocab, tokens, draws, temperature, top_p = 4, 5, 3000, 0.5, 0.8
    target = tiny_model("qwen2", layers=2, hidden=32, vocab=vocab)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    draft = set_gamma(noisy_copy(target, noise=0.05), 2)
    prompt = torch.tensor([[1, 3, 2]])
    law = joint_law(
        target, prompt, tokens, LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
    )
    assert (law == 0).any()  # top-p excludes some sequences
    torch.manual_seed(0)
    hooks = DecodeHooks(prefill=tiled_prefill(1))  # one prompt: prefill it once, not per row
    with dustin_hf.patch(target, hooks=hooks):
        out = target.generate(
            prompt.expand(draws, -1),
            attention_mask=torch.ones(draws, 3, dtype=torch.long),
            assistant_model=draft,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=top_p,
            max_new_tokens=tokens,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert stats["steps"] >= 2 and 0.25 < stats["acceptance_rate"] < 0.75, stats
    p = law_pvalue(out.sequences[:, 3:], law, vocab)
    assert p > P_VALUE, f"the first {tokens} tokens do not follow the processed law: p = {p:.3g}"
