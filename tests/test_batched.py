"""Batches: ragged prompts and acceptance, EOS per row, sampling law, no cross-row leakage, bad input."""

import pytest
import torch
from tiny_models import PAD, left_pad, noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.decode.hooks import DecodeHooks

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, far faster under load

LENGTHS = [5, 23, 40, 12, 31]


def _rows(seed=0, lengths=LENGTHS):
    return [random_prompt(n, seed=seed * 100 + i)[0] for i, n in enumerate(lengths)]


def _alone(target, row, **kwargs):
    return target.generate(row[None], do_sample=False, **kwargs)[0, row.numel() :]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dustin", [False, True])
def test_each_row_equals_its_prompt_decoded_alone(family, dustin):
    target = tiny_model(family, layers=3)
    draft = set_gamma(noisy_copy(target), 4)
    rows = _rows()
    ids, mask = left_pad(rows)
    extra = {"cache_implementation": "dustin"} if dustin else {}
    with dustin_hf.patch(target):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            max_new_tokens=25,
            do_sample=False,
            return_dict_in_generate=True,
            **extra,
        )
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, ids.shape[1] :], _alone(target, row, max_new_tokens=25)), f"row {b}"
    stats = out.past_key_values.stats
    assert 0 < stats["acceptance_rate"] < 1  # ragged acceptance actually happened


def test_rows_stop_at_their_own_eos():
    target = tiny_model("qwen2", layers=3)
    draft = set_gamma(noisy_copy(target), 4)
    rows = _rows(seed=1)
    ids, mask = left_pad(rows)
    eos = int(_alone(target, rows[1], max_new_tokens=6)[5])  # row 1 emits it at its 6th token (or earlier)
    pad = PAD
    kwargs = dict(max_new_tokens=25, eos_token_id=eos, pad_token_id=pad)
    with dustin_hf.patch(target):
        out = target.generate(
            ids, attention_mask=mask, assistant_model=draft, do_sample=False, cache_implementation="dustin", **kwargs
        )
    lengths = []
    for b, row in enumerate(rows):
        ref = _alone(target, row, **kwargs)
        got = out[b, ids.shape[1] :]
        assert torch.equal(got[: ref.numel()], ref), f"row {b}"
        assert bool((got[ref.numel() :] == pad).all())
        lengths.append(ref.numel())
    assert min(lengths) <= 6 < max(lengths)  # some rows stopped early, others went on


@pytest.mark.parametrize("sparse_draft", [False, True])
def test_no_cross_row_leakage_in_sparse_selection(sparse_draft):
    """Rows that differ only in content: a row's output never depends on the other rows (nor, with the
    sparse draft, on what the other rows' drafts read)."""
    target = tiny_model("qwen2", layers=2, hidden=32)
    draft = set_gamma(noisy_copy(target), 3)
    common = random_prompt(700, seed=5)[0]
    others = [random_prompt(n, seed=10 + n)[0] for n in (650, 720, 300)]
    config = DustinConfig(budget=48, min_context=256, sink_tokens=2, recent_tokens=6, sparse_draft=sparse_draft)
    outputs = []
    with dustin_hf.patch(target, config):
        alone = target.generate(
            common[None],
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=20,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
        assert alone.past_key_values.stats["sparse_steps"] > 0
        assert (alone.past_key_values.stats["draft_sparse_forwards"] > 0) == sparse_draft
        for other in others:
            ids, mask = left_pad([other, common])
            out = target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                do_sample=False,
                max_new_tokens=20,
                cache_implementation="dustin",
            )
            outputs.append(out[1, ids.shape[1] :])
    for got in outputs:
        assert torch.equal(got, alone.sequences[0, common.numel() :])


@pytest.mark.parametrize("mode", ["dense", "dustin", "sparse_draft", "sampled"])
def test_drafts_queued_ahead_change_nothing(mode):
    """The next step's first draft forwards (all γ when greedy: tokens only), queued from device values before
    the step's sync (CUDA graphs only; run eagerly here), give the same tokens as running them after the
    sync, with rows finishing at EOS and at their length on different steps, and a row below ``min_context``
    (read in full, its sparse-draft count past the read set's width: ``full_rows``)."""

    target = tiny_model("qwen2", layers=2, hidden=32)
    draft = set_gamma(noisy_copy(target), 3)
    rows = [random_prompt(n, seed=20 + n)[0] for n in (700, 420, 560, 180)]
    ids, mask = left_pad(rows)
    alone = [_alone(target, row, max_new_tokens=24) for row in rows]
    others = set(torch.cat([alone[0], alone[2], alone[3]]).tolist())
    eos = next(int(t) for t in alone[1][2:12] if int(t) not in others)  # row 1 ends early, the others do not
    config = DustinConfig(
        budget=48, min_context=256, sink_tokens=2, recent_tokens=6, sparse_draft=mode == "sparse_draft"
    )
    kwargs = dict(
        max_new_tokens=24,
        eos_token_id=eos,
        pad_token_id=PAD,
        do_sample=mode == "sampled",
        cache_implementation="dustin" if mode != "dense" else None,
        return_dict_in_generate=True,
    )
    assert draft.generation_config.num_assistant_tokens == 3
    outputs, logits = [], []

    def keep(module, args, out):
        if out.shape[0] == len(rows):  # decode steps (prefill runs row by row)
            logits[-1].append(out.clone())

    hook = draft.lm_head.register_forward_hook(keep)
    with dustin_hf.patch(target, config if mode != "dense" else None) as handle:
        for ahead in (False, True):
            handle.hooks = DecodeHooks(queue_eagerly=ahead)  # what the CUDA graphs queue, on the CPU
            torch.manual_seed(7)  # sampled: a seed under which row 1 alone meets its EOS
            logits.append([])
            out = target.generate(ids, attention_mask=mask, assistant_model=draft, **kwargs)
            outputs.append(out.sequences)
            stats = out.past_key_values.stats
            assert (stats["draft_forwards_ahead"] > 0) == ahead
            assert stats["sparse_steps"] > 0 if mode != "dense" else stats["sparse_steps"] == 0
            assert (stats["draft_sparse_forwards"] > 0) == (mode == "sparse_draft")
            trace = out.past_key_values.run_stats.trace  # per step: (γ, accepted per row; -1 once finished)
    hook.remove()
    assert torch.equal(outputs[0], outputs[1])
    assert (outputs[0][1, ids.shape[1] :] == PAD).any()  # row 1 stopped while the others went on
    # every draft forward the same, bit for bit, for the rows still active on its step (the queued run has the
    # next step's queued ones more, after the last step; a row that has finished drafts from other slots, never used)
    queued = 1 if mode == "sampled" else 3
    assert stats["draft_forwards_ahead"] == queued * len(trace)  # the last step queues them too
    assert len(logits[1]) == len(logits[0]) + queued == 3 * len(trace) + queued
    for i, (a, b) in enumerate(zip(*logits)):
        active = [r for r, n in enumerate(trace[i // 3][1]) if n >= 0]
        assert torch.equal(a[active], b[active]), (i, active)


@pytest.mark.parametrize("cache_implementation", [None, "dustin"])
def test_streamer_is_handed_each_steps_tokens(cache_implementation):
    """Batch 1 with a streamer: the tokens it is handed, step by step, are the generated ones (after the prompt,
    where transformers hands that over), then end() is called."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    target = tiny_model("qwen2", layers=2)
    draft = set_gamma(noisy_copy(target), 3)
    prompt = random_prompt(300, seed=8)
    recorder = Recorder()
    config = DustinConfig(budget=48, min_context=128, sink_tokens=2, recent_tokens=6)
    with dustin_hf.patch(target, config):
        out = target.generate(
            prompt,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=20,
            pad_token_id=PAD,
            cache_implementation=cache_implementation,
            streamer=recorder,
        )
    generated = out[0, prompt.shape[1] :].tolist()
    streamed = [t for put in recorder.puts for t in put]
    assert recorder.ended and len(recorder.puts) > 2  # one put per step, not one at the end
    assert streamed in (generated, prompt[0].tolist() + generated)


@pytest.mark.parametrize("layout", ["right", "holes"])
def test_masks_read_as_stock_reads_them(caplog, layout):
    """Right padding (stock warns) and masked slots inside a row: every row gets what stock greedy generate() gives
    for the same batch and mask without the assistant (a masked last slot still names the first new token, and
    the new tokens' positions restart after it: stock's reading, not the row's tokens alone)."""
    target = tiny_model("qwen2", layers=2)
    draft = set_gamma(noisy_copy(target), 3)
    rows = _rows(lengths=[6, 14])
    ids, mask = left_pad(rows)
    if layout == "right":
        ids[0] = torch.cat([rows[0], torch.full((8,), PAD)])
        mask[0] = torch.cat([torch.ones(6), torch.zeros(8)]).long()
    else:
        mask[1, 3] = mask[1, 7] = 0
    stock = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    for cache_implementation in ("dustin", None):
        with dustin_hf.patch(target):
            out = target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                do_sample=False,
                max_new_tokens=10,
                cache_implementation=cache_implementation,
                pad_token_id=PAD,
            )
        assert torch.equal(out, stock), cache_implementation


def test_bad_batches_raise_clear_errors():
    target = tiny_model("qwen2", layers=2)
    draft = set_gamma(noisy_copy(target), 3)
    ids, mask = left_pad(_rows(lengths=[6, 9, 4]))
    kwargs = dict(assistant_model=draft, max_new_tokens=4, cache_implementation="dustin", pad_token_id=PAD)
    with dustin_hf.patch(target):
        with pytest.raises(ValueError, match="does not match input_ids shape"):
            target.generate(ids, attention_mask=mask[:2], **kwargs)
        empty = mask.clone()
        empty[2] = 0
        with pytest.raises(ValueError, match="row 2 of the batch has an empty prompt"):
            target.generate(ids, attention_mask=empty, **kwargs)


def test_profile_records_each_steps_phases():
    """profile=True: per step, wall and host seconds per phase; 'events' needs CUDA; anything else is refused."""
    from transformers import GenerationConfig

    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.decode.decoder import SpeculativeDecoder
    from dustin_hf.decode.hooks import DecodeHooks
    from dustin_hf.decode.settings import Drafting, RuntimeOptions

    target = tiny_model("qwen2", seed=1)
    draft = set_gamma(noisy_copy(target), 3)
    ids = random_prompt(20, batch=2, seed=3)
    config = GenerationConfig(do_sample=False, max_length=ids.shape[1] + 10, pad_token_id=0)
    with dustin_hf.patch(target), attention_routed(target, draft):
        decoder = SpeculativeDecoder(
            target,
            draft,
            config,
            drafting=Drafting(3),
            runtime=RuntimeOptions(backend="reference"),
            hooks=DecodeHooks(profile=True),
        )
        stats = decoder.generate(ids).stats.as_dict()
    phases = ["draft", "score_select", "verify", "accept", "commit", "bookkeeping"]
    steps = stats["dense_steps"] + stats["sparse_steps"]
    for key in ("phase_seconds", "phase_host_seconds"):
        assert len(stats[key]) == steps and all(list(step) == phases for step in stats[key])
        assert all(t >= 0 for step in stats[key] for t in step.values())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            SpeculativeDecoder(
                target,
                draft,
                config,
                drafting=Drafting(3),
                runtime=RuntimeOptions(backend="reference"),
                hooks=DecodeHooks(profile="events"),
            )
    with pytest.raises(ValueError, match="profile must be"):
        SpeculativeDecoder(
            target,
            draft,
            config,
            drafting=Drafting(3),
            runtime=RuntimeOptions(backend="reference"),
            hooks=DecodeHooks(profile="wall"),
        )


@pytest.mark.parametrize("mode", ["sparse", "exact"])
def test_a_call_leaves_the_decoder_as_it_was_set_up(mode):
    """Everything of one call (rows, caches, stats, schedules, queued drafts) lives on that call's run: generate()
    adds, replaces or drops no attribute of the decoder, and a second call gives the first call's tokens."""
    from transformers import GenerationConfig

    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.config import resolve
    from dustin_hf.decode.decoder import SpeculativeDecoder
    from dustin_hf.decode.settings import Drafting, RuntimeOptions

    target = tiny_model("qwen2", seed=1)
    draft = set_gamma(noisy_copy(target), 3)
    ids, mask = left_pad(_rows()[:3])
    config = GenerationConfig(do_sample=False, max_length=ids.shape[1] + 12, pad_token_id=PAD)
    dustin = resolve(
        DustinConfig(budget=24, sink_tokens=4, recent_tokens=8, min_context=0, mode=mode, backend="reference"),
        target.config,
        draft.config,
    )
    with dustin_hf.patch(target), attention_routed(target, draft):
        decoder = SpeculativeDecoder(
            target,
            draft,
            config,
            dustin_config=dustin,
            drafting=Drafting(3, schedule="heuristic"),
            runtime=RuntimeOptions(backend="reference"),
        )
        before = {name: id(value) for name, value in vars(decoder).items()}
        first = decoder.generate(ids, mask)
        assert {name: id(value) for name, value in vars(decoder).items()} == before
        assert first.stats.sparse_steps > 0
        assert torch.equal(decoder.generate(ids, mask).sequences, first.sequences)
