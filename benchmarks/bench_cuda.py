"""Gefen vs torch AdamW step time on a CUDA device, in one call.

Transformer-shaped parameters (``common.transformer_shapes``; default ~1.75B at d_model 2048,
vocab 32768), gradients with row structure, fp32 or bf16 parameters and gradients. For each
optimizer -- torch AdamW ``fused=True`` and ``foreach=True``, Gefen (default m4v4 layout) with the
Triton kernels (``gefen/triton``) and with the eager torch reference (``GEFEN_DISABLE_NATIVE``'s
switch), and Gefen ``moments="m8"`` with the kernels, factored and per-block second moment -- the first step is timed on its own (state allocation, Gefen's codebooks and, in a fresh
process, Triton's compilation: ``first_step_s``), then a second optimizer's first step on the same
parameters (kernels already compiled: ``first_step_warm_s``), two warm-up steps and the median of
``--reps`` steps timed with CUDA events. The device's copy bandwidth (``Tensor.copy_``, bytes read
+ written) is measured in the same run; "effective GB/s" divides each optimizer's minimal memory
traffic per step (``traffic_bytes``: what it must read and write per parameter) by its step time.

Run through ``benchmarks/gpu.sh`` (CUDA tests, then this in fp32 and bf16, then the docs page).
``--smoke`` runs the same code on CPU with a tiny model, so the script is checked where there
is no GPU (with ``TRITON_INTERPRET=1`` the Triton kernels run in Triton's interpreter there).
Writes ``<out>/cuda[_bfloat16].json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_cuda.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table, numel, transformer_shapes
from gefen import Gefen, dispatch
from gefen.triton import dispatch as triton_dispatch

TRITON = "Gefen (Triton)"
#: Gefen's rows: the keywords each one passes (the eager one runs with the kernels switched off)
GEFEN = {TRITON: {}, "Gefen (eager)": {}, "Gefen m8 (Triton)": {"moments": "m8"},
         "Gefen m8 block v (Triton)": {"moments": "m8", "factored_v_2d": False}}
KINDS = ("AdamW fused", "AdamW foreach", *GEFEN)


class Clock:
    """Seconds of GPU work between start() and stop() (CUDA events), or wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.begin.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` (median of ``reps``)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        with Clock(device) as c:
            dst.copy_(src)
        times.append(c.seconds)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def make_params(shapes, device, dtype) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype))
        rows = torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen, device=device) + 0.1
        p.grad = (torch.randn(shape, generator=gen, device=device) * rows).to(dtype)
        out.append((name, p))
    return out


def make_optimizer(kind: str, named):
    params = [p for _, p in named]
    if kind == "AdamW fused":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    if kind == "AdamW foreach":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    return Gefen(named, lr=1e-4, weight_decay=0.01, **GEFEN[kind])


def traffic_bytes(kind: str, named) -> int:
    """Bytes a step must move at least: parameter read + write and gradient read; AdamW reads and
    writes two moments in the parameter's dtype; Gefen m4v4 reads and writes one code byte per
    element of a matrix (plus its row/column statistics) and two fp32 moments per 1-D element, and
    reads the gradient a second time (phase 1: the row and column sums); m8 reads and writes one
    code byte per element and an fp32 scale per block (one per row of a tensor of two or more
    dims, one per element of a 1-D one) and the second moment (per block; or factored, whose
    phase 1 reads the gradient a second time)."""
    total = 0
    m8 = GEFEN.get(kind, {}).get("moments") == "m8"
    factored = GEFEN.get(kind, {}).get("factored_v_2d", True)
    for _, p in named:
        n, size = p.numel(), p.element_size()
        if kind.startswith("AdamW"):
            total += n * (3 * size + 4 * size)
        elif m8:
            rows = p.shape[0] if p.dim() >= 2 else n  # blocks: a row each, or an element each
            total += n * (3 * size + 2) + rows * 2 * 4
            if factored and p.dim() == 2:
                total += n * size + rows * 2 * 4 + (n // rows) * 2 * 4
            else:
                total += rows * 2 * 4
        elif p.dim() >= 2:
            rows, cols = p.shape[0], n // p.shape[0]
            total += n * (2 * size + 2 * size + 2) + rows * (2 * 2 + 3 * 4) + cols * 2 * 4
        else:
            total += n * (3 * size + 16)
    return total


def kernel_times(opt, device) -> dict:
    """Device seconds of one step's kernel calls (gefen.triton.launch: phase 1 ``m4v4_partials`` /
    ``m8_partials``, phase 2 ``m4v4_update_`` / ``m8_update_``): what is left of the step time is
    torch's work and host overhead."""
    from gefen.triton import launch

    spans = {}
    phases = {"m4v4_partials": "phase1", "m8_partials": "phase1", "m4v4_update_": "phase2", "m8_update_": "phase2"}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            with Clock(device) as c:
                out = fn(*args, **kwargs)
            spans[name] = spans.get(name, 0.0) + c.seconds
            return out
        return wrapper

    saved = {name: getattr(launch, name) for name in phases}
    for name, phase in phases.items():
        setattr(launch, name, timed(phase, saved[name]))
    try:
        opt.step()
    finally:
        for name, fn in saved.items():
            setattr(launch, name, fn)
    return spans


def measure(kind: str, named, device, reps: int) -> dict:
    dispatch.enabled = "eager" not in kind
    opt = make_optimizer(kind, named)
    result = {}
    with Clock(device) as c:
        opt.step()  # AdamW allocates its state; Gefen learns its codebooks (and Triton compiles)
    result["first_step_s"] = c.seconds
    if kind.startswith("Gefen"):
        again = make_optimizer(kind, named)
        with Clock(device) as c:
            again.step()
        result["first_step_warm_s"] = c.seconds
        del again
    opt.step()
    times = []
    for _ in range(reps):
        with Clock(device) as c:
            opt.step()
        times.append(c.seconds)
    result["median_step_s"] = statistics.median(times)
    result["step_times_s"] = times
    if "Triton" in kind:
        result["kernel_s"] = kernel_times(opt, device)
    state = {id(v): v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    state.update({id(b): b for b in (getattr(opt, "codebook", None), getattr(opt, "v_codebook", None))
                  if isinstance(b, torch.Tensor)})  # shared by every parameter's state: counted once
    result["state_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    result["traffic_bytes"] = traffic_bytes(kind, named)
    result["effective_GBps"] = result["traffic_bytes"] / result["median_step_s"] / 1e9
    dispatch.enabled = True
    del opt, state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def measure_all(device: torch.device, millions: float, d_model: int, vocab: int, dtype: torch.dtype, reps: int) -> dict:
    shapes = transformer_shapes(millions, d_model=d_model, vocab=vocab)
    n = numel(shapes)
    named = make_params(shapes, device, dtype)
    copy = copy_bandwidth(device, min(4 * 2**30, max(2**24, n * 4)))
    results = {kind: measure(kind, named, device, reps) for kind in KINDS}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "params": n, "tensors": len(shapes), "dtype": str(dtype),
            "copy_GBps_read_plus_write": copy / 1e9, "reps": reps, "results": results}


def markdown(data: dict) -> str:
    fused = data["results"]["AdamW fused"]["median_step_s"]
    copy = data["copy_GBps_read_plus_write"]
    rows = []
    for kind, r in data["results"].items():
        t = r["median_step_s"]
        warm = r.get("first_step_warm_s")
        rows.append([kind, f"{t * 1e3:.2f}", f"{t / fused:.2f}x", f"{r['first_step_s'] * 1e3:.1f}",
                     "" if warm is None else f"{warm * 1e3:.1f}", f"{r['effective_GBps']:.0f}",
                     f"{r['effective_GBps'] / copy:.0%}", f"{r['state_bytes'] / data['params']:.3f}"])
    head = (f"{data['device']}, torch {data['torch']}, {data['params'] / 1e9:.3f}B params in {data['tensors']} "
            f"tensors ({data['dtype']} parameters and gradients), medians of {data['reps']} steps after 2 warm-ups; "
            f"copy bandwidth {copy:.0f} GB/s (read + write). First step: a fresh optimizer (state, codebooks; "
            "in a fresh process Triton's compilation too), then a second fresh one with the kernels compiled. "
            "Effective GB/s: the optimizer's minimal bytes moved per step over its step time.")
    table = md_table(["optimizer", "step ms", "vs AdamW fused", "first step ms", "first step ms (compiled)",
                      "effective GB/s", "of copy bandwidth", "state B/param"], rows)
    gefen = data["results"].get(TRITON)
    targets = ""
    if gefen:
        ratio = gefen["median_step_s"] / fused
        first = gefen["first_step_s"] / gefen["median_step_s"]
        warm = gefen["first_step_warm_s"] / gefen["median_step_s"]
        for kind, r in data["results"].items():
            if spans := r.get("kernel_s"):
                targets += (f"\n\n{kind}, one step's kernel calls alone (each timed with a synchronisation): "
                            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in spans.items()) + ".")
        targets += "\n\n" + md_table(["target (docs/design.md 12)", "measured", "met"], [
            ["Gefen step <= 0.5x torch fused AdamW", f"{ratio:.2f}x", "yes" if ratio <= 0.5 else "no"],
            ["first step <= 3x a steady step, compilation included", f"{first:.1f}x", "yes" if first <= 3 else "no"],
            ["first step <= 3x a steady step, kernels compiled", f"{warm:.1f}x", "yes" if warm <= 3 else "no"],
        ])
    return f"{head}\n\n{table}{targets}\n"


def run(quick: bool) -> dict:
    """The ``run_all`` section: measured on a CUDA device when this machine has one (fp32 and bf16,
    the ~1.75B set; ~0.2B when ``quick``), otherwise a note on how to measure it."""
    title = "Gefen vs AdamW on CUDA"
    measured = _measured(os.environ.get("GEFEN_CUDA_RESULTS"))
    if measured:  # gpu.sh: this run's fresh-process measurements, rendered into the page
        body = "\n".join(f"### {name} parameters\n\n{markdown(d)}" for name, d in measured.items())
        return {"title": title, "plots": [], "markdown": _HOW + body, "data": measured}
    if not torch.cuda.is_available():
        return {"title": title, "plots": [], "markdown": (
            "No CUDA device on the machine that ran this page, so nothing was measured here. "
            "`bash benchmarks/gpu.sh` on a machine with one runs the CUDA tests and this benchmark "
            "(fp32 and bf16; Gefen m4v4 and m8 with the Triton kernels, m4v4 eager, torch AdamW fused and "
            "foreach) in one call.")}
    millions, reps = (200.0, 3) if quick else (1750.0, 10)
    data = {str(dt).removeprefix("torch."): measure_all(torch.device("cuda"), millions, 2048, 32768, dt, reps)
            for dt in (torch.float32, torch.bfloat16)}
    body = "\n".join(f"### {name} parameters\n\n{markdown(d)}" for name, d in data.items())
    return {"title": title, "plots": [], "markdown": _HOW + body, "data": data}


_HOW = "Measured by `bash benchmarks/gpu.sh` (each dtype in a fresh process, so the first step includes compiling).\n\n"


def _measured(folder: str | None) -> dict | None:
    """``{dtype: data}`` from ``<folder>/cuda.json`` and ``cuda_bfloat16.json`` (None if absent)."""
    if not folder:
        return None
    files = {"float32": Path(folder) / "cuda.json", "bfloat16": Path(folder) / "cuda_bfloat16.json"}
    found = {name: json.loads(f.read_text()) for name, f in files.items() if f.is_file()}
    return found or None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--millions", type=float, default=1750.0)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script without a GPU")
    args = ap.parse_args(argv)
    if args.smoke:
        device, args.millions, args.d_model, args.vocab, args.reps = torch.device("cpu"), 0.001, 16, 32, 2
        if os.environ.get("TRITON_INTERPRET") == "1":  # the Triton rows run the kernels in the interpreter
            triton_dispatch.DEVICES = {"cuda", "cpu"}
    elif not torch.cuda.is_available():
        sys.exit("bench_cuda: no CUDA device (use --smoke to check the script on CPU)")
    else:
        device = torch.device("cuda")
    data = measure_all(device, args.millions, args.d_model, args.vocab, getattr(torch, args.dtype), args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    (out / f"cuda{suffix}.json").write_text(json.dumps(data, indent=1))
    print(markdown(data))


if __name__ == "__main__":
    main()
