"""Contracts: how the checkpoint subsystem sees an optimizer's state (docs/design.md 4).

A contract is a frozen, msgpack-able description of every state field: name, dtype and *geometry*
(how it lies relative to the parameter, so how it shards along dim 0). ``gefen_ckpt`` slices,
assembles and validates state only through contracts. Optimizer-wide fields live under
``state_dict()[GLOBAL_STATE_KEY]``; a composite optimizer (``GefenMuonHybrid``) exposes ``children``
named as in its contract and a flat state_dict (``join_composite``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gefen.geometry import GEOMETRIES, field_local_shape, shape_problem

if TYPE_CHECKING:  # torch is imported only where torch optimizers are involved: reading a
    import torch  # manifest (gefen-ckpt inspect/verify) needs no torch

#: The canonical-state schema this code writes and reads.
SCHEMA_VERSION = 1
GLOBAL_STATE_KEY = "global_state"
#: the nested composite form (read, never written): ``state_dict()[CHILDREN_KEY][name]``
CHILDREN_KEY = "children"
#: a composite optimizer's param group names the child that owns it under this key
CHILD_KEY = "child"
#: a composite optimizer's state_dict records its contract (``to_dict()``) under this key
CONTRACT_KEY = "contract"

#: dtype placeholder for fields stored in the parameter's own dtype (torch AdamW's moments)
LIKE_PARAM = "like_param"
#: layouts whose per-parameter fields depend on the parameter's number of dimensions (their
#: contracts mark these fields optional): (implementation, version) -> (the fields of a tensor
#: of >= 2 dims, the fields of a 1-D or 0-D tensor)
DIMENSION_FIELDS = {
    ("gefen.Gefen", "2"): (("step", "mv_code", "m_row_scale", "v_row", "v_col"), ("step", "exp_avg", "exp_avg_sq")),
}


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: str
    geometry: str
    optional: bool = False

    def __post_init__(self):
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"field {self.name!r}: unknown geometry {self.geometry!r}")

    @property
    def row_sharded(self) -> bool:
        return GEOMETRIES[self.geometry]

    def check(self, shape: tuple[int, ...], value_shape, value_dtype, param_dtype=None) -> str | None:
        """Why a value (global shape, dtype) cannot be this field of a parameter of global ``shape``
        and ``param_dtype``; None when it can (each reader and loader chooses the exception)."""
        return self.check_dtype(value_dtype, param_dtype) or self.check_shape(shape, value_shape)

    def check_dtype(self, dtype, param_dtype=None) -> str | None:
        """Torch dtypes or their names; ``param_dtype`` None: any floating dtype is like the parameter's."""
        got = _dtype_name(dtype)
        if self.dtype != LIKE_PARAM:
            want = self.dtype
        elif param_dtype is not None:
            want = _dtype_name(param_dtype)
        else:
            want = got if got.startswith(("float", "bfloat")) else "a floating dtype"
        return None if got == want else f"dtype {got}, expected {want}"

    def check_shape(self, shape: tuple[int, ...], value_shape) -> str | None:
        return shape_problem(self.geometry, shape, value_shape)

    def local_shape(self, local: tuple[int, ...], shape: tuple[int, ...], period: int) -> tuple[int, ...]:
        return field_local_shape(self.geometry, local, shape, period)


def _dtype_name(dtype) -> str:  # torch.float32 or "float32" -> "float32" (no torch import here)
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class OptimizerContract:
    implementation: str
    version: str
    hyperparameters: tuple[str, ...]
    fields: tuple[FieldSpec, ...]
    global_fields: tuple[FieldSpec, ...] = ()
    children: tuple[tuple[str, OptimizerContract], ...] = ()
    schema_version: int = SCHEMA_VERSION
    #: torch optimizers keep a DTensor parameter's row-sharded state as DTensors; Gefen's
    #: optimizers keep plain rank-local tensors (cheaper per-step dispatch)
    dtensor_state: bool = False

    def field(self, name: str) -> FieldSpec:
        for f in self.fields + self.global_fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.implementation} has no state field {name!r}")

    def child(self, name: str) -> OptimizerContract:
        for child_name, contract in self.children:
            if child_name == name:
                return contract
        raise KeyError(f"{self.implementation} has no child optimizer {name!r}")

    def leaf(self, child: str | None) -> OptimizerContract:
        """The contract of the optimizer that owns a parameter: ``child``'s, or this one (None)."""
        return self if child is None else self.child(child)

    def leaves(self) -> tuple[tuple[str | None, OptimizerContract], ...]:
        """(child name, contract) of every non-composite optimizer inside (composites are one level deep)."""
        return self.children or ((None, self),)

    def to_dict(self) -> dict:
        """Plain dict of str/int/list only (msgpack- and JSON-able)."""
        return {
            "implementation": self.implementation,
            "version": self.version,
            "schema_version": self.schema_version,
            "hyperparameters": list(self.hyperparameters),
            "fields": [dataclasses.asdict(f) for f in self.fields],
            "global_fields": [dataclasses.asdict(f) for f in self.global_fields],
            "children": [[name, c.to_dict()] for name, c in self.children],
            "dtensor_state": self.dtensor_state,
        }

    @classmethod
    def from_dict(cls, data: dict) -> OptimizerContract:
        try:
            return cls(
                implementation=str(data["implementation"]),
                version=str(data["version"]),
                schema_version=int(data["schema_version"]),
                hyperparameters=tuple(str(h) for h in data["hyperparameters"]),
                fields=tuple(FieldSpec(**f) for f in data["fields"]),
                global_fields=tuple(FieldSpec(**f) for f in data.get("global_fields", ())),
                children=tuple((str(n), cls.from_dict(c)) for n, c in data.get("children", ())),
                dtensor_state=bool(data.get("dtensor_state", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed optimizer contract: {exc}") from exc


_ADAM_FIELDS = (
    FieldSpec("step", "float32", "scalar"),
    FieldSpec("exp_avg", LIKE_PARAM, "param"),
    FieldSpec("exp_avg_sq", LIKE_PARAM, "param"),
    FieldSpec("max_exp_avg_sq", LIKE_PARAM, "param", optional=True),
)
_ADAM_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


@functools.cache
def torch_contracts() -> dict[type, OptimizerContract]:
    """optimizer class -> contract, for the supported torch optimizers (versioned by torch's version)."""
    import torch

    version = torch.__version__.split("+")[0]
    return {
        **{cls: OptimizerContract(f"torch.optim.{cls.__name__}", version, _ADAM_HYPER, _ADAM_FIELDS, dtensor_state=True)
           for cls in (torch.optim.AdamW, torch.optim.Adam)},
        torch.optim.SGD: OptimizerContract(
            "torch.optim.SGD",
            version,
            ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
            (FieldSpec("momentum_buffer", LIKE_PARAM, "param", optional=True),),
            dtensor_state=True,
        ),
    }


def contract_of(optimizer: torch.optim.Optimizer) -> OptimizerContract:
    """The contract of a Gefen optimizer or of a supported torch optimizer."""
    own = getattr(optimizer, "contract", None)
    if callable(own):
        return own()
    contract = torch_contracts().get(type(optimizer))
    if contract is None:
        supported = ", ".join(sorted(c.implementation for c in torch_contracts().values()))
        raise TypeError(
            f"no contract for {type(optimizer).__module__}.{type(optimizer).__qualname__}; "
            f"supported: Gefen optimizers, {supported}"
        )
    return contract


# ----- composite state_dicts ----------------------------------------------------------------
def composite_children(state_dict) -> list[str]:
    """The child names a composite state_dict mentions, in order ([] for any other state_dict)."""
    if not isinstance(state_dict, dict):
        return []
    nested = state_dict.get(CHILDREN_KEY)
    if isinstance(nested, dict) and nested:
        return [str(name) for name in nested]
    groups = state_dict.get("param_groups")
    names = [g[CHILD_KEY] for g in groups if isinstance(g, dict) and CHILD_KEY in g] if isinstance(groups, list) else []
    return list(dict.fromkeys(map(str, names)))


def join_composite(children: dict[str, dict]) -> dict:
    """The flat state_dict of a composite optimizer from its children's (``{name: state_dict}``, in
    the composite's order), which torch's ``get_state_dict`` sees whole: every child's groups in
    order, each naming its child under ``CHILD_KEY``; ``params`` and ``state`` numbered over those
    groups; a child's optimizer-wide field ``f`` under ``GLOBAL_STATE_KEY["<child>/f"]``. Entries and
    group values are shared, not copied."""
    state, groups, shared, index = {}, [], {}, 0
    for name, sd in children.items():
        if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("param_groups"), list):
            raise ValueError(f"child {name!r}: not an optimizer state_dict")
        for key, value in (sd.get(GLOBAL_STATE_KEY) or {}).items():
            shared[f"{name}/{key}"] = value
        for gi, group in enumerate(sd["param_groups"]):
            if not isinstance(group, dict) or not isinstance(group.get("params"), (list, tuple)):
                raise ValueError(f"child {name!r}: param group {gi} has no 'params' list")
            numbers = list(range(index, index + len(group["params"])))
            groups.append({**group, "params": numbers, CHILD_KEY: name})
            state.update({new: sd["state"][old] for old, new in zip(group["params"], numbers) if old in sd["state"]})
            index += len(numbers)
        stray = set(sd["state"]) - {key for group in sd["param_groups"] for key in group["params"]}
        if stray:
            raise ValueError(f"child {name!r}: state for parameters {sorted(stray, key=repr)[:5]} in no param group")
    out = {"state": state, "param_groups": groups}
    if shared:
        out[GLOBAL_STATE_KEY] = shared
    return out


def split_composite(state_dict: dict, children: list[str]) -> dict[str, dict]:
    """One state_dict per child (``children``: the composite's child names, in order) from a
    composite state_dict, flat or nested (``{"state": {}, "param_groups": [], CHILDREN_KEY: {name:
    child_sd}}``), renumbered from 0. Pure: nothing is copied or changed; ValueError names what is wrong."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"a {type(state_dict).__name__}, not a state_dict")
    if CHILDREN_KEY in state_dict:  # the nested form: brought to the flat one, then split like it
        nested = state_dict[CHILDREN_KEY]
        if not isinstance(nested, dict):
            raise ValueError(f"{CHILDREN_KEY!r} is a {type(nested).__name__}, not a dict of child state_dicts")
        if state_dict.get("state") or state_dict.get("param_groups"):
            raise ValueError(f"a state_dict with {CHILDREN_KEY!r} keeps everything in its children; "
                             "top-level state must be empty")
        state_dict = join_composite(nested)
    state, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, (list, tuple)):
        raise ValueError("not an optimizer state_dict: 'state' or 'param_groups' missing or malformed")
    out = {name: {"state": {}, "param_groups": []} for name in children}
    placed: set = set()
    for gi, group in enumerate(groups):
        if not isinstance(group, dict) or not isinstance(group.get("params"), (list, tuple)):
            raise ValueError(f"param group {gi} has no 'params' list")
        name = group.get(CHILD_KEY)
        if name not in out:
            raise ValueError(f"param group {gi} names child {name!r}, expected one of {list(children)} under "
                             f"{CHILD_KEY!r} (a state_dict of another optimizer?)")
        child = out[name]
        start = sum(len(g["params"]) for g in child["param_groups"])
        numbers = list(range(start, start + len(group["params"])))
        for key, number in zip(group["params"], numbers):
            if key in placed:
                raise ValueError(f"parameter {key!r} is in two param groups")
            placed.add(key)
            if key in state:
                child["state"][number] = state[key]
        child["param_groups"].append({**{k: v for k, v in group.items() if k != CHILD_KEY}, "params": numbers})
    stray = [key for key in state if key not in placed]
    if stray:
        raise ValueError(f"state for parameters {stray[:5]} that are in no param group")
    empty = [name for name, sd in out.items() if not sd["param_groups"]]
    if empty:
        raise ValueError(f"no param group of child {empty[0]!r} (children {list(children)}, groups name "
                         f"{composite_children(state_dict)})")
    for key, value in (state_dict.get(GLOBAL_STATE_KEY) or {}).items():
        name, _, field = str(key).partition("/")
        if name not in out or not field:
            raise ValueError(f"optimizer-wide field {key!r} is not '<child>/<field>' of a child in {list(children)}")
        out[name].setdefault(GLOBAL_STATE_KEY, {})[field] = value
    return out
