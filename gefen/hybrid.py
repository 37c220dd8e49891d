"""``GefenMuonHybrid``: Muon on hidden matrices, a backup optimizer on the rest (docs/design.md 3.2).

Muon suits hidden 2-D weights only: embeddings and output heads (tied or not) see sparse or skewed
gradients, and other tensors are not matrices to orthogonalise. The hybrid routes parameters with
``split_params_for_muon`` and presents its two children as one torch optimizer; checkpoint code
sees it through ``gefen.contract``'s composite convention.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from gefen.base import apply_load_pre_hooks, check_field, local_tensor, run_closure, stage_groups
from gefen.compile import eager_step
from gefen.contract import (
    CHILD_KEY,
    CONTRACT_KEY,
    OptimizerContract,
    contract_of,
    join_composite,
    split_composite,
)
from gefen.dispatch import batched
from gefen.muon import GefenMuon
from gefen.optimizer import Gefen
from gefen.validation import param_label

__all__ = ["GefenMuonHybrid", "split_params_for_muon"]

Named = list[tuple[str, torch.Tensor]]

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
#: Name fragments of embeddings and output heads (lower-cased substring match on the FQN).
HEAD_PATTERNS = ("embed", "wte", "wpe", "lm_head", "classifier", "score")
BACKUPS = {"gefen": Gefen, "adamw": torch.optim.AdamW}


def split_params_for_muon(model_or_named_params) -> tuple[Named, Named]:
    """``(muon, backup)`` lists of ``(name, tensor)``: hidden 2-D matrices go to Muon; embeddings
    (by module type and tensor identity, so a tied LM head is caught under any name), names
    matching ``HEAD_PATTERNS``, and every tensor that is not 2-D go to the backup. Given a model,
    only trainable parameters are routed; given named parameters, embeddings are known by name only.
    """
    if isinstance(model_or_named_params, nn.Module):
        model = model_or_named_params
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, EMBEDDING_TYPES)}
    else:
        named, embeddings = _named(model_or_named_params), set()
    _check_unique(named)
    muon, backup = [], []
    for name, p in named:
        hidden = p.dim() == 2 and id(p) not in embeddings and not any(pat in name.lower() for pat in HEAD_PATTERNS)
        (muon if hidden else backup).append((name, p))
    return muon, backup


def _named(items) -> Named:
    """A list of ``(str, tensor)`` pairs, or a TypeError that says what was wrong."""
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                "GefenMuonHybrid needs a model, (name, tensor) pairs or (muon, backup) lists of pairs; got an item "
                f"of type {type(item).__name__}"
            )
        out.append((item[0], item[1]))
    return out


def _check_unique(named: Named) -> None:
    names, ids = {}, {}
    for name, p in named:
        if name in names:
            raise ValueError(f"duplicate parameter name {name!r}")
        if id(p) in ids:
            raise ValueError(f"parameters {ids[id(p)]!r} and {name!r} are the same tensor")
        names[name], ids[id(p)] = p, name


def _is_explicit_split(params) -> bool:
    """``(muon, backup)``: two sequences of pairs, as opposed to a sequence of two pairs."""
    return (isinstance(params, (tuple, list)) and len(params) == 2
            and all(isinstance(half, (list, tuple)) and not (half and isinstance(half[0], str)) for half in params))


def _is_group_list(params) -> bool:
    """Param-group dicts (torch's other form): a non-empty sequence of dicts only."""
    items = list(params) if isinstance(params, (list, tuple)) else None
    if not items or not any(isinstance(item, dict) for item in items):
        return False
    if not all(isinstance(item, dict) for item in items):
        raise TypeError("GefenMuonHybrid got a mix of param-group dicts and other items: pass one form")
    return True


def _group_pairs(group: dict) -> tuple[Named, dict]:
    """A param-group dict's ``(name, tensor)`` pairs (given or named by ``"param_names"``) and its other keys."""
    if not isinstance(group, dict):
        raise TypeError(f"param_group must be a dict, got {type(group).__name__}")
    if "params" not in group:
        raise ValueError("a param group needs 'params'")
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if "param_names" in group:
        names = list(group["param_names"])
        if len(names) != len(params):
            raise ValueError(f"a param group lists {len(names)} param_names for {len(params)} params")
        params = list(zip(names, params))
    if any(not isinstance(p, (tuple, list)) for p in params):
        raise TypeError("GefenMuonHybrid routes parameters by name: give a group (name, tensor) pairs or "
                        "'param_names'")
    return _named(params), {k: v for k, v in group.items() if k not in ("params", "param_names")}


#: one routed param group: its hyperparameters and the (name, tensor) pairs of each child
Routed = list[tuple[dict, Named, Named]]


def _resolve_split(params, model: nn.Module | None) -> Routed:
    """Each input group's hyperparameters and its ``(muon, backup)`` pairs (one group without
    hyperparameters unless param-group dicts were given, each routed by name and shape)."""
    if _is_group_list(params):
        routed = []
        for group in params:
            pairs, hyper = _group_pairs(group)
            routed.append((hyper, *split_params_for_muon(pairs)))
        _check_unique([pair for _, muon, rest in routed for pair in muon + rest])
    elif not _is_explicit_split(params):
        if model is not None:
            raise TypeError("model= only checks explicit (muon, backup) lists or param groups; pass the model itself "
                            "instead")
        return [({}, *split_params_for_muon(params))]
    else:
        muon, backup = _named(params[0]), _named(params[1])
        backup_ids = {id(p): n for n, p in backup}
        for name, p in muon:
            if id(p) in backup_ids:
                raise ValueError(f"parameter {name!r} is in both the Muon and the backup list (as "
                                 f"{backup_ids[id(p)]!r})")
        _check_unique(muon + backup)
        routed = [({}, muon, backup)]
    if model is not None:
        listed = {id(p) for _, muon, rest in routed for _, p in muon + rest}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in listed]
        if missing:
            raise ValueError(f"trainable parameters in neither the Muon nor the backup list: {missing}")
    return routed


def _check_known(children: dict[str, torch.optim.Optimizer], hyper: dict) -> None:
    unknown = sorted(set(hyper) - {k for child in children.values() for k in child.defaults})
    if unknown:
        raise ValueError(f"param group keys unknown to both children: {unknown}")


def _apply_hyper(children: dict[str, torch.optim.Optimizer], hyper: dict, groups: dict[str, dict]) -> None:
    """Give each child's new group the keys of ``hyper`` that child knows, validated as the child's."""
    _check_known(children, hyper)
    for name, group in groups.items():
        child = children[name]
        group.update({k: v for k, v in hyper.items() if k in child.defaults})
        if (check := getattr(child, "_check_group", None)) is not None:
            check(group)


def _keywords(cls) -> set[str]:
    return set(inspect.signature(cls).parameters) - {"params", "lr", "weight_decay"}


def _route_kwargs(kwargs: dict, backup_cls) -> tuple[dict, dict]:
    """Each keyword goes to every child whose constructor takes it (``seed`` may reach both), but
    ``eps`` to the backup only: Muon's ``eps`` (torch's) is Newton-Schulz's norm floor, not Adam's."""
    muon_keys, backup_keys = _keywords(GefenMuon) - {"eps"}, _keywords(backup_cls)
    unknown = sorted(set(kwargs) - muon_keys - backup_keys)
    if unknown:
        raise TypeError(f"GefenMuonHybrid got keyword arguments neither GefenMuon nor {backup_cls.__name__} takes: "
                        f"{unknown}")
    return ({k: v for k, v in kwargs.items() if k in muon_keys}, {k: v for k, v in kwargs.items() if k in backup_keys})


def hybrid_contract(children: dict[str, OptimizerContract]) -> OptimizerContract:
    """The contract of a GefenMuonHybrid whose children have these contracts (``muon``, ``backup``)."""
    return OptimizerContract("gefen.GefenMuonHybrid", "1", (), (), children=tuple(children.items()))


def _pick(override, default):
    return default if override is None else override


class GefenMuonHybrid(torch.optim.Optimizer):
    """GefenMuon for hidden 2-D matrices plus a backup (``"gefen"`` or ``"adamw"``) for the rest.

    ``model_or_named_params`` is a model, an iterable of ``(name, tensor)`` pairs, explicit
    ``(muon_pairs, backup_pairs)`` lists, or param-group dicts as torch's optimizers take them
    (``"params"`` as pairs or with ``"param_names"``; each group is routed by name and shape and
    its other keys reach the child groups made from it, each child the keys it knows). Pass
    ``model=`` with explicit lists or groups to check that they cover every trainable parameter.
    ``lr`` and ``weight_decay`` apply to both halves unless
    ``muon_lr``/``muon_weight_decay``/``backup_lr``/``backup_weight_decay`` override them. Other
    keywords go to every child whose constructor takes them (``momentum``, ``ns_coefficients``,
    ``normuon`` -> Muon; ``betas``, ``eps``, ``factored_v_2d``, ``foreach`` -> backup;
    ``codebook_size``, ``seed``, ``bf16_stochastic_round`` -> each that accepts it).

    Defaults: ``lr=1e-3`` (an AdamW learning rate) with Muon's ``adjust_lr_fn="match_rms_adamw"``,
    which scales Muon's update to AdamW's RMS so one learning rate serves both halves;
    ``weight_decay=0.0`` for both halves unless given; ``backup="gefen"`` (~1 byte/param everywhere).

    Its state_dict follows ``gefen.contract``'s composite convention (``children = {"muon": ...,
    "backup": ...}``), which torch's ``get_state_dict`` / ``set_state_dict`` see whole.
    """

    def __init__(self, model_or_named_params, lr: float = 1e-3, backup: str = "gefen", muon_lr: float | None = None,
                 muon_weight_decay: float | None = None, backup_lr: float | None = None,
                 backup_weight_decay: float | None = None, *, weight_decay: float = 0.0,
                 model: nn.Module | None = None, **kwargs):
        if backup not in BACKUPS:
            raise ValueError(f"backup must be one of {sorted(BACKUPS)}, got {backup!r}")
        routed = _resolve_split(model_or_named_params, model)
        if not any(muon for _, muon, _ in routed):
            raise ValueError("no parameter was routed to Muon (no hidden 2-D matrix): use Gefen or AdamW alone")
        if not any(rest for _, _, rest in routed):
            raise ValueError("no parameter was routed to the backup optimizer: use GefenMuon alone")
        if kwargs.get("bf16_stochastic_round") and backup == "adamw":
            raise ValueError("bf16_stochastic_round=True needs backup='gefen': torch.optim.AdamW rounds bf16 "
                             "parameters to nearest")
        muon_kwargs, backup_kwargs = _route_kwargs(kwargs, BACKUPS[backup])
        muon_kwargs.setdefault("adjust_lr_fn", "match_rms_adamw")
        # one child group per input group and child it has members in; each gets the group's keys
        # the child knows once the children (and so their defaults) exist
        self.children: dict[str, torch.optim.Optimizer] = {
            "muon": GefenMuon([{"params": muon} for _, muon, _ in routed if muon], lr=_pick(muon_lr, lr),
                              weight_decay=_pick(muon_weight_decay, weight_decay), **muon_kwargs),
            "backup": BACKUPS[backup]([{"params": rest} for _, _, rest in routed if rest], lr=_pick(backup_lr, lr),
                                      weight_decay=_pick(backup_weight_decay, weight_decay), **backup_kwargs),
        }
        groups = {name: iter(child.param_groups) for name, child in self.children.items()}
        for hyper, muon, rest in routed:
            _apply_hyper(self.children, hyper, {name: next(groups[name]) for name, part in
                                                (("muon", muon), ("backup", rest)) if part})
        self._tag_groups()
        # Optimizer.__init__ would own param_groups/state; the children own them, so only the
        # hook machinery is set up (the same path torch uses when unpickling an optimizer).
        torch.optim.Optimizer.__setstate__(self, {"defaults": dict(lr=lr, weight_decay=weight_decay, backup=backup)})

    def _tag_groups(self) -> None:
        """Every child group names its child (``CHILD_KEY``), live as in ``state_dict()``: torch's
        ``_unflatten_optim_state_dict`` and torchtitan's copy rebuild the groups from the keys of
        the live ``param_groups``, so a key only the state_dict had would be lost on load."""
        for name, child in self.children.items():
            for group in child.param_groups:
                group[CHILD_KEY] = name

    def __getstate__(self) -> dict:
        return self.__dict__.copy()  # torch's version keeps only defaults/state/param_groups

    # ----- one optimizer over the children --------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The children's group dicts themselves, so LR schedulers and GradScaler act on them."""
        return [group for child in self.children.values() for group in child.param_groups]

    @property
    def state(self) -> defaultdict:
        """A merged view of the children's per-parameter state (the inner dicts are live)."""
        merged = defaultdict(dict)
        for child in self.children.values():
            merged.update(child.state)
        return merged

    def contract(self) -> OptimizerContract:
        return hybrid_contract({name: contract_of(child) for name, child in self.children.items()})

    @eager_step
    def step(self, closure=None):
        loss = run_closure(closure)
        with batched():  # both children's Triton updates launch together
            for child in self.children.values():
                child.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.children.values():
            child.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Route a named group (``(name, tensor)`` pairs or ``"param_names"``) as the constructor does."""
        pairs, hyper = _group_pairs(param_group)
        muon, rest = split_params_for_muon(pairs)
        known = {id(p) for group in self.param_groups for p in group["params"]}
        for name, p in muon + rest:
            if id(p) in known:
                raise ValueError(f"parameter {name!r} is already optimised by this GefenMuonHybrid")
        _check_known(self.children, hyper)
        added = []
        try:
            for name, part in (("muon", muon), ("backup", rest)):
                if part:
                    child = self.children[name]
                    child.add_param_group({"params": part, **{k: v for k, v in hyper.items() if k in child.defaults}})
                    added.append(child)
        except Exception:
            for child in added:
                child.param_groups.pop()
            raise
        self._tag_groups()

    # ----- state_dict -----------------------------------------------------------------------
    @torch._disable_dynamo
    def state_dict(self) -> dict:
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        sd = join_composite({n: c.state_dict() for n, c in self.children.items()})
        sd[CONTRACT_KEY] = self.contract().to_dict()  # so a torch.save'd file names its optimizer
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Stage and validate both children, then publish both: on any error neither changes."""
        self.prepare_load_state_dict(state_dict)()

    def prepare_load_state_dict(self, state_dict: dict, *, adopt: bool = False) -> Callable[[], None]:
        """Validate and stage both children without touching either; the returned callable publishes
        both. ``adopt``: as ``Gefen.prepare_load_state_dict``'s."""
        state_dict = apply_load_pre_hooks(self, state_dict)
        try:
            saved = split_composite(state_dict, list(self.children))
        except ValueError as exc:
            raise ValueError(f"not a GefenMuonHybrid state_dict: {exc}") from None
        staged = []
        for name, child in self.children.items():
            try:
                staged.append(_prepare_child_load(child, saved[name], adopt))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"child {name!r}: {exc}") from exc
        # a torch child's own load can still refuse (it checks group structure), so it goes first
        staged.sort(key=lambda s: not s[0])

        def publish() -> None:
            for _, publish_child in staged:
                publish_child()
            self._tag_groups()
            for hook in self._optimizer_load_state_dict_post_hooks.values():
                hook(self)

        return publish


def _prepare_child_load(child: torch.optim.Optimizer, sd, adopt: bool) -> tuple[bool, Callable[[], None]]:
    """``(may_still_fail, publish)`` for one child, after validating ``sd`` completely (a torch
    optimizer keeps the very tensors it is given: unless they are adopted, it gets a copy, as
    Gefen children do)."""
    prepare = getattr(child, "prepare_load_state_dict", None)
    if prepare is not None:
        return False, prepare(sd, adopt=adopt)
    _check_plain_state_dict(child, sd)
    return True, functools.partial(child.load_state_dict, sd if adopt else copy.deepcopy(sd))


def _check_plain_state_dict(opt: torch.optim.Optimizer, sd) -> None:
    """torch optimizers check group structure but load any state shape: check the state against
    the contract so a bad checkpoint fails before either child is touched."""
    contract = contract_of(opt)
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("param_groups"), list):
        raise ValueError(f"not a {contract.implementation} state_dict")
    fields = {f.name: f for f in contract.fields}
    required = {f.name for f in contract.fields if not f.optional}
    for group, i, entry in stage_groups(sd, opt.param_groups, contract.hyperparameters)[1]:
        label = param_label(group, i)
        if not isinstance(entry, dict) or set(entry) - set(fields) or required - set(entry):
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"state of parameter {label} has fields {got}, but {contract.implementation} keeps "
                             f"{sorted(required)} (+ optional {sorted(set(fields) - required)}); another optimizer's?")
        param = group["params"][i]
        for name, value in entry.items():  # ``param`` (DTensors for DTensor parameters) or ``scalar`` fields
            if name == "step" and isinstance(value, (int, float)):
                continue  # older torch's Python step: torch's own load makes it a tensor
            want = fields[name].local_shape(local_tensor(param).shape, tuple(param.shape), 1)
            check_field(label, name, value, fields[name], want)
