"""``torch.distributed.checkpoint`` (DCP) integration (docs/design.md 8, ``docs/dcp.md``).

``GefenDCPState(optimizer)`` is a DCP ``Stateful`` that presents an optimizer's state with
*global* shapes, so stock ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` reshard it natively,
still compressed (uint8 codes stay uint8) and bit-exact:

* row-sharded fields (geometries ``param``, ``block``, ``row``) of a DTensor parameter become
  DTensors built with ``DTensor.from_local`` on the parameter's mesh and placements, so each
  rank writes and reads only its own rows (uneven and empty shards included);
* replicated fields (``scalar``, ``col``, optimizer-wide ``global`` fields such as the codebook)
  are plain tensors, which DCP writes once;
* the namespace is flat: ``"<fqn>/<field>"``, ``"__global__/<key>"`` and ``"__gefen__"``, a
  uint8 tensor holding msgpack (never pickle) with the contract, the param groups and each
  parameter's global shape/dtype/owning child.

``GefenSavePlanner`` additionally records that description in DCP's metadata, so that
``GefenLoadPlanner`` can check the contract and schema version and the FQNs and shapes against
the live optimizer *before any tensor is read*, and allocate destination buffers for an
optimizer that has no state yet (block shapes depend on periods stored in the checkpoint).
``GefenDCPState.load_state_dict`` then assembles a ``CanonicalState`` and imports it: every rank
validates and stages first, the ranks agree (one all-reduce), and only then does any rank
publish, so a failure anywhere raises everywhere and leaves every optimizer untouched.

Plain ``dcp.load`` without ``GefenLoadPlanner`` works only into an optimizer that already has
state of the same geometry (DCP then reads in place into the live state, so only DCP's own
pre-read checks come before mutation); into a fresh optimizer it raises
``CheckpointMismatchError`` asking for the planner, and changes nothing.

``read_dcp(path)`` / ``write_dcp(state, path)`` convert between this layout and a
``CanonicalState`` offline, with no process group and memory bounded by one stored chunk.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
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
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.stateful import Stateful

from gefen.contract import (
    FieldSpec,
    OptimizerContract,
    contract_of,
)
from gefen.distributed import as_field_dtensor
from gefen_ckpt import collective
from gefen_ckpt.canonical import CanonicalState, EagerSource, LocalPart, ParamState, TensorSource
from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
)
from gefen_ckpt.exchange import (
    LiveOptimizer,
    LiveParam,
    check_contract,
    check_param_shape,
    check_same_params,
    check_schema,
    field_spec,
    live_view,
    load_agreed,
)
from gefen_ckpt.format.dtypes import dtype_name, plain, torch_dtype
from gefen_ckpt.format.manifest import parse_contract
from gefen_ckpt.layout import chunk_rows, local_rows, rows_per_chunk, to_local
from gefen_ckpt.layout import is_dtensor as _is_dtensor
from gefen_ckpt.stock_dcp import (
    ReadOnlyPlanner,
    find_flat_keys,
    find_stock_keys,
    flat_entries,
    raw_values,
    read_stock,
)

__all__ = [
    "GefenDCPState",
    "GefenSavePlanner",
    "GefenLoadPlanner",
    "read_dcp",
    "write_dcp",
    "find_gefen_keys",
    "safe_load_dcp_metadata",
    "DCPSource",
    "META_KEY",
    "GLOBAL_PREFIX",
    "PLANNER_DATA_KEY",
    "DCP_FORMAT",
    "DCP_FORMAT_VERSION",
]

#: key (inside the Stateful's namespace) of the uint8 msgpack description
META_KEY = "__gefen__"
#: prefix of optimizer-wide fields: ``"__global__/codebook"``, ``"__global__/<child>/codebook"``
GLOBAL_PREFIX = "__global__/"
#: key under ``Metadata.planner_data`` where ``GefenSavePlanner`` records each optimizer
PLANNER_DATA_KEY = "gefen_ckpt.dcp"
DCP_FORMAT = "gefen-dcp"
DCP_FORMAT_VERSION = 1

_MAGIC = b"GEFNDCP\x01"
_HEADER = len(_MAGIC) + 8
#: the description tensor is padded to a multiple of this, so that the same optimizer encodes
#: to the same size whatever its hyperparameter values (needed by plain ``dcp.load``)
_META_PAD = 4096
_MAX_META = 1 << 30


# ----- the msgpack description ---------------------------------------------------------------
def _encode_meta(meta: dict) -> torch.Tensor:
    body = msgpack.packb(meta, use_bin_type=True)
    size = -(-(_HEADER + len(body)) // _META_PAD) * _META_PAD
    buf = bytearray(size)
    buf[: len(_MAGIC)] = _MAGIC
    buf[len(_MAGIC):_HEADER] = len(body).to_bytes(8, "little")
    buf[_HEADER:_HEADER + len(body)] = body
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def _meta_bytes(tensor: torch.Tensor) -> bytes:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise CheckpointFormatError(f"the {META_KEY!r} entry is not a 1-D uint8 tensor")
    data = tensor.detach().cpu().numpy().tobytes()
    if len(data) < _HEADER or data[: len(_MAGIC)] != _MAGIC:
        raise CheckpointFormatError(f"the {META_KEY!r} entry is not a gefen DCP description (bad magic)")
    length = int.from_bytes(data[len(_MAGIC):_HEADER], "little")
    if length > len(data) - _HEADER:
        raise CheckpointFormatError(f"the {META_KEY!r} entry claims {length} bytes but holds {len(data) - _HEADER}")
    return data[_HEADER:_HEADER + length]


def _unpack(body: bytes, what: str) -> Any:
    if len(body) > _MAX_META:
        raise CheckpointFormatError(f"{what} is implausibly large ({len(body)} bytes)")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CheckpointFormatError(f"{what} is not valid msgpack: {exc}") from None


def _decode_meta(body: bytes) -> dict:
    return _check_meta(_unpack(body, "the gefen DCP description"))


def _check_meta_entry(md, what: str) -> None:
    """The stored description must be a 1-D uint8 tensor of a plausible size (checked before reading it)."""
    if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != torch.uint8 or len(md.size) != 1 \
            or md.size[0] > _MAX_META:
        raise CheckpointFormatError(f"{what} is not a plausible description tensor")


def _planner_record(metadata: Metadata, key: str) -> Any:
    """What ``GefenSavePlanner`` (or ``write_dcp``) recorded for the state saved under ``key``, decoded
    (None: nothing)."""
    data = metadata.planner_data
    record = (data.get(PLANNER_DATA_KEY) or {}).get(key) if isinstance(data, dict) else None
    return None if record is None else _unpack(record, f"the planner record of {key!r}")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckpointFormatError(f"malformed gefen DCP description: {msg}")


def _is_shape(value) -> bool:
    return isinstance(value, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)


def _check_meta(meta: Any) -> dict:
    """Structural validation of a decoded description (hostile input gets CheckpointFormatError)."""
    _need(isinstance(meta, dict), "not a map")
    _need(meta.get("format") == DCP_FORMAT, f"format {meta.get('format')!r}, expected {DCP_FORMAT!r}")
    version = meta.get("format_version")
    _need(isinstance(version, int), "format_version missing")
    if version > DCP_FORMAT_VERSION:
        raise CheckpointFormatError(
            f"gefen DCP format version {version} is newer than this gefen_ckpt ({DCP_FORMAT_VERSION})"
        )
    _need(isinstance(meta.get("schema_version"), int), "schema_version missing")
    check_schema(meta["schema_version"])
    _need(isinstance(meta.get("contract"), dict), "contract missing")
    meta["contract"] = parse_contract(meta["contract"], "the gefen DCP description's contract")
    groups = meta.get("param_groups")
    _need(isinstance(groups, list) and all(isinstance(g, dict) for g in groups), "param_groups must be a list of maps")
    for g in groups:
        _need(isinstance(g.get("params"), list) and all(isinstance(f, str) for f in g["params"]),
              "a param group's params must be a list of FQNs")
    params = meta.get("params")
    _need(isinstance(params, list), "params must be a list")
    out = {}
    for entry in params:
        _need(isinstance(entry, list) and len(entry) == 5, "a param entry must be [fqn, shape, dtype, child, state]")
        fqn, shape, dtype, child, has_state = entry
        _need(isinstance(fqn, str), "param FQN must be a string")
        _need(shape is None or _is_shape(shape), f"{fqn}: bad shape {shape!r}")
        _need(child is None or isinstance(child, str), f"{fqn}: bad child {child!r}")
        _need(isinstance(has_state, bool), f"{fqn}: bad state flag")
        _need(not has_state or (shape is not None and dtype is not None), f"{fqn}: has state but no shape/dtype")
        _need(fqn not in out, f"parameter {fqn!r} listed twice")
        out[fqn] = (None if shape is None else tuple(shape),
                    None if dtype is None else torch_dtype(dtype, f"malformed gefen DCP description: {fqn}"),
                    child, has_state)
    meta["params"] = out
    return meta


def _meta_dict(contract: OptimizerContract, groups: list[dict], params: dict[str, tuple]) -> dict:
    """The description of an optimizer whose ``params`` are fqn -> (shape, dtype, child, has
    state); shape and dtype may be None for a parameter without state."""
    return {
        "format": DCP_FORMAT,
        "format_version": DCP_FORMAT_VERSION,
        "schema_version": contract.schema_version,
        "contract": contract.to_dict(),
        "param_groups": groups,
        "params": [[fqn, None if shape is None else list(shape), None if dtype is None else dtype_name(dtype),
                    child, has_state] for fqn, (shape, dtype, child, has_state) in params.items()],
    }


# ----- the live optimizer, seen through its contract ----------------------------------------
def _global_spec(contract: OptimizerContract, key: str) -> FieldSpec:
    """The optimizer-wide field ``key`` (``"<child>/<name>"`` in a composite optimizer); KeyError if none."""
    child, name = key.split("/", 1) if "/" in key else (None, key)
    for f in contract.leaf(child).global_fields:
        if f.name == name:
            return f
    raise KeyError(key)


def _as_global(fqn: str, name: str, value: torch.Tensor, lp: LiveParam, spec: FieldSpec) -> torch.Tensor:
    """A rank-local field as DCP should see it: a DTensor of the global shape when row-sharded."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) or not spec.row_sharded or not _is_dtensor(lp.param) or value.dim() == 0:
        return value
    start, stop = local_rows(lp.param, fqn)
    if value.shape[0] != stop - start:
        raise CheckpointMismatchError(
            f"{fqn}/{name}: this rank holds {value.shape[0]} rows but owns rows [{start}, {stop}) of the parameter"
        )
    shape = (lp.param.shape[0] if lp.param.dim() else 1, *value.shape[1:])
    return as_field_dtensor(value.contiguous(), lp.param, spec.geometry, shape)


# ----- sources over what dcp.load filled in --------------------------------------------------
def _source_of(value: torch.Tensor) -> TensorSource:
    if _is_dtensor(value):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = value.to_local()
        if value.dim() == 0:
            return EagerSource(local)
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return LocalPart(local, offset[0], tuple(value.shape), True)
    return EagerSource(value)


def _split_key(key: str) -> tuple[str, str] | None:
    """``"<fqn>/<field>"`` -> (fqn, field); None for the description and global fields."""
    if key == META_KEY or key.startswith(GLOBAL_PREFIX) or "/" not in key:
        return None
    fqn, name = key.rsplit("/", 1)
    return fqn, name


def _canonical(meta: dict, entries: Mapping[str, Any], *, what: str) -> CanonicalState:
    """A CanonicalState from a checked description and ``key -> tensor/source`` entries."""
    params: dict[str, ParamState] = {}
    global_fields: dict[str, TensorSource] = {}
    described = meta["params"]
    for key, value in entries.items():
        if key == META_KEY:
            continue
        source = value if not isinstance(value, torch.Tensor) else _source_of(value)
        if key.startswith(GLOBAL_PREFIX):
            global_fields[key[len(GLOBAL_PREFIX):]] = source
            continue
        split = _split_key(key)
        if split is None or split[0] not in described or not described[split[0]][3]:
            raise CheckpointFormatError(f"{what}: entry {key!r} belongs to no parameter with state")
        fqn, name = split
        shape, dtype, child, _ = described[fqn]
        entry = params.setdefault(fqn, ParamState(shape, dtype, {}, child))
        entry.fields[name] = source
    return CanonicalState(meta["contract"], meta["param_groups"], params, global_fields,
                          metadata={"source_format": "dcp"})


# ----- the Stateful ------------------------------------------------------------------------------
class _GefenStateDict(dict):
    """The dict ``GefenDCPState.state_dict()`` returns; ``GefenLoadPlanner`` finds it by type.

    Copies and pickles are plain dicts (DCP's async stager copies state dicts)."""

    __slots__ = ("owner", "planned")

    def __init__(self, owner: GefenDCPState):
        super().__init__()
        self.owner = owner
        self.planned = False

    def __reduce__(self):
        return (dict, (dict(self),))

    def __deepcopy__(self, memo):
        import copy

        return copy.deepcopy(dict(self), memo)

    def copy(self) -> dict:
        return dict(self)


class GefenDCPState(Stateful):
    """An optimizer's state as a DCP ``Stateful`` with global shapes.

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
        self.optimizer = optimizer
        self.model = model
        self.process_group = process_group
        self.no_dist = no_dist
        self.timeout = timeout
        contract_of(optimizer)  # fail now for an optimizer without a contract

    def state_dict(self) -> dict[str, Any]:
        """Live views (no copy): rank-local rows as DTensors of the global shape where the field is
        row-sharded along a DTensor parameter, plain tensors otherwise, plus the description."""
        live = live_view(self.optimizer, self.model)
        out = _GefenStateDict(self)
        out[META_KEY] = _encode_meta(_meta_dict(live.contract, live.groups, {
            fqn: (lp.param.shape, lp.param.dtype, lp.child, lp.state is not None) for fqn, lp in live.params.items()}))
        for key in sorted(live.global_fields):
            out[GLOBAL_PREFIX + key] = live.global_fields[key]
        for fqn, lp in live.params.items():
            for name in sorted(lp.state or {}):
                spec = field_spec(lp.contract, fqn, name)
                out[f"{fqn}/{name}"] = _as_global(fqn, name, lp.state[name], lp, spec)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Import what ``dcp.load`` read into ``state_dict`` (fail before mutation, on all ranks)."""
        with collective.deadline(self.timeout):
            load_agreed(self.optimizer, lambda: self._to_canonical(state_dict), self.model,
                        "loading the optimizer state (DCP)", self.process_group, alone=self.no_dist)

    def _to_canonical(self, state_dict: Mapping[str, Any]) -> CanonicalState:
        if META_KEY not in state_dict:
            raise CheckpointMismatchError(
                "nothing was loaded into GefenDCPState: the checkpoint has no gefen description under "
                "this key, or the optimizer has no state yet and dcp.load ran without "
                "planner=GefenLoadPlanner() (which allocates the buffers a fresh optimizer lacks)"
            )
        meta = _decode_meta(_meta_bytes(state_dict[META_KEY]))
        planned = getattr(state_dict, "planned", False)
        present = {fqn for key in state_dict if (s := _split_key(key)) is not None for fqn in [s[0]]}
        lacking = [fqn for fqn, (_, _, _, has) in meta["params"].items() if has and fqn not in present]
        if lacking:
            if not planned:
                raise CheckpointMismatchError(
                    f"the checkpoint has state for {lacking[:3]} but this optimizer has no state buffers for "
                    "them: load with dcp.load(..., planner=GefenLoadPlanner()) (plain dcp.load only works "
                    "into an optimizer that already has state of the same geometry)"
                )
            raise CheckpointFormatError(f"the checkpoint describes state for {lacking[:3]} but stores none")
        return _canonical(meta, state_dict, what="DCP checkpoint")


# ----- planners ---------------------------------------------------------------------------------
def _find_gefen_dicts(state_dict: Mapping, path: tuple = ()) -> Iterator[tuple[tuple, _GefenStateDict]]:
    for key, value in state_dict.items():
        if isinstance(value, _GefenStateDict):
            yield path + (str(key),), value
        elif isinstance(value, Mapping):
            yield from _find_gefen_dicts(value, path + (str(key),))


class GefenSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that records each ``GefenDCPState``'s description (contract, schema
    version, param groups, shapes) in ``Metadata.planner_data[PLANNER_DATA_KEY]``, where
    ``GefenLoadPlanner`` checks it before any tensor is read.

    Memory: ``GefenDCPState.state_dict()`` hands DCP live views of each rank's own rows, so
    saving allocates nothing beyond DCP's own write buffers (no gather, no copy of the state)."""

    def set_up_planner(self, state_dict, storage_meta: StorageMeta | None = None, is_coordinator: bool = False):
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # found by key, not by type: async_save hands the planner a staged (copied) state dict
        self._gefen_records = {}
        for key, value in self.state_dict.items():
            if (owner := _owner_key(key)) is not None:
                world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
                record = {"meta": _meta_bytes(value), "topology": {"world_size": world}}
                self._gefen_records[owner] = msgpack.packb(record, use_bin_type=True)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        planner_data = dict(metadata.planner_data or {})
        planner_data[PLANNER_DATA_KEY] = dict(getattr(self, "_gefen_records", {}))
        self.metadata = dataclasses.replace(metadata, planner_data=planner_data)
        return plans, self.metadata


class GefenLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that, for every ``GefenDCPState`` in the state dict, checks the
    checkpoint against the live optimizer (contract, schema version, FQNs, shapes, dtypes)
    before anything is read, and allocates fresh destination buffers of the stored global
    shapes (this rank's rows only), so loading works into a fresh optimizer and never writes
    into live state. Errors are ``CheckpointMismatchError``/``CheckpointFormatError``; ``dcp.load``
    delivers them wrapped in its ``CheckpointException`` (on every rank)."""

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            for path, target in _find_gefen_dicts(state_dict):
                self._allocate(".".join(path), target, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def _allocate(self, name: str, target: _GefenStateDict, metadata: Metadata) -> None:
        prefix = name + "."
        meta_key = prefix + META_KEY
        entries = {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(prefix)}
        if META_KEY not in entries:
            found = find_gefen_keys(metadata)
            raise CheckpointMismatchError(
                f"the checkpoint has no gefen optimizer state under {name!r}"
                + (f" (it has some under {found})" if found else " (it holds no GefenDCPState at all)")
            )
        live = live_view(target.owner.optimizer, target.owner.model)
        rec = _planner_record(metadata, name)
        if rec is not None:
            if not isinstance(rec, dict) or not isinstance(rec.get("meta"), bytes):
                raise CheckpointFormatError(f"the planner record of {name!r} is malformed")
            _check_against_live(_decode_meta(rec["meta"]), live)
        fresh = _GefenStateDict(target.owner)
        for key, md in entries.items():
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointFormatError(f"{meta_key[:-len(META_KEY)]}{key}: not a tensor entry")
            fresh[key] = _allocate_entry(key, md, live)
        target.clear()
        target.update(fresh)
        target.planned = True


def _check_against_live(meta: dict, live: LiveOptimizer) -> None:
    """Contract, schema, FQNs and shapes of a checkpoint's description vs the live optimizer."""
    check_contract(live.contract, meta["contract"])
    check_same_params(live.params, [fqn for g in meta["param_groups"] for fqn in g["params"]])
    for fqn, (shape, _, _, has_state) in meta["params"].items():
        if has_state:
            check_param_shape(fqn, shape, _held_param(live, fqn))


def _held_param(live: LiveOptimizer, fqn: str) -> torch.Tensor:
    if fqn not in live.params:
        raise CheckpointMismatchError(f"checkpoint has state for {fqn!r}, which the optimizer does not hold")
    return live.params[fqn].param


def _allocate_entry(key: str, md: TensorStorageMetadata, live: LiveOptimizer) -> torch.Tensor:
    """An empty destination for one stored entry: this rank's rows of it, on the right device."""

    shape, dtype = tuple(md.size), md.properties.dtype
    if key == META_KEY:
        _check_meta_entry(md, repr(META_KEY))
        return torch.empty(shape, dtype=dtype)
    if key.startswith(GLOBAL_PREFIX):
        name = key[len(GLOBAL_PREFIX):]
        try:
            spec = _global_spec(live.contract, name)
        except KeyError:
            raise CheckpointMismatchError(
                f"optimizer-wide field {name!r} of the checkpoint is not part of {live.contract.implementation}'s state"
            ) from None
        if problem := spec.check_dtype(dtype):
            raise CheckpointMismatchError(f"optimizer-wide field {name!r}: {problem}")
        return torch.empty(shape, dtype=dtype)
    split = _split_key(key)
    if split is None:
        raise CheckpointMismatchError(f"checkpoint entry {key!r} is not gefen optimizer state")
    fqn, name = split
    param = _held_param(live, fqn)
    spec = field_spec(live.params[fqn].contract, fqn, name)
    if problem := spec.check(param.shape, shape, dtype, param.dtype):
        raise CheckpointMismatchError(f"{fqn}/{name}: checkpoint {problem}")
    local_param = to_local(param)
    device = torch.device("cpu") if spec.geometry == "scalar" else local_param.device
    if spec.row_sharded and _is_dtensor(param) and shape:
        start, stop = local_rows(param, fqn)
        local = torch.empty((stop - start,) + shape[1:], dtype=dtype, device=device)
        return as_field_dtensor(local, param, spec.geometry, shape)
    return torch.empty(shape, dtype=dtype, device=device)


# ----- offline: read and write the layout without a process group ------------------------------
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to the layout
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "bytes", "bytearray", "complex", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; this refuses every global except DCP's metadata
    dataclasses, ``torch.Size``, dtypes, layouts and memory formats (no code execution)."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                        torch.memory_format)):
            return getattr(torch, name)
        if name in _SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointFormatError(f"DCP metadata references {module}.{name}, which a safe reader refuses")


def safe_load_dcp_metadata(stream) -> Metadata:
    """Unpickle a DCP ``.metadata`` stream with an allowlist (``CheckpointFormatError`` otherwise)."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointFormatError(f"unreadable DCP metadata: {exc}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointFormatError("DCP metadata does not hold a Metadata object")
    return metadata


def _storage(path: str | os.PathLike, local: type, remote: str) -> tuple[type, str | os.PathLike]:
    """(DCP's storage class, path): ``local`` for a path or ``file://`` URL, else the fsspec one."""
    if "://" not in str(path):
        return local, path
    if str(path).startswith("file://"):
        return local, str(path)[len("file://"):]
    from torch.distributed.checkpoint import _fsspec_filesystem

    return getattr(_fsspec_filesystem, remote), path


def _storage_reader(path: str | os.PathLike):
    """A DCP storage reader (local or fsspec) whose metadata load is the allowlisted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader

    base, path = _storage(path, FileSystemReader, "FsspecReader")

    class SafeReader(base):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            mpath = self._get_metadata_path(kwargs.get("rank"))
            try:
                with self.fs.create_stream(mpath, "rb") as f:
                    metadata = safe_load_dcp_metadata(f)
            except FileNotFoundError:
                raise CheckpointIncompleteError(f"{path}: no DCP .metadata (not a committed DCP checkpoint)") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _storage_writer(path: str | os.PathLike):
    from torch.distributed.checkpoint import FileSystemWriter

    cls, path = _storage(path, FileSystemWriter, "FsspecWriter")
    return cls(path)


def _owner_key(key: str) -> str | None:
    """The state-dict key of the ``GefenDCPState`` whose description is stored under ``key``
    ('' = top level; None: ``key`` is no description)."""
    if key == META_KEY:
        return ""
    return key[: -len(META_KEY) - 1] if key.endswith("." + META_KEY) else None


def find_gefen_keys(metadata: Metadata) -> list[str]:
    """The state-dict keys under which a DCP checkpoint holds a ``GefenDCPState`` ('' = top level)."""
    return sorted(owner for key in metadata.state_dict_metadata if (owner := _owner_key(key)) is not None)


class _RowsLoadPlanner(ReadOnlyPlanner):
    """Feeds ``StorageReader.read_data`` a destination tensor that holds rows ``[start, ...)``."""

    def __init__(self, dest: torch.Tensor):
        self.dest = dest

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointFormatError(f"{read_item.dest_index.fqn}: a pickled entry where a tensor was expected")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        return narrow_tensor_by_index(self.dest, read_item.dest_offsets, read_item.lengths)


class _DCPReader:
    """One DCP checkpoint opened for reading: metadata once, then row-range reads."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.reader = _storage_reader(path)
        self.metadata = self.reader.read_metadata()
        if self.metadata.storage_data is None:
            raise CheckpointFormatError(f"{self.path}: DCP metadata has no storage index")
        self.reader.set_up_storage_reader(self.metadata, True)

    def read(self, key: str, start: int, stop: int | None) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        shape, dtype = tuple(md.size), md.properties.dtype
        if not shape:
            dest = torch.empty((), dtype=dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(()))
        else:
            stop = shape[0] if stop is None else min(stop, shape[0])
            start = max(0, min(start, stop))
            dest = torch.empty((stop - start,) + shape[1:], dtype=dtype)
            if dest.numel() == 0:
                return dest
            chunk = ChunkStorageMetadata(offsets=torch.Size((start,) + (0,) * (len(shape) - 1)),
                                         sizes=dest.shape)
        items = create_read_items_for_chunk_list(key, md, [chunk])
        covered = sum(math.prod(it.lengths) for it in items)
        if covered != dest.numel():
            raise CheckpointCorruptError(
                f"{self.path}: stored chunks of {key!r} cover {covered} of the {dest.numel()} elements requested"
            )
        try:
            self.reader.read_data(LoadPlan(items), _RowsLoadPlanner(dest)).wait()
        except CheckpointError:
            raise
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{self.path}: a data file of {key!r} is missing: {exc}") from None
        except Exception as exc:
            raise CheckpointCorruptError(f"{self.path}: reading {key!r} failed: {exc}") from None
        return dest


class DCPSource:
    """A lazy global tensor inside a DCP checkpoint: ``read(start, stop)`` reads those rows only
    (DCP's reader loads each overlapping stored chunk, i.e. at most one rank's shard, at a time)."""

    def __init__(self, reader: _DCPReader, key: str):
        self._reader, self.key = reader, key
        md = reader.metadata.state_dict_metadata[key]
        self.shape, self.dtype = tuple(md.size), md.properties.dtype

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self._reader.read(self.key, start, stop)

    def __repr__(self) -> str:
        return f"DCPSource({self.key!r}, shape={self.shape}, dtype={self.dtype})"


def read_dcp(path: str | os.PathLike, key: str | None = None) -> CanonicalState:
    """The ``CanonicalState`` of the optimizer state in the DCP checkpoint at ``path``: a
    ``GefenDCPState``, or the layout of torch's ``get_state_dict``, flattened by FQN
    (``flatten_optimizer_state_dict=True``, torchtitan) or not (``gefen_ckpt.stock_dcp``).

    ``key`` is the state-dict key it was saved under (e.g. ``"optim"``); by default the only one
    present. No process group; tensors are lazy ``DCPSource`` objects that read only the rows
    asked for. DCP's ``.metadata`` pickle is loaded with an allowlist (no code execution)."""
    reader = _DCPReader(path)
    found = find_gefen_keys(reader.metadata)
    stock = find_stock_keys(reader.metadata) + find_flat_keys(reader.metadata)
    if key is None:
        if len(found) + len(stock) != 1:
            raise CheckpointMismatchError(
                f"{path}: " + (f"several optimizer states, under {', '.join(map(repr, found + stock))}: say which "
                               "(key=, or --key)" if found or stock
                               else "this DCP checkpoint holds no GefenDCPState and no optimizer state of torch's "
                                    "get_state_dict (flattened or not)")
            )
        key = (found + stock)[0]
    elif key not in found + stock:
        raise CheckpointMismatchError(f"{path}: no optimizer state under {key!r} (found: {found + stock})")
    if key in stock:
        state = read_stock(reader, key, lambda full: DCPSource(reader, full))
        state.metadata.update({"source_format": "dcp", "path": str(path), "key": key})
        return state
    prefix = f"{key}." if key else ""
    smd = reader.metadata.state_dict_metadata
    _check_meta_entry(smd[prefix + META_KEY], f"{path}: {prefix + META_KEY!r}")
    meta = _decode_meta(_meta_bytes(reader.read(prefix + META_KEY, 0, None)))
    entries = {}
    for full, md in smd.items():
        if not full.startswith(prefix):
            continue
        sub = full[len(prefix):]
        if sub == META_KEY:
            continue
        if not key and not sub.startswith(GLOBAL_PREFIX):
            split = _split_key(sub)
            if split is None or split[0] not in meta["params"]:
                continue  # a top-level GefenDCPState shares the namespace with other entries
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointFormatError(f"{path}: {full!r} is not a tensor entry")
        entries[sub] = DCPSource(reader, full)
    state = _canonical(meta, entries, what=str(path))
    for fqn, entry in state.params.items():
        for name, src in entry.fields.items():
            _check_stored_field(state.contract, fqn, entry, name, src)
    rec = _planner_record(reader.metadata, key)
    if isinstance(rec, dict) and isinstance(rec.get("topology"), dict):
        state.metadata["source_topology"] = rec["topology"]
    state.metadata.update({"source_format": "dcp", "path": str(path), "key": key})
    return state


def _check_stored_field(contract: OptimizerContract, fqn: str, entry: ParamState, name: str, src) -> None:
    if problem := field_spec(contract.leaf(entry.child), fqn, name).check(entry.shape, src.shape, src.dtype,
                                                                          entry.dtype):
        raise CheckpointFormatError(f"{fqn}/{name}: stored {problem}")


class _SourcesSavePlanner(SavePlanner):
    """Writes tensor sources (in bounded row chunks) and ``torch.save``d values under their full
    keys, with ``planner_data`` = ``mappings`` (DCP's flatten mapping) plus ``record``."""

    def __init__(self, sources: dict[str, TensorSource], values: dict[str, bytes], mappings: dict,
                 chunk_bytes: int, world_size: int | None = None, record: dict | None = None):
        self.sources, self.values, self.mappings = sources, values, mappings
        self.chunk_bytes, self.world_size, self.record = max(1, int(chunk_bytes)), world_size, record

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
            props = TensorProperties(dtype=src.dtype)
            size = torch.Size(shape)
            if not shape:
                items.append(WriteItem(MetadataIndex(key, ()), WriteItemType.TENSOR, tensor_data=TensorWriteData(
                    ChunkStorageMetadata(torch.Size(()), torch.Size(())), props, size)))
                continue
            starts = self._starts(shape[0], rows_per_chunk(shape, src.dtype.itemsize, self.chunk_bytes))
            kind = WriteItemType.TENSOR if len(starts) == 1 else WriteItemType.SHARD
            for start, stop in zip(starts, starts[1:] + [shape[0]]):
                offsets = torch.Size((start,) + (0,) * (len(shape) - 1))
                items.append(WriteItem(MetadataIndex(key, offsets), kind, tensor_data=TensorWriteData(
                    ChunkStorageMetadata(offsets, torch.Size((max(stop - start, 0),) + shape[1:])), props, size)))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        plans, metadata = create_default_global_save_plan(all_plans)
        planner_data = dict(self.mappings)
        if self.record is not None:
            planner_data[PLANNER_DATA_KEY] = self.record
        self.metadata = dataclasses.replace(metadata, planner_data=planner_data)
        return plans, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.values[write_item.index.fqn])
        src = self.sources[write_item.index.fqn]
        chunk = write_item.tensor_data.chunk
        if not chunk.offsets:
            return src.read().detach().reshape(())
        start = chunk.offsets[0]
        return src.read(start, start + chunk.sizes[0]).detach().contiguous()


class _CanonicalSavePlanner(_SourcesSavePlanner):
    """Writes a CanonicalState in GefenDCPState's layout, one bounded row-chunk at a time."""

    def __init__(self, state: CanonicalState, key: str, chunk_bytes: int):
        prefix = f"{key}." if key else ""
        params = {fqn: (None, None, g.get("child"), False) for g in state.param_groups for fqn in g["params"]}
        params.update({fqn: (e.shape, e.dtype, params[fqn][2], True) for fqn, e in state.params.items() if fqn in params})
        meta = _meta_dict(state.contract, plain(state.param_groups, "param_groups"), params)
        meta_tensor = _encode_meta(meta)
        sources: dict[str, TensorSource] = {prefix + META_KEY: EagerSource(meta_tensor)}
        for k in sorted(state.global_fields):
            sources[prefix + GLOBAL_PREFIX + k] = state.global_fields[k]
        for fqn, entry in state.params.items():
            for name in sorted(entry.fields):
                sources[f"{prefix}{fqn}/{name}"] = entry.fields[name]
        path = (key,) if key else ()
        mappings = {k: path + (k[len(prefix):],) for k in sources}
        record = {"meta": _meta_bytes(meta_tensor), "topology": {"world_size": None, "writer": "write_dcp"}}
        super().__init__(sources, {}, mappings, chunk_bytes, record={key: msgpack.packb(record, use_bin_type=True)})
        self.canonical, self.key = state, key


def write_sources(path: str | os.PathLike, sources: dict[str, TensorSource], values: dict[str, bytes],
                  mappings: dict, *, chunk_bytes: int = 256 << 20, world_size: int | None = None) -> None:
    """Write tensor sources and ``torch.save``d values as a DCP checkpoint under their full keys,
    offline (no process group), memory bounded by one chunk of ``chunk_bytes``."""
    _save_offline(path, _SourcesSavePlanner(sources, values, mappings, chunk_bytes, world_size))


def _save_offline(path: str | os.PathLike, planner: SavePlanner) -> None:
    from torch.distributed.checkpoint import save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        save({}, storage_writer=_storage_writer(path), planner=planner, no_dist=True)


def write_dcp(state: CanonicalState, path: str | os.PathLike, *, key: str = "optim",
              chunk_bytes: int = 256 << 20) -> None:
    """Write ``state`` as a DCP checkpoint in ``GefenDCPState``'s layout under ``key``, so that
    ``dcp.load({key: GefenDCPState(opt)}, planner=GefenLoadPlanner())`` loads it on any world size.

    No process group; each tensor is written in row chunks of at most ``chunk_bytes`` (at least one
    row), read lazily from ``state``'s sources, so memory stays bounded by one chunk."""
    if "." in key:
        raise ValueError(f"key {key!r}: use a top-level name without dots (DCP flattens nested keys with '.')")
    _save_offline(path, _CanonicalSavePlanner(state, key, chunk_bytes))


def write_flat(state: CanonicalState, path, *, key: str, chunk_bytes: int = 256 << 20,
               world_size: int | None = None) -> None:
    """Write ``state`` as a DCP checkpoint in the flattened layout under ``key``, so that torch's
    ``set_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))``
    and torchtitan's ``CheckpointManager`` resume from it. When ``state`` was read from a DCP
    checkpoint, every entry of that checkpoint outside ``key`` (the model, LR schedulers,
    dataloader and train state) is copied as it was, so the result is a whole checkpoint.

    No process group; tensors are written in row chunks of at most ``chunk_bytes``, cut at the
    ``torch.chunk`` boundaries of ``world_size`` ranks when given (each rank then reads only its
    own chunks), read lazily from the sources."""
    tensors, values = flat_entries(state, key)
    mappings = {k: (key, k[len(key) + 1:]) for k in list(tensors) + list(values)}
    source = state.metadata.get("path") if state.metadata.get("source_format") == "dcp" else None
    if source is not None:
        reader = _DCPReader(source)
        smd, stored = reader.metadata.state_dict_metadata, reader.metadata.planner_data
        others = [k for k in smd if not k.startswith(f"{state.metadata.get('key')}.")]
        tensors.update({k: DCPSource(reader, k) for k in others if isinstance(smd[k], TensorStorageMetadata)})
        values.update(raw_values(reader, [k for k in others if isinstance(smd[k], BytesStorageMetadata)]))
        if isinstance(stored, dict):
            mappings.update({k: tuple(stored[k]) for k in others if isinstance(stored.get(k), (tuple, list))})
    write_sources(path, tensors, values, mappings, chunk_bytes=chunk_bytes, world_size=world_size)
