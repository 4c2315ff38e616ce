"""The projections :func:`~dustin_hf.runtime.fused.fused_ops` runs as fewer, larger GEMMs: at decode sizes each
GEMM launch costs more than its arithmetic.

* An MLP of the standard form ``down(silu(gate(x)) * up(x))`` (``recognise._MLP_CLASSES``, checked by bytecode, SiLU,
  no biases) runs one GEMM over ``[gate; up]`` and :func:`~.ops.silu_mul` (both in one :func:`~.ops.gated_linear`
  launch for a draft's weight at decode sizes, or a large target's at verification sizes: :class:`FusedTuning`),
  and its down projection at decode sizes as :func:`~.ops.skinny_linear` (one launch where cuBLAS splits K and
  reduces in a second).
* An attention's ``q_proj``, ``k_proj`` and ``v_proj`` (plain ``nn.Linear``) run one GEMM over ``[q; k; v]`` when
  they are called on the same input, as every listed family's attention does: ``q_proj`` computes all three and
  ``k_proj``/``v_proj`` hand out their slices (on any other input each runs its own). That GEMM runs as
  :func:`~.ops.skinny_linear` for a draft's small weights at decode sizes (a launch that starts as a dependent of the
  one before on sm_90, where cuBLAS's cannot). ``o_proj`` stays the model's own ``nn.Linear``.

The weights are not copied: each projection's weight (and bias) becomes a view of the fused tensor
(:class:`FusedWeights`) while the context is open, and gets its own storage back on exit. Numerics: SiLU·mul rounds
as PyTorch does; a fused GEMM (and a skinny one) may reduce in another order than the separate ones (cuBLAS picks its
kernel by shape), so its outputs can differ in the last bits.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.tuning import GemmTuning
from .ops import gated_linear, silu_mul, skinny_linear, triton_runs_on
from .recognise import _ATTENTION_CLASSES, _MLP_CLASSES, _standard_mlp_code
from .registry import _replace_forward

__all__ = ["FusedTuning", "FusedWeights"]


@dataclasses.dataclass(frozen=True)
class FusedTuning:
    """Which fused paths :func:`~.fused.fused_ops` takes (each switch turns one off on its own, for an A/B against
    transformers' own code: ``benchmarks/surgery.py``), and which projections run through the Triton GEMMs, by rows
    and weight bytes (0 turns a GEMM path off).

    Attributes:
        norms: RMSNorms run :func:`~.ops.rms_norm` (off: ``layers`` too, whose residual adds run inside the norms).
        rotary: attentions run ``apply_rotary_pos_emb`` as :func:`~.ops.apply_rotary` (:mod:`~.rotary`).
        mlps: MLPs run one ``[gate; up]`` GEMM and :func:`~.ops.silu_mul` (and the GEMM paths below).
        qkv: an attention's q/k/v projections run as one GEMM.
        layers: :class:`~.pipeline.Pipeline` runs a standard decoder layer submodule by submodule, each
            residual add inside the next norm's launch (off: the layer's own forward).
        skinny_rows: an MLP's down projection of at most this many rows (a draft's decode step: 16 rows at batch
            16, 32 in its first forward of a step) runs as :func:`skinny_linear`: cuBLAS runs the 0.5B draft's
            (K = 4864) as a split-K GEMM plus a reduction launch.
        gated_max_bytes: with at most this many bytes of ``[gate; up]`` weight, at up to ``skinny_rows`` rows, an
            MLP's gate/up GEMM and SiLU-mul run as one :func:`gated_linear` launch (a latency-bound GEMM: the
            0.5B draft's 17 MB).
        gated_min_large_bytes, gated_rows: ... and with at least ``gated_min_large_bytes``, at up to
            ``gated_rows`` rows (a large target's verification: 72B at batch 8 is 40 rows of 969 MB). Weights
            between the two limits (a 7B's 272 MB) keep cuBLAS, which is faster there; a down projection of
            more than ``skinny_rows`` rows keeps it too.
        skinny_projection_max_bytes: an attention's fused q/k/v GEMM of at most this many bytes of weight (the
            0.5B draft's 2.1 MB), at up to ``skinny_rows`` rows, runs as a :func:`skinny_linear` launch, which can
            start as a dependent of the kernel before it (cuBLAS's cannot). Larger weights keep cuBLAS.
    """

    norms: bool = True
    rotary: bool = True
    mlps: bool = True
    qkv: bool = True
    layers: bool = True
    skinny_rows: int = 32
    gated_max_bytes: int = 32 * 2**20
    gated_min_large_bytes: int = 512 * 2**20
    gated_rows: int = 64
    skinny_projection_max_bytes: int = 8 * 2**20

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(field.default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"FusedTuning.{field.name} must be True or False; got {value!r}")
            elif not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"FusedTuning.{field.name} must be an int >= 0; got {value!r}")

    @classmethod
    def switches(cls) -> tuple[str, ...]:
        """The fields that turn a fused path off on its own (``norms`` ... ``layers``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if isinstance(f.default, bool))


def _plain_linears(*linears) -> bool:
    """Plain ``nn.Linear`` layers (not quantized or hooked) of one dtype and device, the Triton kernels' dtypes."""
    if not all(type(m) is torch.nn.Linear and not hasattr(m, "_hf_hook") for m in linears):
        return False
    weights = [m.weight for m in linears]
    return (
        len({(w.dtype, w.device) for w in weights}) == 1
        and weights[0].dtype in (torch.float16, torch.bfloat16, torch.float32)
        and triton_runs_on(weights[0].device)
    )


class FusedWeights:
    """The concatenated weights :func:`~.fused.fused_ops` runs as one GEMM (``[q; k; v]``, ``[gate; up]``), kept from
    one context to the next.

    Each fused layer's parameters become views of the concatenation (no second copy of the weights). A context
    given no ``FusedWeights`` makes its own and gives every layer its own storage back on exit; a context given one
    leaves the concatenations in place, so CUDA graphs captured over them replay in a later context (the decode
    loop's :class:`~dustin_hf.decode.workspace.Workspace`). Until :meth:`release`, the layers' parameters share storage
    (views of one tensor that do not overlap: ``state_dict()``, ``save_pretrained`` and safetensors take them as
    they take separate tensors). A layer whose parameters were replaced since (``param.data = ...``,
    ``model.to(...)``) is concatenated afresh and :attr:`generation` counts up.
    """

    def __init__(self):
        # per fused group of layers: the layers, the weight and bias concatenations, and the parameters' addresses
        self._held: dict[tuple[int, ...], tuple[tuple, torch.Tensor, torch.Tensor | None, tuple[int, ...]]] = {}
        self.generation = 0  # counts concatenations made: graphs captured over older ones read freed memory

    def share(self, linears) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``linears``' weights (and biases) concatenated along the output dimension, the layers' parameters views
        of them: the held concatenation while the parameters are still its views, else a new one."""
        key = tuple(id(m) for m in linears)
        held = self._held.get(key)
        if held is not None and all(a is b for a, b in zip(held[0], linears)) and held[3] == _addresses(linears):
            return held[1], held[2]
        fused = []
        for name in ("weight", "bias"):
            params = [getattr(m, name) for m in linears]
            if params[0] is None:
                fused.append(None)
                continue
            whole = torch.cat([p.detach() for p in params])
            for param, view in zip(params, whole.split([p.shape[0] for p in params])):
                param.data = view  # the layer's own storage (or an older concatenation) is released here
            fused.append(whole)
        self._held[key] = (tuple(linears), fused[0], fused[1], _addresses(linears))
        self.generation += 1
        return fused[0], fused[1]

    def release(self) -> None:
        """Give every layer still viewing a held concatenation its own storage back; hold nothing."""
        held, self._held = self._held, {}
        for linears, _, _, addresses in held.values():
            if _addresses(linears) == addresses:  # not replaced since (else nothing of ours to undo)
                for m in linears:
                    for param in (m.weight, m.bias):
                        if param is not None:
                            param.data = param.data.clone()  # the concatenation goes once every view is replaced


def _addresses(linears) -> tuple[int, ...]:
    return tuple(p.data_ptr() for m in linears for p in (m.weight, m.bias) if p is not None)


def _fuse_mlp(
    module: torch.nn.Module, undo: list, weights: FusedWeights, tuning: FusedTuning, gemm: GemmTuning | None
) -> bool:
    """``down(silu(gate(x)) * up(x))`` as one GEMM over ``[gate; up]`` and one :func:`silu_mul` launch."""
    cls = type(module)
    if cls.__name__ not in _MLP_CLASSES or not _standard_mlp_code(cls):
        return False
    gate, up = module.gate_proj, module.up_proj
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    if not (silu and gate.bias is None and up.bias is None and _plain_linears(gate, up, module.down_proj)):
        return False
    if getattr(module.__dict__.get("forward"), "_dustin_fused", False):
        return False  # an enclosing context did it
    weight, _ = weights.share((gate, up))
    down = module.down_proj
    weight_bytes = weight.numel() * weight.element_size()
    gated_rows = (
        tuning.skinny_rows
        if weight_bytes <= tuning.gated_max_bytes
        else tuning.gated_rows
        if weight_bytes >= tuning.gated_min_large_bytes
        else 0
    )

    def forward(x):
        if x.numel() <= gated_rows * x.shape[-1]:  # decode-sized: one launch, no gate_up tensor
            hidden = gated_linear(x, weight, gemm)
        else:
            hidden = silu_mul(torch.nn.functional.linear(x, weight))
        if hidden.numel() <= tuning.skinny_rows * hidden.shape[-1]:  # decode-sized: no split-K + reduction launch
            return skinny_linear(hidden, down.weight, down.bias, gemm)
        return down(hidden)

    return _replace_forward(module, forward, undo)


def _fuse_qkv(
    module: torch.nn.Module, undo: list, weights: FusedWeights, tuning: FusedTuning, gemm: GemmTuning | None
) -> bool:
    """``q_proj``, ``k_proj``, ``v_proj`` of one input as one GEMM over ``[q; k; v]``."""
    if type(module).__name__ not in _ATTENTION_CLASSES:
        return False
    q, k, v = (getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    if not _plain_linears(q, k, v) or len({m.bias is None for m in (q, k, v)}) != 1:
        return False
    if getattr(q.__dict__.get("forward"), "_dustin_fused", False):
        return False  # an enclosing context did it
    weight, bias = weights.share((q, k, v))
    n_q, n_k = q.out_features, k.out_features
    last = {}  # the input q_proj last saw and the fused projection of it, until v_proj takes its slice

    def q_forward(x):
        out = _projection(x, weight, bias, tuning, gemm)
        last.update(x=x, out=out)
        return out[..., :n_q]

    def k_forward(x):
        if last.get("x") is x:
            return last["out"][..., n_q : n_q + n_k]
        return torch.nn.functional.linear(x, k.weight, k.bias)

    def v_forward(x):
        if last.get("x") is x:
            out = last.pop("out")
            last.clear()
            return out[..., n_q + n_k :]
        return torch.nn.functional.linear(x, v.weight, v.bias)

    for layer, forward in ((q, q_forward), (k, k_forward), (v, v_forward)):
        _replace_forward(layer, forward, undo)
    return True


def _projection(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tuning: FusedTuning, gemm: GemmTuning | None
) -> torch.Tensor:
    """``F.linear``; for at most ``tuning.skinny_rows`` rows and ``tuning.skinny_projection_max_bytes`` of weight
    one :func:`skinny_linear` launch."""
    if (
        x.numel() <= tuning.skinny_rows * x.shape[-1]
        and weight.numel() * weight.element_size() <= tuning.skinny_projection_max_bytes
    ):
        return skinny_linear(x, weight, bias, gemm)
    return torch.nn.functional.linear(x, weight, bias)
