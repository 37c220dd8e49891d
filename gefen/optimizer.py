"""``Gefen``: a drop-in for ``torch.optim.AdamW`` with ~1 byte of state per parameter (docs/design.md 3.1)."""

from __future__ import annotations

import torch

from gefen import dispatch
from gefen.base import CompressedOptimizer, local_tensor
from gefen.contract import OptimizerContract
from gefen.functional import (
    M4V4_MATRIX_FIELDS,
    VECTOR_FIELDS,
    Hyper,
    init_m4v4_state,
    init_m8_state,
    is_coded,
    is_factored,
)
from gefen.geometry import rows_and_row_numel
from gefen.state_layouts import CONTRACTS, MOMENTS, V_CODEBOOK, version_refusal
from gefen.stochastic import CODES, param_salt, ratio_table, standin_codebook, v_grid
from gefen.validation import check_adamw_options, check_betas, check_flags_and_seed, check_range

__all__ = ["Gefen", "MOMENTS", "version_refusal"]

class Gefen(CompressedOptimizer):
    """AdamW with its moments compressed to about one byte per parameter.

    ``moments="m4v4"`` (the default, contract version "2"): every tensor of two or more
    dimensions keeps one byte per element, a 4-bit first-moment code (per-row bf16 max-abs scale,
    16-entry learned codebook) and a 4-bit code of ``v / vhat`` against the factored second
    moment ``vhat`` (row and column EMAs), both re-quantised by unbiased stochastic rounding
    whose noise is a hash of the element's global index, the step and ``seed``; 1-D tensors keep
    AdamW's moments (the first in bf16, rounded by the same hashed noise). ``moments="m8"`` (version "1"): 8-bit first-moment
    codes into a ``codebook_size`` codebook and a factored (``factored_v_2d``) or per-block
    second moment; it loads version "1" checkpoints.

    ``params`` may be tensors, ``(name, tensor)`` pairs (preferred: names become the state's
    identity in checkpoints) or param-group dicts (optionally with ``"param_names"``).
    Codebooks are learned once from the first non-zero gradients, with a histogram of
    ``bins_per_code * codebook_size`` bins.

    The signature is ``torch.optim.AdamW``'s, positionally and in its defaults (``weight_decay=1e-2``,
    ``amsgrad`` sixth), so swapping the class name keeps every argument's meaning; Gefen's own
    options are keyword-only after AdamW's. ``lr`` and ``betas`` may be tensors; ``maximize``
    ascends the objective; ``foreach`` / ``fused`` are accepted as hints (one implementation
    serves all); ``amsgrad``, ``capturable`` and ``differentiable`` are refused with the reason.
    ``bf16_stochastic_round=True`` (bf16 parameters): the update is added in fp32 and rounded to
    bf16 stochastically, unbiased, by the counter hash of (global element index, step, ``seed``),
    so small updates accumulate in expectation instead of vanishing and the trajectory stays
    independent of the world size (no fp32 master copy). ``step()`` is never traced by
    ``torch.compile``: a compiled training step graph-breaks around it (``gefen.compile``).
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, factored_v_2d: bool = True, codebook_size: int | None = None,
                 bins_per_code: int = 16, moments: str = "m4v4", seed: int = 0, bf16_stochastic_round: bool = False):
        check_adamw_options(foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable,
                            amsgrad=amsgrad)
        if moments not in CONTRACTS:
            raise ValueError(f"moments must be one of {list(MOMENTS)}, got {moments!r}")
        if codebook_size is None:
            codebook_size = CODES if moments == "m4v4" else 256
        if moments == "m4v4" and codebook_size != CODES:
            raise ValueError(f"moments='m4v4' packs two 4-bit codes in a byte: codebook_size must be {CODES}, got "
                             f"{codebook_size!r} (other sizes need moments='m8')")
        self.moments = moments
        self.v_codebook: torch.Tensor | None = None
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
                        weight_decay=weight_decay, factored_v_2d=factored_v_2d, maximize=maximize, moments=moments,
                        seed=seed, bf16_stochastic_round=bf16_stochastic_round)
        self._check_group(defaults)
        super().__init__(params, defaults, codebook_size=codebook_size, bins_per_code=bins_per_code)

    def contract(self) -> OptimizerContract:
        return CONTRACTS[self.moments]

    @property
    def learns_at_allocation(self) -> bool:
        return self.moments == "m8"  # m4v4 learns both codebooks in its step, from the reduced statistics

    def global_books(self) -> dict[str, int]:
        books = super().global_books()
        if self.moments == "m4v4":
            books[V_CODEBOOK] = CODES
        return books

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["moments"] = self.moments
        state.setdefault(V_CODEBOOK, None)
        return state

    def _check_group(self, group: dict) -> None:
        check_range("lr", group["lr"], 0.0, torch_says="Invalid learning rate: {}")  # AdamW's words
        check_betas(group["betas"])
        check_range("eps", group["eps"], 0.0, torch_says="Invalid epsilon value: {}")
        check_range("weight_decay", group["weight_decay"], 0.0, torch_says="Invalid weight_decay value: {}")
        check_flags_and_seed(group, ("factored_v_2d", "maximize", "bf16_stochastic_round"))
        if group.get("moments", self.moments) != self.moments:
            raise ValueError(f"moments is optimizer-wide: a param group asks for {group['moments']!r}, the optimizer "
                             f"keeps {self.moments!r}")
        if self.moments == "m4v4" and group.get("factored_v_2d") is False:
            raise ValueError("m4v4 codes the second moment against the factored estimate; factored_v_2d=False "
                             "needs moments='m8'")

    def _saved_group(self, group: dict) -> dict:
        """Version "1" groups carry no ``moments``: they are m8 state (refused unless this is m8)."""
        saved = group.get("moments", "m8")
        refusal = version_refusal(CONTRACTS[saved].version, self.contract().version) if saved in CONTRACTS else None
        if refusal:
            raise ValueError(refusal)
        group = {"bf16_stochastic_round": self.defaults["bf16_stochastic_round"], **group}  # unsaved: the live choice
        return {"moments": "m8", "seed": 0, **group} if saved == "m8" else group

    def _state_fields(self, group: dict, shape: tuple[int, ...]) -> tuple[str, ...]:
        if self.moments == "m4v4":
            return M4V4_MATRIX_FIELDS if is_coded(shape) else VECTOR_FIELDS
        second = ("v_row", "v_col") if is_factored(shape, group["factored_v_2d"]) else ("v",)
        return ("step", "period", "m_code", "m_scale") + second

    def _init_param_state(self, group: dict, param: torch.Tensor, period: int) -> dict:
        shape = tuple(param.shape)
        if self.moments == "m4v4":
            return init_m4v4_state(local_tensor(param), shape)
        return init_m8_state(local_tensor(param), shape, period, is_factored(shape, group["factored_v_2d"]))

    def _moments_nonzero(self, entry: dict) -> bool:
        if self.moments == "m8":
            return super()._moments_nonzero(entry)
        return "mv_code" in entry and bool(entry["m_row_scale"].any() or entry["v_row"].any())

    def _step(self, work) -> None:
        if self.moments == "m4v4":
            self._step_m4v4(work)
        else:
            self._step_m8(work)

    @property
    def reduces_column_splits(self) -> bool:
        return self.moments == "m4v4"  # m8 has no tensor-parallel reduction of its row statistics

    def _reduced_partials(self, work, fields: str, partials_fn,
                          batched_fn=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Phase 1: every factored tensor's (new v_row, globally summed partials), by position in
        ``work``, after ONE reduction of all of them together. ``partials_fn(param, local grad,
        state, beta2)``; ``batched_fn([(local grad, state, beta2)])`` computes them all at once
        where a kernel applies (else None)."""
        plan = self.reduction_plan()
        factored = []
        todo = [(i, p, local_tensor(grad), group["betas"][1])
                for i, (group, p, grad) in enumerate(work) if fields in self.state[p]]
        # CUDA: every matrix's partials in two Triton launches per dtype (gefen/triton), else one call each
        fused = batched_fn([(g, self.state[p], b2) for _, p, g, b2 in todo]) if batched_fn and todo else None
        for k, (i, p, g, b2) in enumerate(todo):
            v_row, parts = fused[k] if fused else partials_fn(p, g, self.state[p], b2)
            factored.append((i, p, v_row, plan.spread_partials(p, parts, _row_len(p))))
        if not factored:
            return {}
        flat = torch.cat([parts for *_, parts in factored])
        plan.reducer.sum_(flat)
        sums = flat.split([parts.numel() for *_, parts in factored])
        return {i: (v_row, plan.take_partials(p, total, _row_len(p))) for (i, p, v_row, _), total in zip(factored, sums)}

    def _step_m8(self, work) -> None:
        pending = self._reduced_partials(work, "v_row", lambda p, *args: dispatch.m8_partials(*args),
                                         batched_fn=dispatch.m8_partials_)
        codebook = self._step_codebook()
        for i, _, p, target, grad, h, _, _ in self._updates(work):
            v_row, partials = pending.get(i, (None, None))
            dispatch.m8_update_(target, grad, self.state[p], codebook, h, global_rows=p.shape[0] if p.dim() else 1,
                                v_row=v_row, partials=partials)

    def _step_m4v4(self, work) -> None:
        plan = self.reduction_plan()
        # tensor parallelism: a coded tensor whose columns are split needs its whole rows' sums of g^2
        # (phase 1) and max |m| (phase 2); one pass over each shard gives both, then ONE collective
        # over tp serves every split tensor. The new m does not depend on a codebook learned at this
        # step: until one is learned every row scale is 0, and |codebook[code] * 0 * b1 + g (1 - b1)|
        # is the same under any finite codebook.
        split = [(g, p, grad) for g, p, grad in work if "mv_code" in self.state[p] and plan.splits_columns(p)]
        book = self._step_codebook()
        stats = plan.reduce_rows_([dispatch.m4v4_row_stats(local_tensor(grad), self.state[p], book.to(grad.device),
                                                           group["betas"][0]) for group, p, grad in split], ("sum", "max"))
        row_sums = {id(p): s for (_, p, _), (s, _) in zip(split, stats)}
        row_max = {id(p): m for (_, p, _), (_, m) in zip(split, stats)}
        pending = self._reduced_partials(
            work, "mv_code", lambda p, g, state, beta2: dispatch.m4v4_partials(
                g, state, beta2, row_sum=row_sums.get(id(p)), row_len=_row_len(p)),
            batched_fn=None if split else dispatch.m4v4_partials_)
        # both codebooks at the first step whose gradients are not all zero: the second moment's is
        # the fixed v_grid (no histogram of the first step's g^2 / vhat, far wider than the EMA's ratio)
        if self.codebook is None and (learned := self._learn_codebook(work)) is not None:
            self.v_codebook, self.codebook = v_grid(learned.device), learned
        codebook = self._step_codebook()
        ratios = {}  # device -> ratio table
        for i, group, p, target, grad, h, pidx, (row0, col0) in self._updates(work):
            seed = group["seed"]
            if i not in pending:
                dispatch.adamw_update_(target, grad, self.state[p], h, pidx=pidx, seed=seed, row0=row0)
                continue
            if target.device not in ratios:
                v_book = standin_codebook(target.device) if self.v_codebook is None else self.v_codebook.to(target.device)
                ratios[target.device] = ratio_table(v_book)
            v_row, partials = pending[i]
            dispatch.m4v4_update_(target, grad, self.state[p], codebook.to(target.device), ratios[target.device], h,
                                  global_rows=p.shape[0], v_row=v_row, partials=partials, pidx=pidx, seed=seed,
                                  row0=row0, col0=col0, row_len=_row_len(p), row_max=row_max.get(id(p)))

    def _updates(self, work):
        """Each parameter of ``work`` as ``(index, group, param, what its update writes
        (dispatch.sr_target), local grad, Hyper, position, (row0, col0))``; once its update is done,
        the bf16_stochastic_round write-back (a queued Triton update writes the step count at its
        launch: read it first)."""
        plan, position = self.reduction_plan(), self._positions()
        for i, (group, p, grad) in enumerate(work):
            local, offsets = local_tensor(p), plan.offsets(p)
            target = dispatch.sr_target(local, group["bf16_stochastic_round"])
            step = int(self.state[p]["step"]) + 1
            h = Hyper(group["lr"], *group["betas"], group["eps"], group["weight_decay"])
            yield i, group, p, target, local_tensor(grad), h, position[id(p)], offsets
            dispatch.round_param_(local, target, step=step, salt=param_salt(position[id(p)], group["seed"]),
                                  row0=offsets[0], col0=offsets[1], row_len=_row_len(p))


def _row_len(p: torch.Tensor) -> int:
    """The global row length of ``p`` (elements per row of the whole parameter)."""
    return rows_and_row_numel(tuple(p.shape))[1]
