"""Host side of the Triton kernels: parameter tables, launch classes, per-step scalars.

A launch serves every parameter of one *class* (dtypes and tile shape), so a step costs a few
launches per phase whatever the number of tensors. The scalars a kernel multiplies by are
rounded to fp32 here exactly as torch rounds a Python float scalar.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from gefen.codebook import code_thresholds
from gefen.functional import _local_period, inverse_step_bound
from gefen.stochastic import hash_base
from gefen.triton import kernels  # refuses to load without Triton
from gefen.triton.kernels import triton

#: Rows longer than this are processed in two passes over column tiles (tests lower it). Sizes are
#: chosen from ptxas' register counts for sm_90 (docs/decisions.md), not yet timed on a GPU.
MAX_SINGLE = 2048
#: Elements per program when rows are short (several rows per program).
TILE = 2048
#: Column tile of the two-pass kernels.
TWO_PASS_BC = 1024

_TRITON_DT = {torch.float32: kernels.tl.float32, torch.bfloat16: kernels.tl.bfloat16}


def _geometry(P: int) -> tuple[int, int, bool]:
    """(rows per program, column tile, single pass) for rows of ``P`` elements."""
    if P <= MAX_SINGLE:
        bc = max(16, triton.next_power_of_2(P))
        return max(1, TILE // bc), bc, True
    return 1, min(TWO_PASS_BC, triton.next_power_of_2(MAX_SINGLE)), False


_program_tables: dict[tuple, torch.Tensor] = {}


def _programs(rows: list[int], br: int, device: torch.device) -> torch.Tensor:
    """int64 ``[n, 2]`` on ``device``: (parameter index, first row) of every program of a launch
    whose parameter ``i`` has ``rows[i]`` rows (or columns), ``br`` per program; cached (shapes
    only decide it) and vectorised (a large model has ~10^5 programs)."""
    key = (tuple(rows), br, str(device))
    table = _program_tables.get(key)
    if table is None:
        counts = torch.tensor([-(-n // br) for n in rows], dtype=torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(rows)), counts)
        first = torch.cumsum(counts, 0) - counts
        local = torch.arange(int(counts.sum())) - first[owner]
        table = torch.stack([owner, local * br], 1)
        (table,) = _to(device, table)
        if len(_program_tables) > 64:
            _program_tables.clear()
        _program_tables[key] = table
    return table


def _ptr_table(tensors: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.tensor([[t.data_ptr() for t in row] for row in tensors], dtype=torch.int64)


def _to(device: torch.device, *tables: torch.Tensor) -> list[torch.Tensor]:
    if device.type == "cpu":
        return list(tables)
    return [t.pin_memory().to(device, non_blocking=True) for t in tables]


def _classes(keys) -> dict:
    """The indices of ``keys`` grouped by launch class (``keys[i]``; None: nothing to launch)."""
    classes = defaultdict(list)
    for i, key in enumerate(keys):
        if key is not None:
            classes[key].append(i)
    return classes


def _class_tables(idx: list[int], rows: list[int], br: int, ptrs: list, *tables: torch.Tensor) -> list:
    """What a launch of the class ``idx`` (indices of the step's items) takes first: its program
    table (item i has ``rows[i]`` rows, ``br`` per program), its pointer table (``ptrs``: a row of
    tensors per member) and its members' rows of the step's per-item ``tables`` (on the device)."""
    device = tables[0].device
    ptr_t, sel = _to(device, _ptr_table(ptrs), torch.tensor(idx, dtype=torch.int64))
    return [_programs([rows[i] for i in idx], br, device), ptr_t, *(t.index_select(0, sel) for t in tables)]


def _launch(kernel, progs: torch.Tensor, *args, **meta) -> None:
    """One program per row of the table ``progs`` (``_programs``), which the kernel gets first."""
    if progs.shape[0] == 0:
        return
    tile = meta.get("BR", 1) * meta.get("BC", meta.get("BLOCK", 1))
    # ~4 elements per thread keeps the step kernel near 64 registers (ptxas, sm_90): several blocks
    # per SM to hide memory latency. No FMA contraction: every mul and add rounds on its own.
    kernel[(progs.shape[0],)](progs, *args, enable_fp_fusion=False, num_warps=max(4, min(16, tile // 128)), **meta)


# ----- GefenMuon's momentum ------------------------------------------------------------------
class _Codebook:
    """The codebook and its padded decision thresholds on the codebook's device (cached)."""

    def __init__(self, codebook: torch.Tensor):
        self.source, self.version, self.K = codebook, codebook._version, codebook.numel()
        self.log2k = max(1, math.ceil(math.log2(self.K)))
        thr = torch.full((1 << self.log2k,), float("inf"), dtype=torch.float32)
        thr[: self.K - 1] = code_thresholds(codebook.detach().cpu().float())
        self.values = codebook.detach().float().contiguous()
        self.thr = thr.to(codebook.device)


_books: dict[int, _Codebook] = {}


def codebook_tables(codebook: torch.Tensor) -> _Codebook:
    book = _books.get(id(codebook))
    if book is None or book.source is not codebook or book.version != codebook._version:
        if len(_books) > 8:
            _books.clear()
        book = _books[id(codebook)] = _Codebook(codebook)
    return book


def momentum_(items: list[tuple[dict, torch.Tensor, float]], codebook: torch.Tensor,
              scales: list[torch.Tensor | None] | None = None, *, scales_only: bool = False) -> list[torch.Tensor]:
    """``functional.update_momentum_`` of every ``(state, grad, beta)``, one launch per class.
    ``scales[i]``: item i's block scales given (``store_momentum_``'s); ``scales_only``: return
    each item's block scales instead, touching nothing."""
    book = codebook_tables(codebook)
    scales = scales or [None] * len(items)
    if scales_only:
        outs = [torch.empty(tuple(s["m_scale"].shape), dtype=torch.float32, device=g.device) for s, g, _ in items]
    else:
        outs = [torch.empty(g.shape, dtype=torch.float32, device=g.device) for _, g, _ in items]
    sizes, ptrs = [], []
    for i, (state, grad, _) in enumerate(items):
        P = _local_period(state)
        sizes.append((grad.numel() // P, P, 2 if scales_only else int(scales[i] is not None)))
        out = outs[i] if not scales_only else state["m_scale"]  # (not written: mode 2 masks it)
        aux = outs[i] if scales_only else (scales[i] if scales[i] is not None else state["m_scale"])
        ptrs.append([grad, state["m_code"], state["m_scale"], out, aux])
    size_t, w_t = _to(items[0][1].device, torch.tensor(sizes, dtype=torch.int64),
                      torch.tensor([1 - beta for _, _, beta in items], dtype=torch.float32))
    classes = _classes((g.dtype, _geometry(_local_period(s))) if g.numel() else None for s, g, _ in items)
    for (gdt, (br, bc, single)), idx in classes.items():
        tables = _class_tables(idx, [nb for nb, _, _ in sizes], br, [ptrs[i] for i in idx], size_t, w_t)
        _launch(kernels.momentum_kernel, *tables, book.values, book.thr, book.K, LOG2K=book.log2k, BR=br, BC=bc,
                SINGLE=single, GRAD_T=_TRITON_DT[gdt])
    return outs


# ----- Gefen (m4v4 and m8) --------------------------------------------------------------------
@dataclass
class Item:
    """One parameter's phase-2 inputs (rank-local tensors; ``v_row``/``partials``: a factored
    matrix's results of phase 1 after the global sum). ``salt_m``, ``row0`` and ``row_len`` place
    m4v4's hashed rounding noise; m8 rounds to nearest and has none."""

    param: torch.Tensor
    grad: torch.Tensor
    state: dict
    h: object  # gefen.functional.Hyper
    step: int  # the step being taken (t)
    salt_m: int = 0
    row0: int = 0  # global row of local row 0
    global_rows: int = 1
    row_len: int | None = None  # global row length (default: the local one)
    v_row: torch.Tensor | None = None
    partials: torch.Tensor | None = None
    col0: int = 0  # global column of local column 0 (a column split)
    row_max: torch.Tensor | None = None  # a column split's whole rows' max |m| (fp32), reduced over tp


def _row(n, *pairs) -> list:
    """A table row from ``(column constant, number)`` pairs (tuples: tl.constexpr hashes slowly)."""
    row = [0] * n.value
    for col, value in pairs:
        row[col.value] = value
    return row


def _scalars(it: Item) -> list[float]:
    h, t, k = it.h, it.step, kernels
    lr, wd = float(h.lr), float(h.weight_decay)
    return _row(  # torch.tensor(..., float32) rounds each as torch rounds a Python scalar
        k.N_SCALARS, (k.S_B1, h.beta1), (k.S_OMB1, 1 - h.beta1), (k.S_B2, h.beta2), (k.S_OMB2, 1 - h.beta2),
        (k.S_BIAS1, 1 - h.beta1**t), (k.S_BIAS2, math.sqrt(1 - h.beta2**t)), (k.S_EPS, h.eps),
        (k.S_NEG_LR, -lr), (k.S_DECAY, 1 - lr * wd), (k.S_INV_BOUND, inverse_step_bound(t, h.beta1, h.beta2)))


def _ints(it: Item, rows: int, C: int) -> list[int]:
    k = kernels
    return _row(
        k.N_INTS, (k.I_ROWS, rows), (k.I_C, C), (k.I_ROW0, it.row0), (k.I_BASE_M, hash_base(it.step, it.salt_m)),
        (k.I_BASE_V, hash_base(it.step, (it.salt_m + 1) & 0xFFFFFFFF)), (k.I_HAS_WD, int(bool(it.h.weight_decay))),
        (k.I_GROWS, max(it.global_rows, 1)), (k.I_ROW_LEN, C if it.row_len is None else it.row_len),
        (k.I_COL0, it.col0), (k.I_GIVEN, int(it.row_max is not None)))


def m4v4_update_(items: list[Item], codebook: torch.Tensor, ratios: torch.Tensor) -> None:
    """Phase 2 of Gefen m4v4 for every item, in place (state, parameter, step count)."""
    mats = [it for it in items if it.param.dim() >= 2]
    vecs = [it for it in items if it.param.dim() < 2 and it.param.numel()]
    if mats:
        _m4v4_matrices(mats, codebook, ratios)
    if vecs:
        _adamw_vectors(vecs)
    for it in items:
        it.state["step"].fill_(it.step)


def _m4v4_matrices(items: list[Item], codebook, ratios) -> None:
    device = items[0].param.device
    shapes = [(it.param.shape[0], math.prod(it.param.shape[1:])) for it in items]
    v_new = torch.empty(sum(C for _, C in shapes), dtype=torch.float32, device=device)
    v_new_views = list(v_new.split([C for _, C in shapes]))
    ints = torch.tensor([_ints(it, r, C) for it, (r, C) in zip(items, shapes)], dtype=torch.int64)
    scal = torch.tensor([_scalars(it) for it in items], dtype=torch.float32)
    ints, scal = _to(device, ints, scal)
    # prologue: the new column statistics (scratch) and row means, every parameter in one launch
    _prologue(items, v_new_views, ints, scal, m8=False)
    # the step, one launch per (dtypes, tile) class
    classes = _classes((it.param.dtype, it.grad.dtype, _geometry(C)) if it.param.numel() else None
                       for it, (_, C) in zip(items, shapes))
    empty = [i for i, it in enumerate(items) if not it.param.numel()]  # only the statistics move, as in the reference
    cb, R = codebook.contiguous(), ratios.contiguous()
    for (pdt, gdt, (br, bc, single)), idx in classes.items():
        ptrs = [[items[i].param, items[i].grad, items[i].state["mv_code"], items[i].state["m_row_scale"],
                 items[i].state["v_row"], items[i].v_row, items[i].state["v_col"], v_new_views[i],
                 items[i].v_row if items[i].row_max is None else items[i].row_max] for i in idx]
        _launch(kernels.m4v4_kernel, *_class_tables(idx, [r for r, _ in shapes], br, ptrs, ints, scal), cb, R,
                BR=br, BC=bc, SINGLE=single, PARAM_T=_TRITON_DT[pdt], GRAD_T=_TRITON_DT[gdt])
    dst = [it.state["v_col"] for it in items] + [items[i].state["v_row"] for i in empty]
    torch._foreach_copy_(dst, v_new_views + [items[i].v_row for i in empty])


def _adamw_vectors(items: list[Item]) -> None:
    block, sizes = 1024, [it.param.numel() for it in items]
    ints = torch.tensor([_ints(it, n, 1) for it, n in zip(items, sizes)], dtype=torch.int64)
    scal = torch.tensor([_scalars(it) for it in items], dtype=torch.float32)
    ints, scal = _to(items[0].param.device, ints, scal)
    for (pdt, gdt), idx in _classes((it.param.dtype, it.grad.dtype) for it in items).items():
        ptrs = [[items[i].param, items[i].grad, items[i].state["exp_avg"], items[i].state["exp_avg_sq"]] for i in idx]
        _launch(kernels.adamw_kernel, *_class_tables(idx, sizes, block, ptrs, ints, scal), BLOCK=block,
                PARAM_T=_TRITON_DT[pdt], GRAD_T=_TRITON_DT[gdt])


#: rows per program of the phase-1 kernel (its column partial sums cost 8 / BR bytes per element)
PARTIALS_BR = 32


def m4v4_partials(items: list[tuple[torch.Tensor, dict, float]],
                  rows: list[tuple[torch.Tensor, int] | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``functional.m4v4_partials`` of every ``(grad, state, beta2)``; ``rows[i]``: item i's
    ``(row_sum, row_len)`` given (a column split's whole rows)."""
    return _partials(items, m8=False, given=rows)


def m4v4_row_stats(items: list[tuple[torch.Tensor, dict, float]],
                   codebook: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each ``(grad, state, beta1)``'s per-row float64 sums of g^2 and max |m| of the new first
    moment (``row_stats_kernel``, one launch per gradient dtype); nothing else written."""
    device = items[0][0].device
    shapes = [(g.shape[0], math.prod(g.shape[1:])) for g, _, _ in items]
    outs = [(torch.empty(r, dtype=torch.float64, device=device), torch.empty(r, dtype=torch.float32, device=device))
            for r, _ in shapes]
    br, k = 4, kernels
    ints = torch.tensor([_row(k.N_INTS, (k.I_ROWS, r), (k.I_C, C)) for r, C in shapes], dtype=torch.int64)
    scal = torch.tensor([_row(k.N_SCALARS, (k.S_B1, b1), (k.S_OMB1, 1 - b1)) for _, _, b1 in items],
                        dtype=torch.float32)
    ints, scal = _to(device, ints, scal)
    for gdt, idx in _classes(g.dtype if g.numel() else None for g, _, _ in items).items():
        ptrs = [[items[i][0], items[i][1]["mv_code"], items[i][1]["m_row_scale"], *outs[i]] for i in idx]
        bc = max(16, min(triton.next_power_of_2(max(shapes[i][1] for i in idx)), 1024))
        _launch(kernels.row_stats_kernel, *_class_tables(idx, [r for r, _ in shapes], br, ptrs, ints, scal),
                codebook.contiguous(), BR=br, BC=bc, GRAD_T=_TRITON_DT[gdt])
    return outs


def _partials(items, *, m8: bool, given=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Phase 1 of either layout, two launches per gradient dtype: ``partials_kernel`` writes each row
    tile's share of the ``C + 2`` float64 partials to a scratch buffer that ``column_sum_kernel`` sums
    in a fixed order."""
    device = items[0][0].device
    shapes = [(g.shape[0], math.prod(g.shape[1:])) for g, _, _ in items]
    br = PARTIALS_BR
    tiles = [triton.cdiv(r, br) for r, _ in shapes]
    scratch = torch.empty(sum(t * (C + 2) for t, (_, C) in zip(tiles, shapes)), dtype=torch.float64, device=device)
    scratch_views = scratch.split([t * (C + 2) for t, (_, C) in zip(tiles, shapes)])
    parts = torch.empty(sum(C + 2 for _, C in shapes), dtype=torch.float64, device=device)
    part_views = list(parts.split([C + 2 for _, C in shapes]))
    v_rows = [torch.empty(r, dtype=torch.float32, device=device) for r, _ in shapes]
    given = given or [None] * len(items)
    k = kernels
    ints = torch.tensor([_row(k.N_INTS, (k.I_ROWS, r), (k.I_C, C), (k.I_GIVEN, int(rl is not None)),
                              (k.I_ROW_LEN, C if rl is None else rl[1])) for (r, C), rl in zip(shapes, given)],
                        dtype=torch.int64)
    betas = torch.tensor([(b2, 1 - b2) for _, _, b2 in items], dtype=torch.float32)
    ints, betas = _to(device, ints, betas)
    for gdt, idx in _classes(g.dtype for g, _, _ in items).items():
        ptrs = [[items[i][0], items[i][1]["v_row"], v_rows[i], scratch_views[i],
                 scratch_views[i] if given[i] is None else given[i][0]] for i in idx]
        bc = max(16, min(triton.next_power_of_2(max(shapes[i][1] for i in idx)), 4096 // br))
        _launch(kernels.partials_kernel, *_class_tables(idx, [r for r, _ in shapes], br, ptrs, ints, betas), BR=br,
                BC=bc, GRAD_T=_TRITON_DT[gdt], M8=m8)
    bc = 256
    progs = _programs([C + 2 for _, C in shapes], bc, device)
    (ptrs,) = _to(device, _ptr_table([[s, p] for s, p in zip(scratch_views, part_views)]))
    _launch(kernels.column_sum_kernel, progs, ptrs, ints, BC=bc, BR=br)
    return list(zip(v_rows, part_views))


# ----- Gefen m8 ------------------------------------------------------------------------------
def _m8_ints(it: Item) -> list[int]:
    k, P = kernels, int(it.state["period"])
    C = math.prod(it.param.shape[1:]) if it.param.dim() else 1
    return _row(k.N_INTS, (k.I_ROWS, it.param.numel() // P), (k.I_P, P), (k.I_BPR, max(C // P, 1)), (k.I_C, C),
                (k.I_HAS_WD, int(bool(it.h.weight_decay))), (k.I_GROWS, it.global_rows))


def _prologue(factored: list[Item], v_new: list[torch.Tensor], ints, scal, *, m8: bool) -> None:
    """``prologue_kernel`` for the factored matrices, the first rows of the ``ints``/``scal``
    tables: their new ``v_col`` (into ``v_new``, which m8 passes as ``v_col`` itself) and row means."""
    bc = 1024
    progs = _programs([v.numel() for v in v_new], bc, ints.device)
    (ptrs,) = _to(ints.device, _ptr_table([[it.state["v_col"], v, it.partials] for it, v in zip(factored, v_new)]))
    _launch(kernels.prologue_kernel, progs, ptrs, ints, scal, BC=bc, M8=m8)


def m8_update_(items: list[Item], codebook: torch.Tensor) -> None:
    """Phase 2 of Gefen m8 for every item, in place (state, parameter, step count): the factored
    matrices' column statistics in one launch, then the step in one launch per class."""
    items = sorted(items, key=lambda it: "v_row" not in it.state)  # factored first: the prologue's rows
    factored = [it for it in items if "v_row" in it.state]
    device = items[0].param.device
    book = codebook_tables(codebook)
    ints = torch.tensor([_m8_ints(it) for it in items], dtype=torch.int64)
    scal = torch.tensor([_scalars(it) for it in items], dtype=torch.float32)
    ints, scal = _to(device, ints, scal)
    if factored:
        _prologue(factored, [it.state["v_col"] for it in factored], ints, scal, m8=True)
    classes = _classes((it.param.dtype, it.grad.dtype, _geometry(int(it.state["period"])), "v_row" in it.state)
                       if it.param.numel() else None for it in items)
    blocks = [it.param.numel() // int(it.state["period"]) for it in items]
    for (pdt, gdt, (br, bc, single), fact), idx in classes.items():
        ptrs = []
        for i in idx:
            it, st = items[i], items[i].state
            v = [it.v_row, st["v_col"]] if fact else [st["v"], st["v"]]
            ptrs.append([it.param, it.grad, st["m_code"], st["m_scale"], *v])
        _launch(kernels.m8_kernel, *_class_tables(idx, blocks, br, ptrs, ints, scal), book.values, book.thr, book.K,
                LOG2K=book.log2k, BR=br, BC=bc, SINGLE=single, FACTORED=fact, PARAM_T=_TRITON_DT[pdt],
                GRAD_T=_TRITON_DT[gdt])
    if factored:
        torch._foreach_copy_([it.state["v_row"] for it in factored], [it.v_row for it in factored])
    for it in items:
        it.state["step"].fill_(it.step)


def m8_partials(items: list[tuple[torch.Tensor, dict, float]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``functional.m8_partials`` of every factored ``(grad, state, beta2)``."""
    return [(v_row, parts[:-1]) for v_row, parts in _partials(items, m8=True)]


# ----- bf16_stochastic_round's write-back ------------------------------------------------------
ROUND_BLOCK = 1024


def round_params_(items: list[tuple]) -> None:
    """``functional.round_param_`` of every ``(param, work, step, salt, row0, col0, row_len)`` in one launch."""
    from gefen.functional import param_rows

    device = items[0][0].device
    ints = []
    for param, _, step, salt, row0, col0, row_len in items:
        rows, cols, r0, length, c0 = param_rows(param, row0=row0, col0=col0, row_len=row_len)
        ints.append([param.numel(), max(cols, 1), r0, length, c0, hash_base(step, salt)])
    progs = _programs([it[0].numel() for it in items], ROUND_BLOCK, device)
    ptrs, ints = _to(device, _ptr_table([[it[0], it[1]] for it in items]), torch.tensor(ints, dtype=torch.int64))
    _launch(kernels.round_bf16_kernel, progs, ptrs, ints, BLOCK=ROUND_BLOCK)


# ----- the first step: the codebook histogram -------------------------------------------------
def block_histogram(blocks: torch.Tensor, num_bins: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``codebook.histogram_normalised_blocks`` of ``blocks`` ``[..., P]`` (``scale``: one fp32 per
    block given), int64 ``[num_bins]`` on the blocks' device, in one launch."""
    P = blocks.shape[-1]
    flat = blocks.reshape(-1, P)
    counts = torch.zeros(num_bins, dtype=torch.int64, device=blocks.device)
    bc = max(16, min(triton.next_power_of_2(P), 1024))
    br = max(1, 2048 // bc)
    progs = _programs([flat.shape[0]], br, blocks.device)
    given = scale is not None
    scale = scale.reshape(-1).float().contiguous() if given else counts.new_empty(0, dtype=torch.float32)
    _launch(kernels.histogram_kernel, progs, flat, scale, counts, flat.shape[0], P, num_bins, GIVEN=given,
            NB=triton.next_power_of_2(num_bins), BR=br, BC=bc)
    return counts
