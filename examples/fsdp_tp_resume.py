"""Tensor parallelism x FSDP2 with Gefen or GefenMuonHybrid, checkpointed with torch's own API, resumed on other meshes.

Trains a small next-token MLP on a 2x2 ``(dp, tp)`` mesh: ``ColwiseParallel`` /
``RowwiseParallel`` on ``tp`` (parameters split by rows and by columns), ``fully_shard`` on
``dp``. Saves with ``get_state_dict`` + ``dcp.save``; then a *fresh* model and optimizer on a
1x3 mesh (tensor parallelism over 3 ranks) and on 3 ranks of plain FSDP2 (3x1) fill themselves
with ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` and continue. ``--optimizer hybrid``
trains with ``GefenMuonHybrid`` instead of ``Gefen``: Muon on the hidden matrices (one split by
rows, one by columns), Gefen on the embedding, the head, biases and the norm. No gefen_ckpt call in the
training code. Runs on CPU with gloo. Each step uses the same global batch, split over ``dp``, so
every mesh follows the same loss curve up to float reduction order in the model's own collectives
(the optimizer's state is bit-identical across meshes for the same gradients: tests/dist/test_tp.py).

    python examples/fsdp_tp_resume.py [--workdir DIR] [--steps N] [--optimizer {gefen,hybrid}]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gefen import Gefen, GefenMuonHybrid

VOCAB, DIM, BATCH = 64, 48, 48


def make_model(mesh) -> nn.Module:
    """Embedding -> Linear (column-parallel) -> GELU -> Linear (row-parallel) -> LayerNorm -> head
    (column-parallel, logits gathered), tensor-parallel on ``mesh["tp"]``, sharded on ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(emb=nn.Embedding(VOCAB, DIM), up=nn.Linear(DIM, 4 * DIM), act=nn.GELU(),
                                      down=nn.Linear(4 * DIM, DIM), norm=nn.LayerNorm(DIM),
                                      lm_head=nn.Linear(DIM, VOCAB)))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                           "lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def batch(step: int, dp_rank: int, dp: int):
    """This data-parallel rank's share of the global batch of ``step`` (a synthetic task)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH,), generator=g)
    y = (x * 7 + 3) % VOCAB
    share = BATCH // dp
    return x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share]


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "hybrid":  # routes by itself: up/down to Muon; emb, lm_head, biases, norm to Gefen
        return GefenMuonHybrid(model, lr=3e-3, weight_decay=0.01)
    return Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.01)


def worker(rank: int, dp: int, tp: int, rendezvous: str, steps: range, load_from: str | None,
           save_to: str | None, log: str, kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=dp * tp)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = make_model(mesh)
    opt = make_optimizer(kind, model)
    if load_from:  # a fresh model and optimizer, filled the stock way
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=load_from)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    losses, dp_rank = [], mesh.get_local_rank("dp")
    for step in steps:
        x, y = batch(step, dp_rank, dp)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced, group=mesh.get_group("dp"))
        losses.append(reduced.item() / dp)
    if save_to:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_to)
    if rank == 0:
        with open(log, "w") as fh:
            fh.write("\n".join(f"{s} {v:.6f}" for s, v in zip(steps, losses)))
    dist.destroy_process_group()
    # The work is done and on disk: leave now. gloo's worker threads can abort the interpreter's own
    # teardown ("terminate called without an active exception"), which would fail the launch.
    sys.stdout.flush()
    os._exit(0)


def launch(dp: int, tp: int, steps: range, load_from: str | None, save_to: str | None, workdir: str,
           kind: str) -> list[float]:
    tag = f"{kind}-{dp}x{tp}-{steps.start}-{steps.stop}"
    rendezvous, log = os.path.join(workdir, f"rdzv-{tag}"), os.path.join(workdir, f"loss-{tag}.txt")
    mp.spawn(worker, args=(dp, tp, rendezvous, steps, load_from, save_to, log, kind), nprocs=dp * tp)
    with open(log) as fh:
        return [float(line.split()[1]) for line in fh]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temp dir, removed)")
    parser.add_argument("--steps", type=int, default=20, help="steps before and after the resume")
    parser.add_argument("--optimizer", choices=("gefen", "hybrid"), default="gefen",
                        help="Gefen (default) or GefenMuonHybrid (Muon on the hidden matrices)")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="gefen-tp-")
    os.makedirs(workdir, exist_ok=True)
    print(f"working in {workdir}", flush=True)
    n, kind, ckpt = args.steps, args.optimizer, os.path.join(workdir, f"ckpt-{args.optimizer}")
    name = {"gefen": "Gefen", "hybrid": "GefenMuonHybrid"}[kind]
    try:
        print(f"1) {n} steps on a 2x2 (dp, tp) mesh (TP + FSDP2 + {name}), then get_state_dict + dcp.save", flush=True)
        first = launch(2, 2, range(n), None, ckpt, workdir, kind)
        print(f"   loss {first[0]:.4f} -> {first[-1]:.4f}; saved to {ckpt}\n", flush=True)

        print(f"2) fresh models + optimizers: get_state_dict, dcp.load, set_state_dict; {n} more steps", flush=True)
        curves = {mesh: launch(*mesh, range(n, 2 * n), ckpt, None, workdir, kind) for mesh in ((1, 3), (3, 1), (2, 2))}
        print(f"   {'step':>5} {'1x3 (TP)':>10} {'3x1 (FSDP2)':>12} {'2x2 (as saved)':>15}")
        for i in range(0, n, max(1, n // 6)):
            print(f"   {n + i:>5} {curves[1, 3][i]:>10.6f} {curves[3, 1][i]:>12.6f} {curves[2, 2][i]:>15.6f}")
        worst = max(abs(a - b) for mesh in ((1, 3), (3, 1)) for a, b in zip(curves[mesh], curves[2, 2]))
        print(f"   max |difference| from the 2x2 continuation over {n} steps: {worst:.2e} "
              "(float reduction order in the model's collectives only)", flush=True)
        if worst > 1e-3:
            sys.exit(f"a resumed run diverged from the reference (max difference {worst:.2e})")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
