"""What every compressed Gefen optimizer shares: parameter checks, state allocated from the
global shape alone (``gefen.geometry.shape_period``), the codebook learned at the first step
with a nonzero gradient, and a state_dict round trip that never casts the uint8 codes and fails
before it mutates anything.

Subclasses supply ``contract()``, ``_check_group(group)``, ``_state_fields(group, shape)`` (the
fields a parameter of global ``shape`` must have), ``_init_param_state(group, param, period)``
and the step math for every ``(group, param, grad)`` whose state exists, ``_step(work)``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from gefen.codebook import learn_codebook
from gefen.compile import eager_step
from gefen.contract import GLOBAL_STATE_KEY, FieldSpec, OptimizerContract
from gefen.dispatch import batched, block_histograms
from gefen.distributed import (
    ReductionPlan,
    as_field_dtensor,
    is_dtensor,
    local_tensor,
    plan_reduction,
    refusal,
)
from gefen.functional import row_abs_max, rows_view
from gefen.geometry import (
    as_blocks,
    field_global_shape,
    shape_period,
)
from gefen.validation import (
    check_not_adam_state,
    check_params,
    check_step_param,
    param_label,
    plain_hyperparameters,
)

#: the optimizer-wide field that every parameter's state (live and in the state_dict) also carries
CODEBOOK = "codebook"


def apply_load_pre_hooks(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A shallow copy of ``state_dict`` after the optimizer's load_state_dict pre-hooks (as
    ``torch.optim.Optimizer.load_state_dict`` runs them)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    state_dict = state_dict.copy()
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_closure(closure):
    """The loss of ``closure`` evaluated with grad enabled (None without one), as torch's optimizers do."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_field(label: str, name: str, value, spec: FieldSpec, want: tuple[int, ...]) -> None:
    """Raise unless ``value`` is a tensor of ``spec``'s dtype whose rank-local shape is ``want``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"parameter {label}: field {name!r} is a {type(value).__name__}, not a tensor")
    if problem := spec.check_dtype(value.dtype):
        raise TypeError(f"parameter {label}: field {name!r} has {problem}")
    if tuple(local_tensor(value).shape) != want:
        raise ValueError(f"parameter {label}: field {name!r} has shape {tuple(value.shape)}, expected {want}")


def stage_groups(sd: dict, live_groups: list[dict], hyperparameters, *, adapt=None,
                 check=None) -> tuple[list[dict], list[tuple[dict, int, object]], dict]:
    """A state_dict's param groups paired with the live ones (in number, sizes and names): each
    saved group's hyperparameters (``adapt`` may fill or refuse them, ``check`` validates the
    result) on the live group's parameters, with the live group's ``param_names`` or else the
    saved ones (as torch keeps them); every state entry as (its new group, index, entry); and the
    state under keys that are not parameter indices (a hook's ``optimizer.state["key"]``), which
    torch passes through unchanged."""
    saved_groups = sd["param_groups"]
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(live_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups) if isinstance(saved_groups, (list, tuple)) else '?'} param "
            f"groups, the optimizer has {len(live_groups)}"
        )
    groups, index = [], {}
    for gi, (live, saved) in enumerate(zip(live_groups, saved_groups)):
        if not isinstance(saved, dict) or len(saved.get("params", ())) != len(live["params"]):
            raise ValueError(f"param group {gi} of the state_dict does not match the optimizer's group in size")
        live_names, saved_names = live.get("param_names"), saved.get("param_names")
        if live_names and saved_names and list(live_names) != list(saved_names):
            bad = next(a for a, b in zip(live_names, saved_names) if a != b)
            raise ValueError(f"param group {gi}: state_dict names differ from the optimizer's (first: {bad!r})")
        group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        group = adapt(group) if adapt else group
        missing = [h for h in hyperparameters if h not in group]
        if missing:
            raise ValueError(f"param group {gi} of the state_dict lacks hyperparameters {missing}")
        group["params"] = live["params"]
        if live_names or saved_names:
            group["param_names"] = list(live_names or saved_names)
        if check:
            check(group)
        groups.append(group)
        index.update({key: (group, i) for i, key in enumerate(saved["params"])})
    unknown = next((key for key in sd["state"] if key not in index and _is_index(key)), None)
    if unknown is not None:
        raise ValueError(f"state_dict holds state for unknown parameter index {unknown!r}")
    extra = {key: entry for key, entry in sd["state"].items() if key not in index}
    return groups, [(*index[key], entry) for key, entry in sd["state"].items() if key in index], extra


def _is_index(key) -> bool:
    """Does a state_dict's state key name a parameter (torch numbers them)? Other keys are a hook's own."""
    return isinstance(key, int) and not isinstance(key, bool)


def step_tensor(label: str, value):
    """A ``step`` saved as a Python number (what older torch wrote, and torch still loads) as the
    int64 count Gefen keeps; anything else unchanged (the field check judges it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"parameter {label}: field 'step' is {value!r}, not a step count")
    return torch.tensor(int(value), dtype=torch.int64)


class CompressedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, defaults: dict, *, codebook_size: int, bins_per_code: int):
        if not isinstance(codebook_size, int) or not 4 <= codebook_size <= 256:
            raise ValueError(f"codebook_size must be an int in [4, 256] (codes are uint8), got {codebook_size!r}")
        if not isinstance(bins_per_code, int) or bins_per_code < 1:
            raise ValueError(f"bins_per_code must be a positive int, got {bins_per_code!r}")
        self.codebook_size = codebook_size
        self.bins_per_code = bins_per_code
        self.codebook: torch.Tensor | None = None
        self._plan: tuple[tuple[int, ...], ReductionPlan] | None = None
        self._codebooks_in_state: tuple | None = None  # the key of the codebooks the live state holds
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(_add_global_state, prepend=True)

    def __getstate__(self) -> dict:
        """torch pickles only defaults/state/param_groups; the codebooks and sizes travel too
        (the reduction plan is rebuilt on demand)."""
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self.global_books()})
        state.update(codebook_size=self.codebook_size, bins_per_code=self.bins_per_code, _plan=None,
                     _codebooks_in_state=None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_codebooks_in_state", None)

    def global_books(self) -> dict[str, int]:
        """The optimizer-wide codebooks (attributes of these names, None until learned) and their
        sizes; every parameter's live state holds each (``put_codebooks_in_state``) and so does its
        state_dict entry (``_add_global_state``)."""
        return {CODEBOOK: self.codebook_size}

    def put_codebooks_in_state(self) -> None:
        """Put the optimizer-wide codebooks (all-zero until learned) into every parameter's live
        state, one tensor shared by all: torch's ``_unflatten_optim_state_dict`` (and torchtitan's
        copy) rebuild a state_dict from the live state's keys, so only keys it has reach
        ``load_state_dict``. Re-shared only when a book or the state changed."""
        books = {}
        for name, size in self.global_books().items():
            book = getattr(self, name)
            if book is None:
                unlearned = self.__dict__.setdefault("_unlearned", {})
                if name not in unlearned and self.param_groups and self.param_groups[0]["params"]:
                    device = self.param_groups[0]["params"][0].device
                    unlearned[name] = torch.zeros(size, dtype=torch.float32, device=device)
                book = unlearned.get(name)
            if book is not None:
                books[name] = book
        key = (tuple((name, id(book)) for name, book in books.items()), id(self.state), len(self.state))
        if key == self._codebooks_in_state:
            return
        for param, entry in self.state.items():
            if isinstance(param, torch.Tensor):  # a hook's own keys (optimizer.state["key"]) stay as they are
                entry.update(books)
        self._codebooks_in_state = key

    #: the torch optimizer whose refusals at ``step()`` this one repeats (``validation.TORCH_STEP_REFUSALS``)
    torch_name = "Adam"

    #: the codebook is learned when the first non-zero gradients are allocated for (``step``);
    #: an optimizer that learns it inside its step (with more statistics) sets this False
    learns_at_allocation = True

    def _moments_nonzero(self, entry: dict) -> bool:
        """Does this (staged) parameter state hold moments that need the codebooks to decode?"""
        return bool(entry["m_scale"].any())

    #: does the step reduce the row statistics a column split (tensor parallelism's ``Shard(1)``)
    #: cuts? If not, ``reduction_plan`` refuses such a layout before any state exists
    reduces_column_splits = False

    # ----- parameters -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        probe = dict(param_group)
        for name, default in self.defaults.items():
            probe.setdefault(name, default)
        self._check_group(probe)
        super().add_param_group(param_group)
        group = self.param_groups.pop()  # re-appended only once it passes the checks
        check_params(group, self.param_groups)
        self.param_groups.append(group)

    def _grads(self) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
        """(group, param, grad) for every parameter that has a gradient, after checking it; the
        group's tensor hyperparameters read as numbers, the gradient negated under ``maximize``."""
        out, seen = [], set()
        for group in self.param_groups:
            values = plain_hyperparameters(group)
            for i, p in enumerate(group["params"]):
                if p.grad is not None and id(p) not in seen:  # a tensor listed twice is stepped once
                    seen.add(id(p))
                    check_step_param(local_tensor(p), local_tensor(p.grad), param_label(group, i), self.torch_name,
                                     type(self).__name__)
                    out.append((values, p, -p.grad if group.get("maximize") else p.grad))
        return out

    def _positions(self) -> dict[int, int]:
        """id(param) -> its index over all groups (what salts its rounding noise): its first, as
        torch's state_dict numbers a tensor listed twice."""
        positions: dict[int, int] = {}
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            positions.setdefault(id(p), i)
        return positions

    def reduction_plan(self) -> ReductionPlan:
        """Which ranks to sum global statistics over (recomputed when the parameters change)."""
        key = tuple(id(p) for g in self.param_groups for p in g["params"])
        if self._plan is None or self._plan[0] != key:
            named = [(param_label(g, i), p) for g in self.param_groups for i, p in enumerate(g["params"])]
            plan = plan_reduction(named)
            for name, p in named:
                if plan.splits_columns(p) and not self.reduces_column_splits:
                    raise refusal(name, p, type(self).__name__, "use Gefen(moments='m4v4'), which reduces row "
                                  "statistics over the tensor-parallel dimension")
            self._plan = (key, plan)
        return self._plan[1]

    @eager_step
    @torch.no_grad()
    def step(self, closure=None):
        """Run the closure, collect this step's gradients, allocate state (and learn the codebook)
        for parameters seen for the first time, then take the step (``_step``)."""
        loss = run_closure(closure)
        work = self._grads()
        if work:
            self.reduction_plan()  # refuses a layout the block geometry cannot honour, before any state exists
            with batched():  # the step's Triton updates: a few launches for the whole step
                self._initialise_new(work)
                self._step(work)
                self.put_codebooks_in_state()
        return loss

    # ----- the first step with a gradient ---------------------------------------------------
    def _initialise_new(self, work: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> None:
        """Allocate state for parameters seen for the first time (from the global shape alone:
        torch's ``get_state_dict`` fills an empty optimizer by a zero-gradient step and must get the
        checkpoint's shapes) and learn the codebook at the first step whose gradients are not all
        zero on every rank (until then the moments stay exactly zero, as AdamW's do)."""
        new = [(g, p) for g, p, _ in work if p not in self.state]
        staged = {p: self._init_param_state(g, p, shape_period(tuple(p.shape))) for g, p in new}
        self.state.update(staged)
        if self.codebook is None and self.learns_at_allocation:
            self.codebook = self._learn_codebook(work)

    def _learn_codebook(self, work: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The first-moment codebook from this step's gradients (None: every gradient is zero on
        every rank, nothing to learn from); every rank takes part in the same reductions."""
        plan = self.reduction_plan()
        counted = [(p, local_tensor(grad)) for _, p, grad in work if plan.counts(p)]
        # whether any local gradient is non-zero (stops at the first that is: nearly always the first)
        signal = torch.tensor([int(any(_nonzero(g) for _, g in counted))], dtype=torch.int64)
        plan.reducer.sum_(signal)
        if not int(signal):
            return None
        # tensor parallelism: a column-split row is normalised by its whole row's max-abs
        split = [(p, rows_view(local_tensor(grad))) for _, p, grad in work if plan.splits_columns(p)]
        maxes = plan.reduce_rows_([(row_abs_max(g.float()),) for _, g in split], ("max",))
        scales = {id(p): m for (p, _), (m,) in zip(split, maxes)}
        periods = [(p, g, shape_period(tuple(p.shape))) for p, g in counted]
        blocks = [(rows_view(g), scales[id(p)]) if id(p) in scales else as_blocks(g, period)
                  for p, g, period in periods if period > 1]
        codebook = learn_codebook(blocks, self.codebook_size, self.bins_per_code, all_reduce=plan.reducer.sum_,
                                  histogram=block_histograms)
        return codebook.to(work[0][1].device)

    def _step_codebook(self) -> torch.Tensor:
        """The codebook a step quantises with. Before it is learned every moment is zero, and zero
        quantises to code 0 with scale 0 under any codebook, so a uniform one stands in."""
        if self.codebook is not None:
            return self.codebook
        device = self.param_groups[0]["params"][0].device
        return torch.linspace(-1.0, 1.0, self.codebook_size, dtype=torch.float32, device=device)

    # ----- state_dict -----------------------------------------------------------------------
    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Validate and stage everything, then publish: on any error the optimizer is untouched."""
        self.prepare_load_state_dict(state_dict)()

    def prepare_load_state_dict(self, state_dict: dict, *, adopt: bool = False) -> Callable[[], None]:
        """Validate and stage ``state_dict`` without touching the optimizer; the returned callable
        publishes it. gefen_ckpt stages on every rank first and publishes only once all ranks have
        succeeded, so a load that fails anywhere changes nothing anywhere. ``adopt``: the caller
        hands over the state tensors (fresh memory nothing else holds, as a checkpoint read makes):
        they are staged as they are, not copied, where they already lie on the parameter's device."""
        state_dict = apply_load_pre_hooks(self, state_dict)
        groups, state, books = self._stage(state_dict, adopt)

        def publish() -> None:
            self.__setstate__({"state": state, "param_groups": groups})
            for name, book in books.items():
                setattr(self, name, book)
            self._codebooks_in_state = None
            self.put_codebooks_in_state()
            for hook in self._optimizer_load_state_dict_post_hooks.values():
                hook(self)

        return publish

    def _stage(self, sd: dict, adopt: bool = False):
        contract = self.contract()
        for key in ("state", "param_groups"):
            if key not in sd:
                raise ValueError(f"not an optimizer state_dict: missing {key!r}")
        check_not_adam_state(sd, contract.implementation)
        groups, entries, extra = stage_groups(sd, self.param_groups, contract.hyperparameters,
                                              adapt=self._saved_group, check=self._check_group)
        state = defaultdict(dict)
        sizes = self.global_books()
        copies = {name: [] for name in sizes}  # name -> [(where, tensor)]: each parameter's copy, the shared one
        for group, i, entry in entries:
            if isinstance(entry, dict) and set(entry) & set(sizes):
                entry = dict(entry)
                for name in sizes:
                    if name in entry:
                        copies[name].append((f"parameter {param_label(group, i)}", entry.pop(name)))
            state[group["params"][i]] = self._stage_param(contract, group, i, entry, adopt)
        for name in sizes:
            if (shared := (sd.get(GLOBAL_STATE_KEY) or {}).get(name)) is not None:
                copies[name].append(("the optimizer-wide entry", shared))
        books = {name: self._stage_codebook(name, sizes[name], copies[name]) for name in sizes}
        learned = [name for name, book in books.items() if book is not None]
        if learned and len(learned) != len(books):
            missing = sorted(set(books) - set(learned))
            raise ValueError(f"state_dict has a learned {learned[0]} but no {missing[0]}")
        if not learned and any(self._moments_nonzero(entry) for entry in state.values()):
            raise ValueError("state_dict has parameter state but no codebook")
        # one order on every rank, whatever order the state_dict came in: the parameters' (torch's
        # full-state-dict paths issue a collective per parameter and field in the live order)
        order = [p for group in groups for p in group["params"] if p in state]
        ordered = defaultdict(dict, {p: state[p] for p in order})
        ordered.update(extra)
        return groups, ordered, books

    def _saved_group(self, group: dict) -> dict:
        """A saved param group's hyperparameters as this optimizer will use them (a subclass may
        fill options its contract does not record, or refuse the group)."""
        return group

    def _stage_param(self, contract: OptimizerContract, group: dict, i: int, entry, adopt: bool) -> dict:
        param, label = group["params"][i], param_label(group, i)
        if not isinstance(entry, dict):
            raise ValueError(f"state of parameter {label} is not a dict")
        shape = tuple(param.shape)  # a DTensor's global shape
        fields = self._state_fields(group, shape)  # a fresh step's order: staged in it (not a set's)
        required = set(fields)
        known = {f.name for f in contract.fields}
        if set(entry) - known:
            raise ValueError(
                f"state of parameter {label} has fields {sorted(set(entry) - known)} unknown to "
                f"{contract.implementation} (a checkpoint of another optimizer?)"
            )
        if set(entry) != required:
            raise ValueError(
                f"state of parameter {label} has fields {sorted(entry)}, expected {sorted(required)} "
                "(saved with other settings, e.g. factored_v_2d or normuon, or by another optimizer?)"
            )
        period = shape_period(shape)
        if "period" in required:
            period_t = entry["period"]
            if not isinstance(period_t, torch.Tensor) or period_t.numel() != 1:
                raise ValueError(f"parameter {label}: period must be a one-element tensor")
            if int(period_t) != period:  # the one block length (gefen.geometry.shape_period)
                raise ValueError(f"parameter {label}: period {int(period_t)} is not the block length of shape {shape} "
                                 f"({period}: one block per row, 1 for 1-D/0-D tensors and empty rows)")
        local = local_tensor(param)
        staged = {}
        for name in fields:  # torch's full-state-dict paths issue one collective per field in this order
            value, spec = entry[name], contract.field(name)
            if name == "step":
                value = step_tensor(label, value)
            if is_dtensor(value):  # torch's get/set_state_dict hand back the DTensors state_dict() made
                expected = field_global_shape(spec.geometry, shape, period)
                if tuple(value.shape) != expected:
                    raise ValueError(f"parameter {label}: field {name!r} has global shape {tuple(value.shape)}, "
                                     f"expected {expected}")
                value = value.to_local()
            check_field(label, name, value, spec, spec.local_shape(local.shape, shape, period))
            if name == "m_code" and self.codebook_size < 256 and value.numel() and int(value.max()) >= self.codebook_size:
                raise ValueError(f"parameter {label}: field {name!r} holds code {int(value.max())}, "
                                 f"the codebook has {self.codebook_size} entries")  # (any uint8 fits 256)
            device = value.device if spec.geometry == "scalar" else local.device
            # one torch op per field (detach only when needed): each op releases the GIL, which
            # costs a switch interval while another thread runs Python (docs/decisions.md)
            staged[name] = value if adopt and value.device == device else (
                value.detach() if value.requires_grad else value).to(device=device, copy=True)
        return staged

    def _stage_codebook(self, name: str, size: int, copies: list[tuple[str, object]]) -> torch.Tensor | None:
        """The one codebook ``name`` every copy in the state_dict agrees on (None: not learned yet,
        which an all-zero copy stands for)."""
        first = None
        for where, book in copies:
            if not isinstance(book, torch.Tensor) or book.dtype != torch.float32:
                raise TypeError(f"{name} of {where} must be a float32 tensor")
            book = local_tensor(book)
            if tuple(book.shape) != (size,):
                raise ValueError(f"{name} of {where} has shape {tuple(book.shape)}, expected ({size},)")
            if first is None:
                first = (where, book)
            elif not torch.equal(book, first[1]):
                raise ValueError(f"the {name} of {where} differs from that of {first[0]}: the state_dict mixes "
                                 "state of different optimizers")
        codebook = None if first is None or not first[1].any() else first[1]
        if codebook is None:
            return None
        if not torch.isfinite(codebook).all() or codebook[0] != -1 or codebook[-1] != 1:
            raise ValueError(f"{name} must be finite with {name}[0] == -1 and {name}[-1] == +1")
        if (codebook[1:] < codebook[:-1]).any():
            raise ValueError(f"{name} must be sorted ascending")
        device = self.param_groups[0]["params"][0].device if self.param_groups else codebook.device
        return codebook.detach().to(device=device, copy=True)


def _add_global_state(optimizer: CompressedOptimizer, state_dict: dict) -> dict:
    """What torch's state_dict lacks: the codebook, optimizer-wide and in every parameter's state
    (the stock checkpoint API keeps only ``state`` and ``param_groups``; an all-zero codebook
    means "not learned yet", so a fresh optimizer's state_dict already has every key and shape
    ``dcp.load`` fills), and each field of a DTensor parameter as a DTensor of the field's
    global shape, so DCP reshards it like the parameter."""
    books, shared = {}, {}
    for name, size in optimizer.global_books().items():
        live = getattr(optimizer, name)
        if live is not None:
            books[name] = shared[name] = live.clone()
        elif state_dict["state"]:
            device = optimizer.param_groups[0]["params"][0].device
            books[name] = torch.zeros(size, dtype=torch.float32, device=device)
    state_dict[GLOBAL_STATE_KEY] = shared
    params = [p for group in optimizer.param_groups for p in group["params"]]
    first = {}  # id -> the index torch's state_dict numbers a parameter by (its first listing)
    for index, p in enumerate(params):
        first.setdefault(id(p), index)
    with_state = {first[id(p)] for p in optimizer.state if isinstance(p, torch.Tensor)}
    contract = optimizer.contract()
    for index, entry in list(state_dict["state"].items()):
        if index not in with_state:  # a hook's own key (optimizer.state["key"]): passed through as torch does
            continue
        param = params[index]
        entry = dict(entry)  # torch hands out the live per-parameter dicts
        if is_dtensor(param):
            shape = tuple(param.shape)
            period = shape_period(shape)
            for name, value in entry.items():
                geometry = contract.field(name).geometry
                if geometry not in ("scalar", "global"):
                    entry[name] = as_field_dtensor(value, param, geometry, field_global_shape(geometry, shape, period))
        entry.update(books)
        state_dict["state"][index] = entry
    return state_dict


def _nonzero(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a non-zero: its first 4,096 elements decide nearly always, so the
    first step need not scan a whole embedding's gradient (``Tensor.any`` does not stop early)."""
    flat = t.reshape(-1)
    return bool(flat[:4096].any()) or (flat.numel() > 4096 and bool(flat[4096:].any()))
