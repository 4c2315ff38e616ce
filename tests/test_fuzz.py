"""The seeded fuzz of ``tests/fuzz.py`` (issue #24): one test per drawn case, each failure printing its case and a
one-line reproduction; and the smallest case found for each cause of failure at the time the fuzz was written,
pinned so that each keeps being checked whatever the draw.

CI draws :data:`fuzz.CI_CASES` cases over seeds 0 and 1; ``DUSTIN_FUZZ_CASES=800`` draws 500 cases with a budget
covering the context and 300 with a small one (400 per seed); ``DUSTIN_FUZZ_SEED=S DUSTIN_FUZZ_CASE=I`` runs one.
"""

import pytest

from fuzz import Case, case_ids, check_case, draw_case, report

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = case_ids()

# Found by the draw (shrunk with ``python tests/fuzz.py --shrink``); each failed one invariant at the base commit
# and passes once its cause is fixed (the comment names the cause).
PINNED = {
    # min_new_tokens counted from the padded width: EOS stays banned on a short row
    "min_new_tokens_in_a_padded_batch": Case(
        seed=0, index=24, family="qwen3", layers=1, hidden=32, heads=2, kv_heads=1, draft_kind="independent",
        draft_family="llama", draft_layers=1, draft_hidden=32, draft_heads=4, draft_kv_heads=2, draft_vocab=96,
        noise=0.0, lengths=(4, 8), prompt_vocab=95, padding="left", gamma=1, threshold=0.0, max_new_tokens=7,
        eos=(48, 44, 62), processors=(("min_new_tokens", 2),), do_sample=False, sampling=(), covering=True,
        budget=52, sink_tokens=1, recent_tokens=10, draft_share=None, min_context=12, sparse_draft=False,
        dense_layers=(), calibration="none", subject=0
    ),
    # sparse_draft: a dense row in the batch makes the draft read everything, for every row
    "sparse_draft_beside_a_dense_row": Case(
        seed=1, index=86, family="mistral", layers=3, hidden=32, heads=2, kv_heads=1, draft_kind="independent",
        draft_family="qwen3", draft_layers=1, draft_hidden=64, draft_heads=4, draft_kv_heads=2, draft_vocab=96,
        noise=0.0, lengths=(26, 1), prompt_vocab=95, padding="left", gamma=3, threshold=0.0, max_new_tokens=4,
        eos=(), processors=(), do_sample=False, sampling=(), covering=False, budget=10, sink_tokens=4,
        recent_tokens=2, draft_share=None, min_context=22, sparse_draft=True, dense_layers=(), calibration="none",
        subject=0
    ),
    # the confidence threshold stops drafting only when no row is confident (greedy)
    "threshold_stops_drafting_for_the_batch": Case(
        seed=0, index=277, family="qwen3", layers=2, hidden=64, heads=2, kv_heads=2, draft_kind="clone",
        draft_family="qwen3", draft_layers=1, draft_hidden=64, draft_heads=2, draft_kv_heads=2, draft_vocab=96,
        noise=0.2, lengths=(75, 5), prompt_vocab=95, padding="left", gamma=2, threshold=0.12, max_new_tokens=4,
        eos=(), processors=(), do_sample=False, sampling=(), covering=False, budget=40, sink_tokens=1,
        recent_tokens=2, draft_share=None, min_context=23, sparse_draft=False, dense_layers=(), calibration="none",
        subject=0
    ),
    # the same, sampling with a covering budget: the batch's draft count moves the draws
    "threshold_shifts_the_sampling_draws": Case(
        seed=0, index=346, family="qwen3", layers=1, hidden=64, heads=2, kv_heads=1, draft_kind="clone",
        draft_family="qwen3", draft_layers=1, draft_hidden=64, draft_heads=2, draft_kv_heads=1, draft_vocab=96,
        noise=0.2, lengths=(1, 2), prompt_vocab=95, padding="left", gamma=2, threshold=None, max_new_tokens=4,
        eos=(), processors=(), do_sample=True, sampling=(), covering=True, budget=41, sink_tokens=4,
        recent_tokens=6, draft_share=None, min_context=16, sparse_draft=False, dense_layers=(), calibration="none",
        subject=0
    ),
    # prompt ids the smaller draft cannot embed (an IndexError in its prefill)
    "prompt_ids_past_the_draft_vocabulary": Case(
        seed=0, index=0, family="mistral", layers=1, hidden=64, heads=2, kv_heads=1, draft_kind="small_vocab",
        draft_family="llama", draft_layers=1, draft_hidden=64, draft_heads=4, draft_kv_heads=2, draft_vocab=91,
        noise=0.0, lengths=(17,), prompt_vocab=95, padding="left", gamma=1, threshold=0.0, max_new_tokens=4, eos=(),
        processors=(), do_sample=False, sampling=(), covering=True, budget=99, sink_tokens=4, recent_tokens=10,
        draft_share=None, min_context=61, sparse_draft=False, dense_layers=(), calibration="none", subject=0
    ),
    # repetition_penalty's per-row prompt_ignore_length meets one row at a time (a ValueError)
    "repetition_penalty_in_a_batch": Case(
        seed=0, index=10, family="qwen2", layers=1, hidden=32, heads=2, kv_heads=2, draft_kind="clone",
        draft_family="qwen2", draft_layers=1, draft_hidden=32, draft_heads=2, draft_kv_heads=2, draft_vocab=96,
        noise=0.2, lengths=(1, 2), prompt_vocab=95, padding="left", gamma=1, threshold=0.0, max_new_tokens=4,
        eos=(), processors=(("repetition_penalty", 1.19),), do_sample=False, sampling=(), covering=True, budget=106,
        sink_tokens=0, recent_tokens=11, draft_share=None, min_context=70, sparse_draft=False, dense_layers=(),
        calibration="none", subject=1
    ),
    # bad_words_ids' bias, sized on the target's logits, added to the draft's
    "bad_words_with_a_smaller_draft_vocabulary": Case(
        seed=0, index=11, family="mistral", layers=1, hidden=32, heads=4, kv_heads=4, draft_kind="small_vocab",
        draft_family="mistral", draft_layers=1, draft_hidden=32, draft_heads=4, draft_kv_heads=4, draft_vocab=88,
        noise=0.0, lengths=(1,), prompt_vocab=88, padding="left", gamma=1, threshold=0.0, max_new_tokens=4, eos=(),
        processors=(("bad_words_ids", ((48,), (76,))),), do_sample=False, sampling=(), covering=True, budget=69,
        sink_tokens=2, recent_tokens=4, draft_share=None, min_context=57, sparse_draft=False, dense_layers=(),
        calibration="none", subject=0
    ),
}


@pytest.mark.parametrize("seed, index", CASES, ids=[f"s{seed}-c{index}" for seed, index in CASES])
def test_fuzz(seed, index):
    case = draw_case(seed, index)
    failures = check_case(case)
    if failures:
        pytest.fail(report(case, failures), pytrace=False)


@pytest.mark.parametrize("name", PINNED)
def test_pinned(name):
    failures = check_case(PINNED[name])
    if failures:
        pytest.fail(report(PINNED[name], failures, f"python -m pytest tests/test_fuzz.py -k {name}"), pytrace=False)
