"""`make bench` discovers every benchmarks/bench_*.py and calls ``run(quick)``: each module must
keep that convention (a module that breaks it fails the whole page)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from benchmarks import run_all


@pytest.mark.parametrize("name", run_all.discover())
def test_every_benchmark_module_follows_the_run_convention(name):
    module = importlib.import_module(f"benchmarks.bench_{name}")
    assert list(inspect.signature(module.run).parameters) == ["quick"], name


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures for minutes on a GPU")
def test_cuda_section_without_a_device_says_how_to_measure():
    from benchmarks import bench_cuda

    section = bench_cuda.run(quick=True)
    run_all._check(section)
    assert "gpu.sh" in section["markdown"]
