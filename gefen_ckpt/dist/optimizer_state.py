"""``export_canonical`` / ``import_canonical``: between a live optimizer and ``CanonicalState``,
only through its contract (docs/design.md 4) and ``state_dict()`` / ``load_state_dict()``, so
every optimizer shares one path. Import validates everything and builds the whole local
state_dict before the optimizer sees any of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from gefen.contract import (
    GLOBAL_STATE_KEY,
    SCHEMA_VERSION,
    OptimizerContract,
    contract_of,
    join_composite,
)
from gefen.distributed import as_field_dtensor
from gefen.geometry import rows_and_row_numel
from gefen.state_layouts import version_refusal
from gefen_ckpt.dist import placement
from gefen_ckpt.dist.collective import agree
from gefen_ckpt.errors import CheckpointMismatchError
from gefen_ckpt.formats.torch_file import as_tuples, canonical_groups, field_spec, leaf_state_dict
from gefen_ckpt.state.canonical import CanonicalState, LocalPart, ParamState, global_key
from gefen_ckpt.wire.manifest import missing_fields


# ----- naming -------------------------------------------------------------------------------
def names_from_model(model: torch.nn.Module | None) -> dict[int, str]:
    if model is None:
        return {}
    return {id(p): name for name, p in model.named_parameters()}


def group_fqns(group: dict, names: dict[int, str], implementation: str) -> list[str]:
    if group.get("param_names"):
        return list(group["param_names"])
    try:
        return [names[id(p)] for p in group["params"]]
    except KeyError:
        raise CheckpointMismatchError(
            f"{implementation} was built without parameter names: pass model=... (or build it from "
            "model.named_parameters()) so the state can be keyed by FQN"
        ) from None


def leaves(optimizer, contract: OptimizerContract):
    """(child name, optimizer, contract) for every non-composite optimizer inside ``optimizer``."""
    children = getattr(optimizer, "children", None) if contract.children else None
    if contract.children and not isinstance(children, dict):
        raise TypeError(f"{contract.implementation} declares children but has no `children` dict")
    return [(name, children[name] if name is not None else optimizer, leaf) for name, leaf in contract.leaves()]


def live_params(optimizer, model: torch.nn.Module | None = None):
    """``(child, leaf contract, group, fqn, parameter)`` of every parameter, leaf by leaf in
    param-group order: the one walk of a live optimizer's parameters by name."""
    names = names_from_model(model)
    for child, opt, leaf in leaves(optimizer, contract_of(optimizer)):
        for group in opt.param_groups:
            for fqn, p in zip(group_fqns(group, names, leaf.implementation), group["params"]):
                yield child, leaf, group, fqn, p


# ----- export -------------------------------------------------------------------------------
def export_canonical(optimizer: torch.optim.Optimizer, *, model: torch.nn.Module | None = None) -> CanonicalState:
    """The optimizer's state as a topology-free ``CanonicalState``, valid until its next step
    (tensors are not copied: ``.materialize()`` for a snapshot). ``model`` supplies FQNs for
    optimizers built from bare tensors. Under a process group each field is this rank's
    ``LocalPart`` of the global tensor (no communication; ``transport.gather`` assembles them).
    """
    contract, names, rank0 = contract_of(optimizer), names_from_model(model), placement.rank() == 0
    groups: list[dict] = []
    params: dict[str, ParamState] = {}
    global_fields: dict[str, LocalPart] = {}
    seen: set[str] = set()
    for child, opt, leaf in leaves(optimizer, contract):
        sd = opt.state_dict()
        shared = {f.name for f in leaf.global_fields}  # each parameter's entry repeats them (the codebook)
        for key, value in (sd.get(GLOBAL_STATE_KEY) or {}).items():
            if isinstance(value, torch.Tensor):
                global_fields[global_key(child, key)] = LocalPart(value, 0, tuple(value.shape), rank0,
                                                                  placement.every_rank())
        fqns = [group_fqns(live, names, leaf.implementation) for live in opt.param_groups]
        leaf_groups, owner = canonical_groups(leaf, child, sd["param_groups"], fqns, seen, "the optimizer")
        groups += leaf_groups
        live = {fqn: p for members, g in zip(fqns, opt.param_groups) for fqn, p in zip(members, g["params"])}
        for index, fqn in owner.items():
            p = live[fqn]
            placement.local_rows(p, fqn)  # whole rows on every rank: refuses a column split (Shard(1))
            fields = {k: _local_part(fqn, p, leaf.field(k).row_sharded,
                                     v if isinstance(v, torch.Tensor) else torch.tensor(v))
                      for k, v in (sd["state"].get(index) or {}).items() if v is not None and k not in shared}
            if fields:
                params[fqn] = ParamState(tuple(p.shape), p.dtype, fields, child)
    return CanonicalState(contract, groups, params, global_fields, metadata={"source_topology": {"kind": "single"}})


def _local_part(fqn: str, param: torch.Tensor, row_sharded: bool, value: torch.Tensor) -> LocalPart:
    """A field of this rank's state as a slice of the global field."""
    value = placement.to_local(value)  # torch optimizers keep DTensor state for DTensor params
    if row_sharded and value.dim():
        start, _ = placement.local_rows(param, fqn)
        rows = rows_and_row_numel(param.shape)[0]
        return LocalPart(value, start, (rows, *value.shape[1:]), placement.first_writer(param, True),
                         placement.holders(param, True))
    return LocalPart(value, 0, tuple(value.shape), placement.first_writer(param, False),
                     placement.holders(param, False))


# ----- import -------------------------------------------------------------------------------
def check_contract(live: OptimizerContract, saved: OptimizerContract) -> None:
    """The checkpoint must come from the same optimizer implementation and a readable schema."""
    if saved.schema_version > SCHEMA_VERSION:
        raise CheckpointMismatchError(f"checkpoint schema version {saved.schema_version} is newer than this "
                                      f"gefen_ckpt ({SCHEMA_VERSION})")
    if saved.implementation != live.implementation:
        raise CheckpointMismatchError(
            f"checkpoint holds {saved.implementation} state, the live optimizer is {live.implementation}"
        )
    if live.implementation == "gefen.Gefen" and (refusal := version_refusal(saved.version, live.version)):
        raise CheckpointMismatchError(refusal)  # another state layout (moments=...)
    if [n for n, _ in saved.children] != [n for n, _ in live.children]:
        raise CheckpointMismatchError(
            f"checkpoint children {[n for n, _ in saved.children]} differ from the optimizer's "
            f"{[n for n, _ in live.children]}"
        )
    for (_, a), (_, b) in zip(live.children, saved.children):
        check_contract(a, b)
    live_fields = {f.name: f for f in live.fields + live.global_fields}
    for f in saved.fields + saved.global_fields:
        if f.name not in live_fields or live_fields[f.name].geometry != f.geometry:
            raise CheckpointMismatchError(
                f"field {f.name!r} ({f.geometry}) of the checkpoint is not part of {live.implementation}'s state"
            )


def check_same_params(live: Iterable[str], saved: Iterable[str]) -> None:
    """The checkpoint must hold state for exactly the optimizer's parameters (by FQN)."""
    missing, extra = set(live) - set(saved), set(saved) - set(live)
    if missing or extra:
        raise CheckpointMismatchError(
            "parameters differ between checkpoint and optimizer: "
            f"missing from checkpoint {sorted(missing)[:5]}, unknown to optimizer {sorted(extra)[:5]}"
        )


def check_param_shape(fqn: str, shape, param: torch.Tensor) -> None:
    if tuple(shape) != tuple(param.shape):
        raise CheckpointMismatchError(
            f"{fqn}: checkpoint shape {tuple(shape)} differs from the live parameter's {tuple(param.shape)}")


def check_group_members(saved: list[list[str]], live: list[list[str]], child: str | None = None) -> None:
    """The checkpoint's param groups (FQN lists) must be the optimizer's, in number and members."""
    if len(saved) != len(live):
        raise CheckpointMismatchError(f"checkpoint has {len(saved)} param groups{f' for {child!r}' if child else ''}, "
                                      f"the optimizer has {len(live)}")
    for gi, (a, b) in enumerate(zip(saved, live)):
        if sorted(map(str, a)) != sorted(b):
            raise CheckpointMismatchError(f"param group {gi}{f' of {child!r}' if child else ''} has different members")


def _local_state_dict(opt, leaf: OptimizerContract, child: str | None, state: CanonicalState,
                      names: dict[int, str]) -> dict:
    """The state_dict ``opt`` would have saved on this rank, cut from the canonical state
    (after ``check_fits``)."""
    saved_groups = [g for g in state.param_groups if g.get("child") == child]
    groups = []
    for live, saved in zip(opt.param_groups, saved_groups):
        hyper = as_tuples({h: saved[h] for h in leaf.hyperparameters})
        groups.append(({**{k: v for k, v in live.items() if k != "params"}, **hyper},
                       list(zip(group_fqns(live, names, leaf.implementation), live["params"]))))

    def entry_of(member) -> dict | None:
        fqn, p = member
        if (entry := state.params.get(fqn)) is None:
            return None
        start, stop = placement.local_rows(p, fqn)
        out = {}
        for name, src in entry.fields.items():
            spec = leaf.field(name)
            if not spec.row_sharded or not src.shape:
                out[name] = src.read()
            elif leaf.dtensor_state and placement.is_dtensor(p):
                out[name] = as_field_dtensor(src.read(start, stop).contiguous(), p, spec.geometry, src.shape)
            else:
                out[name] = src.read(start, stop)
        return out

    return leaf_state_dict(groups, entry_of, {k: src.read() for k, src in state.globals_of(child).items()})


def import_canonical(optimizer: torch.optim.Optimizer, state: CanonicalState, *,
                     model: torch.nn.Module | None = None, adopt: bool = False) -> None:
    """Load ``state`` into ``optimizer``, each rank taking the slices it owns. Everything is read
    and validated first: on any error (``CheckpointMismatchError`` naming the FQN/field, or a read
    error) the optimizer is untouched; under a process group every rank raises together.
    ``adopt``: every read of ``state`` returns memory nothing else holds (a checkpoint's lazy
    state): the optimizer keeps it instead of copying.
    """
    load_agreed(lambda: stage_state_dict(optimizer, local_state_dict(optimizer, state, model), adopt),
                "import_canonical")


def load_agreed(stage: Callable[[], Callable[[], None]], what: str, group=None, alone: bool = False) -> None:
    """Run ``stage()`` (validate and stage; it returns the publisher), agree with every rank of
    ``group`` (not when ``alone``: only this process loads), then publish: a failure on any rank
    raises on every rank before any of them publishes."""
    error, publish = None, None
    try:
        publish = stage()
    except Exception as exc:  # re-raised on this rank by agree(), after every rank has reported
        error = exc
    if alone and error is not None:
        raise error
    if not alone:
        agree(error, what, group)
    publish()


def copies_on_load(optimizer: torch.optim.Optimizer) -> bool:
    """Does loading copy the tensors it is given (so they may be views of checkpoint files)? Gefen
    optimizers do; a torch optimizer keeps the very tensors, so it must get memory of its own."""
    return hasattr(optimizer, "prepare_load_state_dict")


def stage_state_dict(optimizer: torch.optim.Optimizer, sd: dict, adopt: bool = False) -> Callable[[], None]:
    """Stage the optimizer's own ``sd``; the returned callable publishes it. Gefen optimizers
    validate and copy (unless they ``adopt`` the tensors) in ``prepare_load_state_dict``; torch
    optimizers load what gefen_ckpt checked."""
    prepare = getattr(optimizer, "prepare_load_state_dict", None)
    if prepare is None:
        return functools.partial(optimizer.load_state_dict, sd)
    try:
        return prepare(sd, adopt=adopt)
    except (ValueError, TypeError, KeyError) as exc:
        if isinstance(exc, CheckpointMismatchError):
            raise
        raise CheckpointMismatchError(f"{contract_of(optimizer).implementation} refused the checkpoint state: "
                                      f"{exc}") from exc


def local_state_dict(optimizer: torch.optim.Optimizer, state: CanonicalState, model=None) -> dict:
    """The optimizer's local state_dict cut from ``state``, after checking that they fit."""
    check_fits(optimizer, state, model)
    contract, names = contract_of(optimizer), names_from_model(model)
    sds = {child: _local_state_dict(opt, leaf, child, state, names) for child, opt, leaf in leaves(optimizer, contract)}
    return join_composite(sds) if contract.children else sds[None]


def check_fits(optimizer: torch.optim.Optimizer, state: CanonicalState, model=None) -> None:
    """Does ``state`` fit ``optimizer`` (contract, FQNs, groups, hyperparameters, shapes, dtypes,
    required fields)? From the description alone, so a load refuses before reading any data."""
    contract = contract_of(optimizer)
    check_contract(contract, state.contract)
    names = names_from_model(model)
    check_same_params([fqn for *_, fqn, _ in live_params(optimizer, model)], state.fqns())
    unowned = set(state.params) - set(state.fqns())
    if unowned:
        raise CheckpointMismatchError(f"checkpoint has state for parameters in no group: {sorted(unowned)[:5]}")
    for child, opt, leaf in leaves(optimizer, contract):
        saved_groups = [g for g in state.param_groups if g.get("child") == child]
        members = [group_fqns(live, names, leaf.implementation) for live in opt.param_groups]
        check_group_members([g["params"] for g in saved_groups], members, child)
        for gi, (live, saved, fqns) in enumerate(zip(opt.param_groups, saved_groups, members)):
            missing = [h for h in leaf.hyperparameters if h not in saved]
            if missing:
                raise CheckpointMismatchError(f"param group {gi} of the checkpoint lacks hyperparameters {missing}")
            for fqn, p in zip(fqns, live["params"]):
                if (entry := state.params.get(fqn)) is None:
                    continue
                if entry.fields and (missing := missing_fields(leaf, entry.fields, entry.shape)):
                    raise CheckpointMismatchError(f"{fqn}: the checkpoint lacks {leaf.implementation}'s required "
                                                  f"field(s) {missing}")
                check_param_shape(fqn, entry.shape, p)
                for name, source in entry.fields.items():
                    if problem := field_spec(leaf, fqn, name).check(entry.shape, source.shape, source.dtype, p.dtype):
                        raise CheckpointMismatchError(f"{fqn}/{name}: {problem}")
