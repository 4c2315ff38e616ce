"""Row independence: a row's tokens depend only on its own prompt, the config and the seed, never on its
batch-mates (README, "Three guarantees"), under every setting that decides how much a row drafts.

How much a row drafts is its own: the confidence threshold cuts its drafts after its own unconfident draft, the
``"heuristic"`` schedule grows and shrinks its own length; and in exact mode a sampled row confirms on its own
schedule (when it confirms decides which draws it makes). Each case decodes one subject row alone, then at row 1
and at row 2 of two batches of three ragged prompts, each batch with another row 0, and checks that the subject's
tokens and its steps (the drafts it kept at each step, ``run_stats.trace``) are the same in all three runs.

Why the cases are sharp, that is fail when a row drafts row 0's count or confirms when row 0 does:

- greedy decoding with a budget covering the context returns the target's greedy tokens whatever was drafted, so
  there only the steps can show it; a sparse budget (the drafts' queries score the positions verification reads)
  and sampling (a row's draws follow its draft count) show it in the tokens too;
- the target's ``lm_head`` is scaled up so that the draft's probability of its own drafts spreads around the
  threshold 0.5 (a tiny random model's distributions are near uniform, so every draft would be unconfident and
  every row would draft one token), and the draft is noisy enough that rows keep different numbers of drafts,
  so the ``"heuristic"`` lengths of different rows part within a few steps;
- each run asserts that the subject drafted a different count than row 0, or confirmed when row 0 did not (or
  the reverse), in some step: the premise under which following row 0 changes the subject.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD, left_pad, noisy_copy, random_prompt, tiny_model

import dustin_hf
from dustin_hf.decode.confirm import ConfirmSchedule
from dustin_hf.decode.drafter import Drafter
from dustin_hf.decode.sampling import RowGenerators

pytestmark = pytest.mark.usefixtures("one_thread")

SUBJECT = 520  # the subject's prompt length: past min_context, far past the sparse budget
BATCHES = [(700, 300), (180, 650)]  # each batch's two other rows, row 0 first (180: below min_context, a dense row)
SPARSE = {"budget": 48, "min_context": 256, "sink_tokens": 2, "recent_tokens": 6}
DENSE = {"budget": 4096, "min_context": 0}  # covers every context here
EXACT = {**SPARSE, "mode": "exact", "confirm_tokens": 2, "confirm_every": 2}  # sampled rows confirm on their own
VERIFY = {"selection": "verify", "selection_layers": (0,)}
SEED = 11
LAST_ROW = 2  # the subject sits at row 0 (alone), 1 and 2

CASES = {  # name: (num_assistant_tokens_schedule, assistant_confidence_threshold, do_sample, cache_config)
    "heuristic-threshold-greedy-dense": ("heuristic", 0.5, False, DENSE),
    "threshold-greedy-sparse": ("constant", 0.5, False, SPARSE),
    "threshold-sampling-dense": ("constant", 0.5, True, DENSE),
    "heuristic-greedy-sparse": ("heuristic", 0.0, False, SPARSE),
    "heuristic-sampling-dense": ("heuristic", 0.0, True, DENSE),
    "heuristic-threshold-sampling-sparse": ("heuristic", 0.5, True, SPARSE),
    "exact-sampling": ("constant", 0.0, True, EXACT),
    "exact-heuristic-threshold-sampling": ("heuristic", 0.5, True, EXACT),
    # the verification forward chooses each row's read set at its selection layer (test_select_layers.py)
    "verify-select-threshold-greedy-sparse": ("constant", 0.5, False, {**SPARSE, **VERIFY}),
    "verify-select-exact-sampling": ("constant", 0.0, True, {**EXACT, **VERIFY}),
}


def _pair():
    """A target whose next-token distributions are peaked (``lm_head`` x40: the draft's probability of its greedy
    draft has median ~0.6, so a threshold of 0.5 stops some rows' drafting and not others'), and a noisy copy
    whose greedy choice agrees with the target's ~2/5 of the time."""
    target = tiny_model("qwen2", layers=2, hidden=32)
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)
    return target, noisy_copy(target, noise=0.01)


def _seed_row(position: int) -> None:
    """Seed the global generator so that the row at ``position`` gets the same random stream in every run.

    :class:`~dustin_hf.decode.sampling.RowGenerators` seeds row ``b`` with the ``b``-th value of one ``torch.randint``
    call: skipping ``LAST_ROW - position`` values first hands every position the same seed (checked here)."""

    def seed_at(skip: int, row: int) -> int:
        torch.manual_seed(SEED)
        torch.randint(0, 2**32, (skip,))
        state = torch.get_rng_state()
        seed = int(RowGenerators(row + 1, torch.device("cpu")).seeds[row])
        torch.set_rng_state(state)
        return seed

    assert seed_at(LAST_ROW - position, position) == seed_at(0, LAST_ROW)
    seed_at(LAST_ROW - position, position)


def _batches() -> list[tuple[list[torch.Tensor], int]]:
    """``(rows, the subject's row)``: the subject alone, then at row 1 and at row 2 of a batch of three."""
    subject = random_prompt(SUBJECT, seed=SUBJECT)[0]
    batches = [([subject], 0)]
    for position, (first, other) in enumerate(BATCHES, start=1):
        rows = [random_prompt(first, seed=first)[0], random_prompt(other, seed=other)[0]]
        rows.insert(position, subject)
        batches.append((rows, position))
    return batches


def _subject_runs(monkeypatch, schedule: str, threshold: float, sample: bool, cache_config: dict) -> list[dict]:
    """Per run (alone, batch 1, batch 2): the subject's generated ``tokens``, the drafts it ``kept`` at each of
    its steps, and the number of steps in which it drafted a different count than row 0 or confirmed when row 0
    did not, or the reverse (``differs``)."""
    target, draft = _pair()
    steps = []  # per step of the current run and row: [drafts proposed, confirmed (exact mode)]; None: finished
    real_draft, real_confirm = Drafter.draft, ConfirmSchedule.after_confirm

    def drafting(self, run, *args, **kwargs):
        drafts = real_draft(self, run, *args, **kwargs)
        steps.append([None if done else [g, False] for g, done in zip(drafts.row_gamma, run.rows.finished)])
        return drafts

    def confirming(self, b, *args, **kwargs):
        steps[-1][b][1] = True
        return real_confirm(self, b, *args, **kwargs)

    monkeypatch.setattr(Drafter, "draft", drafting)
    monkeypatch.setattr(ConfirmSchedule, "after_confirm", confirming)
    runs = []
    with dustin_hf.patch(target):
        for rows, position in _batches():
            ids, mask = left_pad(rows)
            # the draft's settings as a user sets them, before every call: "heuristic" writes its final length back
            draft.generation_config.num_assistant_tokens = 3
            draft.generation_config.num_assistant_tokens_schedule = schedule
            draft.generation_config.assistant_confidence_threshold = threshold
            if sample:
                _seed_row(position)
            steps.clear()
            out = target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                do_sample=sample,
                max_new_tokens=24,
                pad_token_id=PAD,
                cache_implementation="dustin",
                cache_config=cache_config,
                return_dict_in_generate=True,
            )
            cache = out.past_key_values
            assert (cache.stats["sparse_steps"] > 0) == (cache_config is not DENSE), cache.stats
            runs.append(
                {
                    "tokens": out.sequences[position, ids.shape[1] :].tolist(),
                    "kept": [accepted[position] for _, accepted in cache.run_stats.trace if accepted[position] >= 0],
                    "differs": sum(
                        1 for step in steps if None not in (step[0], step[position]) and step[0] != step[position]
                    ),
                }
            )
    return runs


@pytest.mark.parametrize("case", CASES)
def test_a_rows_tokens_do_not_depend_on_its_batch_mates(case, monkeypatch):
    """The subject's tokens, and the drafts it kept at each step, are the same alone, at row 1 beside one pair of
    batch-mates and at row 2 beside another; in each batch it drafted a different count than row 0, or confirmed
    apart from it, in some step (so a row following row 0 would change them)."""
    alone, *batched = _subject_runs(monkeypatch, *CASES[case])
    for run, got in enumerate(batched, start=1):
        at = next((j for j, (g, w) in enumerate(zip(got["tokens"], alone["tokens"])) if g != w), None)
        assert got["tokens"] == alone["tokens"], (
            f"batch {run}: the subject's tokens differ from alone at {at}: {got['tokens']} vs {alone['tokens']}"
        )
        assert got["kept"] == alone["kept"], (
            f"batch {run}: the subject's drafts kept per step differ from alone: {got['kept']} vs {alone['kept']}"
        )
    assert all(run["differs"] for run in batched), (
        f"the subject drafted and confirmed as row 0 did at every step: {[run['differs'] for run in batched]}"
    )
