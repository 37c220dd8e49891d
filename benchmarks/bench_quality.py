"""Training quality on real text: held-out loss of a character LM, AdamW vs Gefen.

Task: a character-level pre-norm transformer LM (d = 192, 3 layers, 4 heads, context 128,
~1.4M parameters) trained for 400 steps of batch 32 x 128 with cosine LR 2e-3 (50 warm-up
steps), weight decay 0.1, gradient clipping 1.0, one thread per run; the held-out loss is the
mean over 32 fixed batches from the last 10% of the text. Two texts that ship with Python (no
download): ``stdlib`` (the top-level ``*.py`` of the standard library; the text the second
moment's storage was chosen on) and ``packages`` (the sources of the email, json, http, urllib,
xml, html and logging packages; not tuned on). Characters outside printable ASCII map to one token.

Optimizers: torch AdamW (the baseline, same run), ``gefen.Gefen`` (the production default,
``moments="m4v4"``), ``gefen.GefenMuonHybrid`` (Gefen backup), torch's own Muon (+ AdamW on
the rest, routed as the hybrid routes) and, where installed, torchao's 4-bit AdamW. ``gefen-m8``
and the ``p-*`` prototype storage variants of ``benchmarks/fidelity_variants.py`` stay runnable
(``train("stdlib", "p-m4v4-ratio-sr", 0)``): docs/decisions.md records their losses.
Runs go to ``GEFEN_BENCH_JOBS`` processes (default 2, one thread each). Each finished run is
also written to ``benchmarks/out/quality/``; ``GEFEN_QUALITY_RESUME=1`` reuses those files
(the table then says how many runs were reused) so an interrupted full run can be completed, and
``GEFEN_QUALITY_CACHED_ONLY=1`` renders the 400-step table from the runs found there.

    python -m benchmarks.run_all --only quality --full   # the 400-step plan (make bench FULL=1)
    python -m benchmarks.run_all --only quality           # otherwise the short run, as with --quick

``--full`` also runs the learning-rate sweep (``sweep_section``: each optimizer at its own best
rate on the short task, ~80 runs of ~5 CPU-seconds) and ``ranking_section`` (AdamW and Gefen at
three rates on both tasks, then with six seeds at the 400-step task's AdamW-best rate);
``python -m benchmarks.bench_quality --sweep`` runs only the sweep.

Runtime: a 400-step run is ~3.5-8 CPU-minutes; the full plan (``full_plan``, 16 runs, plus 14 for
the ranking) is ~2-4 CPU-hours, far over run_all's 4-minute guideline, so it runs only with
``--full``: the quality question needs the real task. ``--quick`` (60 steps, seed 0, stdlib, 3
optimizers) takes ~1-2 minutes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import multiprocessing
import os
import statistics
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import OUT, md_table, write_json

TEXTS = {
    "stdlib": ("*.py",),
    "packages": tuple(f"{pkg}/**/*.py" for pkg in ("email", "json", "http", "urllib", "xml", "html", "logging")),
}


@dataclass(frozen=True)
class Task:
    d: int = 192
    layers: int = 3
    heads: int = 4
    context: int = 128
    batch: int = 32
    steps: int = 400
    warmup: int = 50
    lr: float = 2e-3
    weight_decay: float = 0.1
    eval_batches: int = 32


# ----- data -----------------------------------------------------------------------------------
def corpus(name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train, held-out, vocab) token tensors of a text: sorted files concatenated, printable
    ASCII (plus newline) kept, every other byte mapped to one extra token; last 10% held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted({f for pattern in TEXTS[name] for f in root.glob(pattern) if f.is_file()})
    raw = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    keep = (raw == 10) | ((raw >= 32) & (raw < 127))
    raw = np.where(keep, raw, 0)
    symbols, tokens = np.unique(raw, return_inverse=True)
    data = torch.from_numpy(tokens.astype(np.int64))
    split = int(0.9 * len(data))
    return data[:split], data[split:], len(symbols)


def batch(src: torch.Tensor, task: Task, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(0, len(src) - task.context - 1, (task.batch,), generator=gen)
    offsets = torch.arange(task.context + 1)
    window = src[ix[:, None] + offsets]
    return window[:, :-1], window[:, 1:]


# ----- model ----------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class CharLM(nn.Module):
    """Token + position embeddings (nn.Embedding, so GefenMuonHybrid routes them to its backup),
    pre-norm blocks with bias-free linears, final norm, ``lm_head`` (routed to the backup by name)."""

    def __init__(self, vocab: int, task: Task):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, task.d), nn.Embedding(task.context, task.d)
        self.blocks = nn.ModuleList(Block(task.d, task.heads) for _ in range(task.layers))
        self.norm, self.lm_head = nn.LayerNorm(task.d), nn.Linear(task.d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


# ----- optimizers -----------------------------------------------------------------------------
def _variant(**kw):
    def make(model, task, seed):
        from benchmarks.fidelity_variants import MomentVariant

        return MomentVariant(model.parameters(), lr=task.lr, weight_decay=task.weight_decay, seed=seed, **kw)
    return make


def _adamw(model, task, seed):
    return torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)


def _gefen(model, task, seed):
    """The production default; the run's seed also seeds the rounding noise (as the prototype's)."""
    from gefen import Gefen

    return Gefen(model.named_parameters(), lr=task.lr, weight_decay=task.weight_decay, seed=seed)


def _gefen_rule(name: str):
    """The production default under another step-safety rule (``benchmarks.step_rules``)."""
    def make(model, task, seed):
        from benchmarks.step_rules import under_rule
        from gefen import Gefen

        return under_rule(Gefen, name)(model.named_parameters(), lr=task.lr, weight_decay=task.weight_decay, seed=seed)
    return make


def _gefen_m8(model, task, seed):
    from gefen import Gefen

    return Gefen(model.named_parameters(), lr=task.lr, weight_decay=task.weight_decay, moments="m8")


def _hybrid(model, task, seed):
    from gefen import GefenMuonHybrid

    return GefenMuonHybrid(model, lr=task.lr, weight_decay=task.weight_decay, seed=seed)


class _Chain(torch.optim.Optimizer):
    """Two torch optimizers as one (param groups, state, step), for the LR schedule; ``children``
    lets ``state_bytes`` count both."""

    def __init__(self, **children: torch.optim.Optimizer):
        self.children = children
        torch.optim.Optimizer.__setstate__(self, {"defaults": {}})

    @property
    def param_groups(self) -> list[dict]:
        return [g for child in self.children.values() for g in child.param_groups]

    @property
    def state(self) -> dict:
        return {p: st for child in self.children.values() for p, st in child.state.items()}

    def step(self, closure=None):
        for child in self.children.values():
            child.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.children.values():
            child.zero_grad(set_to_none)


def _muon(model, task, seed):
    """torch.optim.Muon on the hidden matrices and AdamW on the rest, split and scaled as
    GefenMuonHybrid does (``split_params_for_muon``; Muon's update matched to AdamW's RMS, so one
    learning rate serves both)."""
    from gefen import split_params_for_muon

    muon, rest = split_params_for_muon(model)
    return _Chain(muon=torch.optim.Muon([p for _, p in muon], lr=task.lr, weight_decay=task.weight_decay,
                                        adjust_lr_fn="match_rms_adamw"),
                  adamw=torch.optim.AdamW([p for _, p in rest], lr=task.lr, weight_decay=task.weight_decay))


def _torchao_adamw4bit(model, task, seed):
    """torchao's 4-bit AdamW (block-wise 4-bit moments), where torchao is installed."""
    from torchao.optim import AdamW4bit

    return AdamW4bit(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)


def torchao_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


#: name -> (description, factory(model, task, seed)); the first is the baseline
OPTIMIZERS = {
    "adamw": ("torch AdamW (fp32 moments)", _adamw),
    "gefen": ("Gefen (default moments='m4v4': 4-bit m + 4-bit v/factored, stochastic rounding unbiased in v^(1/3))",
              _gefen),
    "gefen-m8": ("Gefen moments='m8': 8-bit m, factored v", _gefen_m8),
    **{f"gefen-{rule}": (f"Gefen under the step rule {rule!r} (benchmarks/step_rules.py)", _gefen_rule(rule))
       for rule in ("unguarded", "zero-only", "bound-1", "cap")},
    "hybrid": ("GefenMuonHybrid (Gefen backup)", _hybrid),
    "muon": ("torch.optim.Muon (hidden matrices) + AdamW (rest)", _muon),
    "torchao-4bit": ("torchao.optim.AdamW4bit (block-wise 4-bit moments)", _torchao_adamw4bit),
    "p-m8-factored": ("prototype: 8-bit m, factored v", _variant(m_bits=8)),
    "p-m4v4-ratio-sr": ("4-bit m + 4-bit log(v/factored), stochastic rounding",
                        _variant(m_bits=4, v="ratio", v_bits=4, rounding="stochastic")),
    "p-m4v4-ratio-near": ("4-bit m + 4-bit log(v/factored), nearest rounding",
                          _variant(m_bits=4, v="ratio", v_bits=4)),
    "p-m4v4-rowlog-sr": ("4-bit m + 4-bit log v in the row's range, stochastic",
                         _variant(m_bits=4, v="rowlog", v_bits=4, rounding="stochastic")),
    "p-m5v3-ratio-sr": ("5-bit m + 3-bit log(v/factored), stochastic",
                        _variant(m_bits=5, v="ratio", v_bits=3, rounding="stochastic")),
    "p-m6v2-ratio-sr": ("6-bit m + 2-bit log(v/factored), stochastic",
                        _variant(m_bits=6, v="ratio", v_bits=2, rounding="stochastic")),
}
BASELINE = "adamw"
#: quick run: the shipped optimizers, stdlib text, seed 0
QUICK = ("adamw", "gefen", "hybrid")
CORE = ("adamw", "gefen", "muon", "hybrid")  # the 400-step table: both texts, seeds 0 and 1


def full_plan() -> list[tuple[str, str, int]]:
    """(text, optimizer, seed) of the 400-step table, most needed first (each run is ~6-8
    CPU-minutes): seed 0 of every optimizer on both texts, then seed 1."""
    return [(t, n, s) for s in (0, 1) for n in CORE for t in TEXTS]


def _leaves(t: torch.Tensor):
    """The plain tensors a tensor subclass holds (torchao's 4-bit state: codes and scales)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _leaves(getattr(t, name))
    else:
        yield t


def state_bytes(opt) -> int:
    """Bytes of optimizer state: the prototype's packed size, else every state tensor (each
    storage once) plus codebooks; a composite counts its children."""
    if hasattr(opt, "state_bytes"):
        return opt.state_bytes()
    children = getattr(opt, "children", None)
    opts = list(children.values()) if isinstance(children, dict) else [opt]
    seen, total = set(), 0
    for o in opts:
        tensors = [t for st in o.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        books = o.global_books() if hasattr(o, "global_books") else {}
        tensors += [getattr(o, name) for name in books if getattr(o, name) is not None]
        for t in (leaf for x in tensors for leaf in _leaves(x)):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


# ----- one training run -----------------------------------------------------------------------
def held_out_loss(model: nn.Module, held: torch.Tensor, task: Task) -> float:
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                  for x, y in (batch(held, task, gen) for _ in range(task.eval_batches))]
    return sum(losses) / len(losses)


def fit(model, opt, train_data, task: Task, seed: int, after_step=None) -> list[float]:
    """The recipe's training loop (warm-up + cosine LR, clipping 1.0, batches drawn from ``seed``);
    ``after_step()`` runs after every step (probes that watch the gradients). The loss curve."""
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / task.warmup) * 0.5 * (1 + math.cos(math.pi * s / task.steps)))
    gen = torch.Generator().manual_seed(100 + seed)
    curve = []
    for _ in range(task.steps):
        x, y = batch(train_data, task, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if after_step is not None:
            after_step()
        curve.append(loss.item())
    return curve


def train(text: str, optimizer: str, seed: int, task: Task = Task(), data=None) -> dict:
    """Train one model; the held-out loss, the training-loss curve, state bytes and seconds."""
    start = time.perf_counter()
    train_data, held, vocab = corpus(text) if data is None else data
    torch.manual_seed(seed)
    model = CharLM(vocab, task)
    opt = OPTIMIZERS[optimizer][1](model, task, seed)
    curve = fit(model, opt, train_data, task, seed)
    params = sum(p.numel() for p in model.parameters())
    return {"text": text, "optimizer": optimizer, "seed": seed, "held_out": held_out_loss(model, held, task),
            "curve": curve, "state_bytes": state_bytes(opt), "params": params,
            "state_bytes_bf16_stats": opt.state_bytes(2) if hasattr(opt, "state_bytes") else None,
            "seconds": round(time.perf_counter() - start, 1), "task": asdict(task)}


def _worker_init() -> None:
    torch.set_num_threads(1)


def _job(args: tuple) -> dict:
    text, optimizer, seed, task = args
    path = _record(text, optimizer, seed, task)
    if os.environ.get("GEFEN_QUALITY_RESUME") == "1" and path.is_file():
        cached = json.loads(path.read_text())
        if cached["task"] == asdict(task):
            return cached | {"reused": True}
    result = train(text, optimizer, seed, task)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result) + "\n")
    return result


def _record(text: str, optimizer: str, seed: int, task: Task) -> Path:
    """Where a finished run is kept: the default task by its step count (as before), any other
    task also by its learning rate and width."""
    tag = "" if (task.d, task.layers, task.lr) == (192, 3, 2e-3) else f"-lr{task.lr:g}-d{task.d}x{task.layers}"
    return OUT / "quality" / f"{text}-{optimizer}-{seed}-{task.steps}{tag}.json"


def run_jobs(jobs: list[tuple], workers: int) -> list[dict]:
    """Run ``(text, optimizer, seed, task)`` jobs in spawned one-thread processes, printing progress."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process whose OpenMP pool is running
    results = []
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
        futures = [pool.submit(_job, job) for job in jobs]
        for i, fut in enumerate(cf.as_completed(futures), 1):
            r = fut.result()
            results.append(r)
            print(f"[quality] {i}/{len(jobs)} {r['text']} {r['optimizer']} seed {r['seed']}: "
                  f"{r['held_out']:.4f} ({r['seconds']} s{', reused' if r.get('reused') else ''})", flush=True)
    return results


# ----- learning-rate sweep: each optimizer at its own best learning rate ------------------------
#: the sweep's task (``tests/optim/test_quality_lm.py``'s short task): ~5 CPU-seconds a run, so the
#: whole sweep (~80 runs) is a few CPU-minutes; ``ranking_section`` checks its ranking on ``Task()``
SWEEP_TASK = Task(d=64, layers=2, heads=4, context=64, batch=16, steps=150, warmup=20, eval_batches=8)
#: five learning rates over 16x, around AdamW's best on this task
SWEEP_LRS = (4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2)
#: an optimizer whose seed-0 best is the largest (smallest) rate it ran also runs at twice (half)
#: that rate, up to this many times, so that each one's best is bracketed
MAX_EXTEND = 3
#: each compressed optimizer and the optimizer it is compared with at their own best rates
SWEEP_PAIRS = {"gefen": "adamw", "torchao-4bit": "adamw", "hybrid": "muon"}
#: a rate counts as "near AdamW's best" when AdamW's seed-0 loss there is within this factor
NEAR_BEST = 1.05


def sweep_names() -> tuple[str, ...]:
    return ("adamw", "gefen", "muon", "hybrid") + (("torchao-4bit",) if torchao_installed() else ())


def _at(task: Task, lr: float) -> Task:
    import dataclasses

    return dataclasses.replace(task, lr=lr)


def _seed0(results: list[dict]) -> dict[tuple[str, str], dict[float, float]]:
    """(text, optimizer) -> {lr: seed-0 held-out loss}."""
    out: dict[tuple[str, str], dict[float, float]] = {}
    for r in results:
        if r["seed"] == 0:
            out.setdefault((r["text"], r["optimizer"]), {})[r["task"]["lr"]] = r["held_out"]
    return out


def sweep_extensions(results: list[dict]) -> list[tuple[str, str, float]]:
    """(text, optimizer, lr) one factor of 2 past the edge, for each optimizer whose seed-0 best is
    the largest or the smallest rate it ran (doubling and halving are exact in binary floats)."""
    todo = []
    for (text, name), per in _seed0(results).items():
        best = min(per, key=per.get)
        if len(per) > 1 and best == max(per):
            todo.append((text, name, best * 2))
        elif len(per) > 1 and best == min(per):
            todo.append((text, name, best / 2))
    return sorted(todo)


def sweep_second_seeds(results: list[dict]) -> list[tuple[str, str, float]]:
    """(text, optimizer, lr) to run with seed 1: each optimizer's two best rates by its seed-0 loss,
    and, for AdamW and the optimizers compared with it, every rate near AdamW's best."""
    seed0, todo = _seed0(results), set()
    for (text, name), per in seed0.items():
        todo.update((text, name, lr) for lr in sorted(per, key=per.get)[:2])
    for text in {t for t, _ in seed0}:
        base = seed0.get((text, "adamw"))
        if not base:
            continue
        near = [lr for lr, loss in base.items() if loss <= NEAR_BEST * min(base.values())]
        for name in ("adamw", *[k for k, v in SWEEP_PAIRS.items() if v == "adamw"]):
            todo.update((text, name, lr) for lr in near if lr in seed0.get((text, name), {}))
    return sorted(todo)


def run_sweep(task: Task = SWEEP_TASK, lrs=SWEEP_LRS, texts=tuple(TEXTS), names=None, workers: int = 2) -> list[dict]:
    """Seed 0 at every rate (and past the edge where ``sweep_extensions`` says), then seed 1
    where ``sweep_second_seeds`` says."""
    names = names or sweep_names()
    results = run_jobs([(t, n, 0, _at(task, lr)) for n in names for lr in lrs for t in texts], workers)
    for _ in range(MAX_EXTEND):
        more = sweep_extensions(results)
        if not more:
            break
        results += run_jobs([(t, n, 0, _at(task, lr)) for t, n, lr in more], workers)
    return results + run_jobs([(t, n, 1, _at(task, lr)) for t, n, lr in sweep_second_seeds(results)], workers)


def sweep_summary(results: list[dict]) -> dict:
    """Per text: ``losses[name][lr]`` (by seed), each optimizer's best rate (lowest mean over the
    rates run with both seeds) and whether it is bracketed (neither the largest nor the smallest
    rate run with seed 0), best-vs-best ratios of ``SWEEP_PAIRS``, and the per-rate ratio to AdamW
    at the rates near AdamW's best (mean over the seeds both ran)."""
    out: dict[str, dict] = {}
    for r in sorted(results, key=lambda r: (r["task"]["lr"], r["seed"])):
        entry = out.setdefault(r["text"], {"losses": {}})
        entry["losses"].setdefault(r["optimizer"], {}).setdefault(r["task"]["lr"], {})[r["seed"]] = r["held_out"]
    for entry in out.values():
        losses = entry["losses"]
        best = {}
        for name, by_lr in losses.items():
            two = {lr: sum(s.values()) / len(s) for lr, s in by_lr.items() if len(s) == 2}
            ran = [lr for lr, s in by_lr.items() if 0 in s]
            if two:
                lr = min(two, key=two.get)
                best[name] = {"lr": lr, "mean": two[lr], "bracketed": min(ran) < lr < max(ran)}
        entry["best"] = best
        entry["best_vs_best"] = {n: best[n]["mean"] / best[b]["mean"] for n, b in SWEEP_PAIRS.items()
                                 if n in best and b in best}
        base = losses.get("adamw", {})
        seed0 = {lr: s[0] for lr, s in base.items() if 0 in s}
        near = sorted(lr for lr, x in seed0.items() if x <= NEAR_BEST * min(seed0.values())) if seed0 else []
        entry["near_adamw_best"] = {}
        for name in (n for n, b in SWEEP_PAIRS.items() if b == "adamw" and n in losses):
            per = {}
            for lr in near:
                mine, theirs = losses[name].get(lr, {}), base[lr]
                seeds = sorted(set(mine) & set(theirs))
                if seeds:
                    per[lr] = {"seeds": seeds, "ratio": sum(mine[s] for s in seeds) / sum(theirs[s] for s in seeds)}
            entry["near_adamw_best"][name] = per
    return out


def _rates(by_name: dict[str, dict]) -> list[float]:
    return sorted({lr for by_lr in by_name.values() for lr in by_lr})


def sweep_markdown(summary: dict) -> str:
    parts = []
    for text, entry in summary.items():
        lrs = _rates(entry["losses"])
        header = ["optimizer"] + [f"lr {lr:g}" for lr in lrs] + ["best lr (mean of 2 seeds)", "best vs best"]
        rows = []
        for name, by_lr in entry["losses"].items():
            cells = []
            for lr in lrs:
                s = by_lr.get(lr, {})
                cells.append("" if not s else " / ".join(f"{s[k]:.4f}" for k in sorted(s))
                             + (f" ({sum(s.values()) / len(s):.4f})" if len(s) == 2 else ""))
            b = entry["best"].get(name)
            pair = SWEEP_PAIRS.get(name)
            ratio = entry["best_vs_best"].get(name)
            rows.append([f"`{name}`", *cells,
                         "" if b is None else f"{b['lr']:g}: {b['mean']:.4f}" + ("" if b["bracketed"] else " (edge)"),
                         "" if ratio is None else f"{ratio:.4f} vs `{pair}`"])
        parts += [f"**{text}** (seed 0 / seed 1 (mean)):", "", md_table(header, rows), ""]
        for name, per in entry["near_adamw_best"].items():
            if per:
                parts.append(f"`{name}` / `adamw` at the rates where AdamW is within {NEAR_BEST - 1:.0%} of its best: "
                             + ", ".join(f"{lr:g}: {v['ratio']:.4f} (seeds {'+'.join(map(str, v['seeds']))})"
                                         for lr, v in per.items()) + ".")
        parts.append("")
    return "\n".join(parts)


def plot_sweep(summary: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4), dpi=110, squeeze=False)
    for ax, (text, entry) in zip(axes[0], summary.items()):
        for name, by_lr in entry["losses"].items():
            xs = sorted(lr for lr, s in by_lr.items() if 0 in s)
            line, = ax.plot(xs, [by_lr[lr][0] for lr in xs], marker="o", markersize=3, linewidth=1, label=name)
            two = sorted(lr for lr, s in by_lr.items() if len(s) == 2)
            ax.plot(two, [sum(by_lr[lr].values()) / 2 for lr in two], marker="*", markersize=8, linestyle="none",
                    color=line.get_color())
        ax.set_xscale("log")
        ax.set_title(f"{text}: held-out loss vs learning rate (dots seed 0, stars mean of 2 seeds)", fontsize=8)
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("held-out cross-entropy (nats/char)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "quality_lr_sweep.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _footer(results: list[dict]) -> str:
    new = [r for r in results if not r.get("reused")]
    return (f"{len(results)} runs ({len(results) - len(new)} reused from benchmarks/out/quality/); "
            f"{sum(r['seconds'] for r in results) / 60:.1f} minutes of training in all, the sum of the runs' "
            "wall times (one thread each, on a shared machine).")


def sweep_section(task: Task = SWEEP_TASK, workers: int = 2) -> dict:
    results = run_sweep(task, workers=workers)
    summary = sweep_summary(results)
    write_json("quality_sweep", {"task": asdict(task), "lrs": list(SWEEP_LRS),
                                 "summary": {t: {k: v for k, v in e.items()} for t, e in summary.items()},
                                 "runs": [{k: v for k, v in r.items() if k != "curve"} for r in results]})
    params = results[0]["params"]
    markdown = "\n".join([
        f"The character LM at a small size ({params:,} parameters, d = {task.d}, {task.layers} layers, context "
        f"{task.context}), {task.steps} steps of batch {task.batch} x {task.context}, cosine schedule "
        f"({task.warmup} warm-up steps), weight decay {task.weight_decay}, clipping 1.0; held-out loss over "
        f"{task.eval_batches} fixed batches. Seed 0 at five peak rates over 16x ({', '.join(f'{lr:g}' for lr in SWEEP_LRS)}); "
        "an optimizer whose seed-0 best is the largest (smallest) rate it ran also runs at twice (half) that, "
        f"up to {MAX_EXTEND} times, so that its best is bracketed. Seed 1 at each optimizer's two best rates and, "
        f"for AdamW and the optimizers compared with it, at every rate where AdamW's seed-0 loss is within "
        f"{NEAR_BEST - 1:.0%} of its best. \"best\" is the lowest mean of two seeds, \"(edge)\" where it is the "
        "largest or smallest rate run. `gefen` and `torchao-4bit` (where installed) are compared with `adamw`, "
        "`hybrid` with `muon`.",
        "", sweep_markdown(summary), _footer(results),
    ])
    return {"markdown": markdown, "plots": [str(plot_sweep(summary))], "summary": summary}


# ----- does the small task rank like the 400-step one? ------------------------------------------
#: rates at which AdamW and Gefen run at both sizes (seed 0, stdlib); 2e-3 is the table's own run
RANK_LRS = (2e-3, 8e-3, 1.6e-2)
RANK_NAMES = ("adamw", "gefen")
#: seeds of both at the big task's AdamW-best rate of ``RANK_LRS``: one seed there scatters by 2-3%
RANK_SEEDS = 6


def ranking_section(task: Task = Task(), small: Task = SWEEP_TASK, workers: int = 2) -> dict:
    """AdamW and Gefen (seed 0, stdlib) at ``RANK_LRS`` on ``task`` and on the sweep's ``small``
    task: the Gefen / AdamW ratio at each rate and each size, and AdamW's best of these rates."""
    jobs = [("stdlib", n, 0, _at(t, lr)) for t in (task, small) for lr in RANK_LRS for n in RANK_NAMES]
    results = run_jobs(_cached_only(jobs), workers)
    loss = {(r["task"]["steps"], r["optimizer"], r["task"]["lr"]): r["held_out"] for r in results}
    lrs = [lr for lr in RANK_LRS if all((t.steps, n, lr) in loss for t in (task, small) for n in RANK_NAMES)]
    if not lrs:
        return {"markdown": "", "results": results, "data": {}}
    rows, ratios = [], {}
    for lr in lrs:
        row = [f"{lr:g}"]
        for t in (task, small):
            a, g = loss[(t.steps, "adamw", lr)], loss[(t.steps, "gefen", lr)]
            ratios[(t.steps, lr)] = g / a
            row += [f"{a:.4f}", f"{g:.4f}", f"{g / a:.4f}"]
        rows.append(row)
    best = {t.steps: min(lrs, key=lambda lr: loss[(t.steps, "adamw", lr)]) for t in (task, small)}
    header = ["lr"] + [f"{t.steps} steps, d = {t.d}: {c}" for t in (task, small) for c in ("AdamW", "Gefen", "Gefen / AdamW")]
    spread = max(abs(ratios[(task.steps, lr)] - ratios[(small.steps, lr)]) for lr in lrs)
    markdown = "\n".join([
        f"Does the small task rank like the {task.steps}-step one? AdamW and Gefen, seed 0, stdlib, at "
        f"{', '.join(f'{lr:g}' for lr in lrs)} on both tasks (the {task.steps}-step runs at 2e-3 are the table's):",
        "", md_table(header, rows), "",
        f"AdamW's best of these rates: {best[task.steps]:g} ({task.steps} steps), {best[small.steps]:g} "
        f"({small.steps} steps); the Gefen / AdamW ratios of the two sizes differ by at most {spread:.4f} at "
        "one rate.",
    ])
    seeds = seeds_at(task, best[task.steps], workers)
    return {"markdown": markdown + ("\n\n" + seeds["markdown"] if seeds["markdown"] else ""),
            "results": results + seeds["results"],
            "data": {"ratios": {f"{s}-{lr:g}": v for (s, lr), v in ratios.items()}, "adamw_best": best,
                     "seeds": seeds["data"]}}


def seeds_at(task: Task, lr: float, workers: int = 2, n: int = RANK_SEEDS) -> dict:
    """AdamW and Gefen (stdlib) with seeds 0 .. n-1 at ``lr`` on ``task``: the ratio of their mean
    losses, and the per-seed ratios' mean with its standard error (a seed changes the data order
    and the initialisation of both alike, so the ratios pair)."""
    jobs = [("stdlib", name, seed, _at(task, lr)) for seed in range(n) for name in RANK_NAMES]
    results = run_jobs(_cached_only(jobs), workers)
    loss = {(r["optimizer"], r["seed"]): r["held_out"] for r in results}
    paired = [seed for seed in range(n) if all((name, seed) in loss for name in RANK_NAMES)]
    if len(paired) < 2:
        return {"markdown": "", "results": results, "data": {}}
    per_seed = [loss[("gefen", seed)] / loss[("adamw", seed)] for seed in paired]
    mean, stderr = statistics.fmean(per_seed), statistics.stdev(per_seed) / math.sqrt(len(per_seed))
    of_means = sum(loss[("gefen", seed)] for seed in paired) / sum(loss[("adamw", seed)] for seed in paired)
    rows = [[str(seed), f"{loss[('adamw', seed)]:.4f}", f"{loss[('gefen', seed)]:.4f}", f"{x:.4f}"]
            for seed, x in zip(paired, per_seed)]
    markdown = "\n".join([
        f"At {lr:g}, the {task.steps}-step task's best rate for AdamW above, with {len(paired)} seeds (stdlib):", "",
        md_table(["seed", "AdamW", "Gefen", "Gefen / AdamW"], rows), "",
        f"Gefen / AdamW: {of_means:.4f} for the mean losses; per seed {mean:.4f} +- {stderr:.4f} (mean +- standard "
        f"error over {len(paired)} seeds).",
    ])
    return {"markdown": markdown, "results": results,
            "data": {"lr": lr, "seeds": paired, "of_means": of_means, "mean_ratio": mean, "stderr": stderr}}


#: the step-safety rules compared at the 400-step task's best rates for AdamW (docs/decisions.md,
#: "Bounded steps"): the product's, and the rule before it
RULE_NAMES = ("gefen", "gefen-unguarded")
RULE_LRS = (8e-3, 1.6e-2)


def rules_section(task: Task = Task(), lrs=RULE_LRS, names=RULE_NAMES, seeds=(0, 1), workers: int = 2) -> str:
    """AdamW and Gefen under each step rule of ``names`` (stdlib) at ``lrs`` with ``seeds``: the
    held-out losses and each one's ratio to AdamW's mean over the same seeds."""
    jobs = [("stdlib", n, seed, _at(task, lr)) for lr in lrs for seed in seeds for n in ("adamw", *names)]
    loss = {(r["optimizer"], r["task"]["lr"], r["seed"]): r["held_out"] for r in run_jobs(jobs, workers)}
    rows = []
    for lr in lrs:
        base = statistics.fmean(loss[("adamw", lr, s)] for s in seeds)
        for n in ("adamw", *names):
            per = [loss[(n, lr, s)] for s in seeds]
            rows.append([f"{lr:g}", f"`{n}`", " / ".join(f"{x:.4f}" for x in per), f"{statistics.fmean(per):.4f}",
                         f"{statistics.fmean(per) / base:.4f}"])
    return "\n".join([f"{task.steps} steps, d = {task.d}, stdlib, seeds {', '.join(map(str, seeds))}:", "",
                      md_table(["lr", "optimizer", "held-out loss per seed", "mean", "vs AdamW"], rows)])


# ----- report ---------------------------------------------------------------------------------
def summarise(results: list[dict]) -> dict:
    """Per text and optimizer: mean held-out loss over seeds, per-seed losses, and the ratio to
    AdamW's mean over the *same* seeds (a row run on fewer seeds compares like with like)."""
    table: dict[str, dict[str, dict]] = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        entry = table.setdefault(r["text"], {}).setdefault(r["optimizer"], {
            "losses": [], "seeds": [], "state_bytes": r["state_bytes"], "params": r["params"],
            "state_bytes_bf16_stats": r.get("state_bytes_bf16_stats")})
        entry["losses"].append(r["held_out"])
        entry["seeds"].append(r["seed"])
    for per_opt in table.values():
        base = per_opt.get(BASELINE, {"seeds": [], "losses": []})
        base_by_seed = dict(zip(base["seeds"], base["losses"]))
        for entry in per_opt.values():
            entry["mean"] = sum(entry["losses"]) / len(entry["losses"])
            matched = [base_by_seed[s] for s in entry["seeds"] if s in base_by_seed]
            entry["vs_adamw"] = (entry["mean"] / (sum(matched) / len(matched))
                                 if len(matched) == len(entry["seeds"]) else float("nan"))
    return table


def plot_curves(results: list[dict], names: list[str], texts: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4), dpi=110, squeeze=False)
    window = 20
    for ax, text in zip(axes[0], texts):
        for name in names:
            curves = [r["curve"] for r in results if r["text"] == text and r["optimizer"] == name]
            if not curves:
                continue
            mean = np.mean(np.array(curves), axis=0)
            smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window, len(mean) + 1), smooth, label=name, linewidth=1)
        ax.set_title(f"{text}: training loss (mean over seeds, {window}-step average)", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/char)")
        finals = [r["curve"][-1] for r in results if r["text"] == text]
        if finals:
            ax.set_ylim(min(finals) - 0.3, min(finals) + 1.2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "quality_curves.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _cached_only(jobs: list[tuple]) -> list[tuple]:
    """With ``GEFEN_QUALITY_CACHED_ONLY=1``, only the jobs whose run is in benchmarks/out/quality/."""
    if os.environ.get("GEFEN_QUALITY_CACHED_ONLY") != "1":
        return jobs
    return [j for j in jobs if _record(*j).is_file()]


def table_markdown(results: list[dict], task: Task) -> str:
    """The 400-step table: held-out loss per optimizer and text, mean over the seeds run."""
    table = summarise(results)
    names = [n for n in OPTIMIZERS if any(r["optimizer"] == n for r in results)]
    texts = [t for t in TEXTS if t in table]
    bf16_col = any(table[t][n]["state_bytes_bf16_stats"] is not None for t in texts for n in table[t])
    rows = []
    for name in names:
        first = next(table[t][name] for t in texts if name in table[t])
        row = [f"`{name}`", OPTIMIZERS[name][0], f"{first['state_bytes'] / first['params']:.3f}"]
        if bf16_col:
            bf16 = first["state_bytes_bf16_stats"]
            row.append("" if bf16 is None else f"{bf16 / first['params']:.3f}")
        for text in texts:
            e = table[text].get(name)
            row += (["not run", ""] if e is None else
                    [f"{e['mean']:.4f} ({' / '.join(f'{x:.4f}' for x in e['losses'])})",
                     "" if math.isnan(e["vs_adamw"]) else f"{e['vs_adamw']:.4f}"])
        rows.append(row)
    header = ["optimizer", "storage", "state B/param"] + (["B/param, bf16 row/col stats"] if bf16_col else [])
    for text in texts:
        header += [f"{text}: held-out loss, mean (per seed)", f"{text}: vs AdamW"]
    seeds = sorted({r["seed"] for r in results})
    params = table[texts[0]][BASELINE]["params"]
    return "\n".join([
        f"Character LM on real text ({params:,} parameters, d = {task.d}, {task.layers} layers, context "
        f"{task.context}), {task.steps} steps of batch {task.batch} x {task.context}, cosine LR {task.lr} "
        f"({task.warmup} warm-up steps), weight decay {task.weight_decay}, clipping 1.0, one thread per run; "
        f"held-out loss = mean over {task.eval_batches} fixed batches of the last 10% of the text, seed"
        f"{'s' if len(seeds) > 1 else ''} {' and '.join(map(str, seeds))}. `stdlib` is the text the second "
        "moment's storage was chosen on, `packages` one not tuned on. `gefen` is the production default "
        "(`moments='m4v4'`, state bytes as allocated). One learning rate for all, so this table compares the "
        "optimizers at 2e-3 only; the sweep below compares each at its own best rate. `muon` is "
        "torch.optim.Muon on the hidden matrices and AdamW on the rest, routed and scaled as `hybrid` routes "
        "GefenMuon and its Gefen backup. \"vs AdamW\" divides by AdamW's mean over the same seeds.",
        "", md_table(header, rows), "", _footer(results),
    ])


def run(quick: bool) -> dict:
    quick = quick or os.environ.get("GEFEN_BENCH_FULL") != "1"  # the 400-step plan only with --full
    task = Task(steps=60, warmup=10, eval_batches=8) if quick else Task()
    plan = [("stdlib", n, 0) for n in QUICK] if quick else full_plan()
    workers = int(os.environ.get("GEFEN_BENCH_JOBS", "2"))
    results = run_jobs(_cached_only([(t, n, s, task) for t, n, s in plan]), workers)
    markdown = table_markdown(results, task)
    plots = [plot_curves(results, [n for n in OPTIMIZERS if any(r["optimizer"] == n for r in results)],
                         [t for t in TEXTS if any(r["text"] == t for r in results)])]
    data = {"summary": summarise(results)}
    if not quick:  # each optimizer at its own best learning rate, and whether the small task ranks alike
        sweep = sweep_section(workers=workers)
        ranking = ranking_section(task, workers=workers)
        markdown += "\n\n### Each optimizer at its own best learning rate\n\n" + sweep["markdown"]
        markdown += "\n\n" + ranking["markdown"]
        plots += [Path(p) for p in sweep["plots"]]
        data |= {"sweep": sweep["summary"], "ranking": ranking["data"]}
    write_json("quality", {"task": asdict(task), "summary": data["summary"],
                           "runs": [{k: v for k, v in r.items() if k != "curve"} for r in results]})
    return {"title": "Training quality on real text (character LM)", "markdown": markdown,
            "plots": [str(p) for p in plots], "data": data}


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    if "--rules" in sys.argv:  # the step-safety rules at AdamW's best rates (markdown on stdout)
        print(rules_section(workers=int(os.environ.get("GEFEN_BENCH_JOBS", "2"))))
    elif "--sweep" in sys.argv:  # only the learning-rate sweep (markdown on stdout)
        print(sweep_section(workers=int(os.environ.get("GEFEN_BENCH_JOBS", "2")))["markdown"])
    else:
        print(json.dumps(run("--quick" in sys.argv)["data"], indent=1))
