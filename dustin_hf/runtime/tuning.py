"""Every tunable constant of the decode loop's GPU path in one frozen object: the kernels' launch heuristics and
which projections run as Triton GEMMs.

    tuning = Tuning().with_value("kernels.verify.sparse_programs_per_sm", 2)

A benchmark compares variants by building one :class:`Tuning` per variant and passing it in; nothing changes
for the calls that do not get it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..kernels.tuning import KernelTuning, check_parts
from .fused import FusedTuning

__all__ = ["Tuning"]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernels' tuning (:class:`~dustin_hf.kernels.tuning.KernelTuning`) and the fused projections'
    (:class:`~dustin_hf.runtime.fused.FusedTuning`); the defaults are the values measured best."""

    kernels: KernelTuning = dataclasses.field(default_factory=KernelTuning)
    fused: FusedTuning = dataclasses.field(default_factory=FusedTuning)

    def __post_init__(self):
        check_parts(self)

    @classmethod
    def paths(cls) -> tuple[str, ...]:
        """Every dotted path :meth:`with_value` takes, e.g. ``"kernels.verify.sparse_programs_per_sm"``."""
        return tuple(_paths(cls()))

    def with_value(self, path: str, value: Any) -> Tuning:
        """A copy with the field at the dotted ``path`` set to ``value`` (validated as at construction).

        Raises ``ValueError`` for a path that names no tunable field, listing the valid ones."""
        if path not in self.paths():
            raise ValueError(f"unknown tuning path {path!r}; valid paths: {', '.join(self.paths())}")
        return _replaced(self, path.split("."), value)


def _paths(obj, prefix: str = ""):
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            yield from _paths(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}"


def _replaced(obj, parts: list[str], value: Any):
    name, rest = parts[0], parts[1:]
    return dataclasses.replace(obj, **{name: _replaced(getattr(obj, name), rest, value) if rest else value})
