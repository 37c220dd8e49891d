/*
 * Exact 1-D weighted k-means with the two end centres pinned (see gefen/codebook.py).
 *
 * Plain C99, no Python C-API: gefen.codebook loads this shared object with ctypes, so the
 * same file also works when built by any C compiler outside setuptools.
 *
 * Points are the active histogram bins 0..n-1 in ascending order.  Inputs are float64
 * prefix arrays of length n + 1 (index i = sum over bins < i):
 *   W, S1, S2   prefix sums of w, w*x, w*x^2 (O(1) weighted SSE of any bin range),
 *   L[i]        cost of sending bins [0, i) to the pinned centre -1,
 *   R[j]        cost of sending bins [j, n) to the pinned centre +1.
 * With m = K - 2 free centres, D_t(j) = min_{i<j} D_{t-1}(i) + sse(i, j), D_0 = L, and the
 * answer is min_j D_m(j) + R(j).  sse satisfies the quadrangle inequality (also against
 * the pinned -1 prefix), so the leftmost argmin a_t(j) is monotone in j, which lets divide
 * and conquer solve a layer in O(n log n) instead of O(n^2), and a_{t-1}(j) <= a_t(j),
 * which prunes each scan from below (2.2x fewer evaluations for 4096 bins x 256 codes).
 * Ties go to the smaller split index everywhere.
 *
 * Output: cuts[0..m] with prefix = [0, cuts[0]), free segment t = [cuts[t], cuts[t+1]),
 * suffix = [cuts[m], n).  Requires n >= m >= 0.  threads: how many OpenMP threads a layer may
 * use (the cuts do not depend on it).  Returns 0, or -1 if out of memory.
 */
#include <stdint.h>
#include <stdlib.h>

#include "gefen_common.h"

typedef struct {
    const double *W, *S1, *S2, *prev; /* prev = D_{t-1} */
    double *cur;                      /* D_t */
    int32_t *arg;                     /* argmin row of layer t */
    const int32_t *prev_arg;          /* argmin row of layer t-1, NULL for t = 1 */
    int64_t prev_end;                 /* last j that layer t-1 solved */
} layer_t;

/* prev[i] + weighted SSE of bins [i, j).  Same operation order as _segment_cost in
 * gefen/codebook.py: keep them identical so both backends return identical cuts. */
static inline double split_cost(const layer_t *ly, int64_t i, double wj, double s1j, double s2j) {
    double w = wj - ly->W[i];
    double s1 = s1j - ly->S1[i];
    double s2 = s2j - ly->S2[i];
    return ly->prev[i] + (s2 - s1 * s1 / w);
}

/* Solve node mid (cur[mid], arg[mid]) knowing its argmin lies in [ilo, ihi]; returns the argmin. */
static int64_t solve_point(const layer_t *ly, int64_t mid, int64_t ilo, int64_t ihi) {
    int64_t top = ihi < mid - 1 ? ihi : mid - 1;
    int64_t start = ilo;
    if (ly->prev_arg && mid <= ly->prev_end && ly->prev_arg[mid] > start)
        start = ly->prev_arg[mid] < top ? ly->prev_arg[mid] : top;
    double wj = ly->W[mid], s1j = ly->S1[mid], s2j = ly->S2[mid];
    int64_t best = start;
    double best_cost = split_cost(ly, start, wj, s1j, s2j);
    for (int64_t i = start + 1; i <= top; ++i) {
        double c = split_cost(ly, i, wj, s1j, s2j);
        int better = c < best_cost; /* strict: ties keep the smaller split */
        best = better ? i : best;
        best_cost = better ? c : best_cost;
    }
    ly->cur[mid] = best_cost;
    ly->arg[mid] = (int32_t)best;
    return best;
}

/* Fill cur[j], arg[j] for j in [jlo, jhi] knowing the argmin lies in [ilo, ihi]. */
static void solve_range(const layer_t *ly, int64_t jlo, int64_t jhi, int64_t ilo, int64_t ihi) {
    while (jlo <= jhi) {
        int64_t mid = jlo + (jhi - jlo) / 2;
        int64_t best = solve_point(ly, mid, ilo, ihi);
        /* Recurse into the smaller half, loop on the other: bounded stack depth. */
        if (mid - jlo < jhi - mid) {
            solve_range(ly, jlo, mid - 1, ilo, best);
            jlo = mid + 1;
            ilo = best;
        } else {
            solve_range(ly, mid + 1, jhi, best, ihi);
            jhi = mid - 1;
            ihi = best;
        }
    }
}

/* Threads: the top PAR_DEPTH levels of a layer's recursion tree are solved first, in order; the
 * subtrees below them read only those nodes' results and write disjoint j, so they run in any
 * order on any thread and every node sees the bounds the serial recursion gives it: the same
 * cuts on every thread count. */
#define PAR_DEPTH 3     /* up to 8 independent subtrees per layer */
#define PAR_MIN_BINS 512 /* below this a layer is too small to share */
typedef struct {
    int64_t jlo, jhi, ilo, ihi;
} range_t;

static int split_top(const layer_t *ly, int64_t jlo, int64_t jhi, int64_t ilo, int64_t ihi, int depth,
                     range_t *out, int k) {
    if (jlo > jhi) return k;
    if (depth == 0) {
        out[k] = (range_t){jlo, jhi, ilo, ihi};
        return k + 1;
    }
    int64_t mid = jlo + (jhi - jlo) / 2;
    int64_t best = solve_point(ly, mid, ilo, ihi);
    k = split_top(ly, jlo, mid - 1, ilo, best, depth - 1, out, k);
    return split_top(ly, mid + 1, jhi, best, ihi, depth - 1, out, k);
}

static void solve_layer(const layer_t *ly, int64_t jlo, int64_t jhi, int64_t ilo, int64_t ihi, int threads) {
    if (threads < 2 || jhi - jlo < PAR_MIN_BINS) {
        solve_range(ly, jlo, jhi, ilo, ihi);
        return;
    }
    range_t r[1 << PAR_DEPTH];
    int k = split_top(ly, jlo, jhi, ilo, ihi, PAR_DEPTH, r, 0);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int q = 0; q < k; ++q) solve_range(ly, r[q].jlo, r[q].jhi, r[q].ilo, r[q].ihi);
}

GEFEN_EXPORT int gefen_kmeans_dp(int64_t n, int64_t m, const double *W, const double *S1,
                                 const double *S2, const double *L, const double *R,
                                 int64_t *cuts, int32_t threads) {
    double *prev = malloc((size_t)(n + 1) * sizeof(double));
    double *cur = malloc((size_t)(n + 1) * sizeof(double));
    int32_t *arg = malloc((size_t)(m + 1) * (size_t)(n + 1) * sizeof(int32_t));
    if (!prev || !cur || !arg) {
        free(prev);
        free(cur);
        free(arg);
        return -1;
    }
    for (int64_t i = 0; i <= n; ++i) prev[i] = L[i];
    for (int64_t t = 1; t <= m; ++t) {
        /* Segment t ends at j; bins [j, n) must still hold the m - t later segments. */
        layer_t ly = {W, S1, S2, prev, cur, arg + t * (n + 1),
                      t > 1 ? arg + (t - 1) * (n + 1) : NULL, n - (m - t + 1)};
        solve_layer(&ly, t, n - (m - t), t - 1, n - (m - t) - 1, threads);
        double *tmp = prev;
        prev = cur;
        cur = tmp;
    }
    int64_t best = m;
    double best_cost = prev[m] + R[m];
    for (int64_t j = m + 1; j <= n; ++j) {
        double c = prev[j] + R[j];
        if (c < best_cost) {
            best_cost = c;
            best = j;
        }
    }
    cuts[m] = best;
    for (int64_t t = m; t >= 1; --t) cuts[t - 1] = arg[t * (n + 1) + cuts[t]];
    free(prev);
    free(cur);
    free(arg);
    return 0;
}
