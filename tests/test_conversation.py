"""The conversation benchmark (``benchmarks/conversation.py``) in its ``--smoke`` form: tiny models, CPU, synthetic
replays. It checks the script, not the timings: every (turn, method) is recorded, the dustin methods' follow-up turns
read only what the held caches do not hold, and stock's assisted decoding reads the whole prompt again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import conversation  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, far faster under load


@pytest.fixture(scope="module")
def smoke():
    return conversation.main(["--smoke"])


def _by(records) -> dict:
    return {(r["method"], r["context"], r["batch"], r["turn"]): r for r in records}


def test_every_turn_of_every_method_is_recorded_with_its_ratio_to_stock_reuse(smoke):
    sizes = conversation.SMOKE
    records = _by(smoke["records"])
    turns = range(sizes["follow_ups"] + 1)
    for context in sizes["contexts"]:
        for batch in sizes["batches"]:
            for method in conversation.METHODS:
                if method == "stock_assisted_reuse" and batch != 1:
                    continue
                for turn in turns:
                    r = records.pop((method, context, batch, turn))
                    assert r["seconds"] > 0 and r["x_vs_plain_reuse"] is not None, r
                    assert r["generated_tokens"] == batch * sizes["new_tokens"], r
    assert not records, sorted(records)


def test_dustin_follow_ups_read_only_the_last_answer_and_the_new_question(smoke):
    """Turn 0 reads the whole prompt; each follow-up reads the rows' new tokens (the held caches hold the last
    prompt), as stock's recipe reads what its document cache lacks; plain generate() reads everything."""
    sizes = conversation.SMOKE
    added = sizes["new_tokens"] + sizes["question_tokens"]
    for r in smoke["records"]:
        whole, since_document = r["batch"] * r["prompt_tokens"], r["batch"] * (r["prompt_tokens"] - r["context"])
        expected = {
            "generate": whole,
            "generate_reuse": since_document,
            "stock_assisted_reuse": whole + r["batch"] * (r["prompt_tokens"] - r["context"]),
            "dustin_sparse_draft": whole if r["turn"] == 0 else r["batch"] * added,
            "dustin_exact": whole if r["turn"] == 0 else r["batch"] * added,
        }[r["method"]]
        if r["method"] == "stock_assisted_reuse":  # the cache's rest, then the whole prompt again on top of it
            assert r["prefill_tokens"] >= whole and r["tokens_wrong_in_stock"], r
            continue
        assert r["prefill_tokens"] == expected, r
