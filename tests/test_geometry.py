"""gefen.geometry: block candidates and shapes, period statistics and the SPEC 3.1 period rule.

The rule takes the candidate with the smallest increment of ``err(p)``. Along a chain of
candidates that divide each other ``err`` can never decrease (a block's population variance is
at least the mean of its halves' variances), so the rule only selects a planted period P* when
the candidate just below P* does *not* divide it (the error then drops at P*). Power-of-two row
lengths have only nested candidates and therefore always fall back to one block per row; the
tests below pin down both sides of that behaviour.
"""

from __future__ import annotations

import math

import pytest
import torch

from gefen import Gefen
from gefen.geometry import (
    MIN_PERIOD,
    as_blocks,
    block_shape,
    period_candidates,
    period_statistics,
    pick_period,
    rows_and_row_numel,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread (OpenMP spin-waits only cost time on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def planted(shape, period, seed, noise="normal"):
    """A gradient whose magnitude is constant inside blocks of ``period`` elements of each row.

    ``g[i, j] = r_i * s[i, j // period] * z`` with row scales ``r`` in [0.5, 2], block scales ``s``
    log-uniform over one decade (strongly varying) and ``z`` standard normal (or +-1).
    """
    gen = torch.Generator().manual_seed(seed)
    rows, row_numel = rows_and_row_numel(shape)
    r = 10 ** (0.3 * (2 * torch.rand(rows, 1, generator=gen) - 1))
    s = (10 ** -torch.rand(rows, row_numel // period, generator=gen)).repeat_interleave(period, 1)
    if noise == "normal":
        z = torch.randn(rows, row_numel, generator=gen)
    else:
        z = torch.randint(0, 2, (rows, row_numel), generator=gen).float() * 2 - 1
    return (r * s * z).reshape(shape)


def choose(grad):
    """The period the SPEC rule picks for ``grad`` (single process: no reduction)."""
    candidates = period_candidates(grad.shape)
    return pick_period(candidates, period_statistics(grad, candidates))


def errors(grad):
    """``err(p)`` for every candidate, straight from ``period_statistics``."""
    candidates = period_candidates(grad.shape)
    stats = period_statistics(grad, candidates)
    return candidates, [math.sqrt(max(s, 0.0) / c) for s, c in stats.tolist()]


def stats_from_errors(errs):
    """Statistics rows (sum of variances, block count) that reproduce the given ``err`` curve."""
    return torch.tensor([[e * e, 1.0] for e in errs], dtype=torch.float64)


# ----- candidates and block shapes --------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 768), (3, 16, 3, 3), (7, 1), (4, 97), (2, 1, 1), (6, 360)])
def test_candidates_are_exactly_the_divisors_of_the_row(shape):
    """Every divisor of row_numel, ascending, and nothing else."""
    n = math.prod(shape[1:])
    assert period_candidates(shape) == [d for d in range(1, n + 1) if n % d == 0]


def test_empty_rows_use_period_one():
    """Rows without elements (shape (5, 0)) have no divisors to choose from: P = 1."""
    assert period_candidates((5, 0)) == period_candidates((3, 0, 2)) == [1]
    assert block_shape((5, 0), 1) == (5, 0)


@pytest.mark.parametrize("shape", [(), (1,), (4096,), (3,)])
def test_vectors_and_scalars_use_period_one(shape):
    """1-D and 0-D tensors keep per-element state, whatever their gradient."""
    assert period_candidates(shape) == [1]
    grad = torch.randn(shape)
    assert choose(grad) == 1


def test_optimizer_gives_vectors_and_scalars_period_one():
    """The optimizer's state agrees: P = 1 and one block per element for 1-D/0-D parameters."""
    vec, scalar = torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.tensor(0.5))
    vec.grad, scalar.grad = planted((40,), 1, 0), torch.tensor(0.25)
    opt = Gefen([vec, scalar])
    opt.step()
    assert int(opt.state[vec]["period"]) == 1 and opt.state[vec]["m_scale"].shape == (40, 1)
    assert int(opt.state[scalar]["period"]) == 1 and opt.state[scalar]["m_scale"].shape == (1, 1)


@pytest.mark.parametrize("shape,period", [((6, 12), 4), ((6, 12), 12), ((6, 12), 1), ((4, 3, 2, 5), 10), ((), 1), ((9,), 1)])
def test_block_shape_and_block_view(shape, period):
    """Blocks are contiguous runs of P elements inside one row; row slices keep whole blocks."""
    rows, row_numel = rows_and_row_numel(shape)
    assert block_shape(shape, period) == (rows, row_numel // period)
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    blocks = as_blocks(t, period)
    assert blocks.shape == (rows, row_numel // period, period)
    flat = t.reshape(rows, row_numel)
    for r in range(rows):
        for b in range(row_numel // period):
            assert torch.equal(blocks[r, b], flat[r, b * period : (b + 1) * period])
    blocks[0, 0, 0] = -1.0  # a view, not a copy
    assert t.reshape(-1)[0] == -1.0
    if len(shape) >= 1 and rows > 1:
        half = rows // 2
        assert torch.equal(as_blocks(t[half:], period), blocks[half:])


@pytest.mark.parametrize("period", [0, 5, 7, -4])
def test_block_shape_rejects_non_divisors(period):
    """A period that does not divide the row length is an error naming it."""
    with pytest.raises(ValueError, match=str(period)):
        block_shape((3, 12), period)


# ----- period statistics ------------------------------------------------------------------------
def direct_statistics(grad, candidates):
    """Slow and obvious: population variance of g^2 inside every block, float64."""
    rows, row_numel = rows_and_row_numel(grad.shape)
    sq = grad.to(torch.float64).reshape(rows, row_numel).square()
    out = []
    for p in candidates:
        blocks = sq.reshape(rows, row_numel // p, p)
        var = (blocks - blocks.mean(-1, keepdim=True)).square().mean(-1)
        out.append([var.sum().item(), float(blocks.shape[0] * blocks.shape[1])])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(24, 96), (8, 6, 3, 3), (5, 7), (16, 360), (1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_period_statistics_equal_direct_computation(shape, dtype):
    """Hierarchical block sums give the same per-candidate statistics as the direct formula."""
    gen = torch.Generator().manual_seed(1)
    grad = (torch.randn(shape, generator=gen) * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen) * 3).to(dtype)
    grad.view(-1)[::17] *= 20  # outliers stress the E[x^2] - E[x]^2 cancellation
    before = grad.clone()
    candidates = period_candidates(shape)
    got = period_statistics(grad, candidates)
    want = direct_statistics(grad, candidates)
    assert got.dtype == torch.float64 and got.shape == (len(candidates), 2)
    assert torch.equal(got[:, 1], want[:, 1])
    scale = grad.to(torch.float64).pow(4).sum().item()
    assert torch.allclose(got[:, 0], want[:, 0], rtol=1e-9, atol=1e-12 * scale)
    assert torch.equal(grad, before), "period_statistics must not modify the gradient"


def test_period_statistics_of_a_row_shard_sum_to_the_whole():
    """Statistics are additive over row slices, so all-reducing shards gives the global numbers."""
    grad = planted((30, 48), 12, 3)
    candidates = period_candidates(grad.shape)
    parts = sum(period_statistics(part, candidates) for part in torch.tensor_split(grad, [7, 8, 19]))
    assert torch.allclose(parts, period_statistics(grad, candidates), rtol=1e-12, atol=0)


# ----- the period rule ---------------------------------------------------------------------------
PLANTED = [((64, 768), p) for p in (16, 24, 32, 48, 64, 96, 128, 192, 256, 384)]
PLANTED += [((16, 3072), p) for p in (16, 96, 512, 1536)]
PLANTED += [((64, 16, 3, 3), p) for p in (9, 18, 72)]
PLANTED += [((24, 640), p) for p in (20, 64, 80, 160)]


@pytest.mark.parametrize("shape,period", PLANTED, ids=[f"{s}-P{p}" for s, p in PLANTED])
@pytest.mark.parametrize("seed", [0, 1])
def test_rule_finds_planted_period(shape, period, seed):
    """Row/column scale structure with per-block magnitudes: the rule returns the planted P."""
    assert choose(planted(shape, period, seed)) == period


def test_optimizer_picks_the_planted_period():
    """The optimizer's first step applies the rule per parameter (here P = 96 and P = 9)."""
    a = torch.nn.Parameter(torch.zeros(64, 768))
    b = torch.nn.Parameter(torch.zeros(64, 16, 3, 3))
    a.grad, b.grad = planted(a.shape, 96, 5), planted(b.shape, 9, 5)
    opt = Gefen([a, b])
    opt.step()
    assert int(opt.state[a]["period"]) == 96 and opt.state[a]["m_scale"].shape == (64, 8)
    assert int(opt.state[b]["period"]) == 9 and opt.state[b]["m_scale"].shape == (64, 16)


@pytest.mark.parametrize("shape,period", [((64, 1024), 64), ((64, 1024), 8), ((32, 4096), 256), ((64, 512), 128)])
def test_power_of_two_rows_fall_back_to_one_block_per_row(shape, period):
    """Nested candidates: err never decreases, no increment beats the first one's 1e-12, so the
    rule answers P = 1 and the fallback gives one block per row, whatever was planted."""
    grad = planted(shape, period, 0)
    _, err = errors(grad)
    assert all(b >= a for a, b in zip(err, err[1:]))
    assert choose(grad) == shape[1]


def test_nested_predecessor_hides_the_planted_period():
    """640 = 5 * 128: P* = 320 has the divisor 160 just below it, so the error cannot drop at 320;
    the rule lands on 160 (still whole planted blocks, twice the scales)."""
    assert choose(planted((24, 640), 320, 0)) == 160


def test_planted_period_below_min_period_falls_back_to_one_block_per_row():
    """|g| constant inside blocks of 4: err is 0 at p = 1, 2, 4 and the largest drop is at 4,
    but 4 < MIN_PERIOD, so the rule falls back to P = row_numel."""
    grad = planted((32, 96), 4, 0, noise="sign")
    cands, err = errors(grad)
    assert [err[cands.index(p)] for p in (1, 2, 4)] == [0, 0, 0] and err[cands.index(3)] > 0
    assert choose(grad) == 96


def test_flat_error_curve_falls_back_to_one_block_per_row():
    """|g| the same everywhere: every err is 0, p = 2 wins with a zero increment, fallback."""
    grad = torch.randint(0, 2, (16, 72), generator=torch.Generator().manual_seed(0)).float() * 2 - 1
    assert max(errors(grad)[1]) == 0
    assert choose(grad) == 72
    assert choose(grad[:, :6]) == 1  # rows shorter than MIN_PERIOD: P = 1


def test_increment_rule_on_handmade_curves():
    """Smallest increment wins, ties go to the smaller p, the first candidate counts as 1e-12,
    results below MIN_PERIOD fall back to the row (or 1 when the row is shorter than 8)."""
    cands = [1, 2, 4, 8, 16, 32, 64]
    # increments: 1e-12, 1, .5, -.25, .5, -.25, .5 -> the tie at -0.25 goes to p = 8, not p = 32
    assert pick_period(cands, stats_from_errors([0, 1, 1.5, 1.25, 1.75, 1.5, 2])) == 8
    # the largest drop wins
    assert pick_period(cands, stats_from_errors([0, 1, 1.5, 1.3, 1.6, 1.0, 1.5])) == 32
    # all increments positive: the first candidate keeps 1e-12 -> p = 1 -> one block per row
    assert pick_period(cands, stats_from_errors([0, 1, 2, 3, 4, 5, 6])) == 64
    # an increment of exactly 1e-12 ties with the first candidate, which keeps it (ties go low)
    assert pick_period(cands, stats_from_errors([0, 1e-12, 1, 2, 3, 4, 5])) == 64
    # ... while a zero increment beats it
    assert pick_period(cands, stats_from_errors([0, 1, 2, 2, 3, 4, 5])) == 8
    assert pick_period(cands, stats_from_errors([0, 1, 2, 3, 3, 4, 5])) == 16
    # best below MIN_PERIOD: drop at p = 4 -> fallback to the row length
    assert pick_period(cands, stats_from_errors([0, 1, 0.5, 1, 2, 3, 4])) == 64
    # rows shorter than MIN_PERIOD fall back to 1
    assert pick_period([1, 2, 3, 6], stats_from_errors([0, 1, 0.5, 2])) == 1
    assert pick_period([1], stats_from_errors([0])) == 1
    assert MIN_PERIOD == 8
