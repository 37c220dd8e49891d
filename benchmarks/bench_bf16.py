"""Pure-bf16 training on real text: Gefen with ``bf16_stochastic_round`` vs round-to-nearest vs
AdamW with fp32 master weights, and the bytes per parameter of each whole training state.

The task is ``benchmarks/bench_quality.py``'s character LM (its data, model and held-out loss),
smaller (d = 64, 2 layers, context 64, batch 16) and shorter: bf16 matrix products on a CPU
without bf16 units run ~10x slower than fp32. ``adamw-fp32-master``: fp32 parameters (the master weights), the
forward and backward under ``torch.autocast(bfloat16)``, torch AdamW; ``gefen-fp32-master``: the
same with Gefen. ``gefen-bf16-sr`` / ``gefen-bf16-nearest``: the model itself in bfloat16 (no fp32
copy anywhere), Gefen with and without stochastic rounding of the parameter update. "Training
state" counts the parameters (as stored) and the optimizer state (every state tensor and the
codebooks); activations and gradients are not state. The held-out loss of every run is computed
in fp32 from its trained weights (bf16 weights are exact in fp32), so it measures the weights.

    nice -n 10 python -m benchmarks.bench_bf16 [--steps 150] [--seeds 0] [--jobs 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing
import os
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.nn.functional as F

from benchmarks.bench_quality import CharLM, Task, batch, corpus, held_out_loss, state_bytes
from benchmarks.common import md_table, write_json

RUNS = {
    "adamw-fp32-master": ("fp32 parameters + bf16 autocast, torch AdamW", torch.float32, None),
    "gefen-fp32-master": ("fp32 parameters + bf16 autocast, Gefen", torch.float32, False),
    "gefen-bf16-sr": ("bf16 parameters, Gefen bf16_stochastic_round=True", torch.bfloat16, True),
    "gefen-bf16-nearest": ("bf16 parameters, Gefen round-to-nearest", torch.bfloat16, False),
}


def _optimizer(name: str, model, task: Task, seed: int):
    from gefen import Gefen

    _, _, sr = RUNS[name]
    if sr is None:
        return torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)
    return Gefen(model.named_parameters(), lr=task.lr, weight_decay=task.weight_decay, seed=seed,
                 bf16_stochastic_round=sr)


def train(name: str, seed: int, task: Task) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    train_data, held, vocab = corpus("stdlib")
    torch.manual_seed(seed)
    _, dtype, _ = RUNS[name]
    model = CharLM(vocab, task).to(dtype)
    opt = _optimizer(name, model, task, seed)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / task.warmup) * 0.5 * (1 + math.cos(math.pi * s / task.steps)))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == torch.float32 else nullcontext
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(task.steps):
        x, y = batch(train_data, task, gen)
        with autocast():
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held_loss = held_out_loss(model.float(), held, task)  # every run evaluated alike: its weights, in fp32
    return {"run": name, "seed": seed, "held_out": held_loss, "params": params, "weight_bytes": weights,
            "state_bytes": state_bytes(opt), "seconds": round(time.perf_counter() - start, 1)}


def _job(args):
    return train(*args)


def measure(steps: int, seeds: list[int], jobs: int) -> tuple[Task, list[dict]]:
    task = Task(d=64, layers=2, heads=4, context=64, batch=16, steps=steps, warmup=max(1, steps // 10),
                eval_batches=16)
    plan = [(name, seed, task) for seed in seeds for name in RUNS]
    with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return task, list(pool.map(_job, plan))


def render(task: Task, seeds: list[int], results: list[dict]) -> str:
    base = [r["held_out"] for r in results if r["run"] == "adamw-fp32-master"]
    rows = []
    for name, (what, _, _) in RUNS.items():
        mine = [r for r in results if r["run"] == name]
        losses = [r["held_out"] for r in mine]
        mean = sum(losses) / len(losses)
        r = mine[0]
        rows.append([f"`{name}`", what, f"{r['weight_bytes'] / r['params']:.2f}", f"{r['state_bytes'] / r['params']:.3f}",
                     f"{(r['weight_bytes'] + r['state_bytes']) / r['params']:.3f}",
                     f"{mean:.4f} ({' / '.join(f'{x:.4f}' for x in losses)})", f"{mean / (sum(base) / len(base)):.4f}"])
    return "\n".join([
        f"Character LM on real text ({results[0]['params']:,} parameters, d = {task.d}, {task.layers} layers, context "
        f"{task.context}, batch {task.batch}; `bench_quality`'s data, model and held-out loss over {task.eval_batches} "
        f"batches), {task.steps} steps, cosine LR {task.lr} ({task.warmup} warm-up), weight decay {task.weight_decay}, "
        f"clipping 1.0, one thread per run, seeds {seeds}. Training state = the parameters as stored + the "
        "optimizer's state (gradients and activations are not state).",
        "",
        md_table(["run", "weights and optimizer", "weights B/param", "optimizer B/param", "training state B/param",
                  "held-out loss, mean (per seed)", "vs AdamW fp32 master"], rows),
    ])


def run(quick: bool) -> dict:
    """``make bench``: 20 steps unless GEFEN_BENCH_FULL=1 (150 steps, ~30 CPU-minutes: bf16 matrix
    products are slow on CPUs without bf16 units)."""
    full = not quick and os.environ.get("GEFEN_BENCH_FULL") == "1"
    steps, seeds = (150, [0]) if full else (20, [0])
    task, results = measure(steps, seeds, int(os.environ.get("GEFEN_BENCH_JOBS", "2")))
    write_json("bf16", {"task": asdict(task), "runs": results})
    markdown = render(task, seeds, results) + "\n\nRe-run: `nice -n 10 python -m benchmarks.bench_bf16 --steps 150`."
    return {"title": "Pure-bf16 training: stochastic vs nearest rounding vs fp32 master weights",
            "markdown": markdown, "plots": [], "data": {"runs": results}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    task, results = measure(args.steps, args.seeds, args.jobs)
    print(render(task, args.seeds, results))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
