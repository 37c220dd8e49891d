"""How an optimizer sees torch.distributed: which ranks hold *different rows* of its parameters.

Global statistics (period choice, codebook histogram, factored second moment) must be summed
over exactly the ranks that split a parameter's rows: the shard dimension of an FSDP2/HSDP
mesh. Replicas (DDP, the replicate dimension of HSDP) hold the same rows and must not be
counted twice, so a parameter that is not row-sharded contributes from one rank only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gefen.reduce import LocalReducer, Reducer


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh")


class ProcessGroupReducer:
    """Sum over the process group of one mesh dimension (float64/int64 tensors, in place)."""

    def __init__(self, group):
        self.group = group

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor


def _row_shard_dim(name: str, p: torch.Tensor) -> int | None:
    """The mesh dimension that splits ``p``'s rows, or None if every rank holds all of them."""
    dims = []
    for i, placement in enumerate(p.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise ValueError(
                    f"parameter {name}: layout {tuple(p.placements)} shards dim {placement.dim}; Gefen's blocks "
                    "live inside rows, so only Shard(0) and Replicate are supported (unsupported layout)"
                )
            dims.append(i)
        elif placement.is_partial():
            raise ValueError(f"parameter {name}: Partial placements are not supported (unsupported layout)")
    if len(dims) > 1:
        raise ValueError(f"parameter {name}: rows sharded over several mesh dimensions (unsupported layout)")
    return dims[0] if dims else None


@dataclass
class ReductionPlan:
    """The reducer for global sums, and which parameters this rank must count."""

    reducer: Reducer
    silent: set[int] = field(default_factory=set)  # ids of params whose rows another rank counts

    def counts(self, p: torch.Tensor) -> bool:
        return id(p) not in self.silent


def plan_reduction(named_params: Iterable[tuple[str, torch.Tensor]]) -> ReductionPlan:
    named = list(named_params)
    groups, replicated = {}, []
    for name, p in named:
        dim = _row_shard_dim(name, p) if is_dtensor(p) else None
        if dim is None:
            replicated.append(p)
        else:
            groups[(p.device_mesh, dim)] = (p.device_mesh, dim, name)  # equal meshes compare equal
    if not groups:
        return ReductionPlan(LocalReducer())
    if len(groups) > 1:
        names = [n for _, _, n in groups.values()]
        raise ValueError(f"parameters {names[:2]} are sharded over different meshes; one optimizer needs one mesh")
    mesh, dim, _ = next(iter(groups.values()))
    local_rank = mesh.get_local_rank(dim)
    silent = {id(p) for p in replicated} if local_rank != 0 else set()
    return ReductionPlan(ProcessGroupReducer(mesh.get_group(dim)), silent)
