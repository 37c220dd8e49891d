"""``CanonicalState`` <-> a ``torch.save``d ``optimizer.state_dict()`` (the one converter between a
torch state_dict and the canonical state; DCP's stock layout is read through it too).

Reading keys the state by FQN and checks every field against the contract (given, recorded or
inferred from the names). Writing records, under ``"gefen_ckpt"``, the contract and the
parameters' dtypes (``weights_only``-safe; optimizers ignore unknown keys), which makes
``torch -> portable`` exact. Files are read with ``torch.load(..., weights_only=True)`` through
fsspec, whole: the format is not lazy.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from gefen.contract import (
    CHILD_KEY,
    CONTRACT_KEY,
    GLOBAL_STATE_KEY,
    LIKE_PARAM,
    FieldSpec,
    OptimizerContract,
    composite_children,
    join_composite,
    split_composite,
    torch_contracts,
)
from gefen_ckpt.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
)
from gefen_ckpt.io.storage import require_regular
from gefen_ckpt.state.canonical import CanonicalState, EagerSource, ParamState, TensorSource, global_key
from gefen_ckpt.wire.dtypes import dtype_name, plain, torch_dtype
from gefen_ckpt.wire.manifest import missing_fields, names_optimizer, parse_contract

__all__ = [
    "TORCH_META_KEY",
    "canonical_from_state_dict",
    "state_dict_from_canonical",
    "known_contracts",
    "resolve_contract",
    "infer_contract",
    "composite_contract",
    "load_torch_state_dict",
    "save_torch_state_dict",
    "is_torch_file",
]

#: top-level key of our record (contract + parameter dtypes) in a state_dict we write
TORCH_META_KEY = "gefen_ckpt"
TORCH_META_VERSION = 1


# ----- contracts ----------------------------------------------------------------------------
def known_contracts() -> dict[str, OptimizerContract]:
    """implementation name -> current contract, of every optimizer whose state this module reads."""
    out = {}
    for contract in all_contracts():
        out.setdefault(contract.implementation, contract)
    return out


def all_contracts() -> list[OptimizerContract]:
    """Every readable (non-composite) contract, in order of preference when several fit a state_dict;
    older layouts of an implementation after its current one (a ``gefen.Gefen`` state_dict of
    version "1" is told apart from version "2" by its fields)."""
    from gefen.muon import CONTRACT as MUON_CONTRACT  # parameter-independent
    from gefen.state_layouts import CONTRACTS as GEFEN_LAYOUTS

    return [*GEFEN_LAYOUTS.values(), MUON_CONTRACT, *torch_contracts().values()]


def resolve_contract(name: str | OptimizerContract) -> OptimizerContract:
    """A contract from its implementation name; short, case-insensitive names also work
    (``"adamw"``, ``"Gefen"``, ``"sgd"``)."""
    if isinstance(name, OptimizerContract):
        return name
    known = known_contracts()
    if name in known:
        return known[name]
    matches = [c for impl, c in known.items() if names_optimizer(name, impl)]
    if len(matches) == 1:
        return matches[0]
    raise CheckpointMismatchError(f"unknown optimizer {name!r}; known: {', '.join(sorted(known))}")


def infer_contract(state_dict: dict) -> OptimizerContract:
    """The contract that fits a (non-composite) state_dict's field and hyperparameter names.

    A contract fits when every stored field is one of its fields, each parameter's state has
    its required fields and every group has its hyperparameters. Adam and AdamW store the same
    fields: ``decoupled_weight_decay: False`` in the groups means Adam, anything else AdamW.
    """
    check_state_dict(state_dict)
    observed: set[str] = set()
    entries = [e for e in state_dict["state"].values() if isinstance(e, dict) and e]
    for entry in entries:
        observed.update(k for k, v in entry.items() if v is not None)
    groups = state_dict["param_groups"]
    fits = []
    for contract in all_contracts():
        names = {f.name for f in contract.fields + contract.global_fields}
        if not observed <= names:
            continue
        if any(missing_fields(contract, (k for k, v in e.items() if v is not None)) for e in entries):
            continue
        if any(not set(contract.hyperparameters) <= set(g) for g in groups):
            continue
        fits.append(contract)
    impls = {c.implementation for c in fits}
    if {"torch.optim.Adam", "torch.optim.AdamW"} <= impls:
        drop = "torch.optim.AdamW" if groups and all(g.get("decoupled_weight_decay") is False for g in groups) \
            else "torch.optim.Adam"
        fits = [c for c in fits if c.implementation != drop]
    if not fits:
        raise CheckpointMismatchError(
            f"cannot tell which optimizer wrote this state_dict (fields {sorted(observed)}, group keys "
            f"{sorted(set().union(*map(set, groups))) if groups else []}); pass the optimizer explicitly "
            f"(known: {', '.join(sorted(known_contracts()))})"
        )
    return fits[0]


#: composite optimizers by their children's names, for state that records no contract (torch's
#: ``get_state_dict`` keeps only ``state`` and ``param_groups``)
_COMPOSITES = {("muon", "backup"): "gefen.GefenMuonHybrid"}


def composite_contract(name: str | None, sd: dict) -> OptimizerContract:
    """The contract of a composite optimizer called ``name`` (default: the one ``_COMPOSITES``
    names for the children) whose children's contracts are inferred from their state_dicts (in
    their stored order). Its ``version`` is ``"unrecorded"``: only the file written by
    :func:`state_dict_from_canonical` knows it."""
    names = composite_children(sd)
    if name is None and tuple(names) not in _COMPOSITES:
        known = ", ".join(f"{v} {list(k)}" for k, v in _COMPOSITES.items())
        raise CheckpointMismatchError(f"no composite optimizer has the children {list(names)} "
                                      f"(known: {known})")
    name = name or _COMPOSITES[tuple(names)]
    try:
        leaf = resolve_contract(name)
    except CheckpointMismatchError:
        pass
    else:
        raise CheckpointMismatchError(f"{leaf.implementation} is not a composite optimizer, but the state_dict "
                                      f"has child optimizers {sorted(names)}")
    name = next((impl for impl in _COMPOSITES.values() if names_optimizer(name, impl)), name)
    children = []
    for child, child_sd in _split(sd, names, name).items():
        try:
            children.append((str(child), infer_contract(child_sd)))
        except CheckpointError as exc:
            raise type(exc)(f"child {child!r}: {exc}") from None
    return OptimizerContract(name, "unrecorded", (), (), children=tuple(children))


# ----- state_dict -> canonical --------------------------------------------------------------
def check_state_dict(sd, where: str = "state_dict") -> None:
    if not isinstance(sd, dict):
        raise CheckpointFormatError(f"{where} is a {type(sd).__name__}, not an optimizer state_dict")
    for key, kind in (("state", dict), ("param_groups", (list, tuple))):
        if not isinstance(sd.get(key), kind):
            raise CheckpointFormatError(f"{where} is not an optimizer state_dict: {key!r} missing or malformed")
    for gi, g in enumerate(sd["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            raise CheckpointFormatError(f"{where}: param group {gi} has no 'params' list")


def canonical_groups(leaf: OptimizerContract, child: str | None, saved_groups: list[dict], fqns: list[list[str]],
                     seen: set[str], where: str) -> tuple[list[dict], dict]:
    """(canonical param groups, state index -> FQN) of one (child) optimizer's saved groups whose
    members are ``fqns``: the inverse of ``leaf_state_dict``, for files and live optimizers alike.
    ``seen`` gathers the FQNs of every leaf: each may appear once in ``where``."""
    groups, owner = [], {}
    for saved, members in zip(saved_groups, fqns):
        group = {h: plain(saved[h], f"hyperparameter {h!r}") for h in leaf.hyperparameters if h in saved}
        groups.append({**group, "params": list(members), **({CHILD_KEY: child} if child is not None else {})})
        for index, fqn in zip(saved["params"], members):
            if fqn in seen:
                raise CheckpointMismatchError(f"parameter FQN {fqn!r} appears twice in {where}")
            seen.add(fqn)
            owner[index] = fqn
    return groups, owner


def _split(sd: dict, children: list[str], implementation: str) -> dict[str, dict]:
    """``gefen.contract.split_composite`` with its refusal as a checkpoint error."""
    try:
        return split_composite(sd, children)
    except ValueError as exc:
        raise CheckpointMismatchError(f"state_dict: not a state_dict of {implementation}: {exc}") from None


def _source(value, spec, fqn: str, name: str) -> TensorSource:
    if isinstance(value, torch.Tensor):
        return EagerSource(value)
    if hasattr(value, "read") and hasattr(value, "shape"):  # already a lazy source (a DCP entry)
        return value
    if isinstance(value, (bool, int, float)) and spec.geometry == "scalar":  # old torch: step as a number
        dtype = torch.float32 if spec.dtype == LIKE_PARAM else torch_dtype(spec.dtype, f"{fqn}/{name}")
        return EagerSource(torch.tensor(value, dtype=dtype))
    raise CheckpointFormatError(f"{fqn}/{name}: a {type(value).__name__}, not a tensor")


def canonical_from_state_dict(sd: dict, contract: OptimizerContract | str | None = None, *,
                              dtypes: dict | None = None) -> CanonicalState:
    """A ``CanonicalState`` from an ``optimizer.state_dict()`` (tensors are not copied): the one
    conversion of a torch state_dict, from a file or read lazily from a DCP checkpoint (values
    may be tensor sources, ``params`` may be the FQNs themselves).

    ``contract``: an ``OptimizerContract`` or an implementation name; by default the one recorded
    by :func:`state_dict_from_canonical`, else one inferred from the field names. ``dtypes``:
    fqn -> the parameter's dtype (default: the recorded ones).
    """
    check_state_dict(sd)
    meta = sd.get(TORCH_META_KEY) if isinstance(sd.get(TORCH_META_KEY), dict) else {}
    composite = composite_children(sd)
    if isinstance(contract, str) and composite:
        contract = composite_contract(contract, sd)
    elif contract is not None:
        contract = resolve_contract(contract)
    elif isinstance(meta.get("contract"), dict) or (composite and isinstance(sd.get(CONTRACT_KEY), dict)):
        recorded = meta["contract"] if isinstance(meta.get("contract"), dict) else sd[CONTRACT_KEY]
        contract = parse_contract(recorded, "recorded contract")
    elif composite:
        raise CheckpointMismatchError(
            f"a composite optimizer's state_dict (children {sorted(composite)}) records no "
            "contract: name the optimizer (e.g. gefen.GefenMuonHybrid) or pass contract_of(optimizer)"
        )
    else:
        contract = infer_contract(sd)
    if composite and not contract.children:
        raise CheckpointMismatchError(f"{contract.implementation} is not a composite optimizer, but the state_dict "
                                      f"has child optimizers {sorted(composite)}")
    if dtypes is None:
        dtypes = meta.get("param_dtypes") if isinstance(meta.get("param_dtypes"), dict) else {}

    groups: dict[str | None, list[dict]] = {}
    seen: set[str] = set()
    params: dict[str, ParamState] = {}
    global_fields: dict[str, TensorSource] = {}
    split = _split(sd, [n for n, _ in contract.children], contract.implementation) if contract.children else {None: sd}
    for child, leaf in contract.leaves():
        leaf_sd = split[child]
        where = f"child {child!r}" if child else "state_dict"
        for key, value in (leaf_sd.get(GLOBAL_STATE_KEY) or {}).items():
            try:
                spec = leaf.field(key)
            except KeyError:
                raise CheckpointMismatchError(
                    f"{where}: optimizer-wide field {key!r} is unknown to {leaf.implementation}") from None
            global_fields[global_key(child, key)] = _source(value, spec, "global", key)
        fqns = []
        for gi, saved in enumerate(leaf_sd["param_groups"]):
            names = saved.get("param_names")
            if not names:
                raise CheckpointMismatchError(
                    f"{where}: param group {gi} has no 'param_names', so its state cannot be keyed by parameter "
                    "name; name them (gefen-ckpt --param-names FILE or --names-from MODEL; "
                    "gefen_ckpt.formats.names.name_state_dict) or build the optimizer from model.named_parameters()"
                )
            if len(names) != len(saved["params"]):
                raise CheckpointFormatError(f"{where}: param group {gi} has {len(saved['params'])} params but "
                                            f"{len(names)} param_names")
            fqns.append([str(n) for n in names])
        groups[child], owner = canonical_groups(leaf, child, leaf_sd["param_groups"], fqns, seen, "the state_dict")
        entries = {}
        for index, entry in leaf_sd["state"].items():
            if index not in owner:
                raise CheckpointFormatError(f"{where}: state for parameter index {index!r}, which is in no param group")
            fqn = owner[index]
            if not isinstance(entry, dict):
                raise CheckpointFormatError(f"{fqn}: state is a {type(entry).__name__}, not a dict")
            entries[fqn] = {name: _source(v, field_spec(leaf, fqn, name, _ANOTHER), fqn, name)  # (SGD: None buffers)
                            for name, v in entry.items() if v is not None}
        params.update(param_states(leaf, child, entries, global_fields, dtypes))
    order = [g.get(CHILD_KEY) for g in sd["param_groups"]]  # the groups in their saved order (if flat)
    if len(order) != sum(map(len, groups.values())):
        order = [c for c, gs in groups.items() for _ in gs]
    return CanonicalState(contract, [groups[c].pop(0) for c in order], params, global_fields,
                          metadata={"source_topology": {"kind": "single"}, "source_format": "torch"})


def field_spec(leaf: OptimizerContract, fqn: str, name: str, hint: str = "") -> FieldSpec:
    """``leaf``'s field ``name`` (of parameter ``fqn``); a mismatch naming both (and ``hint``) if it has none."""
    try:
        return leaf.field(str(name))
    except KeyError:
        raise CheckpointMismatchError(f"{fqn}: field {name!r} is unknown to {leaf.implementation}{hint}") from None


#: what a field unknown to the contract of a file's state most likely means
_ANOTHER = " (a checkpoint of another optimizer? pass the optimizer explicitly)"


def param_states(leaf: OptimizerContract, child: str | None, entries: dict[str, dict[str, TensorSource]],
                 global_fields: dict[str, TensorSource], dtypes: dict) -> dict[str, ParamState]:
    """FQN-keyed state as ``ParamState``s: the optimizer-wide fields each entry repeats for torch's
    checkpoint API (the codebook) go to ``global_fields`` once (copies that disagree are refused),
    the shape comes from a field of ``param`` geometry, the dtype from ``dtypes`` (recorded), else
    a field stored like the parameter, else fp32; every field is checked against ``leaf``."""
    params = {}
    for fqn, fields in entries.items():
        fields = dict(fields)
        for spec in leaf.global_fields:
            if spec.name in fields:
                copy = fields.pop(spec.name)
                known = global_fields.setdefault(global_key(child, spec.name), copy)
                if known is not copy and not torch.equal(known.read(), copy.read()):
                    raise CheckpointMismatchError(f"{fqn}: its {spec.name} differs from the optimizer's")
        if not fields:
            continue
        specs = {name: field_spec(leaf, fqn, name, _ANOTHER) for name in fields}
        if missing := missing_fields(leaf, fields):
            raise CheckpointMismatchError(f"{fqn}: state lacks {leaf.implementation}'s fields {missing}")
        like = [n for n in fields if specs[n].geometry == "param"]
        if not like:
            raise CheckpointMismatchError(f"{fqn}: no field of 'param' geometry, so the parameter's shape is unknown")
        shape = tuple(fields[like[0]].shape)
        if missing := missing_fields(leaf, fields, shape):
            raise CheckpointMismatchError(f"{fqn}: state lacks {leaf.implementation}'s fields {missing} (shape {shape})")
        stored = dtypes.get(fqn)
        if stored is not None:
            dtype = stored if isinstance(stored, torch.dtype) else torch_dtype(stored, fqn)
        else:
            like_param = [n for n in fields if specs[n].dtype == LIKE_PARAM]
            dtype = fields[like_param[0]].dtype if like_param else torch.float32
        for name, src in fields.items():
            if problem := specs[name].check(shape, src.shape, src.dtype, dtype):
                raise CheckpointMismatchError(f"{fqn}/{name}: {problem} ({leaf.implementation})")
        params[fqn] = ParamState(shape, dtype, {specs[n].name: src for n, src in fields.items()}, child)
    return params


# ----- canonical -> state_dict --------------------------------------------------------------
def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor that owns exactly its bytes (torch.save writes whole storages)."""
    t = t.detach()
    if (t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        t = t.to("cpu", copy=True).contiguous()
    return t


def leaf_state_dict(groups: list[tuple[dict, list]], entry_of: Callable, global_state: dict | None) -> dict:
    """One (child) optimizer's ``state_dict()`` layout: ``groups`` are (hyperparameters, member
    FQNs or parameters) in order, ``params`` numbered across them; ``entry_of(member)`` gives a
    member's state (None: no state). The one builder of the layout, for files and live loads."""
    sd_state, sd_groups, index = {}, [], 0
    for group, members in groups:
        sd_groups.append({**group, "params": list(range(index, index + len(members)))})
        for member in members:
            if (entry := entry_of(member)) is not None:
                sd_state[index] = entry
            index += 1
    out = {"state": sd_state, "param_groups": sd_groups}
    if global_state is not None:
        out[GLOBAL_STATE_KEY] = global_state
    return out


def as_tuples(group: dict) -> dict:
    """Saved hyperparameters as the optimizer holds them (msgpack brings tuples back as lists)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}


def state_dict_from_canonical(state: CanonicalState) -> dict:
    """The ``optimizer.state_dict()`` a single process would hold for ``state`` (every tensor read
    into memory): it loads with ``optimizer.load_state_dict`` into an optimizer built like the
    original. ``params`` are numbered in group order, ``param_names`` carry the FQNs."""
    contract = state.contract

    def entry_of(fqn: str) -> dict | None:
        entry = state.params.get(fqn)
        return {name: _owned(src.read()) for name, src in entry.fields.items()} if entry and entry.fields else None

    leaves = {}
    for child, leaf in contract.leaves():
        groups = []
        for g in (g for g in state.param_groups if g.get(CHILD_KEY) == child):
            fqns = [str(f) for f in g["params"]]
            groups.append(({**as_tuples({k: v for k, v in g.items() if k not in ("params", CHILD_KEY)}),
                            "param_names": fqns}, fqns))
        globals_ = ({k: _owned(src.read()) for k, src in state.globals_of(child).items()}
                    if leaf.global_fields else None)
        leaves[child] = leaf_state_dict(groups, entry_of, globals_)
    stray = [g.get(CHILD_KEY) for g in state.param_groups if g.get(CHILD_KEY) not in leaves]
    if stray:
        raise CheckpointMismatchError(f"param groups name child optimizers {sorted(set(map(str, stray)))} "
                                      f"that {contract.implementation} does not have")
    sd = join_composite(leaves) if contract.children else leaves[None]
    sd[TORCH_META_KEY] = {
        "version": TORCH_META_VERSION,
        "contract": contract.to_dict(),
        "param_dtypes": {fqn: dtype_name(e.dtype) for fqn, e in state.params.items()},
    }
    return sd


# ----- files --------------------------------------------------------------------------------
def _fs(url: str):
    try:
        return fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as exc:
        raise CheckpointFormatError(f"{url}: {exc}") from None


def is_torch_file(url: str) -> bool:
    """Does ``url`` name a file that starts like a ``torch.save`` output (zip or legacy pickle)?"""
    fs, path = _fs(url)
    try:
        if not fs.isfile(path):
            return False
        with fs.open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def torch_load(url: str, what: str, *, mmap: bool = False):
    """``torch.load(map_location="cpu", weights_only=True)`` (no pickled code runs) of any fsspec
    URL, memory-mapped if ``mmap`` and local; a file that does not load is a format error saying
    that it is not ``what``. Storage failures (``OSError``) pass through."""
    fs, path = _fs(url)
    require_regular(fs, path, url)
    try:
        if mmap and isinstance(fs, LocalFileSystem):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # torch.load raises many types for a file that is not its own
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointFormatError(f"{url}: not {what} ({first})") from None


def load_torch_state_dict(url: str) -> dict:
    """``torch.load(url, map_location="cpu", weights_only=True)`` of any fsspec URL."""
    fs, path = _fs(url)
    if not fs.exists(path):
        raise CheckpointIncompleteError(f"{url}: no such file")
    if fs.isdir(path):
        raise CheckpointFormatError(f"{url}: a directory, not a torch.save file")
    sd = torch_load(url, "a loadable torch.save file of plain tensors")
    check_state_dict(sd, url)
    return sd


def save_torch_state_dict(sd: dict, url: str) -> None:
    """``torch.save(sd, url)``; on a local filesystem via a temporary file and an atomic rename."""
    fs, path = _fs(url)
    parent = fs._parent(path)
    if parent and not fs.exists(parent):
        fs.makedirs(parent, exist_ok=True)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:  # object stores publish an object only when its upload completes
        with fs.open(path, "wb") as f:
            torch.save(sd, f)

