"""The public checkpoint calls: ``save``/``load`` an optimizer, ``write``/``read`` a canonical
state, ``read_manifest`` and ``verify`` (docs/design.md 7, 11). Any fsspec URL works: local paths,
``file://``, ``memory://``, ``s3://``...; ``storage_options`` go to its filesystem (endpoint,
credentials, timeouts), and ``timeout`` bounds how long a collective save or load waits for a
stalled rank (``collective.DEFAULT_TIMEOUT``).
"""

from __future__ import annotations

import torch

from gefen_ckpt.dist import collective
from gefen_ckpt.dist.optimizer_state import check_fits, copies_on_load, export_canonical, import_canonical
from gefen_ckpt.dist.sharded import load_sharded, save_sharded
from gefen_ckpt.errors import CheckpointMismatchError, naming
from gefen_ckpt.io import iostats
from gefen_ckpt.io.progress import progress_bar
from gefen_ckpt.io.storage import Store
from gefen_ckpt.state.canonical import CanonicalState
from gefen_ckpt.wire.manifest import (
    open_checkpoint,
    parse_manifest,
    read_manifest_bytes,
)
from gefen_ckpt.wire.reader import lazy_state, stage_checkpoint
from gefen_ckpt.wire.verify import VerifyReport, verify
from gefen_ckpt.wire.writer import write_state

__all__ = ["save", "load", "read", "write", "read_manifest", "verify", "VerifyReport", "last_io_stats"]
last_io_stats = iostats.last_io_stats

MAX_FILE_BYTES = 2**31
MEMORY_BUDGET = 256 * 2**20


def write(state: CanonicalState, url: str, world_size: int | None = None, *, max_file_bytes: int = MAX_FILE_BYTES,
          memory_budget: int = MEMORY_BUDGET, progress: bool = False, storage_options: dict | None = None) -> None:
    """Write ``state`` to ``url`` and commit it atomically.

    ``world_size`` None writes the canonical layout (global tensors); an int writes the
    sharded layout, row-sharded fields split like ``torch.chunk`` on dim 0 and replicated ones
    stored once. Tensors are streamed: extra memory stays within ``memory_budget``. A second
    save to the same location while this one runs is refused (``CheckpointLockedError``).
    """
    store = Store(url, storage_options)
    with progress_bar(progress, f"writing {url}", state.total_bytes()) as on_bytes:
        write_state(state, store, world_size=world_size, max_file_bytes=max_file_bytes,
                    memory_budget=memory_budget, on_bytes=on_bytes)


def save(optimizer: torch.optim.Optimizer, url: str, *, model: torch.nn.Module | None = None,
         max_file_bytes: int = MAX_FILE_BYTES, memory_budget: int = MEMORY_BUDGET, progress: bool = False,
         storage_options: dict | None = None, timeout: float | None = None) -> None:
    """Save ``optimizer``'s state to ``url``; the previous checkpoint there stays loadable until
    the new one is committed. ``model`` names parameters of optimizers built from bare tensors.

    Under a process group this is a collective: every rank writes its own rows in parallel
    (the sharded layout) and rank 0 commits the manifest once every rank has succeeded; a rank
    that does not arrive within ``timeout`` seconds makes every rank raise naming it. Replicated
    rows (DDP, HSDP) are written once, the writing spread over every rank holding them
    (``gefen.replicas``); ``gefen_ckpt.last_io_stats()`` tells what this rank moved.
    """
    with iostats.measuring("save"):
        _save(optimizer, url, model, max_file_bytes, memory_budget, progress, storage_options, timeout)


def _save(optimizer, url, model, max_file_bytes, memory_budget, progress, storage_options, timeout) -> None:
    if collective.active():
        with collective.deadline(timeout):
            save_sharded(optimizer, url, model=model, max_file_bytes=max_file_bytes, memory_budget=memory_budget,
                         storage_options=storage_options)
        return
    write(export_canonical(optimizer, model=model), url, max_file_bytes=max_file_bytes,
          memory_budget=memory_budget, progress=progress, storage_options=storage_options)


def read(url: str, *, storage_options: dict | None = None) -> CanonicalState:
    """The checkpoint at ``url`` as a lazy ``CanonicalState``: tensors are read (and verified)
    only when asked for, and only the pieces holding the requested rows."""
    store = Store(url, storage_options)
    return lazy_state(store, open_checkpoint(store, whole=False))


def read_manifest(url: str, *, storage_options: dict | None = None) -> dict:
    """The validated manifest (plain msgpack data); reads no tensor data."""
    store = Store(url, storage_options)
    return parse_manifest(store, read_manifest_bytes(store)).raw


def load(optimizer: torch.optim.Optimizer, url: str, *, model: torch.nn.Module | None = None,
         storage_options: dict | None = None, timeout: float | None = None, read_once: bool | None = None,
         memory_budget: int = MEMORY_BUDGET) -> None:
    """Load the checkpoint at ``url`` into ``optimizer``.

    The manifest is checked against the live optimizer (contract, FQNs, shapes, fields) before
    any data is read; then everything is read and verified into memory and imported; on any
    error (a ``CheckpointError`` naming the file or FQN) the optimizer is untouched. Under a
    process group this is a collective: each rank reads only the pieces holding its rows,
    whatever world size or layout wrote the checkpoint, and all ranks raise together on any
    error (a rank missing for ``timeout`` seconds is named). With ``read_once`` rows that several
    ranks hold (replicas: DDP, HSDP) are read from storage by one of them, the reading spread
    over the holders, and sent to the others over the process group in messages of at most
    ``memory_budget`` bytes, each checked on arrival; None (the default) reads once where reads
    cross a network (object stores, network file systems) and lets every rank read a local
    disk's files itself (docs/decisions.md).
    """
    with iostats.measuring("load"):
        _load(optimizer, url, model, storage_options, timeout, read_once, memory_budget)


def _load(optimizer, url, model, storage_options, timeout, read_once, memory_budget) -> None:
    if collective.active():
        with _naming(url), collective.deadline(timeout):
            load_sharded(optimizer, url, model=model, storage_options=storage_options, read_once=read_once,
                         memory_budget=memory_budget)
        return
    store = Store(url, storage_options)

    def refuse_unfit(manifest) -> None:  # before reading any data
        with _naming(url):
            check_fits(optimizer, lazy_state(store, manifest), model)

    state = stage_checkpoint(store, refuse_unfit, map_files=copies_on_load(optimizer))
    with _naming(url):
        import_canonical(optimizer, state, model=model)


def _naming(url: str):
    """Mismatch errors name the checkpoint; the optimizer's own refusals become mismatch errors."""
    return naming(url, (ValueError, TypeError), CheckpointMismatchError)

