"""Selection layers (``DustinConfig(selection="verify")``): the verification forward chooses what its later layers
read.

The read sets of a real forward are recorded at the attention kernel: the layers before the selection layer read the
set chosen before the forward, the selection layer reads every cached position, and the layers after it read the
set that this forward's own queries at the selection layer attend to most (checked against an independent
computation, :func:`dustin_hf.selection.recovery.position_weights`, not against the code under test). A stale choice
(the previous forward's queries) is caught by the same check. Then the decoder: a budget covering the context is greedy
and stock assisted decoding; exact mode stays exact, greedy and sampled; rows stay independent
(``test_row_independence.py`` walks the mode too).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD, left_pad, noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf
from dustin_hf.adapter import attention
from dustin_hf.adapter.assisted import attention_routed
from dustin_hf.compat import attention_scale
from dustin_hf.config import DustinConfig, resolve
from dustin_hf.decode.cache import DustinCache
from dustin_hf.decode.runner import ModelRunner
from dustin_hf.runtime.plan import DeviceTensors, ForwardPlan, SelectLayers
from dustin_hf.selection import layers as select_layers
from dustin_hf.selection.layers import choose_read_set, select_spec
from dustin_hf.selection.recovery import position_weights

pytestmark = pytest.mark.usefixtures("one_thread")

SINK, RECENT = 2, 4


def _expected_set(weights: torch.Tensor, length: int, count: int) -> list[int]:
    """Sinks, the recent window, then the ``count - SINK - RECENT`` most attended other positions, sorted."""
    candidates = weights[:length].clone()
    candidates[:SINK] = -1
    candidates[length - RECENT :] = -1
    top = candidates.topk(count - SINK - RECENT).indices.tolist()
    return sorted(list(range(SINK)) + list(range(length - RECENT, length)) + top)


def test_the_chosen_set_holds_sinks_recent_and_the_most_attended_positions_per_row():
    """Three rows: two sparse ones of different counts (the quality knob's per-row counts) and one whose count
    covers its length (read in full: its index row is kept). Each sparse row's set is its sinks, its recent window
    and its most attended positions by the mean over heads and queries of the softmax over its cached positions."""
    torch.manual_seed(0)
    batch, n_q, heads, kv_heads, dim, capacity = 3, 5, 4, 2, 8, 300
    q, keys = torch.randn(batch, n_q, heads, dim), torch.randn(batch, capacity, kv_heads, dim)
    seqlens = torch.tensor([200, 250, 40], dtype=torch.int32)
    width = 64
    indices = torch.arange(width, dtype=torch.int32).expand(batch, width).contiguous()
    counts = torch.tensor([64, 50, 64], dtype=torch.int32)
    chosen = choose_read_set(
        q, keys, DeviceTensors(seqlens, indices, counts), 250, SelectLayers((1,), SINK, RECENT), 0.3
    )
    assert torch.equal(chosen.num_indices, counts) and torch.equal(chosen.cache_seqlens, seqlens)
    for b in range(2):
        length, count = int(seqlens[b]), int(counts[b])
        weights = position_weights({0: q[b]}, {0: keys[b]}, length, 0.3)[0]
        assert chosen.indices[b, :count].tolist() == _expected_set(weights, length, count)
        assert (chosen.indices[b, count:] == 0).all()
    assert torch.equal(chosen.indices[2], indices[2])


@pytest.mark.parametrize("holes", [False, True])
def test_under_a_sliding_window_the_set_is_chosen_inside_it(holes):
    """A layer whose sliding window cuts the keys: each sparse row's set is the window's first positions (its
    sinks), its recent window and its most attended positions inside the window (what the step's first query sees:
    ``[L - window + 1, L)``, or by the indices a row with masked input slots counts); a row whose count covers its
    window keeps its index row (it reads its whole window)."""
    torch.manual_seed(1)
    batch, n_q, heads, kv_heads, dim, capacity, window = 3, 3, 2, 1, 8, 260, 100
    q, keys = torch.randn(batch, n_q, heads, dim), torch.randn(batch, capacity, kv_heads, dim)
    seqlens = torch.tensor([200, 250, 150], dtype=torch.int32)
    width = 48
    indices = torch.arange(width, dtype=torch.int32).expand(batch, width).contiguous()
    counts = torch.tensor([48, 30, 99], dtype=torch.int32)  # row 2's count is its whole window
    slots = None
    if holes:  # every slot counts twice for row 0 (a hole after each): its window holds half as many positions
        slots = torch.arange(capacity).expand(batch, capacity).clone()
        slots[0] *= 2
    chosen = choose_read_set(
        q,
        keys,
        DeviceTensors(seqlens, indices, counts),
        250,
        SelectLayers((1,), SINK, RECENT),
        0.3,
        window=window,
        key_slots=slots,
    )
    for b in range(2):
        length, count = int(seqlens[b]), int(counts[b])
        low = length - window + 1 if not (holes and b == 0) else length - window // 2 + 1
        weights = position_weights({0: q[b]}, {0: keys[b]}, length, 0.3)[0]
        inside = weights.clone()
        inside[:low] = -2  # never a candidate
        want = _expected_set(inside[low:], length - low, count)
        assert chosen.indices[b, :count].tolist() == [low + i for i in want], b
    assert torch.equal(chosen.indices[2], indices[2])


def test_rows_choose_independently_and_from_their_leading_queries_when_told():
    """Changing row 1's queries and keys leaves row 0's set as it was; with ``queries=1`` only each row's first
    query scores (its later queries may change freely)."""
    torch.manual_seed(1)
    q, keys = torch.randn(2, 4, 4, 8), torch.randn(2, 128, 2, 8)
    tensors = DeviceTensors(
        torch.tensor([120, 100], dtype=torch.int32),
        torch.zeros(2, 24, dtype=torch.int32),
        torch.tensor([24, 24], dtype=torch.int32),
    )
    spec = SelectLayers((0,), SINK, RECENT)
    before = choose_read_set(q, keys, tensors, 120, spec, 0.35).indices
    q2, keys2 = q.clone(), keys.clone()
    q2[1], keys2[1] = torch.randn(4, 4, 8), torch.randn(128, 2, 8)
    after = choose_read_set(q2, keys2, tensors, 120, spec, 0.35).indices
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])
    first = SelectLayers((0,), SINK, RECENT, queries=1)
    q3 = q.clone()
    q3[:, 1:] = torch.randn(2, 3, 4, 8)
    assert torch.equal(
        choose_read_set(q, keys, tensors, 120, first, 0.35).indices,
        choose_read_set(q3, keys, tensors, 120, first, 0.35).indices,
    )
    assert not torch.equal(choose_read_set(q3, keys, tensors, 120, spec, 0.35).indices, before)


# ---- the read sets of a real forward -------------------------------------------------------------------------------
LAYERS, SELECTOR, PROMPT, WIDTH, Q = 4, 1, 160, 24, 5


class _Reads:
    """Records, per verification call of a forward (one per layer, in order), the positions it read."""

    def __init__(self, monkeypatch):
        self.calls: list[list[int] | None] = []
        real = attention.verify_attention

        def recording(q, k_cache, v_cache, cache_seqlens, *, indices=None, num_indices=None, **kwargs):
            self.calls.append(None if indices is None else indices[0, : int(num_indices[0])].tolist())
            return real(q, k_cache, v_cache, cache_seqlens, indices=indices, num_indices=num_indices, **kwargs)

        monkeypatch.setattr(attention, "verify_attention", recording)


def _sparse_step(runner: ModelRunner, tokens: torch.Tensor, at: int, given: torch.Tensor, reads: _Reads):
    """One sparse verification-shaped forward of ``Q`` tokens at ``at`` cached positions, reading ``given`` before the
    selection layer; returns what each layer read and the selection layer's queries and keys."""
    runner.cache.rollback([at])
    plan = ForwardPlan(
        rows=slice(0, 1),
        cache_seqlens=[at],
        q_len=Q,
        indices=given[None],
        num_indices=torch.tensor([given.numel()], dtype=torch.int32),
        capture={SELECTOR: tuple(range(4))},
        select=SelectLayers((SELECTOR,), SINK, RECENT),
    )
    reads.calls.clear()
    runner.forward(plan, tokens[at : at + Q][None], keep=1)
    keys = runner.cache.layer_buffers(SELECTOR)[0][0]  # (T, Hkv, D)
    return list(reads.calls), plan.captured[SELECTOR][0], keys


def _check_reads(monkeypatch) -> bool:
    """Two consecutive sparse steps; at each, the layers before the selection layer read the given set, the
    selection layer everything, the layers after it the set its current queries choose. Returns whether all held
    (asserting meanwhile that the two steps' choices differ, so that a stale choice would show)."""
    model = tiny_model("qwen2", layers=LAYERS, hidden=32, heads=4, kv_heads=2, seed=4)
    tokens = random_prompt(PROMPT + 2 * Q, seed=9)[0]
    runner = ModelRunner(model, DustinCache(LAYERS, 1, PROMPT + 2 * Q + 1), "reference")
    reads = _Reads(monkeypatch)
    given = torch.arange(WIDTH, dtype=torch.int32)  # what the layers before read: the first WIDTH positions
    held, chosen = True, []
    with dustin_hf.patch(model), attention_routed(model):
        runner.prefill([tokens[:PROMPT]], None, {})
        for at in (PROMPT, PROMPT + Q):
            calls, queries, keys = _sparse_step(runner, tokens, at, given, reads)
            weights = position_weights({0: queries}, {0: keys}, at, attention_scale(model, model.config))[0]
            expected = _expected_set(weights, at, WIDTH)
            chosen.append(expected)
            assert len(calls) == LAYERS
            held &= calls[:SELECTOR] == [given.tolist()] * SELECTOR and calls[SELECTOR] is None
            held &= calls[SELECTOR + 1 :] == [expected] * (LAYERS - SELECTOR - 1)
    assert chosen[0] != chosen[1]
    return held


def test_selection_layer_reads_everything_and_later_layers_what_its_current_queries_choose(monkeypatch):
    assert _check_reads(monkeypatch)


def test_a_choice_from_the_previous_forwards_queries_is_caught(monkeypatch):
    """The mutation the check above guards against: the selection layer scores with the queries it saw in the
    previous forward instead of the current ones."""
    real, previous = select_layers.choose_read_set, []

    def stale(q, *args, **kwargs):
        previous.append(q.clone())
        return real(previous[-2] if len(previous) > 1 else q, *args, **kwargs)

    monkeypatch.setattr(select_layers, "choose_read_set", stale)
    assert not _check_reads(monkeypatch)


def test_a_reused_plan_reads_the_given_set_before_the_selection_layer_again(monkeypatch):
    """A captured forward runs one plan again and again: each run starts from the given set, not from the set the
    last run chose."""
    model = tiny_model("qwen2", layers=LAYERS, hidden=32, heads=4, kv_heads=2, seed=4)
    tokens = random_prompt(PROMPT + Q, seed=9)[0]
    runner = ModelRunner(model, DustinCache(LAYERS, 1, PROMPT + Q + 1), "reference")
    reads = _Reads(monkeypatch)
    given = torch.arange(WIDTH, dtype=torch.int32)
    plan = ForwardPlan(
        rows=slice(0, 1),
        cache_seqlens=[PROMPT],
        q_len=Q,
        indices=given[None],
        num_indices=torch.tensor([WIDTH], dtype=torch.int32),
        select=SelectLayers((1,), SINK, RECENT),
    )
    with dustin_hf.patch(model), attention_routed(model):
        runner.prefill([tokens[:PROMPT]], None, {})
        for _ in range(2):
            runner.cache.rollback([PROMPT])
            reads.calls.clear()
            runner.forward(plan, tokens[PROMPT:][None], keep=1)
            assert reads.calls[0] == given.tolist() and reads.calls[2] != given.tolist()


def test_a_dense_forward_never_selects(monkeypatch):
    """Without a read set (a dense step, a prefill) the selection layer is an ordinary dense layer."""
    plan = ForwardPlan(rows=slice(0, 1), cache_seqlens=[10], q_len=2, select=SelectLayers((0,), SINK, RECENT))
    assert not plan.selects_at(0)
    sparse = ForwardPlan(
        rows=slice(0, 1),
        cache_seqlens=[10],
        q_len=2,
        indices=torch.zeros(1, 4, dtype=torch.int32),
        num_indices=torch.tensor([4], dtype=torch.int32),
        select=SelectLayers((0,), SINK, RECENT),
    )
    assert sparse.selects_at(0) and not sparse.selects_at(1)


# ---- configuration -------------------------------------------------------------------------------------------------
def test_selection_settings_are_validated_and_resolved():
    target = tiny_model("qwen2", layers=6, hidden=32)
    assert resolve(DustinConfig(selection="dustin"), target.config, target.config).selection_layers == ()
    assert resolve(DustinConfig(), target.config, target.config).selection_layers == (2, 3)  # the default: verify
    assert resolve(
        DustinConfig(selection="verify", selection_layers=(-2, 2)), target.config, target.config
    ).selection_layers == (2, 4)
    assert resolve(DustinConfig(selection="verify"), target.config, target.config).selection_layers  # a default
    # recorded layers (a profile's) are kept for selection="verify" and unused by the paper's selection
    assert (
        resolve(DustinConfig(selection="dustin", selection_layers=(3,)), target.config, target.config).selection_layers
        == ()
    )
    assert select_spec(resolve(DustinConfig(selection="dustin"), target.config, target.config)) is None
    with pytest.raises(ValueError, match="selection must be one of"):
        DustinConfig(selection="tidal")
    with pytest.raises(ValueError, match="selection_layers must be"):
        DustinConfig(selection="verify", selection_layers=(2, 2))
    with pytest.raises(ValueError, match="out of range"):
        resolve(DustinConfig(selection="verify", selection_layers=(6,)), target.config, target.config)
    with pytest.raises(ValueError, match="no layer after it"):  # the last layer would choose for nobody
        resolve(DustinConfig(selection="verify", selection_layers=(1, -1)), target.config, target.config)


def test_selection_calibration_walks_each_candidate_and_picks_the_best_agreement(monkeypatch):
    """On a tiny pair (a bundled book through its tokenizer-free ids), every candidate of the grid is a method of
    one teacher-forced walk beside dense verification and Dustin's set; the chosen layers are the candidate with the
    highest pooled top-1 agreement with dense, whose figures the report holds."""
    from dustin_lab import select_calibration
    from dustin_lab.select_calibration import calibrate_selection_layers, selection_candidates

    assert selection_candidates(28) == [
        (1,),
        (2,),
        (4,),
        (1, 7),
        (1, 14),
        (1, 18),
        (2, 7),
        (2, 14),
        (2, 18),
        (4, 7),
        (4, 14),
        (4, 18),
    ]
    assert all(max(c) < 3 for c in selection_candidates(4))  # never the last layer: nothing after it

    target = tiny_model("qwen2", layers=4, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target, noise=0.05), 3)

    class Pair:
        pass

    pair = Pair()
    pair.target, pair.draft, pair.tokenizer = target, draft, None
    monkeypatch.setattr(
        select_calibration,
        "token_window",
        lambda tokenizer, book, length, offset=0: random_prompt(length, seed=len(book))[0],
    )
    report = calibrate_selection_layers(
        pair,
        DustinConfig(budget=24, min_context=16, sink_tokens=SINK, recent_tokens=RECENT),
        ("a", "bb"),
        context=120,
        tokens=41,
        gamma=3,
        candidates=[(1,), (2,), (1, 2)],
        progress=False,
    )
    names = {"select-L1": (1,), "select-L2": (2,), "select-L1,2": (1, 2)}
    assert set(report["pooled"]) == {"dustin", *names} and set(report["per_book"]) == {"a", "bb"}
    best = max(names, key=lambda n: (report["pooled"][n]["top1_agreement"], -report["pooled"][n]["ppl_ratio"]))
    assert report["chosen"] == list(names[best]) and report["tokens"] == 2 * 40


# ---- the decoder ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_full_budget_equals_greedy_and_stock_assisted(family):
    target = tiny_model(family, layers=3)
    draft = set_gamma(noisy_copy(target), 4)
    ids = random_prompt(61, seed=61)
    greedy = target.generate(ids, max_new_tokens=24, do_sample=False)
    stock = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False)
    with dustin_hf.patch(target, DustinConfig(selection="verify", selection_layers=(1,))):
        out = target.generate(
            ids, assistant_model=draft, max_new_tokens=24, do_sample=False, cache_implementation="dustin"
        )
    assert torch.equal(stock, greedy) and torch.equal(out, greedy)


def test_a_row_its_budget_covers_equals_greedy_beside_a_sparse_row(monkeypatch):
    """The full-budget guarantee where the selection layers run: in one batch a long row's steps are sparse (its
    selection layer chooses) while the budget covers the short row's whole context; the short row still decodes
    plain greedy's tokens, and so does exact mode's long row."""
    target = tiny_model("qwen2", layers=3, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target, noise=0.02), 4)
    prompts = [random_prompt(n, seed=n)[0] for n in (600, 40)]
    ids, mask = left_pad(prompts)
    chose = []
    real = select_layers.choose_read_set
    monkeypatch.setattr(select_layers, "choose_read_set", lambda *a, **k: chose.append(1) or real(*a, **k))
    new = dict(do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    alone = [target.generate(p[None], **new)[0, p.shape[0] :] for p in prompts]
    config = dict(
        budget=96, min_context=16, sink_tokens=SINK, recent_tokens=RECENT, selection="verify", selection_layers=(1,)
    )
    with dustin_hf.patch(target):
        for mode in ("sparse", "exact"):
            chose.clear()
            out = target.generate(
                ids,
                attention_mask=mask,
                assistant_model=draft,
                cache_implementation="dustin",
                return_dict_in_generate=True,
                cache_config={**config, "mode": mode},
                **new,
            )
            assert out.past_key_values.stats["sparse_steps"] > 0 and chose
            short = out.sequences[1, ids.shape[1] :]
            assert torch.equal(short, alone[1]), mode
            if mode == "exact":
                assert torch.equal(out.sequences[0, ids.shape[1] :], alone[0])


def _ragged_case():
    target = tiny_model("qwen2", layers=3, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target, noise=0.02), 4)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (700, 300, 520)])
    return target, draft, ids, mask


def test_sparse_steps_select_in_the_forward_and_exact_mode_stays_greedy(monkeypatch):
    """A ragged batch at budget 32: sparse steps run the selection layer (it chose sets), sparse mode's output
    differs from Dustin's own selection's, and exact mode's equals plain greedy decoding."""
    target, draft, ids, mask = _ragged_case()
    chose = []
    real = select_layers.choose_read_set
    monkeypatch.setattr(select_layers, "choose_read_set", lambda *a, **k: chose.append(1) or real(*a, **k))
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
    greedy = target.generate(ids, **kwargs)
    config = dict(budget=32, min_context=64, sink_tokens=SINK, recent_tokens=RECENT)
    outs = {}
    with dustin_hf.patch(target):
        for name, extra in (
            ("dustin", {"selection": "dustin"}),
            ("verify", {"selection": "verify", "selection_layers": (1,)}),
            ("exact", {"selection": "verify", "selection_layers": (1,), "mode": "exact"}),
        ):
            chose.clear()
            out = target.generate(
                ids,
                assistant_model=draft,
                cache_implementation="dustin",
                return_dict_in_generate=True,
                cache_config={**config, **extra},
                **kwargs,
            )
            outs[name] = out.sequences
            assert out.past_key_values.stats["sparse_steps"] > 0
            assert bool(chose) == (name != "dustin")
    assert not torch.equal(outs["verify"], outs["dustin"])
    assert torch.equal(outs["exact"], greedy)


def test_a_workspace_serves_only_its_own_selection():
    """One patched model, calls alternating Dustin's selection and two sets of selection layers: each call builds its
    own workspace (a reused runner would keep the selection layers it was built with) and returns what the same call
    on a freshly patched model returns."""
    target = tiny_model("qwen2", layers=3, hidden=32, heads=4, kv_heads=2)
    draft = set_gamma(noisy_copy(target, noise=0.02), 4)
    ids = random_prompt(200, batch=2, seed=3)
    base = dict(budget=32, min_context=64, sink_tokens=SINK, recent_tokens=RECENT, selection="dustin")
    configs = [
        base,
        {**base, "selection": "verify", "selection_layers": (1,)},
        {**base, "selection": "verify", "selection_layers": (0,)},
        base,
    ]
    kwargs = dict(
        assistant_model=draft,
        cache_implementation="dustin",
        do_sample=False,
        max_new_tokens=16,
        attention_mask=torch.ones_like(ids),
    )

    expected = []
    for config in configs:
        with dustin_hf.patch(target):
            expected.append(target.generate(ids, cache_config=config, **kwargs))
    assert not torch.equal(expected[0], expected[1])  # the selections differ here
    with dustin_hf.patch(target) as handle:
        held = None
        for config, alone in zip(configs, expected):
            out = target.generate(ids, cache_config=config, **kwargs)
            assert handle.workspaces.held is not held and handle.workspaces.held.runs == 1
            held = handle.workspaces.held
            assert torch.equal(out, alone)


def test_exact_sampling_with_selection_layers_follows_the_targets_law(monkeypatch):
    """Exact mode samples with selection layers scoring with each row's first query alone (x's, a function of the
    prefix: p~ judges the tentative tokens, so it must not depend on the drafts after them, as
    test_exact.py::test_sampled_exact_scores_with_the_prefix_alone asks of Dustin's scoring); sparse mode scores with
    all. The first two tokens follow the target's law where sparse mode's do not (test_exact.py's joint-law case;
    it does not tell the two scorings apart, the recorded ``queries`` do)."""
    from test_exact import P_VALUE, _joint_law_case, _pvalue

    target, draft, prompt, law = _joint_law_case()
    scored_with = set()
    real = select_layers.choose_read_set

    def recording(q, k_cache, tensors, span, spec, scale, **kwargs):
        scored_with.add(spec.queries)
        return real(q, k_cache, tensors, span, spec, scale, **kwargs)

    monkeypatch.setattr(select_layers, "choose_read_set", recording)

    def pvalue(mode: str) -> float:
        scored_with.clear()
        return _pvalue(target, draft, prompt, law, mode, selection="verify", selection_layers=(0,))

    assert pvalue("sparse") < P_VALUE and scored_with == {None}
    assert pvalue("exact") > P_VALUE and scored_with == {1}
