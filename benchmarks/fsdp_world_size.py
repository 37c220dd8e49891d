"""How far FSDP2 training on 2 and on 3 ranks drifts apart, without any checkpoint.

The optimizers' step is bitwise independent of the world size *for the same global gradients*.
Under FSDP2 the gradients themselves are not the same: each world size reduce-scatters in its
own order, so float32 gradients differ in their last bits, and training amplifies that. This
script trains one small model from the same initial weights on the same global batches (each
rank takes its slice of every batch) for 7 steps on 2 and on 3 gloo ranks, for Gefen and AdamW
in float32 and float64, and prints the largest relative parameter difference,
``max over tensors of max|p2 - p3| / max|p2|``.

    nice -n 10 .venv/bin/python -m benchmarks.fsdp_world_size [--steps 7]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOBAL_BATCH = 48  # divisible by 2 and 3: every rank of either world takes an equal slice
VOCAB, WIDTH = 64, 48


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
        torch.nn.LayerNorm(4 * WIDTH), torch.nn.Linear(4 * WIDTH, VOCAB),
    ).to(dtype)


def _optimizer(name: str, model: torch.nn.Module):
    from gefen import Gefen

    if name == "Gefen":
        return Gefen(model.named_parameters(), lr=1e-2, weight_decay=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)


def _train(rank: int, world_size: int, name: str, dtype: torch.dtype, steps: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(dtype)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _optimizer(name, model)
    per_rank = GLOBAL_BATCH // world_size
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g)
        y = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])  # FSDP2 averages over ranks
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _entry(rank: int, world_size: int, workdir: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    out = {(name, str(dtype)): _train(rank, world_size, name, dtype, steps)
           for name in ("Gefen", "AdamW") for dtype in (torch.float32, torch.float64)}
    if rank == 0:
        torch.save(out, os.path.join(workdir, "params.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown after the work is done


def final_params(world_size: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_entry, args=(world_size, workdir, steps), nprocs=world_size, start_method="spawn")
        return torch.load(os.path.join(workdir, "params.pt"))


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-30)) for n in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    steps = parser.parse_args().steps
    two, three = final_params(2, steps), final_params(3, steps)
    print(f"max relative parameter difference after {steps} steps, FSDP2 on 2 vs 3 gloo ranks")
    print(f"{'optimizer':<10}{'dtype':<16}{'2 vs 3 ranks':>14}")
    for key in two:
        print(f"{key[0]:<10}{key[1]:<16}{max_relative_difference(two[key], three[key]):>14.2e}")


if __name__ == "__main__":
    main()
