"""Programmatic dependent launch (``dustin_hf.kernels.triton_launch``): every kernel waits before it touches
memory (compiled for sm_90 on CPU), and a decode layer's chain of kernels replayed as dependents in a CUDA graph
computes exactly what serialized launches compute (GPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import capture_graph, on_launch, package_kernels, sm90_ptx_report

from dustin_hf.kernels import triton_launch

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_every_kernel_waits_for_its_producers_before_touching_memory():
    """``pdl_report.py`` (a subprocess without the interpreter) launches each of the package's 12 Triton kernels on a
    simulated H200, where the package's own check launches them as programmatic dependents, and compiles it for
    sm_90: the launch sets Triton's ``launch_pdl``
    and the ``PDL`` constexpr together, and the PTX executes ``griddepcontrol.wait`` once, before its first
    global load, store or atomic (one the compiler hoisted above the wait would read a producer's output early),
    then ``griddepcontrol.launch_dependents``."""
    report = sm90_ptx_report("pdl_report.py")
    assert {r["kernel"] for r in report} == {
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_silu_mul_kernel",
        "_write_kv_kernel",
        "_skinny_gemm_kernel",
        "_score_pass1_kernel",
        "_score_pass2_kernel",
        "_local_pools_kernel",
        "_merge_pools_kernel",
        "_verify_fwd_kernel",
        "_merge_splits_kernel",
        "_argmax_kernel",
    }, report
    assert len(report) == 22, report
    for r in report:
        assert r["pdl"] is True and r["launch_pdl"] is True, r
        assert r["waits"] == 1 and r["launches"] == 1, r
        assert r["first_wait"] < r["first_launch"] < r["first_memory"], r


def test_dependent_launch_only_where_the_gpu_and_triton_can(monkeypatch):
    """Dependent launches need Triton 3.4+ (``griddepcontrol``), a CUDA tensor on sm_90 or later and compiled
    kernels (not the interpreter); everywhere else every kernel launches serialized."""
    import triton

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    assert triton_launch._TRITON_HAS_GDC == ((major, minor) >= (3, 4))
    assert not triton_launch.dependent_launch(torch.zeros(1))
    if torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        gpu = torch.zeros(1, device="cuda")
        assert triton_launch.dependent_launch(gpu) == (HAS_SM90 and triton_launch._TRITON_HAS_GDC)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not triton_launch.dependent_launch(gpu)


def _decode_layers(x, weights, caches, slots, seqlens, cos, sin, indices):
    """Four 0.5B-draft-shaped decoder layers at 16 rows, each output the next kernel's input: add + RMSNorm,
    q/k/v GEMM (bias), rotary + K/V write, sparse attention over the cache, o GEMM, add + RMSNorm, gate/up +
    SiLU-mul, split-K down GEMM."""
    from dustin_hf.kernels.triton_fused import add_rms_norm_triton, rotary_write_kv_triton
    from dustin_hf.kernels.triton_gemm import gated_linear, skinny_linear
    from dustin_hf.kernels.triton_verify import verify_attention_triton

    batch, hidden = x.shape
    h, residual = x, torch.zeros_like(x)
    for (norm1, qkv_w, qkv_b, o_w, norm2, gate_up_w, down_w), (k_cache, v_cache) in zip(weights, caches):
        normed, residual = add_rms_norm_triton(h, residual, norm1, 1e-6)
        qkv = skinny_linear(normed, qkv_w, qkv_b)
        q, k, v = qkv.view(batch, 1, -1, 64).split([14, 2, 2], dim=2)
        q = rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, 0)
        attn = verify_attention_triton(
            q,
            k_cache,
            v_cache,
            seqlens,
            softmax_scale=64**-0.5,
            indices=indices,
            num_indices=torch.full_like(seqlens, indices.shape[1]),
        )
        o = skinny_linear(attn.reshape(batch, hidden), o_w)
        normed, residual = add_rms_norm_triton(o, residual, norm2, 1e-6)
        h = skinny_linear(gated_linear(normed, gate_up_w), down_w)
    return h


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90+ CUDA device")
def test_dependent_launches_in_a_graph_compute_what_serialized_launches_compute(monkeypatch):
    """A CUDA graph of four decoder layers (32 kernels, each reading the one before it) captured with programmatic
    dependent launch, replayed on 8 fresh inputs, equals the same layers launched serialized (the host waits for
    the GPU before every launch), bit for bit. The graph's buffers hold the previous replay's values, so a kernel
    reading its input before its producer ended would read the last input's layer and differ."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, hidden, context = 16, 896, 2048

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    weights = [
        (
            randn(hidden, scale=0.1) + 1,
            randn(1152, hidden, scale=0.03),
            randn(1152, scale=0.1),
            randn(hidden, hidden, scale=0.03),
            randn(hidden, scale=0.1) + 1,
            randn(2 * 4864, hidden, scale=0.03),
            randn(hidden, 4864, scale=0.02),
        )
        for _ in range(4)
    ]
    caches = [(randn(batch, context + 1, 2, 64), randn(batch, context + 1, 2, 64)) for _ in range(4)]
    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    slots = seqlens.to(torch.int64).view(batch, 1).contiguous()
    indices = torch.sort(torch.randperm(context, generator=gen, device="cuda")[:512]).values.int()
    indices = indices.expand(batch, -1).contiguous()
    angles = torch.rand(batch, 1, 32, generator=gen, device="cuda") * 6.28
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    inputs = [randn(batch, hidden) for _ in range(8)]
    x = inputs[0].clone()

    def layers():
        return _decode_layers(x, weights, caches, slots, seqlens, cos, sin, indices)

    assert triton_launch.dependent_launch(x)
    graph, out = capture_graph(layers)
    replayed = []
    for new in inputs:
        x.copy_(new)
        graph.replay()
        replayed.append(out.clone())
    from dustin_hf.kernels import triton_fused, triton_gemm, triton_verify

    serialized = on_launch(
        package_kernels(triton_fused, triton_gemm, triton_verify),  # each waits for the last
        lambda *launch: torch.cuda.synchronize(),
    )
    with serialized:
        for new, got in zip(inputs, replayed):
            x.copy_(new)
            expected = layers()
            assert torch.isfinite(expected).all()
            assert torch.equal(got, expected)
