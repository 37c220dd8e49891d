"""How an optimizer sees torch.distributed: which ranks hold *different parts* of its parameters.

Global statistics are summed over exactly those ranks; replicas (DDP, HSDP's replicate dimension,
a tensor-parallel dimension that leaves a parameter whole) would count the same values twice, so only
the copy at coordinate 0 contributes. Every DTensor parameter is described on the *root* mesh its mesh
was sliced from (:class:`ParamPlacement`); row statistics a column split cuts are reduced over the one
mesh dimension that splits columns, and Muon's Newton-Schulz gathers whole matrices (:func:`row_gather`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gefen.geometry import first_copy


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh")


def shard_dim(placement) -> int | None:
    """The tensor dimension a placement splits (``Shard`` or torch's ``_StridedShard``, whose
    ``is_shard()`` is False), or None for ``Replicate`` (callers refuse ``Partial`` first)."""
    dim = getattr(placement, "dim", None)
    return dim if placement.is_shard() or dim is not None else None


def field_placements(geometry: str, param: torch.Tensor) -> tuple:
    """Placements of a state field of ``geometry`` for the DTensor ``param``: ``param`` fields follow
    every split, ``block`` and ``row`` fields the row splits (``Replicate`` where columns are split:
    their statistics are reduced over it), ``col`` fields the column split (moved to dim 0)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for placement in param.placements:
        if placement.is_partial():
            raise ValueError(f"Partial placements hold no definite values ({tuple(param.placements)})")
        dim = shard_dim(placement)
        if geometry == "param" or dim is None:
            out.append(placement)
        elif geometry in ("block", "row"):
            out.append(placement if dim == 0 else Replicate())
        elif geometry == "col":  # moved to dim 0, keeping a strided shard's split factor
            strided = isinstance(placement, _StridedShard)
            out.append(Replicate() if dim != 1 else
                       _StridedShard(0, split_factor=placement.split_factor) if strided else Shard(0))
        else:
            raise ValueError(f"geometry {geometry!r} is replicated, not laid out on a mesh")
    return tuple(out)


def as_field_dtensor(local: torch.Tensor, param: torch.Tensor, geometry: str, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's part ``local`` of a field of global ``shape`` as a DTensor on ``param``'s mesh
    (no copy: the DTensor shares ``local``'s storage)."""
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()  # contiguous
    return DTensor.from_local(local, param.device_mesh, field_placements(geometry, param), run_check=False,
                              shape=torch.Size(shape), stride=stride)


class Reducer:
    """Sums and maxes over one process group, in place (``group`` None: one process holds every
    row already, nothing to reduce)."""

    def __init__(self, group=None):
        self.group = group

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order (one ``all_gather``)."""
        import torch.distributed as dist

        everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, tensor, group=self.group)
        return torch.stack(everyone)


@dataclass(frozen=True)
class ParamPlacement:
    """Where this rank's block of one DTensor parameter lies, in terms of the root mesh:
    ``row_dims`` split dim 0, ``col_dim`` dim 1 (tensor parallelism's ``Shard(1)``), if any;
    ``replicated`` hold copies; ``row0``/``col0``: the global row and column of its first element."""

    root: object
    coordinate: tuple[int, ...]
    row_dims: frozenset[int]
    col_dim: int | None
    replicated: frozenset[int]
    row0: int
    col0: int


def _root_dims(p: torch.Tensor) -> tuple[object, list[int]]:
    """The root mesh of ``p``'s mesh and, for each of its dimensions, the root dimension it is."""
    mesh = p.device_mesh
    root = mesh._get_root_mesh()
    if root is mesh or root == mesh:
        return mesh, list(range(mesh.ndim))
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or any(n not in root_names for n in names):
        # a flattened dimension: only the mesh itself is known
        return mesh, list(range(mesh.ndim))
    return root, [root_names.index(n) for n in names]


def describe_placement(name: str, p: torch.Tensor) -> ParamPlacement:
    """The :class:`ParamPlacement` of the DTensor ``p``; refuses what no reduction can repair, naming the
    parameter, its placements and what works."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(p.placements)

    def refuse(why: str) -> ValueError:
        return ValueError(f"parameter {name}: layout {placements} on mesh {tuple(p.device_mesh.shape)} {why} "
                          "(unsupported layout); Shard(0) (FSDP2, ColwiseParallel) and, for 2-D parameters, "
                          "Shard(1) (RowwiseParallel) on one mesh dimension work")

    root, dims = _root_dims(p)
    row_dims, col_dims, replicated = set(), [], set(range(root.ndim)) - set(dims)
    for mesh_dim, placement in zip(dims, placements):
        if placement.is_partial():
            raise refuse("has Partial placements, which hold no definite values")
        dim = shard_dim(placement)
        if dim is None:
            replicated.add(mesh_dim)
        elif dim == 0:
            row_dims.add(mesh_dim)
        elif dim == 1 and p.dim() == 2:
            col_dims.append(mesh_dim)
        else:
            raise refuse(f"shards dim {dim} of a {p.dim()}-D tensor")
    if len(col_dims) > 1:
        raise refuse("splits columns over several mesh dimensions")
    row0 = col0 = 0
    if p.dim():
        local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
        row0, col0 = offset[0], (offset[1] if p.dim() > 1 else 0)
        # the hash and the checkpoint need each rank's rows to be one contiguous range
        row_only = tuple(pl if shard_dim(pl) == 0 else Replicate() for pl in placements)
        rows = distribute_tensor(torch.arange(p.shape[0]), p.device_mesh, row_only, src_data_rank=None).to_local()
        if not torch.equal(rows.cpu(), torch.arange(row0, row0 + local_shape[0])):
            raise refuse("gives this rank rows that are not one contiguous range")
    coordinate = root.get_coordinate()
    return ParamPlacement(root, tuple(coordinate), frozenset(row_dims), col_dims[0] if col_dims else None,
                  frozenset(replicated), int(row0), int(col0))


@dataclass
class ReductionPlan:
    """The reducers for global statistics, and which parameters this rank must count: ``reducer``
    sums over ``group``, the ranks (root mesh dimensions ``dims``) that hold different parts of some
    parameter; ``columns`` over the one mesh dimension that splits columns (None without TP)."""

    reducer: Reducer = field(default_factory=Reducer)
    group: object = None  # the process group ``reducer`` sums over (None: one process)
    placements: dict[int, ParamPlacement] = field(default_factory=dict)  # id(param) -> placement, DTensor params only
    dims: frozenset[int] = frozenset()
    columns: Reducer | None = None
    _tables: dict = field(default_factory=dict)  # block_table's cache

    def placement(self, p: torch.Tensor) -> ParamPlacement | None:
        return self.placements.get(id(p))

    def _first_copy(self, p: torch.Tensor, copies: Iterable[int | None]) -> bool:
        lay = self.placement(p)
        if lay is None:  # a plain tensor: every rank of the group holds all of it
            import torch.distributed as dist

            return self.group is None or dist.get_rank(self.group) == 0
        return first_copy(lay.coordinate, (d for d in copies if d in self.dims))

    def counts(self, p: torch.Tensor) -> bool:
        """Does this rank count its elements of ``p`` (no other rank of ``group`` holds them)?"""
        lay = self.placement(p)
        return self._first_copy(p, lay.replicated if lay else ())

    def counts_rows(self, p: torch.Tensor) -> bool:
        """Does this rank count its *rows* of ``p`` (per-row values, which every rank holding
        other columns of those rows has too)?"""
        lay = self.placement(p)
        return self._first_copy(p, (*lay.replicated, lay.col_dim) if lay else ())

    def offsets(self, p: torch.Tensor) -> tuple[int, int]:
        """The global (row, column) of this rank's first element of ``p`` (0, 0 unless it is split)."""
        lay = self.placement(p)
        return (lay.row0, lay.col0) if lay is not None else (0, 0)

    def splits(self, p: torch.Tensor) -> bool:
        """Is ``p`` split (rows or columns) over some mesh dimension?"""
        lay = self.placement(p)
        return lay is not None and (bool(lay.row_dims) or lay.col_dim is not None)

    def block_table(self, params: Sequence[torch.Tensor]) -> list[list[list[int]]]:
        """Where every rank of ``group`` holds each of the 2-D ``params``: ``table[rank][i] =
        [row0, rows, col0, cols, sends]`` (``sends``: 0 for a replica, so the senders' blocks tile
        each matrix once). One small ``all_gather`` the first time these parameters are asked for;
        a table whose blocks do not tile a matrix is refused."""
        key = tuple(id(p) for p in params)
        if key not in self._tables:
            rows = []
            for p in params:
                (row0, col0), local = self.offsets(p), local_tensor(p)
                rows.append([row0, local.shape[0], col0, local.shape[1], int(self.counts(p))])
            mine = torch.tensor(rows, dtype=torch.int64, device=local_tensor(params[0]).device)
            table = self.reducer.gather(mine).tolist()
            for i, p in enumerate(params):
                if sum(rank[i][1] * rank[i][3] for rank in table if rank[i][4]) != p.numel():
                    raise ValueError(f"the ranks' shards of a {tuple(p.shape)} parameter with placements "
                                     f"{tuple(p.placements)} do not tile it once (a mesh whose shards disagree)")
            self._tables[key] = table
        return self._tables[key]

    def splits_columns(self, p: torch.Tensor) -> bool:
        lay = self.placement(p)
        return lay is not None and lay.col_dim is not None

    def spread_partials(self, p: torch.Tensor, partials: torch.Tensor, columns: int) -> torch.Tensor:
        """This rank's share of a global sum ``[per-column sums (all ``columns``)..., per-row sums...]``
        from its ``partials = [its columns' sums..., per-row sums over its rows...]``: its columns
        at their global positions (zeros elsewhere: other ranks fill them), each part zeroed where
        another rank counts the same values."""
        lay = self.placement(p)
        out = partials
        if lay is not None and lay.col_dim is not None:
            n = local_tensor(p).shape[1]
            out = partials.new_zeros(columns + partials.numel() - n)
            out[lay.col0:lay.col0 + n] = partials[:n]
            out[columns:] = partials[n:]
        if not self.counts(p):
            out[:columns].zero_()
        if not self.counts_rows(p):
            out[columns:].zero_()
        return out

    def take_partials(self, p: torch.Tensor, total: torch.Tensor, columns: int) -> torch.Tensor:
        """This rank's columns (then the per-row sums) of a summed ``spread_partials`` buffer."""
        lay = self.placement(p)
        if lay is None or lay.col_dim is None:
            return total
        return torch.cat([total[lay.col0:lay.col0 + local_tensor(p).shape[1]], total[columns:]])

    def reduce_rows_(self, stats: Sequence[tuple[torch.Tensor, ...]], ops: tuple[str, ...]) -> list[tuple]:
        """Per-row values of column-split parameters, ``stats[i][k]`` reduced by ``ops[k]`` (``"sum"``
        or ``"max"``) over the ranks holding the other columns of the same rows: ONE ``all_gather``
        (float64) for all, then each reduced in rank order, the same on every rank (a NaN max stays NaN)."""
        if self.columns is None or not stats:
            return list(stats)
        parts = [t.reshape(-1).double() for row in stats for t in row]
        everyone = self.columns.gather(torch.cat(parts)).split([t.numel() for t in parts], dim=1)
        reduced = iter(e.sum(0) if ops[k % len(ops)] == "sum" else e.amax(0) for k, e in enumerate(everyone))
        return [tuple(next(reduced).to(t.dtype).view_as(t) for t in row) for row in stats]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a (possibly DTensor) parameter or gradient."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def refusal(name: str, p: torch.Tensor, who: str, alternative: str) -> ValueError:
    """The one-line error for a tensor-parallel layout an optimizer cannot honour."""
    return ValueError(f"parameter {name}: {who} does not support the tensor-parallel layout "
                      f"{tuple(p.placements)} (unsupported layout); {alternative}")


def row_gather(plan: ReductionPlan, params: list[torch.Tensor], blocks: list[torch.Tensor],
               fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """This rank's rows, whole, of ``fn(whole matrices)``, for the one computation that needs them
    (Muon's Newton-Schulz): one ``all_gather`` of every rank's blocks of the split ``params`` (a
    replica sends nothing). Whole rows: NorMuon's row statistics need no reduction, and the caller
    keeps its columns."""
    import torch.distributed as dist

    split = [i for i, p in enumerate(params) if plan.splits(p)]
    if not split:
        return fn(list(blocks))
    table = plan.block_table([params[i] for i in split])
    me, device = dist.get_rank(plan.group), blocks[split[0]].device
    sizes = [sum(r * c for _, r, _, c, sends in rank if sends) for rank in table]
    mine = torch.zeros(max(sizes), dtype=torch.float32, device=device)
    sent = [blocks[i].reshape(-1).float() for i, (*_, sends) in zip(split, table[me]) if sends]
    if sent:
        flat = torch.cat(sent)
        mine[:flat.numel()] = flat
    everyone = [torch.empty_like(mine) for _ in table]
    dist.all_gather(everyone, mine, group=plan.group)
    full = list(blocks)
    for i in split:
        full[i] = torch.empty(tuple(params[i].shape), dtype=torch.float32, device=device)
    for buffer, rank in zip(everyone, table):
        at = 0
        for i, (row0, r, col0, c, sends) in zip(split, rank):
            if sends:
                full[i][row0:row0 + r, col0:col0 + c] = buffer[at:at + r * c].view(r, c)
                at += r * c
    for i in split:
        full[i] = full[i].to(blocks[i].dtype)
    out = fn(full)
    rows = {i: (row0, r) for i, (row0, r, *_) in zip(split, table[me])}
    return [o[rows[i][0]:rows[i][0] + rows[i][1]] if i in rows else o for i, o in enumerate(out)]


def _group_over(root, dims: list[int]):
    """The process group of the ranks that differ only in the root mesh dimensions ``dims``."""
    import torch.distributed as dist

    if len(dims) == 1:
        return root.get_group(dims[0])
    if len(dims) == root.ndim and root.size() == dist.get_world_size():
        return dist.group.WORLD
    names = root.mesh_dim_names
    if not names:
        raise ValueError(f"parameters are split over mesh dimensions {dims} of an unnamed mesh; name its "
                         "dimensions (init_device_mesh(..., mesh_dim_names=...))")
    return root[tuple(names[d] for d in dims)]._flatten().get_group()


def plan_reduction(named_params: Iterable[tuple[str, torch.Tensor]]) -> ReductionPlan:
    placements, roots = {}, {}
    for name, p in named_params:
        if is_dtensor(p):
            lay = describe_placement(name, p)
            placements[id(p)] = lay
            roots.setdefault(lay.root, name)  # equal meshes compare equal
    if len(roots) > 1:
        names = list(roots.values())
        raise ValueError(f"parameters {names[:2]} are on different meshes; one optimizer needs one (root) mesh")
    dims = frozenset(d for lay in placements.values() for d in (*lay.row_dims, lay.col_dim) if d is not None)
    if not dims:
        return ReductionPlan(placements=placements)
    col_dims = {lay.col_dim for lay in placements.values()} - {None}
    if len(col_dims) > 1:
        raise ValueError(f"columns are split over several mesh dimensions {sorted(col_dims)}; tensor parallelism "
                         "needs one")
    root = next(iter(roots))
    group = _group_over(root, sorted(dims))
    columns = Reducer(root.get_group(col_dims.pop())) if col_dims else None
    return ReductionPlan(Reducer(group), group, placements, dims, columns)
