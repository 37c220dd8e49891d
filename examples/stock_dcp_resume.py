"""Checkpoint Gefen with torch's own API (get_state_dict + dcp.save) on 2 ranks, resume on 3.

No gefen_ckpt call anywhere in the training code: this is the flow training frameworks run
(torchtitan, accelerate's FSDP2 path, Lightning). Runs on CPU with gloo. Each step uses the
same global batch, split evenly over the ranks, so the loss curve does not depend on the world
size: the run resumed on 3 ranks of FSDP2 continues where the 2-rank run stopped and matches a
2-rank run that never stopped up to float reduction order. Then ``gefen-ckpt inspect`` reads
the checkpoint offline.

    python examples/stock_dcp_resume.py [--workdir DIR] [--steps N]
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
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gefen import Gefen

VOCAB, DIM, BATCH = 64, 48, 48


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, DIM),
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
    model = make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.01)
    if load_from:  # a fresh model and optimizer, filled the stock way
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=load_from)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
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
    if save_to:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_to)  # each rank writes its rows
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
    mp.spawn(worker, args=(world_size, rendezvous, steps, load_from, save_to, log), nprocs=world_size)
    with open(log) as fh:
        return [float(line.split()[1]) for line in fh]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temp dir, removed)")
    parser.add_argument("--steps", type=int, default=20, help="steps before and after the resume")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="gefen-stock-dcp-")
    os.makedirs(workdir, exist_ok=True)
    print(f"working in {workdir}", flush=True)
    n, ckpt = args.steps, os.path.join(workdir, "ckpt")
    try:
        print(f"1) training {n} steps on 2 ranks (FSDP2 + Gefen), then get_state_dict + dcp.save", flush=True)
        first = launch(2, range(n), None, ckpt, workdir)
        print(f"   loss {first[0]:.4f} -> {first[-1]:.4f}; saved to {ckpt}\n", flush=True)

        print(f"2) a fresh model + optimizer on 3 ranks: get_state_dict, dcp.load, set_state_dict; {n} more steps",
              flush=True)
        resumed = launch(3, range(n, 2 * n), ckpt, None, workdir)
        print(f"   reference: the same {n} steps continued on 2 ranks", flush=True)
        reference = launch(2, range(n, 2 * n), ckpt, None, workdir)
        worst = max(abs(a - b) for a, b in zip(resumed, reference))
        print(f"   {'step':>5} {'3 ranks':>10} {'2 ranks':>10}")
        for i in range(0, n, max(1, n // 6)):
            print(f"   {n + i:>5} {resumed[i]:>10.6f} {reference[i]:>10.6f}")
        print(f"   max |difference| over {n} steps: {worst:.2e} (float reduction order only)\n", flush=True)

        print("3) the checkpoint, read offline", flush=True)
        subprocess.run([sys.executable, "-m", "gefen_cli", "inspect", ckpt], check=True)
        if worst > 1e-3:
            sys.exit(f"resumed run diverged from the reference (max difference {worst:.2e})")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
