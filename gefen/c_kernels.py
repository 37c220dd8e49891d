"""The C kernels of the step: a ctypes binding to ``gefen/csrc/`` (``gefen._gefen_step``).

Each function takes the arguments of the ``gefen.functional`` reference of the same name, on a
layout ``gefen.dispatch`` checked, and returns None / False, touching nothing, when the kernel
refuses (``cal``: a calibration candidate to run under; None: the calibrated one). The m8 and
m4v4 kernels compute their references' arithmetic for speed, within the bounds ``gefen.parity``
states; the 1-D AdamW step replays torch's square root. ``calibrate`` checks them, through
``gefen.parity``, and finds the square root, cached per library build, CPU and torch
(``$GEFEN_CACHE_DIR``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import tempfile
import warnings

import torch

from gefen import functional as F
from gefen import parity
from gefen.clib import load
from gefen.codebook import code_thresholds
from gefen.geometry import rows_and_row_numel
from gefen.stochastic import hash_base, salts

__all__ = ["available", "trusted", "m8_partials", "m8_update_", "momentum_", "momentum_scales",
           "calibrate", "Calibration", "block_histograms", "m4v4_partials", "m4v4_row_stats",
           "m4v4_update_", "adamw_update_", "round_param_"]

_ABI = 20
#: ``GEFEN_CPU_ISA`` (read at import): the widest C kernels allowed, capped by the CPU. Every ISA
#: computes the same bits (docs/design.md, "The m4v4 kernels"), so it only changes speed.
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}


def _isa_from_env() -> int:
    name = os.environ.get("GEFEN_CPU_ISA", "").strip().lower()
    if name and name not in ISAS:
        warnings.warn(f"GEFEN_CPU_ISA={name!r} is not one of {sorted(ISAS)}; ignored", RuntimeWarning, stacklevel=2)
    return ISAS.get(name, 2)


_ISA = _isa_from_env()
_DT = {torch.float32: 0, torch.bfloat16: 1}
_P = ctypes.c_void_p
_I32, _I64, _DBL = ctypes.c_int32, ctypes.c_int64, ctypes.c_double


class _Mode(ctypes.Structure):
    """Mirror of ``gefen_mode`` in gefen_common.h: how one call computes (square root, kernels)."""

    _fields_ = [("sqrt", _P), ("mkl_threads", _P), ("isa", _I32)]


#: Mirror of ``GEFEN_ARGS_HEAD`` in gefen_common.h: the fields every step's arguments start with.
_HEAD = [("param", _P), ("grad", _P), ("step_ptr", _P), ("step", _I64),
         *((name, _DBL) for name in ("beta1", "omb1", "beta2", "omb2", "bias1", "bias2_sqrt", "eps", "neg_lr", "decay",
                                    "inv_bound")),
         ("param_dtype", _I32), ("grad_dtype", _I32), ("has_wd", _I32), ("mode", _P)]


class _StepArgs(ctypes.Structure):
    """Mirror of ``gefen_step_args`` in gefen_step.c (field order and types must match)."""

    _fields_ = _HEAD + [
        ("codes", _P), ("scales", _P), ("v", _P), ("v_row_new", _P), ("v_row", _P), ("v_col", _P), ("partials", _P),
        ("codebook", _P), ("thr", _P), ("lut", _P),
        ("rows", _I64), ("bpr", _I64), ("period", _I64), ("global_rows", _I64),
        ("K", _I32), ("lut_M", _I32), ("factored", _I32), ("momentum_only", _I32),
        ("m_out", _P), ("given_scales", _P), ("scales_out", _P),
    ]


class _M4v4Args(ctypes.Structure):
    """Mirror of ``m4v4_args`` in m4v4_step.c (field order and types must match)."""

    _fields_ = _HEAD + [
        ("codes", _P), ("m_scale", _P), ("v_row", _P), ("v_row_new", _P), ("v_col", _P), ("partials", _P),
        ("codebook", _P), ("ratios", _P),
        ("rows", _I64), ("cols", _I64), ("global_rows", _I64), ("global_cols", _I64), ("row_offset", _I64),
        ("col_offset", _I64), ("salt_m", ctypes.c_uint32), ("salt_v", ctypes.c_uint32), ("row_max", _P),
    ]


class _AdamwArgs(ctypes.Structure):
    """Mirror of ``adamw_args`` in m4v4_step.c."""

    _fields_ = _HEAD + [("exp_avg", _P), ("exp_avg_sq", _P), ("n", _I64), ("row_offset", _I64),
                        ("salt", ctypes.c_uint32)]


#: The C library's functions: (argument types, result type).
_SIGNATURES = {name: (args, ctypes.c_int) for name, args in (
    ("gefen_native_abi", []), ("gefen_cpu_isa", []),
    ("gefen_m4v4_partials", [_P, _I32, _I64, _I64, _P, _P, _P, _DBL, _DBL, _P, _P, _I64]),
    ("gefen_m4v4_row_stats", [_P, _I32, _P, _P, _P, _DBL, _DBL, _I64, _I64, _P, _P, _P]),
    ("gefen_build_lut", [_P, _I32, _I32, _I32, _P]),
    ("gefen_step", [ctypes.POINTER(_StepArgs)]),
    ("gefen_m4v4_step", [ctypes.POINTER(_M4v4Args)]),
    ("gefen_adamw_step", [ctypes.POINTER(_AdamwArgs)]),
    ("gefen_block_histograms", [_I64, _P, _P, _P, _P, _P, _I64, _P, _I32, _I64]),
    ("gefen_round_bf16", [_P, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_uint32]))}
_SIGNATURES["gefen_set_threads"] = ([_I32], None)


def _load():
    """The C library, or None (plain source tree, failed build, foreign ABI)."""
    lib = load("gefen._gefen_step", _SIGNATURES)
    return lib if lib is not None and lib.gefen_native_abi() == _ABI else None


@functools.cache
def _torch_vml_sqrt() -> tuple[int, int | None] | None:
    """Addresses of MKL's ``vmsSqrt``, which torch.sqrt calls on CPU when torch is built with MKL,
    and of ``MKL_Set_Num_Threads_Local`` (C ABI; both exported by libtorch_cpu); None otherwise (torch
    then uses an IEEE sqrt)."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        try:
            lib = ctypes.CDLL(os.path.join(lib_dir, name))
        except OSError:  # not this platform's name
            continue
        fn, local = (getattr(lib, sym, None) for sym in ("vmsSqrt", "MKL_Set_Num_Threads_Local"))
        if fn is not None:
            return (ctypes.cast(fn, ctypes.c_void_p).value,
                    ctypes.cast(local, ctypes.c_void_p).value if local is not None else None)
    return None


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` settled on: every fused call passes it to the kernels, and it is replaced
    whole, never modified, so trying a candidate cannot change what a concurrent step computes.

    ``m8``, ``m4v4``: those kernels (m8's with GefenMuon's momentum) keep their bound of their
    reference; ``vml``: the 1-D AdamW step calls MKL's square root, as torch does; ``isa``: the
    widest kernels allowed (2 AVX-512, 1 AVX2, 0 portable; the CPU caps it, tests lower it to
    compare the kernels, which give the same bits)."""

    m8: bool
    vml: bool
    m4v4: bool
    isa: int = _ISA

    def __post_init__(self):
        # built here, not lazily: two threads' first calls must not race to replace the struct
        # whose address a kernel already holds. ``mode`` is the address the kernels get.
        sqrt, threads = (_torch_vml_sqrt() if self.vml else None) or (None, None)
        object.__setattr__(self, "_mode", _Mode(sqrt, threads if sqrt else None, self.isa))
        object.__setattr__(self, "mode", ctypes.addressof(self._mode))


_lib = _load()
_lib_path: str | None = getattr(_lib, "_name", None)
_calibration: Calibration | None = None  # calibrate_cached()'s result, made at first use
_quant_cache: dict = {}


def _calibrated() -> Calibration:
    global _calibration
    if _calibration is None:
        _calibration = calibrate_cached()
    return _calibration


def trusted(family: str) -> bool:
    """Whether ``gefen.dispatch`` may run the C kernels of ``family`` (``"m8"``, ``"momentum"``,
    ``"m4v4"``: calibrated against the reference; ``"round"``, ``"histogram"``: integer and
    counting passes, built is enough)."""
    if _lib is None:
        return False
    if family in ("round", "histogram"):
        return True
    cal = _calibrated()
    return cal.m4v4 if family == "m4v4" else cal.m8


def available() -> bool:
    """True when the fused m8 step is built and verified against its reference on this machine."""
    return trusted("m8")


def _use(cal: Calibration | None) -> Calibration:
    """The calibration a fused call runs under: calibration's candidate ``cal``, else the calibrated one."""
    _lib.gefen_set_threads(torch.get_num_threads())  # the kernels follow torch.set_num_threads
    return _calibrated() if cal is None else cal


_LUT_BUCKETS = 65536


class _Quantiser:
    """fp32 thresholds (padded to 258 with +inf) and the bucket LUT for one codebook.

    ``lut`` is uint16 ``[M + 1]``: per uniform bucket of [-1, 1] the number ``lo`` of thresholds in
    lower buckets, plus 256 when a threshold lies inside the bucket (row M serves NaN); the code of
    x is ``lo + (thr[lo] < x) + (thr[lo + 1] < x)``, exact when no bucket holds more than two
    thresholds.  ``M == 0``: no LUT fits (centres closer than 2/65536), the kernel binary-searches
    the thresholds instead.  65536 buckets (a 128 KiB table, in L2) rather than 16384 (L1): a
    bucket holding a threshold takes a branch the CPU mispredicts, and with 4x fewer of them the
    m8 step is 5-11% faster on gradients that change from step to step (benchmarks/bench_fused.py).
    """

    def __init__(self, codebook: torch.Tensor):
        self.codebook = codebook  # identity + _version is the cache key
        self.version = codebook._version
        self.values = codebook.detach().contiguous().clone()
        thr = code_thresholds(self.values).contiguous()
        self.thr = torch.full((258,), float("inf"), dtype=torch.float32)
        self.thr[: thr.numel()] = thr
        self.M, self.lut = 0, torch.zeros(1, dtype=torch.int16)
        lut = torch.empty(_LUT_BUCKETS + 1, dtype=torch.int16)
        most = _lib.gefen_build_lut(self.thr.data_ptr(), thr.numel(), _LUT_BUCKETS, self.values.numel(), lut.data_ptr())
        if 0 <= most <= 2:
            self.M, self.lut = _LUT_BUCKETS, lut

    @property
    def lo(self) -> torch.Tensor:
        """Thresholds below each bucket (the LUT without its flag bit), int64."""
        return self.lut[: self.M].long() & 0xFF


def _quantiser(codebook: torch.Tensor) -> _Quantiser | None:
    q = _quant_cache.get(id(codebook))
    if q is not None and q.codebook is codebook and q.version == codebook._version:
        return q
    if codebook.dtype != torch.float32 or codebook.device.type != "cpu" or not 2 <= codebook.numel() <= 256:
        return None
    if len(_quant_cache) > 16:
        _quant_cache.clear()
    q = _quant_cache[id(codebook)] = _Quantiser(codebook)
    return q


# ----- phase 1 of both layouts: m4v4_partials' sums (m8's lack the last) -------------------------
def m8_partials(grad: torch.Tensor, state: dict, beta2: float, *, cal: Calibration | None = None):
    """m4v4's phase 1 (the same sums), less its last entry (the old ``v_row``'s sum)."""
    out = m4v4_partials(grad, state, beta2, cal=cal)
    return None if out is None else (out[0], out[1][:-1])


def m4v4_partials(grad: torch.Tensor, state: dict, beta2: float, *, row_sum: torch.Tensor | None = None,
                  row_len: int | None = None, cal: Calibration | None = None):
    """Its float64 sums in an order fixed by the shape: within 1e-12 of the reference's, and the same
    bits on any thread count and ISA."""
    (rows, cols), cal = rows_and_row_numel(grad.shape), _use(cal)
    v_row, partials = torch.empty(rows, dtype=torch.float32), torch.empty(cols + 2, dtype=torch.float64)
    rc = _call(_lib.gefen_m4v4_partials, grad, _DT[grad.dtype], rows, cols, state["v_row"], v_row, partials, beta2,
               1 - beta2, cal.mode, row_sum, max(cols if row_len is None else row_len, 1))
    return (v_row, partials) if rc == 0 else None


def m4v4_row_stats(grad: torch.Tensor, state: dict, codebook: torch.Tensor, beta1: float, *,
                   cal: Calibration | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``gefen.dispatch.m4v4_row_stats``: the max bit for bit, the float64 sums in phase 1's fixed order."""
    codes, scale, cal = state["mv_code"], state["m_row_scale"], _use(cal)
    rows, cols = rows_and_row_numel(grad.shape)
    row_sum, row_max = torch.empty(rows, dtype=torch.float64), torch.empty(rows, dtype=torch.float32)
    rc = _call(_lib.gefen_m4v4_row_stats, grad, _DT[grad.dtype], codes, scale, codebook, beta1, 1 - beta1, rows, cols,
               row_sum, row_max, cal.mode)
    return (row_sum, row_max) if rc == 0 else None


def _arg(value):
    """A kernel argument: a tensor passes its data pointer, None NULL, anything else itself."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _call(fn, *args):
    return fn(*(_arg(value) for value in args))


def _fill(a, fields: dict):
    """A kernel's argument struct ``a`` with ``fields`` set (attribute by attribute: twice as quick
    as ``struct(**fields)``)."""
    for name, value in fields.items():
        setattr(a, name, _arg(value))
    return a


def _run_step(fn, struct, param: torch.Tensor, grad: torch.Tensor, state: dict, h, cal: Calibration,
              **fields) -> bool:
    """Run a fused step: ``GEFEN_ARGS_HEAD`` (tensors, dtypes, the new step count, the mode, the
    step's scalars exactly as the reference forms them: Python floats the C code rounds to fp32
    once, as torch does with a Python scalar operand), then the family's ``fields``. The kernel
    writes the step count when it can reach it (an int64 CPU scalar), else it is written here.
    False when the kernel refused (nothing touched)."""
    step, step_t = int(state["step"]) + 1, state["step"]
    writable = step_t.dtype == torch.int64 and step_t.device.type == "cpu" and step_t.numel() == 1
    a = _fill(struct(), fields)  # the header's fields set directly: this runs for every tensor of every step
    a.param, a.grad, a.step_ptr, a.step = param.data_ptr(), grad.data_ptr(), step_t.data_ptr() if writable else None, step
    a.param_dtype, a.grad_dtype, a.mode = _DT[param.dtype], _DT[grad.dtype], cal.mode
    a.beta1, a.omb1, a.beta2, a.omb2 = h.beta1, 1 - h.beta1, h.beta2, 1 - h.beta2
    a.bias1, a.bias2_sqrt = 1 - h.beta1**step, math.sqrt(1 - h.beta2**step)
    a.eps, a.neg_lr, a.decay, a.has_wd = h.eps, -h.lr, 1 - h.lr * h.weight_decay, bool(h.weight_decay)
    a.inv_bound = F.inverse_step_bound(step, h.beta1, h.beta2)
    if fn(ctypes.byref(a)) != 0:
        return False
    if not writable:
        step_t.fill_(step)
    return True


# ----- the m8 layout: gefen/csrc/gefen_step.c (phase 2, and GefenMuon's momentum alone) ------------
def _momentum_fields(state: dict, grad: torch.Tensor, codebook: torch.Tensor) -> dict | None:
    """What the full m8 step and the momentum alone share: codes, scales, block geometry,
    quantiser; None without a quantiser for ``codebook``."""
    q = _quantiser(codebook)
    if q is None:
        return None
    period = F._local_period(state)  # a column split's one block per (cut) row: the local row
    rows, row_numel = rows_and_row_numel(grad.shape)
    return dict(codes=state["m_code"], scales=state["m_scale"], codebook=q.values, thr=q.thr, lut=q.lut, lut_M=q.M,
                rows=rows, bpr=row_numel // period, period=period, K=q.values.numel())


def m8_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, codebook: torch.Tensor, h, *,
               global_rows: int, v_row: torch.Tensor | None = None, partials: torch.Tensor | None = None,
               cal: Calibration | None = None) -> bool:
    """The m8 step (gefen_step.c) within ``parity.M8_RULE`` of ``functional.m8_update_``."""
    cal = _use(cal)
    fields = _momentum_fields(state, grad, codebook)
    second = (dict(factored=1, v_row=state["v_row"], v_col=state["v_col"], v_row_new=v_row, partials=partials)
              if "v_row" in state else dict(v=state["v"]))
    return fields is not None and _run_step(_lib.gefen_step, _StepArgs, param, grad, state, h, cal, **fields,
                                            **second, global_rows=global_rows)


def momentum_(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor,
              scales: torch.Tensor | None = None) -> torch.Tensor | None:
    """``functional.update_momentum_``'s values (a zero scale's sign aside); ``scales``: as
    ``store_momentum_``'s."""
    return _momentum_only(state, grad, beta, codebook, scales, grad.shape, "m_out")


def momentum_scales(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor) -> torch.Tensor | None:
    """``gefen.dispatch.momentum_scales``'s values, ``[rows, blocks per row]``, state untouched."""
    return _momentum_only(state, grad, beta, codebook, None, tuple(state["m_scale"].shape), "scales_out")


def _momentum_only(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor,
                   scales: torch.Tensor | None, out_shape, out_field: str) -> torch.Tensor | None:
    """The momentum pass alone, its result (the momentum or the scales) into a new fp32 tensor;
    ``omb1``: the lerp weight exactly as update_momentum_ passes it."""
    cal = _use(None)
    fields = _momentum_fields(state, grad, codebook)
    if fields is None:
        return None
    out = torch.empty(out_shape, dtype=torch.float32)
    a = _fill(_StepArgs(), dict(fields, grad=grad, grad_dtype=_DT[grad.dtype], mode=cal.mode, momentum_only=1,
                                global_rows=fields["rows"], omb1=1 - beta, given_scales=scales, **{out_field: out}))
    return out if _lib.gefen_step(ctypes.byref(a)) == 0 else None


# ----- the m4v4 layout: gefen/csrc/m4v4_step.c (phase 2, AdamW); phase 1 is m4v4_partials -------
def m4v4_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, codebook: torch.Tensor,
                 ratio: torch.Tensor, h, *, global_rows: int, v_row: torch.Tensor, partials: torch.Tensor,
                 pidx: int, seed: int, row0: int = 0, col0: int = 0, row_len: int | None = None,
                 row_max: torch.Tensor | None = None, cal: Calibration | None = None) -> bool:
    """Within the bound ``parity.m4v4_disagreement`` checks."""
    rows, cols = rows_and_row_numel(grad.shape)
    salt_m, salt_v = salts(pidx, seed)
    return _run_step(_lib.gefen_m4v4_step, _M4v4Args, param, grad, state, h, _use(cal), codes=state["mv_code"],
                     m_scale=state["m_row_scale"], codebook=codebook, ratios=ratio, v_row=state["v_row"],
                     v_row_new=v_row, v_col=state["v_col"], partials=partials, rows=rows, cols=cols,
                     global_rows=global_rows, global_cols=cols if row_len is None else row_len, row_offset=row0,
                     col_offset=col0, salt_m=salt_m, salt_v=salt_v, row_max=row_max)


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, h, *, pidx: int, seed: int,
                  row0: int = 0, cal: Calibration | None = None) -> bool:
    return _run_step(_lib.gefen_adamw_step, _AdamwArgs, param, grad, state, h, _use(cal), exp_avg=state["exp_avg"],
                     exp_avg_sq=state["exp_avg_sq"], n=param.numel(), row_offset=row0, salt=salts(pidx, seed)[0])


def round_param_(param: torch.Tensor, work: torch.Tensor, *, step: int, salt: int, row0: int = 0,
                 col0: int = 0, row_len: int | None = None) -> bool:
    """Integer arithmetic only: no calibration needed."""
    rows, cols, r0, row_len, c0 = F.param_rows(param, row0=row0, col0=col0, row_len=row_len)
    return _call(_lib.gefen_round_bf16, work, param, rows, cols, r0, row_len, c0, hash_base(step, salt)) == 0


# ----- the first step: the codebook histogram ---------------------------
def block_histograms(pairs: list, num_bins: int, *, isa: int = _ISA, flush: int = 1 << 31) -> torch.Tensor | None:
    """``codebook.histogram_normalised_blocks``'s counts, summed over ``(blocks, scale)`` pairs
    (``[..., P]`` blocks; scale None or one fp32 per block), in one C call. ``isa``: the widest
    kernels allowed (every ISA counts the same); ``flush``: elements a thread counts in uint32 before
    adding them to int64 (tests lower it)."""
    scales = [None if s is None else s.float().contiguous() for _, s in pairs]  # kept alive for the call
    n = len(pairs)
    ptr_array = ctypes.c_void_p * n
    _lib.gefen_set_threads(torch.get_num_threads())
    counts = torch.zeros(num_bins, dtype=torch.int64)
    rc = _lib.gefen_block_histograms(
        n, ptr_array(*(b.data_ptr() for b, _ in pairs)), (_I32 * n)(*(_DT[b.dtype] for b, _ in pairs)),
        (_I64 * n)(*(b.numel() // b.shape[-1] for b, _ in pairs)), (_I64 * n)(*(b.shape[-1] for b, _ in pairs)),
        ptr_array(*(None if s is None else s.data_ptr() for s in scales)), num_bins, counts.data_ptr(), isa, flush)
    return counts if rc == 0 else None


# ----- calibration: the kernels checked against their references ------------------------------
def _kernel_fns(cal: Calibration):
    """The kernels under the candidate ``cal``, for ``gefen.parity``'s problems."""
    fns = dict(m8_partials=m8_partials, m8_update=m8_update_, m4v4_partials=m4v4_partials,
               m4v4_update=m4v4_update_, adamw=adamw_update_, row_stats=m4v4_row_stats)
    return parity.kernel_fns(**{name: functools.partial(fn, cal=cal) for name, fn in fns.items()})


_CPU = torch.device("cpu")
#: m8 problems: the factored and per-block forms, P = 1 and 0-D, blocks of one and of several rows,
#: both lerp formulas (beta1 by the period's parity), a split over threads: (shape, period,
#: factored); in lockstep (a kernel step from the reference's state), fresh and after one step.
_M8 = [(parity.run_m8, (shape, period, factored, torch.float32, _CPU, steps))
       for steps in [(0, 1), (1, 1)] for shape, period, factored in [
           ((37, 33), 11, True), ((260, 130), 130, True), ((45, 29), 29, True), ((3, 5, 8), 40, False),
           ((6, 24, 25), 600, False), ((5000,), 1, False), ((), 1, False), ((12, 6), 2, False),
           ((70, 480), 240, False), ((4400, 8), 8, True)]]
#: m4v4 problems: float64 row sums (vectorised, short, single-row two-pass), one-pass phase 1 with a
#: partial chunk, bf16, the 1-D/0-D step, and a column shard given its rows' statistics: (shape, dtype).
_M4V4 = [(parity.run_m4v4, (shape, dtype, _CPU, (0, 1 if math.prod(shape) >= 32768 else 2))) for shape, dtype in [
    ((37, 33), torch.float32), ((300, 130), torch.float32), ((1, 33000), torch.float32),
    ((45, 29), torch.bfloat16), ((3, 5, 8), torch.float32), ((5000,), torch.float32), ((), torch.bfloat16)]] + [
    (parity.run_m4v4_cut, ((37, 45), torch.bfloat16, _CPU))]
_ADAMW = [problem for problem in _M4V4 if problem[0] is parity.run_m4v4 and len(problem[1][0]) < 2]


def calibrate() -> Calibration:
    """The square root under which the 1-D AdamW step reproduces the eager one bit for bit (MKL's
    when torch exports it and that holds, else IEEE's), and whether the m8 and m4v4 kernels then
    keep their bounds of their references (``parity.M8_RULE``, ``parity.within_m4v4_bound``)."""
    if _lib is None:
        return Calibration(False, False, False)
    with torch.no_grad():
        vml = bool(_torch_vml_sqrt()) and parity.check(
            _ADAMW, _kernel_fns(Calibration(False, True, False)), parity.identical) is None
        cal = Calibration(False, vml, False)
        m8 = parity.check(_M8, _kernel_fns(cal), parity.M8_RULE) is None
        m4v4 = parity.check(_M4V4, _kernel_fns(cal), parity.within_m4v4_bound) is None
    _warn_mismatch(m8, m4v4)
    return dataclasses.replace(cal, m8=m8, m4v4=m4v4)


def _warn_mismatch(m8: bool, m4v4: bool) -> None:
    what = " and ".join(name for name, ok in (("m8", m8), ("m4v4", m4v4)) if not ok)
    if what:
        warnings.warn(f"gefen._gefen_step's {what} kernels are outside their bound of the eager Gefen step on "
                      f"this machine (torch {torch.__version__}, CPU capability "
                      f"{torch.backends.cpu.get_cpu_capability()}); using the eager step", RuntimeWarning, stacklevel=3)


# ----- the calibration cache: a fresh process skips the calibration (docs/decisions.md) --------
def _cpu_identity() -> str:
    """The CPU model and its feature flags (what decides torch's kernels and ours)."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [line for line in fh.read().split("\n\n")[0].splitlines()
                     if line.split(":")[0].strip() in ("vendor_id", "model name", "flags", "Features", "CPU part")]
        if lines:
            return "\n".join(lines)
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_key() -> str:
    """What a calibration result depends on: our library's bytes (the build), the CPU, torch's
    version and CPU capability (its kernels) and the MKL square root it exports."""
    digest = hashlib.sha256()
    with open(_lib_path, "rb") as fh:
        digest.update(fh.read())
    for part in (str(_ABI), torch.__version__, torch.backends.cpu.get_cpu_capability(), _cpu_identity(),
                 str(_torch_vml_sqrt() is not None)):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:32]


_CACHED = ("m8", "vml", "m4v4")  # the Calibration fields a cache entry holds


def _cached(path: str) -> Calibration | None:
    """The calibration cached at ``path``; None when it is missing, unreadable, corrupt or cannot apply."""
    try:
        with open(path) as fh:
            entry = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict):
        return None
    m8, vml, m4v4 = (entry.get(k) for k in _CACHED)
    if not all(isinstance(x, bool) for x in (m8, vml, m4v4)) or (vml and not _torch_vml_sqrt()):
        return None
    _warn_mismatch(m8, m4v4)
    return Calibration(m8, vml, m4v4)


def calibrate_cached() -> Calibration:
    """``calibrate()``, or its result from an earlier process with the same library build, CPU and
    torch, in ``$GEFEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/gefen``, else ``~/.cache/gefen``. An
    unreadable, corrupt or unwritable cache only costs the calibration."""
    if _lib is None:
        return calibrate()
    cache = os.environ.get("GEFEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gefen")
    try:
        path = os.path.join(cache, f"native-calibration-{cache_key()}.json")
    except OSError:  # the library file vanished: calibrate, cache nothing
        path = None
    cal = _cached(path) if path else None
    if cal is None:
        cal = calibrate()
        if path:
            _write_entry(path, {**{k: getattr(cal, k) for k in _CACHED}, "torch": torch.__version__})
    return cal


def _write_entry(path: str, entry: dict) -> None:
    """Write to a temporary file and rename: concurrent processes each publish a whole entry (the
    last rename wins) and a reader never sees half of one."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".calibration-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(entry, fh)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
