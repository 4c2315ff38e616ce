"""A selection layer's one read of its keys (``selection_attention``): the dense verification kernel writes the scores
the choice needs as it attends, and the scoring kernel's pass 2 sums them.

Checked against float64 loops that share no code with the kernels: the attention output (each query over the cached
positions and the new tokens up to itself) and the selection weights (per row, the mean over heads and the row's own
leading queries of each query's softmax over the cached positions alone). fp32 must match to ``rtol 1e-4 / atol
1e-6`` (the output ``1e-5``); fp16 follows flash-attn's rule: at most twice the error of the PyTorch paths in the same
dtype, plus ``1e-6``. Explicit launch configurations cover one split, a ticket merge and the merge kernel. The read
sets must equal the two-step path's (the dense kernel, then ``choose_read_set``) where no weights tie.

Triton runs on CUDA when there is one, otherwise in the Triton interpreter on CPU (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_RUNS

from dustin_hf.kernels.reference import verify_attention_reference
from dustin_hf.kernels.triton_score import attention_mass_from_scores
from dustin_hf.kernels.triton_verify import launch_config, verify_attention_scores_triton, verify_attention_triton
from dustin_hf.runtime.plan import DeviceTensors, SelectLayers
from dustin_hf.selection.layers import choose_read_set, selection_attention
from dustin_hf.selection.scoring import attention_mass

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.skipif(not TRITON_RUNS, reason="needs triton: CUDA, or on CPU TRITON_INTERPRET=1"),
    # pass 2 loads whole tiles, cells nobody wrote included, and drops them with tl.where; the interpreter's numpy
    # still warns when that garbage overflows
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

SCALE = 0.3
SPAN = 200
Q, KV_HEADS, GROUP, DIM = 5, 2, 2, 16
SEQLENS = (SPAN, 3, 41, 177)  # ragged; one row holds 3 positions only


def _inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(len(SEQLENS), Q, KV_HEADS * GROUP, DIM, generator=gen)  # peakier than N(0, 1) logits
    k = torch.randn(len(SEQLENS), SPAN + Q + 3, KV_HEADS, DIM, generator=gen)
    v = torch.randn(len(SEQLENS), SPAN + Q + 3, KV_HEADS, DIM, generator=gen)
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), seqlens.to(DEVICE)


def _explicit_weights(q, k, seqlens, queries: int, counts=None) -> torch.Tensor:
    """float64: per row, the mean over heads and counted leading queries of each softmax over the cached keys."""
    q, k = q.cpu().double(), k.cpu().double()
    heads = q.shape[2]
    out = torch.zeros(q.shape[0], SPAN, dtype=torch.float64)
    for b, length in enumerate(seqlens.tolist()):
        own = queries if counts is None else max(1, min(int(counts[b]), queries))
        for j in range(own):
            for h in range(heads):
                out[b, :length] += (k[b, :length, h // GROUP] @ q[b, j, h] * SCALE).softmax(0)
        out[b] /= own * heads
    return out


def _explicit_output(q, k, v, seqlens) -> torch.Tensor:
    """float64: query ``i`` of row ``b`` over the cached positions and the new tokens ``<= i``."""
    q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
    out = torch.zeros_like(q)
    for b, length in enumerate(seqlens.tolist()):
        for i in range(Q):
            for h in range(q.shape[2]):
                keys, values = k[b, : length + i + 1, h // GROUP], v[b, : length + i + 1, h // GROUP]
                out[b, i, h] = (keys @ q[b, i, h] * SCALE).softmax(0) @ values
    return out


def _low_precision_pytorch(q, k, seqlens, counts=None) -> torch.Tensor:
    """The weights through PyTorch's logits in the inputs' dtype (``attention_mass``'s reference path)."""
    n_q, heads = q.shape[1], q.shape[2]
    own = None if counts is None else counts.long().clamp(1, n_q)
    mass = attention_mass(
        q,
        k,
        (seqlens.long() - 1)[:, None].expand(-1, n_q),
        tuple(range(heads)),
        GROUP,
        SCALE,
        SPAN,
        SPAN,
        query_counts=own,
    )
    return (mass / (heads * (n_q if own is None else own[:, None]))).double().cpu()


def _config(splits: int):
    """One split, a ticket merge (4 splits) or the merge kernel (13 splits of one 16-key tile)."""
    cfg = launch_config(len(SEQLENS), KV_HEADS, GROUP, Q, DIM, SPAN, 1, num_splits=splits, block_n=16)
    assert cfg.merge == {1: "none", 4: "ticket", 13: "kernel"}[splits]
    return cfg


def _fused(q, k, v, seqlens, splits, queries, counts):
    out, buffers = verify_attention_scores_triton(
        q,
        k,
        v,
        seqlens,
        softmax_scale=SCALE,
        max_seqlen_k=SPAN + Q,
        span=SPAN,
        score_queries=queries,
        query_counts=counts,
        config=_config(splits),
    )
    mass = attention_mass_from_scores(buffers, seqlens, counts)
    own = queries if counts is None else counts.clamp(1, queries)[:, None]
    return out, mass / (q.shape[2] * own)


@pytest.mark.parametrize("splits", [1, 4, 13])
@pytest.mark.parametrize("queries, counted", [(Q, False), (Q, True), (2, True)])
def test_output_and_weights_equal_the_explicit_loops(splits, queries, counted):
    """The output is the dense attention's; the weights leave the new tokens out of each softmax, count each row's
    own leading queries only, and survive every way of merging splits."""
    counts = torch.tensor([5, 2, 1, 3], dtype=torch.int32, device=DEVICE) if counted else None
    for dtype in (torch.float32, torch.float16):
        q, k, v, seqlens = _inputs(dtype, seed=splits + queries + 10 * counted)
        out, weights = _fused(q, k, v, seqlens, splits, queries, counts)
        assert weights.shape == (len(SEQLENS), SPAN) and not torch.isnan(weights).any()
        exact_out = _explicit_output(q, k, v, seqlens)
        exact = _explicit_weights(q, k, seqlens, queries, counts)
        label = f"{dtype}, {splits} splits, {queries} queries, counted {counted}"
        if dtype == torch.float32:
            torch.testing.assert_close(
                out.double().cpu(), exact_out, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label}: {m}"
            )
            torch.testing.assert_close(
                weights.double().cpu(), exact, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label}: {m}"
            )
            continue
        dense = verify_attention_reference(q, k, v, seqlens, softmax_scale=SCALE)
        baseline = (dense.double().cpu() - exact_out).abs().max().item()
        err = (out.double().cpu() - exact_out).abs().max().item()
        assert err <= 2 * baseline + 1e-6, f"{label}: output error {err:.3g} > 2 x {baseline:.3g}"
        baseline = (_low_precision_pytorch(q[:, :queries], k, seqlens, counts) - exact).abs().max().item()
        err = (weights.double().cpu() - exact).abs().max().item()
        assert err <= 2 * baseline + 1e-6, f"{label}: weights error {err:.3g} > 2 x {baseline:.3g}"


def test_the_weights_differ_from_a_softmax_over_the_new_tokens_too():
    """Guards the check above: including the new tokens in each softmax moves the weights by far more than the
    tolerance (so a kernel that did would fail it)."""
    q, k, _, seqlens = _inputs(torch.float32, seed=7)
    cached = _explicit_weights(q, k, seqlens, Q)
    q64, k64 = q.cpu().double(), k.cpu().double()
    with_new = torch.zeros_like(cached)
    for b, length in enumerate(seqlens.tolist()):
        for j in range(Q):
            for h in range(q.shape[2]):
                logits = k64[b, : length + j + 1, h // GROUP] @ q64[b, j, h] * SCALE  # cached and new keys <= j
                with_new[b, :length] += logits.softmax(0)[:length]
        with_new[b] /= Q * q.shape[2]
    assert (with_new - cached).abs().max() > 1e-3


@pytest.mark.parametrize("queries", [None, 2])
def test_selection_attention_equals_the_two_step_path(queries):
    """``selection_attention`` returns the dense kernel's output and ``choose_read_set``'s read set (sparse rows of
    different counts, a row read in full keeping its index row, rows of their own query counts)."""
    q, k, v, seqlens = _inputs(torch.float32, seed=3)
    width = 64
    indices = torch.arange(width, dtype=torch.int32, device=DEVICE).expand(len(SEQLENS), width).contiguous()
    tensors = DeviceTensors(
        seqlens,
        indices,
        torch.tensor([64, 50, 64, 30], dtype=torch.int32, device=DEVICE),
        torch.tensor([5, 2, 5, 1], dtype=torch.int32, device=DEVICE),
    )
    spec = SelectLayers((1,), 2, 4, queries)
    out, chosen = selection_attention(q, k, v, tensors, SPAN, SPAN + Q, spec, SCALE)
    dense = verify_attention_triton(q, k, v, seqlens, softmax_scale=SCALE, max_seqlen_k=SPAN + Q)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    want = choose_read_set(q, k, tensors, SPAN, spec, SCALE, backend="triton")
    assert torch.equal(chosen.indices, want.indices)
    assert chosen.num_indices is tensors.num_indices and chosen.cache_seqlens is tensors.cache_seqlens
    assert torch.equal(chosen.indices[1], indices[1])  # row 1 (3 positions, count 50) reads in full: its row kept


def test_odd_shapes_equal_the_explicit_loops():
    """A head dim that is no power of two (24), a row with no cached position, one with one, and 160 packed rows
    (32 query heads on one KV head, 5 queries: two row tiles), with the heuristic's launch and with 4 splits."""
    gen = torch.Generator().manual_seed(11)
    heads, dim, span = 32, 24, 70
    seqlens = torch.tensor([0, 1, span], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, Q, heads, dim, generator=gen).to(DEVICE)
    k = torch.randn(3, span + Q, 1, dim, generator=gen).to(DEVICE)
    v = torch.randn(3, span + Q, 1, dim, generator=gen).to(DEVICE)
    q64, k64, v64 = q.cpu().double(), k.cpu().double(), v.cpu().double()
    want_out, want_w = torch.zeros_like(q64), torch.zeros(3, span, dtype=torch.float64)
    for b, length in enumerate(seqlens.tolist()):
        for i in range(Q):
            for h in range(heads):
                logits = k64[b, : length + i + 1, 0] @ q64[b, i, h] * SCALE
                want_out[b, i, h] = logits.softmax(0) @ v64[b, : length + i + 1, 0]
                if length:
                    want_w[b, :length] += logits[:length].softmax(0) / (Q * heads)
    for config in (None, launch_config(3, 1, heads, Q, dim, span, 1, num_splits=4, block_n=16)):
        out, buffers = verify_attention_scores_triton(
            q, k, v, seqlens, softmax_scale=SCALE, max_seqlen_k=span + Q, span=span, config=config
        )
        weights = attention_mass_from_scores(buffers, seqlens) / (Q * heads)
        torch.testing.assert_close(out.double().cpu(), want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(weights.double().cpu(), want_w, rtol=1e-4, atol=1e-6)


def test_a_triton_forward_takes_the_fused_path_and_a_masked_one_does_not(monkeypatch):
    """Inside a real forward on the Triton backend the selection layer goes through ``selection_attention`` and the
    layers after it read what its own queries chose (as on the reference backend, ``test_select_layers.py``); a
    forward that returns attention weights (the masked path) chooses through ``choose_read_set`` instead."""
    from tiny_models import random_prompt, tiny_model

    import dustin_hf
    from dustin_hf.adapter import attention
    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.compat import attention_scale
    from dustin_hf.decode.cache import DustinCache
    from dustin_hf.decode.runner import ModelRunner
    from dustin_hf.runtime.plan import ForwardPlan
    from dustin_hf.selection import layers as select_layers
    from dustin_hf.selection.recovery import position_weights

    layers, selector, prompt, width, sink, recent = 4, 1, 160, 24, 2, 4
    model = tiny_model("qwen2", layers=layers, hidden=32, heads=4, kv_heads=2, seed=4)
    tokens = random_prompt(prompt + Q, seed=9)[0]
    given = torch.arange(width, dtype=torch.int32)
    reads, fused, chosen = [], [], []
    real_verify, real_fused, real_choose = (
        attention.verify_attention,
        select_layers.selection_attention,
        select_layers.choose_read_set,
    )

    def verify(q, k, v, seqlens, *, indices=None, num_indices=None, **kwargs):
        reads.append(None if indices is None else indices[0, : int(num_indices[0])].tolist())
        return real_verify(q, k, v, seqlens, indices=indices, num_indices=num_indices, **kwargs)

    monkeypatch.setattr(attention, "verify_attention", verify)
    monkeypatch.setattr(select_layers, "selection_attention", lambda *a, **kw: fused.append(1) or real_fused(*a, **kw))
    # a choice that scores the keys itself (the fused path hands it the weights its attention kernel wrote)
    monkeypatch.setattr(
        select_layers,
        "choose_read_set",
        lambda *a, **kw: chosen.append(kw.get("weights") is None) or real_choose(*a, **kw),
    )
    for weights_out in (False, True):
        runner = ModelRunner(model, DustinCache(layers, 1, prompt + Q + 1), "triton")
        reads.clear(), fused.clear(), chosen.clear()
        with dustin_hf.patch(model), attention_routed(model):
            runner.prefill([tokens[:prompt]], None, {})
            plan = ForwardPlan(
                rows=slice(0, 1),
                cache_seqlens=[prompt],
                q_len=Q,
                indices=given[None],
                num_indices=torch.tensor([width], dtype=torch.int32),
                capture={selector: (0, 1, 2, 3)},
                select=SelectLayers((selector,), sink, recent),
                attention_weights=weights_out,
                backend="triton",
            )
            runner.forward(plan, tokens[prompt:][None], keep=1)
        if weights_out:  # the masked path: every layer there, the choice through choose_read_set
            assert (fused, chosen, reads) == ([], [True], [])
            continue
        keys = runner.cache.layer_buffers(selector)[0][0]
        weights = position_weights(
            {0: plan.captured[selector][0]}, {0: keys}, prompt, attention_scale(model, model.config)
        )[0]
        candidates = weights[:prompt].clone()
        candidates[:sink], candidates[prompt - recent :] = -1, -1
        expected = sorted(
            list(range(sink))
            + list(range(prompt - recent, prompt))
            + candidates.topk(width - sink - recent).indices.tolist()
        )
        assert (fused, chosen) == ([1], [False])
        assert reads == [given.tolist()] * selector + [expected] * (layers - selector - 1)
