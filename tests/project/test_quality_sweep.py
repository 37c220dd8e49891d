"""bench_quality's sweep bookkeeping (no training): which rates extend the grid, which runs get a
second seed, and the best-vs-best and near-best ratios computed from them."""

from __future__ import annotations

from benchmarks.bench_quality import sweep_extensions, sweep_second_seeds, sweep_summary


def _run(name, lr, seed, loss):
    return {"text": "t", "optimizer": name, "seed": seed, "held_out": loss, "task": {"lr": lr}}


def test_second_seeds_are_each_ones_best_two_and_adamws_near_best_rates():
    seed0 = [_run("adamw", 1e-3, 0, 3.0), _run("adamw", 2e-3, 0, 2.0), _run("adamw", 4e-3, 0, 2.09),
             _run("gefen", 1e-3, 0, 2.0), _run("gefen", 2e-3, 0, 2.5), _run("gefen", 4e-3, 0, 2.6),
             _run("muon", 1e-3, 0, 1.0), _run("muon", 2e-3, 0, 1.1), _run("muon", 4e-3, 0, 0.9)]
    todo = sweep_second_seeds(seed0)
    assert {(n, lr) for _, n, lr in todo} == {("adamw", 2e-3), ("adamw", 4e-3), ("gefen", 1e-3),
                                              ("gefen", 2e-3), ("gefen", 4e-3), ("muon", 1e-3),
                                              ("muon", 4e-3)}


def test_a_best_at_the_edge_extends_that_optimizers_grid_by_a_factor_of_two():
    runs = [_run("adamw", 1e-3, 0, 3.0), _run("adamw", 2e-3, 0, 2.0), _run("adamw", 4e-3, 0, 2.09),
            _run("muon", 1e-3, 0, 1.2), _run("muon", 2e-3, 0, 1.1), _run("muon", 4e-3, 0, 0.9),
            _run("gefen", 1e-3, 0, 2.0), _run("gefen", 2e-3, 0, 2.5), _run("gefen", 4e-3, 0, 2.6),
            _run("muon", 4e-3, 1, 0.1)]  # seed 1 does not decide the extension
    assert sweep_extensions(runs) == [("t", "gefen", 5e-4), ("t", "muon", 8e-3)]
    runs.append(_run("muon", 8e-3, 0, 0.95))
    runs.append(_run("gefen", 5e-4, 0, 2.1))
    assert sweep_extensions(runs) == []  # both bests are now interior


def test_summary_best_vs_best_uses_two_seed_means_and_own_rates():
    runs = [_run("adamw", 1e-3, 0, 2.0), _run("adamw", 1e-3, 1, 2.2), _run("adamw", 2e-3, 0, 2.1),
            _run("adamw", 2e-3, 1, 2.0), _run("gefen", 1e-3, 0, 2.3), _run("gefen", 1e-3, 1, 2.3),
            _run("gefen", 2e-3, 0, 2.02), _run("gefen", 2e-3, 1, 2.04), _run("gefen", 4e-3, 0, 1.0)]
    s = sweep_summary(runs)["t"]
    assert s["best"]["adamw"] == {"lr": 2e-3, "mean": 2.05, "bracketed": False}  # its largest rate
    assert s["best"]["gefen"]["lr"] == 2e-3  # 4e-3 has one seed only: not a "best"
    assert s["best"]["gefen"]["bracketed"]  # 1e-3 < 2e-3 < 4e-3
    assert abs(s["best_vs_best"]["gefen"] - 2.03 / 2.05) < 1e-12
    near = s["near_adamw_best"]["gefen"]  # AdamW's seed 0 within 5% of its best at both rates
    assert set(near) == {1e-3, 2e-3} and near[1e-3]["seeds"] == [0, 1]
    assert abs(near[1e-3]["ratio"] - 4.6 / 4.2) < 1e-12


def test_ranking_compares_the_ratio_at_each_rate_on_both_sizes(monkeypatch):
    from benchmarks import bench_quality as bq

    big, small = bq.Task(), bq.SWEEP_TASK
    loss = {(big.steps, "adamw"): {2e-3: 2.0, 8e-3: 1.7, 1.6e-2: 1.9}, (big.steps, "gefen"): {2e-3: 1.98, 8e-3: 1.71},
            (small.steps, "adamw"): {2e-3: 2.7, 8e-3: 2.5, 1.6e-2: 2.46}, (small.steps, "gefen"): {2e-3: 2.7, 8e-3: 2.5}}

    def fake_jobs(jobs, workers):  # seed s adds 0.01 s to AdamW's loss and 0.02 s to Gefen's
        return [{"text": t, "optimizer": n, "seed": s, "task": {"steps": task.steps, "lr": task.lr},
                 "held_out": loss[(task.steps, n)][task.lr] + s * (0.01 if n == "adamw" else 0.02)}
                for t, n, s, task in jobs if task.lr in loss[(task.steps, n)]]

    monkeypatch.setattr(bq, "run_jobs", fake_jobs)
    out = bq.ranking_section(big, small)
    assert set(out["data"]["ratios"]) == {f"{s}-{lr:g}" for s in (big.steps, small.steps) for lr in (2e-3, 8e-3)}
    assert abs(out["data"]["ratios"][f"{big.steps}-0.002"] - 0.99) < 1e-12  # 1.6e-2 lacks Gefen: left out
    assert out["data"]["adamw_best"] == {big.steps: 8e-3, small.steps: 8e-3}
    assert "differ by at most 0.0100" in out["markdown"]
    seeds = out["data"]["seeds"]  # six seeds at the big task's AdamW-best rate, paired
    per_seed = [(1.71 + 0.02 * k) / (1.7 + 0.01 * k) for k in range(6)]
    assert seeds["lr"] == 8e-3 and seeds["seeds"] == list(range(6))
    assert abs(seeds["of_means"] - sum(1.71 + 0.02 * k for k in range(6)) / sum(1.7 + 0.01 * k for k in range(6))) < 1e-12
    assert abs(seeds["mean_ratio"] - sum(per_seed) / 6) < 1e-12
    assert 0 < seeds["stderr"] < max(per_seed) - min(per_seed)
    assert "with 6 seeds" in out["markdown"]
