"""Gefen step time vs torch AdamW (foreach and fused) on transformer-shaped tensors, CPU, 2 threads.

For each shape set (~25M and ~42M parameters, ``common.transformer_shapes``) the parameters get
random gradients with row/column scale structure (a different set each round,
``common.gradient_sets``), then Gefen (the default m4v4 layout, fused C kernels), the same Gefen
with the kernels off (its torch reference, within the kernels' stated bound of it, measured in
only the first ``REFERENCE_REPS`` rounds because one step takes seconds), Gefen with the m8 layout
(``moments="m8"``), ``AdamW(foreach=True)`` and ``AdamW(fused=True)`` step the same
parameters in interleaved rounds (so load changes on a shared machine hit all alike); each number
is the median over the rounds after one warm-up step.
Also measured: Gefen's first step (state allocation + codebook + step, on a fresh optimizer, one
sample per shape set) as a multiple of its steady step, and the bytes of optimizer state per
parameter. ``quick`` runs the 25M set only, with 3 rounds.

A fresh process pays more before its first step returns: importing torch and gefen, the native
kernel's calibration (13 small problems, cached per library build, CPU and torch in the user's
cache directory after the first process) and first-touch costs. ``_fresh_processes`` runs the 25M
set in new interpreters, alternately with an empty cache and with the cache the previous one
wrote, and reports each part against that process's own steady step.

Writes ``benchmarks/out/step.json`` and ``benchmarks/out/step.png``; ``run(quick)`` returns the
``run_all`` section dict (see ``benchmarks/run_all.py``). Run alone with
``python -m benchmarks.bench_step [--quick]``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_step.py`
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from benchmarks.bench_quality import state_bytes
from benchmarks.common import (
    ROOT,
    gradient_sets,
    machine_limits,
    md_table,
    numel,
    plot,
    structured_tensor,
    transformer_shapes,
    use_gradients,
    write_json,
)
from gefen import Gefen, c_kernels, dispatch

SIZES = (25, 42)
THREADS = 2
REFERENCE = "Gefen torch reference"
KINDS = ("Gefen", REFERENCE, "Gefen m8", "AdamW foreach", "AdamW fused")
REFERENCE_REPS = 3  # rounds that include the torch reference (quick: 1)


def _native_state() -> str:
    if not (dispatch.enabled and c_kernels.available()):
        return "eager torch ops (native step off or unavailable)"
    return "native fused C step" if c_kernels._calibrated().m4v4 else "eager m4v4 torch ops (m4v4 kernels unavailable)"


def _params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter(structured_tensor(shape, gen, 0.02))
        p.grad = structured_tensor(shape, gen, 1e-3)
        params.append(p)
    return params


def _make(kind, named):
    params = [p for _, p in named]
    if kind in ("Gefen", REFERENCE):
        return Gefen(named, lr=1e-4, weight_decay=0.01)
    if kind == "Gefen m8":
        return Gefen(named, lr=1e-4, weight_decay=0.01, moments="m8")
    if kind == "AdamW foreach":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _step(kind, opt) -> float:
    """Seconds of one step; the torch reference runs with the kernels off."""
    saved = dispatch.enabled
    dispatch.enabled = saved and kind != REFERENCE
    try:
        return _timed(opt.step)
    finally:
        dispatch.enabled = saved


def _measure(size: int, reps: int, first_samples: int, reference_reps: int) -> dict:
    shapes = transformer_shapes(size)
    n = numel(shapes)
    params = _params(shapes)
    named = [(name, p) for (name, _), p in zip(shapes, params)]
    # extra first steps on fresh Gefen optimizers (state + codebook + step)
    firsts = []
    for _ in range(first_samples - 1):
        opt = Gefen(named, lr=1e-4, weight_decay=0.01)
        firsts.append(_timed(opt.step))
        del opt
        gc.collect()
    opts = {kind: _make(kind, named) for kind in KINDS}
    for kind, opt in opts.items():  # warm-up: AdamW allocates its state, Gefen takes its first step
        seconds = _step(kind, opt)
        if kind == "Gefen":
            firsts.append(seconds)
    times = {kind: [] for kind in KINDS}
    grads = gradient_sets(named)
    for r in range(reps):
        use_gradients(named, grads[(r + 1) % len(grads)])
        order = KINDS[r % len(KINDS):] + KINDS[: r % len(KINDS)]
        for kind in order:
            if kind != REFERENCE or r < reference_reps:
                times[kind].append(_step(kind, opts[kind]))
    med = {kind: statistics.median(t) for kind, t in times.items()}
    result = {
        "params": n,
        "tensors": len(shapes),
        "median_step_s": med,
        "ms_per_mparam": {kind: med[kind] * 1e3 / (n / 1e6) for kind in KINDS},
        "gefen_vs_foreach": med["Gefen"] / med["AdamW foreach"],
        "gefen_vs_fused": med["Gefen"] / med["AdamW fused"],
        "speedup_vs_reference": med[REFERENCE] / med["Gefen"],
        "gefen_vs_m8": med["Gefen"] / med["Gefen m8"],
        "first_step_s": firsts,
        "first_step_multiple": statistics.median(firsts) / med["Gefen"],
        "bytes_per_param": {kind: state_bytes(opts[kind]) / n for kind in KINDS},
        "step_times_s": times,
    }
    del opts, params, named
    gc.collect()
    return result


def _fresh_child() -> None:
    """Run in a new interpreter: time the imports, the calibration (or cache read), the first step
    of the 25M set and its steady steps; print one JSON line."""
    import gefen.c_kernels as c_kernels
    from gefen import Gefen as FreshGefen

    startup = time.time() - float(os.environ["GEFEN_BENCH_STARTED"])  # interpreter, torch, gefen
    torch.set_num_threads(THREADS)
    shapes = transformer_shapes(SIZES[0])
    named = [(name, p) for (name, _), p in zip(shapes, _params(shapes))]
    opt = FreshGefen(named, lr=1e-4, weight_decay=0.01)
    calibration = _timed(c_kernels.available)
    first = _timed(opt.step)
    steady = statistics.median(_timed(opt.step) for _ in range(5))
    print(json.dumps({"import_s": startup, "calibration_s": calibration, "first_step_s": first,
                      "steady_s": steady, "native": c_kernels.available()}))


def _fresh_processes(rounds: int) -> dict:
    """Fresh interpreters, alternately with an empty calibration cache and a warm one (medians)."""
    results = {"empty cache": [], "warm cache": []}
    with tempfile.TemporaryDirectory(prefix="gefen-bench-cache-") as tmp:
        warm = os.path.join(tmp, "warm")
        for r in range(rounds):
            for kind in results:
                cache = warm if kind == "warm cache" else os.path.join(tmp, f"empty-{r}")
                if kind == "warm cache" and not os.path.isdir(warm):
                    _child(warm)  # fill it once, untimed
                results[kind].append(_child(cache))
    for runs in results.values():  # each process against its own steady step (load drifts between them)
        for run in runs:
            run["ratio"] = (run["calibration_s"] + run["first_step_s"]) / run["steady_s"]
    return {kind: {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "native"}
            | {"native": all(run["native"] for run in runs), "rounds": len(runs)} for kind, runs in results.items()}


def _child(cache_dir: str) -> dict:
    env = dict(os.environ, GEFEN_CACHE_DIR=cache_dir, OMP_NUM_THREADS=str(THREADS), GEFEN_BENCH_STARTED=repr(time.time()))
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_step", "--fresh-child"], env=env, check=True,
                         capture_output=True, text=True, cwd=str(ROOT), timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(quick: bool = False) -> dict:
    """Measure, write step.json/step.png, return the docs section (run_all convention)."""
    torch.set_num_threads(THREADS)
    warm = torch.nn.Parameter(torch.randn(64, 96))  # pay one-time process costs outside the timings
    warm.grad = torch.randn(64, 96)
    Gefen([warm]).step()
    limits = machine_limits()
    reps, first_samples, reference_reps = (3, 1, 1) if quick else (10, 1, REFERENCE_REPS)
    sizes = {f"{s}M": _measure(s, reps, first_samples, reference_reps) for s in (SIZES[:1] if quick else SIZES)}
    fresh = _fresh_processes(1 if quick else 3)
    data = {"machine": limits, "threads": THREADS, "reps": reps, "reference_reps": reference_reps, "quick": quick,
            "gefen_path": _native_state(), "sizes": sizes, "fresh_process": fresh}
    write_json("step", data)
    shown = [kind for kind in KINDS if kind != REFERENCE]  # the reference is ~100x off the scale
    png = plot("step", {f"{k} ({v['params'] / 1e6:.1f}M)": {kind: v["ms_per_mparam"][kind] for kind in shown}
                        for k, v in sizes.items()},
               ylabel="ms per million parameters", title=f"Optimizer step, CPU, {THREADS} threads (lower is better)")
    return {"title": "Optimizer step time (CPU)", "markdown": _markdown(data), "plots": [str(png)], "data": data}


def _markdown(data: dict) -> str:
    sizes, m = data["sizes"], data["machine"]
    intro = (
        f"`benchmarks/bench_step.py`: {data['threads']} threads, median of {data['reps']} interleaved steps "
        f"after a warm-up step ({data['reference_reps']} for the torch reference)"
        f"{' (quick run)' if data['quick'] else ''}; random gradients with row/column "
        f"scale structure on transformer-shaped tensors (d=512, vocab 16384). Gefen path: {data['gefen_path']}. "
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs ({m['cpu_capability']}), memcpy {m['memcpy_gbps']} GB/s, "
        f"torch {m['torch']}."
    )
    rows = []
    for name, r in sizes.items():
        ms = r["ms_per_mparam"]
        rows.append([f"{name} ({r['params'] / 1e6:.1f}M, {r['tensors']} tensors)", f"{ms['Gefen']:.2f}",
                     f"{ms[REFERENCE]:.1f}", f"{r['speedup_vs_reference']:.0f}x", f"{ms['Gefen m8']:.2f}",
                     f"{ms['AdamW foreach']:.2f}", f"{ms['AdamW fused']:.2f}", f"{r['gefen_vs_foreach']:.2f}x",
                     f"{r['gefen_vs_fused']:.2f}x", f"{r['first_step_multiple']:.1f}x",
                     f"{r['bytes_per_param']['Gefen']:.4f}", f"{r['bytes_per_param']['Gefen m8']:.4f}",
                     f"{r['bytes_per_param']['AdamW foreach']:.2f}"])
    table = md_table(["shape set", "Gefen (m4v4, C) ms/M", "m4v4 torch reference ms/M", "C speed-up",
                      "Gefen m8 (C) ms/M", "AdamW foreach ms/M", "AdamW fused ms/M", "Gefen/foreach", "Gefen/fused",
                      "first step / steady", "Gefen B/param", "m8 B/param", "AdamW B/param"], rows)

    def verdict(ok):
        return "met" if ok else "**not met**"

    targets = []
    for label, target, key, limit in (
        ("optimizer state, bytes/param", "<= 1.05", lambda r: r["bytes_per_param"]["Gefen"], 1.05),
        ("Gefen step / AdamW foreach step", "<= 1.0x", lambda r: r["gefen_vs_foreach"], 1.0),
        ("Gefen step / AdamW fused step (end goal)", "<= 1.0x", lambda r: r["gefen_vs_fused"], 1.0),
        ("first step (state + codebook) / steady step", "<= 3x", lambda r: r["first_step_multiple"], 3.0),
    ):
        values = [key(r) for r in sizes.values()]
        targets.append([label, target, " / ".join(f"{v:.3g}" for v in values), verdict(max(values) <= limit)])
    target_table = md_table(["what (docs/design.md 12)", "target", " / ".join(sizes), "status"], targets)
    return f"{intro}\n\n{table}\n\n{target_table}\n\n{_fresh_markdown(data['fresh_process'])}"


def _fresh_markdown(fresh: dict) -> str:
    """The one-time costs of a new process, against its own steady step."""
    rows = []
    for kind, r in fresh.items():
        rows.append([kind, r["rounds"], f"{r['import_s']:.2f}", f"{r['calibration_s']:.3f}", f"{r['first_step_s']:.3f}",
                     f"{r['steady_s']:.3f}", f"{r['ratio']:.1f}x", "yes" if r["native"] else "no"])
    table = md_table(["fresh process, 25M set", "processes", "start-up s (python, torch, gefen)", "calibration s",
                      "first step s (state + codebook + step)", "steady step s", "first step incl. calibration / steady (median of per-process ratios)",
                      "native step"], rows)
    return (
        "A fresh process (`python -m benchmarks.bench_step --fresh-child`, medians over new interpreters, "
        "interleaved): the native step's calibration runs once per library build, CPU and torch and is cached "
        "in the user's cache directory (`$GEFEN_CACHE_DIR`, else `~/.cache/gefen`); the import of torch and "
        "gefen is paid by any torch program and is not part of the step. The first step's own one-time work "
        "(the codebook, allocating the state) is the rest of the difference.\n\n" + table + "\n"
    )


if __name__ == "__main__":
    if "--fresh-child" in sys.argv[1:]:
        _fresh_child()
    else:
        out = run(quick="--quick" in sys.argv[1:])
        print(out["markdown"])
