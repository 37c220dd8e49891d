"""The canonical state: an optimizer's state with no topology left in it (docs/design.md 5). Each
field is a global tensor held as a ``TensorSource`` (a live tensor, a mapped region, a remote
range read), so offline tools read only the rows they need."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gefen.contract import OptimizerContract
from gefen_ckpt.errors import CheckpointError

if TYPE_CHECKING:  # annotations only: a description (``gefen-ckpt inspect``, ``verify``) needs no torch
    import torch


class TensorSource(Protocol):
    """A global tensor that can hand out any range of rows (dim 0) on demand."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` (the whole tensor for a 0-D source, whatever the range)."""


class EagerSource:
    """A tensor already in memory (it is not copied: a live optimizer's tensor stays live)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape, self.dtype = tensor, tuple(tensor.shape), tensor.dtype

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self.tensor.dim() == 0 or (start == 0 and stop in (None, self.tensor.shape[0])):
            return self.tensor  # no slicing op: each torch op releases the GIL (see wire.many_writers._in_memory)
        return self.tensor[start:stop]

    def __repr__(self) -> str:
        return f"EagerSource(shape={self.shape}, dtype={self.dtype})"


class LocalPart:
    """The rows a rank holds of a global tensor (``export_canonical`` under a process group):
    ``tensor`` is rows ``[row_start, row_start + len)``; ``writer`` marks the first replica
    (``transport.gather``'s source, a save's writer where no rule applies); ``holders``: every rank
    holding these rows (``gefen.replicas.Holders``, None: no chunk rule describes them). Reading
    other rows is an error: move state with ``gefen_ckpt.transport``.
    """

    def __init__(self, tensor: torch.Tensor, row_start: int, shape: tuple[int, ...], writer: bool,
                 holders=None):
        self.tensor, self.row_start, self.shape, self.writer = tensor, row_start, tuple(shape), writer
        self.dtype = tensor.dtype
        self.holders = holders

    @property
    def row_stop(self) -> int:
        return self.row_start + (self.tensor.shape[0] if self.tensor.dim() else 1)

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self.tensor.dim() == 0:
            return self.tensor
        stop = self.shape[0] if stop is None else stop
        if start < self.row_start or stop > self.row_stop:
            raise CheckpointError(
                f"rows [{start}, {stop}) are not held by this rank (it holds [{self.row_start}, {self.row_stop})); "
                "use gefen_ckpt.transport.gather to collect them"
            )
        if start == self.row_start and stop == self.row_stop:
            return self.tensor
        return self.tensor[start - self.row_start:stop - self.row_start]

    def __repr__(self) -> str:
        return f"LocalPart(rows={self.row_start}:{self.row_stop}, shape={self.shape}, dtype={self.dtype})"


def nbytes(source: TensorSource) -> int:
    return math.prod(source.shape) * source.dtype.itemsize


def global_key(child: str | None, name: str) -> str:
    """The ``global_fields`` key of child optimizer ``child``'s field ``name`` (outside composites: ``name``)."""
    return f"{child}/{name}" if child else name


@dataclass
class ParamState:
    """One parameter's state: its global shape and dtype, and each field as a global tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fields: dict[str, TensorSource]
    child: str | None = None  # which child optimizer owns it (composite optimizers only)


@dataclass
class CanonicalState:
    """Topology-free optimizer state. ``param_groups``: hyperparameters plus ``"params"``, the
    member FQNs in order (and ``"child"`` in a composite optimizer); ``params``: FQN ->
    ``ParamState`` for every parameter with state; ``global_fields``: optimizer-wide fields (the
    codebook), keyed ``"<child>/<field>"`` for a composite's children; ``metadata``: informational.
    """

    contract: OptimizerContract
    param_groups: list[dict]
    params: dict[str, ParamState]
    global_fields: dict[str, TensorSource] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    def fqns(self) -> list[str]:
        """Every parameter FQN of the optimizer (with or without state), in group order."""
        return [fqn for group in self.param_groups for fqn in group["params"]]

    def tensors(self) -> Iterator[tuple[str, TensorSource]]:
        """("<fqn>/<field>" or global key, source) for every tensor, in a stable order."""
        for key in sorted(self.global_fields):
            yield key, self.global_fields[key]
        for fqn, entry in self.params.items():
            for name in sorted(entry.fields):
                yield f"{fqn}/{name}", entry.fields[name]

    def globals_of(self, child: str | None) -> dict[str, TensorSource]:
        """One (child) optimizer's optimizer-wide fields, by bare name (``codebook``, ...)."""
        prefix = global_key(child, "")
        return {k[len(prefix):]: s for k, s in self.global_fields.items()
                if k.startswith(prefix) and "/" not in k[len(prefix):]}

    def total_bytes(self) -> int:
        return sum(nbytes(src) for _, src in self.tensors())

    def materialize(self) -> CanonicalState:
        """A copy whose every tensor is in memory and owned (safe across optimizer steps)."""
        return self.with_sources(lambda _, s: EagerSource(s.read().clone()))

    def with_sources(self, make: Callable[[str, TensorSource], TensorSource]) -> CanonicalState:
        """A copy (groups and metadata copied too) whose tensor of each ``tensors()`` key is ``make(key, source)``."""
        return CanonicalState(
            contract=self.contract,
            param_groups=[dict(g, params=list(g["params"])) for g in self.param_groups],
            params={fqn: ParamState(e.shape, e.dtype, {k: make(f"{fqn}/{k}", s) for k, s in e.fields.items()}, e.child)
                    for fqn, e in self.params.items()},
            global_fields={k: make(k, s) for k, s in self.global_fields.items()},
            metadata=dict(self.metadata),
        )
