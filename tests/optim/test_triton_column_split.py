"""The Triton kernels on shards whose columns tensor parallelism splits (``Shard(1)``), against the
torch reference given the same row statistics (Triton's interpreter on CPU without a GPU).

As for the C kernels (test_native_column_split.py): this shard's per-row statistics, a stand-in
for their reduction over the tensor-parallel ranks, then phases 1 and 2 given the reduced
statistics, the shard's first row and column and the global row length; the first step's
histogram with given scales. Codes, scales and moments identical; parameters up to one rounding
where torch's CPU square root (MKL) is not correctly rounded (``gefen.parity.params_close``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from gefen import functional as F
from gefen import parity
from gefen.codebook import histogram_normalised_blocks
from gefen.quant import block_scales
from gefen.stochastic import ratio_table

triton = pytest.importorskip("triton")
from gefen import dispatch as step_dispatch  # noqa: E402
from gefen.triton import dispatch, launch  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H = F.Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


@pytest.fixture(autouse=True)
def _kernels_on_this_device(monkeypatch):
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and Triton's interpreter is off (TRITON_INTERPRET=1)")
    monkeypatch.setattr(dispatch, "DEVICES", {"cuda", "cpu"})
    assert dispatch.available()  # imports the launch module the kernels' functions below call
    monkeypatch.setattr(step_dispatch, "enabled", True)  # off: the reference is the eager torch step
    monkeypatch.setattr(launch, "MAX_SINGLE", 64)  # rows longer than 64 take the two-pass kernels


def _book(gen, k: int) -> torch.Tensor:
    book = torch.sort(torch.rand(k, generator=gen) * 2 - 1).values
    book[0], book[-1] = -1.0, 1.0
    return book.to(DEVICE)


def _grad(gen, shape, dtype, zero_row: bool) -> torch.Tensor:
    g = torch.randn(shape, generator=gen) * (torch.rand(shape[0], 1, generator=gen) + 0.1)
    if zero_row and shape[0] > 2:
        g[2] = 0
    return g.to(device=DEVICE, dtype=dtype)


def _assert_states_equal(ref: dict, got: dict, label: str):
    for key, value in ref.items():
        assert torch.equal(value, got[key]), f"{label}: state {key!r} differs"


#: (local rows, local columns, global row length, first column, param dtype, grad dtype): one
#: tile, two passes (rows longer than MAX_SINGLE), bf16, a shard at column 0
SHARDS = [(37, 33, 80, 20, torch.float32, torch.float32), (3, 150, 300, 150, torch.float32, torch.bfloat16),
          (9, 16, 48, 0, torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("rows,cols,row_len,col0,pdt,gdt", SHARDS, ids=str)
def test_m4v4_column_shard_matches_the_reference(rows, cols, row_len, col0, pdt, gdt):
    gen = torch.Generator().manual_seed(rows + cols)
    cb, ratio = _book(gen, 16), ratio_table(_book(gen, 16))
    p_ref = (torch.randn(rows, cols, generator=gen) * 0.1).to(device=DEVICE, dtype=pdt)
    s_ref = F.init_m4v4_state(p_ref, (rows + 7, row_len))
    p, s = p_ref.clone(), copy.deepcopy(s_ref)
    for step in range(3):
        g = _grad(gen, (rows, cols), gdt, zero_row=step == 1)
        stats = dispatch.m4v4_row_stats(g, s, cb, H.beta1)
        assert stats is not None, "the row statistics kernel did not apply"
        torch.testing.assert_close(stats[0], F.row_square_sums(g), rtol=1e-13, atol=0)
        assert torch.equal(stats[1], F.row_abs_max(F.m4v4_momentum(g, s_ref, cb, H.beta1))), f"step {step}: row max"
        row_sum = F.row_square_sums(g) * 1.75 + 0.5  # the whole rows' statistics, as tp's reduction gives them
        row_max = stats[1] * 1.5
        phase1 = dispatch.m4v4_partials(g, s, H.beta2, row_sum=row_sum, row_len=row_len)
        assert phase1 is not None, "phase 1 did not apply"
        v_row, parts = F.m4v4_partials(g, s_ref, H.beta2, row_sum=row_sum, row_len=row_len)
        assert torch.equal(phase1[0], v_row), f"step {step}: v_row"
        torch.testing.assert_close(phase1[1], parts, rtol=1e-13, atol=0)
        kw = dict(global_rows=rows + 7, v_row=v_row, partials=parts, pidx=3, seed=1, row0=5, col0=col0,
                  row_len=row_len, row_max=row_max)
        before = p_ref.clone()
        F.m4v4_update_(p_ref, g, s_ref, cb, ratio, H, **kw)
        assert dispatch.m4v4_update_(p, g, s, cb, ratio, H, **{**kw, "v_row": v_row.clone()})
        _assert_states_equal(s_ref, s, f"step {step}")
        assert parity.params_close(before, p_ref, p), f"step {step}: parameters differ beyond rounding"
        p.copy_(p_ref)


@pytest.mark.parametrize("K", [16, 256])
@pytest.mark.parametrize("rows,cols", [(37, 33), (3, 150)], ids=str)
def test_momentum_column_shard_matches_the_reference(rows, cols, K):
    """GefenMuon's momentum on a column shard (one block per cut row): the scales alone (state
    untouched), then the momentum with the reduced scales given."""
    gen = torch.Generator().manual_seed(K + rows)
    cb = _book(gen, K)
    s_ref = F.init_momentum_state(torch.zeros(rows, cols, device=DEVICE), (rows, 2 * cols), 2 * cols)
    s = copy.deepcopy(s_ref)
    for step, beta in enumerate((0.95, 0.3, 0.95)):
        g = _grad(gen, (rows, cols), torch.float32, zero_row=step == 1)
        saved = copy.deepcopy(s)
        scales = dispatch.momentum_scales(s, g, beta, cb)
        assert scales is not None, "the block-scale launch did not apply"
        _assert_states_equal(saved, s, f"step {step}: the scales alone")
        m = F.momentum_ema(s_ref, g, beta, cb)
        assert torch.equal(scales, block_scales(F.as_blocks(m, F._local_period(s_ref)))), f"step {step}: scales"
        reduced = scales * 1.25 + 0.125 * step
        want = F.store_momentum_(s_ref, m, cb, reduced)
        got = dispatch.momentum_(s, g, beta, cb, reduced)
        assert got is not None and torch.equal(got, want), f"step {step}: momentum"
        _assert_states_equal(s_ref, s, f"step {step}")


@pytest.mark.parametrize("shape,dtype", [((50, 700), torch.float32), ((20, 40), torch.bfloat16)], ids=str)
def test_histogram_matches_the_reference(shape, dtype):
    """The first step's histogram: blocks by their own max-abs, and a column shard's rows by their
    whole rows' (given; NaN and zero scales, a NaN element and an all-zero row included)."""
    gen = torch.Generator().manual_seed(11)
    rows = _grad(gen, shape, dtype, zero_row=True)
    rows[3, 5] = float("nan")
    scale = F.row_abs_max(rows.float()) * (1 + torch.rand(shape[0], generator=gen).to(DEVICE))
    scale[7], scale[2] = float("nan"), 0.0
    for bins in (256, 4096):
        got = dispatch.block_histogram(rows, bins, scale)
        assert got is not None and torch.equal(got, histogram_normalised_blocks(rows.unsqueeze(1), bins, scale=scale))
        blocks = rows.reshape(-1, 10)
        assert torch.equal(dispatch.block_histogram(blocks, bins), histogram_normalised_blocks(blocks, bins))


def test_first_use_check_of_the_histogram():
    assert dispatch.parity_check(torch.device(DEVICE), "histogram") is None


_AOT = """
import re
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from gefen.triton import kernels as K

tab = {"progs": "*i64", "ptrs": "*i64", "ints": "*i64", "scal": "*fp32"}
hist = {"progs": "*i64", "x_p": "*bf16", "scale_p": "*fp32", "counts_p": "*i64", "nblocks": "i64", "P": "i64",
        "bins": "i64"}
cases = [
    (K.row_stats_kernel, {**tab, "cb": "*fp32"}, {"BR": 4, "BC": 1024, "GRAD_T": tl.bfloat16}),
    (K.histogram_kernel, hist, {"GIVEN": True, "NB": 256, "BR": 2, "BC": 1024}),
    (K.histogram_kernel, {**hist, "x_p": "*fp32"}, {"GIVEN": False, "NB": 4096, "BR": 128, "BC": 16}),
]
for fn, sig, consts in cases:
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    ptx = compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    bad = sorted(set(re.findall(r"\\b(?:div\\.(?:full|approx)|sqrt\\.approx|rcp\\.approx)[.a-z0-9]*", ptx)))
    assert "div.rn" in ptx or fn is K.row_stats_kernel, fn.__name__  # the IEEE division is there
    assert not bad, (fn.__name__, bad)
print("ok")
"""


def test_new_kernels_compile_for_a_gpu_with_ieee_arithmetic():
    """The column split's phase-0 kernel and the histogram lower for an sm_90 GPU without one, with
    no approximate division (the m4v4, momentum and partials kernels: test_triton.py)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout + out.stderr)[-3000:]
