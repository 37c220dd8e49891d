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


def field_placements(geometry: str, param: torch.Tensor) -> tuple:
    """Placements of a state field of ``geometry`` for the DTensor ``param``.

    Fields indexed by the parameter's rows (``param``, ``block``, ``row``) split like its rows;
    ``param`` fields follow every split; a split along another dimension cuts blocks and rows,
    whose statistics are then reduced over that mesh dimension, so such fields are ``Replicate``
    there. ``col`` fields are indexed by the second dimension: ``Shard(0)`` where the parameter
    is ``Shard(1)``, else ``Replicate``.
    """
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for placement in param.placements:
        if placement.is_partial():
            raise ValueError(f"Partial placements hold no definite values ({tuple(param.placements)})")
        if geometry == "param" or not placement.is_shard():
            out.append(placement)
        elif geometry in ("block", "row"):
            out.append(placement if placement.dim == 0 else Replicate())
        elif geometry == "col":
            out.append(Shard(0) if placement.dim == 1 else Replicate())
        else:
            raise ValueError(f"geometry {geometry!r} is replicated, not laid out on a mesh")
    return tuple(out)


def as_field_dtensor(local: torch.Tensor, param: torch.Tensor, geometry: str, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's part ``local`` of a field of global ``shape`` as a DTensor on ``param``'s mesh
    (no copy: the DTensor shares ``local``'s storage)."""
    from torch.distributed.tensor import DTensor

    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return DTensor.from_local(local, param.device_mesh, field_placements(geometry, param), run_check=False,
                              shape=torch.Size(shape), stride=tuple(reversed(stride)))


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
                    f"parameter {name}: layout {tuple(p.placements)} shards dim {placement.dim}, which cuts the "
                    "rows Gefen's blocks and row statistics live in (unsupported layout); shard dim 0 "
                    "(FSDP2 fully_shard, ColwiseParallel) or replicate it"
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
    group: object = None  # the process group of the row-shard mesh dimension (None: one process)

    def counts(self, p: torch.Tensor) -> bool:
        return id(p) not in self.silent


def chunk_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """Each rank's rows under ``Shard(0)`` (``torch.chunk`` semantics; trailing ranks may be empty)."""
    size = -(-rows // parts) if parts else 0
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(parts)]


class RowGather:
    """Whole matrices for the one computation that needs them (Muon's Newton-Schulz).

    Every row-sharded matrix's local rows go into one flat buffer, one ``all_gather`` moves
    them all, every rank runs ``fn`` on the whole matrices and keeps its own rows. Matrices
    that are not row-sharded are already whole.
    """

    def __init__(self, group):
        self.group = group

    def orthogonalise_rows(self, params: list[torch.Tensor], rows: list[torch.Tensor], fn) -> list[torch.Tensor]:
        import torch.distributed as dist

        world, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        sharded = [i for i, p in enumerate(params) if is_dtensor(p) and any(pl.is_shard() for pl in p.placements)]
        bounds = {i: chunk_bounds(params[i].shape[0], world) for i in sharded}
        cols = {i: rows[i].shape[1] for i in sharded}
        sizes = [sum((bounds[i][r][1] - bounds[i][r][0]) * cols[i] for i in sharded) for r in range(world)]
        mine = torch.zeros(max(sizes, default=0), dtype=torch.float32, device=rows[0].device if rows else None)
        if sharded:
            flat = torch.cat([rows[i].reshape(-1).float() for i in sharded])
            mine[: flat.numel()] = flat
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=self.group)
        full = list(rows)
        offsets = [0] * world
        for i in sharded:
            parts = []
            for r in range(world):
                n = (bounds[i][r][1] - bounds[i][r][0]) * cols[i]
                parts.append(everyone[r][offsets[r]:offsets[r] + n].view(-1, cols[i]))
                offsets[r] += n
            full[i] = torch.cat(parts).to(rows[i].dtype)
        out = fn(full)
        return [o[bounds[i][me][0]:bounds[i][me][1]] if i in bounds else o for i, o in enumerate(out)]


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
    group = mesh.get_group(dim)
    return ReductionPlan(ProcessGroupReducer(group), silent, group)
