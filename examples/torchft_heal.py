"""Live healing with torchft: two replica groups train a small model with a Gefen optimizer,
averaging gradients through torchft's fault-tolerant allreduce. Mid-run replica 1 is killed (its
model, optimizer, process group and Manager are dropped) and comes back from other weights and an
empty optimizer; torchft's Manager heals it from replica 0 through ``GefenTransport`` (one
manifest, packed small tensors, shared codebooks once, every tensor CRC-checked before it is
applied). At the end both replicas hold bit-identical weights and optimizer state.

    python examples/torchft_heal.py [--steps 10] [--kill-at 4] [--optimizer gefen|m8|muon|hybrid]
                                    [--flip-first-heal | --stall-first-heal]

Needs the optional extra: ``pip install 'gefen[torchft]'``. Both replicas run as threads of
this process (as torchft's own integration tests do); each is a replica group of one rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager log every quorum at info

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gefen import Gefen, GefenMuon, GefenMuonHybrid  # noqa: E402

try:
    from torchft._torchft import LighthouseServer
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from gefen_ckpt.errors import CheckpointError
    from gefen_ckpt.torchft_transport import GefenTransport
except ImportError:
    sys.exit("this example needs torchft: pip install 'gefen[torchft]'")

TIMEOUT = timedelta(seconds=10)
_SEED_LOCK = threading.Lock()  # the replicas share torch's global RNG while they build models


class FlipOnce:
    """The process group as the rejoining replica's transport sees it, with one byte of the
    first packed buffer it receives flipped (``--flip-first-heal``): that transfer is refused,
    torchft's Manager skips the step (the healthy replica's allreduce waits out ``TIMEOUT``),
    and the next heal succeeds."""

    def __init__(self, pg) -> None:
        self.pg, self.armed = pg, True

    def send(self, tensors, dst, tag):
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        work = self.pg.recv(tensors, src, tag)
        if not (self.armed and tag == GefenTransport.PACKED_TAG):
            return work
        self.armed = False
        return _Flipped(work, tensors[0])


class StallOnce:
    """The healthy replica's process group with the first transfer that starts at or after
    ``from_step`` cut short after its manifest (``--stall-first-heal``): the rest never leaves, so
    the rejoining replica's wait runs out (``TIMEOUT``) naming the peer, the Manager skips the
    step, and the next heal succeeds."""

    def __init__(self, pg, from_step: int) -> None:
        self.pg, self.from_step, self.state = pg, from_step, "armed"

    def send(self, tensors, dst, tag):
        if tag == GefenTransport.HEADER_TAG:  # [magic, version, step, ...]: a transfer starts
            starts = self.state == "armed" and int(tensors[0][2]) >= self.from_step
            self.state = "stalling" if starts else "spent" if self.state == "stalling" else self.state
        if self.state == "stalling" and tag > GefenTransport.MANIFEST_TAG:
            return _Sent()
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.pg.recv(tensors, src, tag)


class _Sent:
    """A send that reports success without sending."""

    def wait(self, timeout=None) -> bool:
        return True


class _Flipped:
    def __init__(self, work, buffer: torch.Tensor) -> None:
        self.work, self.buffer = work, buffer

    def wait(self, timeout=None):
        done = self.work.wait(timeout)
        self.buffer[self.buffer.numel() // 2] ^= 1
        return done


class CountingTransport(GefenTransport):
    """Counts the transfers it refused or that failed (the Manager logs the error and retries)."""

    refused = 0

    def recv_checkpoint(self, *args, **kwargs):
        try:
            return super().recv_checkpoint(*args, **kwargs)
        except CheckpointError:
            self.refused += 1
            raise


class Killed(Exception):
    """Stands for the replica's processes dying: everything it held is dropped."""


def build(kind: str, seed: int):
    with _SEED_LOCK:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=kind != "muon"), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 8, bias=kind != "muon"))
    if kind == "muon":
        return model, GefenMuon(list(model.named_parameters()), lr=1e-2)
    if kind == "hybrid":
        return model, GefenMuonHybrid(model, lr=1e-2)
    moments = "m8" if kind == "m8" else "m4v4"
    return model, Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.1, moments=moments, factored_v_2d=kind != "m8")


def faulty(pg, replica: int, life: int, args):
    """The process group as this replica's transport sees it, with the fault asked for (if any)."""
    if args.flip_first_heal and life:
        return FlipOnce(pg)
    if args.stall_first_heal and replica == 0:
        return StallOnce(pg, args.kill_at)
    return pg


def attempt(replica: int, life: int, lighthouse: str, args) -> dict | None:
    """One life of a replica group: train until ``args.steps`` (or until killed)."""
    model, inner = build(args.optimizer, seed=1000 * replica + life)  # never the other replica's weights
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    manager = Manager(
        pg=pg, min_replica_size=1, replica_id=f"replica{replica}", store_addr="localhost", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=lighthouse, timeout=TIMEOUT,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        checkpoint_transport=(transport := CountingTransport(faulty(pg, replica, life, args), TIMEOUT)))
    opt = OptimizerWrapper(manager, inner)
    try:
        while manager.current_step() < args.steps:
            step = manager.current_step()
            if replica == 1 and life == 0 and step == args.kill_at:
                raise Killed(f"replica {replica} killed at step {step}")
            opt.zero_grad()  # starts the quorum; a rejoining replica heals here
            g = torch.Generator().manual_seed(10_000 * replica + step)
            model(torch.randn(16, 32, generator=g)).square().mean().backward()
            for work in [manager.allreduce(p.grad) for p in model.parameters()]:
                work.wait()
            opt.step()  # applies only if every replica's step succeeded
        got = transport.last_recv
        healed = f"; healed with {got.tensors} tensors, {got.bytes:,} bytes in {got.seconds * 1e3:.1f} ms" if got.tensors else ""
        healed += f"; refused {transport.refused} failed transfer(s)" if transport.refused else ""
        print(f"replica {replica} (life {life}) finished at step {manager.current_step()}{healed}", flush=True)
        return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": inner.state_dict(),
                "step": manager.current_step()}
    finally:
        manager.shutdown(wait=False)


def replica_main(replica: int, lighthouse: str, args) -> dict:
    for life in range(2):
        try:
            return attempt(replica, life, lighthouse, args)
        except Killed as exc:
            print(f"{exc}; rejoining with fresh weights", flush=True)
    raise RuntimeError("unreachable")


def tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for i, s in state["optim"]["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=4)
    parser.add_argument("--optimizer", choices=["gefen", "m8", "muon", "hybrid"], default="gefen")
    parser.add_argument("--flip-first-heal", action="store_true", help="corrupt the first heal in transit")
    parser.add_argument("--stall-first-heal", action="store_true",
                        help="cut the healthy replica's first heal after the kill short after its manifest")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # torchft warns that CPUs have no NCCL flight recorder
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(replica_main, r, lighthouse.address(), args) for r in range(2)]
            first, second = (f.result(timeout=300) for f in futures)
    finally:
        lighthouse.shutdown()
    a, b = tensors(first), tensors(second)
    same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    same = same and first["optim"]["param_groups"] == second["optim"]["param_groups"]
    print(f"after healing: {len(a)} tensors, replicas {'bit-identical' if same else 'DIFFER'} at step {first['step']}")
    return 0 if same and first["step"] == second["step"] else 1


if __name__ == "__main__":
    sys.exit(main())
