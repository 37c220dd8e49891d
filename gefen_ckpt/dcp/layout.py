"""Offline DCP (no process group): a checkpoint opened for lazy reading (``DCPReader``, its
``.metadata`` unpickled with an allowlist), and the layouts torch's own checkpoint API writes.

``get_state_dict`` + ``dcp.save`` stores each field as a tensor ``"<key>.state.<fqn>.<field>"``
(global shape) and each param-group value as a ``torch.save``d entry
``"<key>.param_groups.<i>.<name>"``; flattened (``flatten_optimizer_state_dict=True``, torchtitan)
the groups are ``"<key>.param_groups.<fqn>.<name>"``, rebuilt from ``param_names`` when saved,
else from equal hyperparameters. Both become a state_dict for ``formats.torch_file``'s one converter.
Values are read with ``torch.load(weights_only=True)``: no code runs.
"""

from __future__ import annotations

import io
import math
import os
import pickle

import fsspec
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from gefen.contract import CHILD_KEY, composite_children
from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
)
from gefen_ckpt.io.storage import require_regular_entries
from gefen_ckpt.state.canonical import CanonicalState

__all__ = ["DCPReader", "DCPSource", "safe_load_dcp_metadata", "storage_for", "optimizer_key", "optimizer_keys",
           "state_fields", "group_names", "read_stock", "stock_entries", "FLAT"]

_STATE, _GROUPS = ".state.", ".param_groups."
#: ``CanonicalState.metadata["dcp_layout"]`` of a state read from (and to be written as) the flat layout
FLAT = "flat"


def optimizer_keys(metadata) -> dict[str, bool]:
    """Every state-dict key under which torch's layout holds param groups -> whether they are
    numbered (``get_state_dict``'s ``<key>.param_groups.<i>.params``) rather than flattened."""
    found: dict[str, bool] = {}
    for full, md in metadata.state_dict_metadata.items():
        if _GROUPS in full and isinstance(md, BytesStorageMetadata):
            key, rest = full.split(_GROUPS, 1)
            index, _, name = rest.partition(".")
            found[key] = found.get(key, False) or (name == "params" and index.isdigit())
    return found


def optimizer_key(metadata, key: str | None, where: str) -> str:
    """``key`` (default: the only one) among the keys holding optimizer state; else a mismatch
    error naming those there are."""
    found = sorted(optimizer_keys(metadata))
    if key is None and len(found) != 1:
        raise CheckpointMismatchError(
            f"{where}: " + (f"several optimizer states, under {', '.join(map(repr, found))}: say which "
                            "(key=, or --key)" if found else "this DCP checkpoint holds no optimizer state"))
    if key is not None and key not in found:
        raise CheckpointMismatchError(f"{where}: no optimizer state under {key!r} (found: {found})")
    return found[0] if key is None else key


class ReadOnlyPlanner(DefaultLoadPlanner):
    """What ``StorageReader.read_data`` calls when gefen-ckpt reads offline, without a state dict
    or a plan of DCP's own: tensor reads go into ``dest`` (rows ``[start, ...)``), else the raw
    bytes of ``torch.save``d entries are collected in ``values``."""

    def __init__(self, dest: torch.Tensor | None = None):
        super().__init__()
        self.dest, self.values = dest, {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self.dest is not None:
            raise CheckpointFormatError(
                f"{read_item.dest_index.fqn}: a pickled entry where a tensor was expected")
        self.values[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if self.dest is None:
            raise CheckpointFormatError(
                f"{read_item.dest_index.fqn}: a tensor where a param-group value was expected")
        from torch.distributed._shard._utils import narrow_tensor_by_index

        return narrow_tensor_by_index(self.dest, read_item.dest_offsets, read_item.lengths)


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


def storage_for(path: str | os.PathLike, local: type, remote: str) -> tuple[type, str | os.PathLike]:
    """(DCP's storage class, path): ``local`` for a path or ``file://`` URL, else the fsspec one."""
    if "://" not in str(path):
        return local, path
    if str(path).startswith("file://"):
        return local, str(path)[len("file://"):]
    from torch.distributed.checkpoint import _fsspec_filesystem

    return getattr(_fsspec_filesystem, remote), path


class DCPReader:
    """One DCP checkpoint opened for reading: metadata once, then row-range reads."""

    def __init__(self, path: str | os.PathLike):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = str(path)
        require_regular_entries(*fsspec.core.url_to_fs(self.path), self.path)  # torch's reader opens them
        base, path = storage_for(path, FileSystemReader, "FsspecReader")

        class SafeReader(base):  # its metadata load is the allowlisted unpickler
            def read_metadata(self, *args, **kwargs) -> Metadata:
                mpath = self._get_metadata_path(kwargs.get("rank"))
                try:
                    with self.fs.create_stream(mpath, "rb") as f:
                        metadata = safe_load_dcp_metadata(f)
                except FileNotFoundError:
                    raise CheckpointIncompleteError(
                        f"{path}: no DCP .metadata (not a committed DCP checkpoint)") from None
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        self.reader = SafeReader(path)
        self.metadata = self.reader.read_metadata()
        if self.metadata.storage_data is None:
            raise CheckpointFormatError(f"{self.path}: DCP metadata has no storage index")
        self.reader.set_up_storage_reader(self.metadata, True)

    def read(self, key: str, start: int, stop: int | None) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        shape, dtype = tuple(md.size), md.properties.dtype
        rows = shape[0] if shape else 1  # a 0-d tensor: one "row", no offsets
        stop = rows if stop is None else min(stop, rows)
        start = max(0, min(start, stop))
        dest = torch.empty((stop - start,) + shape[1:] if shape else (), dtype=dtype)
        if dest.numel() == 0:
            return dest
        offsets = (start,) + (0,) * (len(shape) - 1) if shape else ()
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
        items = create_read_items_for_chunk_list(key, md, [chunk])
        covered = sum(math.prod(it.lengths) for it in items)
        if covered != dest.numel():
            raise CheckpointCorruptError(f"{self.path}: stored chunks of {key!r} cover {covered} of the "
                                         f"{dest.numel()} elements requested")
        try:
            self.reader.read_data(LoadPlan(items), ReadOnlyPlanner(dest)).wait()
        except CheckpointError:
            raise
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{self.path}: a data file of {key!r} is missing: {exc}") from None
        except Exception as exc:
            raise CheckpointCorruptError(f"{self.path}: reading {key!r} failed: {exc}") from None
        return dest

    def raw_values(self, keys: list[str]) -> dict[str, bytes]:
        """The stored bytes of each ``torch.save``d entry, unparsed (copied as they are)."""
        none = torch.Size((0,))
        items = [ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(k), dest_offsets=none,
                          storage_index=MetadataIndex(k), storage_offsets=none, lengths=none) for k in keys]
        planner = ReadOnlyPlanner()
        if items:
            self.reader.read_data(LoadPlan(items), planner).wait()
        return planner.values

    def values(self, keys: list[str]) -> dict[str, object]:
        """``torch.load(weights_only=True)`` of each bytes entry: plain numbers, strings, lists only."""
        out = {}
        for key, raw in self.raw_values(keys).items():
            try:
                out[key] = torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as exc:
                raise CheckpointFormatError(
                    f"{self.path}: {key!r} is not a plain param-group value: {exc}") from None
        return out


class DCPSource:
    """A lazy global tensor inside a DCP checkpoint: ``read(start, stop)`` reads those rows only
    (DCP's reader loads each overlapping stored chunk, i.e. at most one rank's shard, at a time)."""

    def __init__(self, reader: DCPReader, key: str):
        self._reader, self.key = reader, key
        md = reader.metadata.state_dict_metadata[key]
        self.shape, self.dtype = tuple(md.size), md.properties.dtype

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self._reader.read(self.key, start, stop)

    def __repr__(self) -> str:
        return f"DCPSource({self.key!r}, shape={self.shape}, dtype={self.dtype})"


def state_fields(metadata, key: str) -> dict[str, dict[str, str]]:
    """fqn -> field -> full key, of every ``<key>.state.<fqn>.<field>`` entry."""
    prefix, out = key + _STATE, {}
    for full in metadata.state_dict_metadata:
        if full.startswith(prefix):
            fqn, _, name = full[len(prefix):].rpartition(".")  # field names hold no dots; FQNs may
            out.setdefault(fqn, {})[name] = full
    return out


def group_names(metadata, key: str, where: str) -> dict[int, list[str]]:
    """Group index -> value names of numbered param groups (``<key>.param_groups.<i>.<name>``)."""
    prefix, names = key + _GROUPS, {}
    for full, md in metadata.state_dict_metadata.items():
        if full.startswith(prefix) and isinstance(md, BytesStorageMetadata):
            index, _, name = full[len(prefix):].partition(".")
            if index.isdigit() and name:
                names.setdefault(int(index), []).append(name)
    if sorted(names) != list(range(len(names))):
        raise CheckpointFormatError(f"{where}param groups of {key!r} are not numbered 0..{len(names) - 1}")
    return names


def _groups(reader, key: str) -> list[dict]:
    prefix = key + _GROUPS
    names = group_names(reader.metadata, key, f"{reader.path}: ")
    values = reader.values([f"{prefix}{i}.{n}" for i in sorted(names) for n in names[i]])
    groups = [{n: values[f"{prefix}{i}.{n}"] for n in names[i]} for i in sorted(names)]
    for i, group in enumerate(groups):
        fqns = group.get("params")
        if not isinstance(fqns, list) or not all(isinstance(f, str) for f in fqns):
            raise CheckpointFormatError(f"{reader.path}: param group {i} of {key!r} does not list parameter FQNs")
    return groups


def _flat_groups(reader, key: str) -> tuple[list[dict], bool]:
    """The param groups of a flattened optimizer state_dict (``<key>.param_groups.<fqn>.<name>``)
    and whether they listed ``param_names``. With names, each group is exactly the names' list;
    without, the parameters with equal hyperparameters form one group (in the order of the
    model's entries when the checkpoint holds the model, else of the stored entries)."""
    prefix = key + _GROUPS
    smd = reader.metadata.state_dict_metadata
    keys = [k for k in smd if k.startswith(prefix)]
    for k in keys:
        if not isinstance(smd[k], BytesStorageMetadata):
            raise CheckpointFormatError(f"{reader.path}: {k!r} is a tensor where a param-group value was expected")
    values = reader.values(keys)
    order = {k: i for i, k in enumerate(smd)}
    per_fqn: dict[str, dict] = {}
    position: dict[str, tuple[int, int]] = {}
    for k in keys:
        fqn, _, name = k[len(prefix):].rpartition(".")  # hyperparameter names hold no dots; FQNs may
        if not fqn:
            raise CheckpointFormatError(f"{reader.path}: {k!r} names no parameter")
        per_fqn.setdefault(fqn, {})[name] = values[k]
        model = [order[m] for m in (f"model.{fqn}", fqn) if m in order]  # torchtitan saves the model at the top
        position[fqn] = min(position.get(fqn, (2, 0)), (0, min(model)) if model else (1, order[k]))
    fqns = sorted(per_fqn, key=position.__getitem__)
    named = any("param_names" in hp for hp in per_fqn.values())
    groups, placed = [], set()
    for fqn in fqns:
        if fqn in placed:
            continue
        hp = per_fqn[fqn]
        if named:
            members = hp.get("param_names")
            if not isinstance(members, list) or fqn not in members or not all(isinstance(m, str) for m in members):
                raise CheckpointFormatError(f"{reader.path}: the param_names saved for {fqn!r} under {key!r} do not "
                                            "list it")
        else:
            members = [f for f in fqns if f not in placed and per_fqn[f] == hp]
        for member in members:
            if member in placed or per_fqn.get(member) != hp:
                raise CheckpointFormatError(f"{reader.path}: {member!r} is in two param groups of {key!r}, or its "
                                            "hyperparameters differ from its group's")
        placed.update(members)
        groups.append({**{k: v for k, v in hp.items() if k != "param_names"}, "params": list(members)})
    return groups, named


def read_stock(reader, key: str, contract=None) -> CanonicalState:
    """The ``CanonicalState`` of the optimizer saved under ``key`` by torch's API (either layout),
    its tensors lazy; ``reader`` is an opened DCP checkpoint (``DCPReader``),
    ``contract`` the recorded one (default: inferred from the names)."""
    from gefen_ckpt.formats.torch_file import canonical_from_state_dict, composite_contract

    flat = not optimizer_keys(reader.metadata).get(key, True)
    groups, named = _flat_groups(reader, key) if flat else (_groups(reader, key), False)
    fqns = {f for g in groups for f in g["params"]}
    smd = reader.metadata.state_dict_metadata
    fields = state_fields(reader.metadata, key)
    for fqn, full in ((fqn, full) for fqn, names in fields.items() for full in names.values()):
        if fqn not in fqns or not isinstance(smd[full], TensorStorageMetadata):
            raise CheckpointFormatError(
                f"{reader.path}: {full!r} is not a tensor field of a listed parameter")
    state = {fqn: {name: DCPSource(reader, full) for name, full in names.items()}
             for fqn, names in fields.items()}
    sd = {"state": state, "param_groups": [{**g, "param_names": g["params"]} for g in groups]}
    dtypes = {fqn: md.properties.dtype for fqn in state
              if isinstance(md := smd.get(f"model.{fqn}", smd.get(fqn)), TensorStorageMetadata)}
    try:
        if contract is None and composite_children(sd):
            contract = composite_contract(None, sd)
        out = canonical_from_state_dict(sd, contract, dtypes=dtypes)
    except CheckpointError as exc:
        raise type(exc)(f"{reader.path}: {exc}") from None
    out.metadata = {"source_topology": {"kind": "dcp (torch get_state_dict)"}}
    if flat:
        out.metadata.update(source_topology={"kind": "dcp (torch flattened optimizer state_dict)"},
                            dcp_layout=FLAT, dcp_param_names=named)
    return out


# ----- writing the flat layout ----------------------------------------------------------------
def saved_value(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def stock_entries(state: CanonicalState, key: str, flat: bool) -> tuple[dict, dict[str, bytes], dict]:
    """(tensor sources, ``torch.save``d values, DCP's flatten mapping) of ``state`` in torch's layout
    under ``key``, its groups numbered or ``flat``; each parameter's entry repeats the optimizer-wide
    fields, as ``optimizer.state[p]`` holds them. Every key the optimizer's groups hold is written,
    at its default where ``state`` lacks it: torch reads every key the live group has."""
    from gefen_ckpt.formats.convert import group_defaults

    contract = state.contract
    tensors, values, mappings = {}, {}, {}
    names = state.metadata.get("dcp_param_names", False)
    defaults = {}
    for gi, group in enumerate(state.param_groups):
        leaf = contract.leaf(group.get(CHILD_KEY))
        if leaf.implementation not in defaults:
            defaults[leaf.implementation] = group_defaults(leaf)
        hyper = {k: tuple(v) if isinstance(v, list) and k in leaf.hyperparameters else v
                 for k, v in {**defaults[leaf.implementation], **group}.items() if k != "params"}
        if names or not flat:
            hyper["param_names"] = list(group["params"])
        if not flat:
            hyper["params"] = list(group["params"])
        for fqn in group["params"] if flat else [gi]:
            for name, value in hyper.items():
                full = f"{key}{_GROUPS}{fqn}.{name}"
                values[full] = saved_value(value)
                mappings[full] = (key, full[len(key) + 1:]) if flat else (key, "param_groups", gi, name)
    for fqn, entry in state.params.items():
        fields = {**entry.fields, **state.globals_of(entry.child)}
        for name in sorted(fields):
            full = f"{key}{_STATE}{fqn}.{name}"
            tensors[full] = fields[name]
            mappings[full] = (key, full[len(key) + 1:]) if flat else (key, "state", fqn, name)
    return tensors, values, mappings
