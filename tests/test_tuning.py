"""Tuning objects: frozen, validated, one dotted path per field, and each reaches the launches it tunes (the
kernels' constexprs and launch sizes, caught through Triton's pre-run hooks; interpreter on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TRITON_RUNS, on_launch, package_kernels

from dustin_hf.kernels.tuning import ArgmaxTuning, GemmTuning, KernelTuning, ScoreTuning, SelectTuning, VerifyTuning
from dustin_hf.runtime.fused import FusedTuning
from dustin_hf.runtime.tuning import Tuning

needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_with_value_returns_a_new_tuning_and_leaves_the_old_one():
    default = Tuning()
    tuned = default.with_value("kernels.verify.sparse_programs_per_sm", 2)
    assert tuned.kernels.verify.sparse_programs_per_sm == 2 and default.kernels.verify.sparse_programs_per_sm == 1
    assert tuned.kernels.verify == dataclasses.replace(VerifyTuning(), sparse_programs_per_sm=2)
    assert (tuned.kernels.gemm, tuned.fused) == (default.kernels.gemm, default.fused)
    assert default.with_value("fused.skinny_rows", 16).fused.skinny_rows == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuned.kernels = KernelTuning()


def test_every_field_has_one_path():
    paths = Tuning.paths()
    parts = {
        "verify": VerifyTuning,
        "gemm": GemmTuning,
        "score": ScoreTuning,
        "select": SelectTuning,
        "argmax": ArgmaxTuning,
    }
    expected = [f"kernels.{name}.{field.name}" for name, cls in parts.items() for field in dataclasses.fields(cls)]
    assert list(paths) == expected + [f"fused.{field.name}" for field in dataclasses.fields(FusedTuning)]


@pytest.mark.parametrize("path", ["kernels.verify.sparse_programs", "kernels.verify", "verify.programs_per_sm", ""])
def test_with_value_names_the_valid_paths(path):
    with pytest.raises(ValueError, match=r"unknown tuning path .*valid paths: kernels\.verify\.programs_per_sm, "):
        Tuning().with_value(path, 2)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: VerifyTuning(programs_per_sm=0), "VerifyTuning.programs_per_sm must be an int >= 1; got 0"),
        (lambda: VerifyTuning(sparse_stages=()), "VerifyTuning.sparse_stages must be a non-empty tuple of ints"),
        (lambda: GemmTuning(num_stages=2.5), "GemmTuning.num_stages must be an int >= 1; got 2.5"),
        (lambda: GemmTuning(gated_block_n=48), "GemmTuning.gated_block_n must be a power of two; got 48"),
        (lambda: ScoreTuning(pass2_block_r=6), "ScoreTuning.pass2_block_r must be a power of two"),
        (lambda: SelectTuning(min_chunk=1000), "SelectTuning.min_chunk must be a power of two"),
        (lambda: ArgmaxTuning(programs_per_sm=True), "ArgmaxTuning.programs_per_sm must be an int >= 1; got True"),
        (lambda: FusedTuning(gated_rows=-1), "FusedTuning.gated_rows must be an int >= 0; got -1"),
        (lambda: KernelTuning(score=SelectTuning()), "KernelTuning.score must be a ScoreTuning"),
        (lambda: Tuning().with_value("kernels.argmax.block", 1000), "ArgmaxTuning.block must be a power of two"),
    ],
)
def test_a_bad_value_is_named_with_its_class_and_field(make, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        make()


def _constexprs(run, *modules) -> list[dict]:
    """The keyword arguments of every launch of ``modules``' kernels that ``run()`` makes."""
    launched = []
    with on_launch(package_kernels(*modules), lambda name, args, kwargs: launched.append(kwargs)):
        out = run()
    return out, launched


@needs_triton
def test_verify_tuning_reaches_the_launch():
    """The dispatcher hands its tuning to the Triton kernel: with a short range that no longer counts as short, a
    split of one tile and more programs per SM, dense mode splits the keys it reads in one split by default (on
    the interpreter's one SM), with the same output."""
    from dustin_hf.kernels import triton_verify, verify_attention
    from dustin_hf.kernels.reference import verify_attention_reference

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 16, generator=gen).to(DEVICE)
    cache = torch.randn(1, 200, 2, 16, generator=gen).to(DEVICE)
    seqlens = torch.tensor([190], dtype=torch.int32, device=DEVICE)
    kwargs = dict(softmax_scale=0.25, max_seqlen_k=192)
    want = verify_attention_reference(q, cache, cache, seqlens, **kwargs)
    split = VerifyTuning(programs_per_sm=4, min_blocks_per_split=1, short_range_blocks=2)
    for tuning, single in ((None, True), (split, False)):
        out, launched = _constexprs(
            lambda: verify_attention(q, cache, cache, seqlens, **kwargs, backend="triton", tuning=tuning),
            triton_verify,
        )
        assert [k["SINGLE_SPLIT"] for k in launched if "SINGLE_SPLIT" in k] == [single]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # the interpreter on what pass 1
def test_score_select_and_argmax_tunings_reach_their_launches():  # left unwritten, which pass 2 masks by design
    from dustin_hf.kernels import triton_argmax, triton_score, triton_select

    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 300, 1, 16, generator=gen).to(DEVICE)
    queries = torch.randn(2, 1, 2, 16, generator=gen).to(DEVICE)
    query_pos = torch.tensor([[250], [299]], device=DEVICE)
    scored = {}
    for name, tuning in (("default", None), ("tuned", ScoreTuning(tile_bytes=1024, programs_per_sm=64))):
        scored[name], launched = _constexprs(
            lambda: triton_score.attention_mass_triton(
                queries, keys, query_pos, (0, 1), 2, 0.25, 300, 300, tuning=tuning
            ),
            triton_score,
        )
        scored[name + " tiles"] = {(k.get("BLOCK_N"), k.get("BLOCK_S")) for k in launched if "BLOCK_S" in k}
    assert scored["default tiles"] == {(128, 1)} and scored["tuned tiles"] == {(32, 2)}  # 1 KiB tiles, 2 splits
    torch.testing.assert_close(scored["tuned"], scored["default"], rtol=1e-5, atol=1e-6)

    scores = torch.rand(2, 3000, generator=gen).to(DEVICE)
    lengths = torch.tensor([3000, 2900], device=DEVICE)
    picks = {}
    for chunk, tuning in ((1024, None), (2048, SelectTuning(min_chunk=2048))):
        picks[chunk], launched = _constexprs(
            lambda: triton_select.select_sparse_triton(
                scores, scores, lengths, sink=4, recent=8, share=20, fill=32, tuning=tuning
            ),
            triton_select,
        )
        assert {k["CHUNK"] for k in launched if "CHUNK" in k} == {chunk}
    assert torch.equal(picks[1024], picks[2048])

    logits = torch.randn(3, 5000, generator=gen).to(DEVICE)
    for block, tuning in ((4096, None), (1024, ArgmaxTuning(block=1024))):
        tokens, launched = _constexprs(lambda: triton_argmax.argmax_triton(logits, tuning=tuning), triton_argmax)
        assert [k["BLOCK"] for k in launched] == [block] and torch.equal(tokens, logits.argmax(dim=-1))
