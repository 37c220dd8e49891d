"""Live healing through torchft (docs/design.md, "Live healing"): ``GefenTransport`` is a torchft
``CheckpointTransport`` that sends a healthy replica's state dict to a rejoining replica over a
process group, pickle-free: a fixed header, one msgpack manifest (the tree with tensors by
number, per-tensor dtype runs, shapes and CRC-32s), the small tensors in one packed buffer, each
large one as its own message straight from its memory. A tensor reached from many places (the
shared codebooks) is sent once. The receiver checks the header, the manifest and every tensor's
CRC-32 before it returns the state, so a bad transfer never reaches ``load_state_dict``; a
DTensor travels as its local shard (rank i heals from rank i) and is checked against the
receiver's ``mesh`` before it is rebuilt there. torchft is an optional extra (``gefen[torchft]``):
only this module imports it.
"""

from __future__ import annotations

import gc
import itertools
import struct
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from gefen.distributed import is_dtensor
from gefen_ckpt.dist import collective
from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
)
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.dtypes import dtype_name, itemsize, torch_dtype

try:
    from torchft.checkpointing.transport import CheckpointTransport
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("gefen_ckpt.torchft_transport needs torchft: pip install 'gefen[torchft]'") from exc

__all__ = ["GefenTransport", "HealStats", "encode_state", "decode_state"]

FORMAT = "gefen-heal"
VERSION = 1
MAGIC = 0x4746454E48454131  # "GFENHEA1"
#: Tensors at most this large travel packed in one buffer; larger ones as their own message.
PACK_BYTES = 1 << 20
#: A manifest larger than this is refused before anything it describes is allocated.
MAX_MANIFEST_BYTES = 1 << 30
_HEADER = 5  # magic, version, step, manifest bytes, manifest crc
_TENSOR, _TUPLE, _DTYPE, _ORDERED, _SHARD = 1, 2, 3, 4, 5  # msgpack extension codes in the tree
_INDEX = struct.Struct("<I")


# ===== encoding (pure: no process group) ======================================================
@dataclass
class Encoded:
    """A state dict ready to send: the manifest bytes, the packed buffer, the large tensors."""

    manifest: bytes
    pack: torch.Tensor
    large: list[torch.Tensor]
    count: int
    large_crc: list[int]

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + self.pack.numel() + sum(t.numel() for t in self.large)


class _Collector:
    """msgpack's ``default`` hook: tensors become numbered references (each distinct one once:
    same memory, shape, strides, dtype), tuples, OrderedDicts and dtypes tagged extensions;
    anything else is refused, naming its type (no pickle on either side)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.seen: dict[tuple, int] = {}

    def __call__(self, value: Any):
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:  # the common case first
            return msgpack.ExtType(_TENSOR, _INDEX.pack(self.number(value)))
        if isinstance(value, torch.Tensor):
            if is_dtensor(value):
                return msgpack.ExtType(_SHARD, self.pack([self.number(value.to_local()), *shard_meta(value)]))
            if not isinstance(value, torch.nn.Parameter):
                raise CheckpointError(f"cannot send a {type(value).__name__} (send its local tensor)")
            return msgpack.ExtType(_TENSOR, _INDEX.pack(self.number(value)))
        if isinstance(value, tuple):
            return msgpack.ExtType(_TUPLE, self.pack(list(value)))
        if isinstance(value, OrderedDict):  # a module's state_dict: kept an OrderedDict
            return msgpack.ExtType(_ORDERED, self.pack(dict(value)))
        if isinstance(value, dict):  # other dict subclasses travel as dicts
            return dict(value)
        if isinstance(value, torch.dtype):
            return msgpack.ExtType(_DTYPE, dtype_name(value).encode())
        raise CheckpointError(f"cannot send a {type(value).__name__} value in a state dict (tensors and plain data only)")

    def number(self, value: torch.Tensor) -> int:
        """The tensor's number, a new one the first time this memory, shape, strides and dtype come."""
        key = (value.device, value.data_ptr(), value.shape, value.stride(), value.dtype)
        number = self.seen.get(key)
        if number is None:
            number = self.seen[key] = len(self.tensors)
            self.tensors.append(value.detach())
        return number

    def pack(self, value) -> bytes:
        return msgpack.packb(value, default=self, strict_types=True, use_bin_type=True)


# ===== DTensor shards =========================================================================
def _placement_wire(p) -> list:
    """A placement as plain data: ["R"], ["S", dim], ["s", dim, split factor], ["P", reduce op]."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return ["s", int(p.dim), int(p.split_factor)]
    if p.is_shard():
        return ["S", int(p.dim)]
    if p.is_replicate():
        return ["R"]
    if p.is_partial():
        return ["P", str(p.reduce_op)]
    raise CheckpointError(f"cannot send a DTensor placed {p!r}")


def _placement(wire, ndim: int):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kind = wire[0] if isinstance(wire, list) and wire else None
    dims_ok = all(type(d) is int and 0 <= d for d in wire[1:2]) if kind in ("S", "s") else True
    if kind == "R" and len(wire) == 1:
        return Replicate()
    if kind == "S" and len(wire) == 2 and dims_ok and wire[1] < ndim:
        return Shard(wire[1])
    if kind == "s" and len(wire) == 3 and dims_ok and wire[1] < ndim and type(wire[2]) is int and wire[2] > 0:
        return _StridedShard(wire[1], split_factor=wire[2])
    if kind == "P" and len(wire) == 2 and wire[1] in ("sum", "avg", "max", "min"):
        return Partial(wire[1])
    _fail(f"malformed placement {wire!r}")


def shard_meta(d) -> list:
    """What identifies a DTensor's local shard: global shape, placements, the shard's offset in
    the global tensor, and the mesh's shape and dimension names."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
    names = d.device_mesh.mesh_dim_names
    return [list(d.shape), [_placement_wire(p) for p in d.placements], list(offset),
            list(d.device_mesh.shape), list(names) if names else None]


class _Shard(NamedTuple):
    """A received DTensor before it is checked against and placed on the receiver's mesh."""

    local: torch.Tensor
    shape: list
    placements: list
    offset: list
    mesh: list
    names: list | None


def _int_list(value, what: str) -> list:
    if not (isinstance(value, list) and all(type(v) is int and 0 <= v < 2**40 for v in value)):
        _fail(f"DTensor {what} is malformed")
    return value


def _shard(payload: list, tensors: list[torch.Tensor]) -> _Shard:
    if not (isinstance(payload, list) and len(payload) == 6 and type(payload[0]) is int
            and 0 <= payload[0] < len(tensors) and isinstance(payload[2], list)):
        _fail("malformed DTensor entry")
    names = payload[5]
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        _fail("malformed DTensor mesh names")
    return _Shard(tensors[payload[0]], _int_list(payload[1], "shape"), payload[2], _int_list(payload[3], "offset"),
                  _int_list(payload[4], "mesh shape"), names)


def _target_mesh(mesh, shard: _Shard, where: str):
    """The receiver's mesh for ``shard``: ``mesh`` itself, or its submesh of the sender's names."""
    if mesh is None:
        raise CheckpointMismatchError(f"{where} is a DTensor shard: give this replica's GefenTransport its "
                                      "device mesh (mesh=) to place it on; nothing was applied")
    names = tuple(shard.names) if shard.names else None
    if names and mesh.mesh_dim_names and names != tuple(mesh.mesh_dim_names):
        if not set(names) <= set(mesh.mesh_dim_names):
            raise CheckpointMismatchError(f"{where}: the sender's mesh dimensions {names} are not in this "
                                          f"replica's mesh {tuple(mesh.mesh_dim_names)}; nothing was applied")
        mesh = mesh[names]
    if list(mesh.shape) != shard.mesh:
        raise CheckpointMismatchError(f"{where}: the sender's mesh has shape {tuple(shard.mesh)}, this replica's "
                                      f"{tuple(mesh.shape)}; nothing was applied")
    return mesh


def _place_shard(shard: _Shard, mesh, where: str):
    """The DTensor of ``shard`` on this replica's mesh, once its global shape, placements and
    offset are exactly the part this rank holds there (rank i heals from rank i)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    target = _target_mesh(mesh, shard, where)
    if len(shard.placements) != len(shard.mesh):
        _fail(f"{where}: {len(shard.placements)} placements on a {len(shard.mesh)}-D mesh")
    placements = [_placement(p, len(shard.shape)) for p in shard.placements]
    local_shape, offset = compute_local_shape_and_global_offset(shard.shape, target, placements)
    got = (tuple(shard.local.shape), tuple(shard.offset))
    if got != (tuple(local_shape), tuple(offset)):
        raise CheckpointMismatchError(
            f"{where}: the sender's shard of the {tuple(shard.shape)} tensor placed {tuple(placements)} has shape "
            f"{got[0]} at offset {got[1]}, this rank's part is {tuple(local_shape)} at {tuple(offset)} (heal rank i "
            "from the healthy replica's rank i, on the same mesh); nothing was applied")
    stride = torch.empty(shard.shape, device="meta").stride()
    return DTensor.from_local(shard.local, target, placements, run_check=False, shape=torch.Size(shard.shape),
                              stride=stride)


def _place(node, mesh, where: str):
    """``node`` with every received shard rebuilt as a DTensor on ``mesh`` (containers rebuilt
    alike, other values as they are)."""
    if isinstance(node, _Shard):
        return _place_shard(node, mesh, where)
    if isinstance(node, dict):
        return type(node)((k, _place(v, mesh, f"{where}[{k!r}]")) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return type(node)(_place(v, mesh, f"{where}[{i}]") for i, v in enumerate(node))
    return node


@contextmanager
def _gc_paused():
    """Thousands of small tensors make thousands of objects: the cyclic collector would stop the
    transfer for 10-100 ms to find no garbage among them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The small tensors' bytes end to end: one concatenation per run of one dtype, then their bytes."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    runs = [torch.cat([t.cpu().reshape(-1) for t in run]).view(torch.uint8)
            for _, run in itertools.groupby(tensors, key=lambda t: t.dtype)]
    return torch.cat(runs) if len(runs) > 1 else runs[0]


def _order(tensors: list[torch.Tensor], pack_bytes: int) -> tuple[list[int], int]:
    """Send order and how many are packed: the packed ones first, by element size then dtype
    (so each lies aligned in the buffer), then the large ones."""
    small, large = [], []
    for i, t in enumerate(tensors):
        (small if t.numel() * t.element_size() <= pack_bytes else large).append(i)
    small.sort(key=lambda i: (-tensors[i].element_size(), str(tensors[i].dtype)))
    return small + large, len(small)


def _runs(dtypes: list[str], packed: int) -> list[list]:
    """[dtype, count, packed] for each run of consecutive pieces alike."""
    alike = itertools.groupby((name, j < packed) for j, name in enumerate(dtypes))
    return [[name, sum(1 for _ in run), inside] for (name, inside), run in alike]


def encode_state(state_dict: Any, step: int, *, pack_bytes: int = PACK_BYTES, hash_large: bool = True) -> Encoded:
    """The manifest, packed buffer and large tensors of ``state_dict``, each tensor checksummed
    (the large ones only with ``hash_large``: the transport hashes each while it is sent)."""
    collect = _Collector()
    with _gc_paused():
        tree = collect.pack(state_dict)
        order, packed = _order(collect.tensors, pack_bytes)
        ordered = [collect.tensors[i] for i in order]
        pack = _packed(ordered[:packed])
    crcs = _packed_crcs(pack, np.fromiter((t.nbytes for t in ordered[:packed]), np.int64, packed))
    shapes = [t.shape for t in ordered]
    # the pieces in send order as columns: [dtype, count, packed] runs, shapes, the packed ones'
    # CRC-32s (the large ones' travel in the trailer), each piece's number in the tree
    manifest = msgpack.packb({
        "format": FORMAT, "version": VERSION, "step": int(step), "tree": tree,
        "runs": _runs([dtype_name(t.dtype) for t in ordered], packed),
        "ndim": np.fromiter((len(s) for s in shapes), "<u1", len(shapes)).tobytes(),
        "dims": np.fromiter((d for s in shapes for d in s), "<i8").tobytes(),
        "crc": np.asarray(crcs, "<u4").tobytes(), "index": np.asarray(order, "<u4").tobytes(),
        "pack": int(pack.numel())}, use_bin_type=True)
    large = [t.cpu().reshape(-1).view(torch.uint8) for t in ordered[packed:]]  # views: sent from their own memory
    return Encoded(manifest, pack, large, len(ordered), [_crc(t) for t in large] if hash_large else [])


def _crc(t: torch.Tensor) -> int:
    return checksum.update(0, t.numpy())


def _fail(message: str):
    raise CheckpointFormatError(f"heal manifest: {message}"[:400])


def _column(raw: dict, key: str, dtype: str, count: int | None) -> np.ndarray:
    data = raw.get(key)
    size = np.dtype(dtype).itemsize
    if not isinstance(data, bytes) or len(data) % size or (count is not None and len(data) != count * size):
        _fail(f"column {key!r} is missing or of the wrong length")
    return np.frombuffer(data, dtype)


class Parsed(NamedTuple):
    """A validated manifest: per piece (send order) dtype, shape, bytes; the packed ones' CRCs."""

    dtypes: list[str]
    packed: int
    shapes: list[tuple[int, ...]]
    nbytes: np.ndarray
    crc: np.ndarray
    index: np.ndarray
    pack: int
    tree: bytes


def _check_runs(runs, bound: int) -> tuple[list[str], int]:
    """Each piece's dtype and how many are packed; at most ``bound`` pieces (the manifest's size)."""
    if not isinstance(runs, list):
        _fail("no runs")
    dtypes: list[str] = []
    packed = 0
    for k, run in enumerate(runs):
        if not (isinstance(run, list) and len(run) == 3 and isinstance(run[0], str) and type(run[1]) is int
                and 0 < run[1] <= bound - len(dtypes) and isinstance(run[2], bool)):
            _fail(f"run {k} is malformed, or more pieces than the manifest has bytes")
        torch_dtype(run[0], f"heal manifest: run {k}")
        if run[2]:
            if packed != len(dtypes):
                _fail(f"run {k}: packed pieces after unpacked ones")
            packed += run[1]
        dtypes += [run[0]] * run[1]
    return dtypes, packed


def parse_manifest(data: bytes, step: int) -> Parsed:
    """The manifest's pieces, validated (sizes, shapes, offsets, counts) before anything is allocated."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=len(data))
    except Exception as exc:
        _fail(f"not msgpack ({exc})")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        _fail(f"not a {FORMAT} v{VERSION} manifest")
    if raw.get("step") != step:
        raise CheckpointError(f"heal: the sender is at step {raw.get('step')}, the receiver expects step {step}")
    dtypes, packed = _check_runs(raw.get("runs"), len(data))
    n, pack, tree = len(dtypes), raw.get("pack"), raw.get("tree")
    if type(pack) is not int or pack < 0 or not isinstance(tree, bytes):
        _fail("missing or malformed pack / tree")
    ndim = _column(raw, "ndim", "<u1", n).astype(np.int64)
    dims = _column(raw, "dims", "<i8", int(ndim.sum()))
    crc, index = _column(raw, "crc", "<u4", packed), _column(raw, "index", "<u4", n)
    if (dims < 0).any() or (dims >= 2**40).any() or (index >= n).any() or len(np.unique(index)) != n:
        _fail("a dimension is out of range, or the tree numbers are not a permutation")
    owner = np.repeat(np.arange(n), ndim)
    numel = np.ones(n, np.float64)
    np.multiply.at(numel, owner, dims.astype(np.float64))
    sizes = np.fromiter((itemsize(d) for d in dtypes), np.int64, n)
    if (numel * sizes > 2**50).any():
        _fail("a tensor is impossibly large")
    nbytes = numel.astype(np.int64) * sizes
    starts = np.cumsum(nbytes[:packed]) - nbytes[:packed]
    if int(nbytes[:packed].sum()) != pack or (starts % sizes[:packed]).any():
        _fail(f"the packed pieces do not tile the {pack}-byte buffer aligned")
    cuts = np.cumsum(ndim).tolist()
    flat = dims.tolist()
    shapes = [tuple(flat[a:b]) for a, b in zip([0, *cuts[:-1]], cuts)]
    return Parsed(dtypes, packed, shapes, nbytes, crc, index, pack, tree)


def _packed_crcs(pack: torch.Tensor, sizes: np.ndarray) -> list[int]:
    """The CRC-32 of each packed piece (``sizes``: their bytes, end to end in ``pack``)."""
    return checksum.of_ranges(pack.numpy(), (np.cumsum(sizes) - sizes).tolist(), sizes.tolist()) if len(sizes) else []


def _tensors(p: Parsed, pack: torch.Tensor, large: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every piece as a tensor of its dtype and shape, viewing the received bytes (tree order)."""
    flat: list[torch.Tensor] = []
    at = j = 0
    for name, run in itertools.groupby(p.dtypes[:p.packed]):  # consecutive pieces of one dtype: one split
        sizes = p.nbytes[j:j + sum(1 for _ in run)]
        span = int(sizes.sum())
        flat += pack[at:at + span].view(torch_dtype(name)).split((sizes // itemsize(name)).tolist())
        at, j = at + span, j + len(sizes)
    flat += [t.view(torch_dtype(p.dtypes[p.packed + k])) for k, t in enumerate(large)]
    out: list[torch.Tensor] = [None] * len(flat)  # type: ignore[list-item]
    for t, shape, number in zip(flat, p.shapes, p.index.tolist()):
        out[number] = t if len(shape) == 1 else t.reshape(shape)
    return out


def decode_state(data: bytes, step: int, pack: torch.Tensor, large: list[torch.Tensor], large_crc: list[int],
                 peer: str = "the sender", mesh=None):
    """The state dict of a transfer (manifest, packed buffer, large tensors, their CRCs as sent):
    every CRC is checked before the tree is rebuilt (DTensor shards on ``mesh``)."""
    parsed = parse_manifest(data, step)
    if pack.numel() != parsed.pack or [t.numel() for t in large] != parsed.nbytes[parsed.packed:].tolist():
        raise CheckpointCorruptError(f"heal from {peer}: the received buffers do not match the manifest")
    got = _packed_crcs(pack, parsed.nbytes[:parsed.packed]) + [_crc(t) for t in large]
    return _unpack_tree(parsed, pack, large, got, large_crc, mesh, peer)


def _unpack_tree(parsed: Parsed, pack: torch.Tensor, large: list[torch.Tensor], got: list[int], large_crc,
                 mesh, peer: str):
    """The state dict the manifest describes, once every tensor's CRC-32 (``got``) matched the
    sender's (the manifest's, then ``large_crc``); DTensor shards checked and placed on ``mesh``."""
    want = np.concatenate([parsed.crc.astype(np.int64), np.asarray(large_crc, np.int64)])
    bad = np.flatnonzero(np.asarray(got, np.int64) != want) if len(got) == len(want) else [len(got)]
    if len(bad):
        raise CheckpointCorruptError(f"heal from {peer}: {len(bad)} tensor(s) failed their CRC-32 "
                                     f"(first: piece {int(bad[0])}); nothing was applied")
    shards = []

    def hook(code: int, payload: bytes):
        if code == _TENSOR and len(payload) == _INDEX.size and _INDEX.unpack(payload)[0] < len(tensors):
            return tensors[_INDEX.unpack(payload)[0]]
        if code == _SHARD:
            shards.append(_shard(unpack(payload), tensors))
            return shards[-1]
        if code == _TUPLE:
            return tuple(unpack(payload))
        if code == _ORDERED:
            return OrderedDict(unpack(payload))
        if code == _DTYPE:
            return torch_dtype(payload.decode(errors="replace"), "heal manifest")
        _fail(f"unknown or out-of-range tree entry (extension {code})")

    def unpack(payload: bytes):
        return msgpack.unpackb(payload, ext_hook=hook, raw=False, strict_map_key=False, max_bin_len=len(payload))

    with _gc_paused():
        tensors = _tensors(parsed, pack, large)  # the hook's
        try:
            state = unpack(parsed.tree)
        except CheckpointError:
            raise
        except Exception as exc:
            _fail(f"tree does not decode ({exc})")
        return _place(state, mesh, f"heal from {peer}: state") if shards else state


# ===== the transport ==========================================================================
@dataclass
class HealStats:
    """What the last send / receive moved: bytes on the wire, messages, tensors, seconds."""

    bytes: int = 0
    messages: int = 0
    tensors: int = 0
    seconds: float = 0.0


class GefenTransport(CheckpointTransport):
    """torchft ``CheckpointTransport`` over a process group (torchft's or a torch
    ``ProcessGroup``: anything with ``send`` / ``recv(tensors, rank, tag)``), on CPU tensors.

    ``pack_bytes``: tensors up to this size travel in the one packed buffer. ``mesh``: the
    replica group's device mesh (FSDP2, tensor parallel), where received DTensor shards are
    checked and rebuilt; its own ranks heal from the same ranks of the healthy group. ``timeout``
    is unused (torchft's signature): the one each transfer is passed bounds it, not each message.
    """

    #: Message tags of one transfer: header, manifest, packed buffer, the large tensors' CRC-32s
    #: (hashed while they are sent), then one per large tensor.
    HEADER_TAG, MANIFEST_TAG, PACKED_TAG, TRAILER_TAG, LARGE_TAG = 1000, 1001, 1002, 1003, 1004

    def __init__(self, pg, timeout: timedelta = timedelta(seconds=60), *, pack_bytes: int = PACK_BYTES,
                 mesh=None) -> None:
        self._pg = pg
        self._pack_bytes = pack_bytes
        self._mesh = mesh
        self.last_send = HealStats()
        self.last_recv = HealStats()

    def metadata(self) -> str:
        return f"{FORMAT}/{VERSION}"

    def disallow_checkpoint(self) -> None:
        """Sends complete inside ``send_checkpoint``: the state may be mutated once it returns."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to release: the process group belongs to the caller."""

    def _wait(self, work, deadline: float, total: float, what: str, peer: str) -> None:
        """Wait for ``work`` until ``deadline`` (monotonic): ``total`` seconds bound the whole transfer."""
        collective.wait_for(work, deadline - time.monotonic(), f"heal: {peer} did not complete the {what} within {total:g}s",
                 f"heal: the {what} with {peer} failed")

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: timedelta) -> None:
        start = time.perf_counter()
        total = timeout.total_seconds()
        deadline = time.monotonic() + total
        enc = encode_state(state_dict, step, pack_bytes=self._pack_bytes, hash_large=False)
        header = torch.tensor([MAGIC, VERSION, step, len(enc.manifest), checksum.update(0, enc.manifest)],
                              dtype=torch.int64)
        manifest = torch.frombuffer(bytearray(enc.manifest), dtype=torch.uint8)
        for dst in dst_ranks:
            peer = f"replica rank {dst}"
            works = [(self._pg.send([m], dst, tag), tag) for m, tag in
                     ((header, self.HEADER_TAG), (manifest, self.MANIFEST_TAG), (enc.pack, self.PACKED_TAG)) if m.numel()]
            for k, t in enumerate(enc.large):
                works.append((self._pg.send([t], dst, self.LARGE_TAG + k), self.LARGE_TAG + k))
                if len(enc.large_crc) == k:
                    enc.large_crc.append(_crc(t))  # while the gloo thread sends it
            trailer = torch.tensor(enc.large_crc, dtype=torch.int64)
            if trailer.numel():
                works.append((self._pg.send([trailer], dst, self.TRAILER_TAG), self.TRAILER_TAG))
            for work, tag in works:
                self._wait(work, deadline, total, f"send of message {tag - self.HEADER_TAG}", peer)
        sent = header.nbytes + enc.nbytes + 8 * len(enc.large_crc)
        self.last_send = HealStats(sent * len(dst_ranks), (3 + len(enc.large) + bool(enc.large)) * len(dst_ranks),
                                   enc.count, time.perf_counter() - start)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        start = time.perf_counter()
        total = timeout.total_seconds()
        deadline = time.monotonic() + total
        peer = f"replica rank {src_rank}"
        if metadata != self.metadata():
            raise CheckpointError(f"heal: {peer} speaks {metadata!r}, this replica {self.metadata()!r}")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self._wait(self._pg.recv([header], src_rank, self.HEADER_TAG), deadline, total, "header", peer)
        magic, version, sent_step, length, crc = header.tolist()
        if magic != MAGIC or version != VERSION or not 0 < length <= MAX_MANIFEST_BYTES:
            raise CheckpointCorruptError(f"heal from {peer}: bad header {header.tolist()}")
        if sent_step != step:
            raise CheckpointError(f"heal: {peer} sent step {sent_step}, this replica expects step {step}")
        manifest = torch.empty(length, dtype=torch.uint8)
        self._wait(self._pg.recv([manifest], src_rank, self.MANIFEST_TAG), deadline, total, "manifest", peer)
        data = manifest.numpy().tobytes()
        if checksum.update(0, data) != crc:
            raise CheckpointCorruptError(f"heal from {peer}: the manifest failed its CRC-32; nothing was applied")
        parsed = parse_manifest(data, step)
        pack, large, got, large_crc = self._receive(parsed, src_rank, deadline, total, peer)
        # every message is in: a bad piece leaves the process group clean for the Manager's retry
        state = _unpack_tree(parsed, pack, large, got, large_crc, self._mesh, peer)
        self.last_recv = HealStats(header.nbytes + length + parsed.pack + sum(t.numel() for t in large) + 8 * len(large),
                                   3 + len(large) + bool(large), len(parsed.dtypes), time.perf_counter() - start)
        return state

    def _receive(self, parsed: Parsed, src: int, deadline: float, total: float, peer: str):
        """The packed buffer and the large tensors, each hashed as soon as it is in (while the
        next arrives); returns them, their hashes and the sender's of the large ones."""
        pack = torch.empty(parsed.pack, dtype=torch.uint8)
        large = [torch.empty(n, dtype=torch.uint8) for n in parsed.nbytes[parsed.packed:].tolist()]
        trailer = torch.zeros(len(large), dtype=torch.int64)
        work_pack = self._pg.recv([pack], src, self.PACKED_TAG) if pack.numel() else None
        work_large = [self._pg.recv([t], src, self.LARGE_TAG + k) for k, t in enumerate(large)]
        work_trailer = self._pg.recv([trailer], src, self.TRAILER_TAG) if large else None
        if work_pack is not None:
            self._wait(work_pack, deadline, total, "packed buffer", peer)
        got = _packed_crcs(pack, parsed.nbytes[:parsed.packed])
        for k, (work, t) in enumerate(zip(work_large, large)):
            self._wait(work, deadline, total, f"large tensor {k}", peer)
            got.append(_crc(t))
        if work_trailer is not None:
            self._wait(work_trailer, deadline, total, "checksum trailer", peer)
        return pack, large, got, trailer.numpy()
