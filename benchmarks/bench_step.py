"""Gefen step time vs torch AdamW (foreach and fused) on transformer-shaped tensors, CPU, 2 threads.

For each shape set (~25M and ~42M parameters, ``common.transformer_shapes``) the parameters get
random gradients with row/column scale structure, then Gefen, ``AdamW(foreach=True)`` and
``AdamW(fused=True)`` step the same parameters in interleaved rounds (so load changes on a shared
machine hit all three alike); each number is the median over the rounds after one warm-up step.
Also measured: Gefen's first step (period choice + codebook + step, on a fresh optimizer, one
sample per shape set) as a multiple of its steady step, and the bytes of optimizer state per
parameter. ``quick`` runs the 25M set only, with 3 rounds.

Writes ``benchmarks/out/step.json`` and ``benchmarks/out/step.png``; ``run(quick)`` returns the
``run_all`` section dict (see ``benchmarks/run_all.py``). Run alone with
``python -m benchmarks.bench_step [--quick]``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_step.py`
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    machine_limits,
    md_table,
    numel,
    plot,
    structured_tensor,
    transformer_shapes,
    write_json,
)
from gefen import Gefen

SIZES = (25, 42)
THREADS = 2
KINDS = ("Gefen", "AdamW foreach", "AdamW fused")


def _native_state() -> str:
    try:
        from gefen import native
    except ImportError:
        return "eager (no native module)"
    return "native fused C step" if native.available() else "eager torch ops (native step unavailable)"


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
    if kind == "Gefen":
        return Gefen(named, lr=1e-4, weight_decay=0.01)
    if kind == "AdamW foreach":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def _state_bytes(opt) -> int:
    total = sum(v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    codebook = getattr(opt, "codebook", None)
    return total + (codebook.nbytes if isinstance(codebook, torch.Tensor) else 0)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(size: int, reps: int, first_samples: int) -> dict:
    shapes = transformer_shapes(size)
    n = numel(shapes)
    params = _params(shapes)
    named = [(name, p) for (name, _), p in zip(shapes, params)]
    # extra first steps on fresh Gefen optimizers (period + codebook + step)
    firsts = []
    for _ in range(first_samples - 1):
        opt = Gefen(named, lr=1e-4, weight_decay=0.01)
        firsts.append(_timed(opt.step))
        del opt
        gc.collect()
    opts = {kind: _make(kind, named) for kind in KINDS}
    for kind, opt in opts.items():  # warm-up: AdamW allocates its state, Gefen takes its first step
        seconds = _timed(opt.step)
        if kind == "Gefen":
            firsts.append(seconds)
    times = {kind: [] for kind in KINDS}
    for r in range(reps):
        order = KINDS[r % len(KINDS):] + KINDS[: r % len(KINDS)]
        for kind in order:
            times[kind].append(_timed(opts[kind].step))
    med = {kind: statistics.median(t) for kind, t in times.items()}
    result = {
        "params": n,
        "tensors": len(shapes),
        "median_step_s": med,
        "ms_per_mparam": {kind: med[kind] * 1e3 / (n / 1e6) for kind in KINDS},
        "gefen_vs_foreach": med["Gefen"] / med["AdamW foreach"],
        "gefen_vs_fused": med["Gefen"] / med["AdamW fused"],
        "first_step_s": firsts,
        "first_step_multiple": statistics.median(firsts) / med["Gefen"],
        "bytes_per_param": {kind: _state_bytes(opts[kind]) / n for kind in KINDS},
        "periods": sorted({int(st["period"]) for st in opts["Gefen"].state.values()}),
        "step_times_s": times,
    }
    del opts, params, named
    gc.collect()
    return result


def run(quick: bool = False) -> dict:
    """Measure, write step.json/step.png, return the docs section (run_all convention)."""
    torch.set_num_threads(THREADS)
    warm = torch.nn.Parameter(torch.randn(64, 96))  # pay one-time process costs outside the timings
    warm.grad = torch.randn(64, 96)
    Gefen([warm]).step()
    limits = machine_limits()
    reps, first_samples = (3, 1) if quick else (10, 1)
    sizes = {f"{s}M": _measure(s, reps, first_samples) for s in (SIZES[:1] if quick else SIZES)}
    data = {"machine": limits, "threads": THREADS, "reps": reps, "quick": quick,
            "gefen_path": _native_state(), "sizes": sizes}
    write_json("step", data)
    png = plot("step", {f"{k} ({v['params'] / 1e6:.1f}M)": v["ms_per_mparam"] for k, v in sizes.items()},
               ylabel="ms per million parameters", title=f"Optimizer step, CPU, {THREADS} threads (lower is better)")
    return {"title": "Optimizer step time (CPU)", "markdown": _markdown(data), "plots": [str(png)], "data": data}


def _markdown(data: dict) -> str:
    sizes, m = data["sizes"], data["machine"]
    intro = (
        f"`benchmarks/bench_step.py`: {data['threads']} threads, median of {data['reps']} interleaved steps "
        f"after a warm-up step{' (quick run)' if data['quick'] else ''}; random gradients with row/column "
        f"scale structure on transformer-shaped tensors (d=512, vocab 16384). Gefen path: {data['gefen_path']}. "
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs ({m['cpu_capability']}), memcpy {m['memcpy_gbps']} GB/s, "
        f"torch {m['torch']}."
    )
    rows = []
    for name, r in sizes.items():
        ms = r["ms_per_mparam"]
        rows.append([f"{name} ({r['params'] / 1e6:.1f}M, {r['tensors']} tensors)", f"{ms['Gefen']:.2f}",
                     f"{ms['AdamW foreach']:.2f}", f"{ms['AdamW fused']:.2f}", f"{r['gefen_vs_foreach']:.2f}x",
                     f"{r['gefen_vs_fused']:.2f}x", f"{r['first_step_multiple']:.1f}x",
                     f"{r['bytes_per_param']['Gefen']:.4f}", f"{r['bytes_per_param']['AdamW foreach']:.2f}"])
    table = md_table(["shape set", "Gefen ms/M", "AdamW foreach ms/M", "AdamW fused ms/M", "Gefen/foreach",
                      "Gefen/fused", "first step / steady", "Gefen B/param", "AdamW B/param"], rows)

    def verdict(ok):
        return "met" if ok else "**not met**"

    targets = []
    for label, target, key, limit in (
        ("optimizer state, bytes/param", "<= 1.05", lambda r: r["bytes_per_param"]["Gefen"], 1.05),
        ("Gefen step / AdamW foreach step", "<= 1.0x", lambda r: r["gefen_vs_foreach"], 1.0),
        ("Gefen step / AdamW fused step (end goal)", "<= 1.0x", lambda r: r["gefen_vs_fused"], 1.0),
        ("first step (period + codebook) / steady step", "<= 3x", lambda r: r["first_step_multiple"], 3.0),
    ):
        values = [key(r) for r in sizes.values()]
        targets.append([label, target, " / ".join(f"{v:.3g}" for v in values), verdict(max(values) <= limit)])
    target_table = md_table(["what (SPEC 12 / issue 2)", "target", " / ".join(sizes), "status"], targets)
    return f"{intro}\n\n{table}\n\n{target_table}\n"


if __name__ == "__main__":
    out = run(quick="--quick" in sys.argv[1:])
    print(out["markdown"])
