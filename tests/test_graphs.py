"""The staged forward that CUDA graphs capture (one graph per device) computes what the model computes.

``Pipeline`` calls the model's modules itself so that a model split over GPUs can be captured one
device at a time. These tests run it eagerly on CPU against the model's own forward: same logits,
same cache writes, for each supported family, dense and sparse, in one stage and split into several
(the hand-over of hidden states and the rotary cos/sin between stages is what a split model relies on).

Inside ``fused_ops`` the pipeline runs standard decoder layers submodule by submodule, each residual add
inside the RMSNorm launch after it: the logits must equal the model's own forward inside the same context bit for
bit (same add, same norm kernel), in float32 and bf16.
"""

import pytest
import torch
from conftest import TRITON_RUNS, on_launch, package_kernels
from tiny_models import random_prompt, tiny_model

import dustin_hf
from dustin_hf.adapter.assisted import attention_routed
from dustin_hf.decode.cache import DustinCache
from dustin_hf.decode.runner import ModelRunner
from dustin_hf.runtime import fused
from dustin_hf.runtime.pipeline import Pipeline, Stage
from dustin_hf.runtime.plan import ForwardPlan

# These tests run the pipeline on CPU (stages cut on the CPU device), so the fused kernels need Triton's
# interpreter; on a CUDA machine Triton compiles for the GPU instead and cannot take CPU tensors. There,
# tests/test_gpu.py checks the captured (fused) pipeline against the eager model forward, token for token.
needs_triton = pytest.mark.skipif(
    not TRITON_RUNS or torch.cuda.is_available(),
    reason="runs the fused kernels on CPU in Triton's interpreter (TRITON_INTERPRET=1)",
)


def _prefilled_runner(model, prompt: torch.Tensor) -> ModelRunner:
    runner = ModelRunner(model, DustinCache(model.config.num_hidden_layers, prompt.shape[0], capacity=64), "reference")
    plan = ForwardPlan(
        rows=slice(0, prompt.shape[0]), cache_seqlens=[0] * prompt.shape[0], q_len=prompt.shape[1], backend="reference"
    )
    runner.forward(plan, prompt, keep=1)
    return runner


def _split(pipeline: Pipeline, cuts: list[int]) -> Pipeline:
    """The same steps cut into several stages (all on the CPU): after step indices ``cuts``."""
    steps = [step for stage in pipeline.stages for step in stage.steps]
    bounds = [0, *cuts, len(steps)]
    pipeline.stages = tuple(Stage(torch.device("cpu"), tuple(steps[a:b])) for a, b in zip(bounds, bounds[1:]))
    return pipeline


def _step_inputs(sparse: bool):
    """A 20-token prompt of 2 rows, 3 new tokens per row, and a factory of fresh plans for that step (a
    sparse one reads 4 and 3 selected positions) keeping layer 1's queries of heads 0 and 3."""
    prompt = random_prompt(20, batch=2, seed=1)
    step_ids = random_prompt(3, batch=2, seed=2)
    indices = torch.tensor([[0, 3, 7, 19], [1, 2, 15, 18]], dtype=torch.int32) if sparse else None
    num = torch.tensor([4, 3], dtype=torch.int32) if sparse else None

    def plan():
        return ForwardPlan(
            rows=slice(0, 2),
            cache_seqlens=[20, 20],
            q_len=3,
            backend="reference",
            indices=indices,
            num_indices=num,
            capture={1: (0, 3)},
        )

    return prompt, step_ids, plan


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "mistral"])
@pytest.mark.parametrize("cuts", [[], [1], [3, 4]], ids=["one-stage", "after-embed", "mid-layers"])
@pytest.mark.parametrize("sparse", [False, True])
def test_pipeline_matches_the_model_forward(family, cuts, sparse):
    model = tiny_model(family, layers=3)
    prompt, step_ids, plan = _step_inputs(sparse)

    with dustin_hf.patch(model), attention_routed(model), torch.no_grad():
        reference = _prefilled_runner(model, prompt)
        expected_plan = plan()
        expected = reference.forward(expected_plan, step_ids, keep=2)

        staged = _prefilled_runner(model, prompt)
        pipeline = _split(Pipeline(model), cuts) if cuts else Pipeline(model)
        assert len(pipeline.stages) == len(cuts) + 1
        staged_plan = plan()
        with staged.cache.forward_plan(staged_plan):
            logits = pipeline.forward(step_ids, staged_plan, staged.cache, keep=2)

    assert logits.shape == expected.shape == (2, 2, model.config.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    torch.testing.assert_close(staged_plan.captured[1], expected_plan.captured[1], rtol=0, atol=0)
    for layer in range(model.config.num_hidden_layers):  # the new tokens' keys and values were written alike
        for got, want in zip(staged.cache.layer_buffers(layer), reference.cache.layer_buffers(layer)):
            torch.testing.assert_close(got[:, :23], want[:, :23], rtol=0, atol=0)


def _logits_and_tokens(model, tuning=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of ``model`` through the pipeline (built with ``tuning``) twice from the same prefill: the
    last two positions' logits (fp32), then the greedy head's tokens."""
    prompt, step_ids, plan = _step_inputs(sparse=False)
    outputs = []
    with dustin_hf.patch(model), attention_routed(model), torch.no_grad():
        for tokens in (False, True):
            runner, step_plan = _prefilled_runner(model, prompt), plan()
            with runner.cache.forward_plan(step_plan):
                outputs.append(
                    Pipeline(model, tuning).forward(step_ids, step_plan, runner.cache, keep=2, tokens=tokens)
                )
    return outputs[0], outputs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipeline_tokens_are_the_argmax_of_its_logits(dtype):
    """Greedy decoding runs the head's argmax inside the graph (on 16-bit logits, no fp32 copy): the same
    tokens as the argmax of the fp32 logits the pipeline hands out otherwise."""
    logits, tokens = _logits_and_tokens(tiny_model("qwen2", layers=3).to(dtype))
    assert logits.dtype == torch.float32 and tokens.dtype == torch.long and tokens.shape == (2, 2)
    assert torch.equal(tokens, logits.argmax(dim=-1))


@needs_triton
def test_pipeline_takes_a_greedy_heads_argmax_in_one_kernel():
    """Where the argmax kernel runs (CUDA; here Triton's interpreter) a greedy head's tokens come from it: one
    launch over the 16-bit logits, the same tokens as PyTorch's argmax of the fp32 logits; the pipeline's tuning
    sets its tile."""
    from dustin_hf.kernels import KernelTuning, triton_argmax
    from dustin_hf.kernels.tuning import ArgmaxTuning

    model = tiny_model("qwen2", layers=3).to(torch.bfloat16)
    for tuning, block in ((None, ArgmaxTuning().block), (KernelTuning(argmax=ArgmaxTuning(block=64)), 64)):
        launched = []
        with on_launch(package_kernels(triton_argmax), lambda name, args, kwargs: launched.append((args[0], kwargs))):
            logits, tokens = _logits_and_tokens(model, tuning)
        assert [(tuple(x.shape), x.dtype, kw["BLOCK"]) for x, kw in launched] == [
            ((4, model.config.vocab_size), torch.bfloat16, block)
        ]
        assert torch.equal(tokens, logits.argmax(dim=-1))


def test_pipeline_stages_follow_the_devices_of_the_modules():
    model = tiny_model("qwen2", layers=3)
    pipeline = Pipeline(model)
    assert pipeline.devices == (torch.device("cpu"),)
    assert pipeline.stages == (Stage(torch.device("cpu"), ("embed", "rotary", 0, 1, 2, "norm", "head")),)


def test_pipeline_names_what_a_model_lacks():
    model = tiny_model("qwen2", layers=2)
    del model.model.rotary_emb
    with pytest.raises(ValueError, match="missing: rotary_emb.*cuda_graphs=False"):
        Pipeline(model)


# ----------------------------------------------------------------------------- inside fused_ops


def _staged_and_expected(model, cuts, sparse=False, keep=2, caches=False, tuning=None):
    """Logits of the pipeline (cut after step indices ``cuts``) and of the model's own forward, both inside
    ``fused_ops`` (with ``tuning``'s paths); each from its own prefilled cache. Returns ``(logits, expected, pipeline,
    FusedOps)``, and with ``caches`` also the two caches."""
    prompt, step_ids, plan = _step_inputs(sparse)

    with dustin_hf.patch(model), attention_routed(model), torch.no_grad():
        reference, staged = _prefilled_runner(model, prompt), _prefilled_runner(model, prompt)  # unfused: faster
        with fused.fused_ops(model, tuning=tuning) as done:
            expected = reference.forward(plan(), step_ids, keep=keep)
            pipeline = _split(Pipeline(model), cuts) if cuts else Pipeline(model)
            staged_plan = plan()
            with staged.cache.forward_plan(staged_plan):
                logits = pipeline.forward(step_ids, staged_plan, staged.cache, keep=keep)
    if caches:
        return logits, expected, pipeline, done, (staged.cache, reference.cache)
    return logits, expected, pipeline, done


@needs_triton
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "mistral"])
@pytest.mark.parametrize("cuts", [[], [3, 4]], ids=["one-stage", "mid-layers"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_pipeline_matches_the_model_forward_bit_for_bit(family, cuts, sparse, dtype):
    """Residual adds fused into the norms, the MLP output pending across a stage boundary (``mid-layers``
    cuts between layers 0, 1 and 2), the final add on the kept positions only; the same cache written."""
    from dustin_hf.kernels import triton_fused

    model = tiny_model(family, layers=3).to(dtype)
    added = []  # the rows of every add + RMSNorm launch

    def record(name, args, kwargs):
        if kwargs.get("ADD"):
            added.append(tuple(args[0].shape))

    with on_launch(package_kernels(triton_fused), record):
        logits, expected, _, done, (staged, reference) = _staged_and_expected(model, cuts, sparse, caches=True)
    assert done.layers == 3
    for layer in range(3):
        for got, want in zip(staged.layer_buffers(layer), reference.layer_buffers(layer)):
            assert torch.equal(got, want)
    # per layer the post-attention norm, layers 1 and 2 their input norm, then the final norm (kept rows only):
    # batch 2 x 3 positions, then 2 x 2
    assert added == [(6, 64)] * 5 + [(4, 64)]
    assert torch.equal(logits, expected)


@needs_triton
def test_the_pipeline_with_its_fused_layers_off_computes_the_same():
    """With the pipeline's own layer path off (FusedTuning), the pipeline calls the layers instead, under the same
    context, and the logits stay the model's bit for bit (the surgery benchmark's A/B compares speed only)."""
    model = tiny_model("qwen2", layers=3).to(torch.bfloat16)
    logits, expected, _, done = _staged_and_expected(model, [], sparse=True, tuning=fused.FusedTuning(layers=False))
    assert done.layers == 0 and done.norms
    assert torch.equal(logits, expected)


@needs_triton
def test_fused_pipeline_falls_back_per_layer():
    """A layer that is not plain (here: a forward hook someone registered) runs its own forward: the pending
    MLP output of the layer before is added first, and the layer after resumes the fused path."""
    model = tiny_model("qwen2", layers=3).to(torch.bfloat16)
    seen = []
    model.model.layers[1].register_forward_hook(lambda *args: seen.append(True))
    logits, expected, _, done = _staged_and_expected(model, [])
    assert done.layers == 2 and len(seen) == 4  # two prefills, the model's step, the pipeline's
    assert torch.equal(logits, expected)


@needs_triton
@pytest.mark.parametrize("mistake", ["norm-before-add", "stale-residual", "final-add-skipped"])
def test_fused_pipeline_catches_a_misordered_add(mistake, monkeypatch):
    """The bit-for-bit comparison above is sensitive to the order of add and norm: a pipeline that normalises
    the residual before adding, keeps the old residual, or drops the last MLP output, gets other logits."""
    from dustin_hf.runtime import pipeline

    real = pipeline._add_norm

    def wrong(norm, x, residual):
        if mistake == "norm-before-add":
            return norm(residual), residual + x
        if mistake == "stale-residual":
            return real(norm, x, residual)[0], residual
        return norm(residual), residual  # final-add-skipped: applied to the final norm only, below

    if mistake == "final-add-skipped":
        monkeypatch.setattr(
            pipeline.Pipeline,
            "_final_norm",
            lambda self, state, keep: wrong(self.decoder.norm, state["mlp_out"][:, -keep:], state["h"][:, -keep:])[0],
        )
    else:
        monkeypatch.setattr(pipeline, "_add_norm", wrong)
    logits, expected, _, _ = _staged_and_expected(tiny_model("llama", layers=3), [])
    assert not torch.equal(logits, expected)
