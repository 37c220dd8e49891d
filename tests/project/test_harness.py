"""The distributed test harness itself: results in rank order, fast failure, timeouts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import run


def _sum_of_ranks(rank: int, world_size: int, scale: int) -> int:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t)


def _rank1_raises_rank0_waits(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("injected on rank 1")
    dist.barrier()  # never completes: rank 1 is gone


def _rank1_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _hangs(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_results_come_back_in_rank_order():
    assert run(_sum_of_ranks, 3, 10) == [30, 30, 30]


def test_a_raising_rank_fails_the_run_without_waiting_for_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="^rank 1 of _rank1_raises_rank0_waits failed(.|\n)*injected on rank 1"):
        run(_rank1_raises_rank0_waits, 2, timeout=100)
    assert time.monotonic() - start < 60


def test_a_rank_that_dies_is_reported():
    with pytest.raises(RuntimeError, match="^rank 1 of _rank1_dies died without a result .exit code 3"):
        run(_rank1_dies, 2, timeout=100)


def test_a_hang_times_out():
    with pytest.raises(TimeoutError, match="exceeded 3"):
        run(_hangs, 2, timeout=3)


def _environment(rank: int, world_size: int) -> tuple[str | None, int]:
    return os.environ.get("GEFEN_HARNESS_PROBE"), hash("a string")


def test_each_rank_starts_with_its_own_environment():
    """``rank_env`` reaches each rank's interpreter before it starts (PYTHONHASHSEED is read then)."""
    got = run(_environment, 2, rank_env=[{"GEFEN_HARNESS_PROBE": "a", "PYTHONHASHSEED": "1"},
                                         {"GEFEN_HARNESS_PROBE": "b", "PYTHONHASHSEED": "1"}])
    assert [probe for probe, _ in got] == ["a", "b"] and got[0][1] == got[1][1]
    assert "GEFEN_HARNESS_PROBE" not in os.environ
    with pytest.raises(ValueError, match="rank_env has 1 entries for 2 ranks"):
        run(_environment, 2, rank_env=[{}])
