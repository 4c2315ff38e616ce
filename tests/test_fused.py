"""Fused RMSNorm and rotary kernels against transformers' own functions; fused_ops() patches and restores.

Oracles are transformers' modules and functions themselves: ``apply_rotary_pos_emb`` must be matched
bit for bit (``torch.equal``) in every dtype. RMSNorm reduces its sum of squares in another order than
PyTorch, so its fp32 ``rsqrt(var + eps)`` may differ in the last bits: fp32 is compared with a tight
tolerance, and in 16 bits the normalised value ``y`` may round one ulp the other way, which the weight
multiply can turn into two ulps of a 16-bit output. On CPU no element differs in these cases; on an
H200, 2 to 5 elements per million did (bf16, hidden 896 to 20000), by at most 2 ulps.

Triton runs on CUDA when there is one, otherwise in the Triton interpreter on CPU
(``TRITON_INTERPRET=1``, set below before triton is imported) with small shapes.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import inspect
import math
import os
import sys
import types
import warnings

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import transformers  # noqa: E402
from accelerate.hooks import ModelHook, add_hook_to_module  # noqa: E402
from conftest import capture_graph, on_launch, package_kernels  # noqa: E402
from packaging.version import Version  # noqa: E402
from tiny_models import random_prompt, tiny_model  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402

from dustin_hf.compat import VERIFIED_RANGE  # noqa: E402
from dustin_hf.runtime import _transformers_reference, fused, ops, recognise, rotary  # noqa: E402
from dustin_hf.runtime.fused import FusedTuning, add_rms_norm, apply_rotary, fused_ops, fused_ops_available, rms_norm  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_RUNS = HAS_TRITON and (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = "cuda" if HAS_CUDA else "cpu"
HF_ROTARY = modeling_qwen2.apply_rotary_pos_emb  # the oracle, taken before any test patches the module
VERIFIED = Version(VERIFIED_RANGE[0]) <= Version(transformers.__version__) <= Version(VERIFIED_RANGE[1])

pytestmark = [
    pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (CUDA, or TRITON_INTERPRET=1 on CPU)"),
    pytest.mark.usefixtures("one_thread"),
]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _rotary_inputs(batch=2, q_heads=4, k_heads=2, seq=5, head_dim=64, dtype=torch.bfloat16, seed=0, device=DEVICE):
    """q as transformers makes it, ``(B, T, H, D)`` transposed to ``(B, H, T, D)`` (not contiguous); cos/sin
    as its rotary module makes them: fp32 angles, cast to the hidden states' dtype."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(batch, seq, k_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.randint(0, 4096, (batch, seq), generator=gen).float()
    freqs = positions[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def expect_fused(model) -> bool:
    """Whether every fused path listed for ``model``'s classes must apply: on each transformers version dustin_hf
    verified (``test_verified_transformers_code_is_recognised``), and on a newer one where the code is still the one
    checked. Elsewhere the tests check the outputs and the warning, not what was fused."""
    return VERIFIED or not recognise._unrecognised(list(model.modules()))


def _hub_wrapped(func):
    """What the ``kernels`` package's ``@use_kernel_forward_from_hub`` makes of a function (its ``Func`` module, as
    in kernels 0.19): an ``nn.Module`` instance, tagged with a layer name, whose forward calls ``func``."""

    class Func(torch.nn.Module):
        kernel_layer_name = "rotary_pos_emb"

        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between two tensors of one float dtype (bit patterns mapped to ordered ints)."""
    bits, mask = (torch.int32, 0x7FFFFFFF) if a.dtype == torch.float32 else (torch.int16, 0x7FFF)

    def ordered(t):
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & mask), i)

    return (ordered(a) - ordered(b)).abs()


# ----------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_is_bit_exact(dtype, head_dim):
    q, k, cos, sin = _rotary_inputs(head_dim=head_dim, dtype=dtype, seq=5)
    q_ref, k_ref = HF_ROTARY(q, k, cos, sin)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    assert q_out.dtype == q_ref.dtype and q_out.shape == q_ref.shape
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("case", ["unsqueeze_dim_2", "batch_1_cos", "fp32_cos", "head_dim_80", "one_token"])
def test_rotary_other_layouts_and_dtypes(case):
    q, k, cos, sin = _rotary_inputs(head_dim=80 if case == "head_dim_80" else 64, seq=1 if case == "one_token" else 3)
    dim = 1
    if case == "unsqueeze_dim_2":  # (B, T, H, D)
        q, k, dim = q.transpose(1, 2), k.transpose(1, 2), 2
    elif case == "batch_1_cos":
        cos, sin = cos[:1], sin[:1]
    elif case == "fp32_cos":  # bf16 q times fp32 cos promotes to fp32, as in PyTorch
        cos, sin = cos.float(), sin.float()
    expected = HF_ROTARY(q, k, cos, sin, unsqueeze_dim=dim)
    out = apply_rotary(q, k, cos, sin, unsqueeze_dim=dim)
    assert out[0].dtype == expected[0].dtype
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


@pytest.mark.parametrize("case", ["bf16", "fp32", "head_dim_80_batch_1_cos", "fp32_cos"])
def test_rotary_write_kv_is_the_rotary_then_the_cache_write(case):
    """One launch for a decode step's rotary and K/V write: q_embed, and the caches at the rows' slots, equal
    transformers' apply_rotary_pos_emb and the index write bit for bit; every other slot is untouched."""
    from dustin_hf.kernels.triton_fused import rotary_write_kv_triton

    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q, k, cos, sin = _rotary_inputs(head_dim=80 if "80" in case else 64, dtype=dtype, seq=3, q_heads=6, k_heads=2)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, T, H, D): views of one projection, as the pipeline has them
    v = torch.randn_like(k)
    if "batch_1_cos" in case:
        cos, sin = cos[:1], sin[:1]
    if case == "fp32_cos":
        cos, sin = cos.float(), sin.float()
    q_ref, k_ref = HF_ROTARY(q, k, cos, sin, unsqueeze_dim=2)
    batch, seq, heads, head_dim = k.shape
    caches = [torch.randn(batch + 2, 16, heads, head_dim, dtype=k_ref.dtype, device=DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    slots = torch.tensor([[4, 5, 6], [9, 10, 11]], device=DEVICE)
    for b in range(batch):  # rows 1 and 2 of the cache
        expected[0][1 + b, slots[b]] = k_ref[b]
        expected[1][1 + b, slots[b]] = v[b].to(k_ref.dtype)
    q_out = rotary_write_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots, row0=1)
    assert q_out.dtype == q_ref.dtype and torch.equal(q_out, q_ref)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_rotary_rotates_each_pair_by_its_angle():
    """An oracle independent of transformers: dims ``(i, i + D/2)`` form a pair rotated by the angle of ``i``,
    ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``. Swapped halves or a wrong sign fail here."""
    head_dim, angle = 8, 0.5
    q = torch.zeros(1, 1, 1, head_dim, device=DEVICE)
    q[..., 1], q[..., 1 + head_dim // 2] = 1.0, 2.0  # pair 1: (x1, x2) = (1, 2)
    theta = torch.zeros(1, 1, head_dim, device=DEVICE)
    theta[..., 1] = theta[..., 1 + head_dim // 2] = angle
    q_out, k_out = apply_rotary(q, q.clone(), theta.cos(), theta.sin())
    c, s = math.cos(angle), math.sin(angle)
    expected = torch.zeros(head_dim)
    expected[1], expected[1 + head_dim // 2] = 1 * c - 2 * s, 2 * c + 1 * s
    torch.testing.assert_close(q_out.flatten().cpu(), expected)
    torch.testing.assert_close(k_out, q_out)


def test_rotary_rejects_bad_shapes():
    q, k, cos, sin = _rotary_inputs()
    with pytest.raises(ValueError, match="even"):
        apply_rotary(q[..., :63], k[..., :63], cos[..., :63], sin[..., :63])
    with pytest.raises(ValueError, match="cos must be"):
        apply_rotary(q, k, cos[:, :2], sin)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply_rotary(q, k, cos, sin, unsqueeze_dim=0)


# ----------------------------------------------------------------------------- RMSNorm


def _norm(hidden, weight_dtype, seed=0, eps=1e-6):
    torch.manual_seed(seed)
    norm = Qwen2RMSNorm(hidden, eps=eps).to(DEVICE)
    norm.weight.data = (torch.randn(hidden, device=DEVICE) * 0.3 + 1).to(weight_dtype)
    return norm


@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 200), (2, 3, 4, 32)], ids=str)
def test_rms_norm_fp32_matches_the_module(shape):
    norm = _norm(shape[-1], torch.float32)
    x = torch.randn(shape, device=DEVICE) * 3
    out = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, norm(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_16bit_within_one_ulp_of_y(x_dtype, weight_dtype):
    """The output takes PyTorch's promoted dtype (fp32 for a bf16 x and an fp32 weight). The rounded
    ``y = x * rsqrt(var + eps)`` may differ by one ulp: two ulps of a 16-bit ``weight * y``, or a relative
    ``2**-7`` (one bf16 ulp) of an fp32 one."""
    norm = _norm(384, weight_dtype)
    x = (torch.randn(16, 384, device=DEVICE) * 2).to(x_dtype)
    out, expected = rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)
    assert out.dtype == expected.dtype == torch.promote_types(x_dtype, weight_dtype)
    if out.dtype == x_dtype:
        assert int(_ulps(out, expected).max()) <= 2
    else:  # fp32 = fp32 weight * 16-bit y
        torch.testing.assert_close(out, expected, rtol=2.0**-7, atol=0)
    assert float((out != expected).float().mean()) < 0.01


def test_rms_norm_long_rows_loop_and_strided_input():
    """Rows longer than the tile run the two-pass loop; a non-contiguous x is read through its strides."""
    from dustin_hf.kernels.triton_fused import rms_norm_triton

    norm = _norm(200, torch.float32)
    x = (torch.randn(200, 6, device=DEVICE) * 3).t()  # (6, 200), last dim strided
    torch.testing.assert_close(rms_norm_triton(x, norm.weight, 1e-6, block=64), norm(x), rtol=2e-6, atol=1e-6)
    rows = torch.randn(6, 400, device=DEVICE)[:, :200]  # row stride 400, last dim contiguous
    torch.testing.assert_close(rms_norm(rows, norm.weight, 1e-6), norm(rows), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["weight-same", "weight-fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_add_rms_norm_is_the_add_then_the_norm(dtype, weight_dtype):
    """``(rms_norm(residual + x), residual + x)`` bit for bit: the sum rounded as PyTorch's add, the norm the
    same kernel code; in one tile, in the looped path, and on strided inputs."""
    from dustin_hf.kernels.triton_fused import add_rms_norm_triton, rms_norm_triton

    gen = torch.Generator().manual_seed(0)
    norm = _norm(200, weight_dtype or dtype)
    x = (torch.randn(3, 5, 200, generator=gen) * 3).to(DEVICE, dtype)
    residual = (torch.randn(3, 5, 200, generator=gen) * 30).to(DEVICE, dtype)  # sums that round
    for block in (None, 64):
        normed, total = add_rms_norm_triton(x, residual, norm.weight, norm.variance_epsilon, block=block)
        assert total.dtype == dtype and torch.equal(total, residual + x)
        assert normed.dtype == torch.promote_types(norm.weight.dtype, dtype)
        assert torch.equal(normed, rms_norm_triton(residual + x, norm.weight, norm.variance_epsilon, block=block))
    strided_x, strided_r = x[:, 1:4], residual.transpose(0, 1)[1:4].transpose(0, 1)  # (3, 3, 200), not contiguous
    normed, total = add_rms_norm(strided_x, strided_r, norm.weight, norm.variance_epsilon)
    assert torch.equal(total, strided_r + strided_x)
    assert torch.equal(normed, rms_norm(strided_r + strided_x, norm.weight, norm.variance_epsilon))


def test_add_rms_norm_rejects_mismatched_inputs():
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x, x.to(torch.bfloat16), torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x, x[:1], torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(x, x, torch.ones(31, device=DEVICE), 1e-6)


# ----------------------------------------------------------------------------- fused_ops


@pytest.mark.parametrize("family, norms_per_layer", [("qwen2", 2), ("llama", 2), ("qwen3", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_ops_matches_the_model_and_restores(family, norms_per_layer, dtype):
    model = tiny_model(family, layers=2, hidden=64, heads=4, kv_heads=2).to(DEVICE, dtype)
    modeling = sys.modules[type(model).__module__]
    original_rotary = modeling.apply_rotary_pos_emb
    prompt = random_prompt(9, batch=2).to(DEVICE)
    with torch.no_grad():
        expected = model(prompt).logits.float()
        with fused_ops(model) as done:
            if expect_fused(model):
                assert done.norms == norms_per_layer * 2 + 1
                assert done.rotary_modules == ((modeling.__name__,) if _rotary_fusable(model) else ())
                assert (done.mlps, done.qkv, done.layers) == (2, 2, 2)
                assert all(fused.fused_decoder_layer(layer) for layer in model.model.layers)
            assert modeling.apply_rotary_pos_emb is original_rotary  # no module global is replaced
            out = model(prompt).logits.float()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(out, expected, **tolerance)
    _assert_restored(model, modeling, original_rotary)


def test_fused_ops_calls_the_kernels():
    """Inside the context the model's norms and rotary run the fused kernels (launches counted), outside they do
    not."""
    from dustin_hf.kernels import triton_fused

    launched = collections.Counter()
    model = tiny_model("qwen2", layers=2, hidden=32).to(DEVICE)
    if not expect_fused(model):
        pytest.skip(f"transformers {transformers.__version__}'s Qwen2 code differs from the one checked")
    prompt = random_prompt(3).to(DEVICE)
    expected = {"_rms_norm_kernel": 5} | ({"_rotary_kernel": 2} if _rotary_fusable(model) else {})
    with on_launch(package_kernels(triton_fused), lambda name, args, kwargs: launched.update([name])):
        with torch.no_grad(), fused_ops(model):
            model(prompt)
        assert launched == expected
        with torch.no_grad():
            model(prompt)
        assert launched == expected


def test_fused_mlp_runs_gate_up_and_silu_mul_in_one_launch_for_few_rows():
    """A small [gate; up] weight (a draft's) at most 32 rows, or a large one (a big target's) at most 64, runs the
    MLP's gate/up GEMM and SiLU-mul as one gated_linear launch; more rows, or a weight between the two size
    limits (FusedTuning's), keep the GEMM and silu_mul. Outputs match the MLP's."""
    from dustin_hf.kernels import triton_fused, triton_gemm

    mlp = tiny_model("qwen2", layers=1, hidden=64).to(DEVICE).model.layers[0].mlp
    weight_bytes = 2 * mlp.gate_proj.weight.numel() * mlp.gate_proj.weight.element_size()
    rows = {n: torch.randn(1, n, 64, device=DEVICE) for n in (32, 33, 64, 65)}
    launched = []

    def record(name, args, kwargs):  # gated_linear's launch or silu_mul's (skinny_linear's are not counted)
        if name == "_silu_mul_kernel" or name == "_skinny_gemm_kernel" and kwargs["GATED"]:
            launched.append("gated" if name == "_skinny_gemm_kernel" else "silu_mul")

    def fused_calls(max_small: int, min_large: int) -> dict:
        tuning = FusedTuning(gated_max_bytes=max_small, gated_min_large_bytes=min_large)
        counts = {}
        with (
            torch.no_grad(),
            fused_ops(mlp, tuning=tuning),
            on_launch(package_kernels(triton_fused, triton_gemm), record),
        ):
            for n, x in rows.items():
                launched.clear()
                torch.testing.assert_close(mlp(x), expected[n], rtol=1e-5, atol=1e-5)
                assert len(launched) == 1, launched
                counts[n] = "gated" if launched == ["gated"] else "cuBLAS"
        return counts

    with torch.no_grad():
        expected = {n: mlp(x) for n, x in rows.items()}
    assert fused_calls(weight_bytes, 2**40) == {32: "gated", 33: "cuBLAS", 64: "cuBLAS", 65: "cuBLAS"}  # small
    assert fused_calls(0, weight_bytes) == {32: "gated", 33: "gated", 64: "gated", 65: "cuBLAS"}  # large
    assert fused_calls(weight_bytes - 1, weight_bytes + 1) == dict.fromkeys(rows, "cuBLAS")  # between


# what else a switch turns off: the fused layers need the fused norms
_DEPENDENTS = {"norms": ("layers",)}


@pytest.mark.parametrize("switch", FusedTuning.switches())
def test_each_fused_path_turns_off_on_its_own(switch):
    """A switch of FusedTuning leaves its path (and the paths that need it) to transformers' code, the rest fused."""
    model = tiny_model("qwen2", layers=2, hidden=64, heads=4, kv_heads=2).to(DEVICE)
    if not expect_fused(model):
        pytest.skip(f"transformers {transformers.__version__}'s Qwen2 code differs from the one checked")
    with fused_ops(model) as every:
        pass
    with fused_ops(model, tuning=FusedTuning(**{switch: False})) as done:
        pass
    field = {"rotary": "rotary_modules"}.get(switch, switch)
    off = {field, *_DEPENDENTS.get(switch, ())}
    for name, value in vars(every).items():
        assert getattr(done, name) == (type(value)() if name in off else value), name
    assert every.norms and every.layers


def test_fused_tuning_names_a_bad_value():
    with pytest.raises(ValueError, match="FusedTuning.skinny_rows must be an int >= 0"):
        FusedTuning(skinny_rows=-1)


def test_fused_ops_restores_after_an_exception_and_nests():
    model = tiny_model("llama", layers=2, hidden=32).to(DEVICE)
    if not expect_fused(model):
        pytest.skip(f"transformers {transformers.__version__}'s Llama code differs from the one checked")
    original_rotary = modeling_llama.apply_rotary_pos_emb
    with pytest.raises(RuntimeError, match="boom"):
        with fused_ops(model):
            raise RuntimeError("boom")
    _assert_restored(model, modeling_llama, original_rotary)
    with fused_ops(model, model) as outer:  # a model given twice is patched once
        with fused_ops(model) as inner:
            assert (inner.norms, inner.rotary_modules, inner.layers) == (0, (), 0)
        assert outer.norms == 5 and outer.rotary_modules == inner.rotary_modules + outer.rotary_modules
        wrappers = [w for w in map(rotary.rotary_wrapper, model.modules()) if w is not None]
        assert all("forward" in vars(w) for w in wrappers)  # the inner exit kept the outer's
        assert outer.layers == 2 and fused.fused_decoder_layer(model.model.layers[0])  # the inner exit kept it
        assert model.model.norm.forward.func is ops._fused_rms_norm_forward
    _assert_restored(model, modeling_llama, original_rotary)
    with fused_ops(model) as again:
        assert again.norms == 5
    _assert_restored(model, modeling_llama, original_rotary)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_silu_mul_matches_pytorch(dtype):
    gen = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(3, 5, 2 * 1100, generator=gen)).to(DEVICE, dtype)  # two column blocks, a ragged one
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = fused.silu_mul(gate_up)
    assert out.shape == expected.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:  # each rounding as PyTorch's: equal but where the exponential's last fp32 bit decides one
        assert (out != expected).float().mean() < 1e-3
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_fused_projections_share_storage_inside_and_own_it_after():
    """Inside the context q/k/v (and gate/up) are views of one tensor, no second copy; outside, their own."""
    model = tiny_model("qwen2", layers=2, hidden=64, heads=4, kv_heads=2).to(DEVICE)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with fused_ops(model):
        q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
        x = torch.randn(2, 3, 64, device=DEVICE)
        other = torch.randn(2, 3, 64, device=DEVICE)
        with torch.no_grad():  # q on one input, then k and v on another: each computes its own
            attention.q_proj(x)
            torch.testing.assert_close(attention.k_proj(other), other @ k.T + attention.k_proj.bias)
            torch.testing.assert_close(attention.v_proj(other), other @ v.T + attention.v_proj.bias)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    _assert_restored(model, sys.modules[type(model).__module__], HF_ROTARY)


def _rotary_fusable(model) -> bool:
    """Whether ``model``'s attentions have their own rotary wrappers (``kernels`` from 0.19) or a plain forward (no
    ``kernels``: transformers 5.17 without it), which :mod:`dustin_hf.runtime.rotary` fuses; 5.24 without ``kernels``
    wraps the forward in ``deprecate_kwarg`` and has neither."""
    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    return any(rotary.rotary_wrapper(m) is not None or not hasattr(type(m).forward, "__wrapped__") for m in attentions)


def _assert_restored(model, modeling, original_rotary):
    assert modeling.apply_rotary_pos_emb is original_rotary
    assert not any("forward" in vars(w) for w in map(rotary.rotary_wrapper, model.modules()) if w is not None)
    assert not any(fused.fused_decoder_layer(m) for m in model.modules())
    for module in model.modules():
        assert "forward" not in module.__dict__, type(module).__name__
    # every parameter has its own storage again (a save would treat shared storage as tied weights)
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(storages)) == len(storages)


def test_accelerate_hooks_keep_wrapping_the_fused_forward():
    """Under a device hook (device_map) the hook's ``_old_forward`` is replaced, so the hook still runs."""
    norm = _norm(32, torch.float32)
    seen = []

    class Recorder(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(True)
            return args, kwargs

    add_hook_to_module(norm, Recorder())
    hooked_forward, old_forward = norm.forward, norm._old_forward
    x = torch.randn(3, 32, device=DEVICE)
    with fused_ops(norm) as done:
        assert done.norms == 1 and norm.forward is hooked_forward
        assert norm._old_forward.func is ops._fused_rms_norm_forward
        torch.testing.assert_close(norm(x), old_forward(x), rtol=2e-6, atol=1e-6)
    assert seen and norm.forward is hooked_forward and norm._old_forward is old_forward


def test_only_standard_norms_and_rotaries_are_replaced(monkeypatch):
    """Gemma's ``(1 + weight)`` norm is not listed; a listed name with another forward, or an attention whose rotary
    wrapper calls another function than the standard one (e.g. interleaved), is left alone (the listed name with
    its warning, ``test_unrecognised_code_keeps_transformers_code_with_one_warning``)."""
    monkeypatch.setattr(recognise, "_WARNED", set())

    class Qwen2RMSNorm(torch.nn.Module):  # the allowlisted name, another function
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x):
            return x * (1 + self.weight)

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    fake = types.ModuleType("fake_modeling")
    fake.rotate_half, fake.apply_rotary_pos_emb = modeling_qwen2.rotate_half, _hub_wrapped(interleaved)
    monkeypatch.setitem(sys.modules, "fake_modeling", fake)
    attention = type("FakeAttention", (torch.nn.Module,), {"__module__": "fake_modeling"})()
    attention._kernel_funcs = {"rotary_pos_emb": _hub_wrapped(interleaved)}
    model = torch.nn.Sequential(GemmaRMSNorm(8), Qwen2RMSNorm(), attention).to(DEVICE)
    with pytest.warns(UserWarning, match="Qwen2RMSNorm.forward in transformers"), fused_ops(model) as done:
        assert (done.norms, done.rotary_modules) == (0, ())
    standard = recognise._wrapped_function(HF_ROTARY)  # recognised in any module
    fake.apply_rotary_pos_emb = _hub_wrapped(standard)
    attention._kernel_funcs = {"rotary_pos_emb": _hub_wrapped(standard)}
    with fused_ops(model) as done:
        assert done.rotary_modules == ("fake_modeling",)


def test_rotary_goes_through_each_attentions_own_wrapper(monkeypatch):
    """With the ``kernels`` package from 0.19 (a dependency of transformers from 5.25) each attention holds its own
    wrapper module of ``apply_rotary_pos_emb``, whose forward ``kernelize()`` replaces: the context sets it to the
    Triton kernel and removes it on exit, and the module global stays. A wrapper with a kernel of the user's is left
    alone, and so is the global where it is the attention's only wrapper (``kernels`` before 0.19: shared by every
    model, replacing it would change them all; this attention's forward is not one to copy either)."""
    standard = recognise._wrapped_function(HF_ROTARY)
    assert recognise._same_code(standard, _transformers_reference.apply_rotary_pos_emb)
    fake = types.ModuleType("fake_modeling")
    fake.rotate_half, fake.apply_rotary_pos_emb = modeling_qwen2.rotate_half, _hub_wrapped(standard)
    shared = fake.apply_rotary_pos_emb
    monkeypatch.setitem(sys.modules, "fake_modeling", fake)
    attention = type("FakeAttention", (torch.nn.Module,), {"__module__": "fake_modeling"})()
    attention._kernel_funcs = {"rotary_pos_emb": (own := _hub_wrapped(standard))}
    q, k, cos, sin = _rotary_inputs(dtype=torch.float32)
    expected = standard(q, k, cos, sin)
    with fused_ops(attention) as done:
        assert done.rotary_modules == ("fake_modeling",) and "forward" in vars(own)
        assert all(torch.equal(a, b) for a, b in zip(own(q, k, cos, sin), expected))
        assert fake.apply_rotary_pos_emb is shared and "forward" not in vars(shared)
    assert "forward" not in vars(own)

    own.forward = kernel = types.MethodType(lambda self, *args: args[:2], own)  # what kernelize() does
    with fused_ops(attention) as done:
        assert done.rotary_modules == () and own.forward == kernel
    for wrappers in ({"rotary_pos_emb": shared}, {}):
        attention._kernel_funcs = wrappers
        with fused_ops(attention) as done:
            assert done.rotary_modules == () and "forward" not in vars(shared)


def test_rotary_without_a_wrapper_runs_in_a_copy_of_the_attentions_forward(monkeypatch):
    """Without the attentions' own wrappers (transformers 5.17 without ``kernels``) an attention's forward becomes, for
    that instance, a copy of its class's whose ``apply_rotary_pos_emb`` is the kernel: one launch, transformers'
    outputs bit for bit, the module global and every other instance untouched. A forward that does not call the
    name, or a wrapped one (5.24's ``deprecate_kwarg``), is left alone."""
    from dustin_hf.kernels import triton_fused

    standard = recognise._wrapped_function(HF_ROTARY)
    fake = types.ModuleType("fake_modeling")
    fake.torch, fake.rotate_half, fake.apply_rotary_pos_emb = torch, modeling_qwen2.rotate_half, standard
    exec(  # classes defined in the fake modeling module, as transformers defines them in its own
        "class FakeAttention(torch.nn.Module):\n"
        "    def forward(self, q, k, cos, sin):\n"
        "        return apply_rotary_pos_emb(q, k, cos, sin)\n\n"
        "class FakeMLP(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x\n",
        vars(fake),
    )
    monkeypatch.setitem(sys.modules, "fake_modeling", fake)
    attention, other, mlp = fake.FakeAttention(), fake.FakeAttention(), fake.FakeMLP()
    q, k, cos, sin = _rotary_inputs(dtype=torch.float32)
    expected = standard(q, k, cos, sin)
    launched = collections.Counter()
    with on_launch(package_kernels(triton_fused), lambda name, args, kwargs: launched.update([name])):
        with fused_ops(torch.nn.Sequential(attention, mlp)) as done:
            out = attention(q, k, cos, sin)
            assert done.rotary_modules == ("fake_modeling",) and "forward" not in vars(mlp)
            assert fake.apply_rotary_pos_emb is standard and "forward" not in vars(other)
            assert attention.forward.__func__.__code__ is fake.FakeAttention.forward.__code__
        assert launched == {"_rotary_kernel": 1}
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    assert "forward" not in vars(attention)
    original = fake.FakeAttention.forward
    monkeypatch.setattr(fake.FakeAttention, "forward", functools.wraps(original)(lambda self, *a: original(self, *a)))
    with fused_ops(attention) as done:
        assert done.rotary_modules == () and "forward" not in vars(attention)


def test_a_model_without_rotary_wrappers_fuses_its_rotary_in_copies_of_the_attention_forwards(monkeypatch):
    """transformers 5.17 without ``kernels``, simulated (the attention class's plain forward, no wrappers): every
    attention runs a copy of that forward with the fused rotary, and the logits are the model's."""
    model = tiny_model("qwen2", layers=2, hidden=64, heads=4, kv_heads=2).to(DEVICE)
    if not expect_fused(model):
        pytest.skip(f"transformers {transformers.__version__}'s Qwen2 code differs from the one checked")
    Attention = modeling_qwen2.Qwen2Attention
    monkeypatch.setattr(Attention, "forward", inspect.unwrap(Attention.forward))
    for layer in model.model.layers:
        vars(layer.self_attn).pop("_kernel_funcs", None)
    prompt = random_prompt(9, batch=2).to(DEVICE)
    with torch.no_grad():
        expected = model(prompt).logits
        with fused_ops(model) as done:
            assert done.rotary_modules == (modeling_qwen2.__name__,)
            out = model(prompt).logits
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.skipif(
    not VERIFIED,
    reason=f"transformers {transformers.__version__} is outside the verified range "
    f"{VERIFIED_RANGE}: its code may differ, and then runs unfused with a warning",
)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_verified_transformers_code_is_recognised(family):
    """On every transformers version dustin_hf declares verified, each fused path listed for the family's classes
    recognises their code (nothing warned about, the rotary function found behind any wrapper)."""
    model = tiny_model(family, layers=1)
    assert recognise._unrecognised(list(model.modules())) == []
    assert recognise._standard_rotary(sys.modules[type(model).__module__]) is not None


def test_unrecognised_code_keeps_transformers_code_with_one_warning(monkeypatch):
    """A listed class whose forward compiles to other code, and a listed attention's modeling module whose rotary
    is another function (what a newer transformers may bring): both keep transformers' own code, the outputs are
    unchanged, and one warning names them; a second context warns no more."""
    monkeypatch.setattr(recognise, "_WARNED", set())

    class Qwen2RMSNorm(torch.nn.Module):  # the listed name, another (equivalent) forward
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return q * cos[:, None] + modeling_qwen2.rotate_half(q) * sin[:, None], k

    fake = types.ModuleType("fake_modeling")
    fake.rotate_half, fake.apply_rotary_pos_emb = modeling_qwen2.rotate_half, apply_rotary_pos_emb
    monkeypatch.setitem(sys.modules, "fake_modeling", fake)
    LlamaAttention = type("LlamaAttention", (torch.nn.Module,), {"__module__": "fake_modeling"})
    model = torch.nn.Sequential(Qwen2RMSNorm(), LlamaAttention()).to(DEVICE)
    x = torch.randn(2, 8, device=DEVICE)
    expected = model[0](x)
    with pytest.warns(UserWarning, match="do not apply to .*Qwen2RMSNorm.forward, fake_modeling.apply_rotary_pos_emb"):
        with fused_ops(model) as done:
            assert (done.norms, done.rotary_modules) == (0, ()) and fake.apply_rotary_pos_emb is apply_rotary_pos_emb
            assert torch.equal(model[0](x), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fused_ops(model) as done:
            assert (done.norms, done.rotary_modules) == (0, ())


def test_only_plain_standard_layers_are_registered():
    """A decoder layer is run submodule by submodule only if calling it would run nothing else (a torch hook,
    a replaced forward, an offloading accelerate hook) and its forward is the standard block."""
    from accelerate.hooks import AlignDevicesHook

    model = tiny_model("llama", layers=5).to(DEVICE)
    layers = model.model.layers
    layers[0].register_forward_pre_hook(lambda *args: None)
    layers[1].forward = layers[1].forward  # an instance attribute: whatever it is, not the class's forward
    add_hook_to_module(layers[2], AlignDevicesHook(offload=True))
    add_hook_to_module(layers[3], AlignDevicesHook(execution_device=DEVICE))  # moves inputs only: fine
    with fused_ops(model) as done:
        assert [fused.fused_decoder_layer(layer) for layer in layers] == [False, False, False, True, True]
        assert done.layers == 2
    model = tiny_model("llama", layers=1).to(DEVICE)
    model.model.layers[0].forward = types.MethodType(lambda self, h, **kwargs: h, model.model.layers[0])
    with fused_ops(model) as done:
        assert done.layers == 0


@pytest.mark.skipif(HAS_CUDA, reason="CPU without the interpreter")
def test_cpu_models_need_the_interpreter(monkeypatch):
    model = tiny_model("qwen2", layers=1, hidden=32)
    assert not fused_ops_available(model)
    q, k, cos, sin = _rotary_inputs(dtype=torch.float32)
    with fused_ops(model):
        monkeypatch.delenv("TRITON_INTERPRET")
        # another CPU model of the family, outside the interpreter, falls back to transformers' function
        out = modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(out[0], HF_ROTARY(q, k, cos, sin)[0])
        with pytest.raises(ValueError, match="fused_ops_available"):
            with fused_ops(model):
                pass
        with pytest.raises(ValueError, match="CUDA tensors"):
            rms_norm(q, torch.ones(64), 1e-6)


# ----------------------------------------------------------------------------- GPU


@needs_cuda
@pytest.mark.gpu
def test_rms_norm_and_rotary_on_gpu_at_qwen_sizes():
    """Qwen2.5-7B (hidden 3584, 28/4 heads of 128) and 0.5B (896, 14/2 of 64) at batch 16, 5 positions."""
    for hidden, q_heads, k_heads, head_dim in ((3584, 28, 4, 128), (896, 14, 2, 64)):
        q, k, cos, sin = _rotary_inputs(16, q_heads, k_heads, 5, head_dim, torch.bfloat16)
        q_ref, k_ref = HF_ROTARY(q, k, cos, sin)
        q_out, k_out = apply_rotary(q, k, cos, sin)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
        for weight_dtype in (torch.bfloat16, torch.float32):
            norm = _norm(hidden, weight_dtype)
            x = torch.randn(16 * 5 * 8, hidden, device="cuda").to(torch.bfloat16) * 2
            out, expected = rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)
            assert out.dtype == expected.dtype
            if out.dtype == torch.bfloat16:
                assert int(_ulps(out, expected).max()) <= 2
            else:
                torch.testing.assert_close(out, expected, rtol=2.0**-7, atol=0)
            assert float((out != expected).float().mean()) < 1e-3


@needs_cuda
@pytest.mark.gpu
def test_add_rms_norm_on_gpu_is_the_add_then_the_norm():
    """Compiled, the fused kernel must still reduce exactly as rms_norm's (Qwen2.5 hidden sizes, bf16, 80 rows)."""
    for hidden in (896, 3584, 20000):
        norm = _norm(hidden, torch.bfloat16)
        x = torch.randn(80, hidden, device="cuda").to(torch.bfloat16)
        residual = (torch.randn(80, hidden, device="cuda") * 10).to(torch.bfloat16)
        normed, total = add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
        assert torch.equal(total, residual + x)
        assert torch.equal(normed, rms_norm(residual + x, norm.weight, norm.variance_epsilon))


@needs_cuda
@pytest.mark.gpu
def test_fused_kernels_are_cuda_graph_capturable():
    q, k, cos, sin = _rotary_inputs(4, 8, 2, 3, 128, torch.bfloat16)
    norm = _norm(512, torch.bfloat16)
    x = torch.randn(12, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        return apply_rotary(q, k, cos, sin), rms_norm(x, norm.weight, 1e-6)

    graph, ((q_out, k_out), normed) = capture_graph(step)
    fresh = _rotary_inputs(4, 8, 2, 3, 128, torch.bfloat16, seed=1)
    for tensor, new in zip((q, k, cos, sin), fresh):
        tensor.copy_(new)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    (q_ref, k_ref), norm_ref = step()
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref) and torch.equal(normed, norm_ref)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fused_ops_on_a_model_split_over_two_devices():
    """accelerate's device_map puts the second layer and the head on cuda:1 while cuda:0 is current: each
    launch must run on its tensors' device, and the hooked final norm keeps its hook."""
    from accelerate import dispatch_model

    model = tiny_model("qwen2", layers=2, hidden=64).to(torch.bfloat16)
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    model = dispatch_model(model, device_map=device_map)
    assert fused_ops_available(model)
    prompt = random_prompt(7, batch=2).to("cuda:0")
    torch.cuda.set_device(0)
    with torch.no_grad():
        expected = model(prompt).logits.float()
        with fused_ops(model) as done:
            assert done.norms == 5
            out = model(prompt).logits.float()
    torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)


def test_decoder_with_fused_ops_decodes_like_without():
    """The decoding loop inside fused_ops: same greedy tokens as unfused, patches counted, models restored."""
    from transformers import GenerationConfig

    import dustin_hf
    from dustin_hf.adapter.assisted import attention_routed
    from dustin_hf.decode.decoder import SpeculativeDecoder
    from dustin_hf.decode.settings import Drafting, RuntimeOptions

    target, draft = tiny_model("qwen2", seed=1).to(DEVICE), tiny_model("qwen2", layers=2, seed=2).to(DEVICE)
    if not expect_fused(target):
        pytest.skip(f"transformers {transformers.__version__}'s Qwen2 code differs from the one checked")
    forwards = [m.forward for m in target.modules()]
    ids = random_prompt(23, batch=2, seed=3).to(DEVICE)  # on CUDA the kernels run compiled (no interpreter there)
    config = GenerationConfig(do_sample=False, max_length=ids.shape[1] + 12, pad_token_id=0)
    outputs = []
    with dustin_hf.patch(target), attention_routed(target, draft):
        for fused_on in (False, True):
            decoder = SpeculativeDecoder(
                target,
                draft,
                config,
                drafting=Drafting(3),
                runtime=RuntimeOptions(backend="reference", fused_ops=fused_on),
            )
            result = decoder.generate(ids)
            outputs.append(result.sequences)
            report = result.stats.as_dict()["fused_ops"]
            # 2 norms per layer and a final one, in both models; one modeling module's rotary
            assert report == (
                {
                    "norms": 2 * 3 + 1 + 2 * 2 + 1,
                    "rotary": [modeling_qwen2.__name__],
                    "mlps": 3 + 2,
                    "qkv": 3 + 2,
                }
                if fused_on
                else {"norms": 0, "rotary": [], "mlps": 0, "qkv": 0}
            )
    assert torch.equal(outputs[0], outputs[1])
    assert [m.forward for m in target.modules()] == forwards and modeling_qwen2.apply_rotary_pos_emb is HF_ROTARY
