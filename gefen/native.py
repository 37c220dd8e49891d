"""The fused CPU Gefen step: a ctypes binding to ``gefen/csrc/gefen_step.c`` (``gefen._gefen_step``).

``fused_partials`` and ``fused_update_`` take the arguments of ``gefen.functional``'s
``second_moment_partials`` and ``gefen_update_`` and produce bit-identical results (codes, scales,
second moments and parameters) in one C call per parameter; they return ``None`` / ``False``
when they do not apply (not CPU, not contiguous, dtype other than fp32/bf16, library missing or
disabled), and the caller then runs the eager reference.  Nothing is modified in that case.

The C code reproduces the rounding order of the eager torch ops, including ATen's cascade
summation, whose vector width depends on torch's CPU capability.  At first use the kernels, at each
candidate width (their ``width`` argument), and the pure reference are run side by side on a few
small problems (``calibrate``; no module state is swapped); on any mismatch the native path stays
off and a warning says so.  The result is cached per library build, CPU and torch in the user's cache
directory (``calibrate_cached``; ``$GEFEN_CACHE_DIR`` overrides it), so a fresh process does not
pay the calibration again.  ``GEFEN_DISABLE_NATIVE=1`` (read at import) or ``native.enabled = False``
forces the eager path; both paths compute the same numbers, so this only changes speed.

``fused_m4v4_partials``, ``fused_m4v4_update_`` and ``fused_adamw_update_`` do the same for the
default m4v4 layout (``m4v4_partials``, ``m4v4_update_`` and the 1-D ``adamw_update_`` of
``gefen.functional``; C in ``gefen/csrc/m4v4_step.c`` and ``gefen_step.c``). After its float64
sums every m4v4 value is a chain of single fp32 operations, so parity needs no emulation beyond
the sums and the square root; the calibration also runs a few m4v4 problems and turns off only
the m4v4 kernels if they disagree.

``block_histogram`` is the first step's one-time pass (``gefen/csrc/first_step.c``): the same
histogram counts as ``gefen.codebook``.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import math
import os
import platform
import tempfile
import warnings

import torch

from gefen import functional as F
from gefen.codebook import code_thresholds
from gefen.geometry import rows_and_row_numel
from gefen.quant import quantise
from gefen.stochastic import ratio_table, salts

__all__ = ["available", "enabled", "fused_partials", "fused_update_", "fused_momentum_", "calibrate",
           "block_histogram", "fused_m4v4_partials", "fused_m4v4_update_", "fused_adamw_update_"]

#: Module switch (tests and benchmarks); the environment variable sets its initial value.
enabled: bool = os.environ.get("GEFEN_DISABLE_NATIVE", "").strip() in ("", "0")

_ABI = 12
_lib_path: str | None = None
_DT = {torch.float32: 0, torch.bfloat16: 1}
_P = ctypes.c_void_p


class _StepArgs(ctypes.Structure):
    """Mirror of ``gefen_step_args`` in gefen_step.c (field order and types must match)."""

    _fields_ = [
        ("param", _P), ("grad", _P), ("codes", _P), ("scales", _P), ("v", _P), ("v_row_new", _P),
        ("v_row", _P), ("v_col", _P), ("partials", _P), ("step_ptr", _P), ("codebook", _P),
        ("thr", _P), ("lut", _P),
        ("rows", ctypes.c_int64), ("bpr", ctypes.c_int64), ("period", ctypes.c_int64),
        ("global_rows", ctypes.c_int64), ("step", ctypes.c_int64),
        ("omb1", ctypes.c_double), ("beta2", ctypes.c_double), ("omb2", ctypes.c_double),
        ("bias1", ctypes.c_double), ("bias2_sqrt", ctypes.c_double), ("eps", ctypes.c_double),
        ("neg_lr", ctypes.c_double), ("decay", ctypes.c_double),
        ("param_dtype", ctypes.c_int32), ("grad_dtype", ctypes.c_int32), ("K", ctypes.c_int32),
        ("lut_M", ctypes.c_int32), ("W", ctypes.c_int32), ("T", ctypes.c_int32),
        ("has_wd", ctypes.c_int32), ("factored", ctypes.c_int32),
        ("scale_mode", ctypes.c_int32), ("momentum_only", ctypes.c_int32), ("m_out", _P),
    ]


class _M4v4Args(ctypes.Structure):
    """Mirror of ``m4v4_args`` in m4v4_step.c (field order and types must match)."""

    _fields_ = [
        ("param", _P), ("grad", _P), ("codes", _P), ("m_scale", _P), ("v_row", _P), ("v_row_new", _P),
        ("v_col", _P), ("partials", _P), ("step_ptr", _P), ("codebook", _P), ("ratios", _P),
        ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("global_rows", ctypes.c_int64),
        ("global_cols", ctypes.c_int64), ("row_offset", ctypes.c_int64), ("col_offset", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("beta1", ctypes.c_double), ("omb1", ctypes.c_double), ("beta2", ctypes.c_double), ("omb2", ctypes.c_double),
        ("bias1", ctypes.c_double), ("bias2_sqrt", ctypes.c_double), ("eps", ctypes.c_double),
        ("neg_lr", ctypes.c_double), ("decay", ctypes.c_double),
        ("salt_m", ctypes.c_uint32), ("salt_v", ctypes.c_uint32),
        ("param_dtype", ctypes.c_int32), ("grad_dtype", ctypes.c_int32), ("has_wd", ctypes.c_int32),
    ]


class _AdamwArgs(ctypes.Structure):
    """Mirror of ``adamw_args`` in m4v4_step.c."""

    _fields_ = [
        ("param", _P), ("grad", _P), ("exp_avg", _P), ("exp_avg_sq", _P), ("step_ptr", _P),
        ("n", ctypes.c_int64), ("row_offset", ctypes.c_int64), ("step", ctypes.c_int64),
        ("beta1", ctypes.c_double), ("omb1", ctypes.c_double), ("beta2", ctypes.c_double), ("omb2", ctypes.c_double),
        ("bias1", ctypes.c_double), ("bias2_sqrt", ctypes.c_double), ("eps", ctypes.c_double),
        ("neg_lr", ctypes.c_double), ("decay", ctypes.c_double), ("salt", ctypes.c_uint32),
        ("param_dtype", ctypes.c_int32), ("grad_dtype", ctypes.c_int32), ("has_wd", ctypes.c_int32),
    ]


def _load():
    """The C library, or None (plain source tree, failed build, foreign ABI)."""
    global _lib_path
    try:
        spec = importlib.util.find_spec("gefen._gefen_step")
    except ImportError:
        return None
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        _lib_path = spec.origin
        if lib.gefen_native_abi() != _ABI:
            return None
    except (OSError, AttributeError):
        return None
    i32, i64, dbl = ctypes.c_int32, ctypes.c_int64, ctypes.c_double
    lib.gefen_partials.argtypes = [_P, i32, i64, i64, _P, _P, _P, dbl, dbl, i32, i32]
    lib.gefen_partials.restype = ctypes.c_int
    lib.gefen_build_lut.argtypes = [_P, i32, i32, i32, _P]
    lib.gefen_build_lut.restype = ctypes.c_int
    lib.gefen_step.argtypes = [ctypes.POINTER(_StepArgs)]
    lib.gefen_step.restype = ctypes.c_int
    lib.gefen_m4v4_partials.argtypes = [_P, i32, i64, i64, i64, _P, _P, _P, dbl, dbl, i32, i32]
    lib.gefen_m4v4_partials.restype = ctypes.c_int
    lib.gefen_m4v4_step.argtypes = [ctypes.POINTER(_M4v4Args)]
    lib.gefen_m4v4_step.restype = ctypes.c_int
    lib.gefen_adamw_step.argtypes = [ctypes.POINTER(_AdamwArgs)]
    lib.gefen_adamw_step.restype = ctypes.c_int
    lib.gefen_m4v4_isa.argtypes = [ctypes.c_int]
    lib.gefen_m4v4_isa.restype = ctypes.c_int
    lib.gefen_block_histogram.argtypes = [_P, i32, i64, i64, i64, _P]
    lib.gefen_block_histogram.restype = ctypes.c_int
    lib.gefen_force_portable.argtypes = [ctypes.c_int]
    lib.gefen_set_sqrt.argtypes = [_P, _P]
    return lib


def _torch_vml_sqrt() -> tuple[int, int | None] | None:
    """Addresses of MKL's ``vmsSqrt``, which torch.sqrt calls on CPU when torch is built with MKL,
    and of ``MKL_Set_Num_Threads_Local`` (C ABI; both exported by libtorch_cpu); None otherwise (torch
    then uses an IEEE sqrt)."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn, local = (getattr(lib, sym, None) for sym in ("vmsSqrt", "MKL_Set_Num_Threads_Local"))
        if fn is not None:
            return (ctypes.cast(fn, ctypes.c_void_p).value,
                    ctypes.cast(local, ctypes.c_void_p).value if local is not None else None)
    return None


_lib = _load()
_width: int | None = None  # torch's Vectorized<float>::size() as found by calibrate(); 0 = failed
_sqrt_is_vml = False  # whether calibrate() settled on MKL's square root
_m4v4_ok = False  # whether the m4v4 kernels reproduced the m4v4 reference at that width (calibrate)
_scale_mode = 0  # how gefen.quant signs the scale of an all-zero block (see _probe_scale_mode)
_quant_cache: dict = {}


def available() -> bool:
    """True when the fused path is built, enabled and verified against torch on this machine."""
    return _lib is not None and enabled and _vector_width() > 0


def _vector_width() -> int:
    global _width
    if _width is None:
        _width = 0
        _width = calibrate_cached()
    return _width


class _Quantiser:
    """fp32 thresholds (padded to 258 with +inf) and the bucket LUT for one codebook.

    ``lut`` is uint16 ``[M + 1]``: per uniform bucket of [-1, 1] the number ``lo`` of thresholds in
    lower buckets, plus 256 when a threshold lies inside the bucket (row M serves NaN); the code of
    x is ``lo + (thr[lo] < x) + (thr[lo + 1] < x)``, exact when no bucket holds more than two
    thresholds.  ``M == 0``: no LUT fits (centres closer than 2/65536), the kernel binary-searches
    the thresholds instead.
    """

    def __init__(self, codebook: torch.Tensor):
        self.codebook = codebook  # identity + _version is the cache key
        self.version = codebook._version
        self.values = codebook.detach().contiguous().clone()
        thr = code_thresholds(self.values).contiguous()
        self.thr = torch.full((258,), float("inf"), dtype=torch.float32)
        self.thr[: thr.numel()] = thr
        self.M, self.lut = 0, torch.zeros(1, dtype=torch.int16)
        for M in (16384, 65536):
            lut = torch.empty(M + 1, dtype=torch.int16)
            most = _lib.gefen_build_lut(self.thr.data_ptr(), thr.numel(), M, self.values.numel(), lut.data_ptr())
            if 0 <= most <= 2:
                self.M, self.lut = M, lut
                break

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


def _cpu_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def fused_partials(grad: torch.Tensor, state: dict, beta2: float, *, width: int = 0):
    """``second_moment_partials`` in one C call, or None when the fused path does not apply.
    ``width``: calibration's vector width to try (then ``enabled`` is not consulted); 0: the calibrated one."""
    gdt = _DT.get(grad.dtype)
    v_row_old = state["v_row"]
    if (gdt is None or grad.dim() != 2 or not (width or enabled) or _lib is None or v_row_old.dtype != torch.float32
            or not _cpu_contiguous(grad, v_row_old) or v_row_old.shape != grad.shape[:1] or grad.shape[1] < 1):
        return None
    W = width or _vector_width()
    if not W:
        return None
    rows, cols = grad.shape
    v_row = torch.empty(rows, dtype=torch.float32)
    partials = torch.empty(cols + 1, dtype=torch.float64)
    rc = _lib.gefen_partials(grad.data_ptr(), gdt, rows, cols, v_row_old.data_ptr(), v_row.data_ptr(),
                             partials.data_ptr(), beta2, 1 - beta2, W, torch.get_num_threads())
    return (v_row, partials) if rc == 0 else None


def fused_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, codebook: torch.Tensor, h, *,
                  global_rows: int, v_row: torch.Tensor | None = None, partials: torch.Tensor | None = None,
                  width: int = 0) -> bool:
    """``gefen_update_`` in one C call; returns False (touching nothing) when it does not apply
    (``width``: as for ``fused_partials``)."""
    pdt, gdt = _DT.get(param.dtype), _DT.get(grad.dtype)
    if pdt is None or gdt is None or not (width or enabled) or _lib is None or param.shape != grad.shape:
        return False
    codes, scales = state["m_code"], state["m_scale"]
    factored = "v_row" in state
    if factored:
        if v_row is None or partials is None or partials.dtype != torch.float64 or v_row.dtype != torch.float32:
            return False
        extra = (state["v_row"], state["v_col"], v_row, partials)
    else:
        extra = (state["v"],)
    if not _cpu_contiguous(param, grad, codes, scales, *extra) or codes.dtype != torch.uint8:
        return False
    if any(t.dtype != torch.float32 for t in (scales, *extra[:2])):
        return False
    a = _momentum_args(state, grad, gdt, codebook, width)
    if a is None:
        return False
    rows, row_numel = a.rows, a.bpr * a.period
    if factored and (partials.numel() != row_numel + 1 or v_row.numel() != rows or state["v_col"].numel() != row_numel):
        return False
    step_t = state["step"]
    step = int(step_t) + 1
    a.param = param.data_ptr()
    if factored:
        a.v_row, a.v_col, a.v_row_new, a.partials = (t.data_ptr() for t in extra)
    else:
        a.v = extra[0].data_ptr()
    a.step_ptr = _step_pointer(step_t)
    a.global_rows, a.step = global_rows, step
    # scalars exactly as gefen_update_ forms them (Python floats, cast to fp32 in C like torch does)
    a.omb1, a.beta2, a.omb2 = 1 - h.beta1, h.beta2, 1 - h.beta2
    a.bias1, a.bias2_sqrt = 1 - h.beta1**step, math.sqrt(1 - h.beta2**step)
    a.eps, a.neg_lr, a.decay, a.has_wd = h.eps, -h.lr, 1 - h.lr * h.weight_decay, bool(h.weight_decay)
    a.param_dtype, a.factored = pdt, factored
    if _lib.gefen_step(ctypes.byref(a)) != 0:
        return False
    if a.step_ptr is None:
        step_t.fill_(step)
    return True


def _step_pointer(step_t: torch.Tensor) -> int | None:
    """Where the kernel may write the new step count (an int64 CPU scalar), else None: the caller
    fills it after the call."""
    ok = step_t.dtype == torch.int64 and step_t.device.type == "cpu" and step_t.numel() == 1
    return step_t.data_ptr() if ok else None


def fused_momentum_(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor) -> torch.Tensor | None:
    """``functional.update_momentum_`` in one C call (same codes, scales and returned fp32
    momentum, bit for bit), or None when it does not apply (nothing modified then)."""
    gdt = _DT.get(grad.dtype)
    codes, scales = state["m_code"], state["m_scale"]
    if gdt is None or not enabled or _lib is None or codes.dtype != torch.uint8 or scales.dtype != torch.float32:
        return None
    if not _cpu_contiguous(grad, codes, scales) or codes.shape != grad.shape:
        return None
    a = _momentum_args(state, grad, gdt, codebook, 0)
    if a is None:
        return None
    out = torch.empty(grad.shape, dtype=torch.float32)
    a.m_out, a.momentum_only, a.global_rows = out.data_ptr(), 1, a.rows
    a.omb1 = 1 - beta  # the lerp weight exactly as update_momentum_ passes it
    return out if _lib.gefen_step(ctypes.byref(a)) == 0 else None


def _momentum_args(state: dict, grad: torch.Tensor, gdt: int, codebook: torch.Tensor,
                   width: int) -> _StepArgs | None:
    """Kernel arguments shared by the full step and the momentum alone: gradient, codes, scales,
    block geometry, quantiser, threads, vector width; None when the fused path does not apply."""
    W = width or _vector_width()
    q = _quantiser(codebook) if W else None
    if q is None:
        return None
    codes, scales = state["m_code"], state["m_scale"]
    period = int(state["period"])
    rows, row_numel = rows_and_row_numel(grad.shape)
    if period < 1 or row_numel % period or scales.numel() != rows * (row_numel // period):
        return None
    a = _StepArgs()
    a.grad, a.codes, a.scales = grad.data_ptr(), codes.data_ptr(), scales.data_ptr()
    a.codebook, a.thr, a.lut, a.lut_M = q.values.data_ptr(), q.thr.data_ptr(), q.lut.data_ptr(), q.M
    a.rows, a.bpr, a.period = rows, row_numel // period, period
    a.grad_dtype, a.K, a.W, a.T = gdt, q.values.numel(), W, torch.get_num_threads()
    a.scale_mode = _scale_mode
    return a


# ----- the m4v4 layout: gefen/csrc/m4v4_step.c (phase 2, AdamW), gefen_m4v4_partials (phase 1) -----
def _m4v4_width(width: int) -> int:
    """The vector width the m4v4 kernels run at: calibration's ``width``, else the calibrated one
    when they are built, enabled and checked against the m4v4 reference here (``calibrate``); 0: off."""
    if _lib is None:
        return 0
    return width or (_width if enabled and _vector_width() > 0 and _m4v4_ok else 0)


def fused_m4v4_partials(grad: torch.Tensor, state: dict, beta2: float, *, width: int = 0):
    """``functional.m4v4_partials`` (same ``(v_row, partials)``, bit for bit) in one C call, or
    None when it does not apply (``width``: as for ``fused_partials``)."""
    gdt = _DT.get(grad.dtype)
    v_row_old = state.get("v_row")
    if gdt is None or grad.dim() < 2 or v_row_old is None or not (W := _m4v4_width(width)):
        return None
    rows, cols = rows_and_row_numel(grad.shape)
    if (cols < 1 or v_row_old.dtype != torch.float32 or v_row_old.shape != (rows,)
            or not _cpu_contiguous(grad, v_row_old)):
        return None
    v_row = torch.empty(rows, dtype=torch.float32)
    partials = torch.empty(cols + 2, dtype=torch.float64)
    rc = _lib.gefen_m4v4_partials(grad.data_ptr(), gdt, rows, cols, cols, v_row_old.data_ptr(), v_row.data_ptr(),
                                  partials.data_ptr(), beta2, 1 - beta2, W, torch.get_num_threads())
    return (v_row, partials) if rc == 0 else None


_M4V4_DTYPES = {"mv_code": torch.uint8, "m_row_scale": torch.bfloat16, "v_row": torch.float32, "v_col": torch.float32}


def fused_m4v4_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, codebook: torch.Tensor,
                       ratio: torch.Tensor, h, *, global_rows: int, v_row: torch.Tensor, partials: torch.Tensor,
                       pidx: int, seed: int, row0: int = 0, col0: int = 0, row_len: int | None = None,
                       width: int = 0) -> bool:
    """``functional.m4v4_update_`` in one C call; returns False (touching nothing) when it does
    not apply (then the caller runs the reference; ``width``: as for ``fused_partials``)."""
    pdt, gdt = _DT.get(param.dtype), _DT.get(grad.dtype)
    if pdt is None or gdt is None or param.shape != grad.shape or grad.dim() < 2 or not _m4v4_width(width):
        return False
    rows, cols = rows_and_row_numel(grad.shape)
    fields = [state.get(k) for k in _M4V4_DTYPES]
    if cols < 1 or any(t is None or t.dtype != dt for t, dt in zip(fields, _M4V4_DTYPES.values())):
        return False
    codes, scale, v_row_old, v_col = fields
    tables = (codebook, ratio)
    if (v_row.dtype != torch.float32 or partials.dtype != torch.float64
            or any(t.dtype != torch.float32 or t.numel() != 16 for t in tables)
            or not _cpu_contiguous(param, grad, *fields, v_row, partials, *tables)):
        return False
    if (codes.numel() != rows * cols or scale.numel() != rows or v_row_old.numel() != rows or v_row.numel() != rows
            or v_col.numel() != cols or partials.numel() != cols + 2):
        return False
    step_t = state["step"]
    step = int(step_t) + 1
    a = _M4v4Args()
    a.param, a.grad, a.codes, a.m_scale = param.data_ptr(), grad.data_ptr(), codes.data_ptr(), scale.data_ptr()
    a.v_row, a.v_row_new, a.v_col, a.partials = v_row_old.data_ptr(), v_row.data_ptr(), v_col.data_ptr(), partials.data_ptr()
    a.step_ptr = _step_pointer(step_t)
    a.codebook, a.ratios = codebook.data_ptr(), ratio.data_ptr()
    a.rows, a.cols, a.global_rows, a.global_cols = rows, cols, global_rows, cols if row_len is None else row_len
    a.row_offset, a.col_offset, a.step = row0, col0, step
    a.salt_m, a.salt_v = salts(pidx, seed)
    _set_scalars(a, h, step)
    a.param_dtype, a.grad_dtype = pdt, gdt
    return _run_step(_lib.gefen_m4v4_step, a, step_t, step)


def fused_adamw_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, h, *, pidx: int, seed: int,
                        row0: int = 0, width: int = 0) -> bool:
    """``functional.adamw_update_`` (m4v4's 1-D/0-D step) in one C call; False (touching
    nothing) when it does not apply (``width``: as for ``fused_partials``)."""
    pdt, gdt = _DT.get(param.dtype), _DT.get(grad.dtype)
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if pdt is None or gdt is None or m is None or v is None or not _m4v4_width(width):
        return False
    if (param.shape != grad.shape or m.shape != param.shape or v.shape != param.shape
            or m.dtype != torch.bfloat16 or v.dtype != torch.float32 or not _cpu_contiguous(param, grad, m, v)):
        return False
    step_t = state["step"]
    step = int(step_t) + 1
    a = _AdamwArgs()
    a.param, a.grad, a.exp_avg, a.exp_avg_sq = param.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr()
    a.step_ptr = _step_pointer(step_t)
    a.n, a.row_offset, a.step = param.numel(), row0, step
    a.salt = salts(pidx, seed)[0]
    _set_scalars(a, h, step)
    a.param_dtype, a.grad_dtype = pdt, gdt
    return _run_step(_lib.gefen_adamw_step, a, step_t, step)


def _run_step(fn, a, step_t: torch.Tensor, step: int) -> bool:
    """Run a fused m4v4 / 1-D step; the kernel writes the step count itself when it can reach
    it (``a.step_ptr``), else it is written here. False when the kernel refused (nothing touched)."""
    if fn(ctypes.byref(a)) != 0:
        return False
    if a.step_ptr is None:
        step_t.fill_(step)
    return True


def _set_scalars(a, h, step: int) -> None:
    """The step's scalars exactly as the reference forms them (Python floats; the C code rounds
    each to fp32 once, as torch does with a Python scalar operand)."""
    a.beta1, a.omb1, a.beta2, a.omb2 = h.beta1, 1 - h.beta1, h.beta2, 1 - h.beta2
    a.bias1, a.bias2_sqrt = 1 - h.beta1**step, math.sqrt(1 - h.beta2**step)
    a.eps, a.neg_lr, a.decay, a.has_wd = h.eps, -h.lr, 1 - h.lr * h.weight_decay, bool(h.weight_decay)


# ----- the first step: the codebook histogram ---------------------------
def _first_step_input(x: torch.Tensor) -> int | None:
    """The C dtype code of ``x`` when the first-step kernels can read it in place, else None."""
    dt = _DT.get(x.dtype)
    if dt is None or not enabled or _lib is None or not _cpu_contiguous(x):
        return None
    return dt


def block_histogram(blocks: torch.Tensor, num_bins: int) -> torch.Tensor | None:
    """``codebook.histogram_normalised_blocks`` (identical counts) in one C pass, or None when
    it does not apply."""
    dt = _first_step_input(blocks)
    if dt is None or blocks.dim() < 1 or blocks.shape[-1] < 1 or num_bins < 1:
        return None
    counts = torch.zeros(num_bins, dtype=torch.int64)
    P = blocks.shape[-1]
    rc = _lib.gefen_block_histogram(blocks.data_ptr(), dt, blocks.numel() // P, P, num_bins, counts.data_ptr())
    return counts if rc == 0 else None


# ----- calibration: the C emulation of torch's rounding order, checked against torch ------------
def _problems():
    """Small (shape, period, factored) cases that reach every summation path of the kernel
    (vectorised and short rows, A/B column orders, two-pass single outputs, P = 1)."""
    return [
        ((37, 33), 11, True), ((260, 130), 130, True), ((1, 33000), 33000, True), ((33000, 1), 1, True),
        ((45, 29), 29, True), ((3, 5, 8), 40, False), ((6, 24, 25), 600, False), ((1, 33000), 33000, False),
        ((5000,), 1, False), ((), 1, False), ((12, 6), 2, False), ((70, 480), 240, False), ((4400, 8), 8, True),
    ]


def _run_problem(shape, period, factored, W: int):
    """Two m8 steps of one problem (one for the big ones) through the reference (``W == 0``) or the
    C kernels at vector width ``W`` (None: a kernel refused)."""
    gen = torch.Generator().manual_seed(1234 + len(shape) + period)
    p = torch.randn(shape, generator=gen)
    state = F.init_state(p, tuple(shape), period, factored)
    codebook = torch.cat([torch.tensor([-1.0]), torch.sort(torch.rand(62, generator=gen) * 2 - 1).values,
                          torch.tensor([1.0])])
    # beta1 <= 0.5 takes ATen's other lerp formula (|weight| >= 0.5): check both
    h = F.Hyper(lr=1e-2, beta1=0.9 if period % 2 else 0.4, beta2=0.99, eps=1e-8, weight_decay=0.05)
    rows = shape[0] if shape else 1
    for _ in range(1 if p.numel() >= 32768 else 2):  # big ones only test the parallel split rules
        g = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen)
        if len(shape) == 2 and shape[0] > 2:
            g[1] = 0  # all-zero blocks: zero scales (and their sign)
        v_row = partials = None
        if factored:
            out = fused_partials(g, state, h.beta2, width=W) if W else None
            v_row, partials = out if out is not None else F.second_moment_partials(g, state, h.beta2)
        kw = dict(global_rows=rows, v_row=v_row, partials=partials)
        if not W:
            F.gefen_update_(p, g, state, codebook, h, **kw)
        elif not fused_update_(p, g, state, codebook, h, width=W, **kw):
            return None
    return p, state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (fp32/bf16 compared as integers, so -0.0 != +0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float32, torch.bfloat16):
        ints = torch.int32 if a.dtype == torch.float32 else torch.int16
        a, b = a.view(ints), b.view(ints)
    return torch.equal(a, b)


def _same_run(got, ref) -> bool:
    """Whether a kernel run's ``(param, state)`` (None: refused) is the reference's, bit for bit."""
    return got is not None and _same(got[0], ref[0]) and all(_same(got[1][k], ref[1][k]) for k in ref[1])


def _probe_scale_mode() -> int:
    """0 when gefen.quant's all-zero blocks get torch.maximum(+0, -0)'s sign (-0 in the vectorised
    part), 1 when they get +0 (a max of |m|)."""
    scales = quantise(torch.zeros(1, 40 * 8), torch.linspace(-1.0, 1.0, 16), 8)[1]
    return 0 if torch.signbit(scales).any() else 1


def calibrate() -> int:
    """torch's float vector width that makes the C step reproduce the eager step bit for bit on
    ``_problems()`` with the current thread count, or 0 (native path off) when none does."""
    global _scale_mode, _sqrt_is_vml, _m4v4_ok
    if _lib is None:
        return 0
    _scale_mode = _probe_scale_mode()
    capability = torch.backends.cpu.get_cpu_capability()
    widths = (16, 8) if "512" in capability else (8, 16)
    vml = _torch_vml_sqrt()
    with torch.no_grad():
        reference = [_run_problem(*case, W=0) for case in _problems()]
        for sqrt_fns in ([vml] if vml else []) + [(None, None)]:
            _lib.gefen_set_sqrt(*sqrt_fns)
            for W in widths:
                if all(_same_run(_run_problem(*case, W=W), ref) for case, ref in zip(_problems(), reference)):
                    _sqrt_is_vml = sqrt_fns is vml
                    _m4v4_ok = _m4v4_matches(W)
                    if not _m4v4_ok:
                        _warn_mismatch("m4v4 ")
                    return W
    _warn_mismatch()
    return 0


def _m4v4_problems():
    """(shape, dtype) cases for the m4v4 kernels: float64 row sums (vectorised, short, single-row
    two-pass), one-pass phase 1 with a partial chunk, bf16, and the 1-D/0-D step."""
    return [((37, 33), torch.float32), ((300, 130), torch.float32), ((1, 33000), torch.float32),
            ((45, 29), torch.bfloat16), ((3, 5, 8), torch.float32), ((5000,), torch.float32), ((), torch.bfloat16)]


def _run_m4v4(shape, dtype, W: int):
    """Two m4v4 steps of one tensor (one for the big ones, which only test the summation paths)
    through the reference (``W == 0``) or the kernels at vector width ``W`` (None: a kernel refused)."""
    gen = torch.Generator().manual_seed(4321 + len(shape))
    p = torch.randn(shape, generator=gen).to(dtype)
    state = F.init_m4v4_state(p, tuple(shape))
    codebook = torch.sort(torch.rand(16, generator=gen) * 2 - 1).values
    ratio = ratio_table(torch.sort(torch.rand(16, generator=gen) * 2 - 1).values)
    h = F.Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
    for _ in range(1 if p.numel() >= 32768 else 2):
        g = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen)).to(dtype)
        if len(shape) < 2:
            if not W:
                F.adamw_update_(p, g, state, h, pidx=3, seed=1, row0=5)
            elif not fused_adamw_update_(p, g, state, h, pidx=3, seed=1, row0=5, width=W):
                return None
            continue
        out = fused_m4v4_partials(g, state, h.beta2, width=W) if W else F.m4v4_partials(g, state, h.beta2)
        if out is None:
            return None
        kw = dict(global_rows=shape[0], v_row=out[0], partials=out[1], pidx=3, seed=1, row0=5)
        if not W:
            F.m4v4_update_(p, g, state, codebook, ratio, h, **kw)
        elif not fused_m4v4_update_(p, g, state, codebook, ratio, h, width=W, **kw):
            return None
    return p, state


def _m4v4_matches(W: int) -> bool:
    """Whether the m4v4 kernels reproduce the m4v4 reference at torch vector width W."""
    return all(_same_run(_run_m4v4(*case, W=W), _run_m4v4(*case, W=0)) for case in _m4v4_problems())


def _warn_mismatch(what: str = "") -> None:
    warnings.warn(f"gefen._gefen_step does not reproduce torch's eager {what}Gefen step on this machine "
                  f"(torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}); "
                  "using the eager step", RuntimeWarning, stacklevel=3)


# ----- the calibration cache: a fresh process skips the 13 problems (docs/decisions.md) --------
def cache_dir() -> str:
    """``$GEFEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/gefen``, else ``~/.cache/gefen``."""
    explicit = os.environ.get("GEFEN_CACHE_DIR")
    if explicit:
        return explicit
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "gefen")


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


def _cache_file() -> str:
    return os.path.join(cache_dir(), f"native-calibration-{cache_key()}.json")


def _apply(entry: dict) -> int | None:
    """Restore a cached calibration (width, square root, zero-scale sign); None if it cannot apply."""
    global _scale_mode, _sqrt_is_vml, _m4v4_ok
    width, use_vml, mode, m4v4 = (entry.get(k) for k in ("width", "vml", "scale_mode", "m4v4"))
    vml = _torch_vml_sqrt()
    if (width not in (0, 8, 16) or not isinstance(use_vml, bool) or mode not in (0, 1) or (use_vml and not vml)
            or not isinstance(m4v4, bool)):
        return None
    _scale_mode, _sqrt_is_vml, _m4v4_ok = mode, use_vml, m4v4
    _lib.gefen_set_sqrt(*(vml if use_vml else (None, None)))
    if width == 0 or not m4v4:
        _warn_mismatch("" if width == 0 else "m4v4 ")
    return width


def calibrate_cached() -> int:
    """``calibrate()``, or its result from an earlier process with the same library build, CPU and
    torch. An unreadable, corrupt or unwritable cache only costs the calibration."""
    if _lib is None:
        return 0
    try:
        path = _cache_file()
    except OSError:  # the library file vanished: calibrate, cache nothing
        path = None
    entry = _read_entry(path) if path else None
    width = _apply(entry) if entry is not None else None
    if width is None:
        width = calibrate()
        if path:
            _write_entry(path, {"width": width, "vml": bool(width) and _sqrt_is_vml, "scale_mode": _scale_mode,
                                "m4v4": bool(width) and _m4v4_ok, "torch": torch.__version__})
    return width


def _read_entry(path: str) -> dict | None:
    try:
        with open(path) as fh:
            entry = json.load(fh)
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


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

