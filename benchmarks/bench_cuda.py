"""Gefen vs torch AdamW step time on a CUDA device (issue 6's GPU numbers), in one call.

Transformer-shaped parameters (``common.transformer_shapes``; default ~1.75B at d_model 2048,
vocab 32768, the size the issue's anchor table uses), gradients with row structure. For each
optimizer -- torch AdamW ``fused=True`` and ``foreach=True``, Gefen (factored second moment,
the default; and block second moment) -- two warm-up steps, then the median of ``--reps``
steps timed with CUDA events; Gefen's first step (period choice + codebook) is timed on its
own. The device's copy bandwidth (``Tensor.copy_``, bytes read + written) is measured in the
same run, so the table can show each step's floor. Gefen on CUDA runs the eager torch step
(there is no fused CUDA kernel yet): these are the numbers a fused kernel must beat.

Run through ``benchmarks/gpu.sh`` (builds the C extensions, runs the CUDA tests, then this).
``--smoke`` runs the same code on CPU with a tiny model, so the script is checked where there
is no GPU. Writes ``<out>/cuda.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_cuda.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table, numel, transformer_shapes
from gefen import Gefen

KINDS = ("AdamW fused", "AdamW foreach", "Gefen factored", "Gefen block")


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
    return Gefen(named, lr=1e-4, weight_decay=0.01, factored_v_2d=kind == "Gefen factored")


def measure(kind: str, named, device, reps: int) -> dict:
    opt = make_optimizer(kind, named)
    result = {}
    with Clock(device) as c:
        opt.step()  # AdamW allocates its state; Gefen chooses periods and learns its codebook
    result["first_step_s"] = c.seconds
    opt.step()
    times = []
    for _ in range(reps):
        with Clock(device) as c:
            opt.step()
        times.append(c.seconds)
    result["median_step_s"] = statistics.median(times)
    result["step_times_s"] = times
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    state += [opt.codebook] if isinstance(getattr(opt, "codebook", None), torch.Tensor) else []
    result["state_bytes"] = sum(t.numel() * t.element_size() for t in state)
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
    rows = []
    for kind, r in data["results"].items():
        t = r["median_step_s"]
        rows.append([kind, f"{t * 1e3:.2f}", f"{t * 1e3 / (data['params'] / 1e6):.4f}", f"{t / fused:.2f}x",
                     f"{r['first_step_s'] * 1e3:.1f}", f"{r['state_bytes'] / data['params']:.3f}"])
    head = (f"{data['device']}, torch {data['torch']}, {data['params'] / 1e9:.3f}B params in {data['tensors']} "
            f"tensors ({data['dtype']}), medians of {data['reps']} steps after 2 warm-ups; copy bandwidth "
            f"{data['copy_GBps_read_plus_write']:.0f} GB/s (read + write).")
    table = md_table(["optimizer", "step ms", "ms per M params", "vs AdamW fused", "first step ms", "state B/param"],
                     rows)
    return f"{head}\n\n{table}\n"


def run(quick: bool) -> dict:
    """The ``run_all`` section: measured on a CUDA device when this machine has one (fp32, the
    issue's ~1.75B set; ~0.2B when ``quick``), otherwise a note on how to measure it."""
    title = "Gefen vs AdamW on CUDA"
    if not torch.cuda.is_available():
        return {"title": title, "plots": [], "markdown": (
            "No CUDA device on the machine that ran this page, so nothing was measured here. "
            "`bash benchmarks/gpu.sh` on a machine with one runs the CUDA tests and this benchmark "
            "(fp32 and bf16) in one call.")}
    data = measure_all(torch.device("cuda"), 200.0 if quick else 1750.0, 2048, 32768, torch.float32, 3 if quick else 10)
    return {"title": title, "plots": [], "markdown": markdown(data), "data": data}


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
        device, args.millions, args.d_model, args.vocab, args.reps = torch.device("cpu"), 2.0, 64, 512, 2
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
