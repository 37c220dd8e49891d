"""``async_save``: copy the state into reusable host buffers (training waits only for that),
then write and commit it in a background thread with the synchronous save's own code (under a
process group, on a gloo group of its own so its collectives never interleave with training's).
One save runs at a time.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from gefen_ckpt import collective
from gefen_ckpt.canonical import CanonicalState, EagerSource, LocalPart

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pending: Future | None = None
_buffers: dict[str, torch.Tensor] = {}
_group = None


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
            return LocalPart(_buffer(key, source.tensor), source.row_start, source.shape, source.writer, source.split)
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
    The files are those ``gefen_ckpt.save`` writes for the same state."""
    from gefen_ckpt.api import MAX_FILE_BYTES, MEMORY_BUDGET
    from gefen_ckpt.live import export_canonical
    from gefen_ckpt.sharded_io import save_sharded
    from gefen_ckpt.storage import Store
    from gefen_ckpt.wire.writer import write_state

    global _executor, _pending, _group
    sizes = {"max_file_bytes": max_file_bytes or MAX_FILE_BYTES, "memory_budget": memory_budget or MEMORY_BUDGET}
    with _lock:
        if _pending is not None:
            wait([_pending])  # its error, if any, is its own future's to raise
        sharded = collective.active()
        if sharded and _group is None:  # a gloo group over every rank, created once, collectively
            import torch.distributed as dist

            _group = dist.new_group(backend="gloo")
        staged = _stage(export_canonical(optimizer, model=model))
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="gefen-ckpt-async-save")

        def run() -> None:
            with collective.deadline(timeout):
                if sharded:
                    save_sharded(None, url, model=model, storage_options=storage_options, state=staged, group=_group,
                                 **sizes)
                else:
                    write_state(staged, Store(url, storage_options), world_size=None, **sizes)

        _pending = _executor.submit(run)
        return _pending
