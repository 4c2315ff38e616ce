"""End to end on CUDA: the patched generate() with the GPU backends (skipped without a GPU)."""

import pytest
import torch
from tiny_models import left_pad, noisy_copy, random_prompt, set_gamma, tiny_model

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.kernels import resolve_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _pair(family="qwen2", dtype=torch.float32):
    target = tiny_model(family, layers=3, hidden=128, heads=8, kv_heads=2)
    draft = set_gamma(noisy_copy(target), 4)
    return target.to("cuda", dtype), draft.to("cuda", dtype)


def test_auto_backend_is_a_gpu_kernel():
    assert resolve_backend("auto", "cuda") in ("triton", "flash_attn", "varlen")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batched_full_budget_equals_greedy_on_cuda(backend):
    target, draft = _pair()  # float32: exact comparisons (the varlen backends need fp16/bf16)
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (7, 40, 23, 64)]
    ids, mask = left_pad(rows)
    with dustin_hf.patch(target, DustinConfig(selection="dustin", backend=backend)):
        out = target.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=24,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    for b, row in enumerate(rows):
        alone = target.generate(row[None], max_new_tokens=24, do_sample=False)[0, row.numel() :]
        assert torch.equal(out.sequences[b, ids.shape[1] :], alone), f"row {b}"


@pytest.mark.parametrize("backend", ["triton", "varlen", "reference"])
def test_sparse_generation_runs_on_cuda_bf16(backend):
    target, draft = _pair(dtype=torch.bfloat16)
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (3000, 2500)]
    ids, mask = left_pad(rows)
    config = DustinConfig(selection="dustin", budget=128, min_context=1024, backend=backend)
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=32,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert stats["dense_steps"] == 0 and stats["sparse_steps"] > 0 and stats["mean_attended"] == 128
    assert out.sequences.shape == (2, ids.shape[1] + 32)


@pytest.mark.parametrize("dustin", [False, True, "sparse_draft"])
def test_cuda_graphs_replay_the_eager_steps_exactly(dustin):
    from transformers import GenerationConfig

    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.config import resolve
    from dustin_hf.decode.decoder import SpeculativeDecoder
    from dustin_hf.decode.settings import Drafting, RuntimeOptions

    target, draft = _pair()  # float32: eager and replayed kernels may split the keys differently
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (1500, 1700, 900)]
    ids, mask = left_pad(rows)
    config = GenerationConfig(do_sample=False, max_length=ids.shape[1] + 40, pad_token_id=0)
    resolved = resolve(
        DustinConfig(
            selection="dustin", budget=128, min_context=512, backend="triton", sparse_draft=dustin == "sparse_draft"
        ),
        target.config,
        draft.config,
    )
    outputs = []
    with dustin_hf.patch(target), attention_routed(target, draft):
        for graphs in (False, True):
            decoder = SpeculativeDecoder(
                target,
                draft,
                config,
                dustin_config=resolved if dustin else None,
                drafting=Drafting(4),
                runtime=RuntimeOptions(backend="triton", cuda_graphs=graphs),
            )
            result = decoder.generate(ids.cuda(), mask.cuda())
            outputs.append(result.sequences)
            assert decoder.graphs == {"target": graphs, "draft": graphs}
            stats = result.stats.as_dict()
            assert (stats["draft_forwards_ahead"] > 0) == graphs  # queued before the sync: replays only
            assert stats["cuda_graphs"]["select"] == {"captured": int(graphs and bool(dustin)), "failed": []}
            if dustin:
                assert stats["sparse_steps"] > 0
                assert (stats["draft_sparse_forwards"] > 0) == (dustin == "sparse_draft")
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("sparse_draft", [False, True])
def test_decode_steps_wait_for_the_device_once(sparse_draft):
    """A step's only host sync is reading the accepted counts: anything else (a host list copied to the device
    without ``non_blocking``, an ``.item()``) makes the host wait for the work it queued and idles the GPU while
    it queues more. torch's sync debug mode warns at every synchronising call; count them over a generate()."""
    import warnings

    target, draft = _pair(dtype=torch.bfloat16)
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (1500, 1700, 900)]
    ids, mask = left_pad(rows)
    config = DustinConfig(selection="dustin", budget=128, min_context=512, backend="triton", sparse_draft=sparse_draft)
    with dustin_hf.patch(target, config), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = target.generate(
                ids.cuda(),
                attention_mask=mask.cuda(),
                assistant_model=draft,
                do_sample=False,
                max_new_tokens=160,
                cache_implementation="dustin",
                return_dict_in_generate=True,
            )
        finally:
            torch.cuda.set_sync_debug_mode(0)
    stats = out.past_key_values.stats
    steps = stats["sparse_steps"] + stats["dense_steps"]
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert stats["sparse_steps"] > 20 and (stats["draft_sparse_forwards"] > 0) == sparse_draft
    # one per step, plus set-up (prefill, first tokens, graph capture): far below the ~10 per step of a loop
    # that copied its host lists with blocking copies
    assert len(syncs) <= steps + 40, (len(syncs), steps, sorted({str(w.message)[:80] for w in syncs}))


def test_dense_layers_and_prompt_calibration_under_cuda_graphs():
    """Every layer dense on sparse steps, heads calibrated on the prompts, graphs replayed: still greedy."""
    target, draft = _pair()
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (1500, 1100)]
    ids, mask = left_pad(rows)
    config = DustinConfig(
        selection="dustin", budget=128, min_context=512, backend="triton", dense_layers=(0, 1, 2), calibration="prompt"
    )
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=24,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert stats["sparse_steps"] > 0 and stats["cuda_graphs"]["target"]["captured"] > 0
    assert stats["calibration"]["steps"] > 0
    for b, row in enumerate(rows):
        alone = target.generate(row[None], max_new_tokens=24, do_sample=False)[0, row.numel() :]
        assert torch.equal(out.sequences[b, ids.shape[1] :], alone), f"row {b}"


def _split_over_two_gpus(model):
    """accelerate's pipeline layout: embedding and the first layers on cuda:0, the rest and the head on cuda:1."""
    from accelerate import dispatch_model

    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map.update({f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)})
    return dispatch_model(model, device_map=device_map)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_target_split_over_two_gpus_equals_greedy_and_replays_its_graphs_exactly():
    """A target split by accelerate: each device's stage captured in its own graph, replayed with the hidden
    states handed across; every Triton launch on its tensors' device (cuda:0 stays current throughout)."""
    from transformers import GenerationConfig

    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.config import resolve
    from dustin_hf.decode.decoder import SpeculativeDecoder
    from dustin_hf.decode.settings import Drafting, RuntimeOptions
    from dustin_hf.runtime.pipeline import Pipeline

    torch.cuda.set_device(0)
    target = tiny_model("qwen2", layers=4, hidden=128, heads=8, kv_heads=2)
    draft = set_gamma(noisy_copy(target), 4).to("cuda:0")
    target = _split_over_two_gpus(target)
    assert [stage.device.index for stage in Pipeline(target).stages] == [0, 1]
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (1500, 1700, 900)]
    ids, mask = left_pad(rows)
    config = GenerationConfig(do_sample=False, max_length=ids.shape[1] + 40, pad_token_id=0)
    full = resolve(DustinConfig(selection="dustin", budget=4096, backend="triton"), target.config, draft.config)
    sparse = resolve(
        DustinConfig(selection="dustin", budget=128, min_context=512, backend="triton"), target.config, draft.config
    )
    outputs = {}
    with dustin_hf.patch(target), attention_routed(target, draft):
        for name, dustin, graphs in (("full", full, True), ("eager", sparse, False), ("graphed", sparse, True)):
            decoder = SpeculativeDecoder(
                target,
                draft,
                config,
                dustin_config=dustin,
                drafting=Drafting(4),
                runtime=RuntimeOptions(backend="triton", cuda_graphs=None if graphs else False),
            )
            result = decoder.generate(ids.cuda(), mask.cuda())
            outputs[name] = result.sequences
            assert decoder.graphs["target"] == graphs
            report = result.stats.as_dict()["cuda_graphs"]["target"]
            assert report["failed"] == [] and (report["captured"] > 0) == graphs
    assert torch.equal(outputs["eager"], outputs["graphed"])
    for b, row in enumerate(rows):  # the whole context in budget: plain greedy decoding of the split model
        alone = target.generate(row[None], max_new_tokens=40, do_sample=False)[0, row.numel() :]
        assert torch.equal(outputs["full"][b, ids.shape[1] :], alone.to(outputs["full"].device)), f"row {b}"


def test_decoding_prefers_cublaslt_and_restores_the_setting():
    """The decode steps' GEMMs go through cuBLASLt (fewer split-K launches, dustin_hf.runtime.launch.prefer_cublaslt),
    the prompt's through PyTorch's default (its large GEMMs ran faster there: 1.051 against 1.080 s a 32k row of a
    7B on an H200), and the process-wide setting is back to the user's after generate()."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    seen = []

    class Probe(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(torch.backends.cuda.preferred_blas_library())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    target, draft = _pair()
    ids = random_prompt(40, seed=3)[0].cuda()[None]
    before = torch.backends.cuda.preferred_blas_library()
    with dustin_hf.patch(target):
        target.generate(
            ids,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=8,
            cache_implementation="dustin",
            stopping_criteria=StoppingCriteriaList([Probe()]),
        )
    assert seen[0] == before  # the first token: named by the prompt's forward
    assert len(seen) > 1 and all(library == torch._C._BlasBackend.Cublaslt for library in seen[1:])
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.parametrize("lengths", [(2600, 1900, 700, 2200), (2600, 1900, 1300, 2200)], ids=["mixed", "long"])
@pytest.mark.parametrize("sparse_draft", [False, True])
def test_exact_mode_equals_greedy_on_cuda_with_graphs(sparse_draft, lengths):
    """Exact mode through the Triton kernels, CUDA graphs and fused ops (float32): sparse steps, confirmations
    (dense, wider blocks) and rows read in full beside sparse ones ("mixed"), and the output still greedy's."""
    target, draft = _pair()
    rows = [random_prompt(n, seed=n)[0].cuda() for n in lengths]
    ids, mask = left_pad(rows)
    greedy = target.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False)
    config = DustinConfig(
        selection="dustin", budget=64, min_context=1024, backend="triton", mode="exact", sparse_draft=sparse_draft
    )
    with dustin_hf.patch(target, config):
        out = target.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=40,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert torch.equal(out.sequences, greedy)
    assert stats["sparse_steps"] > 0 and stats["exact"]["confirmations"] > 0
    if not sparse_draft or min(lengths) > 1024:  # confirming steps queue the next drafts too, not only sparse ones
        # (a greedy confirming step is dense, so at most sparse_steps steps would have theirs queued otherwise). The
        # sparse draft's reads of the 700-token row, which reads in full, are wider than a graph: none queued there
        assert stats["steps_drafted_ahead"] > stats["sparse_steps"]


def test_quality_knob_reads_rows_in_full_inside_the_graph():
    """A target out of reach of a small ceiling: every row reads in full through its count (the kernels' full
    rows, the read width still the ceiling), so the target's sparse forwards replay a CUDA graph, and the output is
    greedy's."""
    target, draft = _pair()
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (2600, 1500, 2100)]
    ids, mask = left_pad(rows)
    greedy = target.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False)
    knob = DustinConfig(
        selection="dustin",
        budget=64,
        min_context=1024,
        backend="triton",
        min_recovery=1.0,
        max_budget=128,
        sparse_draft=True,
    )
    with dustin_hf.patch(target, knob):
        out = target.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=24,
            cache_implementation="dustin",
            return_dict_in_generate=True,
        )
    stats = out.past_key_values.stats
    assert torch.equal(out.sequences, greedy)
    assert stats["knob"]["dense_fallbacks"] > 0 and stats["sparse_steps"] > 0
    assert stats["cuda_graphs"]["target"]["full_rows"] >= 1 and not stats["cuda_graphs"]["target"]["failed"]


@pytest.mark.parametrize("sparse_draft", [False, True])
def test_a_row_below_min_context_beside_long_rows_stays_in_the_graphs(sparse_draft):
    """A short row (below ``min_context``, read in full) beside long ones: its read set is named by its count,
    so the sparse verification (and the sparse draft) replay CUDA graphs of the budget's width with the full-row
    launch; the output equals the eager loop's, and the short row's is greedy's."""
    from transformers import GenerationConfig

    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.config import resolve
    from dustin_hf.decode.decoder import SpeculativeDecoder
    from dustin_hf.decode.settings import Drafting, RuntimeOptions

    target, draft = _pair()
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (2600, 500, 2100)]
    ids, mask = left_pad(rows)
    config = GenerationConfig(do_sample=False, max_length=ids.shape[1] + 24, pad_token_id=0)
    dustin = resolve(
        DustinConfig(selection="dustin", budget=64, min_context=1024, backend="triton", sparse_draft=sparse_draft),
        target.config,
        draft.config,
    )
    outputs = {}
    with dustin_hf.patch(target), attention_routed(target, draft):
        for graphs in (False, True):
            decoder = SpeculativeDecoder(
                target,
                draft,
                config,
                dustin_config=dustin,
                drafting=Drafting(4),
                runtime=RuntimeOptions(backend="triton", cuda_graphs=None if graphs else False),
            )
            result = decoder.generate(ids.cuda(), mask.cuda())
            outputs[graphs] = result.sequences
            stats = result.stats.as_dict()
            assert stats["sparse_steps"] > 0
    report = stats["cuda_graphs"]
    assert report["target"]["full_rows"] >= 1 and not report["target"]["failed"]
    assert (report["draft"]["full_rows"] >= 1) == sparse_draft and not report["draft"]["failed"]
    assert torch.equal(outputs[False], outputs[True])
    short = target.generate(rows[1][None], max_new_tokens=24, do_sample=False)[0, rows[1].numel() :]
    assert torch.equal(outputs[True][1, ids.shape[1] :], short)


def test_quality_knob_and_masked_rows_on_cuda():
    """The knob's per-row counts through the Triton sparse kernel (a target of 1.0: greedy's output), a tril mask
    (a masked last slot) and right padding, against stock greedy on the same batch."""
    target, draft = _pair()
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (2600, 1500)]
    ids, mask = left_pad(rows)
    greedy = target.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False)
    knob = DustinConfig(
        selection="dustin", budget=64, min_context=1024, backend="triton", min_recovery=1.0, max_budget=4096
    )
    with dustin_hf.patch(target, knob):
        out = target.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=24,
            cache_implementation="dustin",
        )
        assert torch.equal(out, greedy)
        small = target.generate(
            ids.cuda(),
            attention_mask=mask.cuda(),
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=24,
            cache_implementation="dustin",
            return_dict_in_generate=True,
            cache_config={"min_recovery": 0.6},
        )
        assert small.past_key_values.stats["knob"]["budget_p50"] < 2600
        tril_ids = random_prompt(9, batch=3, seed=4).cuda()
        tril = torch.tril(torch.ones_like(tril_ids))
        stock = target.generate(tril_ids, attention_mask=tril, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = target.generate(
            tril_ids,
            attention_mask=tril,
            assistant_model=draft,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="dustin",
        )
        assert torch.equal(got, stock)


@pytest.mark.parametrize("sparse_draft", [False, True])
def test_a_second_call_replays_the_first_calls_graphs(sparse_draft):
    """The workspace a call leaves (caches, CUDA graphs, fused weights: dustin_hf.decode.workspace) serves the next
    call of its shape, and that call returns what a call after ``release()`` (everything built afresh) returns."""
    target, draft = _pair(dtype=torch.bfloat16)
    config = DustinConfig(selection="dustin", budget=128, min_context=512, backend="triton", sparse_draft=sparse_draft)
    batches = []
    for seed in (1, 2):
        ids, mask = left_pad([random_prompt(n, seed=seed * n)[0] for n in (1500, 1700, 900)])
        batches.append((ids.cuda(), mask.cuda()))
    call = dict(
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=48,
        cache_implementation="dustin",
        return_dict_in_generate=True,
    )
    with dustin_hf.patch(target, config) as handle:
        first = target.generate(batches[0][0], attention_mask=batches[0][1], **call)
        second = target.generate(batches[1][0], attention_mask=batches[1][1], **call)
        handle.release()
        fresh = target.generate(batches[1][0], attention_mask=batches[1][1], **call)
    assert first.past_key_values.stats["cuda_graphs"]["target"]["captured"] > 0
    assert second.past_key_values.stats["workspace"]["runs"] == 2
    assert fresh.past_key_values.stats["workspace"]["runs"] == 1
    assert torch.equal(second.sequences, fresh.sequences)


def test_prefill_in_one_forward_matches_chunks_on_cuda():
    """The whole prompt in one forward (square causal attention: cuDNN's kernel on Hopper) against chunks that
    attend to their prefix (flash's), bf16: the same last logits and cache within bf16's rounding."""
    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.decode.cache import DustinCache
    from dustin_hf.decode.runner import ModelRunner

    target, _ = _pair(dtype=torch.bfloat16)
    ids = random_prompt(3000, seed=5)[0].cuda()
    results = []
    with dustin_hf.patch(target), attention_routed(target), torch.no_grad():
        for chunk in (None, 1024):
            cache = DustinCache(target.config.num_hidden_layers, 1, 3100)
            logits, _ = ModelRunner(target, cache, "triton").prefill([ids], chunk, {})
            results.append((logits[0].float(), cache.layers[-1].buffers()[0][0, :3000].float()))
    torch.testing.assert_close(results[0][0], results[1][0], atol=0.05, rtol=0.05)
    torch.testing.assert_close(results[0][1], results[1][1], atol=0.05, rtol=0.05)


def test_selection_layer_kernels_at_7b_head_shapes_replay_in_a_cuda_graph():
    """``choose_read_set`` through the scoring and selection kernels at Qwen2.5-7B's head shapes (28 query heads over
    4 KV heads, head dim 128, bf16, 5 queries, rows of their own query counts and read counts), captured in a CUDA
    graph and replayed on new keys and lengths: the weights keep flash-attn's rule against a float64 computation
    (at most twice the error of PyTorch's bf16 logits, plus 1e-6), and each sparse row's chosen set holds its windows
    and the positions that computation ranks highest (up to near-ties: at least 99.9% of the best set's mass)."""
    from conftest import capture_graph

    from dustin_hf.runtime.plan import DeviceTensors, SelectLayers
    from dustin_hf.selection.layers import choose_read_set, layer_position_weights
    from dustin_hf.selection.scoring import attention_mass

    gen = torch.Generator().manual_seed(12)
    batch, n_q, heads, kv_heads, dim, capacity, width, scale = 4, 5, 28, 4, 128, 9000, 512, 128**-0.5
    q = (1.5 * torch.randn(batch, n_q, heads, dim, generator=gen)).cuda().bfloat16()
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=gen).cuda().bfloat16().transpose(1, 2)  # HF layout
    seqlens = torch.tensor([8000, 5000, 300, 7000], dtype=torch.int32, device="cuda")
    indices = torch.arange(width, dtype=torch.int32, device="cuda").expand(batch, -1).contiguous()
    tensors = DeviceTensors(
        seqlens,
        indices,
        torch.tensor([512, 400, 512, 512], dtype=torch.int32, device="cuda"),
        torch.tensor([5, 3, 5, 1], dtype=torch.int32, device="cuda"),
    )
    spec, span = SelectLayers((1,), 4, 16), 8500
    graph, (weights, chosen) = capture_graph(
        lambda: (
            layer_position_weights(q, keys, seqlens, span, scale, tensors.query_counts, backend="triton"),
            choose_read_set(q, keys, tensors, span, spec, scale, backend="triton").indices,
        )
    )
    keys.copy_(torch.randn(batch, capacity, kv_heads, dim, generator=gen).cuda().bfloat16())
    seqlens.copy_(torch.tensor([8400, 6000, 300, 7999]))
    graph.replay()
    torch.cuda.synchronize()

    own = tensors.query_counts.long()
    visible = torch.arange(span, device="cuda")[None, :] < seqlens.long()[:, None]  # (B, span)
    logits = torch.einsum("bqhd,bphd->bqhp", q.double(), keys[:, :span].double().repeat_interleave(7, dim=2)) * scale
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)  # (B, Q, H, span)
    probs = probs * (torch.arange(n_q, device="cuda")[None, :] < own[:, None])[:, :, None, None]
    exact = probs.sum(dim=(1, 2)) / (heads * own[:, None])
    mass = attention_mass(
        q,
        keys,
        (seqlens.long() - 1)[:, None].expand(-1, n_q),
        tuple(range(heads)),
        7,
        scale,
        span,
        span,
        query_counts=own,
    )
    baseline = (mass.double() / (heads * own[:, None]) - exact).abs().max().item()
    err = (weights.double() - exact).abs().max().item()
    assert err <= 2 * baseline + 1e-6, f"max abs error {err:.3g} > 2 x {baseline:.3g} + 1e-6"
    for b in (0, 1, 3):  # row 2's count covers its length: it keeps its index row
        length, count = int(seqlens[b]), int(tensors.num_indices[b])
        row = chosen[b, :count].long()
        assert (chosen[b, count:] == 0).all() and bool((row[1:] > row[:-1]).all())
        assert row[:4].tolist() == [0, 1, 2, 3] and row[-16:].tolist() == list(range(length - 16, length))
        candidates = exact[b, 4 : length - 16]
        best = candidates.topk(count - 20).values.sum()
        assert exact[b, row[4:-16]].sum() >= 0.999 * best, f"row {b}"
    assert torch.equal(chosen[2], tensors.indices[2])


@pytest.mark.parametrize("mode", ["sparse", "exact"])
def test_selection_layers_replay_inside_the_cuda_graphs(mode):
    """selection='verify' through the Triton kernels, fused ops and CUDA graphs (float32): the selection layer's
    choice is captured with the forward (no capture failure, the same tokens as the eager loop, one host sync a
    step as before); exact mode's output is greedy's."""
    import warnings

    from transformers import GenerationConfig

    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.config import resolve
    from dustin_hf.decode.decoder import SpeculativeDecoder
    from dustin_hf.decode.settings import Drafting, RuntimeOptions

    target, draft = _pair()
    rows = [random_prompt(n, seed=n)[0].cuda() for n in (1500, 1700, 900)]
    ids, mask = left_pad(rows)
    greedy = target.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False)
    config = GenerationConfig(do_sample=False, max_length=ids.shape[1] + 40, pad_token_id=0)
    resolved = resolve(
        DustinConfig(
            budget=128, min_context=512, backend="triton", mode=mode, selection="verify", selection_layers=(1,)
        ),
        target.config,
        draft.config,
    )
    outputs = []
    with dustin_hf.patch(target), attention_routed(target, draft):
        for graphs in (False, True):
            decoder = SpeculativeDecoder(
                target,
                draft,
                config,
                dustin_config=resolved,
                drafting=Drafting(4),
                runtime=RuntimeOptions(backend="triton", cuda_graphs=graphs),
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = decoder.generate(ids.cuda(), mask.cuda())
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            stats = result.stats.as_dict()
            steps = stats["sparse_steps"] + stats["dense_steps"]
            assert stats["sparse_steps"] > 0 and not stats["cuda_graphs"]["target"]["failed"]
            if graphs:
                assert stats["cuda_graphs"]["target"]["captured"] > 0
                assert len([w for w in caught if "synchroniz" in str(w.message)]) <= steps + 40
            outputs.append(result.sequences)
    assert torch.equal(outputs[0], outputs[1])
    if mode == "exact":
        assert torch.equal(outputs[1], greedy)
