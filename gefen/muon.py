"""``GefenMuon``: Muon whose momentum is stored like Gefen's first moment (docs/design.md 3.2),
so it shards and reshards exactly like Gefen's state. A step is rank-local except Newton-Schulz,
which needs whole matrices (``gefen.distributed.row_gather``), and, where tensor parallelism splits
columns, each row's momentum scale (a max over the tensor-parallel dimension).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from gefen.base import CompressedOptimizer, local_tensor
from gefen.contract import FieldSpec, OptimizerContract
from gefen.dispatch import momenta_, momentum_scales, round_param_, sr_target, update_momentum_
from gefen.distributed import row_gather
from gefen.functional import decay_and_add_, init_momentum_state
from gefen.newton_schulz import NORM_EPS, STANDARD, orthogonalise, resolve_schedule
from gefen.state_layouts import CODEBOOK_FIELD, MOMENTUM_FIELDS
from gefen.stochastic import param_salt
from gefen.validation import check_flags_and_seed, check_range, param_label

__all__ = ["GefenMuon", "lr_scale"]

#: flipped into the parameter-rounding salt, so a GefenMuonHybrid's two children never share noise
MUON_SALT = 0x40000000
#: ``adjust_lr_fn`` values, as ``torch.optim.Muon`` (None: "original")
ADJUST_LR = (None, "original", "match_rms_adamw")
#: GefenMuon's state contract: the same for every parameter, so the offline tools can read it without an instance
CONTRACT = OptimizerContract(
    implementation="gefen.GefenMuon",
    version="1",
    hyperparameters=("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                     "adjust_lr_fn", "normuon", "beta2", "normuon_eps"),
    fields=(*MOMENTUM_FIELDS, FieldSpec("v_row", "float32", "row", optional=True)),  # v_row: NorMuon only
    global_fields=(CODEBOOK_FIELD,),
)


def lr_scale(shape: tuple[int, int], adjust_lr_fn: str | None) -> float:
    """Multiplier on the learning rate for a ``rows x cols`` matrix (global shape): ``original``
    (Keller Jordan) or ``match_rms_adamw`` (Moonlight: AdamW's update RMS, so AdamW's LR carries over)."""
    rows, cols = shape
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def normuon_(o: torch.Tensor, state: dict, beta2: float, eps: float) -> torch.Tensor:
    """Divide each row of ``o`` (fp32, in place) by the bias-corrected RMS of its EMA (NorMuon); the
    float64 local sums ``[|O|^2, |O_normalised|^2]``, whose *global* ratio restores the Frobenius norm."""
    sq = o.square()
    before = sq.sum(dtype=torch.float64)
    state["v_row"].mul_(beta2).add_(sq.mean(1), alpha=1 - beta2)
    denom = state["v_row"].div(1 - beta2 ** int(state["step"])).sqrt_().add_(eps)
    o.div_(denom.unsqueeze(1))
    return torch.stack([before, o.square().sum(dtype=torch.float64)])


class GefenMuon(CompressedOptimizer):
    """Muon (momentum, then Newton-Schulz orthogonalisation) for 2-D parameters, with the momentum
    compressed to ~1 byte per parameter exactly like ``Gefen``'s first moment.

    The parameters before ``*`` are ``torch.optim.Muon``'s, in its order, with its defaults and
    meaning (``lr=1e-3``, ``weight_decay=0.1`` decoupled with the unscaled ``lr``, ``momentum=0.95``,
    Nesterov, ``ns_coefficients`` = Keller Jordan's ``(a, b, c)`` for ``ns_steps=5`` steps, ``eps``
    the floor of the norm Newton-Schulz divides by, ``adjust_lr_fn`` None/``"original"``:
    ``sqrt(max(1, rows/cols))`` or ``"match_rms_adamw"``: AdamW's update RMS, so an AdamW
    learning rate carries over, ``GefenMuonHybrid``'s default). ``ns_coefficients`` also takes a
    schedule name, ``"tuned3"`` / ``"tuned4"``, or a list of per-step ``(a, b, c)``, which fix their
    own step count. Keyword-only: ``normuon=True`` adds NorMuon's per-row normalisation
    (``beta2``, ``normuon_eps``); ``bf16_stochastic_round=True`` rounds bf16 parameters
    stochastically (as ``Gefen``; noise salted by ``seed``). Embeddings, heads and 1-D tensors
    belong to a backup optimizer.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=STANDARD, eps: float = NORM_EPS, ns_steps: int = 5,
                 adjust_lr_fn: str | None = None, *, normuon: bool = False, beta2: float = 0.95,
                 normuon_eps: float = 1e-8, codebook_size: int = 256, bins_per_code: int = 16, seed: int = 0,
                 bf16_stochastic_round: bool = False):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        normuon=normuon, beta2=beta2, normuon_eps=normuon_eps, seed=seed,
                        bf16_stochastic_round=bf16_stochastic_round)
        self._check_group(defaults)
        super().__init__(params, defaults, codebook_size=codebook_size, bins_per_code=bins_per_code)

    torch_name = "Muon"

    def contract(self) -> OptimizerContract:
        return CONTRACT

    def _check_group(self, group: dict) -> None:
        check_range("lr", group["lr"], 0.0, torch_says="Learning rate should be >= 0 but is: {}")  # Muon's words
        check_range("momentum", group["momentum"], 0.0, 1.0, high_open=True,
                    torch_says="momentum should be >= 0 but is: {}")
        check_range("weight_decay", group["weight_decay"], 0.0, torch_says="weight decay should be >= 0 but is: {}")
        check_range("beta2", group["beta2"], 0.0, 1.0, high_open=True)
        check_range("eps", group["eps"], 0.0)
        check_range("normuon_eps", group["normuon_eps"], 0.0)
        check_flags_and_seed(group, ("nesterov", "normuon", "bf16_stochastic_round"))
        if group["adjust_lr_fn"] not in ADJUST_LR:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported "
                             f"(adjust_lr_fn must be one of {ADJUST_LR})")
        resolve_schedule(group["ns_coefficients"], group["ns_steps"])

    def _saved_group(self, group: dict) -> dict:
        """Options a saved group may lack (a state_dict rebuilt from a checkpoint, whose contract
        holds no ``seed`` or ``bf16_stochastic_round``) take this optimizer's."""
        return {k: self.defaults[k] for k in ("seed", "bf16_stochastic_round")} | group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if p.dim() != 2:
                self.param_groups.pop()
                raise ValueError(
                    f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()} "
                    f"(GefenMuon takes 2-D parameters only; parameter {param_label(group, i)} has shape "
                    f"{tuple(p.shape)}: give embeddings, heads and other tensors to a backup optimizer, "
                    "e.g. with GefenMuonHybrid)"
                )

    def _state_fields(self, group: dict, shape: tuple[int, ...]) -> tuple[str, ...]:
        return ("step", "period", "m_code", "m_scale") + (("v_row",) if group["normuon"] else ())

    def _init_param_state(self, group: dict, param: torch.Tensor, period: int) -> dict:
        local = local_tensor(param)
        state = init_momentum_state(local, tuple(param.shape), period)
        if group["normuon"]:
            state["v_row"] = torch.zeros(local.shape[0], dtype=torch.float32, device=local.device)
        return state

    #: every layout ``describe_placement`` accepts works: Newton-Schulz gathers whole matrices, and a
    #: column split's cut of a row's block is repaired by a max over the tensor-parallel dimension
    reduces_column_splits = True

    def _step(self, work) -> None:
        plan = self.reduction_plan()

        # 1. compressed momentum and the Newton-Schulz input (rank-local)
        codebook = self._step_codebook()
        items = [(self.state[p], local_tensor(grad), group["momentum"]) for group, p, grad in work]
        for state, _, _ in items:
            state["step"].add_(1)
        cut = [k for k, (_, p, _) in enumerate(work) if plan.splits_columns(p)]  # tensor parallelism's Shard(1)
        whole = [k for k in range(len(items)) if k not in cut]
        momenta = dict(zip(whole, momenta_([items[k] for k in whole], codebook)))
        momenta.update(zip(cut, self._cut_momenta_([items[k] for k in cut], codebook)))
        inputs = [momenta[k].mul_(mu).add_(g, alpha=1 - mu) if group["nesterov"] else momenta[k]  # fp32 += bf16: exact
                  for k, ((group, _, _), (_, g, mu)) in enumerate(zip(work, items))]

        # 2. orthogonalise: the one step that needs whole matrices (this rank gets its rows, whole)
        schedules = [(resolve_schedule(group["ns_coefficients"], group["ns_steps"]), group["eps"])
                     for group, _, _ in work]
        ortho = row_gather(plan, [p for _, p, _ in work], inputs, lambda full: orthogonalise_batched(full, schedules))

        # 3. NorMuon: whole rows normalised locally, Frobenius norms restored with one reduction
        normed = [i for i, (group, _, _) in enumerate(work) if group["normuon"]]
        if normed:
            partials = []
            for i in normed:
                group, p, _ = work[i]
                ortho[i] = ortho[i].float()
                sums = normuon_(ortho[i], self.state[p], group["beta2"], group["normuon_eps"])
                partials.append(sums if plan.counts_rows(p) else sums.zero_())  # the same rows elsewhere: one counts
            sums = plan.reducer.sum_(torch.stack(partials)).tolist()
            for i, (before, after) in zip(normed, sums):
                ortho[i].mul_(math.sqrt(before / after) if after > 0 else 0.0)

        # 4. decoupled weight decay with the plain lr, then the scaled orthogonal step (own columns);
        # bf16_stochastic_round: added in fp32, rounded by the hash of the global index
        position = self._positions()
        for k, ((group, p, _), o) in enumerate(zip(work, ortho)):
            param = local_tensor(p)
            row0, col0 = plan.offsets(p)
            if k in cut:
                o = o[:, col0:col0 + param.shape[1]]
            target = sr_target(param, group["bf16_stochastic_round"])
            decay_and_add_(target, o, group["lr"], group["weight_decay"],
                           alpha=-group["lr"] * lr_scale(tuple(p.shape), group["adjust_lr_fn"]))
            round_param_(param, target, step=int(self.state[p]["step"]), row0=row0, col0=col0, row_len=p.shape[1],
                         salt=param_salt(position[id(p)], group["seed"]) ^ MUON_SALT)

    def _cut_momenta_(self, items: list[tuple[dict, torch.Tensor, float]], codebook: torch.Tensor) -> list:
        """``update_momentum_`` of shards whose columns tensor parallelism splits: each row's max-abs
        scale is reduced over the ranks holding its other columns (one collective) before coding."""
        items = [(state, g.float(), mu) for state, g, mu in items]
        scales = self.reduction_plan().reduce_rows_([(momentum_scales(*item, codebook),) for item in items], ("max",))
        return [update_momentum_(*item, codebook, s) for item, (s,) in zip(items, scales)]


def orthogonalise_batched(matrices: list[torch.Tensor], schedules: list[tuple]) -> list[torch.Tensor]:
    """Newton-Schulz of every matrix (``schedules``: its ``(coefficients, eps)``); equal shapes and
    schedules run as one batched iteration."""
    batches = defaultdict(list)
    for i, (m, schedule) in enumerate(zip(matrices, schedules)):
        batches[(tuple(m.shape), m.device, schedule)].append(i)
    out: list[torch.Tensor] = [None] * len(matrices)
    for (_, _, (coefficients, eps)), idx in batches.items():
        result = orthogonalise(torch.stack([matrices[i] for i in idx]), list(coefficients), len(coefficients), eps)
        for i, o in zip(idx, result.unbind(0)):
            out[i] = o
    return out
