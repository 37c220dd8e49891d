"""The package's one agreement protocol, and byte collectives (msgpack: no pickle crosses ranks).

Every collective path stages its work, then calls ``agree`` (or ``exchange``, which also
all-gathers a payload): if any rank failed, every rank raises before anything is published.
Each collective first checks in through the store (``checkin``), so a rank that stalls or dies
is named within ``DEFAULT_TIMEOUT`` (or ``deadline``), not the backend's 30 minutes.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import msgpack
import torch

from gefen_ckpt.errors import CheckpointError, CheckpointTimeoutError
from gefen_ckpt.wire.dtypes import plain

#: Seconds a rank waits for the others at each collective step of a save or load (the skew
#: between ranks, not the length of the save): well under the backends' 30 minutes.
DEFAULT_TIMEOUT = 300.0
_local = threading.local()
_sequence: dict[tuple, int] = {}
_sequence_lock = threading.Lock()


def active(group=None) -> bool:
    """True under an initialised process group (``group``: default the world) of more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def device(group=None) -> torch.device:
    """Where this rank's collective tensors live: the current GPU under NCCL alone, else the CPU
    (gloo, and a mixed ``cpu:gloo,cuda:nccl`` backend, take CPU tensors); the CPU with no group."""
    if not active(group):
        return torch.device("cpu")
    import torch.distributed as dist

    nccl = str(dist.get_backend(group)).lower() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def current_timeout(group=None) -> float:
    """Seconds to wait for the other ranks: the ``deadline`` in force, else the smaller of
    ``DEFAULT_TIMEOUT`` and the process group's own timeout (a job that set 40 s hears of a dead
    rank in 40 s, not 300)."""
    explicit = getattr(_local, "timeout", None)
    if explicit:
        return explicit
    pg = group_timeout(group)
    return min(DEFAULT_TIMEOUT, pg) if pg else DEFAULT_TIMEOUT


def group_timeout(group=None) -> float | None:
    """The process group's timeout in seconds (None when it cannot be told)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        pg = group if group is not None else c10d._get_default_group()
        return pg._get_backend(device(group)).options._timeout.total_seconds() or None
    except Exception:  # a backend without options (or a torch without these internals)
        return None


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


def checkin(what: str, group=None, error: BaseException | None = None) -> str:
    """Wait until every rank of ``group`` has reached this call, at most ``current_timeout()``
    seconds; else raise ``CheckpointTimeoutError`` naming the ranks that did not arrive (on the
    ranks that waited) or saying that the others gave up (on a rank that arrived late). A rank's
    ``error`` arrives with it (``agree_in_store`` reads them); returns the round's store key."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    store = c10d._get_default_store()  # the rendezvous store every process group shares
    name = "world" if group is None else c10d._get_process_group_name(group)  # one sequence per group
    key = (ranks, name)
    with _sequence_lock:
        seq = _sequence[key] = _sequence.get(key, 0) + 1
    base = f"gefen-ckpt/checkin/{name}/{hash(ranks) & 0xFFFFFFFF:08x}/{seq}"
    me, timeout = dist.get_rank(), current_timeout(group)
    try:
        if error is not None:
            store.add(f"{base}/errors", 1)
        store.set(f"{base}/{me}", b"1" if error is None else b"!" + describe_error(error).encode())
        store.wait([f"{base}/{r}" for r in ranks], datetime.timedelta(seconds=timeout))
    except Exception as exc:  # the store's timeout error (its type differs between torch versions), or a lost store
        try:
            missing = [r for r in ranks if not store.check([f"{base}/{r}"])]
            store.set(f"{base}/gave-up", b"1")
        except Exception:  # the store itself went away (it lived in a rank that died)
            raise CheckpointTimeoutError(f"{what}: the rendezvous store was lost ({describe_error(exc)}); a rank "
                                         "holding it died") from None
        raise CheckpointTimeoutError(f"{what}: rank(s) {missing} did not arrive within {timeout:g} s (stalled or "
                                     "dead); every waiting rank gave up, nothing was changed") from None
    if _check(store, f"{base}/gave-up"):
        raise CheckpointTimeoutError(f"{what}: rank {me} arrived after the other ranks gave up waiting for it "
                                     f"({timeout:g} s); nothing was changed")
    return base


def _check(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception as exc:
        raise CheckpointTimeoutError(f"the rendezvous store was lost ({describe_error(exc)})") from None


@contextmanager
def lost_ranks(what: str) -> Iterator[None]:
    """A collective that fails inside the backend (a peer that died between the check-in and the
    transfer: gloo's "Connection closed by peer", or its own timeout) is a ``CheckpointTimeoutError``
    naming ``what``, like a rank that never checked in."""
    try:
        yield
    except CheckpointError:
        raise
    except RuntimeError as exc:  # torch.distributed's DistBackendError / DistError are RuntimeErrors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointTimeoutError(f"{what}: a rank was lost during the transfer ({first}); nothing was "
                                     "changed") from exc


def wait_for(work, seconds: float, stalled: str, failed: str) -> None:
    """Wait for one message at most ``seconds`` (never 0, which gloo reads as no limit): a peer
    that stalls raises ``CheckpointTimeoutError(stalled)`` instead of waiting out the backend's
    timeout, one that fails (its process died) ``CheckpointError`` (``failed``: the backend's reason)."""
    try:
        done = work.wait(datetime.timedelta(seconds=max(seconds, 1e-3)))
    except Exception as exc:
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CheckpointTimeoutError(stalled) from exc
        raise CheckpointError(f"{failed}: {text.splitlines()[0] if text else repr(exc)}") from exc
    if done is False:
        raise CheckpointTimeoutError(stalled)


def pack(obj) -> bytes:
    """``obj`` as msgpack (what crosses ranks; never pickle), values made ``plain`` (unknown ones
    as their ``str``)."""
    return msgpack.packb(obj, use_bin_type=True, default=plain)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def exchange(payload: dict, error: BaseException | None, what: str, group=None) -> list[dict]:
    """Every rank's ``payload`` (msgpack-able), in rank order; but first, if any rank of
    ``group`` reports an ``error``, raise on every rank: the failing rank its own error, the
    others a ``CheckpointError`` naming each failed rank (``failure``). Without a process
    group: ``[payload]``, or ``error`` raised."""
    payload = dict(payload, error=None if error is None else describe_error(error))
    try:
        data = pack(payload)
    except Exception as exc:  # an unpackable payload must not leave the other ranks waiting
        error = error or exc
        data = pack({"error": describe_error(exc)})
    everyone = [unpack(b) for b in all_gather_bytes(data, what, group)]
    if error is not None:
        raise error
    if (failed := failure(what, everyone)) is not None:
        raise failed
    return everyone


def failure(what: str, everyone: list[dict],
            changed: str = "nothing was changed on this rank") -> CheckpointError | None:
    """The error the ranks that did not fail raise when any payload of ``everyone`` carries one: the
    message names each failed rank and its error's type; ``rank_errors`` (and, on Python >= 3.11,
    the notes a traceback shows) hold each one's full error, which is that rank's own to print."""
    failed = {r: p["error"] for r, p in enumerate(everyone) if p.get("error") is not None}
    if not failed:
        return None
    kinds = "; ".join(f"rank {r}: {_first_line(e)}" for r, e in list(failed.items())[:4])
    error = shared_type(failed.values())(f"{what} failed on rank(s) {list(failed)} ({kinds}); {changed}")
    error.rank_errors = failed
    for r, e in failed.items():
        getattr(error, "add_note", lambda _: None)(f"rank {r}: {e}")
    return error


def _first_line(error: str, limit: int = 300) -> str:
    """A failed rank's ``describe_error`` shortened for another rank's message: its type and
    what it names (the file, the FQN), not its whole story (that is in the notes)."""
    line = error.strip().splitlines()[0] if error.strip() else error
    return line if len(line) <= limit else line[:limit - 3] + "..."


def shared_type(errors: Iterable[str]) -> type[CheckpointError]:
    """The type of the failed ranks' errors (``describe_error`` strings) when they share one of
    gefen_ckpt's types, else ``CheckpointError``: so every rank raises the type the failing rank
    raised (``CheckpointLockedError``, ``CheckpointCorruptError``...), not a vaguer one."""
    from gefen_ckpt import errors as kinds

    names = {e.split(":", 1)[0] for e in errors}
    kind = getattr(kinds, names.pop(), None) if len(names) == 1 else None
    return kind if isinstance(kind, type) and issubclass(kind, CheckpointError) else CheckpointError


def agree(error: BaseException | None, what: str, group=None) -> None:
    """Raise on every rank of ``group`` if ``error`` is set on any rank (``exchange`` of nothing)."""
    exchange({}, error, what, group)


def agree_in_store(error: BaseException | None, what: str) -> None:
    """``agree`` over the world through the rendezvous store alone (``checkin``), for a step after
    which the backend may be unusable (a point-to-point transfer that timed out closes gloo's
    connection to that peer): every rank raises, the failed ones their own error (which names the
    peer), the others one naming each failed rank; a rank that never arrives is named by the timeout."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        base = checkin(what, error=error)
    except CheckpointTimeoutError:
        if error is not None:
            raise error from None
        raise
    if error is not None:
        raise error
    store = c10d._get_default_store()
    if int(store.add(f"{base}/errors", 0)):
        arrivals = [store.get(f"{base}/{r}") for r in range(dist.get_world_size())]
        raise failure(what, [{"error": a[1:].decode() if a.startswith(b"!") else None} for a in arrivals])


def _as_tensor(payload: bytes, size: int, dev: torch.device) -> torch.Tensor:
    """``payload`` as a uint8 tensor on ``dev``, zero-padded to ``size`` bytes."""
    out = torch.zeros(size, dtype=torch.uint8, device=dev)
    if payload:
        out[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out


def _framed(payload: bytes, what: str, group) -> torch.Tensor:
    """Check in, then ``payload`` after its 8-byte length, padded to the longest of ``group``'s."""
    import torch.distributed as dist

    checkin(what, group)
    longest = torch.tensor([len(payload)], dtype=torch.int64, device=device(group))
    with lost_ranks(what):
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    return _as_tensor(len(payload).to_bytes(8, "little") + payload, int(longest) + 8, device(group))


def _unframed(framed: torch.Tensor) -> bytes:
    data = bytes(framed.cpu().numpy())
    return data[8:8 + int.from_bytes(data[:8], "little")]


def all_gather_bytes(payload: bytes, what: str, group=None) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank of ``group``."""
    if not active(group):
        return [payload]
    import torch.distributed as dist

    mine = _framed(payload, what, group)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with lost_ranks(what):
        dist.all_gather(out, mine, group=group)
    return [_unframed(t) for t in out]


def gather_bytes(payload: bytes, what: str, dst: int = 0, group=None) -> list[bytes] | None:
    """Every rank's ``payload`` on rank ``dst`` (None elsewhere): what a commit needs from each
    rank, without sending every rank's bytes to every rank (``all_gather_bytes``)."""
    if not active(group):
        return [payload]
    import torch.distributed as dist

    mine = _framed(payload, what, group)
    here = dist.get_rank() == dst
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))] if here else None
    with lost_ranks(what):
        dist.gather(mine, out, dst=dst, group=group)
    return [_unframed(t) for t in out] if here else None


def broadcast_bytes(payload: bytes | None, src: int = 0, group=None) -> bytes:
    """``payload`` of rank ``src`` on every rank."""
    if not active(group):
        return payload or b""
    import torch.distributed as dist

    what = "sharing checkpoint metadata"
    framed = _framed((payload or b"") if dist.get_rank() == src else b"", what, group)
    with lost_ranks(what):
        dist.broadcast(framed, src, group=group)
    return _unframed(framed)
