"""The teacher-forced walk, prefill reuse and recovery math, on tiny random-weight models."""

import pytest
import torch
from tiny_models import left_pad, noisy_copy, one_thread, random_prompt, set_gamma, tiny_model  # noqa: F401

from dustin_hf import DustinConfig
from dustin_hf.experimental import (
    attention_mass,
    estimated_mass,
    head_probabilities,
    position_weights,
    resolve,
    selection_recovery,
)
from dustin_lab.continuations import speculative_continuation, token_agreement
from dustin_lab.estimators import Estimator, library_estimator, order_study, study
from dustin_lab.knob import EstimatorFeatures, load_features
from dustin_lab.prefilled import PrefillStore, clone_cache, prefill_pair
from dustin_lab.walk import teacher_forced_walk

CONTEXT, GAMMA = 80, 3


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", layers=3, hidden=32, heads=4, kv_heads=2)
    return target, set_gamma(noisy_copy(target), GAMMA)


def _cfg(target, draft, budget, **kw):
    config = DustinConfig(budget=budget, min_context=16, **{"selection": "dustin", **kw})  # Dustin's set unless told
    return resolve(config, target.config, draft.config)


@pytest.fixture(scope="module")
def state(pair):
    target, draft = pair
    tokens = random_prompt(CONTEXT + 33, seed=5)[0]
    layer = _cfg(target, draft, 32).target_layer
    return prefill_pair(target, draft, tokens[:CONTEXT], (layer,)), tokens[CONTEXT:]


def test_prefill_shows_its_progress_only_when_asked(pair, capsys, monkeypatch):
    """A long prefill's bar counts the tokens both models read, chunk by chunk; without ``progress`` nothing
    prints, and the states are the same either way."""
    from dustin_lab import prefilled

    counted = []

    class Bar(prefilled.tqdm):
        def close(self):
            counted.append(self.n)
            super().close()

    monkeypatch.setattr(prefilled, "tqdm", Bar)
    target, draft = pair
    tokens = random_prompt(300, seed=6)[0]
    quiet = prefill_pair(target, draft, tokens, chunk=64)
    assert capsys.readouterr().err == ""
    shown = prefill_pair(target, draft, tokens, chunk=64, progress=True)
    err = capsys.readouterr().err
    assert "prefill 300 tokens" in err and "/599" in err  # 300 target tokens and 299 draft ones
    assert counted[-1] == 599
    assert torch.equal(quiet.last_logits, shown.last_logits)


def test_budget_covering_the_context_equals_the_dense_walk_exactly(pair, state):
    target, draft = pair
    prefilled, continuation = state
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {"dense": None, "full": _cfg(target, draft, 4096), "small": _cfg(target, draft, 24)},
        progress=False,
    )
    assert walk.steps == (continuation.numel() - 1) // (GAMMA + 1) and walk.tokens == walk.steps * (GAMMA + 1)
    assert walk.nll["full"] == walk.nll["dense"]  # bit for bit: the same dense forwards
    assert walk.sparse_steps == {"dense": 0, "full": 0, "small": walk.steps}
    assert walk.nll["small"] != walk.nll["dense"]
    assert 0.0 < walk.recovery["small"] < 1.0 and "full" not in walk.recovery
    assert walk.accepted["full"] == walk.accepted["dense"] and walk.top1_agreement_with_dense["full"] == 1.0
    assert 0 <= walk.accepted["small"] <= GAMMA and 0 <= walk.draft_agreement["small"] <= 1
    assert walk.accepted["dense"] > 0  # the noisy-copy draft mostly agrees with its target


def test_walk_keeps_every_prediction_per_position(pair, state):
    """Entry j of each list is about the token at C + j given the true prefix: the dense lists equal a stock forward's
    argmax over the whole text, a covering budget's equal dense, and each step's teacher-forced acceptance is the
    agreeing prefix of the lists from the step's first draft."""
    target, draft = pair
    prefilled, continuation = state
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {
            "dense": None,
            "full": _cfg(target, draft, 4096),
            "small": _cfg(target, draft, 24),
            "small_sd": _cfg(target, draft, 24, sparse_draft=True),
        },
        recovery_every=0,
        progress=False,
    )
    n = walk.tokens
    tokens = torch.cat([prefilled.tokens, continuation])
    assert walk.truth == continuation[:n].tolist()
    with torch.no_grad():
        stock = target(tokens[None, : CONTEXT + n - 1]).logits[0, CONTEXT - 1 :].argmax(-1).tolist()
        stock_draft = draft(tokens[None, : CONTEXT + n - 1]).logits[0, CONTEXT - 1 :].argmax(-1).tolist()
    assert walk.predictions["dense"] == stock and walk.draft_predictions["dense"] == stock_draft
    assert walk.predictions["full"] == walk.predictions["dense"]
    assert walk.draft_predictions["small"] == walk.draft_predictions["dense"]  # the shared dense draft
    assert walk.draft_predictions["small_sd"] != walk.draft_predictions["dense"]
    assert walk.predictions["small"] != walk.predictions["dense"]
    assert all(len(v) == n for v in [*walk.predictions.values(), *walk.draft_predictions.values()])
    for name in walk.predictions:
        verifier, drafted = walk.predictions[name], walk.draft_predictions[name]
        for step, accepted in enumerate(walk.accepted_trace[name]):
            first = step * (GAMMA + 1) + 1  # the step's first draft guesses the token after L
            agree = [verifier[first + i] == drafted[first + i] for i in range(GAMMA)]
            assert accepted == (agree + [False]).index(False)


def test_a_method_does_not_depend_on_the_others_in_its_forward(pair, state):
    """Methods share one forward per model (a row each): a method's results are the same walked alone with dense."""
    target, draft = pair
    prefilled, continuation = state
    small, small_sd = _cfg(target, draft, 24), _cfg(target, draft, 24, sparse_draft=True)
    together = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {"dense": None, "small": small, "small_sd": small_sd, "wide_sd": _cfg(target, draft, 40, sparse_draft=True)},
        recovery_every=0,
        progress=False,
    )
    for name, cfg in (("small", small), ("small_sd", small_sd)):
        alone = teacher_forced_walk(
            target, draft, prefilled, continuation, GAMMA, {"dense": None, name: cfg}, recovery_every=0, progress=False
        )
        assert alone.predictions[name] == together.predictions[name]
        assert alone.draft_predictions[name] == together.draft_predictions[name]
        assert alone.nll[name] == pytest.approx(together.nll[name], rel=1e-5)


def test_dense_layers_in_the_walk(pair, state):
    """All target layers dense: a sparse step (selection made) scores exactly like the dense walk."""
    target, draft = pair
    prefilled, continuation = state
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {
            "dense": None,
            "all": _cfg(target, draft, 24, dense_layers=(0, 1, 2)),
            "last": _cfg(target, draft, 24, dense_layers=(-1,)),
            "none": _cfg(target, draft, 24),
        },
        recovery_every=0,
        progress=False,
    )
    assert walk.sparse_steps["all"] == walk.steps
    assert walk.nll["all"] == walk.nll["dense"]
    assert len({walk.nll["dense"], walk.nll["last"], walk.nll["none"]}) == 3


def test_sparse_draft_in_the_walk(pair, state):
    """A sparse-draft method drafts from its own selections: its target (every layer dense) scores exactly
    like dense, its drafts differ; the per-step accepted counts add up to the mean."""
    target, draft = pair
    prefilled, continuation = state
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {
            "dense": None,
            "all": _cfg(target, draft, 24, dense_layers=(0, 1, 2)),
            "all_sd": _cfg(target, draft, 24, dense_layers=(0, 1, 2), sparse_draft=True),
        },
        recovery_every=0,
        progress=False,
    )
    assert walk.nll["all_sd"] == walk.nll["all"] == walk.nll["dense"]
    assert walk.accepted_trace["all"] == walk.accepted_trace["dense"]  # the same dense draft
    assert walk.accepted_trace["all_sd"] != walk.accepted_trace["all"]
    for name, trace in walk.accepted_trace.items():
        assert len(trace) == walk.steps and sum(trace) / walk.steps == pytest.approx(walk.accepted[name])


def test_dense_walk_equals_the_plain_forward_nll(pair, state):
    target, draft = pair
    prefilled, continuation = state
    walk = teacher_forced_walk(
        target, draft, prefilled, continuation, GAMMA, {"dense": None}, recovery_every=0, progress=False
    )
    tokens = torch.cat([prefilled.tokens, continuation])
    with torch.no_grad():
        logits = target(tokens[None]).logits[0].float()  # the model's own attention, one forward
    positions = torch.arange(CONTEXT, CONTEXT + walk.tokens)  # predicting tokens[C+1 : C+1+n]
    nll = torch.nn.functional.cross_entropy(logits[positions], tokens[positions + 1], reduction="sum")
    assert walk.nll["dense"] == pytest.approx(float(nll), rel=1e-5)


def test_recovery_of_the_dense_signals_uses_the_given_configs(pair, state):
    target, draft = pair
    prefilled, continuation = state
    cfg = _cfg(target, draft, 24)
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {"dense": None},
        recovery_configs={"a": cfg, "everything": _cfg(target, draft, 4096)},
        progress=False,
    )
    assert walk.recovery_dense_signals["everything"] == 1.0
    assert 0.0 < walk.recovery_dense_signals["a"] <= walk.recovery_dense_signals["oracle@24"] < 1.0


def test_reused_prefill_decodes_exactly_like_a_fresh_one(pair, state):
    target, draft = pair
    prefilled, _ = state
    store = PrefillStore(target, draft)
    store.add(prefilled)
    for cfg in (None, _cfg(target, draft, 24)):
        kwargs = dict(config=cfg, gamma=GAMMA, max_new_tokens=12, eos_token_ids=[])
        fresh = speculative_continuation(target, draft, prefilled.tokens, **kwargs)
        reused = speculative_continuation(target, draft, prefilled.tokens, store=store, **kwargs)
        assert reused["tokens"] == fresh["tokens"] and reused["accepted"] == fresh["accepted"]
    greedy = target.generate(prefilled.tokens[None], max_new_tokens=12, do_sample=False)[0, CONTEXT:].tolist()
    assert (
        fresh["tokens"] != []
        and speculative_continuation(
            target, draft, prefilled.tokens, config=None, gamma=GAMMA, max_new_tokens=12, eos_token_ids=[], store=store
        )["tokens"]
        == greedy
    )


@pytest.mark.parametrize("do_sample", [False, True])
def test_stored_prefills_serve_a_left_padded_batch_through_generate(pair, do_sample):
    """Each row of a left-padded batch found in the store is copied into its row of the run's caches: generate()
    returns the tokens of the same call prefilled by the loop, dense and sparse, greedy and sampling."""
    import dustin_hf
    from dustin_hf.experimental import DecodeHooks

    target, draft = pair
    rows = [random_prompt(n, seed=20 + n)[0] for n in (70, 90, 64)]
    layer = _cfg(target, draft, 24).target_layer
    store = PrefillStore(target, draft)
    for ids in rows:
        store.add(prefill_pair(target, draft, ids, (layer,)))
    ids, mask = left_pad(rows)
    sampling = dict(do_sample=True, temperature=0.9, top_p=0.95) if do_sample else dict(do_sample=False)
    kwargs = dict(attention_mask=mask, assistant_model=draft, max_new_tokens=10, **sampling)
    modes = [{}, dict(cache_implementation="dustin", cache_config={"budget": 24, "min_context": 16})]
    outputs = {}

    def refuse(*args, **kw):
        raise AssertionError("a stored row was prefilled again")

    # every row comes from the store: a batch prefilled by the model instead fails
    for hooks in (None, DecodeHooks(prefill=store.hook(missing=refuse))):
        with dustin_hf.patch(target, hooks=hooks):
            for i, mode in enumerate(modes):
                torch.manual_seed(0)
                outputs.setdefault(hooks is None, []).append(target.generate(ids, **kwargs, **mode))
    for fresh, reused in zip(outputs[True], outputs[False]):
        assert torch.equal(fresh, reused)
    called = []
    with dustin_hf.patch(target, hooks=DecodeHooks(prefill=lambda *a: called.append(1) or store.hook()(*a))):
        unknown = random_prompt(50, seed=3)
        assert target.generate(
            unknown,
            attention_mask=torch.ones_like(unknown),
            assistant_model=draft,
            max_new_tokens=4,
            do_sample=False,
            **modes[1],
        ).shape == (1, 54)  # prefilled as usual
    assert called == [1, 1]


def test_the_walk_in_bfloat16_predicts_as_in_float32(pair, state):
    """The walk in bfloat16, the dtype it runs in on a GPU (``agreement_cpu.py --device cuda``), gives the float32
    walk's predictions within bfloat16's rounding: the dense target's argmax on nearly every position, every method
    kind (Dustin's set, the sparse draft, the oracle) runs, and the perplexities move by a few percent at most."""
    import copy

    target, draft = pair
    prefilled, continuation = state
    cfg = _cfg(target, draft, 24)
    methods = {"dense": None, "sparse": cfg, "sparse_draft": _cfg(target, draft, 24, sparse_draft=True), "oracle": cfg}
    walks = {}
    for dtype in (torch.float32, torch.bfloat16):
        t, d = (copy.deepcopy(m).to(dtype) for m in (target, draft))
        start = prefill_pair(t, d, prefilled.tokens, (cfg.target_layer,))
        walks[dtype] = teacher_forced_walk(
            t, d, start, continuation, GAMMA, methods, oracle={"oracle": "shared"}, progress=False
        )
    full, half = walks[torch.float32], walks[torch.bfloat16]
    assert full.predictions.keys() == half.predictions.keys() == methods.keys()
    for name in methods:
        same = sum(a == b for a, b in zip(full.predictions[name], half.predictions[name])) / full.tokens
        assert same >= 0.9, (name, same)
        assert abs(half.ppl[name] / full.ppl[name] - 1) < 0.05, (name, half.ppl[name], full.ppl[name])


def test_clone_cache_copies_contents_and_lengths(state):
    prefilled, _ = state
    copy = clone_cache(prefilled.target_cache, capacity=500)
    assert copy.seq_lengths == prefilled.target_cache.seq_lengths and copy.capacity >= 500
    for a, b in zip(copy.layers, prefilled.target_cache.layers):
        assert torch.equal(a.buffers()[0][:, :CONTEXT], b.buffers()[0][:, :CONTEXT])
    copy.layers[0].buffers()[0].zero_()  # independent storage
    assert prefilled.target_cache.layers[0].buffers()[0][:, :CONTEXT].abs().sum() > 0


def test_head_probabilities_sum_to_the_scoring_mass():
    torch.manual_seed(0)
    q, k = torch.randn(3, 4, 8), torch.randn(40, 2, 8)  # 3 queries, 4 heads (2 per KV head), 40 keys
    pos = torch.tensor([30, 31, 32])
    per_head = head_probabilities(q, k, pos, 30, 0.35)
    for heads in [(0,), (0, 1), (2, 3), (1, 2)]:
        mass = attention_mass(q[None][:, :, list(heads)], k[None], pos[None], heads, 2, 0.35, 30, 33)[0]
        torch.testing.assert_close(per_head[list(heads)].sum(0), mass, rtol=1e-5, atol=1e-6)


def test_position_weights_are_distributions_and_recovery_is_linear():
    torch.manual_seed(0)
    q, k = {0: torch.randn(4, 4, 8), 1: torch.randn(4, 4, 8)}, {0: torch.randn(50, 2, 8), 1: torch.randn(50, 2, 8)}
    w = position_weights(q, k, 50, 0.35)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    everything = selection_recovery(w, torch.arange(50))
    torch.testing.assert_close(everything, torch.ones(2))
    half = selection_recovery(w, torch.arange(25)) + selection_recovery(w, torch.arange(25, 50))
    torch.testing.assert_close(half, everything)


def test_token_agreement():
    assert token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {
        "prefix": 2,
        "agreement": 0.75,
        "compared": 4,
        "identical": False,
    }
    assert token_agreement([1, 2], [1, 2])["identical"]


def test_refresh_rewrites_sparse_keys_and_values_as_dense_ones(pair, state):
    """After a sparse step, one dense forward over its positions leaves the cache as a dense step would."""
    from dustin_hf.experimental import ForwardPlan, ModelRunner
    from dustin_lab.prefilled import dustin_attention_on
    from dustin_lab.walk import _refresh

    target, draft = pair
    prefilled, continuation = state
    tokens = torch.cat([prefilled.tokens, continuation])
    q = GAMMA + 1
    runners = {
        name: ModelRunner(target, clone_cache(prefilled.target_cache, CONTEXT + q + 1), "reference")
        for name in ("dense", "sparse")
    }
    indices = torch.tensor([[0, 5, 40, 79]], dtype=torch.int32)
    with torch.no_grad(), dustin_attention_on(target, draft):
        for name, runner in runners.items():
            sparse = name == "sparse"
            plan = ForwardPlan(
                rows=slice(0, 1),
                cache_seqlens=[CONTEXT],
                q_len=q,
                backend="reference",
                indices=indices if sparse else None,
                num_indices=torch.tensor([4], dtype=torch.int32) if sparse else None,
            )
            runner.forward(plan, tokens[CONTEXT : CONTEXT + q][None], keep=1)
        written = [runners["sparse"].cache.layer_buffers(layer)[0][0, : CONTEXT + q].clone() for layer in range(3)]
        _refresh(runners["sparse"], 0, tokens, CONTEXT, CONTEXT + q, "reference")
    assert runners["sparse"].cache.seq_lengths == [CONTEXT + q]
    for layer in range(3):
        dense_k = runners["dense"].cache.layer_buffers(layer)[0][0, : CONTEXT + q]
        assert torch.equal(runners["sparse"].cache.layer_buffers(layer)[0][0, : CONTEXT + q], dense_k)
    assert any(
        not torch.equal(w, runners["dense"].cache.layer_buffers(l)[0][0, : CONTEXT + q]) for l, w in enumerate(written)
    )  # the sparse step had written other values above layer 0


def test_refresh_every_names_sparse_methods(pair, state):
    target, draft = pair
    prefilled, continuation = state
    with pytest.raises(ValueError, match="not sparse methods"):
        teacher_forced_walk(
            target,
            draft,
            prefilled,
            continuation,
            GAMMA,
            {"dense": None},
            recovery_every=0,
            progress=False,
            refresh_every={"dense": 2},
        )
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {"small": _cfg(target, draft, 24), "refreshed": _cfg(target, draft, 24)},
        recovery_every=0,
        progress=False,
        refresh_every={"refreshed": 2},
    )
    assert walk.nll["refreshed"] != walk.nll["small"]  # the same steps, read from rewritten keys and values


def _logits(runner_cache, target, draft, tokens, plan):
    from dustin_hf.experimental import ModelRunner
    from dustin_lab.prefilled import dustin_attention_on

    runner = ModelRunner(target, clone_cache(runner_cache, CONTEXT + GAMMA + 2), "reference")
    with torch.no_grad(), dustin_attention_on(target, draft):
        return runner.forward(plan, tokens[CONTEXT : CONTEXT + GAMMA + 1][None], keep=GAMMA + 1)


def test_a_layerwise_plan_gives_each_layer_its_own_read_set(pair, state):
    """Layer 0 reading every cached position through its own indices, the others a small set S, equals a plain
    plan reading S with layer 0 dense; every layer given S equals the plain plan bit for bit; moving one
    layer's set changes the output."""
    from dustin_hf.experimental import ForwardPlan
    from dustin_lab.oracle import layerwise_plan

    target, draft = pair
    prefilled, continuation = state
    tokens = torch.cat([prefilled.tokens, continuation])
    small = torch.tensor([[0, 3, 17, 40, 66, 79]], dtype=torch.int32)
    other = torch.tensor([[1, 2, 30, 50, 70, 78]], dtype=torch.int32)
    everything = torch.arange(CONTEXT, dtype=torch.int32)[None]

    base = dict(
        rows=slice(0, 1),
        cache_seqlens=[CONTEXT],
        q_len=GAMMA + 1,
        backend="reference",
        indices=small,
        num_indices=torch.tensor([small.shape[1]], dtype=torch.int32),
    )

    def plan(**kw):
        return ForwardPlan(**base, **kw)

    def layerwise(layer_indices):
        return layerwise_plan(layer_indices, **base)

    def run(p):
        return _logits(prefilled.target_cache, target, draft, tokens, p)

    plain = run(plan())
    torch.testing.assert_close(run(layerwise({0: everything})), run(plan(dense_layers=(0,))), rtol=1e-5, atol=1e-5)
    assert torch.equal(run(layerwise({l: small for l in range(3)})), plain)
    assert not torch.allclose(run(layerwise({1: other})), plain)
    with pytest.raises(ValueError, match="reference"):
        layerwise_plan({}, **{**base, "backend": "triton"})
    with pytest.raises(ValueError, match="one row"):
        layerwise_plan({}, **{**base, "indices": None, "num_indices": None})


def test_oracle_indices_are_the_top_positions_of_the_true_attention():
    from dustin_lab.oracle import oracle_indices, oracle_recovery

    torch.manual_seed(0)
    weights = torch.rand(3, 40).softmax(dim=-1)
    shared, per_layer = oracle_indices(weights, 8, "shared"), oracle_indices(weights, 8, "per-layer")
    assert shared.shape == (1, 8) and per_layer.shape == (3, 8) and shared.dtype == torch.int32
    assert set(shared[0].tolist()) == set(weights.sum(0).topk(8).indices.tolist())
    for layer in range(3):
        assert set(per_layer[layer].tolist()) == set(weights[layer].topk(8).indices.tolist())
    torch.testing.assert_close(oracle_recovery(weights, per_layer), weights.topk(8, dim=1).values.sum(1))
    assert (oracle_recovery(weights, per_layer) >= oracle_recovery(weights, shared)).all()
    with pytest.raises(ValueError, match="unknown oracle"):
        oracle_indices(weights, 8, "per-head")


def test_oracle_methods_in_the_walk(pair, state):
    """The oracles read the best sets of the dense method's attention: the shared one captures what the
    ``oracle@budget`` bound says and at least Dustin's selection does, the per-layer one at least as much per
    layer; with every layer dense, or a budget covering the context, they score exactly like dense."""
    target, draft = pair
    prefilled, continuation = state
    small, full = _cfg(target, draft, 24), _cfg(target, draft, 4096)
    all_dense = _cfg(target, draft, 24, dense_layers=(0, 1, 2))
    methods = {
        "dense": None,
        "small": small,
        "shared": small,
        "per-layer": small,
        "shared-full": full,
        "per-layer-full": full,
        "shared-all-dense": all_dense,
        "per-layer-all-dense": all_dense,
    }
    oracle = {
        "shared": "shared",
        "per-layer": "per-layer",
        "shared-full": "shared",
        "per-layer-full": "per-layer",
        "shared-all-dense": "shared",
        "per-layer-all-dense": "per-layer",
    }
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        methods,
        recovery_configs={"small": small},
        recovery_every=0,
        progress=False,
        oracle=oracle,
    )
    assert walk.sparse_steps["shared"] == walk.sparse_steps["per-layer"] == walk.steps
    assert walk.recovery["shared"] == pytest.approx(walk.recovery_dense_signals["oracle@24"], rel=1e-5)
    assert walk.recovery["shared"] >= walk.recovery["small"] and walk.recovery["shared"] < 1.0
    assert all(p >= s for p, s in zip(walk.recovery_per_layer["per-layer"], walk.recovery_per_layer["shared"]))
    assert walk.recovery["per-layer"] > walk.recovery["shared"]
    assert len({walk.nll["dense"], walk.nll["small"], walk.nll["shared"], walk.nll["per-layer"]}) == 4
    for name in ("shared-full", "per-layer-full", "shared-all-dense", "per-layer-all-dense"):
        assert walk.nll[name] == walk.nll["dense"], name
    with pytest.raises(ValueError, match="not sparse methods"):
        teacher_forced_walk(
            target, draft, prefilled, continuation, GAMMA, {"dense": None}, progress=False, oracle={"dense": "shared"}
        )
    with pytest.raises(ValueError, match="unknown oracle"):
        teacher_forced_walk(
            target,
            draft,
            prefilled,
            continuation,
            GAMMA,
            {"dense": None, "s": small},
            progress=False,
            oracle={"s": "per-head"},
        )
    with pytest.raises(ValueError, match="have selection layers"):  # they would replace the oracle's sets
        teacher_forced_walk(
            target,
            draft,
            prefilled,
            continuation,
            GAMMA,
            {"dense": None, "s": _cfg(target, draft, 24, selection="verify")},
            progress=False,
            oracle={"s": "shared"},
        )


def test_knob_methods_in_the_walk(pair, state):
    """A knob method reads, per step, a set its estimate holds the target in (between the floor and the ceiling),
    else the whole context; a target of 1.0 reads everything, as dense verification does; every sparse method
    records each step's read count, estimated and true recovery."""
    target, draft = pair
    prefilled, continuation = state
    walk = teacher_forced_walk(
        target,
        draft,
        prefilled,
        continuation,
        GAMMA,
        {
            "dense": None,
            "knob": _cfg(target, draft, 24, min_recovery=0.6, max_budget=60),
            "all": _cfg(target, draft, 24, min_recovery=1.0),
            "fixed": _cfg(target, draft, 24),
        },
        progress=False,
    )
    contexts = [CONTEXT + step * (GAMMA + 1) for step in range(walk.steps)]
    assert walk.read_counts["all"] == contexts and walk.nll["all"] == walk.nll["dense"]
    assert walk.read_counts["fixed"] == [24] * walk.steps
    read, estimates, truths = walk.read_counts["knob"], walk.estimated_recovery["knob"], walk.true_recovery["knob"]
    assert any(n == at for n, at in zip(read, contexts)) and any(n < at for n, at in zip(read, contexts))
    for n, at, estimate, truth in zip(read, contexts, estimates, truths):
        assert (n == at and estimate == truth == 1.0) or (24 <= n <= 60 and estimate >= 0.6 and 0 < truth < 1)
    for name in ("knob", "fixed"):  # the per-step truths are the recovery the walk reports
        assert sum(walk.true_recovery[name]) / walk.steps == pytest.approx(walk.recovery[name], rel=1e-5)
        assert all(0 < e <= 1 for e in walk.estimated_recovery[name])


def test_the_probe_sees_what_the_scores_and_the_recovery_are_made_of(pair, state, tmp_path):
    """EstimatorFeatures keeps, per step, every head's history and lookahead attention and the true weights: the
    library's estimator recipe over them is estimated_mass of the scoring heads' scores, and the paper's fill made
    from them recovers what the walk measures from the dense signals."""
    target, draft = pair
    _, continuation = state
    tokens = random_prompt(CONTEXT + 33, seed=5)[0]
    everything = prefill_pair(target, draft, tokens[:CONTEXT], tuple(range(target.config.num_hidden_layers)))
    cfg = _cfg(target, draft, 24, min_recovery=0.5, max_budget=48)
    fixed = _cfg(target, draft, 24)
    walk = teacher_forced_walk(
        target,
        draft,
        everything,
        continuation,
        GAMMA,
        {"dense": None},
        recovery_configs={"fixed": fixed},
        probe=EstimatorFeatures(tmp_path),
        progress=False,
    )
    steps = load_features(tmp_path)
    assert [s["at"] for s in steps] == [CONTEXT + step * (GAMMA + 1) for step in range(walk.steps)]
    library = library_estimator(cfg)
    for s in steps:
        assert s["truth"].sum() == pytest.approx(1.0, abs=1e-4)
        assert torch.allclose(s["history"].float().sum(-1), torch.ones(s["history"].shape[:2]), atol=1e-2)
        s_draft = sum(
            s["draft"][layer, list(heads)].float().sum(0) for layer, heads in zip(cfg.draft_layers, cfg.draft_heads)
        )
        s_target = s["history"][cfg.target_layer, list(cfg.target_heads)].float().sum(0)
        expected = estimated_mass(s_draft[None], s_target[None], [True], torch.tensor([s["at"]]))[0]
        assert torch.allclose(library.mass(s), expected, atol=1e-6)
    report = study(
        {"text": steps},
        cfg,
        {"library": library, "flat": Estimator(library.target, library.draft, power=0.5)},
        targets=[0.5, 0.9],
        budgets=[24],
    )
    assert report["fixed_fill"]["24"]["mean_truth"] == pytest.approx(walk.recovery_dense_signals["fixed"], abs=5e-3)
    for name in ("library", "flat"):
        knob = report["estimators"][name]["knob"]
        assert 24 <= knob["0.5"]["pooled"]["mean_read"] <= knob["0.9"]["pooled"]["mean_read"]
        assert knob["0.5"]["pooled"]["mean_truth"] <= knob["0.9"]["pooled"]["mean_truth"] <= 1
        assert report["estimators"][name]["proxy"]["24"]["pooled"]["n"] == len(steps)
    orders = order_study({"text": steps}, cfg, targets=[0.5, 0.9], ladder=[24, 32, 48], reads=(24, 32))
    assert orders["by_count"]["24"]["fixed_fill"]["mean_truth"] == pytest.approx(
        report["fixed_fill"]["24"]["mean_truth"]
    )
    assert orders["library_knob"] == report["estimators"]["library"]["knob"]
    assert orders["at_read"]["24"]["fixed_fill"]["mean_truth"] == pytest.approx(
        report["fixed_fill"]["24"]["mean_truth"]
    )
    for t in (0.5, 0.9):  # the oracle splits reach the target on every step (reading everything, 1.0, at worst)
        for name in ("oracle_ladder", "oracle_library"):
            assert orders[name][str(t)]["pooled"]["p10_truth"] >= t - 1e-4
        ladder = orders["ladder_knob"][str(t)]["pooled"]
        assert 24 <= ladder["mean_read"] and orders["ladder_knob_no_fallback"][str(t)]["pooled"]["mean_read"] <= 48
    best = orders["best_mean_ladder"]
    assert best[0]["mean_read"] == 24 and best[0]["mean_truth"] == pytest.approx(
        report["fixed_fill"]["24"]["mean_truth"]
    )
    assert [p["mean_read"] for p in best] == sorted(p["mean_read"] for p in best)


def test_the_walk_measures_what_each_layer_after_a_selection_layer_read(pair, state):
    """With selection layers, the walk's recovery is that of what each layer read (the plan's selection_hook tells it
    what each selection layer chose): a selection layer reads everything, so its recovery is 1, and the layers after
    it read its choice, not the method's own set."""
    target, draft = pair
    prefilled, continuation = state
    cfg = _cfg(target, draft, 24, selection="verify")
    assert cfg.selection_layers
    methods = {"dense": None, "verify": cfg, "dustin": _cfg(target, draft, 24)}
    walk = teacher_forced_walk(target, draft, prefilled, continuation, GAMMA, methods, progress=False)
    per_layer = walk.recovery_per_layer
    assert walk.sparse_steps["verify"] > 0
    assert all(per_layer["verify"][layer] == 1.0 for layer in cfg.selection_layers)
    assert all(per_layer["dustin"][layer] < 1.0 for layer in cfg.selection_layers)  # the same set, without its choice
