"""``Gefen``: a drop-in for ``torch.optim.AdamW`` with ~1 byte of state per parameter (SPEC 3.1)."""

from __future__ import annotations

import torch

from gefen.base import CompressedOptimizer, global_shape, local_tensor
from gefen.compile import eager_step
from gefen.contract import FieldSpec, OptimizerContract
from gefen.functional import Hyper, gefen_update_, init_state, is_factored, second_moment_partials
from gefen.validation import check_adamw_options, check_betas, check_range

__all__ = ["Gefen"]

_FIELDS = (
    FieldSpec("step", "int64", "scalar"),
    FieldSpec("period", "int64", "scalar"),
    FieldSpec("m_code", "uint8", "param"),
    FieldSpec("m_scale", "float32", "block"),
    FieldSpec("v", "float32", "block", optional=True),
    FieldSpec("v_row", "float32", "row", optional=True),
    FieldSpec("v_col", "float32", "col", optional=True),
)
_CONTRACT = OptimizerContract(
    implementation="gefen.Gefen",
    version="1",
    hyperparameters=("lr", "betas", "eps", "weight_decay", "factored_v_2d"),
    fields=_FIELDS,
    global_fields=(FieldSpec("codebook", "float32", "global"),),
)


class Gefen(CompressedOptimizer):
    """AdamW with a block-quantised first moment and a factored/per-block second moment.

    ``params`` may be tensors, ``(name, tensor)`` pairs (preferred: names become the state's
    identity in checkpoints) or param-group dicts (optionally with ``"param_names"``).
    ``codebook_size`` codes (uint8) are learned once from the first gradients, with a histogram
    of ``bins_per_code * codebook_size`` bins.

    AdamW's keywords: ``lr`` and ``betas`` may be tensors; ``maximize`` ascends the objective;
    ``foreach`` / ``fused`` are accepted as hints (one implementation serves all); ``amsgrad``,
    ``capturable`` and ``differentiable`` are refused with the reason. ``step()`` is never traced
    by ``torch.compile``: a compiled training step graph-breaks around it (``gefen.compile``).
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, factored_v_2d: bool = True, codebook_size: int = 256,
                 bins_per_code: int = 16, *, maximize: bool = False, foreach: bool | None = None,
                 fused: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 amsgrad: bool = False):
        check_adamw_options(foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable,
                            amsgrad=amsgrad)
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
                        weight_decay=weight_decay, factored_v_2d=factored_v_2d, maximize=maximize)
        self._check_group(defaults)
        super().__init__(params, defaults, codebook_size=codebook_size, bins_per_code=bins_per_code)

    def contract(self) -> OptimizerContract:
        return _CONTRACT

    def _check_group(self, group: dict) -> None:
        check_range("lr", group["lr"], 0.0)
        check_betas(group["betas"])
        check_range("eps", group["eps"], 0.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        for flag in ("factored_v_2d", "maximize"):
            if not isinstance(group.get(flag, False), bool):
                raise TypeError(f"{flag} must be a bool, got {group[flag]!r}")

    def _state_fields(self, group: dict, shape: tuple[int, ...]) -> tuple[str, ...]:
        second = ("v_row", "v_col") if is_factored(shape, group["factored_v_2d"]) else ("v",)
        return ("step", "period", "m_code", "m_scale") + second

    def _init_param_state(self, group: dict, param: torch.Tensor, period: int) -> dict:
        shape = global_shape(param)
        return init_state(local_tensor(param), shape, period, is_factored(shape, group["factored_v_2d"]))

    @eager_step
    @torch.no_grad()
    def step(self, closure=None):
        loss, work = self._begin_step(closure)
        if not work:
            return loss

        # phase 1: what the factored second moments must sum over all rows (one reduction)
        plan = self.reduction_plan()
        factored = []
        for i, (group, p, grad) in enumerate(work):
            if "v_row" in self.state[p]:
                v_row, parts = second_moment_partials(local_tensor(grad), self.state[p], group["betas"][1])
                factored.append((i, v_row, plan.spread_partials(p, parts, parts.numel() - 1)))
        pending = {}
        if factored:
            flat = torch.cat([parts for _, _, parts in factored])
            plan.reducer.sum_(flat)
            sums = flat.split([parts.numel() for _, _, parts in factored])
            pending = {i: (v_row, total) for (i, v_row, _), total in zip(factored, sums)}

        # phase 2: the rank-local update
        codebook = self._step_codebook()
        for i, (group, p, grad) in enumerate(work):
            beta1, beta2 = group["betas"]
            h = Hyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            v_row, partials = pending.get(i, (None, None))
            shape = global_shape(p)
            gefen_update_(local_tensor(p), local_tensor(grad), self.state[p], codebook, h,
                          global_rows=shape[0] if shape else 1, v_row=v_row, partials=partials)
        return loss
