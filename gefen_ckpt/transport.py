"""Moving optimizer state between ranks in chunks under a byte budget (docs/design.md 9):
``gather`` (onto one rank), ``scatter`` (from one rank into a sharded optimizer) and
``redistribute`` (from one layout to another over the same ranks, without a file or a whole copy).

Every layout gives each rank one contiguous range of global rows of each field, so what moves
where is a pure plan of row ranges (``assign_rows`` ... ``plan_rounds``), identical on every rank.
Moves are cut to ``budget_bytes`` and grouped into rounds in which no rank sends, receives and
copies more; rows go straight from the holder's tensor into the receiver's (``last_stats()``
reports the copies). A rank whose read fails sends zeros, so every rank finishes the round and
raises before any optimizer is touched. Descriptions travel as msgpack, tensors as raw bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gefen.contract import OptimizerContract
from gefen.geometry import rows_and_row_numel
from gefen_ckpt.dist import collective
from gefen_ckpt.dist.placement import is_dtensor, to_local
from gefen_ckpt.errors import CheckpointError
from gefen_ckpt.state.canonical import CanonicalState, EagerSource, LocalPart, ParamState, TensorSource
from gefen_ckpt.wire.dtypes import dtype_name, torch_dtype

__all__ = ["gather", "scatter", "redistribute", "last_stats", "TransportStats"]

DEFAULT_BUDGET = 256 * 2**20
_MIN_BUDGET = 16  # one element of any dtype must fit in a message

Range = tuple[int, int]


# ===== pure planning ==========================================================================
@dataclass(frozen=True)
class Move:
    """Elements ``[start, stop)`` of the flattened global tensor number ``tensor``, ``src`` -> ``dst``."""

    tensor: int
    src: int
    dst: int
    start: int
    stop: int


def assign_rows(rows: int, have: Sequence[Range | None], want: Sequence[Range | None], *,
                load: list[int] | None = None, row_bytes: int = 1, label: str = "tensor") -> list[tuple[int, int, int, int]]:
    """Which rows each receiving rank gets from which holder: ``[(src, dst, start, stop)]``.

    ``have[r]`` / ``want[r]``: the global rows rank ``r`` holds / needs (None: nothing). A
    receiver takes rows it holds from itself; other rows come from the holder given the fewest
    bytes so far (``load``, shared across tensors, so replicas share the sending).
    """
    load = [0] * len(have) if load is None else load
    for what, ranges in (("held", have), ("wanted", want)):
        for r, span in enumerate(ranges):
            if span is not None and not 0 <= span[0] <= span[1] <= rows:
                raise CheckpointError(f"{label}: rank {r} {what} rows {list(span)} outside [0, {rows})")
    out: list[tuple[int, int, int, int]] = []
    for dst, span in enumerate(want):
        if span is None or span[0] == span[1]:
            continue
        lo, hi = span
        cuts = {lo, hi}
        for h in have:
            if h is not None:
                cuts.update(c for c in h if lo < c < hi)
        edges = sorted(cuts)
        for a, b in zip(edges, edges[1:]):
            holders = [r for r, h in enumerate(have) if h is not None and h[0] <= a and b <= h[1]]
            if not holders:
                raise CheckpointError(f"{label}: rows [{a}, {b}) are held by no rank (the state does not cover it)")
            src = dst if dst in holders else min(holders, key=lambda r: (load[r], r))
            if src != dst:
                load[src] += (b - a) * row_bytes
            if out and out[-1][0] == src and out[-1][1] == dst and out[-1][3] == a:
                out[-1] = (src, dst, out[-1][2], b)
            else:
                out.append((src, dst, a, b))
    return out


def chunk_elements(start: int, stop: int, row_numel: int, itemsize: int, budget: int) -> list[Range]:
    """Rows ``[start, stop)`` as flat element ranges of at most ``budget`` bytes each: whole rows
    when a row fits (so a lazy source reads each row once), else pieces of one row."""
    if budget < itemsize:
        raise ValueError(f"budget of {budget} bytes cannot hold one {itemsize}-byte element")
    if row_numel == 0 or start >= stop:
        return []
    row_bytes = row_numel * itemsize
    if row_bytes <= budget:
        step = budget // row_bytes
        return [(r * row_numel, min(r + step, stop) * row_numel) for r in range(start, stop, step)]
    piece = budget // itemsize
    return [(r * row_numel + e, r * row_numel + min(e + piece, row_numel))
            for r in range(start, stop) for e in range(0, row_numel, piece)]


@dataclass(frozen=True)
class TensorInfo:
    """What the planner needs of a global tensor (0-D tensors are one row of one element)."""

    shape: tuple[int, ...]
    itemsize: int
    label: str = "tensor"

    @property
    def rows(self) -> int:
        return rows_and_row_numel(self.shape)[0]

    @property
    def row_numel(self) -> int:
        return rows_and_row_numel(self.shape)[1]


def plan_moves(tensors: Sequence[TensorInfo], have: Sequence[Sequence[Range | None]],
               want: Sequence[Sequence[Range | None]], budget: int) -> list[Move]:
    """Every chunk to move, in one global order (identical on all ranks); ``have[t][r]`` /
    ``want[t][r]``: rows of tensor ``t`` rank ``r`` holds / needs."""
    moves: list[Move] = []
    load = [0] * (len(have[0]) if have else 0)
    for t, info in enumerate(tensors):
        row_bytes = info.row_numel * info.itemsize
        for src, dst, a, b in assign_rows(info.rows, have[t], want[t], load=load, row_bytes=row_bytes,
                                          label=info.label):
            moves.extend(Move(t, src, dst, s, e) for s, e in chunk_elements(a, b, info.row_numel, info.itemsize,
                                                                            budget))
    return moves


def plan_rounds(moves: Sequence[Move], itemsizes: Sequence[int], budget: int) -> list[list[Move]]:
    """Consecutive moves grouped so that in each round no rank sends, receives and copies more
    than ``budget`` bytes in all. Each round is completed before the next, so no order of moves
    can deadlock."""
    rounds: list[list[Move]] = []
    current: list[Move] = []
    busy: dict[int, int] = {}
    for m in moves:
        n = (m.stop - m.start) * itemsizes[m.tensor]
        ranks = {m.src, m.dst}
        if current and any(busy.get(r, 0) + n > budget for r in ranks):
            rounds.append(current)
            current, busy = [], {}
        current.append(m)
        for r in ranks:
            busy[r] = busy.get(r, 0) + n
    if current:
        rounds.append(current)
    return rounds


# ===== statistics =============================================================================
@dataclass
class TransportStats:
    """What the last transport call on this rank moved, and the extra memory it staged."""

    operation: str = ""
    budget_bytes: int = 0
    rounds: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    largest_message: int = 0
    staging_bytes: int = 0  # currently held copies (0 after a call)
    peak_staging_bytes: int = 0  # the most bytes held at once in copies made for sending/receiving
    local_copies: int = 0

    def stage(self, nbytes: int) -> None:
        self.staging_bytes += nbytes
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes)

    def unstage(self, nbytes: int) -> None:
        self.staging_bytes -= nbytes


_LAST = TransportStats()


def last_stats() -> TransportStats:
    """Statistics of this rank's most recent ``gather``/``scatter``/``redistribute`` call."""
    return _LAST


# ===== descriptions (msgpack) =================================================================
_DESCRIPTION = "a transported state description"


def _describe(state: CanonicalState) -> dict:
    """The state without its tensor data: what receivers need to allocate and validate."""
    if not isinstance(state, CanonicalState):
        raise TypeError(f"expected a CanonicalState, got {type(state).__name__}")

    def tensor(src: TensorSource) -> list:
        return [[int(s) for s in src.shape], dtype_name(src.dtype)]

    return {
        "contract": state.contract.to_dict(),
        "groups": state.param_groups,
        "params": [[fqn, [int(s) for s in e.shape], dtype_name(e.dtype), e.child,
                    [[name, *tensor(e.fields[name])] for name in sorted(e.fields)]]
                   for fqn, e in state.params.items()],
        "globals": [[key, *tensor(state.global_fields[key])] for key in sorted(state.global_fields)],
    }


class _Skeleton:
    """A tensor known by shape and dtype only, recording which rows an import reads: running
    ``import_canonical``'s preparation against skeletons makes the rows a rank is sent exactly
    those its import reads, and runs every structural check before any data moves."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype, self.wanted = tuple(shape), dtype, None

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = rows_and_row_numel(self.shape)[0] if stop is None else stop
        if self.wanted is not None:
            start, stop = min(start, self.wanted[0]), max(stop, self.wanted[1])
        self.wanted = (start, stop)
        if not self.shape:
            return torch.zeros((), dtype=self.dtype)
        return torch.zeros((), dtype=self.dtype).expand(stop - start, *self.shape[1:])


class _Absent:
    """A tensor this rank was not sent because its import does not read it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, label: str):
        self.shape, self.dtype, self.label = tuple(shape), dtype, label

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        raise CheckpointError(f"{self.label} was not transported to this rank")


def _skeleton(description: dict) -> CanonicalState:
    """The described state with a ``_Skeleton`` for each tensor."""

    def tensor(shape, dtype: str) -> _Skeleton:
        return _Skeleton(tuple(shape), torch_dtype(dtype, _DESCRIPTION))

    global_fields = {key: tensor(shape, dtype) for key, shape, dtype in description["globals"]}
    params = {fqn: ParamState(tuple(shape), torch_dtype(dtype, _DESCRIPTION),
                              {name: tensor(s, d) for name, s, d in fields}, child)
              for fqn, shape, dtype, child, fields in description["params"]}
    return CanonicalState(OptimizerContract.from_dict(description["contract"]),
                          [dict(g) for g in description["groups"]], params, global_fields)


def _infos(ordered: Sequence[tuple[str, object]]) -> list[TensorInfo]:
    return [TensorInfo(tuple(src.shape), src.dtype.itemsize, label) for label, src in ordered]


def _wanted_rows(optimizer, description: dict, model) -> tuple[CanonicalState, list[Range | None]]:
    """The described state (of skeletons) and the rows of each tensor that this rank's
    ``import_canonical`` will read, after all of its validation against the live optimizer."""
    from gefen_ckpt.dist.optimizer_state import local_state_dict

    skeleton = _skeleton(description)
    local_state_dict(optimizer, skeleton, model)
    return skeleton, [src.wanted for _, src in skeleton.tensors()]


# ===== collectives ============================================================================
def _world() -> tuple[int, int]:
    if not collective.active():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _agreed(payload: dict, error: BaseException | None, what: str, stats: TransportStats,
            **same: str) -> list[dict]:
    """The first exchange of every call: all ranks' payloads, checked to carry the same value
    under each key of ``same`` (its name for the error); the budget is the smallest passed."""
    everyone = collective.exchange(payload, error, what)
    for key, name in same.items():
        if any(p[key] != everyone[0][key] for p in everyone):
            raise CheckpointError(f"{what}: ranks passed different {name}: {[p[key] for p in everyone]}")
    stats.budget_bytes = min(p["budget"] for p in everyone)
    return everyone


def _ranges(everyone: list[dict], key: str, count: int) -> list[list[Range | None]]:
    """``[tensor][rank]`` row ranges from every rank's payload list under ``key``."""
    return [[None if (r := p[key][t]) is None else (int(r[0]), int(r[1])) for p in everyone]
            for t in range(count)]


def _offer(state: CanonicalState, budget_bytes, writers_only: bool) -> tuple[dict, list, dict]:
    """What ``gather``/``redistribute`` send first: the state's description, its tensors in
    order, and the payload (budget, digest of the description, rows held of each tensor)."""
    budget = _check_budget(budget_bytes)
    description = _describe(state)
    ordered = [(label, _normalise(src)) for label, src in state.tensors()]
    payload = {"budget": budget, "digest": hashlib.sha256(collective.pack(description)).digest(),
               "held": [_held(src, writers_only) for _, src in ordered]}
    return description, ordered, payload


def _import(what: str, received: tuple[list, BaseException | None], optimizer, skeleton: CanonicalState,
            metadata: dict, want, model) -> None:
    """Agree on the data phase (``_move``'s outputs and error), then load this rank's rows as
    LocalParts through ``import_canonical``, which validates again and agrees before it loads."""
    from gefen_ckpt.dist.optimizer_state import import_canonical

    outputs, error = received
    collective.agree(error, what)
    rank, _ = _world()
    arrived = {label: (t, w[rank]) for (label, _), t, w in zip(skeleton.tensors(), outputs, want)}

    def source(label: str, src: _Skeleton):
        tensor, span = arrived[label]
        if tensor is None:
            return _Absent(src.shape, src.dtype, label)
        return LocalPart(tensor, span[0] if src.shape else 0, src.shape, False)

    state = skeleton.with_sources(source)
    state.metadata = dict(metadata)
    import_canonical(optimizer, state, model=model)


_DIFFERENT_STATES = "states (contract, param groups, FQNs, shapes or dtypes differ)"


def _check_budget(budget_bytes) -> int:
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < _MIN_BUDGET:
        raise ValueError(f"budget_bytes must be an int >= {_MIN_BUDGET}, got {budget_bytes!r}")
    return budget_bytes


# ===== the data phase =========================================================================
def _normalise(source):
    """A LocalPart over a DTensor (torch optimizers' state on FSDP2 params) as one over the
    local tensor: slicing the DTensor itself would be a collective."""
    if isinstance(source, LocalPart) and is_dtensor(source.tensor):
        return LocalPart(to_local(source.tensor), source.row_start, source.shape, source.writer)
    return source


class _Mover:
    """Runs the rounds of a plan on this rank: ``sources[t]`` this rank's source of tensor ``t``,
    ``outputs[t]`` ``(flat tensor, first global element)`` where received elements land (either
    may be None). A failed read is kept in ``self.error`` and zeros are sent instead, so the
    protocol stays in lockstep."""

    def __init__(self, infos: Sequence[TensorInfo], dtypes: Sequence[torch.dtype], sources, outputs, stats,
                 error: BaseException | None = None):
        self.infos, self.dtypes, self.sources, self.outputs, self.stats = infos, dtypes, sources, outputs, stats
        self.budget, self.error = stats.budget_bytes, error
        self.rank, _ = _world()
        self.device = collective.device()
        self._window: tuple[int, int, int] | None = None
        self._window_flat: torch.Tensor | None = None
        self._window_bytes = 0
        self._retired = 0  # bytes of windows replaced this round: sends may still reference them
        self._window_pinned = False

    # -- reading ------------------------------------------------------------------------------
    def _release_window(self) -> None:
        if self._window_pinned:  # an isend of this round may still read it: freed at the round's end
            self._retired += self._window_bytes
        else:
            self.stats.unstage(self._window_bytes)
        self._window, self._window_flat, self._window_bytes, self._window_pinned = None, None, 0, False

    def _end_round(self, staged: int) -> None:
        self.stats.unstage(staged + self._retired)
        self._retired, self._window_pinned = 0, False

    def _rows(self, t: int, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of tensor t from this rank's source, flat (cached: the pieces of a row
        larger than the budget are cut from one read)."""
        if self._window == (t, r0, r1):
            return self._window_flat
        self._release_window()
        info, source = self.infos[t], self.sources[t]
        if source is None:
            raise CheckpointError(f"{info.label}: this rank holds no rows of it (planning error)")
        value = source.read(r0, r1)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{info.label}: source returned {type(value).__name__}, not a tensor")
        value = to_local(value)
        expected = tuple(info.shape) if not info.shape else (r1 - r0, *info.shape[1:])
        if tuple(value.shape) != expected or value.dtype != self.dtypes[t]:
            raise CheckpointError(f"{info.label}: source returned rows {r0}:{r1} as {tuple(value.shape)} "
                                  f"{value.dtype}, expected {expected} {self.dtypes[t]}")
        copied = not isinstance(source, (LocalPart, EagerSource))  # else a view of memory held anyway
        if not value.is_contiguous():
            value, copied = value.contiguous(), True
        flat = value.reshape(-1)
        self._window, self._window_flat = (t, r0, r1), flat
        self._window_bytes = flat.numel() * flat.element_size() if copied else 0
        self.stats.stage(self._window_bytes)
        return flat

    def _piece(self, m: Move) -> torch.Tensor:
        rn = self.infos[m.tensor].row_numel
        r0, r1 = m.start // rn, -(-m.stop // rn)
        return self._rows(m.tensor, r0, r1)[m.start - r0 * rn:m.stop - r0 * rn]

    # -- one round ----------------------------------------------------------------------------
    def run(self, rounds: Sequence[Sequence[Move]]) -> None:
        import torch.distributed as dist

        for moves in rounds:
            works, landings, staged = [], [], 0
            for tag, m in enumerate(moves):
                nbytes = (m.stop - m.start) * self.infos[m.tensor].itemsize
                if m.src == self.rank and m.dst == self.rank:
                    self._copy_local(m)
                    continue
                if m.src == self.rank:
                    buf, extra = self._send_buffer(m, nbytes)
                    post, peer, what = dist.isend, m.dst, f"sending to rank {m.dst}"
                    self.stats.messages_sent += 1
                    self.stats.bytes_sent += nbytes
                elif m.dst == self.rank:
                    buf, target, extra = self._recv_buffer(m, nbytes)
                    post, peer, what = dist.irecv, m.src, f"receiving from rank {m.src}"
                    landings.append((buf, target))
                    self.stats.messages_received += 1
                    self.stats.bytes_received += nbytes
                else:
                    continue
                staged += extra
                self.stats.largest_message = max(self.stats.largest_message, nbytes)
                try:  # a peer that is gone is a CheckpointError naming it
                    works.append((post(buf, peer, tag=tag), what, buf))  # buf: alive until the wait
                except RuntimeError as exc:
                    raise CheckpointError(f"transport: {what} failed: {exc}") from None
            for work, what, _ in works:
                _wait(work, what)
            for buf, target in landings:
                if target is not None:
                    target.copy_(buf.to(target.device))
            del works, landings
            if self._window_flat is not None and self._window_flat.nbytes <= self.budget:
                self._release_window()  # keep only a row larger than the budget: its next pieces need it
            self._end_round(staged)
            self.stats.rounds += 1
        self._release_window()
        self._end_round(0)

    def _send_buffer(self, m: Move, nbytes: int) -> tuple[torch.Tensor, int]:
        raw = None
        if self.error is None:
            try:
                piece = self._piece(m)
                self._window_pinned = True
                raw = piece.view(torch.uint8)
                if raw.device == self.device:
                    return raw, 0
                raw = raw.to(self.device)
            except Exception as exc:  # keep the protocol going; every rank raises after the data phase
                self.error, raw = exc, None
                self._release_window()
        self.stats.stage(nbytes)
        return (torch.zeros(nbytes, dtype=torch.uint8, device=self.device) if raw is None else raw), nbytes

    def _target(self, m: Move) -> torch.Tensor | None:
        out = self.outputs[m.tensor]
        if out is None:
            return None
        flat, first = out
        return flat[m.start - first:m.stop - first].view(torch.uint8)

    def _recv_buffer(self, m: Move, nbytes: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        target = self._target(m) if self.error is None else None
        if target is not None and target.device == self.device:
            return target, None, 0
        self.stats.stage(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device), target, nbytes

    def _copy_local(self, m: Move) -> None:
        if self.error is not None:
            return
        try:
            target = self._target(m)
            if target is not None:
                target.copy_(self._piece(m).view(torch.uint8))
            self.stats.local_copies += 1
        except Exception as exc:
            self.error = exc
            self._release_window()


def _move(infos, dtypes, sources, have, want, out_device, stats: TransportStats):
    """Plan, allocate this rank's outputs, run the rounds: ``(outputs, error)``, ``outputs[t]``
    the rows ``want[t][rank]`` (None where it wants nothing), ``error`` for the caller to agree on."""
    budget, (rank, _), error = stats.budget_bytes, _world(), None
    moves = plan_moves(infos, have, want, budget)  # deterministic: raises alike on every rank
    rounds = plan_rounds(moves, [i.itemsize for i in infos], budget)
    outputs: list[torch.Tensor | None] = [None] * len(infos)
    flats: list[tuple[torch.Tensor, int] | None] = [None] * len(infos)
    try:
        for t, info in enumerate(infos):
            span = want[t][rank]
            if span is not None:
                shape = (span[1] - span[0], *info.shape[1:]) if info.shape else ()
                outputs[t] = torch.empty(shape, dtype=dtypes[t], device=out_device)
                flats[t] = (outputs[t].reshape(-1), span[0] * info.row_numel)
    except Exception as exc:
        error, outputs, flats = exc, [None] * len(infos), [None] * len(infos)
    mover = _Mover(infos, dtypes, sources, flats, stats, error)
    mover.run(rounds)
    return outputs, mover.error


def _wait(work, what: str) -> None:
    seconds = collective.current_timeout()
    collective.wait_for(work, seconds, f"transport: {what} did not complete within {seconds:g} s", f"transport: {what} failed")


def _begin(operation: str, budget_bytes) -> TransportStats:
    global _LAST
    _LAST = TransportStats(operation=operation, budget_bytes=budget_bytes if isinstance(budget_bytes, int) else 0)
    return _LAST


# ===== gather =================================================================================
def _held(source, writers_only: bool) -> Range | None:
    """The rows this rank can send of a tensor (of a LocalPart: none unless it is their writer,
    for ``gather``; of a ``_Skeleton``: none)."""
    if isinstance(source, _Skeleton):
        return None
    if not isinstance(source, LocalPart):
        return (0, rows_and_row_numel(source.shape)[0])
    if writers_only and not source.writer:
        return None
    return (source.row_start, source.row_stop) if source.shape else (0, 1)


@collective.with_timeout
def gather(optimizer_or_state, dst: int = 0, *, model: torch.nn.Module | None = None,
           budget_bytes: int = DEFAULT_BUDGET) -> CanonicalState | None:
    """The canonical state assembled on rank ``dst`` (global, owned tensors); None elsewhere.

    ``optimizer_or_state``: a live optimizer (``model`` naming its parameters if needed) or a
    ``CanonicalState`` of ``LocalPart`` s from ``export_canonical``. Every row comes from its
    writer rank as views, in messages of at most ``budget_bytes``. All ranks pass the same ``dst``.
    """
    stats = _begin("gather", budget_bytes)
    rank, world = _world()
    error, ordered, payload = None, [], {}
    try:
        if not isinstance(dst, int) or not 0 <= dst < world:
            raise ValueError(f"dst must be a rank in [0, {world}), got {dst!r}")
        state = optimizer_or_state
        if not isinstance(state, CanonicalState):
            from gefen_ckpt.dist.optimizer_state import export_canonical

            state = export_canonical(optimizer_or_state, model=model)
        _, ordered, payload = _offer(state, budget_bytes, writers_only=True)
        payload["root"] = dst
    except Exception as exc:
        error = exc
    everyone = _agreed(payload, error, "gather", stats, root="dst ranks", digest=_DIFFERENT_STATES)
    infos = _infos(ordered)
    want = [[(0, info.rows) if r == dst else None for r in range(world)] for info in infos]
    outputs, error = _move(infos, [src.dtype for _, src in ordered], [src for _, src in ordered],
                           _ranges(everyone, "held", len(infos)), want, torch.device("cpu"), stats)
    result = None
    if rank == dst and error is None:
        try:
            gathered = {label: EagerSource(t) for (label, _), t in zip(ordered, outputs)}
            result = state.with_sources(lambda label, _: gathered[label])
        except Exception as exc:
            error = exc
    collective.agree(error, "gather")
    return result


# ===== scatter ================================================================================
@collective.with_timeout
def scatter(state, optimizer: torch.optim.Optimizer, src: int = 0, *, model: torch.nn.Module | None = None,
            budget_bytes: int = DEFAULT_BUDGET) -> None:
    """Load the ``CanonicalState`` held by rank ``src`` (e.g. ``gefen_ckpt.read(url)`` there, read
    chunk by chunk; ignored elsewhere) into ``optimizer`` on every rank. Each rank checks its
    description first and receives exactly the rows its import reads, in messages of at most
    ``budget_bytes``. Nothing changes unless every rank staged.
    """
    stats = _begin("scatter", budget_bytes)
    rank, world = _world()
    error, budget = None, 0
    try:
        budget = _check_budget(budget_bytes)
        if not isinstance(src, int) or not 0 <= src < world:
            raise ValueError(f"src must be a rank in [0, {world}), got {src!r}")
    except Exception as exc:
        error = exc
    _agreed({"budget": budget, "root": src}, error, "scatter", stats, root="src ranks")
    if rank == src:
        try:
            data = collective.pack({"description": _describe(state), "metadata": dict(state.metadata)})
        except Exception as exc:
            error = exc
            data = collective.pack({"error": collective.describe_error(exc)})
    received = collective.unpack(collective.broadcast_bytes(data if rank == src else None, src))
    if "error" in received:
        if error is not None:
            raise error
        raise CheckpointError(f"scatter: the state on rank {src} cannot be sent ({received['error']}); "
                              "nothing was changed on this rank")

    def described() -> CanonicalState:  # the other ranks hold none of its rows
        skeleton = _skeleton(received["description"])
        skeleton.metadata = received["metadata"]
        return skeleton

    _load("scatter", (lambda: state) if rank == src else described, optimizer, model, budget_bytes, stats)


# ===== redistribute ===========================================================================
@collective.with_timeout
def redistribute(state: CanonicalState, optimizer: torch.optim.Optimizer, *,
                 model: torch.nn.Module | None = None, budget_bytes: int = DEFAULT_BUDGET) -> None:
    """Load ``state`` (this rank's ``LocalPart`` s of a state exported on another layout over
    the same ranks) into ``optimizer`` (its own layout). Rows a rank holds are copied locally, the
    rest come from a holder (replicas share the sending) in messages of at most ``budget_bytes``;
    no rank materialises a whole tensor it does not own. Nothing changes unless every rank staged.
    """
    _load("redistribute", lambda: state, optimizer, model, budget_bytes, _begin("redistribute", budget_bytes))


def _load(what: str, local_state, optimizer, model, budget_bytes, stats: TransportStats) -> None:
    """Load the state whose rows the ranks hold (each rank's ``local_state()``: its rows, as
    ``LocalPart`` s, whole tensors or ``_Skeleton`` s for none) into ``optimizer`` on every rank."""
    error, state, skeleton, ordered, payload = None, None, None, [], {}
    try:
        state = local_state()
        description, ordered, payload = _offer(state, budget_bytes, writers_only=False)
        skeleton, payload["want"] = _wanted_rows(optimizer, description, model)
    except Exception as exc:
        error = exc
    everyone = _agreed(payload, error, what, stats, digest=_DIFFERENT_STATES)
    infos = _infos(ordered)
    want = _ranges(everyone, "want", len(infos))
    moved = _move(infos, [s.dtype for _, s in ordered], [s for _, s in ordered], _ranges(everyone, "held", len(infos)),
                  want, collective.device(), stats)
    _import(what, moved, optimizer, skeleton, state.metadata, want, model)
