"""End-to-end: train on 2 ranks with FSDP2 + Gefen, save, reshard offline to 3, resume, inspect.

Runs on CPU with gloo (the second part of `make demo`, examples/demo.py). Each step uses the same global batch of 48 samples,
split evenly over the ranks, so the loss curve does not depend on the world size: the run
resumed on 3 ranks continues exactly where the 2-rank run stopped, and matches a 2-rank run
that never stopped up to float reduction order.

    python examples/train_reshard_resume.py [--workdir DIR] [--keep] [--steps N]

Everything goes under one directory (printed; a fresh temp directory, removed at the end
unless ``--keep``, when no ``--workdir`` is given).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gefen_ckpt
from gefen import Gefen

VOCAB, DIM, BATCH = 64, 48, 48


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, DIM),
        torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM), torch.nn.LayerNorm(DIM),
        torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM), torch.nn.LayerNorm(DIM),
        torch.nn.Linear(DIM, VOCAB),
    )


def batch(step: int, rank: int, world_size: int):
    """This rank's share of the global batch of ``step`` (a synthetic next-token task)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH,), generator=g)
    y = (x * 7 + 3) % VOCAB
    share = BATCH // world_size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def worker(rank: int, world_size: int, rendezvous: str, steps: range, load_from: str | None,
           save_to: str | None, log: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    if rank == 0:
        print(f"   [{world_size} ranks] processes up (torch imported, process group formed)", flush=True)
    model = make_model()
    if load_from:
        model.load_state_dict(torch.load(os.path.join(load_from, "model.pt"), weights_only=True))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.01)
    if load_from:
        gefen_ckpt.load(opt, os.path.join(load_from, "optim"))  # collective: reads only this rank's rows
    losses = []
    for step in steps:
        x, y = batch(step, rank, world_size)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world_size)
        if rank == 0 and (step + 1 - steps.start) % 10 == 0:
            print(f"   [{world_size} ranks] step {step + 1 - steps.start}/{len(steps)}  loss {losses[-1]:.4f}", flush=True)
    if save_to:
        gefen_ckpt.save(opt, os.path.join(save_to, "optim"))  # collective: each rank writes its rows
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, os.path.join(save_to, "model.pt"))
    if rank == 0:
        with open(log, "w") as fh:
            fh.write("\n".join(f"{s} {v:.6f}" for s, v in zip(steps, losses)))
    dist.destroy_process_group()
    # The work is done and on disk: leave now. gloo's worker threads can abort the interpreter's own
    # teardown ("terminate called without an active exception"), which would fail the launch.
    sys.stdout.flush()
    os._exit(0)


def launch(world_size: int, steps: range, load_from: str | None, save_to: str | None, workdir: str) -> list[float]:
    tag = f"ws{world_size}-{steps.start}-{steps.stop}"
    rendezvous, log = os.path.join(workdir, f"rdzv-{tag}"), os.path.join(workdir, f"loss-{tag}.txt")
    if save_to:
        os.makedirs(save_to, exist_ok=True)
    mp.spawn(worker, args=(world_size, rendezvous, steps, load_from, save_to, log), nprocs=world_size)
    with open(log) as fh:
        return [float(line.split()[1]) for line in fh]


def cli(*args: str) -> None:
    print(f"$ gefen-ckpt {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "gefen_cli", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a fresh temp dir, "
                        "removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir at the end")
    parser.add_argument("--steps", type=int, default=30, help="steps before and after the reshard")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="gefen-demo-")
    owned = args.workdir is None and not args.keep
    print(f"writing under {workdir}" + (" (removed at the end)" if owned else ""), flush=True)
    try:
        run(workdir, args.steps)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)


def run(workdir: str, n: int) -> None:
    """Train, save, reshard, resume and inspect, everything under ``workdir``."""
    on2, on3 = os.path.join(workdir, "ckpt-ws2"), os.path.join(workdir, "ckpt-ws3")

    print(f"1) training {n} steps on 2 ranks (FSDP2 + Gefen, gloo/CPU; starting 2 processes)", flush=True)
    first = launch(2, range(n), None, on2, workdir)
    print(f"   loss {first[0]:.4f} -> {first[-1]:.4f}; saved to {on2}\n")

    print("2) offline reshard of the optimizer state to 3 ranks (no process group)", flush=True)
    os.makedirs(on3, exist_ok=True)
    cli("reshard", os.path.join(on2, "optim"), os.path.join(on3, "optim"), "--world-size", "3")
    with open(os.path.join(on2, "model.pt"), "rb") as src, open(os.path.join(on3, "model.pt"), "wb") as dst:
        dst.write(src.read())
    cli("verify", os.path.join(on3, "optim"))

    print(f"\n3) resuming on 3 ranks for {n} more steps (starting 3 processes)", flush=True)
    resumed = launch(3, range(n, 2 * n), on3, None, workdir)
    print(f"   reference: the same {n} steps continued on 2 ranks", flush=True)
    reference = launch(2, range(n, 2 * n), on2, None, workdir)
    worst = max(abs(a - b) for a, b in zip(resumed, reference))
    print(f"   {'step':>5} {'3 ranks':>10} {'2 ranks':>10}")
    for i in range(0, n, max(1, n // 6)):
        print(f"   {n + i:>5} {resumed[i]:>10.6f} {reference[i]:>10.6f}")
    print(f"   max |difference| over {n} steps: {worst:.2e} (float reduction order only)\n")

    print("4) what the resharded checkpoint holds", flush=True)
    cli("inspect", os.path.join(on3, "optim"))
    if worst > 1e-3:
        sys.exit(f"resumed run diverged from the reference (max difference {worst:.2e})")


if __name__ == "__main__":
    main()
