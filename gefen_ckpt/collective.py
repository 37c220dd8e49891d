"""Small collectives that keep ranks in step: agreeing on failure and moving bytes.

Every collective save/load/transport path stages its work, then calls ``agree``: if any rank
failed, every rank raises (the failing rank its own error, the others a ``CheckpointError``
naming the failed ranks) before anything is published, so no rank hangs and no rank's
optimizer or checkpoint changes alone. Bytes move as uint8 tensors (msgpack payloads), so no
pickle crosses ranks.
"""

from __future__ import annotations

import torch

from gefen_ckpt.errors import CheckpointError


def active() -> bool:
    """True under an initialised process group of more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``error`` is set on any rank (no-op without a process group)."""
    if not active():
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    flags = [torch.zeros(1, dtype=torch.int32, device=_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(error is not None)], dtype=torch.int32, device=_device()))
    failed = [r for r, f in enumerate(flags) if int(f)]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on rank(s) {failed}; nothing was changed on this rank")


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank."""
    if not active():
        return [payload]
    import torch.distributed as dist

    dev, ws = _device(), dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(ws)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    out = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(ws)]
    dist.all_gather(out, mine)
    return [bytes(t[: int(s)].cpu().numpy()) for t, s in zip(out, sizes)]


def broadcast_bytes(payload: bytes | None, src: int = 0) -> bytes:
    """``payload`` of rank ``src`` on every rank."""
    if not active():
        return payload or b""
    import torch.distributed as dist

    dev = _device()
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=dev)
    if dist.get_rank() == src and payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy())
