"""The library's test helpers: tiny random-weight models (:mod:`tiny_models`, shared with the lab's tests), CUDA
graph capture, kernels' launch hooks, statistical checks. No downloads anywhere in the tests."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import noisy_copy, one_thread, set_gamma, tiny_model  # noqa: F401  (first: it sets TRITON_INTERPRET)


def _triton_runs() -> bool:
    """Whether Triton kernels run here: on CUDA, or on CPU in the interpreter, which also needs
    triton.language's own jit functions (``tl.max``...) built for it; that happens only if
    TRITON_INTERPRET was set before anything imported triton (set above, before transformers)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if torch.cuda.is_available():
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.max, InterpretedFunction)


TRITON_RUNS = _triton_runs()


def capture_graph(fn):
    """``fn()`` captured in a CUDA graph, after one warm-up call on a side stream (kernels compile outside
    the capture); returns ``(graph, what the captured call returned)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.fixture
def qwen_pair():
    target = tiny_model("qwen2", layers=4, seed=0)
    return target, set_gamma(noisy_copy(target), 4)


def tiled_prefill(prompts: int):
    """A prefill with :meth:`~dustin_hf.decode.runner.ModelRunner.prefill`'s signature for a batch whose rows repeat
    its first ``prompts`` rows in turn (row ``b`` is row ``b % prompts``): it prefills those and copies each to the
    rows that repeat it. Law tests sample thousands of rows of one or two prompts; use it as a decoder's
    ``DecodeHooks(prefill=...)`` or in place of ``ModelRunner.prefill`` (it calls the one defined now)."""
    from dustin_hf.decode.runner import ModelRunner

    prefill = ModelRunner.prefill

    def tiled(runner, rows, chunk, capture, on_chunk=None):
        logits, kept = prefill(runner, rows[:prompts], chunk, capture)
        cache = runner.cache
        for layer in cache.layers:
            for buffer in layer.buffers():  # (B, capacity, H, D)
                for first in range(prompts):
                    buffer[first::prompts] = buffer[first : first + 1]
        cache.seq_lengths = [row.numel() for row in rows]
        return logits * (len(rows) // prompts), kept * (len(rows) // prompts)

    return tiled


def joint_law(target, prompt: torch.Tensor, tokens: int, processors=None) -> torch.Tensor:
    """The target's joint law of its next ``tokens`` tokens after ``prompt (1, L)``, each drawn from its
    ``processors``' scores (a ``LogitsProcessorList``, as sampling ``generate()`` applies them; ``None``: the raw
    logits): ``(V**tokens,)`` float64, sequence t_1..t_n at index sum t_i V**(n-i), by enumerating every prefix."""
    vocab = target.config.vocab_size
    log_law = torch.zeros(1, dtype=torch.float64)
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    with torch.no_grad():
        for _ in range(tokens):
            inputs = torch.cat([prompt.expand(prefixes.shape[0], -1), prefixes], dim=1)
            scores = target(inputs).logits[:, -1].float()  # (prefixes, V)
            if processors is not None:
                scores = processors(inputs, scores)
            log_law = (log_law[:, None] + scores.double().log_softmax(-1)).flatten()
            prefixes = torch.cat(
                [prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], dim=1
            )
    return log_law.exp()


def law_pvalue(tokens: torch.Tensor, law: torch.Tensor, vocab: int) -> float:
    """The chi-square p-value of the sampled sequences ``tokens (N, n)`` against their joint ``law (V**n,)``
    (indexed as :func:`joint_law` does). A sequence of probability 0 sampled even once gives 0; cells expected
    fewer than 5 times are pooled into one."""
    from scipy.stats import chisquare

    index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for column in tokens.unbind(1):
        index = index * vocab + column
    counts = torch.bincount(index, minlength=law.numel()).double()
    if counts[law == 0].sum() > 0:
        return 0.0
    expected = law.double() * tokens.shape[0]
    keep = expected > 5  # chi-square needs populated cells; pool the rest (those of probability 0 aside)
    pooled = ~keep & (law > 0)
    observed, wanted = counts[keep], expected[keep]
    if pooled.any():
        observed = torch.cat([observed, counts[pooled].sum()[None]])
        wanted = torch.cat([wanted, expected[pooled].sum()[None]])
    return chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue


def explicit_attention_mass(q, keys, query_pos, heads, group, scale, num_positions) -> torch.Tensor:
    """The scoring oracle: float64, one (row, query, head) softmax at a time; returns ``(B, num_positions)``."""
    q, keys, query_pos = q.cpu(), keys.cpu(), query_pos.cpu()
    batch, n_q = q.shape[:2]
    out = torch.zeros(batch, num_positions, dtype=torch.float64)
    for b in range(batch):
        for j in range(n_q):
            visible = int(query_pos[b, j]) + 1
            for i, h in enumerate(heads):
                logits = keys[b, :visible, h // group].double() @ q[b, j, i].double() * scale
                probs = logits.softmax(0)
                n = min(visible, num_positions)
                out[b, :n] += probs[:n]
    return out


def package_kernels(*modules) -> list:
    """The Triton kernels (``@triton.jit`` functions named ``*_kernel``, the ones launched) of ``modules``."""
    return [
        value
        for module in modules
        for name, value in vars(module).items()
        if name.endswith("_kernel") and hasattr(value, "add_pre_run_hook")
    ]


@contextlib.contextmanager
def on_launch(kernels, hook):
    """Call ``hook(name, args, kwargs)`` before each launch of the Triton ``kernels`` inside the block (Triton's
    pre-run hooks: the kernel's name, its positional and keyword arguments); the kernels run as usual."""
    hooks = []
    for kernel in kernels:
        hooks.append((kernel, lambda *args, _name=kernel.fn.__name__, **kwargs: hook(_name, args, kwargs)))
        kernel.add_pre_run_hook(hooks[-1][1])
    try:
        yield
    finally:
        for kernel, added in hooks:
            kernel.pre_run_hooks.remove(added)


def sm90_ptx_report(script: str) -> list[dict]:
    """Run ``tests/<script>`` (``kernel_ptx.py``, ``verify_ptx.py``: kernels compiled for sm_90 without a GPU)
    in a subprocess without the Triton interpreter; its JSON report, or a skip where Triton cannot compile
    for CUDA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script))], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode == 77:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
