"""`make bench` discovers every benchmarks/bench_*.py and calls ``run(quick)``: each module must
keep that convention (a module that breaks it fails the whole page)."""

from __future__ import annotations

import importlib
import inspect
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import run_all


@pytest.mark.parametrize("name", run_all.discover())
def test_every_benchmark_module_follows_the_run_convention(name):
    module = importlib.import_module(f"benchmarks.bench_{name}")
    assert list(inspect.signature(module.run).parameters) == ["quick"], name


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_script_parses():
    """benchmarks/gpu.sh runs only on a GPU machine: at least its syntax is checked everywhere."""
    out = subprocess.run(["bash", "-n", str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.sh")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures for minutes on a GPU")
def test_cuda_section_without_a_device_says_how_to_measure():
    from benchmarks import bench_cuda

    section = bench_cuda.run(quick=True)
    run_all._check(section)
    assert "gpu.sh" in section["markdown"]


@pytest.mark.triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="gpu.sh measures on the GPU")
def test_gpu_benchmark_dry_run_on_cpu(tmp_path, monkeypatch):
    """gpu.sh's Python parts on a tiny model: bench_cuda --smoke (bf16; fp32 differs only in the
    dtype; the Triton rows in Triton's interpreter when TRITON_INTERPRET=1) and the docs section
    rendered from its JSON."""
    pytest.importorskip("triton")
    from benchmarks import bench_cuda
    from gefen.triton import dispatch

    monkeypatch.setattr(dispatch, "DEVICES", set(dispatch.DEVICES))  # --smoke may add "cpu"
    bench_cuda.main(["--smoke", "--dtype", "bfloat16", "--out", str(tmp_path)])
    monkeypatch.setenv("GEFEN_CUDA_RESULTS", str(tmp_path))
    section = bench_cuda.run(quick=True)
    run_all._check(section)
    assert "### bfloat16 parameters" in section["markdown"] and "| Gefen (Triton) |" in section["markdown"]
    results = json.loads((tmp_path / "cuda_bfloat16.json").read_text())["results"]
    # the m8 rows ran the kernels: both phases for the factored form, phase 2 alone for the per-block one
    for kind, phases in (("Gefen m8 (Triton)", {"phase1", "phase2"}), ("Gefen m8 block v (Triton)", {"phase2"})):
        assert f"| {kind} |" in section["markdown"] and set(results[kind]["kernel_s"]) == phases, kind


def test_manifest_benchmark_writes_a_checkpoint_the_library_opens(tmp_path):
    """bench_manifest synthesises the state of its layout: the manifest must open and verify its
    geometry against the contract it names (it broke silently when the default layout changed)."""
    from benchmarks import bench_manifest
    from gefen_ckpt.io.storage import Store
    from gefen_ckpt.wire.manifest import open_checkpoint

    shapes = {"w": (8, 4), "b": (8,)}
    stats = bench_manifest.synthesize(tmp_path / "ckpt", shapes, ranks=3)
    parsed = open_checkpoint(Store(str(tmp_path / "ckpt")))
    assert sorted(parsed.raw["params"]) == sorted(shapes) and stats["ranks"] == 3


def test_io_benchmark_saves_the_default_state_with_safetensors(tmp_path):
    """The default (m4v4) state shares its codebooks between entries; the safetensors baseline
    must still write every key with its bytes."""
    from safetensors.torch import load_file, save_file

    import gefen
    from benchmarks.bench_io import flat

    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = gefen.Gefen([("w", p)], lr=1e-3)
    p.grad = torch.randn(16, 8)
    opt.step()
    tensors = flat(opt.state_dict())
    save_file(tensors, str(tmp_path / "s.safetensors"))
    back = load_file(str(tmp_path / "s.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_fused_benchmark_reports_its_targets_at_the_thread_counts_it_ran():
    """``bench_fused --threads 1,3`` (a machine with more cores): the targets read the 3-thread rows
    when no 2-thread row exists, and bad counts are refused before anything is measured."""
    from benchmarks import bench_fused
    from benchmarks.common import machine_limits

    assert bench_fused._threads_arg(["--quick"]) == bench_fused.THREADS
    assert bench_fused._threads_arg(["--threads", "1,3"]) == (1, 3)
    for bad in (["--threads"], ["--threads", "0,2"], ["--threads", "2,2"], ["--threads", "x"]):
        with pytest.raises(SystemExit, match="--threads"):
            bench_fused._threads_arg(bad)
    named = bench_fused._params([("w", (32, 48)), ("b", (48,))])
    grads = bench_fused.gradient_sets(named)
    sizes = {"tiny": {bench_fused._config_name(t, "m4v4", torch.float32): bench_fused._measure(named, grads, "m4v4", 1, 0)
                      for t in (1, 3)}}
    data = {"machine": machine_limits(size_mib=4, reps=1), "threads": [1, 3], "reps": 1, "eager_reps": 0,
            "quick": True, "native_available": True, "default": "m4v4 fp32, 3 threads", "sizes": sizes}
    markdown = bench_fused._markdown(data)
    assert "| Gefen fused / AdamW fused, 3 threads, every layout and dtype | <= 1.0x | worst" in markdown
    assert "tiny m4v4 fp32, 3 threads:" in markdown and "tiny m4v4 fp32, 1 thread:" not in markdown
