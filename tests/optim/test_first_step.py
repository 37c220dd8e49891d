"""The first step's C kernel (gefen/csrc/first_step.c) against the torch reference: the
codebook histogram must be identical count for count."""

from __future__ import annotations

import pytest
import torch
from test_geometry import planted

import gefen.c_kernels as c_kernels
from gefen import Gefen, dispatch
from gefen.codebook import histogram_normalised_blocks, histogram_pairs, histograms_normalised_blocks
from gefen.geometry import as_blocks

pytestmark = pytest.mark.skipif(c_kernels._lib is None, reason="the C library is not built")


@pytest.fixture(autouse=True)
def _enabled():
    saved = dispatch.enabled
    dispatch.enabled = True
    yield
    dispatch.enabled = saved


def _structured(shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen) * 3
    return (torch.randn(shape, generator=gen) * rows).to(dtype)


@pytest.mark.parametrize("period", [1, 3, 8, 13, 64, 3000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_bins", [4096, 7])
def test_histogram_is_identical(period, dtype, num_bins):
    blocks = as_blocks(_structured((50, 3 * period), period, dtype) ** 3, period)
    blocks[0, 1] = 0  # all-zero block
    blocks[1, 0, 0] = blocks[1, 0].abs().amax() if period > 1 else 2.0  # x = +1 exactly
    want = histogram_normalised_blocks(blocks, num_bins)
    got = c_kernels.block_histograms([(blocks, None)], num_bins)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_histogram_special_values_are_identical():
    x = torch.randn(64, 40)
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 7] = float("-inf")
    x[4, :] = -1e-45  # subnormal block
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        assert torch.equal(c_kernels.block_histograms([(y, None)], 4096), histogram_normalised_blocks(y, 4096))


def _many(seed=0):
    """Tensors of both dtypes and several block lengths (a NaN block, an all-zero block, a column
    split's rows with their given scales), together over the threads' split."""
    x = _structured((300, 520), seed)
    x[5, :8] = float("nan")
    x[6] = 0
    rows = _structured((64, 37), seed + 1, torch.bfloat16)
    return [as_blocks(x, 13), as_blocks(_structured((90, 3000), seed + 2, torch.bfloat16), 3000),
            as_blocks(_structured((7, 5), seed + 3), 1), (rows, rows.float().abs().amax(1) * 1.5),
            torch.empty(0, 4), as_blocks(_structured((1000, 130), seed + 4), 130)]


@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_counts_many_tensors_as_the_reference_on_every_isa(threads):
    items, saved = histogram_pairs(_many()), torch.get_num_threads()
    want = histograms_normalised_blocks(items, 4096)
    torch.set_num_threads(threads)
    try:
        for isa in c_kernels.ISAS.values():
            for flush in (1 << 31, 7, 4000):  # 7 and 4000: the uint32 counters move to int64 between blocks
                got = c_kernels.block_histograms(items, 4096, isa=isa, flush=flush)
                assert got is not None and torch.equal(got, want), (isa, flush)
    finally:
        torch.set_num_threads(saved)
    assert c_kernels.block_histograms(items, 4096, flush=0) is None  # refused, nothing counted
    assert torch.equal(c_kernels.block_histograms([], 4096), torch.zeros(4096, dtype=torch.int64))


def test_dispatch_counts_what_no_kernel_takes_with_the_reference(monkeypatch):
    items = _many(1) + [torch.randn(40, 30).t(), torch.randn(8, 16, dtype=torch.float64)]  # not contiguous, fp64
    want = histograms_normalised_blocks(items, 256)
    assert torch.equal(dispatch.block_histograms(items, 256), want)
    assert dispatch.block_histograms([], 256) is None
    monkeypatch.setattr(c_kernels, "block_histograms", lambda pairs, bins: None)  # the C call refuses
    assert torch.equal(dispatch.block_histograms(items, 256), want)


def test_histogram_declines_other_inputs_and_the_optimizer_falls_back():
    x = torch.randn(30, 16, dtype=torch.float64)
    assert dispatch.kernels("histogram", [x]) is None  # dtype
    t = torch.randn(16, 30).t()
    assert dispatch.kernels("histogram", [t]) is None  # not contiguous
    assert dispatch.kernels("histogram", [t.contiguous()]) is c_kernels
    assert torch.equal(dispatch.block_histograms([t], 64), histogram_normalised_blocks(t.contiguous(), 64))
    dispatch.enabled = False
    assert dispatch.kernels("histogram", [t.contiguous()]) is None


@pytest.mark.parametrize("moments", ["m4v4", "m8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_step_learns_the_same_codebook(dtype, moments):
    shapes = {"emb": (300, 48), "up": (48, 192), "conv": (16, 8, 3, 3), "odd": (40, 60), "norm": (48,)}
    results = []
    for use_native in (False, True):
        dispatch.enabled = use_native
        params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes.values()]
        opt = Gefen(params, lr=1e-3, moments=moments)
        for i, p in enumerate(params):
            p.grad = planted(p.shape, 12 if p.dim() > 1 and p.shape[1] % 12 == 0 else 1, seed=i).to(dtype) \
                if p.dim() > 1 else torch.randn(p.shape).to(dtype)
        opt.step()
        periods = [int(opt.state[p]["period"]) for p in params] if moments == "m8" else None
        results.append((periods, opt.codebook.clone(), opt.v_codebook))
    (periods_ref, book_ref, v_ref), (periods, book, v_book) = results
    assert periods == periods_ref
    assert torch.equal(book, book_ref)
    assert (v_book is None) == (moments == "m8") and (v_book is None or torch.equal(v_book, v_ref))
