"""The declared surface for the lab (``lab/``) and the benchmarks (``benchmarks/``): what they may use beyond
``dustin_hf.__all__``.

Unstable but declared: these names may change or go in any release, without deprecation, and users of the library
should not need them. They are declared so that the code that measures the method drives the loop, the plan and
the selection through one list rather than through the library's internals: the lab and the benchmarks import only
from ``dustin_hf``, this module and the kernel dispatcher ``dustin_hf.kernels``, subclass none of their classes
(the plan's hooks, ``read_hook`` and ``selection_hook``, take what a subclass overrode), and a test checks it
(``tests/test_surface.py``). When a name moves inside the library, its import here moves with it; nothing in the
library imports this module.

Importing it imports the library (torch and transformers) and changes nothing; the Triton kernel's own entry points
load on first use (Triton is optional).
"""

from __future__ import annotations

# the models' attention routed to 'dustin' around a loop driven directly (generate() does it itself)
from .adapter.assisted import attention_routed

# the scoring heads' calibration: per call on the prompts (run on a stored prefill), and the offline search over
# recorded steps (the lab's ``calibrate`` command)
from .calibration.prompt import calibrate_on_prompts
from .calibration.search import (
    Choice,  # a candidate: the target's scoring layer and heads, the draft's, and the draft's share
    StepFeatures,  # the features of the recorded steps, padded to the longest
    default_choice,  # what an uncalibrated config uses, the search's baseline
    oracle_recovery,  # the best recovery any read set of a budget reaches on a step
    recovery_of,  # a choice's recovery on recorded steps
    search,  # the search itself
    stack_features,  # step_features' results stacked into one StepFeatures
    step_features,  # the features of one verification-like step on a cache row
)

# transformers' names and the model facts the library reads
from .compat import (
    CACHE_KWARG,  # generate()'s keyword for a cache implementation in the installed transformers
    attention_scale,  # the model's attention scale, as its attention function uses it
    group_size,  # query heads per key head (GQA)
    model_device,  # the device a model's inputs go to
)

# configuration resolved against a model pair
from .config import ResolvedConfig, resolve  # the values that depend on the models (layers, heads, windows)

# the decode loop, driven directly (a fixed γ, a stored prefill, replayed outcomes)
from .decode.decoder import SpeculativeDecoder  # the loop generate() runs, with its settings spelled out
from .decode.hooks import DecodeHooks, synchronize  # replayed acceptance, stored prefill, phase timing
from .decode.runner import ModelRunner  # one model's forward over a DustinCache under a ForwardPlan
from .decode.settings import Drafting, RuntimeOptions  # the loop's drafting and runtime settings

# kernel backends one by one, for the attention benchmark (the dispatcher is dustin_hf.kernels)
from .kernels.reference import verify_attention_reference  # the plain-PyTorch reference, the tests' oracle
from .kernels.varlen import (
    torch_varlen_available,  # whether PyTorch bundles varlen_attn
    torch_varlen_flavour,  # which varlen_attn signature PyTorch has
    verify_attention_varlen,  # gather the selection, then flash-attn's or PyTorch's varlen attention
)

# profiles: a calibrated config stored as a file
from .profiles import config_for_budget, read_profile, write_profile

# the fused decode ops as a context, each path switched by RuntimeOptions.tuning.fused (the surgery benchmark's A/B)
from .runtime.fused import fused_ops

# the per-forward plan: what one forward over the cache reads
from .runtime.plan import (
    DeviceTensors,  # the plan's tensors on one device, what a read_hook receives and returns
    ForwardPlan,  # one forward's rows, lengths, read set, captured queries and hooks
    device_tensor,  # a host list on a device without a synchronisation
    select_heads,  # a tensor restricted to some heads, as the plan keeps queries
)

# the selection, piece by piece (the walk re-derives the decoder's choice and measures it)
from .selection.draft_reads import DraftReads  # the draft's read sets, from the last sparse verification
from .selection.fill import (
    Selection,  # a read set per row: indices, counts
    dense_rows,  # the rows verification reads in full (context within the budget or below min_context)
    select_positions,  # the budget fill: sinks, recent tokens, then the best-scored positions
)
from .selection.knob import (
    estimated_mass,  # the scoring heads' estimate of the attention each position gets
    select_by_recovery,  # the quality knob's selection: positions until the estimate reaches its target
)
from .selection.layers import select_spec  # a config's selection layers as the plan takes them
from .selection.recovery import (
    head_probabilities,  # per head, the attention probabilities of some queries summed over them
    position_weights,  # the true attention over positions, averaged over heads and queries, per layer
    selection_recovery,  # the share of the true attention a read set captures
)
from .selection.scoring import (
    attention_mass,  # attention probabilities of some queries summed over them, per key position
    draft_lookahead_scores,  # S_draft: the draft's lookahead queries over its keys
    target_history_scores,  # S_target: the target's recent queries over its keys
)

_TRITON = ("launch_config", "sparse_loop_keys", "verify_attention_triton")

__all__ = [
    "CACHE_KWARG",
    "Choice",
    "DecodeHooks",
    "DeviceTensors",
    "DraftReads",
    "Drafting",
    "ForwardPlan",
    "ModelRunner",
    "ResolvedConfig",
    "RuntimeOptions",
    "Selection",
    "SpeculativeDecoder",
    "StepFeatures",
    "attention_mass",
    "attention_routed",
    "attention_scale",
    "calibrate_on_prompts",
    "config_for_budget",
    "default_choice",
    "dense_rows",
    "device_tensor",
    "draft_lookahead_scores",
    "estimated_mass",
    "fused_ops",
    "group_size",
    "head_probabilities",
    "launch_config",  # noqa: F822 (__getattr__ loads it)
    "model_device",
    "oracle_recovery",
    "position_weights",
    "read_profile",
    "recovery_of",
    "resolve",
    "search",
    "select_by_recovery",
    "select_heads",
    "select_positions",
    "select_spec",
    "selection_recovery",
    "sparse_loop_keys",  # noqa: F822 (__getattr__ loads it)
    "stack_features",
    "step_features",
    "synchronize",
    "target_history_scores",
    "torch_varlen_available",
    "torch_varlen_flavour",
    "verify_attention_reference",
    "verify_attention_triton",  # noqa: F822 (__getattr__ loads it)
    "verify_attention_varlen",
    "write_profile",
]


def __getattr__(name: str):
    # the Triton kernel's entry points (its launch configuration and the keys its sparse loop reads, for the
    # attention benchmark's sweeps) import triton, an optional dependency: loaded on first use
    if name in _TRITON:
        from .kernels import triton_verify

        value = getattr(triton_verify, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dustin_hf.experimental' has no attribute {name!r}")
