"""Resharding a Gefen checkpoint: offline (the CLI) and at load time (collective ``gefen_ckpt.load``).

State: Gefen over transformer-shaped tensors (``common.transformer_shapes``, ~25M parameters;
~11M in quick mode) after two steps on random gradients with row/column structure
(``bench_io.gefen_state``), saved by one process (canonical layout).

* offline: ``python -m gefen_cli reshard SRC DST --world-size M --memory-budget 64MiB`` in a
  subprocess, for each target M. Wall time of the subprocess (interpreter start included; the
  same command's ``--dry-run`` wall time is shown as the start-up baseline: the plan, no tensor
  data, in a process that imports torch first as a reshard does), MB/s = state bytes / wall time, peak RSS =
  ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` read in a fresh wrapper process (as
  tests/cli/test_cli_reshard.py does) next to the dry run's peak RSS. Fidelity: ``gefen_ckpt.read`` of source and result, every
  tensor compared bit for bit.
* distributed load: the 2-rank sharded checkpoint (the offline 1 -> 2 result) is loaded with
  ``gefen_ckpt.load`` onto M real gloo ranks (tests/distributed.py) whose parameters are
  DTensor ``Shard(0)`` of the same shapes. Per rank: load time and extra peak RSS during the
  load (psutil, sampled every 2 ms); the table shows the max over ranks. Fidelity: every
  rank's exported local rows (``export_canonical``) against the same rows of the source.

Only numbers measured in this run are shown (no figures copied from elsewhere). The machine is
shared and loaded, so times are noisy.

Writes ``benchmarks/out/reshard.json`` and ``benchmarks/out/reshard.png``; ``run(quick)``
returns the ``run_all`` section. Run alone with ``python -m benchmarks.bench_reshard [--quick]``.
"""

from __future__ import annotations

import gc
import importlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_reshard.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gefen_ckpt
from benchmarks.common import ROOT, PeakRSS, gefen_state, md_table, plot, transformer_shapes, write_json

SCRATCH = Path(__file__).resolve().parent / "scratch"
BUDGET = "64MiB"

_PEAK = """
import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


# ----- the state --------------------------------------------------------------------------------
def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ----- offline ----------------------------------------------------------------------------------
#: The dry run plans from the manifest alone and imports no torch; the baseline imports it first,
#: as a reshard that moves tensor data does, so the two peaks differ by the data in flight.
_WITH_TORCH = "import sys, torch; sys.argv[0] = 'gefen-ckpt'; from gefen_cli.app import main; main()"


def cli(*args: str, torch_first: bool = False) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``python -m gefen_cli ARGS`` measured by a fresh wrapper
    (``torch_first``: with torch imported before the CLI starts)."""
    command = ["-c", _WITH_TORCH] if torch_first else ["-m", "gefen_cli"]
    out = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, *command, *args],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    seconds, rss = out.stdout.split()[-2:]
    return float(seconds), int(rss)


def compare_states(a_url: str, b_url: str) -> float:
    """Max abs difference over every tensor of two checkpoints (0.0 = bit-exact; inf on a
    shape/dtype/key mismatch). Bit-exactness is checked with ``torch.equal`` on the raw bytes."""
    a, b = gefen_ckpt.read(a_url), gefen_ckpt.read(b_url)
    ta, tb = dict(a.tensors()), dict(b.tensors())
    if set(ta) != set(tb):
        return float("inf")
    worst = 0.0
    for key, src in ta.items():
        x, y = src.read(), tb[key].read()
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf")
        if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            worst = max(worst, _max_diff(x, y))
    return worst


def _max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.is_floating_point():
        return (x.double() - y.double()).abs().max().item()
    return (x.long() - y.long()).abs().max().item() if x.dtype != torch.bool else float((x != y).any())


def fidelity(diff: float) -> str:
    return "bit-exact" if diff == 0.0 else f"max abs diff {diff:.3g}"


# ----- distributed load -------------------------------------------------------------------------
def _load_worker(rank: int, world_size: int, size: int, ckpt: str, src: str) -> dict:
    """One rank: DTensor Shard(0) params of the benchmark's shapes, collective load, compare rows."""
    import ctypes

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gefen import Gefen

    mesh = init_device_mesh("cpu", (world_size,))
    params = []
    for name, shape in transformer_shapes(size):
        chunks = torch.chunk(torch.empty(shape[0], dtype=torch.uint8), world_size)  # torch.chunk rows
        rows = chunks[rank].numel() if rank < len(chunks) else 0
        local = torch.zeros((rows, *shape[1:]))
        contiguous = torch.empty(shape).stride()
        params.append((name, torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                                   shape=torch.Size(shape), stride=contiguous))))
    opt = Gefen(params, lr=1e-3)
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    torch.distributed.barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        gefen_ckpt.load(opt, ckpt)
        seconds = time.perf_counter() - start
    # fidelity: this rank's rows of every field against the same rows of the single-process source
    mine = gefen_ckpt.export_canonical(opt)
    source = gefen_ckpt.read(src)
    theirs = dict(source.tensors())
    worst, compared, missing = 0.0, 0, []
    for key, part in mine.tensors():
        if key not in theirs:
            missing.append(key)
            continue
        t = getattr(part, "tensor", None)
        if t is None:
            t = part.read()
            start_row = 0
        else:
            start_row = getattr(part, "row_start", 0)
        ref = theirs[key].read() if t.dim() == 0 else theirs[key].read(start_row, start_row + t.shape[0])
        if tuple(ref.shape) != tuple(t.shape) or ref.dtype != t.dtype:
            worst = float("inf")
        elif t.numel() and not torch.equal(t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
            worst = max(worst, _max_diff(t, ref))
        compared += t.numel() * t.element_size()
    return {"seconds": seconds, "extra_rss": rss.extra, "max_diff": worst, "bytes_compared": compared,
            "missing": missing, "state_keys": len(theirs)}


def distributed_load(size: int, ckpt: str, src: str, world_size: int) -> list[dict]:
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from distributed import run as dist_run

    worker = importlib.import_module("benchmarks.bench_reshard")._load_worker  # pickles by module name
    return dist_run(worker, world_size, size, ckpt, src, timeout=240.0)


# ----- run --------------------------------------------------------------------------------------
def run(quick: bool) -> dict:
    torch.set_num_threads(2)
    size = 8 if quick else 25
    offline_targets = (2, 3) if quick else (2, 3, 4)
    load_targets = (1, 3) if quick else (1, 3, 4)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(dir=SCRATCH))
    data: dict = {"quick": quick, "size_M": size, "budget": BUDGET}
    try:
        t0 = time.perf_counter()
        params, opt = gefen_state(size)
        data["params"] = sum(p.numel() for _, p in params)
        data["state_bytes"] = state_bytes = gefen_ckpt.export_canonical(opt).total_bytes()
        src = root / "src"
        gefen_ckpt.save(opt, str(src))
        data["source_bytes_on_disk"] = size_of(src)
        data["state_build_s"] = time.perf_counter() - t0
        del params, opt
        gc.collect()

        base_s, base_rss = cli("reshard", str(src), str(root / "dry"), "--world-size", "2", "--dry-run",
                               torch_first=True)
        data["dry_run"] = {"seconds": base_s, "peak_rss": base_rss}
        offline = {}
        for m in offline_targets:
            dst = root / f"ws{m}"
            seconds, rss = cli("reshard", str(src), str(dst), "--world-size", str(m), "--memory-budget", BUDGET)
            net = seconds - base_s
            offline[m] = {"seconds": seconds, "MBps": state_bytes / seconds / 1e6, "peak_rss": rss,
                          "net_seconds": net, "net_MBps": state_bytes / net / 1e6 if net > 0 else None,
                          "rss_over_dry_run": rss - base_rss, "bytes_on_disk": size_of(dst),
                          "world_size_in_manifest": gefen_ckpt.read_manifest(str(dst))["world_size"],
                          "max_diff": compare_states(str(src), str(dst))}
        data["offline"] = offline

        two = str(root / "ws2")
        loads = {}
        for m in load_targets:
            t = time.perf_counter()
            ranks = distributed_load(size, two, str(src), m)
            loads[m] = {"ranks": ranks, "wall_s": time.perf_counter() - t,
                        "max_seconds": max(r["seconds"] for r in ranks),
                        "max_extra_rss": max(r["extra_rss"] for r in ranks),
                        "max_diff": max(r["max_diff"] for r in ranks),
                        "missing": sorted({k for r in ranks for k in r["missing"]}),
                        "bytes_compared": sum(r["bytes_compared"] for r in ranks)}
        data["load_from_2"] = {"checkpoint_bytes": size_of(Path(two)), "targets": loads}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json("reshard", data)
    return {"title": "Resharding: offline CLI and load onto another world size",
            "markdown": _markdown(data), "plots": [str(_plot(data))], "data": data}


def _plot(data: dict) -> Path:
    groups = {}
    for m, r in data["load_from_2"]["targets"].items():
        groups[f"load 2->{m}"] = {"time (s)": r["max_seconds"], "extra RSS (100 MB)": r["max_extra_rss"] / 1e8}
    for m, r in data["offline"].items():
        groups[f"CLI 1->{m}"] = {"time (s)": r["seconds"], "extra RSS (100 MB)": r["rss_over_dry_run"] / 1e8}
    return plot("reshard", groups, ylabel="seconds / 100 MB (max over ranks)",
                title=f"Reshard of a {data['params'] / 1e6:.1f}M-param Gefen state (lower is better)")


def _markdown(data: dict) -> str:
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    head = (f"State: {data['params'] / 1e6:.1f}M parameters, Gefen after 2 steps; "
            f"{mb(data['state_bytes'])} MB of compressed state, {mb(data['source_bytes_on_disk'])} MB on disk "
            f"(single-process save). The machine is shared and loaded: times are noisy.")
    off_rows = [[f"1 -> {m}", f"{r['seconds']:.2f}", f"{r['MBps']:.1f}",
                 f"{r['net_MBps']:.0f}" if r["net_MBps"] else "n/a (within start-up noise)", f"{r['peak_rss'] / 2**20:.0f}",
                 f"{r['rss_over_dry_run'] / 2**20:+.0f}", mb(r["bytes_on_disk"]), fidelity(r["max_diff"])]
                for m, r in data["offline"].items()]
    off = md_table(["reshard (CLI, budget " + data["budget"] + ")", "wall s", "MB/s of state",
                    "MB/s net of the dry run", "peak RSS MiB",
                    "vs dry run MiB", "MB on disk", "fidelity"], off_rows)
    base = (f"`reshard --dry-run` baseline (the plan, no tensor data, in a process that imported torch as a "
            f"reshard does): "
            f"{data['dry_run']['seconds']:.2f} s, peak RSS {data['dry_run']['peak_rss'] / 2**20:.0f} MiB. "
            "Wall times include that start-up.")
    ld = data["load_from_2"]
    rows = []
    for m, r in ld["targets"].items():
        fid = fidelity(r["max_diff"]) + (f" (missing {len(r['missing'])} keys)" if r["missing"] else "")
        rows.append(["gefen_ckpt.load (gloo, DTensor Shard(0))", f"2 -> {m}", mb(ld["checkpoint_bytes"]),
                     f"{r['max_seconds']:.2f}", f"+{r['max_extra_rss'] / 1e6:.0f}", fid])
    dist = md_table(["load", "ranks", "checkpoint MB on disk", "load s (max over ranks)",
                     "extra RSS MB per rank (max)", "fidelity vs source"], rows)
    checked = ", ".join(f"2 -> {m}: {mb(r['bytes_compared'])} MB" for m, r in ld["targets"].items())
    note = (f"Fidelity of the loads compares every rank's exported local rows with the same rows of the source "
            f"checkpoint (bytes compared over all ranks, replicated fields once per rank: {checked}).")
    return "\n\n".join([head, "Offline reshard through `python -m gefen_cli reshard` (a subprocess each):", off,
                        base, "Collective load of the 2-rank checkpoint onto other world sizes:",
                        dist, note])


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    print(result["markdown"])
