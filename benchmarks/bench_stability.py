"""Stability: does each optimizer train wherever AdamW trains, with AdamW-sized steps?

Small networks a new user meets first (synthetic data made here, no downloads), each trained for
``STEPS`` steps at every learning rate in ``LRS`` and seed in ``SEEDS``, weight decay 0, by torch
AdamW, Gefen (``m4v4``, ``m8``), GefenMuonHybrid (Gefen backup), its algorithm uncompressed
(``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same split: where the hybrid misses a loss
target and this row misses it too, the miss is Muon's, not the compression's) and torchao's
AdamW8bit and AdamW4bit when torchao imports (``pip install torchao``; a run whose step fails is
reported with its error). Per run: the final loss (every sample of the case's pool, after the
last step), the worst training-batch loss, the largest per-element step ``max |p_after -
p_before| / lr`` over every step and element, the steps with a non-finite loss or parameter, and
how many "zero-history" elements moved: elements whose gradient has been exactly 0 on every step
so far (for GefenMuon's matrices, whole rows or columns of them, which Newton-Schulz keeps at
zero), which AdamW never moves without weight decay.

The targets (3-seed means against AdamW's at the same case and learning rate): no NaN/inf; worst
loss <= max(1.5 x AdamW's, AdamW's + 0.5); final loss <= 1.10 x AdamW's + 0.05; max step <= 4
(x lr); no zero-history element moved.

Cases: ``mlp16`` 16-32-32-4 MLP, batch 8; ``mlp784`` 784-256-10 MLP on non-negative, mostly-zero
inputs with an always-zero border (MNIST-like); ``deep6`` six ReLU layers of 128; ``embed``
embedding 1000x64 (only 200 rows ever looked up) + linear; ``cnn`` two 3x3 conv layers, a hidden
linear layer and a classifier on 12x12 non-negative images;
``transformer`` one pre-norm encoder block (d 32, 4 heads) learning to reverse a sequence;
``finetune`` an AdamW-pretrained MLP fine-tuned on a shifted task with the loss scaled by 1e-6
(gradients ~1e-7); ``masked`` an MLP with a quarter of its first layer's rows and half of its
second layer's weights masked out (their gradients exactly 0); ``late`` an MLP whose first 16
input features are 0 for the first ``STEPS // 3`` steps, then not.

Jobs (one per case and optimizer; torchao's one per optimizer: its step compiles once per
parameter shape and process) run in ``GEFEN_BENCH_JOBS`` (default 2) processes of one thread.
The default run is about 650 CPU-seconds on a busy 2-core machine, half of it torchao's (a
compile per parameter shape, then ~10 ms of guard checks per tensor and step on CPU); ``--quick``
(one learning rate and seed, 15 steps, no torchao) about 15 s. Writes
``benchmarks/out/stability.json`` and ``benchmarks/out/stability.png``; ``run(quick)`` returns the
``run_all`` section. Run alone with ``python -m benchmarks.bench_stability [--quick]``
(``--cases``, ``--optimizers``: a subset; ``--rule NAME ...``: Gefen, m8 and the hybrid also under
``benchmarks/step_rules.py``'s other step-safety rules, to ``stability_rules.json``/``.png``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # `python benchmarks/bench_stability.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OUT, md_table, write_json

LRS = (1e-4, 1e-3, 1e-2, 3e-2)
SEEDS = (0, 1, 2)
STEPS = 60
QUICK = {"lrs": (1e-2,), "seeds": (0,), "steps": 15}
#: the targets of a case against AdamW's 3-seed means (module docstring)
MAX_STEP = 4.0
WORST = (1.5, 0.5)  # worst <= max(1.5 x AdamW's, AdamW's + 0.5)
FINAL = (1.10, 0.05)  # final <= 1.10 x AdamW's + 0.05
BASELINE = "AdamW"
TORCHAO = ("torchao AdamW8bit", "torchao AdamW4bit")
#: the hybrid's algorithm without compression: where it misses a target, so does Muon itself
TORCH_MUON = "torch Muon+AdamW"


# ----- the cases -------------------------------------------------------------------------------
@dataclass
class Problem:
    """A model and its data: ``batch_loss(t)`` is step ``t``'s training loss, ``pool_loss()`` the loss
    over every sample (the final loss); the optimizer minimises ``scale`` x the training loss."""

    model: nn.Module
    batch_loss: Callable[[int], torch.Tensor]
    pool_loss: Callable[[], torch.Tensor]
    scale: float = 1.0


def _mlp(*widths: int) -> nn.Sequential:
    """Linear layers with ReLU between them; the last one is named ``classifier`` (so
    GefenMuonHybrid routes it to its backup, as it would a real model's head)."""
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers[:-1])
    model.add_module("classifier", layers[-1])
    return model


def _teacher(x: torch.Tensor, classes: int, gen: torch.Generator) -> torch.Tensor:
    """Labels from a random linear teacher: learnable, not trivially."""
    return (x.flatten(1) @ torch.randn(x[0].numel(), classes, generator=gen)).argmax(1)


def _classify(model: nn.Module, x, y, batch: int, inputs=None, scale: float = 1.0) -> Problem:
    """Cross-entropy over a pool of ``len(x)`` samples, ``batch`` per step in order;
    ``inputs(t, xb)`` may change step ``t``'s inputs (the dead-then-alive features)."""
    def batch_loss(t: int) -> torch.Tensor:
        i = (t * batch) % len(x)
        xb = x[i:i + batch]
        return F.cross_entropy(model(inputs(t, xb) if inputs else xb), y[i:i + batch])

    return Problem(model, batch_loss, lambda: F.cross_entropy(model(x), y), scale)


def mlp16(gen, steps) -> Problem:
    x = torch.randn(256, 16, generator=gen)
    return _classify(_mlp(16, 32, 32, 4), x, _teacher(x, 4, gen), 8)


def mlp784(gen, steps) -> Problem:
    img = torch.rand(512, 28, 28, generator=gen)
    img = torch.where(img > 0.7, img, torch.zeros(()))  # mostly zero, non-negative
    img[:, :4], img[:, -4:], img[:, :, :4], img[:, :, -4:] = 0, 0, 0, 0  # a border that is always 0
    x = img.flatten(1)
    return _classify(_mlp(784, 256, 10), x, _teacher(x, 10, gen), 32)


def deep6(gen, steps) -> Problem:
    x = torch.randn(512, 32, generator=gen)
    return _classify(_mlp(32, *[128] * 6, 10), x, _teacher(x, 10, gen), 16)


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.classifier = nn.Linear(64, 10)

    def forward(self, tokens):
        return self.classifier(self.embed(tokens))


def embed(gen, steps) -> Problem:
    zipf = 1.0 / torch.arange(1, 201, dtype=torch.float)  # 200 of the 1000 rows, Zipf-distributed
    tokens = torch.multinomial(zipf, 512, replacement=True, generator=gen)
    labels = torch.randint(0, 10, (1000,), generator=gen)[tokens]
    return _classify(_Embed(), tokens, labels, 16)


def cnn(gen, steps) -> Problem:
    img = torch.rand(256, 1, 12, 12, generator=gen)
    img = torch.where(img > 0.5, img, torch.zeros(()))
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(16 * 3 * 3, 32), nn.ReLU())
    model.add_module("classifier", nn.Linear(32, 10))
    return _classify(model, img, _teacher(img, 10, gen), 16)


class _Block(nn.Module):
    """Token + position embeddings, one pre-norm encoder block, a head over the vocabulary."""

    def __init__(self, vocab: int = 32, length: int = 12, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(length, d) * 0.02)
        self.block = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.lm_head(self.block(self.embed(tokens) + self.pos))


def transformer(gen, steps) -> Problem:
    tokens = torch.randint(0, 32, (256, 12), generator=gen)
    model, target = _Block(), tokens.flip(1)  # reverse the sequence

    def loss(xb, yb):
        return F.cross_entropy(model(xb).flatten(0, 1), yb.flatten())

    def batch_loss(t):
        i = (t * 8) % len(tokens)
        return loss(tokens[i:i + 8], target[i:i + 8])

    return Problem(model, batch_loss, lambda: loss(tokens, target))


def finetune(gen, steps) -> Problem:
    """Pretrained (AdamW, 40 steps) on one teacher, fine-tuned on a nearby one, loss x 1e-6."""
    x = torch.randn(512, 32, generator=gen)
    w = torch.randn(32, 10, generator=gen)
    before, after = (x @ w).argmax(1), (x @ (w + 0.5 * torch.randn(32, 10, generator=gen))).argmax(1)
    model = _mlp(32, 64, 64, 10)
    pretrain = _classify(model, x, before, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0)
    for t in range(40):
        opt.zero_grad()
        pretrain.batch_loss(t).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return _classify(model, x, after, 32, scale=1e-6)


class _Masked(nn.Module):
    """An MLP whose masked weights (a quarter of the first layer's rows, half of the second
    layer's elements) take no part: their gradients are exactly 0, so they must never move."""

    def __init__(self, gen):
        super().__init__()
        self.fc1, self.fc2, self.classifier = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        rows = torch.ones(64, 1)
        rows[torch.randperm(64, generator=gen)[:16]] = 0
        self.register_buffer("mask1", rows.expand(64, 32).clone())
        self.register_buffer("mask2", (torch.rand(64, 64, generator=gen) > 0.5).float())

    def forward(self, x):
        x = F.relu(F.linear(x, self.fc1.weight * self.mask1, self.fc1.bias))
        x = F.relu(F.linear(x, self.fc2.weight * self.mask2, self.fc2.bias))
        return self.classifier(x)


def masked(gen, steps) -> Problem:
    x = torch.randn(512, 32, generator=gen)
    return _classify(_Masked(gen), x, _teacher(x, 10, gen), 16)


def late(gen, steps) -> Problem:
    """Features 0-15 read 0 until step ``steps // 3``, then their values."""
    x = torch.randn(512, 32, generator=gen)
    switch = steps // 3

    def inputs(t, xb):
        return xb if t >= switch else torch.cat([torch.zeros_like(xb[:, :16]), xb[:, 16:]], 1)

    return _classify(_mlp(32, 64, 64, 10), x, _teacher(x, 10, gen), 16, inputs=inputs)


CASES: dict[str, Callable[[torch.Generator, int], Problem]] = {
    "mlp16": mlp16, "mlp784": mlp784, "deep6": deep6, "embed": embed, "cnn": cnn,
    "transformer": transformer, "finetune": finetune, "masked": masked, "late": late,
}


# ----- the optimizers --------------------------------------------------------------------------
def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class NotApplicable(Exception):
    """The optimizer does not apply to the case (GefenMuonHybrid on a model with no hidden matrix)."""


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``model``'s trainable parameters, weight decay 0. ``"<Gefen
    optimizer> [<rule>]"``: that optimizer under ``benchmarks.step_rules``' rule (``--rule``)."""
    from gefen import Gefen, GefenMuonHybrid, split_params_for_muon

    name, _, rule = name.partition(" [")
    ruled = (lambda cls: cls) if not rule else _ruled(rule.rstrip("]"))
    params = [p for _, p in _trainable(model)]
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if name.startswith("Gefen "):
        return ruled(Gefen)(_trainable(model), lr=lr, weight_decay=0.0, moments=name.split()[1])
    if name == "GefenMuonHybrid":
        if not split_params_for_muon(model)[0]:
            raise NotApplicable("no hidden matrix for Muon")
        return ruled(GefenMuonHybrid)(model, lr=lr, weight_decay=0.0)
    if name == TORCH_MUON:
        return TorchMuonAdamW(model, lr)
    if name in TORCHAO:
        import torchao.optim

        return getattr(torchao.optim, name.split()[1])(params, lr=lr, weight_decay=0.0)
    raise ValueError(f"unknown optimizer {name!r}")


def _ruled(rule: str):
    from benchmarks.step_rules import under_rule

    return lambda cls: under_rule(cls, rule)


class TorchMuonAdamW:
    """GefenMuonHybrid's algorithm uncompressed: ``torch.optim.Muon`` (``match_rms_adamw``, as the
    hybrid's default) on the matrices the hybrid routes to Muon, ``torch.optim.AdamW`` on the rest."""

    def __init__(self, model: nn.Module, lr: float):
        from gefen import split_params_for_muon

        if not hasattr(torch.optim, "Muon"):
            raise NotApplicable(f"torch {torch.__version__} has no torch.optim.Muon")
        muon, backup = split_params_for_muon(model)
        if not muon:
            raise NotApplicable("no hidden matrix for Muon")
        self.children = {
            "muon": torch.optim.Muon([p for _, p in muon], lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
            "backup": torch.optim.AdamW([p for _, p in backup], lr=lr, weight_decay=0.0)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.children.values():
            child.zero_grad(set_to_none)

    def step(self) -> None:
        for child in self.children.values():
            child.step()


OPTIMIZERS = ("AdamW", "Gefen m4v4", "Gefen m8", "GefenMuonHybrid", TORCH_MUON, *TORCHAO)
#: the optimizers ``--rule`` runs under another step-safety rule
RULED = ("Gefen m4v4", "Gefen m8", "GefenMuonHybrid")


def torchao_unavailable() -> str | None:
    """Why torchao's low-bit AdamW cannot run here (it does not import), or None; a step that fails
    on this machine is reported per run, with its error."""
    try:
        import torchao.optim  # noqa: F401
    except Exception as exc:  # ImportError, or a binary built for another torch
        return f"torchao not importable ({type(exc).__name__}: {exc}); `pip install torchao`"
    return None


def _muon_params(opt) -> set[int]:
    """ids of the parameters GefenMuon steps: their zero-history unit is a whole row or column."""
    muon = getattr(opt, "children", {}).get("muon")
    return {id(p) for g in muon.param_groups for p in g["params"]} if muon is not None else set()


def still_zero(seen: torch.Tensor, muon: bool) -> torch.Tensor:
    """Elements that must not move: never a non-zero gradient; for Muon, every element of a row
    or column whose gradient history is all zero."""
    if not muon:
        return ~seen
    rows, cols = ~seen.any(1, keepdim=True), ~seen.any(0, keepdim=True)
    return rows | cols


# ----- one run ---------------------------------------------------------------------------------
def train(case: str, optimizer: str, lr: float, seed: int, steps: int) -> dict:
    """One run: the per-run numbers of the module docstring."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    problem = CASES[case](torch.Generator().manual_seed(1000 + seed), steps)
    named = _trainable(problem.model)
    opt = make_optimizer(optimizer, problem.model, lr)
    muon = _muon_params(opt)
    seen = [torch.zeros_like(p, dtype=torch.bool) for _, p in named]
    worst, max_step, bad_steps, moved = -math.inf, 0.0, 0, 0
    for t in range(steps):
        loss = problem.batch_loss(t)
        opt.zero_grad(set_to_none=True)
        (loss * problem.scale).backward()
        before = [p.detach().clone() for _, p in named]
        for s, (_, p) in zip(seen, named):
            if p.grad is not None:
                s |= p.grad != 0
        opt.step()
        finite = math.isfinite(loss.item())
        worst = max(worst, loss.item()) if finite else worst
        for s, b, (_, p) in zip(seen, before, named):
            delta = (p.detach() - b).abs()
            finite &= bool(torch.isfinite(p).all())
            max_step = max(max_step, delta.nan_to_num(0.0, 0.0, 0.0).max().item() / lr)
            moved += int(((p.detach() != b) & still_zero(s, id(p) in muon)).sum())
        bad_steps += not finite
    with torch.no_grad():
        final = problem.pool_loss().item()
    return {"case": case, "optimizer": optimizer, "lr": lr, "seed": seed, "final": final,
            "worst": worst if worst > -math.inf else math.nan, "max_step": max_step, "nan_steps": bad_steps,
            "zero_history_moved": moved, "seconds": round(time.perf_counter() - start, 2)}


def _job(args) -> list[dict]:
    """Every (case, lr, seed) of one optimizer and its cases, in a worker process of one thread."""
    optimizer, cases, lrs, seeds, steps = args
    torch.set_num_threads(1)
    if optimizer in TORCHAO:
        torch._dynamo.config.recompile_limit = 64  # its step compiles once per parameter shape
    return [run for case in cases for run in _case_runs(case, optimizer, lrs, seeds, steps)]


def _case_runs(case: str, optimizer: str, lrs, seeds, steps: int) -> list[dict]:
    out = []
    for lr in lrs:
        for seed in seeds:
            try:
                out.append(train(case, optimizer, lr, seed, steps))
            except NotApplicable as exc:
                return [{"case": case, "optimizer": optimizer, "lr": lr, "seed": s, "n/a": str(exc)}
                        for lr in lrs for s in seeds]
            except Exception as exc:  # reported in the table, the other runs go on
                out.append({"case": case, "optimizer": optimizer, "lr": lr, "seed": seed,
                            "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return out


def measure(cases, optimizers, lrs, seeds, steps: int, jobs: int) -> list[dict]:
    """torchao's optimizers one job each, first (they compile their step once per parameter shape
    and process: most of their time); the others one job per case."""
    plan = [(opt, list(cases), lrs, seeds, steps) for opt in optimizers if opt in TORCHAO]
    plan += [(opt, [case], lrs, seeds, steps) for opt in optimizers if opt not in TORCHAO for case in cases]
    with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [run for runs in pool.map(_job, plan) for run in runs]


# ----- the verdicts ----------------------------------------------------------------------------
def summarise(runs: list[dict]) -> list[dict]:
    """One row per (case, optimizer, lr): the seed means of the final and worst loss, the largest
    step of any seed, NaN steps and moved zero-history elements summed over seeds; and which
    targets it meets against AdamW's row."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["case"], r["optimizer"], r["lr"]), []).append(r)
    rows = {}
    for key, rs in groups.items():
        ok = [r for r in rs if "error" not in r and "n/a" not in r]
        row = {"case": key[0], "optimizer": key[1], "lr": key[2], "seeds": len(rs),
               "errors": [r["error"] for r in rs if "error" in r], "n/a": next((r["n/a"] for r in rs if "n/a" in r), None)}
        if ok:
            row.update(final=_mean(r["final"] for r in ok), worst=_mean(r["worst"] for r in ok),
                       max_step=max(r["max_step"] for r in ok), nan_steps=sum(r["nan_steps"] for r in ok),
                       zero_history_moved=sum(r["zero_history_moved"] for r in ok))
        rows[key] = row
    for (case, _, lr), row in rows.items():
        base = rows.get((case, BASELINE, lr))
        row["checks"] = targets_met(row, base)
        row["meets"] = None if row["n/a"] else bool(row["checks"]) and all(row["checks"].values())
    return list(rows.values())


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if all(math.isfinite(v) for v in values) else math.nan


def targets_met(row: dict, base: dict | None) -> dict[str, bool]:
    """Each target met (module docstring); empty when the row or AdamW's has no numbers."""
    if "final" not in row or base is None or "final" not in base:
        return {}
    return {
        "finite": row["nan_steps"] == 0 and math.isfinite(row["final"]) and math.isfinite(row["worst"]),
        "worst": row["worst"] <= max(WORST[0] * base["worst"], base["worst"] + WORST[1]),
        "final": row["final"] <= FINAL[0] * base["final"] + FINAL[1],
        "max_step": row["max_step"] <= MAX_STEP,
        "zero_history": row["zero_history_moved"] == 0,
    }


# ----- the section -----------------------------------------------------------------------------
def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "NaN" if math.isnan(x) else "inf"
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.2e}"


def render(data: dict) -> str:
    rows = data["rows"]
    failed = [r for r in rows if r["optimizer"] != BASELINE and r["meets"] is False]
    verdict = md_table(["optimizer", "cases (case x lr) meeting every target", "max step / lr, worst",
                        "NaN steps", "zero-history elements moved"], [
        [name, f"{sum(r['meets'] is True for r in mine)} / {sum(r['meets'] is not None for r in mine)}",
         _fmt(max((r.get("max_step", math.nan) for r in mine), default=math.nan)),
         sum(r.get("nan_steps", 0) for r in mine), sum(r.get("zero_history_moved", 0) for r in mine)]
        for name in data["optimizers"] if (mine := [r for r in rows if r["optimizer"] == name])])
    table = md_table(["case", "lr", "optimizer", "final loss", "worst loss", "max step / lr", "NaN steps",
                      "zero-history moved", "meets targets"], [
        [r["case"], f"{r['lr']:g}", r["optimizer"], *(_fmt(r[k]) if k in r else "-" for k in
                                                      ("final", "worst", "max_step")),
         r.get("nan_steps", "-"), r.get("zero_history_moved", "-"), _verdict(r)] for r in rows])
    skipped = "".join(f"\n\n{name} not run: {why}" for name, why in data["skipped"].items())
    return "\n".join([
        f"`benchmarks/bench_stability.py` (module docstring: the cases). {data['steps']} steps, learning rates "
        f"{', '.join(f'{lr:g}' for lr in data['lrs'])}, seeds {list(data['seeds'])}, weight decay 0, one thread per "
        f"run{' (quick run)' if data['quick'] else ''}. Final loss: every sample of the case after the last step; worst "
        "loss: the largest training-batch loss; both seed means. Max step / lr: the largest |change of one element in "
        "one step| / lr over every step and seed. Zero-history moved: elements whose gradient had been exactly 0 on "
        "every step so far (GefenMuon: whole rows or columns) that changed anyway. Targets against AdamW's row: "
        f"no NaN/inf, worst <= max({WORST[0]} x AdamW's, AdamW's + {WORST[1]}), final <= {FINAL[0]} x AdamW's + "
        f"{FINAL[1]}, max step <= {MAX_STEP:g}, no zero-history element moved. `{TORCH_MUON}` is GefenMuonHybrid's "
        "algorithm uncompressed (torch.optim.Muon on the same matrices): a loss target both miss is Muon's, not the "
        f"compression's.{skipped}",
        "",
        verdict,
        "",
        f"{len(failed)} (case, lr, optimizer) rows miss a target"
        + (": " + ", ".join(f"{r['case']} {r['lr']:g} {r['optimizer']}" for r in failed[:40])
           + (" ..." if len(failed) > 40 else "") if failed else "") + ".",
        "",
        "<details><summary>every case</summary>",
        "",
        table,
        "",
        "</details>",
        "",
        "Re-run: `python -m benchmarks.bench_stability` (`--quick`: one learning rate and seed, 15 steps, no torchao).",
    ])


def _verdict(row: dict) -> str:
    if row["optimizer"] == BASELINE:
        return "baseline"
    if row["n/a"]:
        return f"n/a: {row['n/a']}"
    if row["errors"]:
        return f"**error**: {row['errors'][0]}"
    missed = [k for k, ok in row["checks"].items() if not ok]
    return "yes" if row["meets"] else "**no**: " + ", ".join(missed)


def _plot(data: dict, stem: str = "stability") -> Path:
    """Bars of the largest step / lr per case and optimizer (every lr and seed), log scale:
    the misses span decades. Written to ``benchmarks/out/<stem>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, dict[str, float]] = {case: {} for case in data["cases"]}
    for r in data["rows"]:
        if math.isfinite(r.get("max_step", math.nan)):
            bars = groups[r["case"]]
            bars[r["optimizer"]] = max(bars.get(r["optimizer"], 0.0), r["max_step"])
    series = [name for name in data["optimizers"] if any(name in bars for bars in groups.values())]
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(12, 4.5), dpi=120)
    for k, name in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [bars.get(name, math.nan) for bars in groups.values()], width, label=name)
    ax.axhline(MAX_STEP, color="k", linestyle="--", linewidth=0.8, label=f"target {MAX_STEP:g}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel("max |step| / lr (every lr and seed)")
    ax.set_title(f"Largest per-element step / lr, {data['steps']} steps, weight decay 0", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{stem}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def collect(quick: bool, jobs: int, optimizers=OPTIMIZERS, cases=tuple(CASES), rules=()) -> dict:
    """Run the suite; the JSON record (settings, every run, the summary rows, what was skipped).
    ``rules``: also each of ``RULED`` under each of these step rules (``benchmarks.step_rules``)."""
    lrs, seeds, steps = (QUICK["lrs"], QUICK["seeds"], QUICK["steps"]) if quick else (LRS, SEEDS, STEPS)
    optimizers = [*optimizers, *(f"{name} [{rule}]" for rule in rules for name in RULED)]
    skipped = {}
    if quick:
        skipped.update({name: "quick run" for name in TORCHAO if name in optimizers})
    elif any(name in optimizers for name in TORCHAO) and (why := torchao_unavailable()) is not None:
        skipped.update({name: why for name in TORCHAO if name in optimizers})
    optimizers = [o for o in optimizers if o not in skipped]
    start = time.perf_counter()
    runs = measure(cases, optimizers, lrs, seeds, steps, jobs)
    return {"quick": quick, "lrs": list(lrs), "seeds": list(seeds), "steps": steps, "cases": list(cases),
            "optimizers": optimizers, "skipped": skipped, "jobs": jobs,
            "seconds": round(time.perf_counter() - start, 1), "runs": runs, "rows": summarise(runs)}


def run(quick: bool) -> dict:
    """Measure, write stability.json/stability.png, return the docs section (run_all convention)."""
    data = collect(quick, int(os.environ.get("GEFEN_BENCH_JOBS", "2")))
    write_json("stability", data)
    png = _plot(data)
    return {"title": "Stability: bounded steps and training where AdamW trains", "markdown": render(data),
            "plots": [str(png)], "data": {"rows": data["rows"], "skipped": data["skipped"]}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one lr and seed, 15 steps, no torchao")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("GEFEN_BENCH_JOBS", "2")))
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    parser.add_argument("--rule", nargs="+", default=[], metavar="NAME",
                        help=f"also {', '.join(RULED)} under these step rules (benchmarks/step_rules.py); "
                             "writes stability_rules.json/.png instead")
    args = parser.parse_args(argv)
    if args.rule:
        from benchmarks.step_rules import RULES

        unknown = sorted(set(args.rule) - set(RULES))
        if unknown:
            parser.error(f"unknown rules {unknown}; known: {sorted(RULES)}")
    data = collect(args.quick, args.jobs, args.optimizers, args.cases, args.rule)
    name = "stability_rules" if args.rule else "stability"
    write_json(name, data)
    _plot(data, name)
    print(render(data))
    print(f"\n[{data['seconds']} s]")


if __name__ == "__main__":
    main()
