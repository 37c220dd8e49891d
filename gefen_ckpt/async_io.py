"""``async_save``: copy the state into reusable host buffers (training waits only for that),
then write and commit it in a background thread with the synchronous save's own code (under a
process group, on a gloo group of its own so its collectives never interleave with training's).
One save runs at a time. A pending save is finished, and its failure reported as a warning unless
its future's result was asked for, before ``destroy_process_group`` and at interpreter exit.
"""

from __future__ import annotations

import atexit
import functools
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from gefen_ckpt.dist import collective
from gefen_ckpt.io import iostats
from gefen_ckpt.state.canonical import CanonicalState, EagerSource, LocalPart


class SaveFuture(Future):
    """The future of one ``async_save``: knows its URL, and whether its outcome was asked for (an
    error nobody asked for is reported at ``destroy_process_group`` and at exit)."""

    def __init__(self, url: str):
        super().__init__()
        self.url, self.seen = url, False

    def result(self, timeout=None):
        self.seen = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.seen = True
        return super().exception(timeout)


_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pending: SaveFuture | None = None
_buffers: dict[str, torch.Tensor] = {}
_group = None


def finish_pending(when: str) -> None:
    """Wait for the pending save (its collectives need the process group, so it must end first)
    and warn, naming its checkpoint, if it failed and nobody asked its future: never lost silently."""
    future = _pending
    if future is None:
        return
    wait([future])
    error = Future.exception(future)  # without marking it seen
    if error is None or future.seen:
        return
    written = ("" if getattr(error, "committed", False)
               else "; the checkpoint there was not written (the previous one, if any, stays committed)")
    warnings.warn(f"gefen_ckpt.async_save to {future.url} failed {when}: {type(error).__name__}: {error}{written}",
                  RuntimeWarning, stacklevel=3)
    future.seen = True


atexit.register(finish_pending, "(reported at interpreter exit)")


def _watch_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` finish (or report) a pending async save
    first: destroying the group under it would fail its collectives, silently to a script that
    never asks its future. It also forgets the save group, which dies with the world."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    real = c10d.destroy_process_group
    if getattr(real, "_gefen_ckpt", False):
        return

    @functools.wraps(real)
    def destroy_process_group(group=None):
        global _group
        if group is None or group is _group:
            finish_pending("before destroy_process_group")
            if group is None:
                _group = None
        return real(group)

    destroy_process_group._gefen_ckpt = True
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group


def _buffer(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` in the buffer kept for ``key`` (reallocated only when the
    shape or dtype changed; pinned when CUDA is available, so device copies run at full speed)."""
    buf = _buffers.get(key)
    if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
        buf = _buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    buf.copy_(tensor, non_blocking=tensor.device.type == "cuda")
    return buf


def _stage(state: CanonicalState) -> CanonicalState:
    """``state`` with every tensor copied into its host buffer (a LocalPart stays a LocalPart)."""
    def staged(key: str, source):
        if isinstance(source, LocalPart):
            return LocalPart(_buffer(key, source.tensor), source.row_start, source.shape, source.writer,
                             source.holders)
        return EagerSource(_buffer(key, source.read()))

    out = state.with_sources(staged)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies are complete before the optimizer steps
    return out


def async_save(optimizer: torch.optim.Optimizer, url: str, *, model: torch.nn.Module | None = None,
               max_file_bytes: int | None = None, memory_budget: int | None = None,
               storage_options: dict | None = None, timeout: float | None = None) -> Future:
    """Save ``optimizer``'s state to ``url`` in the background; returns a ``Future`` whose
    ``result()`` is None once the checkpoint is committed, or raises the save's error (under a
    process group, on every rank). Blocks only to copy the state into host buffers (and first
    until a previous ``async_save`` has finished); the optimizer may step while the write runs.
    The files are those ``gefen_ckpt.save`` writes for the same state. A save still pending at
    ``destroy_process_group()`` or at interpreter exit is finished first (its failure, if nobody
    asked the future, a ``RuntimeWarning`` naming ``url``); ``os._exit`` or a kill runs nothing: the
    save is lost, the previous checkpoint stays committed, and the next save removes its files."""
    from gefen_ckpt.api import MAX_FILE_BYTES, MEMORY_BUDGET
    from gefen_ckpt.dist.optimizer_state import export_canonical
    from gefen_ckpt.dist.sharded import save_sharded
    from gefen_ckpt.io.storage import Store
    from gefen_ckpt.wire.writer import write_state

    global _executor, _pending, _group
    sizes = {"max_file_bytes": max_file_bytes or MAX_FILE_BYTES, "memory_budget": memory_budget or MEMORY_BUDGET}
    with _lock:
        if _pending is not None:
            wait([_pending])  # its error, if any, is its own future's to raise
        sharded = collective.active()
        if sharded and _group is None:  # a gloo group over every rank, created once, collectively
            import datetime

            import torch.distributed as dist

            seconds = collective.group_timeout()  # the job's timeout, not new_group's 30 minutes
            _group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds) if seconds else None)
            _watch_destroy()
        staged, group = _stage(export_canonical(optimizer, model=model)), _group
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="gefen-ckpt-async-save")
        future = SaveFuture(str(url))

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                with collective.deadline(timeout), iostats.measuring("async_save"):
                    if sharded:
                        save_sharded(None, url, model=model, storage_options=storage_options, state=staged,
                                     group=group, **sizes)
                    else:
                        write_state(staged, Store(url, storage_options), world_size=None, **sizes)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

        _executor.submit(run)
        _pending = future
        return future
