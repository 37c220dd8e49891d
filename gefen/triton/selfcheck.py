"""The Triton kernels' parity problems, which ``gefen.triton.dispatch.verify`` runs once per device
and family under the rules of ``gefen.parity``: both row paths (one tile, two passes), bf16 and
fp32, an all-zero row, the 1-D path, m8's two second-moment forms. Reference and kernels step in
lockstep (phase 2 given the reference's phase 1, parameters re-synchronised each step).
"""

from __future__ import annotations

import copy

import torch

from gefen import functional as F
from gefen.parity import M8_APPROX, M8_V_RTOL, params_close, state_differences
from gefen.stochastic import ratio_table, salts

_H = F.Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


def run(launch, device: torch.device, family: str) -> str | None:
    """None when the ``family`` kernels (``"m4v4"``, ``"m8"``, ``"momentum"``, ``"round"`` or
    ``"histogram"``) reproduce the reference on ``device``, else what differs."""
    gen = torch.Generator().manual_seed(0)
    return {"momentum": _momentum, "m8": _m8, "round": _round, "histogram": _histogram}.get(family, _m4v4)(
        launch, device, gen)


def _grad(gen, shape, dtype, device):
    rows = torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen) if shape else torch.rand((), generator=gen)
    g = torch.randn(shape, generator=gen) * (rows + 0.1)
    if len(shape) >= 2:
        g[1] = 0  # an all-zero row: zero scale
    return g.to(device=device, dtype=dtype)


def _book(gen, n: int, device) -> torch.Tensor:
    book = torch.sort(torch.rand(n, generator=gen) * 2 - 1).values
    book[0], book[-1] = -1.0, 1.0
    return book.to(device)


def _m4v4(launch, device, gen) -> str | None:
    cb, R = _book(gen, 16, device), ratio_table(_book(gen, 16, device))
    shapes = [((33, 17), torch.float32), ((3, launch.MAX_SINGLE + 70), torch.bfloat16), ((9,), torch.float32)]
    ref, got = [], []
    for shape, dtype in shapes:
        p = (torch.randn(shape, generator=gen) * 0.1).to(device=device, dtype=dtype)
        state = F.init_m4v4_state(p, shape)
        ref.append((p, state))
        got.append((p.clone(), copy.deepcopy(state)))
    for step in (1, 2):
        grads = [_grad(gen, shape, dtype, device) for shape, dtype in shapes]
        mats = [i for i, (shape, _) in enumerate(shapes) if len(shape) >= 2]
        phase1 = launch.m4v4_partials([(grads[i], got[i][1], _H.beta2) for i in mats])
        items, before = [], [p.clone() for p, _ in ref]
        for k, i in enumerate(mats):
            v_row, parts = F.m4v4_partials(grads[i], ref[i][1], _H.beta2)
            if not torch.equal(phase1[k][0], v_row) or not torch.allclose(phase1[k][1], parts, rtol=1e-12, atol=0):
                return f"phase 1 (row/column sums) differs from the eager step at step {step}"
            rows = shapes[i][0][0]
            F.m4v4_update_(ref[i][0], grads[i], ref[i][1], cb, R, _H, global_rows=rows, v_row=v_row,
                           partials=parts, pidx=i, seed=0)
            items.append(launch.Item(got[i][0], grads[i], got[i][1], _H, step, salts(i, 0)[0],
                                         global_rows=rows, v_row=v_row.clone(), partials=parts))
        for i, (shape, _) in enumerate(shapes):
            if len(shape) < 2:
                F.adamw_update_(ref[i][0], grads[i], ref[i][1], _H, pidx=i, seed=0, row0=3)
                items.append(launch.Item(got[i][0], grads[i], got[i][1], _H, step, salts(i, 0)[0], row0=3))
        launch.m4v4_update_(items, cb, R)
        for i, ((p_ref, s_ref), (p_got, s_got)) in enumerate(zip(ref, got)):
            if (why := state_differences(s_ref, s_got)) is not None:
                return f"{why} (shape {shapes[i][0]}, step {step})"
            if not params_close(before[i], p_ref, p_got):
                return f"parameters differ from the eager step beyond rounding (shape {shapes[i][0]}, step {step})"
            p_got.copy_(p_ref)
    return None


def _momentum(launch, device, gen) -> str | None:
    cb = _book(gen, 256, device)
    cases = [((33, 17), 17, torch.float32), ((6, 40), 8, torch.bfloat16), ((3, launch.MAX_SINGLE + 70), None,
                                                                             torch.float32)]
    states = []
    for shape, period, _ in cases:
        state = F.init_momentum_state(torch.zeros(shape, device=device), shape, period or shape[1])
        states.append((state, copy.deepcopy(state)))
    for beta in (0.9, 0.3):  # torch's lerp takes its two formulas on either side of weight 0.5
        grads = [_grad(gen, shape, dtype, device) for shape, _, dtype in cases]
        got = launch.momentum_([(s, g, beta) for (_, s), g in zip(states, grads)], cb)
        for (s_ref, s_got), g, m in zip(states, grads, got):
            ref = F.update_momentum_(s_ref, g.float(), beta, cb)
            if not torch.equal(ref, m) or (why := state_differences(s_ref, s_got)) is not None:
                return f"the compressed momentum differs from the eager step ({why or 'returned momentum'})"
    return None


def _m8(launch, device, gen) -> str | None:
    cb = _book(gen, 256, device)
    long = launch.MAX_SINGLE + 70
    cases = [  # (shape, block length, factored, dtype): both forms, one tile and two passes, blocks
        # shorter than a row, 1-D and 0-D (one element per block)
        ((33, 17), 17, True, torch.float32), ((3, long), long, True, torch.bfloat16), ((6, 40), 8, True, torch.float32),
        ((4, 3, 10), 30, False, torch.bfloat16), ((2, 2, long), 2 * long, False, torch.float32),
        ((9,), 1, False, torch.float32), ((), 1, False, torch.bfloat16)]
    ref, got = [], []
    for shape, period, factored, dtype in cases:
        p = (torch.randn(shape, generator=gen) * 0.1).to(device=device, dtype=dtype)
        state = F.init_state(p, shape, period, factored)
        ref.append((p, state))
        got.append((p.clone(), copy.deepcopy(state)))
    for step in (1, 2):
        grads = [_grad(gen, shape, dtype, device) for shape, _, _, dtype in cases]
        fact = [i for i, case in enumerate(cases) if case[2]]
        phase1 = dict(zip(fact, launch.m8_partials([(grads[i], got[i][1], _H.beta2) for i in fact])))
        items, before = [], [p.clone() for p, _ in ref]
        for i, (shape, _, factored, _) in enumerate(cases):
            kw = dict(global_rows=shape[0] + 3 if shape else 1)  # a row shard of a larger matrix
            if factored:
                v_row, parts = F.second_moment_partials(grads[i], ref[i][1], _H.beta2)
                if not (torch.allclose(phase1[i][0], v_row, rtol=M8_V_RTOL, atol=0)
                        and torch.allclose(phase1[i][1], parts, rtol=M8_V_RTOL, atol=0)
                        and torch.allclose(phase1[i][1][:-1], parts[:-1], rtol=1e-12, atol=0)):
                    return f"m8 phase 1 (row/column sums) differs from the eager step at step {step}"
                kw.update(v_row=v_row, partials=parts)
            F.gefen_update_(ref[i][0], grads[i], ref[i][1], cb, _H, **kw)
            if factored:
                kw.update(v_row=phase1[i][0], partials=phase1[i][1])
            items.append(launch.Item(got[i][0], grads[i], got[i][1], _H, step, **kw))
        launch.m8_update_(items, cb)
        for i, ((p_ref, s_ref), (p_got, s_got)) in enumerate(zip(ref, got)):
            if (why := state_differences(s_ref, s_got, M8_APPROX)) is not None:
                return f"{why} (m8, shape {cases[i][0]}, step {step})"
            if not params_close(before[i], p_ref, p_got, M8_V_RTOL):
                return f"parameters differ from the eager step beyond rounding (m8, shape {cases[i][0]}, step {step})"
            p_got.copy_(p_ref)
    return None


def _round(launch, device, gen) -> str | None:
    """bf16_stochastic_round's write-back: a row shard with column offset, a 1-D shard, a 0-D
    tensor; values across magnitudes with +-inf and NaN."""
    cases = [((5, 37), dict(row0=3, col0=11, row_len=80)), ((1030,), dict(row0=17)), ((), {})]
    items, refs = [], []
    for shape, kw in cases:
        work = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 8)
        if work.numel() > 3:
            work.view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
        work = work.to(device)
        ref = torch.empty(shape, dtype=torch.bfloat16, device=device)
        F.round_param_(ref, work, step=7, salt=12345, **kw)
        got = torch.empty_like(ref)
        items.append((got, work, 7, 12345, kw.get("row0", 0), kw.get("col0", 0), kw.get("row_len")))
        refs.append(ref)
    launch.round_params_(items)
    for (shape, _), ref, (got, *_) in zip(cases, refs, items):
        nan = ref.isnan()  # NaN stays NaN (torch's own bf16 cast picks one of two NaN patterns)
        if not (torch.equal(nan, got.isnan()) and torch.equal(ref.view(torch.int16)[~nan], got.view(torch.int16)[~nan])):
            return f"the stochastic bf16 write-back differs from the eager step (shape {shape})"
    return None


def _histogram(launch, device, gen) -> str | None:
    """The first step's histogram: blocks of one tile and of several, bf16, an all-zero block, and
    blocks normalised by given scales (a column split's whole rows')."""
    from gefen.codebook import histogram_normalised_blocks

    for shape, dtype in (((5, 8, 16), torch.float32), ((3, 2500), torch.bfloat16)):
        x = _grad(gen, shape, dtype, device)
        if not torch.equal(launch.block_histogram(x, 4096), histogram_normalised_blocks(x, 4096)):
            return f"the codebook histogram differs from the eager one (shape {shape})"
        rows = x.reshape(-1, shape[-1])
        scale = rows.float().abs().amax(1) * 1.5
        if not torch.equal(launch.block_histogram(rows, 256, scale),
                           histogram_normalised_blocks(rows.unsqueeze(1), 256, scale=scale)):
            return f"the codebook histogram with given scales differs from the eager one (shape {shape})"
    return None
