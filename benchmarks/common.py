"""Helpers shared by every benchmark: model shapes, timing, JSON/PNG output, machine limits.

Absolute times on shared machines are noisy, so benchmarks report ratios against baselines
measured in the same run, next to the machine's own limits (``machine_limits()``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"


# ----- shapes ---------------------------------------------------------------------------------
def transformer_shapes(params_millions: float, d_model: int = 512, vocab: int = 16384) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer-shaped list of ``(name, shape)`` with about ``params_millions`` parameters.

    Tied token embedding ``[vocab, d]``; per layer q/k/v/o ``[d, d]``, MLP up ``[4d, d]`` and
    down ``[d, 4d]`` (torch Linear weights are ``[out, in]``) and two norms ``[d]``; a final norm.
    The layer count is whichever lands closest to the target: with the defaults 25 -> 5 layers
    (24.1M parameters) and 42 -> 11 layers (43.0M).
    """
    per_layer = 4 * d_model * d_model + 2 * 4 * d_model * d_model + 2 * d_model
    fixed = vocab * d_model + d_model
    layers = max(1, round((params_millions * 1e6 - fixed) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, d_model))]
    for i in range(layers):
        pre = f"layers.{i}"
        shapes += [(f"{pre}.attn.{n}.weight", (d_model, d_model)) for n in ("q", "k", "v", "o")]
        shapes += [(f"{pre}.mlp.up.weight", (4 * d_model, d_model)), (f"{pre}.mlp.down.weight", (d_model, 4 * d_model))]
        shapes += [(f"{pre}.norm1.weight", (d_model,)), (f"{pre}.norm2.weight", (d_model,))]
    shapes.append(("norm.weight", (d_model,)))
    return shapes


def numel(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


def structured_tensor(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random values with the row/column scale structure of real gradients:
    ``r_i * c_j * noise`` with log-normal row and column scales (vectors: per-element scale)."""
    noise = torch.randn(shape, generator=gen)
    if len(shape) >= 2:
        rows, cols = shape[0], math.prod(shape[1:])
        r = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
        c = torch.exp(0.5 * torch.randn(1, cols, generator=gen))
        noise = (noise.reshape(rows, cols) * r * c).reshape(shape)
    return noise.mul_(scale)


def gradient_sets(named, count: int = 3, seed: int = 1) -> list[list[torch.Tensor]]:
    """The parameters' own gradients and ``count - 1`` more sets of the same shapes and dtype.

    Steps timed on one replayed gradient flatter m8: its codes settle on the codebook's centres,
    where the nearest-code search's branch always predicts (~20% of a step, docs/decisions.md)."""
    gen = torch.Generator().manual_seed(seed)
    more = [[structured_tensor(tuple(p.shape), gen, 1e-3).to(p.dtype) for _, p in named] for _ in range(count - 1)]
    return [[p.grad for _, p in named]] + more


def use_gradients(named, grads: list[torch.Tensor]) -> None:
    for (_, p), g in zip(named, grads):
        p.grad = g


# ----- timing ----------------------------------------------------------------------------------

# ----- a Gefen state to checkpoint -------------------------------------------------------------
def gefen_state(size: int, steps: int = 2):
    """``(named params, Gefen)`` over ``transformer_shapes(size)`` after ``steps`` steps on
    structured gradients (gradients then cleared): the state the checkpoint benchmarks move."""
    from gefen import Gefen

    gen = torch.Generator().manual_seed(size)
    params = [(n, torch.nn.Parameter(structured_tensor(s, gen, 0.02))) for n, s in transformer_shapes(size)]
    opt = Gefen(params, lr=1e-3)
    for _ in range(steps):
        for _, p in params:
            p.grad = structured_tensor(tuple(p.shape), gen)
        opt.step()
    for _, p in params:
        p.grad = None
    return params, opt


class PeakRSS:
    """Extra resident memory (bytes) while the block runs, sampled every 2 ms in a thread."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


def median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_limits(size_mib: int = 256, reps: int = 5) -> dict:
    """The machine's own limits next to which benchmark numbers should be read, with the current
    torch thread count on ``size_mib`` MiB tensors: memcpy bandwidth (bytes copied per second by
    ``Tensor.copy_``) and the traffic of an in-place read + write stream (``Tensor.mul_``, bytes
    read and written per second: the access pattern of an optimizer step, which updates its
    tensors in place; a copy also reads every destination line before writing it, so twice the
    copied bytes undercounts its traffic), CPU and thread counts, versions."""
    src = torch.ones(size_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), reps, warmup=1)
    in_place = median_time(lambda: src.mul_(1.0), reps, warmup=1)
    return {
        "memcpy_gbps": round(size_mib * 2**20 / seconds / 1e9, 2),
        "stream_gbps": round(2 * size_mib * 2**20 / in_place / 1e9, 2),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----- output ----------------------------------------------------------------------------------
def write_json(name: str, data: dict) -> Path:
    """Write ``benchmarks/out/<name>.json`` (pretty, sorted keys) and return its path."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def plot(name: str, groups: dict[str, dict[str, float]], *, ylabel: str, title: str,
         hline: float | None = None, hline_label: str | None = None) -> Path:
    """Grouped bar chart to ``benchmarks/out/<name>.png``: one group of bars per key of ``groups``
    (e.g. a model size), one bar per series inside (e.g. an optimizer). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    series = list(dict.fromkeys(s for bars in groups.values() for s in bars))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups) * max(1, len(series)) / 2, 3.6), dpi=120)
    for k, s in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [bars.get(s, float("nan")) for bars in groups.values()]
        rects = ax.bar(xs, ys, width, label=s)
        ax.bar_label(rects, fmt="%.3g", fontsize=7)
    if hline is not None:
        ax.axhline(hline, color="k", linestyle="--", linewidth=0.8, label=hline_label)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = OUT / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
