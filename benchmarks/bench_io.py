"""Portable-format save/load throughput vs torch.save, safetensors and DCP, with the disk's limit.

State: Gefen over transformer-shaped tensors (``common.transformer_shapes``, ~25M and ~42M
parameters, and with ``--full`` (``make bench FULL=1``) ~400M parameters, a ~400 MB
compressed state, where fixed costs no longer dominate; not in the default run: building and
moving it takes minutes on 2 cores) after two steps on random gradients with row/column structure. For each size, and
for model + optimizer at the smaller size, every method saves and loads the same state in
interleaved rounds (so load drift on a shared machine hits all alike); numbers are medians.

* save: to a fresh location, ``fsync``'d (gefen_ckpt and DCP sync their files; torch.save and
  safetensors get an explicit ``fsync``). Model + optimizer with gefen_ckpt is
  ``gefen_ckpt.save(opt)`` plus ``safetensors.save_file(model)``.
* load (cold): page cache dropped for the checkpoint's files first (``posix_fadvise
  DONTNEED`` after ``fsync``); the state is read into memory: gefen_ckpt verifies every
  checksum (``stage_checkpoint(map_files=True)``, what ``gefen_ckpt.load`` stages for a Gefen
  optimizer: views of a private mapping of the files), torch.load (``weights_only=True``),
  safetensors ``load_file`` (also views of a private mapping, checksums none), DCP ``dcp.load``
  into a preallocated state dict (allocation not timed, to DCP's advantage).
* ``load -> optimizer``: end to end into a live Gefen: ``gefen_ckpt.load`` vs
  ``opt.load_state_dict(torch.load(...))``.
* busy thread (full runs): the 25M save/load/``load -> optimizer`` once more while another
  thread of the process runs Python, one round (the peers take seconds there).
* disk limits, the same byte counts: write ``dd if=/dev/zero bs=16M conv=fdatasync`` (what
  saves are compared with) and cold read, that file read back by ``dd of=/dev/null bs=16M``
  after dropping its page cache the way the loads do (what loads are compared with).
* peak RSS: extra resident memory during each operation (psutil, sampled every 2 ms by a
  thread), the median of ``RSS_ROUNDS`` extra rounds that are not timed: the sampling thread
  takes the GIL, which perturbed the timings.
* size: checkpoint bytes / in-memory compressed state bytes.

Writes ``benchmarks/out/io.json`` and ``benchmarks/out/io.png``; ``run(quick)`` returns the
``run_all`` section. Run alone with ``python -m benchmarks.bench_io [--quick]``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_io.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import gefen_ckpt
from benchmarks.common import PeakRSS, gefen_state, machine_limits, md_table, plot, write_json
from gefen import Gefen
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire.reader import stage_checkpoint

SIZES = (25, 42)
FULL_SIZE = 400  # ~400M parameters: a ~400 MB compressed state (--full only)
FULL_REPS = 3
RSS_ROUNDS = 3
METHODS = ("gefen_ckpt", "torch.save", "safetensors", "DCP")
SCRATCH = Path(__file__).resolve().parent / "scratch"


# ----- the state --------------------------------------------------------------------------------
def flat(sd: dict, prefix: str = "", seen: set | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict under a '/'-joined key (for safetensors), later aliases
    of a storage cloned: safetensors refuses shared tensors, and the m4v4 state's per-parameter
    codebooks are the shared ones (every key keeps its bytes; torch.save writes a shared storage once,
    a few KB less)."""
    out, seen = {}, set() if seen is None else seen
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/", seen))
        elif isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            out[f"{prefix}{k}"] = v.clone() if v.numel() and ptr in seen else v.contiguous()
            seen.add(ptr)
    return out


# ----- file-system helpers ----------------------------------------------------------------------
def files_of(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]


def fsync(path: Path) -> None:
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def drop_cache(path: Path) -> None:
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in files_of(path))


def dd_bandwidth(nbytes: int, where: Path) -> tuple[float, float]:
    """(write, cold read) bytes/s of ``dd`` on ``nbytes`` (rounded up to 16 MiB): written with
    ``conv=fdatasync``, then read back to /dev/null after ``drop_cache`` (as the loads are)."""
    count = max(1, -(-nbytes // (16 * 2**20)))
    target = where / "dd.bin"
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fdatasync"],
                   check=True, capture_output=True)
    write = time.perf_counter() - start
    drop_cache(target)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={target}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    read = time.perf_counter() - start
    target.unlink()
    return count * 16 * 2**20 / write, count * 16 * 2**20 / read


# ----- the methods ------------------------------------------------------------------------------
def methods(opt: Gefen, model_sd: dict | None) -> dict[str, tuple[Callable, Callable]]:
    """name -> (save(path), load(path) -> state in memory) for the optimizer (+ model) state."""
    osd = opt.state_dict()
    both = {"model": model_sd, "optim": osd} if model_sd is not None else osd
    template = {"model": {k: torch.empty_like(v) for k, v in model_sd.items()}} if model_sd is not None else {}

    def ours_save(path: Path):
        gefen_ckpt.save(opt, str(path / "optim"))
        if model_sd is not None:
            save_file(model_sd, str(path / "model.safetensors"))
            fsync(path / "model.safetensors")

    def ours_load(path: Path):
        state = stage_checkpoint(Store(str(path / "optim")), map_files=True)
        return state, load_file(str(path / "model.safetensors")) if model_sd is not None else None

    def torch_save(path: Path):
        with open(path / "state.pt", "wb") as f:
            torch.save(both, f)
            f.flush()
            os.fsync(f.fileno())

    def st_save(path: Path):
        save_file(flat(both), str(path / "state.safetensors"))
        fsync(path / "state.safetensors")

    def dcp_load(path: Path):
        sd = {**template, "optim": {"state": {i: {k: torch.empty_like(v) for k, v in s.items()}
                                              for i, s in osd["state"].items()},
                                    "param_groups": osd["param_groups"],
                                    "global_state": {k: torch.empty_like(v) for k, v in osd["global_state"].items()}}}
        if model_sd is None:
            sd = sd["optim"]
        start = time.perf_counter()
        dcp.load(sd, checkpoint_id=str(path / "dcp"), no_dist=True)
        return time.perf_counter() - start

    return {
        "gefen_ckpt": (ours_save, ours_load),
        "torch.save": (torch_save, lambda path: torch.load(path / "state.pt", weights_only=True)),
        "safetensors": (st_save, lambda path: load_file(str(path / "state.safetensors"))),
        "DCP": (lambda path: dcp.save(both, checkpoint_id=str(path / "dcp"), no_dist=True), dcp_load),
    }


def touch(obj) -> None:
    """Read one byte per 4 KiB page of every tensor in ``obj``: a load that maps files lazily
    (safetensors) must really have read the data by the time the clock stops. Through ctypes,
    not torch ops: those release the GIL, which the busy-thread rows must not be charged for."""
    if isinstance(obj, torch.Tensor):
        obj = obj if obj.is_contiguous() else obj.contiguous()  # kept alive while it is read
        start, nbytes = obj.data_ptr(), obj.numel() * obj.element_size()
        sum(ctypes.c_ubyte.from_address(a).value for a in range(start, start + nbytes, 4096))
    elif isinstance(obj, dict):
        for v in obj.values():
            touch(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            touch(v)
    elif isinstance(obj, gefen_ckpt.CanonicalState):
        for _, src in obj.tensors():
            touch(src.read())


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``), so the next
    operation's RSS growth shows its own allocations rather than reuse of earlier ones."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def timed(fn: Callable, *args, rss: bool = False) -> tuple[float, int]:
    """(seconds, extra peak RSS bytes or 0) of ``fn(*args)``, including touching what it returns;
    a float it returns is its own timing. ``rss`` samples memory in a thread, whose GIL use
    perturbs the timing: measure time and memory in separate rounds."""
    release_freed_memory()
    with PeakRSS() if rss else nullcontext() as sampler:
        start = time.perf_counter()
        result = fn(*args)
        touch(result)
        seconds = time.perf_counter() - start
    return (result if isinstance(result, float) else seconds), sampler.extra if rss else 0


def measure(label: str, opt: Gefen, model_sd: dict | None, state_bytes: int, reps: int, root: Path,
            rss_rounds: int = RSS_ROUNDS) -> dict:
    impls = methods(opt, model_sd)
    times = {m: {"save": [], "load": []} for m in METHODS}
    rss = {m: {"save": [], "load": []} for m in METHODS}
    sizes = {}
    for rep in range(reps + rss_rounds):  # the last rounds sample peak RSS instead of timing
        sampling = rep >= reps
        for m in METHODS:  # interleaved: every method once per round
            save, load = impls[m]
            path = root / f"{label}-{m}-{rep}".replace(" ", "_").replace("+", "")
            path.mkdir(parents=True)
            for op, fn in (("save", save), ("load", load)):
                seconds, extra = timed(fn, path, rss=sampling)
                if sampling:
                    rss[m][op].append(extra)
                else:
                    times[m][op].append(seconds)
                if op == "save":
                    sizes[m] = size_of(path)
                    drop_cache(path)
            shutil.rmtree(path)
    out = {"state_bytes": state_bytes, "checkpoint_bytes": sizes, "peak_extra_rss_rounds": rss, "seconds": times,
           "peak_extra_rss": {m: {op: statistics.median(v) for op, v in ops.items()} for m, ops in rss.items()}}
    out["save_MBps"] = {m: state_bytes / statistics.median(t["save"]) / 1e6 for m, t in times.items()}
    out["load_MBps"] = {m: state_bytes / statistics.median(t["load"]) / 1e6 for m, t in times.items()}
    return out


def _torch_load_into(opt: Gefen, path: Path) -> None:
    opt.load_state_dict(torch.load(path, weights_only=True))


def end_to_end_seconds(opt: Gefen, reps: int, root: Path) -> dict[str, list[float]]:
    """Cold loads into the live optimizer, seconds: gefen_ckpt.load vs load_state_dict(torch.load())."""
    ours, pt = root / "e2e-ours", root / "e2e.pt"
    gefen_ckpt.save(opt, str(ours))
    with open(pt, "wb") as f:
        torch.save(opt.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    runs = {"gefen_ckpt.load": [], "torch.load + load_state_dict": []}
    for _ in range(reps):
        drop_cache(ours)
        runs["gefen_ckpt.load"].append(timed(gefen_ckpt.load, opt, str(ours))[0])
        drop_cache(pt)
        runs["torch.load + load_state_dict"].append(timed(_torch_load_into, opt, pt)[0])
    shutil.rmtree(ours)
    pt.unlink()
    return runs


def end_to_end_load(opt: Gefen, reps: int, root: Path, state_bytes: int) -> dict:
    """MB/s of state for ``end_to_end_seconds`` (medians)."""
    return {k: state_bytes / statistics.median(v) / 1e6 for k, v in end_to_end_seconds(opt, reps, root).items()}


@contextmanager
def busy_python_thread():
    """Another thread of the process running Python the whole time (a data-loading or logging
    thread): every GIL release of the measured code then waits a switch interval (5 ms)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def contended(opt: Gefen, root: Path) -> dict:
    """Seconds to save, load (cold) and load into the optimizer with a busy Python thread: one
    round (peers take seconds each)."""
    out = {}
    with busy_python_thread():
        for m, (save, load) in methods(opt, None).items():
            path = root / f"busy-{m}"
            path.mkdir(parents=True)
            out[f"{m} save"] = timed(save, path)[0]
            drop_cache(path)
            out[f"{m} load"] = timed(load, path)[0]
            shutil.rmtree(path)
        for name, (seconds,) in end_to_end_seconds(opt, 1, root).items():
            out[f"{name} load -> optimizer"] = seconds
    return out


# ----- run --------------------------------------------------------------------------------------
def full_run() -> bool:
    """The ~400 MB state too: ``--full`` or ``GEFEN_BENCH_FULL=1`` (``make bench`` passes the environment)."""
    return "--full" in sys.argv[1:] or os.environ.get("GEFEN_BENCH_FULL", "") not in ("", "0")


def run(quick: bool) -> dict:
    torch.set_num_threads(2)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(dir=SCRATCH))
    sizes, reps = ((25,), 2) if quick else (SIZES, 7)
    full = full_run() and not quick
    if full:
        sizes += (FULL_SIZE,)
    results, e2e, busy = {}, {}, {}
    try:
        dd = []
        for size in sizes:
            params, opt = gefen_state(size)
            state_bytes = gefen_ckpt.export_canonical(opt).total_bytes()
            r = FULL_REPS if size == FULL_SIZE else reps
            results[f"{size}M optimizer"] = measure(f"{size}M", opt, None, state_bytes, r, root,
                                                    rss_rounds=1 if quick else RSS_ROUNDS)
            e2e[f"{size}M"] = end_to_end_load(opt, r, root, state_bytes)
            dd.append(dd_bandwidth(state_bytes, root))
            if size == sizes[0]:
                model_sd = {n: p.detach() for n, p in params}
                both = state_bytes + sum(p.numel() * p.element_size() for p in model_sd.values())
                results[f"{size}M model+optimizer"] = measure(f"{size}M-model", opt, model_sd, both, reps, root,
                                                              rss_rounds=1 if quick else RSS_ROUNDS)
                dd.append(dd_bandwidth(both, root))
                if not quick:
                    busy = contended(opt, root)
            del params, opt
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data = {"results": results, "end_to_end_load_MBps": e2e, "busy_thread_seconds": busy,
            "dd_write_MBps": statistics.median(w for w, _ in dd) / 1e6,
            "dd_read_MBps": statistics.median(r for _, r in dd) / 1e6,
            "dd_samples_MBps": [[w / 1e6, r / 1e6] for w, r in dd],
            "machine": machine_limits(), "reps": reps, "full_reps": FULL_REPS if full else None,
            "rss_rounds": 1 if quick else RSS_ROUNDS, "quick": quick, "full": full}
    write_json("io", data)
    return {"title": "Checkpoint I/O: portable format vs torch.save, safetensors, DCP",
            "markdown": _markdown(data), "plots": [str(_plot(data))], "data": data}


def _plot(data: dict) -> Path:
    groups = {}
    for label, r in data["results"].items():
        groups[f"{label}\nsave"] = {**r["save_MBps"], "dd (write / cold read)": data["dd_write_MBps"]}
        groups[f"{label}\nload (cold)"] = {**r["load_MBps"], "dd (write / cold read)": data["dd_read_MBps"]}
    return plot("io", groups, ylabel="MB/s (state bytes / median time)",
                title="Checkpoint save/load throughput (higher is better)")


def _markdown(data: dict) -> str:
    dd = {"save": data["dd_write_MBps"], "load": data["dd_read_MBps"]}
    limit = {"save": "dd write", "load": "dd read"}
    rows, targets = [], []
    for label, r in data["results"].items():
        for op in ("save", "load"):
            speeds = r[f"{op}_MBps"]
            rows.append([label, op] + [f"{speeds[m]:.0f} ({speeds[m] / dd[op]:.2f}x {limit[op]})" for m in METHODS]
                        + [" / ".join(f"{r['peak_extra_rss'][m][op] / 2**20:.0f}" for m in METHODS)])
        ours = {op: r[f"{op}_MBps"]["gefen_ckpt"] for op in ("save", "load")}
        best_peer = {op: max(v for m, v in r[f"{op}_MBps"].items() if m != "gefen_ckpt") for op in ("save", "load")}
        ratio = r["checkpoint_bytes"]["gefen_ckpt"] / r["state_bytes"]
        targets.append([label, f"{ours['save'] / dd['save']:.2f}x / {ours['load'] / dd['load']:.2f}x",
                        f"{ours['save'] / best_peer['save']:.2f}x / {ours['load'] / best_peer['load']:.2f}x",
                        f"{ratio:.4f}" if "model" not in label else "n/a (model in safetensors)"])
    e2e = [[k] + [f"{v:.0f}" for v in speeds.values()] for k, speeds in data["end_to_end_load_MBps"].items()]
    e2e_header = ["state"] + list(next(iter(data["end_to_end_load_MBps"].values())))
    return "\n\n".join([
        f"Disk limits, measured in this run with `dd bs=16M` on the same byte counts: write (`conv=fdatasync`) "
        f"**{dd['save']:.0f} MB/s**, cold read (the file read back after dropping its page cache, as before every "
        f"load) **{dd['load']:.0f} MB/s** (write / read samples "
        f"{', '.join(f'{w:.0f} / {r:.0f}' for w, r in data['dd_samples_MBps'])}). Saves are compared with the "
        f"write figure, loads with the read figure. Medians of {data['reps']} interleaved rounds"
        + (f" ({data['full_reps']} for the {FULL_SIZE}M row)" if data.get("full") else "")
        + "; MB/s = bytes of state (optimizer, or model + optimizer) / time; peak extra RSS: the median over "
        f"{data['rss_rounds']} further untimed round(s) (the sampling thread's use of the GIL perturbs timings)."
        + ("" if data.get("full") else f" The ~{FULL_SIZE} MB state row is measured by the full run only "
           f"(`make bench FULL=1`, or `python -m benchmarks.bench_io --full`): it takes minutes here."),
        md_table(["state", "op"] + [f"{m} MB/s" for m in METHODS] + ["peak extra RSS MiB (" + " / ".join(METHODS) + ")"],
                 rows),
        "gefen_ckpt's load row is what `gefen_ckpt.load` stages for a Gefen optimizer: every checksum "
        "verified, the data files prefetched while the manifest is validated, tensors as views of a private "
        "mapping of the files (safetensors' `load_file` also returns views of a private mapping, without "
        "checksums). Every save ends in an `fsync`, so all methods run at about the disk's speed (the dd "
        "write figure); what separates them is the time before the data reaches the disk and their fixed cost per "
        "save (gefen_ckpt: planning the file, ~4 ms, and the atomic manifest commit; it writes from the live "
        "tensors without a copy and starts writeback every 2 MiB). The model+optimizer rows pair gefen_ckpt "
        "with safetensors for the model (two files and two flushes against one), so there the two are "
        "within a few percent of each other by construction.",
        "Targets: save >= 0.8x dd write, load >= 0.8x dd cold read, faster than every peer, checkpoint <= 1.05x "
        "the compressed state.",
        md_table(["state", "gefen_ckpt vs dd (save vs write / load vs read)", "vs best peer (save / load)",
                  "checkpoint / in-memory state"], targets),
        "Cold load straight into a live Gefen optimizer (MB/s of state):",
        md_table(e2e_header, e2e),
        _busy_markdown(data.get("busy_thread_seconds") or {}),
    ])


def _busy_markdown(busy: dict) -> str:
    if not busy:
        return "With a busy Python thread: not measured (quick run)."
    rows = [[m] + [f"{busy[f'{m} {op}']:.2f}" if f"{m} {op}" in busy else "" for op in ("save", "load")] for m in METHODS]
    e2e = " vs ".join(f"{k.removesuffix(' load -> optimizer')} {v:.2f} s" for k, v in busy.items() if "optimizer" in k)
    return "\n\n".join([
        f"With another thread of the process running Python the whole time (a data-loading or logging thread), "
        f"{SIZES[0]}M optimizer state, one round, seconds (lower is better). Each GIL release of the measured code "
        "then waits up to the 5 ms switch interval: what counts is how many torch ops and system calls a method "
        "makes per tensor. gefen_ckpt saves and stages with a constant number (tests/ckpt/test_ckpt_gil.py).",
        md_table(["method", "save s", "load (cold) s"], rows),
        f"Cold load into the live Gefen optimizer: {e2e} (the optimizer's own copy is one torch op per tensor).",
    ])


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    print(result["markdown"])
