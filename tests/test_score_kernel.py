"""The Triton scoring kernel against ``scoring.attention_mass`` and an explicit float64 loop.

The loop below takes, per (row, query, head), the softmax over the keys the query sees and adds
its first ``num_positions`` probabilities; it shares no code with ``scoring.py``. fp32 must match it
to ``rtol 1e-4 / atol 1e-6``; fp16 follows flash-attn's rule: the kernel's max abs error against
the fp64 loop may be at most twice the error of the PyTorch reference run in fp16, plus ``1e-5``.

Triton runs on CUDA when there is one, otherwise in the Triton interpreter on CPU
(``TRITON_INTERPRET=1``, set below before triton is imported) with small shapes; the interpreter
cannot multiply bf16, so bf16 cases run on CUDA only. Explicit small launch configs force several
splits per row and several tiles per split, which the heuristic would not pick at these sizes.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from conftest import TRITON_RUNS, capture_graph, explicit_attention_mass, sm90_ptx_report  # noqa: E402

from dustin_hf.selection.scoring import attention_mass, draft_lookahead_scores, target_history_scores  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"

pytestmark = [
    pytest.mark.skipif(not TRITON_RUNS, reason="needs triton: CUDA, or on CPU TRITON_INTERPRET=1 in the environment"),
    # pass 2 loads whole tiles, including cells pass 1 never wrote (nobody sees them) and drops them with
    # tl.where; the interpreter's numpy still warns when that garbage overflows
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _kernel():
    from dustin_hf.kernels import triton_score

    return triton_score


# ----------------------------------------------------------------------------- oracle


def _assert_close_to_oracle(got, case_inputs, dtype, name) -> None:
    exact = explicit_attention_mass(*case_inputs)
    assert got.dtype == torch.float32 and got.shape == exact.shape, (got.dtype, got.shape)
    assert not torch.isnan(got).any(), f"{name}: NaN"
    if dtype == torch.float32:
        torch.testing.assert_close(got.double().cpu(), exact, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        return
    # flash-attn's rule: at most twice the error of the PyTorch reference in the same dtype
    baseline = (attention_mass(*_with_span(case_inputs)).double().cpu() - exact).abs().max().item()
    err = (got.double().cpu() - exact).abs().max().item()
    assert err <= 2 * baseline + 1e-5, f"{name}: max abs error {err:.3g} > 2 x {baseline:.3g} + 1e-5"


def _with_span(case_inputs):
    q, keys, query_pos, heads, group, scale, num_positions = case_inputs
    return q, keys, query_pos, heads, group, scale, num_positions, int(query_pos.max()) + 1


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Case:
    group: int
    n_q: int
    head_dim: int
    two_groups: bool  # heads of two KV heads (out of order), else a subset of one KV head's heads
    layout: str = "contiguous"  # "slice_t": buf[:, :cap]; "slice_b": buf[1:1+B]; "strided_d": buf[..., ::2];
    #                             "hf": a (B, kv, cap, D) buffer transposed, as transformers' caches
    seed: int = 0

    def heads(self) -> tuple[int, ...]:
        g = self.group
        if self.two_groups:  # KV heads 2 and 0, listed out of order, the first one interleaved
            return (2 * g + g - 1, 0, 2 * g) if g > 1 else (2, 0)
        return tuple(range(g, 2 * g))[: max(1, g - 1)] if g > 2 else tuple(range(g, 2 * g))  # KV head 1


def _make_inputs(case: Case, dtype: torch.dtype, device: str = DEVICE):
    """``(q, keys, query_pos, heads, group, scale, num_positions)`` with ragged rows; ``key_span`` is
    ``max(query_pos) + 1``, more than ``num_positions``."""
    gen = torch.Generator().manual_seed(case.seed)
    batch, kv, cap, d = 3, 3, 90, case.head_dim
    heads = case.heads()
    last = torch.tensor([80, 2, 41])  # row 1's queries see only a few keys
    if case.n_q == 1:
        query_pos = last[:, None]
    else:  # draft-like consecutive positions in rows 0 and 2, an unordered set in row 1
        query_pos = torch.stack([last[0] + torch.arange(4), torch.tensor([3, 0, 5, 1]), last[2] + torch.arange(4)])
    num_positions = 70
    if case.layout == "slice_t":
        keys = torch.randn(batch, cap + 9, kv, d, generator=gen)[:, :cap]
    elif case.layout == "slice_b":
        keys = torch.randn(batch + 2, cap, kv, d, generator=gen)[1 : 1 + batch]
    elif case.layout == "strided_d":
        keys = torch.randn(batch, cap, kv, 2 * d, generator=gen)[..., ::2]
    elif case.layout == "hf":
        keys = torch.randn(batch, kv, cap, d, generator=gen).transpose(1, 2)
    else:
        keys = torch.randn(batch, cap, kv, d, generator=gen)
    q = 1.5 * torch.randn(batch, case.n_q, len(heads), d, generator=gen)  # peakier than N(0, 1) logits
    return (
        q.to(device, dtype),
        keys.to(device, dtype),
        query_pos.to(device),
        heads,
        case.group,
        d**-0.5,
        num_positions,
    )


# ----------------------------------------------------------------------------- tests


LAYOUTS = ("contiguous", "slice_t", "slice_b", "strided_d", "hf")


@pytest.mark.parametrize("n_q", [1, 4])
@pytest.mark.parametrize("group", [1, 2, 7, 8])
def test_kernel_matches_reference_andexplicit_attention_mass(group, n_q):
    """Every (group, n_q); head dim, head choice and cache layout cycle across the grid; fp32 and fp16,
    with the heuristic launch and with a small one (3 splits, 16-key tiles, 32-position pass-2 tiles)."""
    kernel = _kernel()
    gi, qi = (1, 2, 7, 8).index(group), (1, 4).index(n_q)
    case = Case(
        group=group,
        n_q=n_q,
        head_dim=(16, 64, 128)[(gi + qi) % 3],
        two_groups=(gi + qi) % 2 == 1,
        layout=LAYOUTS[(2 * gi + qi) % len(LAYOUTS)],
        seed=10 * group + n_q,
    )
    for dtype in (torch.float32, torch.float16):
        inputs = _make_inputs(case, dtype)
        q, keys, query_pos, heads, g, scale, num_positions = inputs
        span = int(query_pos.max()) + 1
        small = kernel.launch_config(3, 3, case.head_dim, span, num_positions, 1, block_n=16, num_splits=3, tile=32)
        for name, config in (("heuristic", None), ("small", small)):
            got = kernel.attention_mass_triton(q, keys, query_pos, heads, g, scale, num_positions, span, config=config)
            label = f"{case} {dtype} {name}"
            _assert_close_to_oracle(got, inputs, dtype, label)
            if dtype == torch.float32:
                torch.testing.assert_close(
                    got,
                    attention_mass(*_with_span(inputs)),
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m: f"{label} vs reference: {m}",
                )


def test_backend_switch_in_attention_mass():
    inputs = _make_inputs(Case(group=4, n_q=4, head_dim=32, two_groups=False, layout="hf"), torch.float32)
    want = attention_mass(*_with_span(inputs))
    got = attention_mass(*_with_span(inputs), backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="unknown scoring backend"):
        attention_mass(*_with_span(inputs), backend="cuda")


@pytest.mark.parametrize("shared", [False, True])
def test_query_counts_leave_out_a_rows_later_queries(shared):
    """``query_counts``: row b adds the mass of its first ``query_counts[b]`` queries only (0: nothing), with each
    query at its own position or all at one (a stride-0 view); a small launch splits the keys three ways."""
    case = Case(group=4, n_q=4, head_dim=32, two_groups=True, layout="hf", seed=5)
    q, keys, query_pos, heads, group, scale, num_positions = _make_inputs(case, torch.float32)
    if shared:
        query_pos = query_pos[:, :1].expand(-1, 4)
    counts = torch.tensor([2, 0, 3], device=DEVICE)
    span = int(query_pos.max()) + 1
    args = (q, keys, query_pos, heads, group, scale, num_positions, span)
    want = attention_mass(*args, query_counts=counts)
    small = _kernel().launch_config(3, 6, case.head_dim, span, num_positions, 1, block_n=16, num_splits=3, tile=32)
    for config in (None, small):
        got = _kernel().attention_mass_triton(*args, query_counts=counts, config=config)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert got[1].abs().max() == 0
    for b, n in ((0, 2), (2, 3)):  # the counts spelled out: rows 0 and 2 by their own leading queries alone
        alone = attention_mass(
            q[b : b + 1, :n], keys[b : b + 1], query_pos[b : b + 1, :n], heads, group, scale, num_positions, span
        )
        torch.testing.assert_close(want[b : b + 1], alone, rtol=1e-5, atol=1e-7)


def test_heads_in_any_order():
    """Heads of one KV head at uneven places in ``heads`` (packed with a copy rather than a view)."""
    gen = torch.Generator().manual_seed(6)
    heads = (0, 4, 1, 2, 5)  # KV head 0 at places 0, 2, 3; KV head 1 at 1, 4
    keys = torch.randn(2, 30, 2, 16, generator=gen).to(DEVICE)
    q = torch.randn(2, 2, len(heads), 16, generator=gen).to(DEVICE)
    query_pos = torch.tensor([[20, 21], [7, 3]], device=DEVICE)
    args = (q, keys, query_pos, heads, 4, 0.3, 22, 22)
    torch.testing.assert_close(attention_mass(*args, backend="triton"), attention_mass(*args), rtol=1e-4, atol=1e-6)


def test_target_history_scores_triton():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 2, 64, 16, generator=gen).transpose(1, 2).to(DEVICE)  # (B, cap, kv, D) view
    history = torch.randn(3, 3, 16, generator=gen).to(DEVICE)
    seqlens = torch.tensor([20, 50, 1], dtype=torch.int32, device=DEVICE)
    args = (history, keys, seqlens, (4, 5, 7), 4, 0.25, 50)
    got = target_history_scores(*args, backend="triton")
    torch.testing.assert_close(got, target_history_scores(*args), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.sum(1).cpu(), torch.tensor([3.0, 3.0, 3.0]))  # one distribution per head
    assert got[0, 20:].abs().max() == 0 and got[2, 1:].abs().max() == 0


def test_draft_lookahead_scores_triton():
    """Layers with different heads add into one buffer; the draft tokens' own positions get nothing."""
    gen = torch.Generator().manual_seed(4)
    gamma, seqlens = 4, torch.tensor([12, 30, 5], device=DEVICE)
    keys = [torch.randn(3, 40, 2, 16, generator=gen).to(DEVICE) for _ in range(3)]
    queries = [torch.randn(3, gamma, len(h), 16, generator=gen).to(DEVICE) for h in ((0, 1), (1,), (3, 0, 2))]
    heads = ((0, 1), (1,), (3, 0, 2))
    want = draft_lookahead_scores(queries, keys, seqlens, heads, 2, 0.35, 30)
    got = draft_lookahead_scores(queries, keys, seqlens, heads, 2, 0.35, 30, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert got[0, 12:].abs().max() == 0 and got[2, 5:].abs().max() == 0


def _layers_inputs(seed: int, dtype: torch.dtype = torch.float32):
    """Three draft-like layers (different heads, one of them over two KV heads), ragged rows, and what
    ``attention_mass`` sums to over them."""
    gen = torch.Generator().manual_seed(seed)
    heads = ((0, 1), (5, 2, 3), (3,))  # group 2: layer 1 reads KV heads 2 and 1
    keys = [torch.randn(3, 75, 3, 32, generator=gen).to(DEVICE, dtype) for _ in heads]
    queries = [(1.5 * torch.randn(3, 4, len(h), 32, generator=gen)).to(DEVICE, dtype) for h in heads]
    query_pos = torch.tensor([[60, 61, 62, 63], [3, 0, 5, 1], [40, 41, 42, 43]], device=DEVICE)
    return queries, keys, query_pos, heads


@pytest.mark.parametrize(
    "launch",
    [
        dict(),  # the heuristic
        dict(
            block_n=16, num_splits=3, tile=64, block_p=32, block_r=8, num_stages_reduce=1
        ),  # 4 row blocks, 2 tiles a step
        dict(
            block_n=16, num_splits=4, tile=48, block_p=16, block_r=4, num_stages_reduce=3
        ),  # 7 row blocks, ragged tiles
        dict(block_n=32, num_splits=1, tile=64, block_p=64, block_r=32, num_warps_reduce=2),  # one split: no ticket
        dict(block_n=16, num_splits=2, layers_per_pass2=2),  # two pass 2s (layers 0-1, then 2), adding up
    ],
)
def test_layers_in_one_pass_2_equal_the_sum_over_layers(launch):
    """``attention_mass_layers_triton``: all layers' rows in one set of buffers and one pass 2, with
    ``out=`` and ``position_limit``, equals ``out`` plus the reference's per-layer masses, limited."""
    kernel = _kernel()
    queries, keys, query_pos, heads = _layers_inputs(7)
    num_positions, span = 56, 64
    limit = torch.tensor([50, 56, 20], device=DEVICE)
    start = torch.rand(3, num_positions, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = start + sum(
        attention_mass(q, k, query_pos, h, 2, 0.2, num_positions, span) for q, k, h in zip(queries, keys, heads)
    )
    want = want * (torch.arange(num_positions, device=DEVICE)[None, :] < limit[:, None])
    rows = query_pos.shape[1] * sum(map(len, heads))
    config = kernel.launch_config(3, 3, 32, span, num_positions, 1, rows=rows, **launch) if launch else None
    got = kernel.attention_mass_layers_triton(
        queries,
        keys,
        query_pos,
        heads,
        2,
        0.2,
        num_positions,
        span,
        out=start.clone(),
        position_limit=limit,
        config=config,
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_split_tickets_are_reset_and_a_second_launch_is_identical():
    """The ticket merge leaves every counter at zero (what a replayed CUDA graph relies on), so the same
    launch twice, and then another shape, give the same results as before."""
    kernel = _kernel()
    from dustin_hf.kernels._device import tickets

    queries, keys, query_pos, heads = _layers_inputs(8, torch.float16)
    config = kernel.launch_config(3, 6, 32, 64, 56, 1, rows=24, block_n=16, num_splits=4)
    run = lambda: kernel.attention_mass_layers_triton(
        queries,
        keys,
        query_pos,
        heads,
        2,
        0.2,
        56,
        64,  # noqa: E731
        config=config,
    )
    first = run()
    counters = tickets(torch.device(DEVICE), 1)
    assert counters.abs().sum().item() == 0
    torch.testing.assert_close(run(), first, rtol=0, atol=0)
    kernel.attention_mass_triton(queries[1], keys[1], query_pos, heads[1], 2, 0.2, 30, 64)  # other splits
    assert counters.abs().sum().item() == 0
    torch.testing.assert_close(run(), first, rtol=0, atol=0)


def test_layers_must_share_queries_head_dim_and_dtype():
    queries, keys, query_pos, heads = _layers_inputs(9)
    mass = _kernel().attention_mass_layers_triton
    with pytest.raises(ValueError, match="one key dtype"):
        mass(queries, [keys[0], keys[1].half(), keys[2]], query_pos, heads, 2, 0.2, 56, 64)
    with pytest.raises(ValueError, match="entry per layer"):
        mass(queries, keys[:2], query_pos, heads, 2, 0.2, 56, 64)
    with pytest.raises(ValueError, match="block_p"):
        _kernel().launch_config(3, 3, 32, 64, 56, 1, block_n=16, block_p=48)


def test_query_that_sees_nothing_adds_nothing():
    """``query_pos = -1`` (an empty row): the kernel adds 0 (the reference's softmax over nothing is NaN)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 20, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(2, 2, 2, 16, generator=gen).to(DEVICE)
    query_pos = torch.tensor([[-1, 6], [-1, -1]], device=DEVICE)
    got = _kernel().attention_mass_triton(q, keys, query_pos, (0, 1), 2, 0.25, 10, 10)
    assert got[1].abs().max() == 0
    torch.testing.assert_close(got[0].sum().cpu(), torch.tensor(2.0))  # one query x two heads


def test_never_written_buffer_cells_are_ignored(monkeypatch):
    """Every scratch buffer starts as NaN: what pass 1 skips (keys nobody sees) must never reach the output."""
    inputs = _make_inputs(Case(group=2, n_q=4, head_dim=16, two_groups=True), torch.float16)
    want = _kernel().attention_mass_triton(*_with_span(inputs))
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)
    small = _kernel().launch_config(
        3, 6, 16, int(inputs[2].max()) + 1, inputs[-1], 1, block_n=16, num_splits=2, tile=32
    )
    got = _kernel().attention_mass_triton(*_with_span(inputs), config=small)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@needs_cuda
def test_bf16_on_cuda():
    case = Case(group=7, n_q=4, head_dim=64, two_groups=False, layout="hf")
    inputs = _make_inputs(case, torch.bfloat16)
    got = attention_mass(*_with_span(inputs), backend="triton")
    _assert_close_to_oracle(got, inputs, torch.bfloat16, "bf16")


@needs_cuda
def test_cuda_graph_replay():
    """Captured once, replayed on new key and position values: the output follows the inputs."""
    case = Case(group=8, n_q=1, head_dim=128, two_groups=False, layout="hf")
    q, keys, query_pos, heads, group, scale, num_positions = _make_inputs(case, torch.bfloat16)
    span = keys.shape[1]
    run = lambda: attention_mass(
        q,
        keys,
        query_pos,
        heads,
        group,
        scale,
        num_positions,
        span,  # noqa: E731
        backend="triton",
    )
    graph, out = capture_graph(run)
    gen = torch.Generator().manual_seed(9)
    keys.copy_(torch.randn(keys.shape, generator=gen).to(keys.device, keys.dtype))
    query_pos.copy_(torch.tensor([[60], [3], [89]], device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    want = attention_mass(q, keys, query_pos, heads, group, scale, num_positions, span)
    exact = explicit_attention_mass(q, keys, query_pos, heads, group, scale, num_positions)
    baseline = (want.double().cpu() - exact).abs().max().item()
    err = (out.double().cpu() - exact).abs().max().item()
    assert err <= 2 * baseline + 1e-5, f"graph replay: {err:.3g} > 2 x {baseline:.3g} + 1e-5"


@needs_cuda
def test_draft_layers_cuda_graph_replay():
    """The three draft layers in one pass 2, captured once and replayed twice on new keys: the split
    tickets are back at zero after every replay, so each replay equals the reference."""
    gen = torch.Generator().manual_seed(11)
    gamma, heads = 4, ((0, 1, 2, 3, 4, 5, 6),) * 3
    seqlens = torch.tensor([3000, 4093, 17], device=DEVICE)
    keys = [torch.randn(3, 4200, 2, 64, generator=gen).to(DEVICE, torch.bfloat16) for _ in heads]
    queries = [torch.randn(3, gamma, 7, 64, generator=gen).to(DEVICE, torch.bfloat16) for _ in heads]
    run = lambda: draft_lookahead_scores(
        queries,
        keys,
        seqlens,
        heads,
        7,
        0.125,
        4093,  # noqa: E731
        backend="triton",
    )
    graph, out = capture_graph(run)
    for _ in range(2):
        for k in keys:
            k.copy_(torch.randn(k.shape, generator=gen).to(DEVICE, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want = draft_lookahead_scores(
            [q.float() for q in queries], [k.float() for k in keys], seqlens, heads, 7, 0.125, 4093
        )
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-4)


def test_memory_accesses_are_wide_on_sm90():
    """How the kernels touch memory at the 72B / 0.5B scoring shapes, compiled for sm_90 without a GPU
    (``kernel_ptx.py``, in a subprocess without the interpreter, launches sized for 132 SMs): pass 1
    streams the keys through 16-byte ``cp.async`` copies, stores the scores 16 bytes at a time and
    merges its splits' log-sum-exps through an acq_rel ticket; pass 2 (one launch for the three draft
    layers) reads the scores back through 16-byte ``cp.async`` copies, software-pipelined. No value
    test sees this: with the keys' batch stride left unspecialised, Triton could not prove a key row
    aligned, loaded the keys 2 bytes at a time without pipelining, and pass 1 ran at ~1.1 TB/s on an
    H200 while every test above passed."""
    launches = sm90_ptx_report("kernel_ptx.py")
    assert [launch["kernel"] for launch in launches] == ["_score_pass1_kernel", "_score_pass2_kernel"] * 2
    for launch in launches:
        ops, label = launch["ops"], f"{launch['kernel']} {launch['constexprs']}: {launch['ops']}"
        streamed = [op for op in ops if "evict_first" in op]  # pass 1's keys unpipelined, pass 2's scores
        assert ops.get("cp.async.cg.shared.global", 0) > 0, f"not loaded through 16-byte cp.async: {label}"
        assert not streamed, f"streamed by plain loads: {label}"
        if launch["kernel"] == "_score_pass1_kernel":
            stores = [op for op in ops if op.startswith("st.global") and "evict_last" in op]
            assert stores and all(".v4." in op for op in stores), f"scores not stored 16 bytes at a time: {label}"
            assert launch["constexprs"]["BLOCK_S"] > 1, "the H200 launch splits the keys"
            assert ops.get("atom.global.gpu.acq_rel.add.u32") == 1 and ops.get("ld.global.cg.b32"), (
                f"no ticket merge of the splits: {label}"
            )
        else:
            assert not [op for op in ops if op.startswith("ld.global.") and ".b16" in op], f"narrow loads: {label}"


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton")
@pytest.mark.parametrize(
    "rows, head_dim, batch, span",
    [(4, 128, 16, 33000), (4, 64, 4, 8300), (48, 64, 16, 33000), (140, 128, 16, 33000), (1, 64, 1, 100)],
)
def test_pass_2_reads_stay_inside_each_row(rows, head_dim, batch, span):
    """Pass 2 loads whole steps of ``block_p`` positions, masked by row only: up to ``span`` rounded up to a step. With
    few rows (a target's history scores) a step is 16 tiles, past a row sized to whole tiles by up to 15 of them."""
    kernel = _kernel()
    config = kernel.launch_config(batch, batch, head_dim, span, span, 132, rows=rows)
    furthest = -(-span // config.block_p) * config.block_p
    assert kernel.buffer_tiles(span, config) * config.block_n >= furthest
