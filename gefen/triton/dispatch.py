"""The Triton kernels' side of ``gefen.dispatch``: whether they are trusted on a device (parity
problems at a CUDA device's first use), and their launch through ``gefen.triton.launch`` (imported,
with Triton, on first use). Each function takes the arguments of the functional reference of the
same name; inside ``batched()`` the updates are queued and launched together when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from gefen import parity
from gefen.functional import _local_period
from gefen.stochastic import salts

log = logging.getLogger("gefen.triton")

#: device types the kernels serve; tests add "cpu" to run them in Triton's interpreter
DEVICES = {"cuda"}

#: ``gefen.triton.launch`` once imported (``_kernels``): the kernels' entry points take lists
launch = None
_import_error: str | None = None
_logged: set[str] = set()
_verified: dict[tuple[str, str], str | None] = {}  # (device, family) -> None (ok) or why not
_local = threading.local()


def _kernels():
    """``gefen.triton.launch`` (importing Triton), or None with the reason remembered."""
    global launch, _import_error
    if launch is None and _import_error is None:
        try:
            from gefen.triton import launch as module
        except Exception as exc:  # ImportError, or a Triton that fails to initialise
            _import_error = f"Triton is not importable ({type(exc).__name__}: {exc})"
        else:
            launch = module
    return launch


def available() -> bool:
    return _kernels() is not None


def fallback(reason: str) -> bool:
    """Log, once per reason, why a CUDA step uses the reference; False (the kernels did nothing)."""
    if reason not in _logged:
        _logged.add(reason)
        log.warning("gefen: a CUDA step uses the eager torch path: %s", reason)
    return False


def untrusted(device: torch.device, family: str) -> str | None:
    """None when the ``family`` kernels may run on ``device``, else why not: Triton does not
    import, or, on CUDA, ``parity_check`` (run once, cached) failed: a Triton or driver that
    miscompiles the kernels, or fails to build them, keeps the reference."""
    if _kernels() is None:
        return _import_error
    key = (str(device), family)
    if device.type == "cuda" and key not in _verified:
        try:
            _verified[key] = parity_check(device, family)
        except Exception as exc:  # a kernel that does not build or launch here
            _verified[key] = f"the {family} kernels failed their first run ({type(exc).__name__}: {exc})"
    return _verified.get(key)


def parity_check(device: torch.device, family: str) -> str | None:
    """None when the ``family`` kernels (``"m4v4"``, ``"m8"``, ``"momentum"``, ``"round"``,
    ``"histogram"``) agree with the reference on ``device`` (``gefen.parity``), else what differs.
    The problems reach both row paths (one tile, two passes), bf16 and fp32, an all-zero row, the
    1-D and 0-D steps, m8's two second-moment forms; each stepping one is checked fresh and from a
    step of the reference."""
    long = launch.MAX_SINGLE + 70  # a row of the two-pass kernels
    steps = [(0, 1), (1, 1)]
    problems, rule = {
        "m4v4": ([(parity.run_m4v4, (shape, dt, device, st)) for st in steps for shape, dt in [
            ((33, 17), torch.float32), ((3, long), torch.bfloat16), ((9,), torch.float32)]], parity.after_rounding()),
        "m8": ([(parity.run_m8, (*case, device, st)) for st in steps for case in [
            ((33, 17), 17, True, torch.float32), ((3, long), long, True, torch.bfloat16),
            ((6, 40), 8, True, torch.float32), ((4, 3, 10), 30, False, torch.bfloat16),
            ((2, 2, long), 2 * long, False, torch.float32), ((9,), 1, False, torch.float32),
            ((), 1, False, torch.bfloat16)]], parity.M8_RULE),
        "momentum": ([(parity.run_momentum, (*case, device)) for case in [
            ((33, 17), 17, torch.float32), ((6, 40), 8, torch.bfloat16), ((3, long), long, torch.float32)]],
            parity.equal),
        "round": ([(parity.run_round, (shape, place, device)) for shape, place in [
            ((5, 37), (3, 11, 80)), ((1030,), (17, 0, None)), ((), (0, 0, None))]], parity.equal),
        "histogram": ([(parity.run_histogram, (shape, dt, device)) for shape, dt in [
            ((5, 8, 16), torch.float32), ((3, 2500), torch.bfloat16)]], parity.equal),
    }[family]
    fns = parity.kernel_fns(m8_partials=lambda g, state, beta2: launch.m8_partials([(g, state, beta2)])[0],
                            m8_update=m8_update_, m4v4_partials=m4v4_partials, m4v4_update=m4v4_update_,
                            adamw=adamw_update_, momentum=momentum_, round=round_param_, histogram=block_histogram)
    queue, _local.queue = getattr(_local, "queue", None), None  # run now, not at the end of a batched() step
    try:
        with torch.no_grad():
            return parity.check(problems, fns, rule)
    finally:
        _local.queue = queue


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
        getattr(launch, run)([item for item, _ in entries], *entries[0][1])


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
        getattr(launch, run)([item], *books)
    else:
        queue.append((run, item, books))


def m4v4_update_(param, grad, state, codebook, ratio, h, *, global_rows, v_row, partials, pidx, seed, row0=0,
                 col0=0, row_len=None, row_max=None) -> bool:
    # gefen.dispatch checked the layout, as for the functions below
    item = launch.Item(param, grad, state, h, int(state["step"]) + 1, salts(pidx, seed)[0], row0=row0,
                       global_rows=global_rows, row_len=row_len, v_row=v_row, partials=partials, col0=col0,
                       row_max=row_max)
    _submit(item, (codebook, ratio))
    return True


def m4v4_partials(grad, state, beta2, *, row_sum=None, row_len=None):
    given = None if row_sum is None else [(row_sum, row_len or grad[0].numel())]
    return launch.m4v4_partials([(grad, state, beta2)], given)[0]


def m4v4_row_stats(grad, state, codebook, beta1):
    return launch.m4v4_row_stats([(grad, state, beta1)], codebook)[0]


def adamw_update_(param, grad, state, h, *, pidx: int, seed: int, row0: int = 0) -> bool:
    _submit(launch.Item(param, grad, state, h, int(state["step"]) + 1, salts(pidx, seed)[0], row0=row0), (None, None))
    return True


def m8_update_(param, grad, state, codebook, h, *, global_rows, v_row=None, partials=None) -> bool:
    # these kernels also want 2-D factored rows and no column split
    if ("v_row" in state and param.dim() != 2) or int(state["period"]) != _local_period(state):
        return fallback("an unexpected m8 state or argument layout")
    item = launch.Item(param, grad, state, h, int(state["step"]) + 1, global_rows=global_rows, v_row=v_row,
                       partials=partials)
    _submit(item, (codebook,), "m8_update_")
    return True


def momentum_(state, grad, beta, codebook, scales=None) -> torch.Tensor:
    """``functional.update_momentum_``; ``scales``: ``store_momentum_``'s (a column split's)."""
    return launch.momentum_([(state, grad, beta)], codebook, None if scales is None else [scales])[0]


def momentum_scales(state, grad, beta, codebook) -> torch.Tensor:
    """The block scales ``update_momentum_`` would choose (nothing else written)."""
    return launch.momentum_([(state, grad, beta)], codebook, scales_only=True)[0]


def round_param_(param, work, *, step: int, salt: int, row0: int = 0, col0: int = 0, row_len=None) -> bool:
    _submit((param, work, step, salt, row0, col0, row_len), (), "round_params_")
    return True


def block_histogram(blocks, num_bins: int, scale=None) -> torch.Tensor | None:
    """``scale``: one per block, a column split's whole rows' max-abs."""
    if not blocks.numel():
        return None
    return launch.block_histogram(blocks, num_bins, scale)
