"""``save``/``load`` under a process group: every rank writes and reads only its own rows.

Each rank writes the rows it owns into its own files and index (checked against the split
rule every rank derives alike); rank 0 gathers O(1) bytes per rank and commits the manifest, so
until then the previous checkpoint stays committed. A load reads only the pieces overlapping a
rank's rows, whatever layout wrote them: that is the reshard.
"""

from __future__ import annotations

import hashlib
import re

import torch

from gefen.geometry import rows_and_row_numel
from gefen_ckpt.dist import placement
from gefen_ckpt.dist.collective import (
    agree,
    broadcast_bytes,
    describe_error,
    failure,
    gather_bytes,
    pack,
    unpack,
)
from gefen_ckpt.dist.optimizer_state import check_fits, export_canonical, import_canonical
from gefen_ckpt.dist.shared_reads import share_reads
from gefen_ckpt.errors import CheckpointError, CheckpointTimeoutError
from gefen_ckpt.io.storage import Store
from gefen_ckpt.state.canonical import CanonicalState, EagerSource, LocalPart
from gefen_ckpt.wire import manifest as mf
from gefen_ckpt.wire.dtypes import dtype_name
from gefen_ckpt.wire.index import Explicit, IndexSet, Rule, SplitTensor, WriterPin
from gefen_ckpt.wire.manifest import build, open_checkpoint, tensor_order
from gefen_ckpt.wire.reader import lazy_state
from gefen_ckpt.wire.writer import (
    WriteItem,
    begin,
    commit,
    data_stem,
    discard,
    new_token,
    write_index,
    write_pieces,
)


def save_sharded(optimizer: torch.optim.Optimizer | None, url: str, *, model, max_file_bytes: int,
                 memory_budget: int, storage_options: dict | None = None, state: CanonicalState | None = None,
                 group=None) -> None:
    """Rank 0 holds the location's writer lock from before any rank writes until after the
    commit; a refusal or failure anywhere raises on every rank and removes this save's files.
    ``state``: this rank's exported (e.g. staged) state instead of ``optimizer``'s; ``group``: a
    process group over every rank for the collectives (an async save's own)."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    token = broadcast_bytes(new_token().encode() if rank == 0 else None, group=group).decode()
    store, lock, previous, error, done = None, None, None, None, False
    try:
        store = Store(url, storage_options)
        if rank == 0:
            lock, previous = begin(store, token)
    except Exception as exc:
        error = exc
    try:
        agree(error, f"locking {url}", group)
        state = export_canonical(optimizer, model=model) if state is None else state
        state.metadata["source_topology"] = {"kind": "sharded", "world_size": world_size}
        error = _save_ranks(state, store, token, previous, rank, world_size, url, max_file_bytes, memory_budget,
                            group)
        try:
            agree(error, f"committing {url}", group)
        except Exception as exc:
            raise told(exc, store, token, url, rank) from exc
        done = True
    finally:
        if lock is not None:  # a failed save's token stays in the lock file: the next save removes its stragglers
            lock.release(clean=done)


def told(exc: Exception, store: Store, token: str, url: str, rank: int) -> Exception:
    """``exc`` of a save that failed once its commit may have happened, telling the truth on every
    rank, whichever rank failed or stalled: the committed manifest names this save's files (the
    checkpoint at ``url`` is the new one), it cannot be read, or, on a rank that gave up waiting
    for rank 0, rank 0 may still commit."""
    try:
        named = mf.committed_files(store)
    except Exception:
        named = None
    ours = named is None or any(n.startswith((f"data-{token}-", f"index-{token}-")) for n in named)
    late = rank != 0 and isinstance(exc, CheckpointTimeoutError)
    if not ours and not late:
        return exc
    reason = re.sub(r"[;,] (?:every waiting rank gave up, )?nothing was changed[^;]*", "", str(exc))
    if named is None:
        state = "may have been committed (the manifest there cannot be read now)"
    elif ours:
        state = f"was committed: the checkpoint there is the new one (files of save {token})"
    else:
        state = "was not committed when this rank gave up, but rank 0 may still commit it"
    kind = type(exc) if isinstance(exc, CheckpointError) else CheckpointError
    error = kind(f"{url}: the save {state}; {reason}")
    error.committed = ours if named is not None else None
    return error


def _save_ranks(state, store, token, previous, rank, world_size, url, max_file_bytes, memory_budget, group=None):
    """Rank-local: each rank writes and checks its data and index (``RankSplits``); rank 0 gathers
    ``commit_payload`` from each and commits. Returns this rank's error (None: committed)."""
    error, payload = None, {}
    try:
        plan = RankSplits(state, rank)
        pieces, files = write_pieces(store, data_stem(token, rank), plan.items(),
                                     max_file_bytes=max_file_bytes, memory_budget=memory_budget)
        pin, data = write_index(store, token, rank, pieces, files, plan.ordinals)
        plan.check(pin, data, {f.name: f.nbytes for f in files}, store)
        payload = commit_payload(pin, plan)
    except Exception as exc:
        error = exc
        discard(store, token, rank)
    payload["error"] = None if error is None else describe_error(error)
    try:
        gathered = gather_bytes(pack(payload), f"save to {url}", group=group)
    except BaseException:  # a rank stalled or died: no commit can follow (a late rank finds that the
        discard(store, token)  # others gave up), so every survivor removes every rank's files of this save
        raise
    if rank != 0:
        return error
    try:
        everyone = [unpack(b) for b in gathered]
        if (failed := failure(f"save to {url}", everyone, "nothing was changed")) is not None:
            raise error or failed
        manifest = build(state, plan.merged([p["explicit"] for p in everyone], [p["digest"] for p in everyone]),
                         [WriterPin.from_raw(p["writer"]) for p in everyone], layout="sharded", world_size=world_size)
        commit(store, manifest, token, previous=previous)  # removes every rank's files if it fails
    except Exception as exc:
        discard(store, token)
        return error or exc
    return error


def commit_payload(pin: WriterPin, plan: RankSplits) -> dict:
    """What one rank sends the committing rank: its files, its index's pin, a digest of the
    state's structure, and only where no rule describes its rows, those rows: O(1) bytes."""
    return {"writer": pin.to_raw(), "digest": plan.digest, "explicit": plan.explicit}


class RankSplits:
    """One rank's view of a sharded save's splits: every tensor's rule (``gefen.replicas.assign``
    over the ranks holding it: the same on every rank, no plan is exchanged), this rank's rows
    of the tensors no rule describes, and the check of its own index."""

    def __init__(self, state: CanonicalState, rank: int):
        self.rank = rank
        self.ordinals = tensor_order(state)
        self.parts = {(fqn, name): state.global_fields[name] if fqn is None else state.params[fqn].fields[name]
                      for fqn, name in self.ordinals}
        for key, part in self.parts.items():
            if not isinstance(part, LocalPart):
                raise TypeError(f"{key[0] or 'global'}/{key[1]}: expected a rank-local part, got {type(part).__name__}")
        self.rules: dict[tuple, Rule | None] = dict.fromkeys(self.ordinals)
        self.rules.update(rules_for({k: p for k, p in self.parts.items() if p.holders is not None}))
        self.explicit: dict[int, list[list[int]]] = {}  # ordinal -> this rank's [start, stop] rows (no rule)
        self.mine: dict[tuple, list[tuple[int, int]]] = {}
        structure = []
        for key, ordinal in self.ordinals.items():
            part, rule = self.parts[key], self.rules[key]
            rows = rows_and_row_numel(part.shape)[0]
            if rule is None:
                spans = [(part.row_start, part.row_stop)] if part.writer and part.row_start < part.row_stop else []
                self.explicit[ordinal] = [list(r) for r in spans]
            else:
                spans = rule.parts_of(rows, rank)
                if any(a < part.row_start or b > part.row_stop for a, b in spans):
                    raise CheckpointError(f"{key[0] or 'global'}/{key[1]}: the replica rule gives rank {rank} rows "
                                          f"{spans[:2]} outside the rows it holds [{part.row_start}, {part.row_stop})")
            self.mine[key] = spans
            shape = None if rule is None else [rule.parts, rule.sub, len(rule.writers), rule.writers[0]]
            structure.append([*key, list(part.shape), str(part.dtype), shape])
        self.digest = hashlib.blake2b(pack(structure), digest_size=16).hexdigest()

    def items(self) -> list[WriteItem]:
        """The pieces this rank writes: its rows by the rule (or, with no rule, as the first replica)."""
        return [WriteItem(fqn, name, a, EagerSource(self.parts[fqn, name].read(a, b) if self.parts[fqn, name].shape
                                                    else self.parts[fqn, name].tensor))
                for (fqn, name), spans in self.mine.items() for a, b in spans]

    def check(self, pin: WriterPin, data: bytes, sizes: dict[str, int], store: Store) -> None:
        """This rank's index, validated exactly as a reader will, against its own parts."""
        tensors = []
        for (fqn, name), ordinal in self.ordinals.items():
            part, split = self.parts[fqn, name], self.rules[fqn, name]
            if split is None:
                split = Explicit(tuple((a, b, self.rank) for a, b in self.explicit[ordinal]))
            tensors.append(SplitTensor(fqn, name, dtype_name(part.dtype), tuple(part.shape), split, ordinal, None))
        indexes = IndexSet({self.rank: pin}, tensors, sizes)
        indexes.store = store
        indexes.parse(self.rank, data)

    def merged(self, explicit: list[dict], digests: list[str]) -> dict:
        """Every tensor's split for the manifest (on the committing rank): its rule, or the rows
        every rank reported where no rule applies."""
        differ = [r for r, d in enumerate(digests) if d != self.digest]
        if differ:
            raise CheckpointError(f"rank(s) {differ[:8]} hold a state of another structure (FQNs, shapes, dtypes or "
                                  "sharding differ from rank 0's): the ranks do not hold one optimizer")
        reported: dict[int, list] = {}
        for r, rows in enumerate(explicit):
            for ordinal, parts in rows.items():
                reported.setdefault(int(ordinal), []).extend((a, b, r) for a, b in parts)
        return {key: (rule.parts, rule.writers, rule.sub) if (rule := self.rules[key]) is not None
                else sorted(reported.get(ordinal, [])) for key, ordinal in self.ordinals.items()}


def rules_for(parts: dict) -> dict:
    """Each tensor's rule (``placement.replica_rules``) from its ``LocalPart``'s shape and holders."""
    return placement.replica_rules(parts, {k: p.holders for k, p in parts.items()})


def load_sharded(optimizer: torch.optim.Optimizer, url: str, *, model, storage_options: dict | None = None,
                 read_once: bool | None = None, memory_budget: int) -> None:
    """Each rank loads its rows; with ``read_once`` rows held by several ranks are read from
    storage by one of them and shared (``shared_reads``). None: where reads cross a network
    (``Store.networked``); a local disk serves every rank from one page cache faster than the ranks
    can send each other the bytes (docs/decisions.md, "Replicas share the I/O")."""
    error, state, store = None, None, None
    try:
        store = Store(url, storage_options)
        state = lazy_state(store, open_checkpoint(store, whole=False), map_files=True)
        check_fits(optimizer, state, model)  # refuse before reading any data
    except Exception as exc:
        error = exc
    agree(error, f"load from {url}")
    if read_once if read_once is not None else store.networked:
        state = share_reads(optimizer, state, url, model=model, budget=memory_budget)
    import_canonical(optimizer, state, model=model, adopt=True)  # reads return memory of their own
