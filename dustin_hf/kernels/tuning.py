"""The tunable constants of the Triton kernels' launch heuristics: one frozen dataclass per kernel module, the
values measured best as defaults, and :class:`KernelTuning` bundling them.

A launcher takes its tuning as an argument (``tuning=None``: the defaults), so a benchmark compares variants by
passing them, and no call changes what another call does. What a kernel's registers or shared memory bound
(a maximum split count, a tile limit) is not tunable and stays a constant of its module; so do the launch
choices of one call (tile sizes, split count), which each module's ``launch_config`` takes as keywords.

Importing this module imports no Triton.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

__all__ = [
    "ArgmaxTuning",
    "Checked",
    "GemmTuning",
    "KernelTuning",
    "ScoreTuning",
    "SelectTuning",
    "VerifyTuning",
    "check_parts",
]


class Checked:
    """Base of the tuning dataclasses: construction checks that every field is an int of at least ``minimum``
    (or a non-empty tuple of such ints) and that the fields named in ``powers_of_two`` are powers of two."""

    minimum: ClassVar[int] = 1
    powers_of_two: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            values = value if isinstance(value, tuple) and value else (value,)
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= self.minimum for v in values):
                kind = "a non-empty tuple of ints" if isinstance(field.default, tuple) else "an int"
                raise ValueError(f"{type(self).__name__}.{field.name} must be {kind} >= {self.minimum}; got {value!r}")
        for name in self.powers_of_two:
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{type(self).__name__}.{name} must be a power of two; got {value}")


@dataclasses.dataclass(frozen=True)
class VerifyTuning(Checked):
    """The verification attention kernel's heuristic (:func:`dustin_hf.kernels.triton_verify.launch_config`).

    Attributes:
        programs_per_sm: dense mode splits the keys until the grid holds about this many programs per SM.
        min_blocks_per_split: a split reads at least this many key tiles (amortising its q load and partial
            write).
        sparse_programs_per_sm: sparse mode with several queries aims for one program per SM: a program holds
            three K/V tiles of shared memory (5 stages), so a second one on the SM waits for the first, and a
            split costs its merge.
        decode_programs_per_sm, decode_min_blocks_per_split, decode_num_warps: sparse mode with one query (a
            draft's decode step) has little work per key tile, so its keys are split finer, one tile a split,
            on 2 warps.
        short_range_blocks: a key range of at most this many tiles (a sparse read of a budget) whose programs
            fill half the SMs already is not split: its merge would cost more than the split saves.
        sparse_stages: software-pipelining depths tried in sparse mode, deepest first: 5 keeps one K/V tile in
            flight beyond the one computed (the index loads take the other stages); a second one in flight
            costs more registers and shared memory than it hides.
        pipeline_smem_bytes: shared memory the sparse pipeline's K/V buffers and q tile may take per program
            (an sm_90 block may use 227 KiB).
        full_rows_divisor: a sparse call whose rows may read in full (``full_rows``) splits those rows' keys as a
            dense call of ``batch // full_rows_divisor`` rows would: finer than a whole dense batch, so that one such
            row spreads over many SMs, while a batch of them takes a few waves.
    """

    programs_per_sm: int = 2
    min_blocks_per_split: int = 2
    sparse_programs_per_sm: int = 1
    decode_programs_per_sm: int = 3
    decode_min_blocks_per_split: int = 1
    decode_num_warps: int = 2
    short_range_blocks: int = 16
    sparse_stages: tuple[int, ...] = (5, 3)
    pipeline_smem_bytes: int = 160 * 1024
    full_rows_divisor: int = 4


@dataclasses.dataclass(frozen=True)
class GemmTuning(Checked):
    """The decode GEMMs' heuristic (:func:`dustin_hf.kernels.triton_gemm.launch_config`).

    Attributes:
        waves: a long ``K`` is split until the grid gives every SM about this many programs.
        min_split_k_tiles: a ``K`` of fewer weight tiles is not split.
        max_splits: the most splits of ``K``.
        num_stages: software-pipelining stages of the weight stream: a decode GEMM's time is its weight read,
            which needs 5 tiles in flight to reach copy bandwidth.
        gated_block_n, gated_num_stages: ``gated_linear``'s tiles (64 columns of gate and of up) and stages;
            on a GPU whose blocks have less shared memory the stages are reduced to fit.
    """

    powers_of_two = ("gated_block_n",)

    waves: int = 2
    min_split_k_tiles: int = 16
    max_splits: int = 16
    num_stages: int = 6
    gated_block_n: int = 64
    gated_num_stages: int = 4


@dataclasses.dataclass(frozen=True)
class ScoreTuning(Checked):
    """The scoring kernels' heuristic (:func:`dustin_hf.kernels.triton_score.launch_config`).

    Attributes:
        programs_per_sm: pass 1 splits the keys until the grid holds about this many programs per SM. Pass 1
            streams keys: an SM needs ~25-40 KB of loads in flight to keep its share of HBM busy, and every
            program also spends a latency-bound stretch per tile (dot, row max/sum shuffles, the score store's
            layout change) with no load issued; 4 programs of 4 warps, each with ``num_stages - 1`` key tiles
            of ~16 KB prefetched, hide it (the draft's pass 1 uses ~123 registers a thread, so 4 programs of 4
            warps fill an SM's register file). 8, with 16-row pass 2 blocks, made no whole step faster that
            matters on the H200 (7B + 0.5B, 32k, batch 16): Dustin + sparse draft 8.900 against 8.891 ms, the
            knob 20.07 against 19.86, the selection layers 9.751 against 9.775.
        tile_bytes: pass 1's key bytes per tile (``block_n * head_dim * key_bytes``).
        min_blocks_per_split: a pass 1 split walks at least this many key tiles (amortising its q load).
        pass2_step_elements: pass 2 loads about this many scores a loop step (rows padded to row blocks).
        pass2_block_r: pass 2's rows per row block.
        pass2_stages: pass 2's software-pipelining stages: 3 keep one step's loads in flight while one is
            computed (2 wait for each step's loads).
        pass2_warps_per_sm: pass 2's programs are sized to this many warps an SM, in one wave (at the headline
            shapes its programs take at most 127 registers and 50 KB of shared memory, so 4 of 4 warps fit).
    """

    powers_of_two = ("pass2_block_r",)

    programs_per_sm: int = 4
    tile_bytes: int = 16384
    min_blocks_per_split: int = 4
    pass2_step_elements: int = 4096
    pass2_block_r: int = 8
    pass2_stages: int = 3
    pass2_warps_per_sm: int = 16


@dataclasses.dataclass(frozen=True)
class SelectTuning(Checked):
    """The selection kernels' chunking (:func:`dustin_hf.kernels.triton_select.launch_config`).

    Attributes:
        min_chunk: launch 1's smallest chunk of positions per program (a power of two).
        target_pool: chunks grow until the history pool is at most this large (launch 2 is one program per row,
            so it should hold few entries).
    """

    powers_of_two = ("min_chunk",)

    min_chunk: int = 1024
    target_pool: int = 4096


@dataclasses.dataclass(frozen=True)
class ArgmaxTuning(Checked):
    """The argmax kernel's split (:func:`dustin_hf.kernels.triton_argmax.argmax_triton`).

    Attributes:
        block: elements per tile (a power of two).
        programs_per_sm: rows are cut into chunks until the grid holds about this many programs per SM.
    """

    powers_of_two = ("block",)

    block: int = 4096
    programs_per_sm: int = 4


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Every kernel's tuning, for callers that pass one object down to all launches."""

    verify: VerifyTuning = dataclasses.field(default_factory=VerifyTuning)
    gemm: GemmTuning = dataclasses.field(default_factory=GemmTuning)
    score: ScoreTuning = dataclasses.field(default_factory=ScoreTuning)
    select: SelectTuning = dataclasses.field(default_factory=SelectTuning)
    argmax: ArgmaxTuning = dataclasses.field(default_factory=ArgmaxTuning)

    def __post_init__(self):
        check_parts(self)


def check_parts(bundle) -> None:
    """Raise ``ValueError`` unless every field of the dataclass ``bundle`` holds an instance of the class its
    default is made by."""
    for field in dataclasses.fields(bundle):
        value, expected = getattr(bundle, field.name), field.default_factory
        if not isinstance(value, expected):
            raise ValueError(f"{type(bundle).__name__}.{field.name} must be a {expected.__name__}; got {value!r}")
