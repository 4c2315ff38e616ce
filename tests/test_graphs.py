"""The staged forward that CUDA graphs capture (one graph per device) computes what the model computes.

``Pipeline`` calls the model's modules itself so that a model split over GPUs can be captured one
device at a time. These tests run it eagerly on CPU against the model's own forward: same logits,
same cache writes, for each supported family, dense and sparse, in one stage and split into several
(the hand-over of hidden states and rotary table between stages is what a split model relies on).
"""

import pytest
import torch

import dustin_hf
from dustin_hf.cache import DustinCache
from dustin_hf.decoding import ModelRunner
from dustin_hf.generate import attention_routed
from dustin_hf.graphs import Pipeline, Stage
from dustin_hf.plan import ForwardPlan

from conftest import random_prompt, tiny_model


def _prefilled_runner(model, prompt: torch.Tensor) -> ModelRunner:
    runner = ModelRunner(model, DustinCache(model.config.num_hidden_layers, prompt.shape[0], capacity=64), "reference")
    plan = ForwardPlan(rows=slice(0, prompt.shape[0]), cache_seqlens=[0] * prompt.shape[0], q_len=prompt.shape[1],
                       backend="reference")
    runner.forward(plan, prompt, keep=1)
    return runner


def _split(pipeline: Pipeline, cuts: list[int]) -> Pipeline:
    """The same steps cut into several stages (all on the CPU): after step indices ``cuts``."""
    steps = [step for stage in pipeline.stages for step in stage.steps]
    bounds = [0, *cuts, len(steps)]
    pipeline.stages = tuple(Stage(torch.device("cpu"), tuple(steps[a:b])) for a, b in zip(bounds, bounds[1:]))
    return pipeline


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "mistral"])
@pytest.mark.parametrize("cuts", [[], [1], [3, 4]], ids=["one-stage", "after-embed", "mid-layers"])
@pytest.mark.parametrize("sparse", [False, True])
def test_pipeline_matches_the_model_forward(family, cuts, sparse):
    model = tiny_model(family, layers=3)
    prompt = random_prompt(20, batch=2, seed=1)
    step_ids = random_prompt(3, batch=2, seed=2)
    indices = torch.tensor([[0, 3, 7, 19], [1, 2, 15, 18]], dtype=torch.int32) if sparse else None
    num = torch.tensor([4, 3], dtype=torch.int32) if sparse else None

    def plan():
        return ForwardPlan(rows=slice(0, 2), cache_seqlens=[20, 20], q_len=3, backend="reference",
                           indices=indices, num_indices=num, capture={1: (0, 3)})

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
