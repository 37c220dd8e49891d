"""``torch.distributed.checkpoint`` (DCP) on torch's stock state_dict route (docs/design.md 8,
``docs/dcp.md``): ``GefenDCPState`` (the optimizer's state keyed by FQN, plus a record of its
contract, shapes and dtypes; its load stages, the ranks agree, then it publishes), the planners
that carry the record into DCP's metadata and check it (and allocate fresh buffers) before any
tensor is read, and ``read_dcp`` / ``write_dcp``: DCP <-> ``CanonicalState`` offline, memory
bounded by one chunk (``layout``: DCP's keys and its offline reader). May import every floor
below (.io, .state, .wire, .formats, .dist).
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.stateful import Stateful

from gefen.contract import OptimizerContract, contract_of
from gefen.distributed import as_field_dtensor, field_placements
from gefen.replicas import chunk_rows
from gefen_ckpt.dcp.layout import (
    FLAT,
    DCPReader,
    DCPSource,
    group_names,
    optimizer_key,
    optimizer_keys,
    read_stock,
    safe_load_dcp_metadata,
    saved_value,
    state_fields,
    stock_entries,
    storage_for,
)
from gefen_ckpt.dist import collective
from gefen_ckpt.dist.optimizer_state import (
    check_contract,
    check_group_members,
    check_param_shape,
    check_same_params,
    live_params,
    load_agreed,
    stage_state_dict,
)
from gefen_ckpt.dist.placement import is_dtensor, rows_per_chunk, to_local
from gefen_ckpt.errors import CheckpointFormatError, CheckpointMismatchError
from gefen_ckpt.formats.torch_file import field_spec, leaf_state_dict
from gefen_ckpt.state.canonical import CanonicalState, TensorSource
from gefen_ckpt.wire.dtypes import dtype_name
from gefen_ckpt.wire.manifest import parse_contract

__all__ = [
    "GefenDCPState",
    "GefenSavePlanner",
    "GefenLoadPlanner",
    "read_dcp",
    "write_dcp",
    "write_sources",
    "safe_load_dcp_metadata",
    "DCPSource",
    "RECORD_KEY",
    "PLANNER_DATA_KEY",
]

#: key, inside an optimizer's namespace, of the record (msgpack bytes: contract, shapes, dtypes)
RECORD_KEY = "gefen_ckpt"
#: key under ``Metadata.planner_data`` where ``GefenSavePlanner`` copies each record
PLANNER_DATA_KEY = "gefen_ckpt.dcp"


# ----- the record ------------------------------------------------------------------------------
def _record(contract: OptimizerContract, fqns: list[str], shapes: Mapping[str, tuple], world_size: int | None) -> bytes:
    """``fqns``: every parameter of the optimizer; ``shapes``: fqn -> (global shape, dtype) where known."""
    return msgpack.packb({"contract": contract.to_dict(), "world_size": world_size, "fqns": list(fqns),
                          "params": [[fqn, list(shape), dtype_name(dtype)] for fqn, (shape, dtype) in shapes.items()]},
                         use_bin_type=True)


def _decode_record(data: Any, what: str) -> dict:
    """The record from untrusted bytes: a ``CheckpointFormatError`` for garbage, never a crash."""
    try:
        record = msgpack.unpackb(data, raw=False, strict_map_key=True) if isinstance(data, bytes) else None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CheckpointFormatError(f"{what} is not valid msgpack: {exc}") from None
    params = record.get("params") if isinstance(record, dict) else None
    if not isinstance(params, list) or not all(isinstance(p, list) and len(p) == 3 and isinstance(p[0], str)
                                               and isinstance(p[1], list) for p in params) \
            or not isinstance(record.get("fqns"), list) or not all(isinstance(f, str) for f in record["fqns"]):
        raise CheckpointFormatError(f"{what} is malformed")
    record["contract"] = parse_contract(record.get("contract"), what)
    record["params"] = {fqn: tuple(shape) for fqn, shape, _ in params}
    return record


def _planner_record(metadata: Metadata, key: str) -> dict | None:
    data = metadata.planner_data
    raw = (data.get(PLANNER_DATA_KEY) or {}).get(key) if isinstance(data, dict) else None
    return None if raw is None else _decode_record(raw, f"the planner record of {key!r}")


def _check_record(record: dict, optimizer, live: Mapping[str, tuple]) -> None:
    """Contract, schema, FQNs and shapes of a checkpoint's record vs the live optimizer."""
    check_contract(contract_of(optimizer), record["contract"])
    check_same_params(live, record["fqns"])
    for fqn, shape in record["params"].items():
        check_param_shape(fqn, shape, live[fqn][0])


# ----- the live optimizer, keyed by FQN ----------------------------------------------------------
def _live(optimizer, model) -> tuple[list[list[str]], dict[str, tuple]]:
    """(FQNs of each of ``optimizer.param_groups``, fqn -> (parameter, its leaf contract))."""
    groups, live = {}, {}
    for _, leaf, group, fqn, p in live_params(optimizer, model):
        if fqn in live:
            raise CheckpointMismatchError(f"parameter FQN {fqn!r} appears twice in the optimizer")
        live[fqn] = (p, leaf)
        groups.setdefault(id(group), []).append(fqn)
    return [groups.get(id(g), []) for g in optimizer.param_groups], live


def _index_keyed(sd: Mapping, optimizer, groups: list[list[str]]) -> dict:
    """The inverse of ``GefenDCPState.state_dict``'s keying by FQN, checked against the live groups
    (fail before mutation: a torch optimizer's ``load_state_dict`` would change the optimizer before
    it refuses)."""
    saved = [g if isinstance(g, Mapping) else {} for g in sd.get("param_groups") or ()]
    check_group_members([g.get("params") or () for g in saved], groups)
    state = sd.get("state") or {}
    unknown = sorted(set(state) - {fqn for fqns in groups for fqn in fqns})
    if unknown:
        raise CheckpointMismatchError(f"checkpoint has state for {unknown[:3]}, which the optimizer does not hold")
    return leaf_state_dict([({**{k: v for k, v in live.items() if k != "params"}, **group}, fqns)
                            for fqns, live, group in zip(groups, optimizer.param_groups, saved)],
                           lambda fqn: dict(state[fqn]) if fqn in state else None, None)


# ----- the Stateful ------------------------------------------------------------------------------
class _GefenStateDict(dict):
    """The dict ``GefenDCPState.state_dict()`` returns; ``GefenLoadPlanner`` finds it by type.

    Copies and pickles are plain dicts (DCP's async stager copies state dicts)."""

    __slots__ = ("owner", "planned")

    def __init__(self, owner: GefenDCPState):
        super().__init__()
        self.owner, self.planned = owner, False

    def __reduce__(self):
        return (dict, (dict(self),))

    def __deepcopy__(self, memo):
        import copy

        return copy.deepcopy(dict(self), memo)

    def copy(self) -> dict:
        return dict(self)


class GefenDCPState(Stateful):
    """An optimizer's state as a DCP ``Stateful``, in torch's stock layout plus a record.

    Save::

        dcp.save({"model": model.state_dict(), "optim": GefenDCPState(opt)}, checkpoint_id=path,
                 planner=GefenSavePlanner())

    Load (any world size or mesh; the optimizer may be fresh)::

        dcp.load({"model": model.state_dict(), "optim": GefenDCPState(opt)}, checkpoint_id=path,
                 planner=GefenLoadPlanner())

    ``model`` supplies FQNs for optimizers built from bare tensors. Under a process group,
    ``load_state_dict`` agrees with the other ranks of ``process_group`` (default: the world)
    before it publishes; pass ``no_dist=True`` when only this process calls ``dcp.load``.
    ``timeout`` (seconds) bounds how long that agreement waits for a stalled rank, which it then
    names (DCP's own collectives keep the process group's timeout).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                 process_group=None, no_dist: bool = False, timeout: float | None = None):
        self.optimizer, self.model = optimizer, model
        self.process_group, self.no_dist, self.timeout = process_group, no_dist, timeout
        contract_of(optimizer)  # fail now for an optimizer without a contract

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state_dict keyed by FQN (live views, no copy) and the record."""
        groups, live = _live(self.optimizer, self.model)
        fqns = [fqn for group in groups for fqn in group]
        sd = self.optimizer.state_dict()
        out = _GefenStateDict(self)  # keyed by FQN, as torch's get_optimizer_state_dict keys it
        out["state"] = {fqns[i]: dict(entry) for i, entry in sd["state"].items()}
        out["param_groups"] = [{**g, "params": [fqns[i] for i in g["params"]]} for g in sd["param_groups"]]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        out[RECORD_KEY] = _record(contract_of(self.optimizer), list(live),
                                  {f: (p.shape, p.dtype) for f, (p, _) in live.items()}, world)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stage what ``dcp.load`` read, agree with the other ranks, publish (fail before mutation)."""
        with collective.deadline(self.timeout):
            load_agreed(lambda: self._stage(state_dict), "loading the optimizer state (DCP)", self.process_group,
                        alone=self.no_dist)

    def _stage(self, state_dict: Mapping[str, Any]):
        groups, live = _live(self.optimizer, self.model)
        if not getattr(state_dict, "planned", False) and not state_dict.get("state") and live:
            raise CheckpointMismatchError(
                "nothing was loaded into GefenDCPState: the optimizer has no state yet and dcp.load ran without "
                "planner=GefenLoadPlanner() (which allocates the buffers a fresh optimizer lacks)")
        if (raw := state_dict.get(RECORD_KEY)) is not None:
            _check_record(_decode_record(raw, "the checkpoint's gefen_ckpt record"), self.optimizer, live)
        return stage_state_dict(self.optimizer, _index_keyed(state_dict, self.optimizer, groups))


# ----- planners ---------------------------------------------------------------------------------
def _find_gefen_dicts(state_dict: Mapping, path: tuple = ()) -> Iterator[tuple[tuple, _GefenStateDict]]:
    for key, value in state_dict.items():
        if isinstance(value, _GefenStateDict):
            yield path + (str(key),), value
        elif isinstance(value, Mapping):
            yield from _find_gefen_dicts(value, path + (str(key),))


class GefenSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that copies each ``GefenDCPState``'s record (contract, schema
    version, shapes) into ``Metadata.planner_data[PLANNER_DATA_KEY]``, where ``GefenLoadPlanner``
    checks it before any tensor is read. Saving allocates nothing beyond DCP's own write path:
    ``GefenDCPState`` hands DCP views of each rank's own state."""

    def set_up_planner(self, state_dict, storage_meta: StorageMeta | None = None, is_coordinator: bool = False):
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # found by key, not by type: async_save hands the planner a staged (copied) state dict
        self._records = {key[: -len(RECORD_KEY) - 1]: value for key, value in self.state_dict.items()
                         if key.endswith("." + RECORD_KEY) and isinstance(value, bytes)}

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        planner_data = {**(metadata.planner_data or {}), PLANNER_DATA_KEY: dict(getattr(self, "_records", {}))}
        self.metadata = dataclasses.replace(metadata, planner_data=planner_data)
        return plans, self.metadata


class GefenLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that, for every ``GefenDCPState``, checks the checkpoint against the
    live optimizer (its record, every stored field's dtype and shape) before anything is read and
    allocates fresh buffers of the stored shapes (this rank's part), so a fresh optimizer loads
    and live state is never written into. ``dcp.load`` delivers its errors wrapped in its
    ``CheckpointException``. Param-group values load with ``torch.load(weights_only=True)``."""

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            for path, target in _find_gefen_dicts(state_dict):
                _allocate(".".join(path), target, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _allocate(name: str, target: _GefenStateDict, metadata: Metadata) -> None:
    """Check the checkpoint's entries under ``name`` against ``target``'s optimizer and replace
    ``target``'s contents by fresh buffers for them."""
    smd = metadata.state_dict_metadata
    if not optimizer_keys(metadata)[optimizer_key(metadata, name, "the checkpoint")]:
        raise CheckpointMismatchError(
            f"{name}.param_groups: param groups flattened by FQN: load them with torch's "
            "set_optimizer_state_dict (flatten_optimizer_state_dict=True)")
    owner = target.owner
    _, live = _live(owner.optimizer, owner.model)
    if (record := _planner_record(metadata, name)) is not None:
        _check_record(record, owner.optimizer, live)
    fields = state_fields(metadata, name)
    for fqn, names in fields.items():
        if fqn not in live:
            raise CheckpointMismatchError(f"checkpoint has state for {fqn!r}, which the optimizer does not hold")
        for field in names:
            field_spec(live[fqn][1], fqn, field)  # a foreign field is named before any dtype or shape
    groups = group_names(metadata, name, "")
    target.clear()
    target.update(state={fqn: {field: _buffer(fqn, field, smd[full], live) for field, full in names.items()}
                         for fqn, names in fields.items()},
                  param_groups=[dict.fromkeys(groups[i]) for i in sorted(groups)])
    if record is None and f"{name}.{RECORD_KEY}" in smd:  # the stored copy, checked by the Stateful
        target[RECORD_KEY] = None
    target.planned = True


def _buffer(fqn: str, name: str, md, live: Mapping[str, tuple]) -> torch.Tensor | None:
    """An empty destination for one stored field: this rank's part of it, on the parameter's device."""
    param, leaf = live[fqn]
    spec = field_spec(leaf, fqn, name)
    if isinstance(md, BytesStorageMetadata):
        return None  # a plain number (old torch's step)
    shape, dtype = tuple(md.size), md.properties.dtype
    if problem := spec.check(param.shape, shape, dtype, param.dtype):
        raise CheckpointMismatchError(f"{fqn}/{name}: checkpoint {problem}")
    device = torch.device("cpu") if spec.geometry == "scalar" else to_local(param).device
    if spec.geometry in ("scalar", "global") or not is_dtensor(param):
        return torch.empty(shape, dtype=dtype, device=device)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, _ = compute_local_shape_and_global_offset(shape, param.device_mesh, field_placements(spec.geometry, param))
    return as_field_dtensor(torch.empty(local, dtype=dtype, device=device), param, spec.geometry, shape)


# ----- offline: writing without a process group -----------------------------------------------
class _SourcesSavePlanner(GefenSavePlanner):
    """Writes tensor sources (in bounded row chunks) and ``torch.save``d values under their full
    keys; the global plan is ``GefenSavePlanner``'s, with ``mappings`` (DCP's flatten mapping) and
    ``records`` as its planner data."""

    def __init__(self, sources: dict[str, TensorSource], values: dict[str, bytes], mappings: dict,
                 chunk_bytes: int, world_size: int | None = None, records: dict | None = None):
        super().__init__()
        self.sources, self.values, self.mappings = sources, values, mappings
        self.chunk_bytes, self.world_size = max(1, int(chunk_bytes)), world_size
        self._records = records or {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.is_coordinator = is_coordinator

    def _starts(self, rows: int, step: int) -> list[int]:
        """Chunk starts: every ``step`` rows, and at each of ``world_size`` ranks' first row."""
        cuts = set(range(0, rows, step)) or {0}
        if self.world_size:
            cuts.update(start for r in range(self.world_size) if (start := chunk_rows(rows, self.world_size, r)[0])
                        < rows)
        return sorted(cuts)

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO) for key in self.values]
        for key, src in self.sources.items():
            shape = tuple(src.shape)
            props, size = TensorProperties(dtype=src.dtype), torch.Size(shape)
            step = rows_per_chunk(shape, src.dtype.itemsize, self.chunk_bytes)
            starts = self._starts(shape[0], step) if shape else [0]  # a 0-d tensor: one chunk, no offsets
            kind = WriteItemType.TENSOR if len(starts) == 1 else WriteItemType.SHARD
            for start, stop in zip(starts, starts[1:] + [shape[0] if shape else 1]):
                offsets = torch.Size((start,) + (0,) * (len(shape) - 1) if shape else ())
                sizes = torch.Size((max(stop - start, 0),) + shape[1:] if shape else ())
                items.append(WriteItem(MetadataIndex(key, offsets), kind, tensor_data=TensorWriteData(
                    ChunkStorageMetadata(offsets, sizes), props, size)))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.values[write_item.index.fqn])
        src = self.sources[write_item.index.fqn]
        chunk = write_item.tensor_data.chunk
        if not chunk.offsets:
            return src.read().detach().reshape(())
        start = chunk.offsets[0]
        return src.read(start, start + chunk.sizes[0]).detach().contiguous()


def write_sources(path: str | os.PathLike, sources: dict[str, TensorSource], values: dict[str, bytes],
                  mappings: dict, *, chunk_bytes: int = 256 << 20, world_size: int | None = None,
                  records: dict[str, bytes] | None = None) -> None:
    """Write tensor sources and ``torch.save``d values as a DCP checkpoint under their full keys,
    offline (no process group), memory bounded by one chunk of ``chunk_bytes``; ``records``: key ->
    record, copied into the planner data as ``GefenSavePlanner`` does."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    writer, path = storage_for(path, FileSystemWriter, "FsspecWriter")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        save({}, storage_writer=writer(path), no_dist=True,
             planner=_SourcesSavePlanner(sources, values, mappings, chunk_bytes, world_size, records))


def _stored_record(reader: DCPReader, key: str) -> dict | None:
    """The record of the optimizer saved under ``key``: the planner's copy, else the stored entry."""
    if (record := _planner_record(reader.metadata, key)) is not None:
        return record
    full = f"{key}.{RECORD_KEY}"
    if not isinstance(reader.metadata.state_dict_metadata.get(full), BytesStorageMetadata):
        return None
    return _decode_record(reader.values([full])[full], f"{reader.path}: {full!r}")


def read_dcp(path: str | os.PathLike, key: str | None = None) -> CanonicalState:
    """The ``CanonicalState`` of the optimizer state saved under ``key`` (default: the only one) in
    the DCP checkpoint at ``path``, in torch's stock layout. Tensors are lazy ``DCPSource`` s;
    ``.metadata`` is unpickled with an allowlist."""
    reader = DCPReader(path)
    key = optimizer_key(reader.metadata, key, str(path))
    record = _stored_record(reader, key)
    state = read_stock(reader, key, record and record["contract"])
    if record and isinstance(record.get("world_size"), int):
        state.metadata["source_topology"] = {"world_size": record["world_size"]}
    state.metadata.update({"source_format": "dcp", "path": str(path), "key": key})
    return state


def write_dcp(state: CanonicalState, path: str | os.PathLike, *, key: str = "optim", chunk_bytes: int = 256 << 20,
              world_size: int | None = None, flat: bool | None = None) -> None:
    """Write ``state`` as a DCP checkpoint in torch's stock layout under ``key``, with its record,
    for ``GefenDCPState`` or torch's ``set_state_dict`` to resume from; ``flat`` (default: as the
    source was) flattens the param groups by FQN, as torchtitan expects. Every entry of a DCP
    source outside the optimizer's key (the model, schedulers, train state) is copied as it was.
    Row chunks of at most ``chunk_bytes`` are cut at the ``torch.chunk`` boundaries of
    ``world_size`` ranks when given, so each rank then reads only its own chunks."""
    if "." in key:
        raise ValueError(f"key {key!r}: use a top-level name without dots (DCP flattens nested keys with '.')")
    flat = state.metadata.get("dcp_layout") == FLAT if flat is None else flat
    tensors, values, mappings = stock_entries(state, key, flat)
    record = _record(state.contract, state.fqns(), {f: (e.shape, e.dtype) for f, e in state.params.items()},
                     world_size)
    values[f"{key}.{RECORD_KEY}"] = saved_value(record)
    mappings[f"{key}.{RECORD_KEY}"] = (key, RECORD_KEY)
    source, source_key = state.metadata.get("path"), state.metadata.get("key")
    if state.metadata.get("source_format") == "dcp" and source is not None and source_key:
        reader = DCPReader(source)
        smd, stored = reader.metadata.state_dict_metadata, reader.metadata.planner_data
        others = [k for k in smd if not k.startswith(f"{source_key}.")]
        tensors.update({k: DCPSource(reader, k) for k in others if isinstance(smd[k], TensorStorageMetadata)})
        values.update(reader.raw_values([k for k in others if isinstance(smd[k], BytesStorageMetadata)]))
        if isinstance(stored, dict):
            mappings.update({k: tuple(stored[k]) for k in others if isinstance(stored.get(k), (tuple, list))})
    write_sources(path, tensors, values, mappings, chunk_bytes=chunk_bytes, world_size=world_size,
                  records={key: record})
