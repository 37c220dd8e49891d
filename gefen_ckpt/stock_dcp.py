"""Reading the DCP layout that torch's own checkpoint API writes, offline.

``get_state_dict(model, optimizer)`` + ``dcp.save({"model": msd, "optim": osd})`` stores each
optimizer state field as a tensor entry ``"<key>.state.<fqn>.<field>"`` (global shape: DTensor
state is resharded by DCP like any tensor) and each param-group value as a small ``torch.save``d
entry ``"<key>.param_groups.<i>.<name>"``. Nothing records which optimizer wrote it, so the
contract is inferred from the field and hyperparameter names, as for a ``torch.save``d
state_dict. Gefen optimizers repeat their codebook in every parameter's state (torch's API
keeps nothing else); it becomes the one optimizer-wide field here, and copies that disagree are
refused. Groups that name a ``"child"`` are a composite optimizer's (``gefen.contract``): each
child's contract is inferred from its own groups and fields, its parameters are marked with
the child and its optimizer-wide fields are keyed ``"<child>/<field>"``.

Param-group entries are read with ``torch.load(weights_only=True)``: no code runs.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from gefen.contract import CHILD_KEY, LIKE_PARAM, composite_children
from gefen_ckpt.canonical import CanonicalState, ParamState, global_key
from gefen_ckpt.errors import CheckpointFormatError, CheckpointMismatchError

__all__ = ["find_stock_keys", "read_stock"]

_STATE, _GROUPS = ".state.", ".param_groups."


def find_stock_keys(metadata) -> list[str]:
    """State-dict keys (e.g. ``"optim"``) under which torch's ``get_state_dict`` layout was saved."""
    found = set()
    for key in metadata.state_dict_metadata:
        if _GROUPS in key and key.split(_GROUPS, 1)[1].split(".", 1)[0].isdigit():
            found.add(key.split(_GROUPS, 1)[0])
    return sorted(found)


class ReadOnlyPlanner(LoadPlanner):
    """The part of a ``LoadPlanner`` that ``StorageReader.read_data`` calls when gefen-ckpt reads
    a checkpoint offline, without a state dict or a plan of DCP's own: subclasses say where each
    read item goes."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):  # pragma: no cover - unused
        pass

    def create_local_plan(self) -> LoadPlan:  # pragma: no cover - unused
        return LoadPlan([])

    def create_global_plan(self, global_plan):  # pragma: no cover - unused
        return global_plan

    def finish_plan(self, central_plan):  # pragma: no cover - unused
        return central_plan

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class _BytesPlanner(ReadOnlyPlanner):
    """Collects the raw bytes of ``torch.save``d entries."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        raise CheckpointFormatError(f"{read_item.dest_index.fqn}: a tensor where a param-group value was expected")


def _read_values(reader, keys: list[str]) -> dict[str, object]:
    """``torch.load(weights_only=True)`` of each bytes entry: plain numbers, strings, lists only."""
    items = [ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(k), dest_offsets=torch.Size((0,)),
                      storage_index=MetadataIndex(k), storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)))
             for k in keys]
    planner = _BytesPlanner()
    reader.reader.read_data(LoadPlan(items), planner).wait()
    out = {}
    for key in keys:
        try:
            out[key] = torch.load(io.BytesIO(planner.values[key]), weights_only=True)
        except Exception as exc:
            raise CheckpointFormatError(f"{reader.path}: {key!r} is not a plain param-group value: {exc}") from None
    return out


def _groups(reader, key: str) -> list[dict]:
    prefix = key + _GROUPS
    names: dict[int, list[str]] = {}
    for full, md in reader.metadata.state_dict_metadata.items():
        if full.startswith(prefix) and isinstance(md, BytesStorageMetadata):
            index, _, name = full[len(prefix):].partition(".")
            if index.isdigit() and name:
                names.setdefault(int(index), []).append(name)
    if sorted(names) != list(range(len(names))):
        raise CheckpointFormatError(f"{reader.path}: param groups of {key!r} are not numbered 0..{len(names) - 1}")
    values = _read_values(reader, [f"{prefix}{i}.{n}" for i in sorted(names) for n in names[i]])
    groups = [{n: values[f"{prefix}{i}.{n}"] for n in names[i]} for i in sorted(names)]
    for i, group in enumerate(groups):
        fqns = group.get("params")
        if not isinstance(fqns, list) or not all(isinstance(f, str) for f in fqns):
            raise CheckpointFormatError(f"{reader.path}: param group {i} of {key!r} does not list parameter FQNs")
        group.pop("param_names", None)  # the same FQNs again, when the optimizer was built with names
    return groups


def read_stock(reader, key: str, source_factory) -> CanonicalState:
    """The ``CanonicalState`` of the optimizer saved under ``key`` by torch's API.

    ``reader`` is an opened DCP checkpoint (``gefen_ckpt.dcp._DCPReader``); ``source_factory(full
    key)`` makes the lazy tensor source of one entry."""
    from gefen_ckpt.torch_format import infer_composite_contract, infer_contract

    groups = _groups(reader, key)
    fqns = [f for g in groups for f in g["params"]]
    smd = reader.metadata.state_dict_metadata
    prefix = key + _STATE
    fields: dict[str, dict[str, str]] = {}
    for full, md in smd.items():
        if full.startswith(prefix):
            fqn, _, name = full[len(prefix):].rpartition(".")  # field names hold no dots; FQNs may
            if fqn not in fqns or not isinstance(md, TensorStorageMetadata):
                raise CheckpointFormatError(f"{reader.path}: {full!r} is not a tensor field of a listed parameter")
            fields.setdefault(fqn, {})[name] = full

    sketch = {"state": {fqn: dict.fromkeys(f, True) for fqn, f in fields.items()}, "param_groups": groups}
    children = composite_children(sketch)
    contract = infer_composite_contract(sketch) if children else infer_contract(sketch)
    global_fields, params = {}, {}
    for child, leaf in [(c, contract.child(c)) for c in children] or [(None, contract)]:
        shared = {f.name for f in leaf.global_fields}
        members = [fqn for g in groups if g.get(CHILD_KEY) == child for fqn in g["params"] if fqn in fields]
        for fqn in members:
            sources = {name: source_factory(full) for name, full in fields[fqn].items()}
            for name in shared & set(sources):
                copy = sources.pop(name)
                first = global_fields.setdefault(global_key(child, name), copy)
                if first is not copy and not torch.equal(first.read(), copy.read()):
                    raise CheckpointMismatchError(f"{reader.path}: {fqn}: its {name} differs from the other "
                                                  "parameters'")
            like = [n for n in sources if leaf.field(n).geometry == "param"]
            if not like:
                raise CheckpointFormatError(f"{reader.path}: {fqn}: no field of the parameter's shape")
            model_md = smd.get(f"model.{fqn}")
            dtype = model_md.properties.dtype if isinstance(model_md, TensorStorageMetadata) else next(
                (sources[n].dtype for n in sources if leaf.field(n).dtype == LIKE_PARAM), torch.float32)
            params[fqn] = ParamState(tuple(sources[like[0]].shape), dtype, sources, child)
    plain_groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]
    return CanonicalState(contract, plain_groups, params, global_fields,
                          metadata={"source_topology": {"kind": "dcp (torch get_state_dict)"}})
