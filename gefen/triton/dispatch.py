"""The Triton kernels' side of ``gefen.dispatch``: whether they are trusted on a device, the
layout each expects, and their launch through ``gefen.triton.launch``.

Each function takes the arguments of the functional reference of the same name and returns True
/ the result when the kernels did the work, or False / None (nothing touched) for a layout that is
not theirs, logged once (``fallback``). At a CUDA device's first use each family runs its parity
problems (``verify``); a mismatch or a build failure keeps the reference. Triton is imported on
first use only. Inside ``batched()`` the updates (which return nothing) are queued and launched
together when the block ends: one launch per phase for the whole step instead of a few per tensor.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading

import torch

from gefen.stochastic import salts

log = logging.getLogger("gefen.triton")

#: device types the kernels serve; tests add "cpu" to run them in Triton's interpreter
DEVICES = {"cuda"}

_launch_mod = None
_import_error: str | None = None
_logged: set[str] = set()
_verified: dict[tuple[str, str], str | None] = {}  # (device, family) -> None (ok) or why not
_local = threading.local()


def _kernels():
    """``gefen.triton.launch`` (importing Triton), or None with the reason remembered."""
    global _launch_mod, _import_error
    if _launch_mod is None and _import_error is None:
        try:
            from gefen.triton import launch
        except Exception as exc:  # ImportError, or a Triton that fails to initialise
            _import_error = f"Triton is not importable ({type(exc).__name__}: {exc})"
        else:
            _launch_mod = launch
    return _launch_mod


def available() -> bool:
    return _kernels() is not None


def fallback(reason: str) -> bool:
    """Log, once per reason, why a CUDA step uses the reference; False (the kernels did nothing)."""
    if reason not in _logged:
        _logged.add(reason)
        log.warning("gefen: a CUDA step uses the eager torch path: %s", reason)
    return False


def untrusted(device: torch.device, family: str) -> str | None:
    """None when the ``family`` kernels may run on ``device`` (Triton imports; on CUDA, ``verify``
    passed), else why not."""
    if _kernels() is None:
        return _import_error
    return verify(device, family) if device.type == "cuda" else None


def verify(device: torch.device, family: str) -> str | None:
    """The ``family``'s parity problems (``gefen.triton.selfcheck``) on ``device``, once (cached):
    None when the kernels agree with the reference, else why the reference is kept (a Triton or
    driver that miscompiles the kernels or fails to build them)."""
    key = (str(device), family)
    if key not in _verified:
        from gefen.triton import selfcheck

        try:
            _verified[key] = selfcheck.run(_launch_mod, device, family)
        except Exception as exc:  # a kernel that does not build or launch here
            _verified[key] = f"the {family} kernels failed their first run ({type(exc).__name__}: {exc})"
    return _verified[key]


@contextlib.contextmanager
def batched():
    """Queue m4v4 updates inside the block and launch them together at its end."""
    if getattr(_local, "queue", None) is not None:  # nested: the outer block launches
        yield
        return
    _local.queue = []
    try:
        yield
        queue = _local.queue
    finally:
        _local.queue = None
    _flush(queue)


def _flush(queue) -> None:
    groups: dict[tuple, list] = {}
    for run, item, books in queue:
        groups.setdefault((run, *(id(b) for b in books)), []).append((item, books))
    # a parameter's stochastic bf16 write-back reads the fp32 its update wrote: those launch last
    for (run, *_), entries in sorted(groups.items(), key=lambda kv: kv[0][0] == "round_params_"):
        getattr(_launch_mod, run)([item for item, _ in entries], *entries[0][1])


def drain() -> None:
    """Launch what ``batched()`` has queued so far (before an eager op that reads its results)."""
    queue = getattr(_local, "queue", None)
    if queue:
        _local.queue = []
        _flush(queue)


def _submit(item, books, run: str = "m4v4_update_") -> None:
    """Launch ``gefen.triton.launch.<run>([item], *books)`` now, or at the end of ``batched()``
    together with the other items of the same ``run`` and codebooks."""
    queue = getattr(_local, "queue", None)
    if queue is None:
        getattr(_launch_mod, run)([item], *books)
    else:
        queue.append((run, item, books))


def m4v4_update_(param, grad, state, codebook, ratio, h, *, global_rows, v_row, partials, pidx, seed, row0=0,
                 col0=0, row_len=None, row_max=None) -> bool:
    # gefen.dispatch checked the layout, as for the m4v4 functions below
    item = _launch_mod.Item(param, grad, state, h, int(state["step"]) + 1, salts(pidx, seed)[0], row0=row0,
                            global_rows=global_rows, row_len=row_len, v_row=v_row, partials=partials, col0=col0,
                            row_max=row_max)
    _submit(item, (codebook, ratio))
    return True


def m4v4_partials(grad, state, beta2, *, row_sum=None, row_len=None):
    out = m4v4_partials_([(grad, state, beta2)], None if row_sum is None else [(row_sum, row_len or grad[0].numel())])
    return None if out is None else out[0]


def m4v4_row_stats(grad, state, codebook, beta1):
    return _launch_mod.m4v4_row_stats([(grad, state, beta1)], codebook)[0]


def m4v4_partials_(items: list[tuple[torch.Tensor, dict, float]], rows=None) -> list | None:
    """Every ``(grad, state, beta2)`` in two launches; ``rows``: as ``launch.m4v4_partials``'."""
    return _launch_mod.m4v4_partials(items, rows)


def adamw_update_(param, grad, state, h, *, pidx: int, seed: int, row0: int = 0) -> bool:
    _submit(_launch_mod.Item(param, grad, state, h, int(state["step"]) + 1, salts(pidx, seed)[0], row0=row0),
            (None, None))
    return True


def gefen_update_(param, grad, state, codebook, h, *, global_rows, v_row=None, partials=None) -> bool:
    factored = "v_row" in state
    period = int(state["period"])
    cols = math.prod(param.shape[1:]) if param.dim() else 1
    blocks = param.numel() // max(period, 1)
    second = (state["v_row"], state["v_col"], v_row) if factored else (state["v"],)
    if (param.shape != grad.shape or codebook.dtype != torch.float32 or not 2 <= codebook.numel() <= 256
            or period < 1 or cols % period or state["m_code"].dtype != torch.uint8
            or state["m_code"].shape != param.shape or state["m_scale"].dtype != torch.float32
            or state["m_scale"].numel() != blocks or any(t.dtype != torch.float32 for t in second)
            or (not factored and state["v"].numel() != blocks)
            or (factored and (param.dim() != 2 or v_row.numel() != param.shape[0] or state["v_col"].numel() != cols
                              or partials.dtype != torch.float64 or partials.numel() != cols + 1))):
        return fallback("an unexpected m8 state or argument layout")
    item = _launch_mod.Item(param, grad, state, h, int(state["step"]) + 1, global_rows=global_rows, v_row=v_row,
                              partials=partials)
    _submit(item, (codebook,), "m8_update_")
    return True


def m8_partials_(items: list[tuple[torch.Tensor, dict, float]]) -> list | None:
    """``functional.second_moment_partials`` of every factored ``(grad, state, beta2)`` in two launches."""
    return _launch_mod.m8_partials(items)


def momentum_(state, grad, beta, codebook, scales=None) -> torch.Tensor | None:
    """``functional.update_momentum_``; ``scales``: ``store_momentum_``'s (a column split's)."""
    out = momenta_([(state, grad, beta)], codebook, None if scales is None else [scales])
    return None if out is None else out[0]


def momentum_scales(state, grad, beta, codebook) -> torch.Tensor | None:
    """The block scales ``update_momentum_`` would choose (nothing else written)."""
    out = momenta_([(state, grad, beta)], codebook, scales_only=True)
    return None if out is None else out[0]


def momenta_(items: list[tuple[dict, torch.Tensor, float]], codebook: torch.Tensor, scales=None, *,
             scales_only: bool = False) -> list | None:
    """``functional.update_momentum_`` of every ``(state, grad, beta)`` in one launch per class,
    or None (nothing touched) when any of them must take the eager path (``scales``,
    ``scales_only``: as ``gefen.triton.launch.momentum_``'s)."""
    grads = [g for _, g, _ in items]
    codes, m_scales = [s["m_code"] for s, _, _ in items], [s["m_scale"] for s, _, _ in items]
    if (codebook.dtype != torch.float32 or not 2 <= codebook.numel() <= 256
            or any(c.dtype != torch.uint8 or s.dtype != torch.float32 or c.shape != g.shape
                   for c, s, g in zip(codes, m_scales, grads))
            or any(s.dtype != torch.float32 or s.numel() != m.numel() for s, m in zip(scales or [], m_scales)
                   if s is not None)):
        return fallback("an unexpected compressed-momentum layout") or None
    if scales_only:
        return _launch_mod.momentum_(items, codebook, scales_only=True)
    return _launch_mod.momentum_(items, codebook, *([scales] if scales else []))


def round_param_(param, work, *, step: int, salt: int, row0: int = 0, col0: int = 0, row_len=None) -> bool:
    _submit((param, work, step, salt, row0, col0, row_len), (), "round_params_")
    return True


def block_histogram(blocks, num_bins: int, scale=None) -> torch.Tensor | None:
    """``scale``: one per block, a column split's whole rows' max-abs."""
    if not blocks.numel():
        return None
    return _launch_mod.block_histogram(blocks, num_bins, scale)
