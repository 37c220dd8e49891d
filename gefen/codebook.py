"""The optimizer-wide codebook: histogram, exact pinned 1-D k-means, nearest-code lookup
(docs/design.md 3.1). The k-means is the C divide-and-conquer DP (``gefen/csrc/kmeans_dp.c``),
built with the package.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable

import numpy as np
import torch

from gefen import clib

# Elements per histogram chunk: bounds the fp32/int64 temporaries on huge gradients.
_HIST_CHUNK = 1 << 22


_DBL = ctypes.POINTER(ctypes.c_double)
_ARGS = [ctypes.c_int64, ctypes.c_int64, _DBL, _DBL, _DBL, _DBL, _DBL, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]
_lib = clib.load("gefen._kmeans_dp", {"gefen_kmeans_dp": (_ARGS, ctypes.c_int)})
_native = _lib.gefen_kmeans_dp if _lib is not None else None  # None: not built (a plain source tree)


def histogram_normalised_blocks(blocks: torch.Tensor, num_bins: int,
                                scale: torch.Tensor | None = None) -> torch.Tensor:
    """Histogram of block-normalised values over [-1, 1]; int64 counts ``[num_bins]``.

    Each block (last dim) is divided by its max-abs in fp32 (an all-zero block stays 0), and x goes
    to bin ``clamp(floor((x + 1) / 2 * num_bins), 0, num_bins - 1)`` evaluated in fp32 in that
    order, so the counts are identical on every device and rank. ``scale``: each block's max-abs
    when the block is only part of one (a column split: the whole row's).
    """
    counts = torch.zeros(num_bins, dtype=torch.int64, device=blocks.device)
    if blocks.numel() == 0:
        return counts
    flat = blocks.detach().reshape(-1, blocks.shape[-1])
    step = max(1, _HIST_CHUNK // flat.shape[1])
    for start in range(0, flat.shape[0], step):
        chunk = flat[start : start + step].float()
        if scale is None:
            chunk_scale = chunk.abs().amax(dim=1, keepdim=True)
        else:
            chunk_scale = scale.reshape(-1, 1)[start : start + step].float().clone()
        chunk_scale.masked_fill_(chunk_scale == 0, 1.0)
        x = chunk.div(chunk_scale).add_(1.0).div_(2.0).mul_(num_bins)
        idx = x.to(torch.int64).clamp_(0, num_bins - 1)  # truncation == floor: x >= 0
        counts += torch.bincount(idx.reshape(-1), minlength=num_bins)
    return counts


def _prefix(values: np.ndarray) -> np.ndarray:
    """float64 prefix sums with a leading 0, so a range sum is one subtraction."""
    return np.concatenate(([0.0], np.cumsum(values)))


def _optimal_cuts(x: np.ndarray, w: np.ndarray, m: int) -> np.ndarray:
    """Segment boundaries of the optimal pinned k-means with m free centres (n >= m >= 0)."""
    if _native is None:
        raise RuntimeError("gefen._kmeans_dp is not built: install the package (`pip install -e .`) to build "
                           "the codebook solver")
    W, S1, S2 = _prefix(w), _prefix(w * x), _prefix(w * x * x)
    L = _prefix(w * (x + 1.0) ** 2)
    R = _prefix((w * (x - 1.0) ** 2)[::-1])[::-1].copy()
    cuts = np.empty(m + 1, dtype=np.int64)
    arrays = [np.ascontiguousarray(a, dtype=np.float64) for a in (W, S1, S2, L, R)]
    # the cuts do not depend on the thread count (kmeans_dp.c); torch.set_num_threads bounds it
    if _native(len(x), m, *[a.ctypes.data_as(_DBL) for a in arrays],
               cuts.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), torch.get_num_threads()) != 0:
        raise MemoryError("gefen._kmeans_dp: out of memory")
    return cuts


def solve_codebook(counts: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """The codebook a step quantises with: ``optimal_codebook`` with its inner centre nearest 0 set to
    exactly 0 (``with_exact_zero``), fp32."""
    return torch.from_numpy(with_exact_zero(optimal_codebook(counts, codebook_size))).to(torch.float32)


def optimal_codebook(counts: torch.Tensor, codebook_size: int) -> np.ndarray:
    """Optimal sorted float64 codebook for a histogram over [-1, 1], ends pinned to -1 and +1: exact
    weighted 1-D k-means over the active bins (at their centres), a possibly empty prefix mapped to
    -1 and suffix to +1, K - 2 middle segments to their means; DP ties go to the smaller split. With
    at most K - 2 active bins each is its own centre, the tail padded with +1; an all-zero histogram
    gives ``linspace(-1, 1, K)``."""
    if codebook_size < 2:
        raise ValueError(f"codebook_size must be >= 2 (both ends are pinned), got {codebook_size}")
    num_bins = counts.numel()
    c = counts.detach().cpu().to(torch.int64).numpy()
    active = np.flatnonzero(c > 0)
    if len(active) == 0:
        return np.linspace(-1.0, 1.0, codebook_size)
    x = -1.0 + (active + 0.5) * (2.0 / num_bins)
    w = c[active].astype(np.float64)
    m = codebook_size - 2
    if len(active) <= m:
        middle = x
    else:
        cuts = _optimal_cuts(x, w, m)
        S0, S1 = _prefix(w), _prefix(w * x)
        lo, hi = cuts[:-1], cuts[1:]
        middle = (S1[hi] - S1[lo]) / (S0[hi] - S0[lo])
    book = np.full(codebook_size, 1.0)
    book[0] = -1.0
    book[1 : 1 + len(middle)] = middle
    return book


def with_exact_zero(book: np.ndarray) -> np.ndarray:
    """``book`` (sorted, ends -1 and +1) with its inner centre nearest 0 set to exactly 0, so a moment
    that is exactly zero codes to exactly zero: an element whose gradients were all zero keeps a zero
    momentum and takes no step (docs/design.md, "Bounded steps"). The order stays sorted: every
    inner centre below the one moved is negative, every one above it positive. A 2-entry book has
    no inner centre and is returned as is."""
    book = book.copy()
    if len(book) > 2 and not (book == 0.0).any():
        inner = np.abs(book[1:-1])
        book[1 + int(np.argmin(inner))] = 0.0
    return book


def histogram_pairs(items: list) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The items of a histogram (``[..., P]`` block tensors or ``(blocks, scale)`` pairs) as pairs;
    scale None: each block's own max-abs."""
    return [item if isinstance(item, tuple) else (item, None) for item in items]


def histograms_normalised_blocks(items: list, num_bins: int) -> torch.Tensor | None:
    """``histogram_normalised_blocks`` summed over ``items`` (``histogram_pairs``), on the first
    item's device; None for no items."""
    counts = None
    for blocks, scale in histogram_pairs(items):
        h = histogram_normalised_blocks(blocks, num_bins, scale)
        counts = h if counts is None else counts + h.to(counts.device)
    return counts


def learn_codebook(
    blocks_list: Iterable,
    codebook_size: int = 256,
    bins_per_code: int = 16,
    all_reduce: Callable[[torch.Tensor], object] | None = None,
    histogram: Callable[[list, int], torch.Tensor | None] = histograms_normalised_blocks,
) -> torch.Tensor:
    """Histogram every ``[..., P]`` block tensor (or ``(blocks, scale)`` pair), sum, solve.
    ``all_reduce(counts)`` sums the int64 counts in place across ranks (exact: every rank gets the
    same codebook); ``histogram(items, num_bins)`` counts them all (``gefen.dispatch.block_histograms``:
    the same counts)."""
    num_bins = bins_per_code * codebook_size
    counts = histogram(list(blocks_list), num_bins)
    if counts is None:
        counts = torch.zeros(num_bins, dtype=torch.int64)
    if all_reduce is not None:
        all_reduce(counts)
    return solve_codebook(counts, codebook_size)


def code_thresholds(codebook: torch.Tensor) -> torch.Tensor:
    """fp32 decision thresholds: ``t_i`` = largest fp32 <= the exact midpoint of c_i, c_{i+1}.

    The fp32 sum c_i + c_{i+1} can round, which would misplace values a half-ulp from the
    midpoint.  Rounding the exact midpoint (an error-free two-sum in float64) *down* to fp32
    instead gives, for every fp32 x, ``x <= t_i  <=>  x <= (c_i + c_{i+1}) / 2`` exactly.
    """
    a = codebook[:-1].detach().to(torch.float64)
    b = codebook[1:].detach().to(torch.float64)
    s = a + b
    bv = s - a
    err = (a - (s - bv)) + (b - bv)  # Knuth two-sum: a + b == s + err exactly
    mid, mid_err = s * 0.5, err * 0.5
    t = mid.to(torch.float32)
    t64 = t.to(torch.float64)
    above = (t64 > mid) | ((t64 == mid) & (mid_err < 0))
    return torch.where(above, torch.nextafter(t, torch.full_like(t, -float("inf"))), t)


def nearest_code(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """uint8 index of the nearest codebook entry for each x (normalised into [-1, 1]): exactly
    ``argmin_i |x - c_i|`` for a sorted codebook, exact ties (x on a midpoint) to the lower code, as
    the number of ``code_thresholds`` strictly below x (what the kernels compare against too).
    x is compared in fp32; NaN maps to the last code.
    """
    if codebook.numel() > 256:
        raise ValueError(f"uint8 codes hold at most 256 entries, codebook has {codebook.numel()}")
    thresholds = code_thresholds(codebook).to(x.device)
    idx = torch.searchsorted(thresholds, x.float(), right=False, out_int32=True)
    return idx.to(torch.uint8)
