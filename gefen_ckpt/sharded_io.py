"""``save``/``load`` under a process group: every rank writes and reads only its own rows.

Save: each rank writes the rows it owns (one replica per row range) into its own data files,
in parallel; the ranks agree that every write succeeded; rank 0 builds the manifest from
every rank's piece records and commits it. Until that commit the previous checkpoint at the
URL stays the committed one, so a failure anywhere leaves it intact (and this save's data
files are removed).

Load: every rank opens the checkpoint lazily and reads only the pieces that overlap its rows
(checksums verified), whatever layout or world size wrote it: that is the reshard.
"""

from __future__ import annotations

import torch

from gefen_ckpt.canonical import CanonicalState, EagerSource, LocalPart
from gefen_ckpt.collective import agree, broadcast_bytes, exchange
from gefen_ckpt.exchange import check_fits, copies_on_load, export_canonical, import_canonical
from gefen_ckpt.format.manifest import FileRecord, PieceRecord, build, open_checkpoint
from gefen_ckpt.format.reader import lazy_state
from gefen_ckpt.format.writer import WriteItem, begin, commit, data_stem, discard, new_token, write_pieces
from gefen_ckpt.storage import Store


def _own_items(state: CanonicalState) -> list[WriteItem]:
    """The pieces this rank writes: the rows it owns as the designated replica, nothing else."""
    def item(fqn, name, part):
        if not isinstance(part, LocalPart):
            raise TypeError(f"{fqn or 'global'}/{name}: expected a rank-local part, got {type(part).__name__}")
        return WriteItem(fqn, name, part.row_start, EagerSource(part.tensor))

    out = [item(None, key, part) for key, part in state.global_fields.items() if part.writer]
    for fqn, entry in state.params.items():
        for name, part in entry.fields.items():
            if part.writer and (part.tensor.dim() == 0 or part.tensor.shape[0] > 0):
                out.append(item(fqn, name, part))
    return out


def save_sharded(optimizer: torch.optim.Optimizer, url: str, *, model, max_file_bytes: int,
                 memory_budget: int, storage_options: dict | None = None) -> None:
    """Rank 0 holds the location's writer lock from before any rank writes until after the
    commit; a refusal or failure anywhere raises on every rank and removes this save's files."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    token = broadcast_bytes(new_token().encode() if rank == 0 else None).decode()
    store, lock, previous, error = None, None, None, None
    try:
        store = Store(url, storage_options)
        if rank == 0:
            lock, previous = begin(store, token)
    except Exception as exc:
        error = exc
    try:
        agree(error, f"locking {url}")
        state = export_canonical(optimizer, model=model)
        state.metadata["source_topology"] = {"kind": "sharded", "world_size": world_size}
        pieces, files = [], []
        try:
            pieces, files = write_pieces(store, data_stem(token, rank), _own_items(state),
                                         max_file_bytes=max_file_bytes, memory_budget=memory_budget)
        except Exception as exc:  # every rank learns of it in exchange()
            error = exc
        try:  # every rank's piece records, once every rank has written
            gathered = exchange({"pieces": [p.to_dict() for p in pieces], "files": [[f.name, f.nbytes] for f in files]},
                                error, f"save to {url}")
        except BaseException:
            discard(store, token, rank)
            raise
        if rank == 0:
            try:
                manifest = build(state, [PieceRecord.from_dict(p) for g in gathered for p in g["pieces"]],
                                 [FileRecord(n, b) for g in gathered for n, b in g["files"]],
                                 layout="sharded", world_size=world_size)
                commit(store, manifest, token, previous=previous)  # removes every rank's files if it fails
            except Exception as exc:
                error = exc
        agree(error, f"committing {url}")
    finally:
        if lock is not None:
            lock.release()


def load_sharded(optimizer: torch.optim.Optimizer, url: str, *, model, storage_options: dict | None = None) -> None:
    error, state = None, None
    try:
        store = Store(url, storage_options)
        state = lazy_state(store, open_checkpoint(store), map_files=copies_on_load(optimizer))
        check_fits(optimizer, state, model)  # refuse before reading any data
    except Exception as exc:
        error = exc
    agree(error, f"load from {url}")
    import_canonical(optimizer, state, model=model)
