"""The decoded second moment against an exact EMA of g^2 trained beside it (``benchmarks.v_fidelity``).

A small character LM (the short task of ``test_quality_lm.py``: d = 64, 2 layers, 150 steps) is
trained with the default Gefen while an exact fp32 EMA of g^2 runs on the same gradients. Over
every coded matrix's elements, the second moment the last step used must be unbiased within 3%:
mean ``log(v_decoded / v_exact)`` within +-0.03 and the mean step-size factor
``(sqrt(v_exact) + eps) / (sqrt(v_decoded) + eps)`` within [0.97, 1.03]. Measured (torch 2.13,
CPU), seeds 0 / 1: log ratio +0.013 / +0.015, step factor 1.013 / 1.013. Rounding unbiased in v
(``V_POWER = 1``; with the learned codebook it had: -0.111 and 1.088) fails the bound, which
the second test pins so the first cannot pass vacuously.
"""

from __future__ import annotations

import pytest

from benchmarks.bench_quality import corpus
from benchmarks.v_fidelity import probe

pytestmark = pytest.mark.usefixtures("one_thread")

BOUND = 0.03


@pytest.mark.parametrize("seed", [0, 1])
def test_decoded_second_moment_is_unbiased_within_three_percent(seed):
    r = probe("stdlib", seed, data=corpus("stdlib"))
    report = {k: r[k] for k in ("mean_log_ratio", "step_factor", "step_factor_p999", "log_ratio_std")}
    assert abs(r["mean_log_ratio"]) <= BOUND, report
    assert abs(r["step_factor"] - 1) <= BOUND, report
    assert r["step_factor_p999"] < 3.0, report  # no rare code makes a rare large step


def test_rounding_unbiased_in_v_fails_the_bound(monkeypatch):
    """The same probe with the rounding unbiased in v (curvatures 0) shows the Jensen gap: steps
    too large by more than the bound, the log ratio below it."""
    monkeypatch.setattr("gefen.stochastic.V_POWER", 1.0)
    r = probe("stdlib", 0, data=corpus("stdlib"))
    assert r["step_factor"] > 1 + BOUND and r["mean_log_ratio"] < -BOUND, r
