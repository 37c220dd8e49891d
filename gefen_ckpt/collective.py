"""Small collectives that keep ranks in step: agreeing on failure and moving bytes.

Every collective save/load/transport path stages its work, then calls ``agree``: if any rank
failed, every rank raises (the failing rank its own error, the others a ``CheckpointError``
naming the failed ranks) before anything is published, so no rank hangs and no rank's
optimizer or checkpoint changes alone. Bytes move as uint8 tensors (msgpack payloads), so no
pickle crosses ranks.

Every collective first checks in (``checkin``) through the process group's store with a
timeout (``DEFAULT_TIMEOUT``, or ``deadline(seconds)`` around a call): a rank that stalls or
dies makes every other rank raise ``CheckpointTimeoutError`` naming it, instead of waiting for
the backend's own timeout (gloo's and NCCL's default is 30 minutes), and the stalled rank
raises too when it arrives late. A tensor collective then runs only among ranks known to be
present.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gefen_ckpt.errors import CheckpointError, CheckpointTimeoutError

#: Seconds a rank waits for the others at each collective step of a save or load (the skew
#: between ranks, not the length of the save): well under the backends' 30 minutes.
DEFAULT_TIMEOUT = 300.0
_local = threading.local()
_sequence: dict[tuple, int] = {}


def active() -> bool:
    """True under an initialised process group of more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def current_timeout() -> float:
    return getattr(_local, "timeout", None) or DEFAULT_TIMEOUT


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Collectives inside the block wait at most ``seconds`` for a missing rank (None: the default)."""
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds!r}")
    before = getattr(_local, "timeout", None)
    _local.timeout = seconds or before
    try:
        yield
    finally:
        _local.timeout = before


def with_timeout(fn):
    """Give the collective ``fn`` a ``timeout=`` keyword (seconds; None: the current default) that
    bounds how long its ranks wait for each other (``deadline`` around the call)."""

    @functools.wraps(fn)
    def call(*args, timeout: float | None = None, **kwargs):
        with deadline(timeout):
            return fn(*args, **kwargs)

    return call


def checkin(what: str, group=None) -> None:
    """Wait until every rank of ``group`` has reached this call, at most ``current_timeout()``
    seconds; else raise ``CheckpointTimeoutError`` naming the ranks that did not arrive (on the
    ranks that waited) or saying that the others gave up (on a rank that arrived late)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    store = c10d._get_default_store()  # the rendezvous store every process group shares
    seq = _sequence[ranks] = _sequence.get(ranks, 0) + 1
    base = f"gefen-ckpt/checkin/{hash(ranks) & 0xFFFFFFFF:08x}/{seq}"
    me, timeout = dist.get_rank(), current_timeout()
    store.set(f"{base}/{me}", b"1")
    try:
        store.wait([f"{base}/{r}" for r in ranks], datetime.timedelta(seconds=timeout))
    except Exception:  # the store's timeout error (its type differs between torch versions)
        missing = [r for r in ranks if not store.check([f"{base}/{r}"])]
        store.set(f"{base}/gave-up", b"1")
        raise CheckpointTimeoutError(f"{what}: rank(s) {missing} did not arrive within {timeout:g} s (stalled or "
                                     "dead); every waiting rank gave up, nothing was changed") from None
    if store.check([f"{base}/gave-up"]):
        raise CheckpointTimeoutError(f"{what}: rank {me} arrived after the other ranks gave up waiting for it "
                                     f"({timeout:g} s); nothing was changed")


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``error`` is set on any rank (no-op without a process group)."""
    if not active():
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    checkin(what)
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

    checkin("exchanging checkpoint records")
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

    checkin("sharing checkpoint metadata")
    dev = _device()
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=dev)
    if dist.get_rank() == src and payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy())
