"""gefen.codebook: exact pinned k-means (the C solver), nearest code, histogram."""

import math
import statistics
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

import gefen.codebook as cb


def bin_centres(num_bins):
    return -1.0 + (np.arange(num_bins) + 0.5) * (2.0 / num_bins)


def brute_force(counts, k):
    """Plain O(n^2 K) DP over the active bins; returns (optimal cost, float64 codebook)."""
    active = np.flatnonzero(counts > 0)
    x, w = bin_centres(len(counts))[active], counts[active].astype(np.float64)
    n, m = len(x), k - 2
    if n <= m:
        return 0.0, np.concatenate(([-1.0], x, np.ones(k - 1 - n)))

    def sse(i, j):
        mu = np.sum(w[i:j] * x[i:j]) / np.sum(w[i:j])
        return float(np.sum(w[i:j] * (x[i:j] - mu) ** 2))

    seg = {(i, j): sse(i, j) for i in range(n) for j in range(i + 1, n + 1)}
    best = [[float(np.sum(w[:j] * (x[:j] + 1) ** 2)) for j in range(n + 1)]]
    arg = [None]
    for t in range(1, m + 1):
        row, row_arg = [math.inf] * (n + 1), [0] * (n + 1)
        for j in range(t, n + 1):
            for i in range(t - 1, j):
                c = best[t - 1][i] + seg[i, j]
                if c < row[j]:
                    row[j], row_arg[j] = c, i
        best.append(row)
        arg.append(row_arg)
    total = [best[m][j] + float(np.sum(w[j:] * (x[j:] - 1) ** 2)) for j in range(n + 1)]
    cuts = [int(np.argmin(total))]
    for t in range(m, 0, -1):
        cuts.insert(0, arg[t][cuts[0]])
    means = [np.sum(w[a:b] * x[a:b]) / np.sum(w[a:b]) for a, b in zip(cuts, cuts[1:])]
    return min(total), np.array([-1.0, *means, 1.0])


def induced_cost(counts, codebook):
    """Cost of the partition that nearest-code assignment induces, with exact float64 means."""
    active = np.flatnonzero(counts > 0)
    x, w = bin_centres(len(counts))[active], counts[active].astype(np.float64)
    book = codebook.double().numpy()
    label = np.abs(x[:, None] - book[None, :]).argmin(1)
    cost = 0.0
    for code in np.unique(label):
        sel = label == code
        centre = {0: -1.0, len(book) - 1: 1.0}.get(code, np.sum(w[sel] * x[sel]) / np.sum(w[sel]))
        cost += float(np.sum(w[sel] * (x[sel] - centre) ** 2))
    return cost


def random_counts(rng, num_bins):
    counts = rng.integers(1, 1000, num_bins)
    counts[rng.random(num_bins) < rng.choice([0.0, 0.3, 0.8])] = 0
    return counts


def check_codebook(book, k):
    """Sorted, ends pinned, and (K > 2) an exact zero: a zero moment must code to zero."""
    assert book.dtype == torch.float32 and book.shape == (k,)
    assert book[0].item() == -1.0 and book[-1].item() == 1.0
    assert torch.all(book[1:] >= book[:-1])
    assert k <= 2 or (book == 0).sum().item() == 1


def test_solve_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        num_bins, k = int(rng.integers(8, 65)), int(rng.integers(4, 17))
        counts = random_counts(rng, num_bins)
        optimal64 = cb.optimal_codebook(torch.from_numpy(counts), k)
        optimal = torch.from_numpy(optimal64).float()
        book = cb.solve_codebook(torch.from_numpy(counts), k)
        check_codebook(book, k)
        assert torch.equal(book, torch.from_numpy(cb.with_exact_zero(optimal64)).float())
        if not counts.any():
            continue
        cost, ref = brute_force(counts, k)
        assert induced_cost(counts, optimal) == pytest.approx(cost, rel=1e-9, abs=1e-12)
        np.testing.assert_allclose(optimal.numpy(), ref, rtol=0, atol=1e-6)


def test_native_solver_does_not_depend_on_the_thread_count():
    """Threads share each DP layer's subtrees; every node keeps the serial bounds, so the same cuts."""
    assert cb._native is not None, "gefen._kmeans_dp is not built: run `pip install -e .`"
    rng = np.random.default_rng(2)
    x = bin_centres(4096)
    cases = [
        np.round(1e5 * np.exp(-(x**2) / 0.08)).astype(np.int64) + 1,  # smooth, every bin active
        rng.integers(0, 50, 4096) * (rng.random(4096) > 0.3),  # gaps
        rng.integers(0, 3, 4096),  # many exact ties
        np.ones(4096, dtype=np.int64),  # all costs tie
    ]
    before = torch.get_num_threads()
    try:
        books = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            books.append([cb.solve_codebook(torch.from_numpy(c), 256) for c in cases])
    finally:
        torch.set_num_threads(before)
    for other in books[1:]:
        for a, b in zip(books[0], other):
            assert torch.equal(a, b)
    assert len({tuple(b.tolist()) for b in books[0]}) == len(cases)  # the cases differ


def test_unbuilt_solver_says_how_to_build(monkeypatch):
    """The DP has one implementation, the C library: without it a solve names the fix."""
    monkeypatch.setattr(cb, "_native", None)
    with pytest.raises(RuntimeError, match="_kmeans_dp is not built.*pip install"):
        cb.solve_codebook(torch.arange(64), 8)


def test_padding_with_few_active_bins():
    counts = torch.zeros(16, dtype=torch.int64)
    counts[[3, 9]] = torch.tensor([5, 7])
    book = cb.solve_codebook(counts, 8)
    centres = bin_centres(16)
    # the bins' centres, the one nearer 0 (centres[9] = 0.1875) moved to exactly 0
    expected = torch.tensor([-1.0, centres[3], 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float32)
    assert torch.equal(book, expected)
    check_codebook(book, 8)


def test_all_zero_histogram_is_uniform():
    book = cb.solve_codebook(torch.zeros(64, dtype=torch.int64), 5)
    assert torch.equal(book, torch.linspace(-1, 1, 5))
    # an even count has no centre at 0: the one nearest it (float64 linspace: +1/3 by an ulp) moves there
    assert torch.equal(cb.solve_codebook(torch.zeros(64, dtype=torch.int64), 4), torch.tensor([-1.0, -1 / 3, 0.0, 1.0]))


def test_exact_zero_keeps_the_book_sorted_and_moves_one_centre():
    rng = np.random.default_rng(5)
    for _ in range(200):
        k = int(rng.integers(3, 20))
        inner = np.sort(rng.uniform(-1, 1, k - 2) * rng.choice([1.0, 0.01]))
        book = np.concatenate(([-1.0], inner, [1.0]))
        zeroed = cb.with_exact_zero(book)
        assert (np.diff(zeroed) >= 0).all() and (zeroed == 0).sum() == 1
        moved = np.flatnonzero(zeroed != book)
        assert len(moved) <= 1 and (len(moved) == 0 or abs(book[moved[0]]) == np.abs(inner).min())


def test_two_codes_are_just_the_ends():
    assert torch.equal(cb.solve_codebook(torch.arange(32), 2), torch.tensor([-1.0, 1.0]))


def test_solve_rejects_tiny_codebook():
    with pytest.raises(ValueError):
        cb.solve_codebook(torch.ones(8, dtype=torch.int64), 1)


def exact_nearest(xs, book):
    """argmin |x - c| in exact rational arithmetic, ties to the lower index."""
    cs = [Fraction(float(c)) for c in book]
    out = []
    for x in xs:
        fx = Fraction(float(x))
        out.append(min(range(len(cs)), key=lambda i: (abs(fx - cs[i]), i)))
    return out


def test_nearest_code_is_exact_argmin_with_low_ties():
    rng = np.random.default_rng(2)
    learned = cb.solve_codebook(torch.from_numpy(random_counts(rng, 256)), 16)
    # awkward spacing: fp32 sums of neighbours round, so naive fp32 midpoints are off by an ulp
    awkward = torch.tensor([-1.0, -0.3, -(2.0**-30), 2.0**-40, 1e-3, 0.1, 1 - 2.0**-24, 1.0])
    for book in (learned, awkward):
        down = up = (book[:-1] + book[1:]) / 2
        near_mids = [down]
        for _ in range(2):
            down, up = torch.nextafter(down, torch.tensor(-2.0)), torch.nextafter(up, torch.tensor(2.0))
            near_mids += [down, up]
        x = torch.cat([torch.rand(1500) * 2 - 1, book, *near_mids, torch.tensor([-1.0, 0.0, 1.0])])
        codes = cb.nearest_code(x, book)
        assert codes.dtype == torch.uint8 and codes.shape == x.shape
        assert codes.tolist() == exact_nearest(x.tolist(), book)


def test_nearest_code_exact_midpoints_go_low():
    book = torch.tensor([-1.0, -0.5, -0.125, 0.0, 0.25, 0.75, 1.0])
    mids = (book[:-1] + book[1:]) / 2  # dyadic: exact in fp32, so these are true ties
    codes = cb.nearest_code(mids.view(2, 3), book)
    assert codes.tolist() == [[0, 1, 2], [3, 4, 5]]
    up = cb.nearest_code(torch.nextafter(mids, torch.tensor(2.0)), book)
    assert up.tolist() == [1, 2, 3, 4, 5, 6]


def test_nearest_code_padded_codebook_and_bf16():
    book = torch.tensor([-1.0, 0.5, 1.0, 1.0, 1.0])
    x = torch.tensor([1.0, 0.9, -0.25, -0.2], dtype=torch.bfloat16)
    assert cb.nearest_code(x, book).tolist() == exact_nearest(x.float().tolist(), book)


def reference_histogram(blocks, num_bins):
    """One block and one element at a time, in numpy fp32 scalars, the documented formula."""
    counts = np.zeros(num_bins, dtype=np.int64)
    for block in blocks.float().reshape(-1, blocks.shape[-1]).numpy():
        scale = np.abs(block).max()
        for v in block:
            x = v / scale if scale > 0 else np.float32(0)
            b = math.floor((x + np.float32(1)) / np.float32(2) * np.float32(num_bins))
            counts[min(max(b, 0), num_bins - 1)] += 1
    return counts


@pytest.mark.parametrize("num_bins", [64, 7])
def test_histogram_matches_reference(num_bins, monkeypatch):
    blocks = torch.randn(3, 10, 8) * torch.rand(3, 10, 1) ** 4
    blocks[0, 2] = 0.0  # all-zero block: every element lands in the bin of x = 0
    blocks[1, :, 3] = blocks[1].abs().amax(-1)  # exact maxima: x = +1 clamps into the top bin
    expected = reference_histogram(blocks, num_bins)
    assert expected[num_bins // 2] >= 8
    monkeypatch.setattr(cb, "_HIST_CHUNK", 24)  # exercise several chunks
    counts = cb.histogram_normalised_blocks(blocks, num_bins)
    assert counts.dtype == torch.int64
    np.testing.assert_array_equal(counts.numpy(), expected)
    bf16 = blocks.bfloat16()
    np.testing.assert_array_equal(
        cb.histogram_normalised_blocks(bf16, num_bins).numpy(), reference_histogram(bf16, num_bins)
    )


def test_histogram_all_zero_and_empty():
    counts = cb.histogram_normalised_blocks(torch.zeros(4, 5), 10)
    assert counts.tolist() == [0] * 5 + [20] + [0] * 4
    assert cb.histogram_normalised_blocks(torch.zeros(0, 4), 10).sum() == 0


def test_learn_codebook_sums_and_all_reduces():
    a, b = torch.randn(50, 16), torch.randn(20, 16)
    both = cb.histogram_normalised_blocks(torch.cat([a, b]), 16 * 8)
    reduced = []

    def all_reduce(counts):  # two identical ranks: an exact integer sum doubles the counts
        reduced.append(counts.clone())
        counts.mul_(2)

    book = cb.learn_codebook([a, b], codebook_size=8, bins_per_code=16, all_reduce=all_reduce)
    assert torch.equal(reduced[0], both)
    assert torch.equal(book, cb.solve_codebook(both, 8))  # scaling every count is exact


def test_native_speed_4096_bins_256_codes():
    """Design target (docs/design.md 12): < 50 ms on one core; asserted at 100 ms to absorb noisy CI machines."""
    x = bin_centres(4096)
    counts = torch.from_numpy(np.round(1e6 * np.exp(-(x**2) / (2 * 0.2**2))).astype(np.int64) + 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            cb.solve_codebook(counts, 256)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    median = statistics.median(times)
    print(f"solve_codebook 4096 bins x 256 codes: median {median * 1e3:.1f} ms")
    assert cb._native is not None
    assert median < 0.1
