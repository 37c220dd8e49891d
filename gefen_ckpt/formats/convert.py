"""Moving state between torch's AdamW/Adam and Gefen's optimizers: warm start and dense export.

Every conversion passes through AdamW's form (one ``Dense`` per parameter: step, ``exp_avg``,
``exp_avg_sq``, the latter ``None`` where the source keeps none, as Muon does), then builds the
target with Gefen's own functions (``learn_codebook`` as at the first step, ``shape_period``,
the layout's codec) and reads it back through the codec's decode, so the reported error is what
the target will use against what the source held. Codes are the *nearest*: a one-off
quantisation has no bias to average out, and nearest has the smaller error.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from gefen.codebook import learn_codebook
from gefen.codecs import M4V4Codec, M8Codec
from gefen.contract import OptimizerContract
from gefen.functional import is_coded, is_factored
from gefen.geometry import as_blocks, shape_period
from gefen.state_layouts import CONTRACTS as GEFEN_LAYOUTS
from gefen.stochastic import CODES, ratio_table, v_grid
from gefen_ckpt.errors import CheckpointMismatchError
from gefen_ckpt.formats.torch_file import known_contracts
from gefen_ckpt.state.canonical import CanonicalState, EagerSource, ParamState, global_key
from gefen_ckpt.wire.manifest import names_optimizer

__all__ = ["TARGETS", "convert_state", "resolve_target"]

GEFEN, MUON, HYBRID, ADAMW, ADAM = ("gefen.Gefen", "gefen.GefenMuon", "gefen.GefenMuonHybrid", "torch.optim.AdamW",
                                    "torch.optim.Adam")
TARGETS = (GEFEN, MUON, HYBRID, ADAMW)


@dataclass
class Dense:
    """One parameter's state in AdamW's form (fp32 moments)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor | None


def resolve_target(name: str) -> str:
    """``"Gefen"``, ``"gefen.GefenMuon"``, ``"adamw"``... -> the implementation name."""
    for impl in TARGETS:
        if names_optimizer(name, impl):
            return impl
    raise CheckpointMismatchError(f"cannot convert into {name!r}: no mapping; targets: "
                                  f"{', '.join(t.rsplit('.', 1)[-1] for t in TARGETS)}")


def convert_state(state: CanonicalState, into: str, *, moments: str = "m4v4", factored_v_2d: bool = True,
                  codebook_size: int | None = None, bins_per_code: int | None = None, backup: str = "gefen",
                  muon_params: list[str] | None = None) -> CanonicalState:
    """``state`` (AdamW, Adam, Gefen of either layout, GefenMuon or GefenMuonHybrid) as ``into``'s state.

    ``into``: ``Gefen``, ``GefenMuon``, ``GefenMuonHybrid`` or ``AdamW``. ``moments``,
    ``factored_v_2d``, ``codebook_size``, ``bins_per_code`` and ``backup`` (the hybrid's) are the
    target's constructor options (its defaults when omitted; ``moments`` and ``factored_v_2d``
    apply to Gefen and the hybrid's Gefen backup, ``factored_v_2d=False`` needs ``moments="m8"``). ``muon_params``: the FQNs the hybrid routes
    to Muon, e.g. ``[n for n, _ in split_params_for_muon(model)[0]]``; by default they are routed
    by name and shape alone, which cannot recognise an embedding by its module type. Parameters
    whose source keeps no second moment (Muon's) get no state in a target that needs one: they
    start afresh, as any new parameter does. The result's ``metadata["conversion"]`` reports what
    happened and the relative errors of the first and second moments (see docs/cli.md). Raises
    ``CheckpointMismatchError`` when a mapping is not defined or a hyperparameter cannot be
    carried; nothing is returned half-converted. Memory: the source's moments in fp32 plus the
    target's state (the report reads the target back one parameter at a time).
    """
    target = resolve_target(into)
    source = state.contract.implementation
    groups, dense = dense_view(state)
    if backup not in ("gefen", "adamw"):
        raise CheckpointMismatchError(f"backup must be 'gefen' or 'adamw', got {backup!r}")
    if moments not in GEFEN_LAYOUTS:
        raise CheckpointMismatchError(f"moments must be one of {list(GEFEN_LAYOUTS)}, got {moments!r}")
    if moments == "m4v4" and not factored_v_2d:
        raise CheckpointMismatchError("m4v4 codes the second moment against the factored estimate; "
                                      "factored_v_2d=False needs moments='m8'")
    if moments == "m4v4" and codebook_size not in (None, CODES):
        raise CheckpointMismatchError(f"moments='m4v4' packs two 4-bit codes in a byte: codebook_size must be "
                                      f"{CODES}, got {codebook_size!r} (other sizes need moments='m8')")
    options = {"moments": moments, "factored_v_2d": factored_v_2d, "codebook_size": codebook_size,
               "bins_per_code": bins_per_code}
    if target == HYBRID:
        out = _build_hybrid(groups, dense, options, backup, muon_params)
    else:
        out = _build_leaf(target, groups, dense, options)
    out.metadata = {**{k: v for k, v in state.metadata.items() if k != "conversion"},
                    "conversion": _report(source, target, dense, out)}
    return out


# ----- source -> dense ----------------------------------------------------------------------
def dense_view(state: CanonicalState) -> tuple[list[dict], dict[str, Dense]]:
    """(groups in AdamW's terms with ``params`` and ``child``, fqn -> ``Dense``) of any supported state."""
    groups, dense = [], {}
    for group in state.param_groups:
        child = group.get("child")
        leaf = state.contract.leaf(child)
        groups.append({"params": list(group["params"]), "child": child, **_carried(leaf.implementation, group)})
        books = state.globals_of(child)
        for fqn in group["params"]:
            entry = state.params.get(fqn)
            if entry is not None and entry.fields:
                dense[fqn] = _dense_param(leaf.implementation, fqn, entry, books)
    return groups, dense


def _number(impl: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointMismatchError(f"{impl}'s {name} {value!r} cannot be carried: not a finite number")
    return float(value)


def _carried(impl: str, group: dict) -> dict:
    """The group's hyperparameters in AdamW's meaning, or an error saying which cannot be carried."""
    if impl in (ADAMW, ADAM):
        for flag, why in (("amsgrad", "its max_exp_avg_sq has no counterpart"),
                          ("maximize", "the targets only minimise")):
            if group.get(flag):
                raise CheckpointMismatchError(f"{impl} with {flag}=True cannot be converted: {why}")
        if impl == ADAM and group.get("weight_decay"):
            raise CheckpointMismatchError(
                "torch.optim.Adam's weight_decay is an L2 penalty added to the gradient, not AdamW's decoupled decay: "
                "it cannot be carried (weight_decay must be 0)")
    if impl in (ADAMW, ADAM, GEFEN):
        betas = group.get("betas")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise CheckpointMismatchError(f"{impl}'s betas {betas!r} cannot be carried: not a pair")
        beta1, beta2 = (_number(impl, "betas", b) for b in betas)
        return {"lr": _number(impl, "lr", group.get("lr")), "beta1": beta1, "beta2": beta2,
                "eps": _number(impl, "eps", group.get("eps")),
                "weight_decay": _number(impl, "weight_decay", group.get("weight_decay"))}
    if impl == MUON:
        adjust = group.get("adjust_lr_fn")
        if adjust != "match_rms_adamw":
            raise CheckpointMismatchError(
                f"GefenMuon's lr cannot be carried: with adjust_lr_fn={adjust!r} it is not on AdamW's "
                "scale (only adjust_lr_fn='match_rms_adamw', GefenMuonHybrid's default, is)")
        return {"lr": _number(impl, "lr", group.get("lr")), "beta1": _number(impl, "momentum", group.get("momentum")),
                "beta2": None, "eps": None,
                "weight_decay": _number(impl, "weight_decay", group.get("weight_decay"))}
    raise CheckpointMismatchError(f"{impl} state cannot be converted: no mapping (sources: AdamW, Adam, Gefen, "
                                  "GefenMuon, GefenMuonHybrid)")


def _dense_param(impl: str, fqn: str, entry: ParamState, books: dict) -> Dense:
    fields = {name: src.read() for name, src in entry.fields.items()}
    step = int(round(float(fields["step"])))
    if "exp_avg" in fields:  # AdamW/Adam, and Gefen's 1-D moments
        return Dense(entry.shape, entry.dtype, step, fields["exp_avg"].float(), fields["exp_avg_sq"].float())
    m4v4 = "mv_code" in fields
    for book in ("codebook", "v_codebook") if m4v4 else ("codebook",):
        if books.get(book) is None:
            raise CheckpointMismatchError(f"{fqn}: {impl} state without a {book}")
    codebook = books["codebook"].read().float()
    codec = M4V4Codec(codebook, ratio_table(books["v_codebook"].read().float())) if m4v4 else M8Codec(codebook)
    return Dense(entry.shape, entry.dtype, step, *codec.decode(fields))


# ----- dense -> target ----------------------------------------------------------------------
def _defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not inspect.Parameter.empty}


def group_defaults(contract: OptimizerContract) -> dict:
    """Every key a group of the optimizer of (leaf) ``contract`` holds, with its default (an
    instance's ``defaults``; {} for an optimizer this module does not build). Writers of torch's
    flattened layout fill a group's missing keys from it: torch rebuilds a flattened state dict
    from the keys of the *live* groups, so a converted group must have them all."""
    cls = _optimizer_class(contract.implementation)
    if cls is None:
        return {}
    moments = next((m for m, c in GEFEN_LAYOUTS.items() if c.version == contract.version), None)
    kwargs = {"moments": moments} if contract.implementation == GEFEN and moments else {}
    probe = cls([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs).defaults
    return {k: list(v) if isinstance(v, tuple) else v for k, v in probe.items()}


def _target_group(target: str, g: dict, options: dict) -> dict:
    """The target's hyperparameters for a group: carried where they mean the same, else its defaults."""
    if target in (ADAMW, GEFEN):
        d = _defaults(_optimizer_class(target))
        group = {"lr": g["lr"], "betas": [g["beta1"], d["betas"][1] if g["beta2"] is None else g["beta2"]],
                 "eps": d["eps"] if g["eps"] is None else g["eps"], "weight_decay": g["weight_decay"]}
        if target == ADAMW:
            return group | {"amsgrad": False, "maximize": False}
        group["factored_v_2d"] = bool(options["factored_v_2d"])
        return group | ({"moments": "m4v4", "seed": d["seed"]} if options["moments"] == "m4v4" else {})
    d = _defaults(_optimizer_class(MUON))  # the lr is AdamW's, so Muon's update is scaled to AdamW's RMS
    return {**{h: d[h] for h in ("nesterov", "ns_coefficients", "eps", "ns_steps", "normuon", "beta2", "normuon_eps")},
            "lr": g["lr"], "momentum": g["beta1"], "weight_decay": g["weight_decay"],
            "adjust_lr_fn": "match_rms_adamw"}


def _build_leaf(target: str, groups: list[dict], dense: dict[str, Dense], options: dict,
                child: str | None = None) -> CanonicalState:
    extra = {} if child is None else {"child": child}
    out_groups = [{**_target_group(target, g, options), "params": list(g["params"]), **extra} for g in groups]
    if target == MUON:
        flat = [f for g in groups for f in g["params"] if f in dense and len(dense[f].shape) != 2]
        if flat:
            raise CheckpointMismatchError(f"GefenMuon takes 2-D parameters only, but {flat[0]!r} has shape "
                                          f"{dense[flat[0]].shape}: convert into GefenMuonHybrid (or Gefen)")
    members = [fqn for g in groups for fqn in g["params"] if fqn in dense]
    if target != MUON:  # AdamW and Gefen need a second moment: parameters without one start afresh
        members = [fqn for fqn in members if dense[fqn].exp_avg_sq is not None]
    params, global_fields = {}, {}
    if target == GEFEN and options["moments"] == "m4v4":
        params, global_fields = _build_m4v4(members, dense, options, child)
    elif target == ADAMW:
        for fqn in members:
            d = dense[fqn]
            params[fqn] = _state(d, child, step=torch.tensor(float(d.step), dtype=torch.float32),
                                 exp_avg=d.exp_avg.to(d.dtype), exp_avg_sq=d.exp_avg_sq.to(d.dtype))
    elif members:
        defaults = _defaults(_optimizer_class(target))
        size = options["codebook_size"] or defaults["codebook_size"] or 256  # (Gefen's m8 default)
        bins = options["bins_per_code"] or defaults["bins_per_code"]
        periods = {fqn: shape_period(dense[fqn].shape) for fqn in members}
        # as at the first step: every block of more than one element, normalised, into one histogram
        codebook = learn_codebook([as_blocks(dense[f].exp_avg, periods[f]) for f in members if periods[f] > 1],
                                  size, bins)
        global_fields[global_key(child, "codebook")] = EagerSource(codebook)
        for fqn in members:
            d, factored = dense[fqn], is_factored(dense[fqn].shape, bool(options["factored_v_2d"]))
            v = d.exp_avg_sq.reshape(d.shape) if target == GEFEN else None  # (GefenMuon keeps none)
            params[fqn] = _state(d, child, step=torch.tensor(d.step, dtype=torch.int64),
                                 **M8Codec(codebook).encode(d.exp_avg.reshape(d.shape), v, periods[fqn], factored))
    contract = GEFEN_LAYOUTS[options["moments"]] if target == GEFEN else known_contracts()[target]
    return CanonicalState(contract, out_groups, params, global_fields)


def _build_m4v4(members: list[str], dense: dict[str, Dense], options: dict, child: str | None):
    """Gefen's default layout from AdamW's form: 1-D tensors keep their moments (``exp_avg`` in
    bf16); for the others the codebooks as at the first step, then nearest codes."""
    params, global_fields = {}, {}
    coded = [fqn for fqn in members if is_coded(dense[fqn].shape)]
    for fqn in members:
        if fqn not in coded:
            d = dense[fqn]
            params[fqn] = _state(d, child, step=torch.tensor(d.step, dtype=torch.int64),
                                 exp_avg=d.exp_avg.to(torch.bfloat16).reshape(d.shape),
                                 exp_avg_sq=d.exp_avg_sq.float().reshape(d.shape))
    if not coded:
        return params, global_fields
    rows = [dense[fqn].exp_avg.flatten(1) for fqn in coded]
    codebook = learn_codebook([m.unsqueeze(1) for m in rows if m.shape[1] > 1], CODES, options["bins_per_code"] or 16)
    codec, v_codebook = M4V4Codec(codebook), v_grid()
    global_fields[global_key(child, "codebook")] = EagerSource(codebook)
    global_fields[global_key(child, "v_codebook")] = EagerSource(v_codebook)
    for fqn in coded:
        d = dense[fqn]
        params[fqn] = _state(d, child, step=torch.tensor(d.step, dtype=torch.int64),
                             **codec.encode_nearest(d.exp_avg.reshape(d.shape), d.exp_avg_sq.reshape(d.shape), v_codebook))
    return params, global_fields


def _optimizer_class(implementation: str) -> type | None:
    """The class of ``implementation`` (Gefen's imported on use: AdamW's conversions need none)."""
    if implementation == GEFEN:
        from gefen.optimizer import Gefen

        return Gefen
    if implementation == MUON:
        from gefen.muon import GefenMuon

        return GefenMuon
    return {ADAMW: torch.optim.AdamW, ADAM: torch.optim.Adam}.get(implementation)


def _state(d: Dense, child: str | None, **fields) -> ParamState:
    return ParamState(d.shape, d.dtype, {k: EagerSource(v.contiguous()) for k, v in fields.items()}, child)


def _build_hybrid(groups: list[dict], dense: dict[str, Dense], options: dict, backup: str,
                  muon_params: list[str] | None) -> CanonicalState:
    """Hidden 2-D matrices to GefenMuon, the rest to the backup, routed by name and shape as
    ``split_params_for_muon`` routes named parameters; each source group splits in two."""
    from gefen.hybrid import hybrid_contract, split_params_for_muon

    fqns = [fqn for g in groups for fqn in g["params"]]
    if muon_params is not None:
        muon_names = set(muon_params)
        if muon_names - set(fqns):
            raise CheckpointMismatchError(f"muon_params names {sorted(muon_names - set(fqns))[0]!r}, which the "
                                          "state does not have")
    elif any(fqn not in dense for fqn in fqns):
        raise CheckpointMismatchError(f"{next(f for f in fqns if f not in dense)!r} has no state, so its shape (and "
                                      "its child in GefenMuonHybrid) is unknown: pass muon_params")
    else:
        muon_names = {name for name, _ in split_params_for_muon(
            [(fqn, torch.empty(dense[fqn].shape, device="meta")) for fqn in fqns])[0]}
    halves = {}
    for child, target, pick in (("muon", MUON, True), ("backup", GEFEN if backup == "gefen" else ADAMW, False)):
        part = [{**g, "params": [f for f in g["params"] if (f in muon_names) == pick]} for g in groups]
        halves[child] = _build_leaf(target, [g for g in part if g["params"]], dense, options, child)
    contract = hybrid_contract({name: half.contract for name, half in halves.items()})
    return CanonicalState(contract, [g for h in halves.values() for g in h.param_groups],
                          {k: v for h in halves.values() for k, v in h.params.items()},
                          {k: v for h in halves.values() for k, v in h.global_fields.items()})


# ----- report -------------------------------------------------------------------------------
def _report(source: str, target: str, before: dict[str, Dense], out: CanonicalState) -> dict:
    """What the target will use against what the source held (plain data: it goes into manifests)."""
    first, second = [], []
    for fqn, entry in out.params.items():  # one parameter's dense view at a time
        leaf = out.contract.leaf(entry.child)
        after = _dense_param(leaf.implementation, fqn, entry, out.globals_of(entry.child))
        first.append((fqn, _squares(after.exp_avg, before[fqn].exp_avg)))
        if after.exp_avg_sq is not None and before[fqn].exp_avg_sq is not None:
            second.append((fqn, _squares(after.exp_avg_sq, before[fqn].exp_avg_sq)))
    return {
        "from": source,
        "into": target,
        "parameters": len(out.params),
        "restarted": sorted(set(before) - set(out.params)),
        "first_moment": _rel_errors(first),
        "second_moment": _rel_errors(second),
    }


def _squares(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    return float((got - want).double().square().sum()), float(want.double().square().sum())


def _rel_errors(squares: list[tuple[str, tuple[float, float]]]) -> dict | None:
    """Relative Frobenius error over all parameters, and the worst parameter's."""
    if not squares:
        return None

    def rel(e: float, n: float) -> float:
        return math.sqrt(e / n) if n else (0.0 if e == 0 else math.inf)

    worst_fqn, worst = max(((fqn, rel(*sq)) for fqn, sq in squares), key=lambda x: x[1])
    return {"rel_error": rel(sum(e for _, (e, _) in squares), sum(n for _, (_, n) in squares)),
            "worst": {"fqn": worst_fqn, "rel_error": worst}}
