"""Which implementation runs each step function, as ``torch.optim.adamw`` picks fused/foreach/single.

Every function takes the arguments of the ``gefen.functional`` reference of the same name and asks
``kernels``, the one selection: the C kernels (CPU), the Triton kernels (CUDA), on a layout checked
here (``_*_layout``), else the reference. The ``*_`` functions over a list take a whole group.
"""

from __future__ import annotations

import os

import torch

from gefen import c_kernels
from gefen import functional as F
from gefen.codebook import histogram_normalised_blocks, histogram_pairs
from gefen.geometry import rows_and_row_numel
from gefen.triton import dispatch as triton
from gefen.triton.dispatch import batched

__all__ = ["adamw_update_", "batched", "block_histograms", "enabled", "kernels", "m4v4_partials", "m4v4_partials_",
           "m4v4_row_stats", "m4v4_update_", "m8_partials", "m8_partials_", "m8_update_", "momenta_",
           "momentum_scales", "round_param_", "sr_target", "unfit", "update_momentum_"]

#: The one switch: False runs the reference everywhere (the kernels' numbers within their bounds, slower).
enabled: bool = os.environ.get("GEFEN_DISABLE_NATIVE", "").strip() in ("", "0")
_FLOATS = (torch.float32, torch.bfloat16)


def unfit(tensors: list, states: list = ()) -> str | None:
    """Why no kernel takes these parameters/gradients with these state tensors and tables, or None:
    every kernel wants one device, contiguous memory, fp32/bf16 parameters and gradients."""
    device = tensors[0].device
    for t in (*tensors, *states):
        if t.device != device:
            return f"tensors on different devices ({t.device} and {device})"
        if not t.is_contiguous():
            return "a non-contiguous parameter, gradient or state tensor"
    bad = [t.dtype for t in tensors if t.dtype not in _FLOATS]
    return f"parameter/gradient dtype {bad[0]} (fp32 and bf16 only)" if bad else None


def kernels(family: str, tensors: list, states: list = (), layout=None):
    """The kernels for a call of ``family`` on ``tensors`` and ``states`` (None: a field the state
    lacks), or None: the switch, the device's family and its parity check, ``unfit``, then
    ``layout()`` (why the call's layout is no kernel's). A CUDA fallback logs why, once per reason."""
    if any(t is None for t in states):
        return None
    device = tensors[0].device
    if device.type in triton.DEVICES:
        why = ("disabled (GEFEN_DISABLE_NATIVE=1 or gefen.dispatch.enabled = False)" if not enabled
               else triton.untrusted(device, family) or unfit(tensors, states) or (layout and layout()))
        if why is None:
            return triton
        if device.type == "cuda":
            triton.fallback(why)
        return None
    if device.type == "cpu" and enabled and c_kernels.trusted(family) and unfit(tensors, states) is None:
        return None if layout and layout() else c_kernels
    return None


def _kernel_or_reference(run, name: str, reference, *args, **kw):
    """``run.<name>(*args, **kw)`` when ``kernels`` chose kernels that have it and they do not
    decline (None / False: nothing touched), else ``reference(*args, **kw)``."""
    fn = getattr(run, name, None)
    out = None if fn is None else fn(*args, **kw)
    return reference(*args, **kw) if out is None or out is False else out


def _first(reasons) -> str | None:
    return next(filter(None, reasons), None)


def _phase1_layout(grad, state, max_dim: int, row_sum=None) -> str | None:
    """Why phase 1's kernels do not take this gradient and state (m8: 2-D only; m4v4: a column
    split's float64 ``row_sum``), or None."""
    rows, cols = rows_and_row_numel(grad.shape)
    if (not 2 <= grad.dim() <= max_dim or cols < 1 or state["v_row"].dtype != torch.float32
            or state["v_row"].shape != (rows,)
            or (row_sum is not None and (row_sum.dtype != torch.float64 or row_sum.shape != (rows,)))):
        return "an unexpected phase-1 gradient or state layout"
    return None


def m8_partials(grad, state, beta2):
    run = kernels("m8", [grad], [state.get("v_row")], lambda: _phase1_layout(grad, state, 2))
    return _kernel_or_reference(run, "m8_partials", F.m8_partials, grad, state, beta2)


def m8_partials_(items: list[tuple[torch.Tensor, dict, float]]) -> list | None:
    """``m8_partials`` of every factored ``(grad, state, beta2)`` in two Triton launches
    (phase 1 of a whole m8 group), or None: the caller takes them one by one."""
    return _phase1_group("m8", items, lambda g: 2, "m8_partials")


def _phase1_group(family: str, items: list, max_dim, name: str) -> list | None:
    """Phase 1 of a whole group by ``gefen.triton.launch.<name>`` when the kernels take every item."""
    if not items:
        return None
    grads, v_rows = [g for g, _, _ in items], [s["v_row"] for _, s, _ in items]
    why = lambda: _first(_phase1_layout(g, s, max_dim(g)) for g, s, _ in items)  # noqa: E731
    return getattr(triton.launch, name)(items) if kernels(family, grads, v_rows, why) is triton else None


def m8_update_(param, grad, state, codebook, h, *, global_rows, v_row=None, partials=None) -> None:
    second = [state.get("v_row"), state.get("v_col"), v_row, partials] if "v_row" in state else [state.get("v")]
    run = kernels("m8", [param, grad], [state.get("m_code"), state.get("m_scale"), codebook, *second],
                  lambda: _m8_layout(param, grad, state, codebook, v_row, partials))
    _kernel_or_reference(run, "m8_update_", F.m8_update_, param, grad, state, codebook, h,
                         global_rows=global_rows, v_row=v_row, partials=partials)


def _momentum_layout(grad, state, codebook, scales=None) -> str | None:
    """Why the compressed-momentum kernels do not take this codebook and state (and a column
    split's ``scales``), or None."""
    codes, m_scale = state["m_code"], state["m_scale"]
    rows, cols = rows_and_row_numel(grad.shape)
    period = F._local_period(state)
    if (codebook.dtype != torch.float32 or not 2 <= codebook.numel() <= 256 or codes.dtype != torch.uint8
            or codes.shape != grad.shape or m_scale.dtype != torch.float32 or period < 1 or cols % period
            or m_scale.numel() != rows * (cols // period)
            or (scales is not None and (scales.dtype != torch.float32 or scales.numel() != m_scale.numel()))):
        return "an unexpected compressed-momentum layout"
    return None


def _m8_layout(param, grad, state, codebook, v_row=None, partials=None) -> str | None:
    """Why the m8 kernels do not take this state and these tables (factored: phase 1's ``v_row``
    and ``partials``), or None."""
    rows, cols = rows_and_row_numel(grad.shape)
    if "v_row" in state:
        v_col = state["v_col"]
        fields_ok = (v_row is not None and partials is not None and partials.dtype == torch.float64
                     and partials.numel() == cols + 1 and v_row.numel() == rows and v_col.numel() == cols
                     and all(t.dtype == torch.float32 for t in (state["v_row"], v_col, v_row)))
    else:
        v = state["v"]
        fields_ok = v.dtype == torch.float32 and v.numel() == state["m_scale"].numel()
    if param.shape != grad.shape or not fields_ok or _momentum_layout(grad, state, codebook):
        return "an unexpected m8 state or argument layout"
    return None


def _momentum_kernels(items, codebook, scales=()):
    states = [codebook, *(s for s in scales if s is not None)]
    for state, _, _ in items:
        states += [state.get("m_code"), state.get("m_scale")]
    paired = zip(items, list(scales) or [None] * len(items))
    return kernels("momentum", [g for _, g, _ in items], states,
                   lambda: _first(_momentum_layout(g, s, codebook, sc) for (s, g, _), sc in paired))


def update_momentum_(state, grad, beta, codebook, scales=None) -> torch.Tensor:
    """``scales``: a column split's rows' scales, reduced over tensor parallelism (``momentum_scales``)."""
    run = _momentum_kernels([(state, grad, beta)], codebook, [scales])
    if run is not None and (out := run.momentum_(state, grad, beta, codebook, scales)) is not None:
        return out
    if scales is None:
        return F.update_momentum_(state, grad, beta, codebook)
    return F.store_momentum_(state, F.momentum_ema(state, grad, beta, codebook), codebook, scales)


def momentum_scales(state, grad, beta, codebook) -> torch.Tensor:
    return _kernel_or_reference(_momentum_kernels([(state, grad, beta)], codebook), "momentum_scales",
                                F.momentum_scales, state, grad, beta, codebook)


def momenta_(items: list[tuple[dict, torch.Tensor, float]], codebook: torch.Tensor) -> list[torch.Tensor]:
    """``update_momentum_`` of every ``(state, grad, beta)``; on CUDA all in one Triton launch
    (which reads bf16 gradients as they are; the others take them as fp32)."""
    if not items:
        return []
    out = triton.launch.momentum_(items, codebook) if _momentum_kernels(items, codebook) is triton else None
    return out or [update_momentum_(s, g.float(), mu, codebook) for s, g, mu in items]


def m4v4_partials(grad, state, beta2, *, row_sum=None, row_len=None):
    run = kernels("m4v4", [grad], [state.get("v_row")] + ([] if row_sum is None else [row_sum]),
                  lambda: _phase1_layout(grad, state, grad.dim(), row_sum))
    return _kernel_or_reference(run, "m4v4_partials", F.m4v4_partials, grad, state, beta2, row_sum=row_sum,
                                row_len=row_len)


def m4v4_partials_(items: list[tuple[torch.Tensor, dict, float]]) -> list | None:
    """``m4v4_partials`` of every ``(grad, state, beta2)`` in two Triton launches (phase 1 of a
    whole group), or None: the caller takes them one by one."""
    return _phase1_group("m4v4", items, lambda g: g.dim(), "m4v4_partials")


def m4v4_row_stats(grad, state, codebook, beta1) -> tuple[torch.Tensor, torch.Tensor]:
    run = kernels("m4v4", [grad], [state.get("mv_code"), state.get("m_row_scale"), codebook],
                  lambda: _m4v4_layout(grad, state, codebook))
    return _kernel_or_reference(run, "m4v4_row_stats", F.m4v4_row_stats, grad, state, codebook, beta1)


def m4v4_update_(param, grad, state, codebook, ratio, h, *, global_rows, v_row, partials, pidx, seed, row0=0,
                 col0=0, row_len=None, row_max=None) -> None:
    fields = [state.get(k) for k in ("mv_code", "m_row_scale", "v_row", "v_col")]
    tables = [codebook, ratio, v_row, partials] + ([] if row_max is None else [row_max])
    run = kernels("m4v4", [param, grad], [*fields, *tables],
                  lambda: _m4v4_layout(grad, state, codebook, param, ratio, v_row, partials, row_max))
    _kernel_or_reference(run, "m4v4_update_", F.m4v4_update_, param, grad, state, codebook, ratio, h,
                         global_rows=global_rows, v_row=v_row, partials=partials, pidx=pidx, seed=seed, row0=row0,
                         col0=col0, row_len=row_len, row_max=row_max)


def adamw_update_(param, grad, state, h, *, pidx: int, seed: int, row0: int = 0) -> None:
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    run = kernels("m4v4", [param, grad], [m, v], lambda: (
        None if param.shape == grad.shape == m.shape == v.shape and m.dtype == torch.bfloat16
        and v.dtype == torch.float32 else "an unexpected AdamW state layout"))
    _kernel_or_reference(run, "adamw_update_", F.adamw_update_, param, grad, state, h, pidx=pidx, seed=seed,
                         row0=row0)


def _m4v4_layout(grad, state, codebook, param=None, ratio=None, v_row=None, partials=None, row_max=None) -> str | None:
    """Why the m4v4 kernels do not take this coded state and these tables (``param`` given: the
    update's arguments too), or None."""
    rows, cols = rows_and_row_numel(grad.shape)
    codes, scale = state["mv_code"], state["m_row_scale"]
    if (grad.dim() < 2 or cols < 1 or codes.dtype != torch.uint8 or codes.numel() != rows * cols
            or scale.dtype != torch.bfloat16 or scale.numel() != rows or codebook.dtype != torch.float32
            or codebook.numel() != 16):
        return "an unexpected m4v4 state layout"
    if param is None:
        return None
    if row_max is not None and (row_max.dtype != torch.float32 or row_max.numel() != rows):
        return "an unexpected row statistic of a column split"
    if (param.shape != grad.shape or ratio.dtype != torch.float32 or ratio.numel() != 32
            or any(t.dtype != torch.float32 or t.numel() != n for t, n in ((state["v_row"], rows), (v_row, rows),
                                                                            (state["v_col"], cols)))
            or partials.dtype != torch.float64 or partials.numel() != cols + 2):
        return "an unexpected m4v4 state or argument layout"
    return None


def sr_target(param: torch.Tensor, enabled: bool) -> torch.Tensor:
    """What an update writes: under ``bf16_stochastic_round`` a bf16 parameter's fp32 copy (every
    kernel computes a bf16 parameter in fp32 and rounds once, so the fp32 result is the one the
    nearest rounding would round; ``round_param_`` then rounds it stochastically), else ``param``."""
    return param.float() if enabled and param.dtype == torch.bfloat16 else param


def round_param_(param, work, *, step: int, salt: int, row0: int = 0, col0: int = 0, row_len=None) -> None:
    """``functional.round_param_`` unless ``work`` is ``param`` itself (``sr_target`` kept it)."""
    if work is param:
        return
    kw = dict(step=step, salt=salt, row0=row0, col0=col0, row_len=row_len)
    if param.dtype == torch.bfloat16 and work.dtype == torch.float32 and param.shape == work.shape:
        run = kernels("round", [param, work])
        if run and run.round_param_(param, work, **kw):
            return
    triton.drain()  # an update queued in batched() must have written ``work`` first
    F.round_param_(param, work, **kw)


def block_histograms(items: list, num_bins: int) -> torch.Tensor | None:
    """The first step's histogram of every item (``codebook.histogram_pairs``), summed on the first
    item's device (None for no items): the C kernels count every CPU item they take in one call,
    Triton each CUDA item, the reference the rest (the same counts)."""
    pairs = histogram_pairs(items)
    runs = [_histogram_kernels(blocks, scale, num_bins) for blocks, scale in pairs]
    batch = [pair for pair, run in zip(pairs, runs) if run is c_kernels]
    counts = c_kernels.block_histograms(batch, num_bins) if batch else None
    if counts is None:  # no batch, or the C call refused it: the reference counts those items
        runs = [None if run is c_kernels else run for run in runs]
    for (blocks, scale), run in zip(pairs, runs):
        if run is c_kernels:
            continue  # counted in the batch
        h = run.block_histogram(blocks, num_bins, scale) if run is not None else None
        h = histogram_normalised_blocks(blocks, num_bins, scale) if h is None else h
        counts = h if counts is None else counts + h.to(counts.device)
    return None if counts is None else counts.to(pairs[0][0].device)


def _histogram_kernels(blocks, scale, num_bins: int):
    if blocks.dim() < 1 or blocks.shape[-1] < 1 or num_bins < 1:
        return None
    return kernels("histogram", [blocks], [] if scale is None else [scale], lambda: (
        None if scale is None or scale.numel() == blocks.numel() // blocks.shape[-1]
        else "an unexpected histogram scale layout"))
