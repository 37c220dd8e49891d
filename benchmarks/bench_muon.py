"""GefenMuon / GefenMuonHybrid step time and state size vs torch AdamW, CPU, 2 threads.

The same ~25M transformer-shaped tensors as ``bench_step`` (``common.transformer_shapes(25)``:
tied embedding, q/k/v/o, MLP up/down, norms) get random gradients with row/column scale
structure, a different set each round (``common.gradient_sets``); ``AdamW(foreach=True)`` and the
hybrid with each backup step the same parameters in interleaved rounds (so load changes on a
shared machine hit all alike), and each number is the median over the rounds after one warm-up
step (periods + codebooks). Every round also times a fresh hybrid's (Gefen backup) first step:
its GefenMuon child's first step against its steady step, Newton-Schulz excluded from both (the
same matrix multiplies every step; timed by wrapping ``gefen.muon.orthogonalise_batched``). Step hooks also time the
hybrid's two children, so GefenMuon's own step (Newton-Schulz dominated) is reported without a
third run. State bytes count every tensor each optimizer holds, codebooks included. ``quick``
runs 3 rounds instead of 10.

Writes ``benchmarks/out/muon.json`` and ``benchmarks/out/muon.png``; ``run(quick)`` returns the
``run_all`` section dict. Run alone with ``python -m benchmarks.bench_muon [--quick]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_muon.py`
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from benchmarks.common import (
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
from gefen import GefenMuonHybrid, muon

THREADS = 2
SIZE = 25
KINDS = ("AdamW foreach", "hybrid, Gefen backup", "hybrid, AdamW backup")


def _make(kind: str, named):
    if kind == "AdamW foreach":
        return torch.optim.AdamW([p for _, p in named], lr=1e-4, weight_decay=0.01, foreach=True)
    if "Gefen" in kind:
        return GefenMuonHybrid(named, lr=1e-4, weight_decay=0.01, backup="gefen")
    return GefenMuonHybrid(named, lr=1e-4, weight_decay=0.01, backup="adamw", foreach=True)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Every tensor the optimizer holds: per-parameter state, codebook, and its children's."""
    children = getattr(opt, "children", None)
    if isinstance(children, dict):
        return sum(state_bytes(child) for child in children.values())
    tensors = {id(v): v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
    codebook = getattr(opt, "codebook", None)
    if isinstance(codebook, torch.Tensor):  # every parameter's state shares it: counted once
        tensors[id(codebook)] = codebook
    return sum(v.nbytes for v in tensors.values())


def _hook_timer(opt: torch.optim.Optimizer, out: list[float]) -> None:
    """Append the wall time of every ``opt.step()`` to ``out``."""
    opt.register_step_pre_hook(lambda o, a, k: setattr(o, "_bench_start", time.perf_counter()))
    opt.register_step_post_hook(lambda o, a, k: out.append(time.perf_counter() - o._bench_start))


class _NewtonSchulzClock:
    """Seconds spent in ``gefen.muon.orthogonalise_batched`` since the last ``take()``."""

    def __init__(self):
        self.spent, self._inner = 0.0, muon.orthogonalise_batched

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.spent += time.perf_counter() - start

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def _first_step_without_newton_schulz(named, clock: _NewtonSchulzClock) -> float:
    """A fresh hybrid's GefenMuon child: its first step's seconds outside Newton-Schulz."""
    fresh, times = _make(KINDS[1], named), []
    _hook_timer(fresh.children["muon"], times)
    clock.take()
    fresh.step()
    return times[0] - clock.take()


def _measure(rounds: int) -> dict:
    clock = _NewtonSchulzClock()
    muon.orthogonalise_batched = clock
    try:
        return _measure_with(rounds, clock)
    finally:
        muon.orthogonalise_batched = clock._inner


def _measure_with(rounds: int, clock: _NewtonSchulzClock) -> dict:
    shapes = transformer_shapes(SIZE)
    n = numel(shapes)
    gen = torch.Generator().manual_seed(0)
    named = []
    for name, shape in shapes:
        p = torch.nn.Parameter(structured_tensor(shape, gen, 0.02))
        p.grad = structured_tensor(shape, gen, 1e-3)
        named.append((name, p))
    grads = gradient_sets(named)
    opts = {kind: _make(kind, named) for kind in KINDS}
    times = {kind: [] for kind in KINDS}
    children = {}
    for kind, opt in opts.items():
        _hook_timer(opt, times[kind])
        for child, child_opt in getattr(opt, "children", {}).items():
            children[(kind, child)] = []
            _hook_timer(child_opt, children[(kind, child)])
    steady_ns, firsts = [], []  # Newton-Schulz seconds of the hybrid (Gefen backup)'s steps; fresh first steps
    for r in range(rounds + 1):  # round 0 is the warm-up
        use_gradients(named, grads[r % len(grads)])
        for kind in KINDS[r % len(KINDS):] + KINDS[: r % len(KINDS)]:
            clock.take()
            opts[kind].step()
            if kind == KINDS[1]:
                steady_ns.append(clock.take())
        if r:
            firsts.append(_first_step_without_newton_schulz(named, clock))
    med = {kind: statistics.median(t[1:]) for kind, t in times.items()}
    muon_steady = [t - ns for t, ns in zip(children[(KINDS[1], "muon")][1:], steady_ns[1:])]
    child_med = {f"{kind} / {child}": statistics.median(t[1:]) for (kind, child), t in children.items()}
    hybrid = opts[KINDS[1]]
    owned = {c: sum(p.numel() for g in o.param_groups for p in g["params"]) for c, o in hybrid.children.items()}
    return {
        "params": n,
        "tensors": len(shapes),
        "muon_params": owned["muon"],
        "median_step_s": med,
        "vs_adamw": {kind: med[kind] / med[KINDS[0]] for kind in KINDS},
        "child_median_step_s": child_med,
        "bytes_per_param": {kind: state_bytes(opts[kind]) / n for kind in KINDS},
        "child_bytes_per_param": {f"{kind} / {c}": state_bytes(o) / owned[c]
                                  for kind in KINDS[1:] for c, o in opts[kind].children.items()},
        "step_times_s": times,
        "muon_first_step_s": firsts,
        "muon_steady_step_s": muon_steady,
        "muon_first_step_multiple": statistics.median(firsts) / statistics.median(muon_steady),
    }


def run(quick: bool = False) -> dict:
    """Measure, write muon.json/muon.png, return the docs section (run_all convention)."""
    torch.set_num_threads(THREADS)
    limits = machine_limits()
    rounds = 3 if quick else 10
    data = {"machine": limits, "threads": THREADS, "rounds": rounds, "quick": quick, **_measure(rounds)}
    write_json("muon", data)
    png = plot("muon", {"step time / AdamW": data["vs_adamw"], "state bytes / param": data["bytes_per_param"]},
               ylabel="x AdamW step  |  bytes per parameter",
               title=f"GefenMuonHybrid vs AdamW, {data['params'] / 1e6:.1f}M params, CPU, {THREADS} threads")
    return {"title": "GefenMuon and GefenMuonHybrid (CPU)", "markdown": _markdown(data), "plots": [str(png)],
            "data": data}


def _markdown(data: dict) -> str:
    m = data["machine"]
    intro = (
        f"`benchmarks/bench_muon.py`: {data['threads']} threads, median of {data['rounds']} interleaved steps "
        f"after a warm-up step{' (quick run)' if data['quick'] else ''}; {data['params'] / 1e6:.1f}M transformer-"
        f"shaped parameters ({data['muon_params'] / 1e6:.1f}M in hidden matrices routed to Muon). Newton-Schulz "
        f"(5 steps, bf16 values, fp32 accumulation) dominates GefenMuon's step: its cost is matrix multiplies, "
        f"not memory traffic, so on a CPU it is many AdamW steps (on a GPU it is a small share of a training "
        f"step). Machine: {m['cpu']}, {m['cpu_count']} CPUs ({m['cpu_capability']}), torch {m['torch']}."
    )
    rows = []
    for kind in KINDS:
        muon = data["child_median_step_s"].get(f"{kind} / muon")
        backup = data["child_median_step_s"].get(f"{kind} / backup")
        rows.append([kind, f"{data['median_step_s'][kind]:.3f}", f"{data['vs_adamw'][kind]:.1f}x",
                     "-" if muon is None else f"{muon:.3f}", "-" if backup is None else f"{backup:.3f}",
                     f"{data['bytes_per_param'][kind]:.4f}"])
    table = md_table(["optimizer", "step s", "step / AdamW", "GefenMuon child s", "backup child s",
                      "state B/param"], rows)
    children = md_table(["child", "state B/param of its own parameters"],
                        [[k, f"{v:.4f}"] for k, v in data["child_bytes_per_param"].items()])
    gefen_bytes, first = data["bytes_per_param"][KINDS[1]], data["muon_first_step_multiple"]
    target = md_table(["what", "target", "hybrid, Gefen backup", "status"],
                      [["optimizer state, bytes/param (docs/design.md 12)", "<= 1.05", f"{gefen_bytes:.4f}",
                        "met" if gefen_bytes <= 1.05 else "**not met**"],
                       ["GefenMuon first step / steady step, Newton-Schulz excluded (medians)", "<= 2x",
                        f"{first:.2f}x ({statistics.median(data['muon_first_step_s']):.3f} / "
                        f"{statistics.median(data['muon_steady_step_s']):.3f} s)", "met" if first <= 2.0 else "**not met**"]])
    return f"{intro}\n\n{table}\n\n{children}\n\n{target}\n"


if __name__ == "__main__":
    out = run(quick="--quick" in sys.argv[1:])
    print(out["markdown"])
