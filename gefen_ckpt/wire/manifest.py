"""The manifest: schema, strict validation, and msgpack encoding (``docs/format.md``).

``validate`` checks everything a reader acts on (types, ranges, shapes against the contract,
file bounds, every row stored exactly once) *before* anything it describes is allocated, so a
hostile manifest costs no more memory than the files it points at. Unknown keys are ignored:
minor versions may add optional keys."""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from gefen.contract import DIMENSION_FIELDS, LIKE_PARAM, SCHEMA_VERSION, OptimizerContract
from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    naming,
)
from gefen_ckpt.state.canonical import CanonicalState, ParamState, global_key
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.datafile import ALIGNMENT
from gefen_ckpt.wire.dtypes import DTYPES, dtype_name, plain
from gefen_ckpt.wire.index import (
    MAX_INDEX_BYTES,
    IndexSet,
    SplitTensor,
    WriterPin,
    parse_rules,
    parse_split,
)
from gefen_ckpt.wire.records import DECODING, MAX_STR, fail

if TYPE_CHECKING:  # reading a manifest needs no torch
    from gefen_ckpt.io.storage import Store
    from gefen_ckpt.state.canonical import CanonicalState

FORMAT_NAME = "gefen-ckpt"
#: (major, minor) of the format written; a reader accepts any minor of its major (minor versions
#: only add optional keys) and refuses every other major.
FORMAT_VERSION = (2, 0)
#: The ``__metadata__`` of every data file's safetensors header.
FILE_METADATA = {"format": FORMAT_NAME, "version": ".".join(map(str, FORMAT_VERSION))}
MANIFEST_NAME = "manifest.msgpack"
LAYOUTS = ("canonical", "sharded")
MAX_MANIFEST_BYTES = 256 * 2**20
#: The last key of the manifest's top-level map: CRC-32 of every byte before its 4-byte value,
#: which is always encoded as a msgpack uint32 (0xce), so the manifest ends with ``_TRAILER``
#: and 4 bytes.
MANIFEST_CHECKSUM = "manifest_checksum"
_TRAILER = msgpack.packb(MANIFEST_CHECKSUM) + b"\xce"
#: Decoding limits (docs/format.md, "Decoding limits"). Each container (map or array) of a real
#: manifest takes ~16 bytes or more (a tensor field: its key, map and shape in ~32 bytes); one per
#: ``_BYTES_PER_CONTAINER`` is admitted, which keeps the decoded objects of any manifest within
#: ``DECODE_MEMORY_FACTOR`` x its size (measured by tests/ckpt/test_ckpt_reliability.py on the
#: worst shapes: tiny maps, short strings, nils).
_BYTES_PER_CONTAINER = 16
DECODE_MEMORY_FACTOR = 32
_MAX_INT = 2**62
_MAX_NDIM = 16
_MAX_DEPTH = 24
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_FILE_NAMES = re.compile(rf"(?:{_FILE_NAME.pattern}\n)*{_FILE_NAME.pattern}")  # names joined by newlines


# ----- records ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileRecord:
    name: str
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """A validated manifest: the decoded map plus the parsed records a reader needs."""

    raw: dict
    contract: OptimizerContract
    files: tuple[FileRecord, ...]  # every writer's data files
    tensors: dict[tuple[str | None, str], SplitTensor]
    writers: tuple[WriterPin, ...]
    indexes: IndexSet  # resolves each tensor's pieces through the writers' indexes

    @property
    def index_files(self) -> tuple[FileRecord, ...]:
        return tuple(FileRecord(w.index, w.index_bytes) for w in self.writers)

    def state(self, sources: dict, dtype: Callable[[str], object] = str) -> CanonicalState:
        """The checkpoint as a ``CanonicalState`` whose tensors are ``sources`` (keyed like
        ``tensors``) and parameter dtypes ``dtype(name)``: torch's for a loader, the format's own
        names for the torch-free tools."""
        raw = self.raw
        params = {fqn: ParamState(tuple(e["shape"]), dtype(e["dtype"]),
                                  {name: sources[(fqn, name)] for name in e["fields"]}, e.get("child"))
                  for fqn, e in raw["params"].items()}
        metadata = {**raw.get("metadata", {}), "source_topology": raw.get("topology", {}), "created": raw.get("created", {})}
        return CanonicalState(self.contract, [dict(g, params=list(g["params"])) for g in raw["param_groups"]], params,
                              {key: sources[(None, key)] for key in raw["globals"]}, metadata)


# ----- encoding -----------------------------------------------------------------------------
def encode(manifest: dict) -> bytes:
    """msgpack, with the manifest's own checksum as the last key (any old one is replaced)."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    data = bytearray(msgpack.packb({**body, MANIFEST_CHECKSUM: 0xFFFFFFFF}, use_bin_type=True))
    data[-4:] = checksum.update(0, memoryview(data)[:-4]).to_bytes(4, "big")
    return bytes(data)


def has_checksum(data: bytes) -> bool:
    return data[-4 - len(_TRAILER):-4] == _TRAILER


def _checksum_differs(data: bytes) -> bool:
    """Does a manifest that ends with its checksum not match it?"""
    return has_checksum(data) and checksum.update(0, memoryview(data)[:-4]) != int.from_bytes(data[-4:], "big")


def decode(data: bytes) -> dict:
    """msgpack -> dict; any malformation (bad bytes, non-str keys, ext types, a wrong checksum,
    sizes over the decoding limits) is a format error, raised before the objects it describes
    exceed ``DECODE_MEMORY_FACTOR`` x its size."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    checked = has_checksum(data)
    if _checksum_differs(data):
        raise CheckpointFormatError("manifest checksum mismatch: the manifest is corrupt")
    budget = [1 + len(data) // _BYTES_PER_CONTAINER]

    def count(container):
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"more than one map or array per {_BYTES_PER_CONTAINER} bytes (a real manifest "
                             "has far fewer)")
        return container

    try:
        raw = msgpack.unpackb(data, object_hook=count, list_hook=count, **DECODING)
    except Exception as exc:  # msgpack raises many types (ValueError, StackError, ExtraData, ...)
        raise CheckpointFormatError(f"manifest is not valid msgpack: {type(exc).__name__}: {exc}"[:500]) from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"manifest is a msgpack {type(raw).__name__}, not a map")
    check_version(raw)
    if not checked:
        raise CheckpointFormatError(f"manifest version {raw['version']} must end with its checksum "
                                    f"({MANIFEST_CHECKSUM}), which is missing: the manifest is damaged")
    return raw


# ----- validation helpers -------------------------------------------------------------------
def _map(x, path: str, required: tuple[str, ...] = ()) -> dict:
    if not isinstance(x, dict):
        fail(path, f"expected a map, got {type(x).__name__}")
    for key in required:
        if key not in x:
            fail(path, f"missing key {key!r}")
    return x


def _list(x, path: str) -> list:
    if not isinstance(x, list):
        fail(path, f"expected an array, got {type(x).__name__}")
    return x


def _int(x, path: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(x) is not int or not lo <= x <= hi:
        fail(path, f"expected an integer in [{lo}, {hi}], got {x!r}"[:200])
    return x


def _str(x, path: str) -> str:
    if not isinstance(x, str) or not x or len(x) > MAX_STR:
        fail(path, f"expected a non-empty string, got {type(x).__name__}")
    return x


def _free(x, path: str, depth: int = 0):
    """Free-form plain data (informational fields, hyperparameters), depth-limited."""
    if depth > _MAX_DEPTH:
        fail(path, "nested too deeply")
    if isinstance(x, list):
        for i, v in enumerate(x):
            _free(v, f"{path}[{i}]", depth + 1)
    elif isinstance(x, dict):
        for k, v in x.items():
            _free(v, f"{path}.{k}", depth + 1)
    elif not (x is None or isinstance(x, (bool, int, float, str))):
        fail(path, f"unexpected {type(x).__name__} value")
    return x


def _dtype_shape(x: dict, path: str) -> tuple[str, tuple[int, ...]]:
    """The ``dtype`` and ``shape`` of a parameter or tensor entry (a map with both keys)."""
    dtype, dims = x["dtype"], x["shape"]
    if not (isinstance(dtype, str) and dtype in DTYPES):
        fail(f"{path}.dtype", f"unknown dtype {dtype!r}"[:200])
    if not (isinstance(dims, list) and len(dims) <= _MAX_NDIM and all(type(d) is int and 0 <= d <= _MAX_INT for d in dims)):
        if len(_list(dims, f"{path}.shape")) > _MAX_NDIM:
            fail(f"{path}.shape", f"{len(dims)} dimensions (at most {_MAX_NDIM})")
        for i, d in enumerate(dims):
            _int(d, f"{path}.shape[{i}]")
    if math.prod(dims) > _MAX_INT:
        fail(f"{path}.shape", "too many elements")
    return dtype, tuple(dims)


# ----- validation ---------------------------------------------------------------------------
def check_version(raw: dict) -> None:
    fmt = raw.get("format")
    if fmt != FORMAT_NAME:
        raise CheckpointFormatError(f"not a {FORMAT_NAME} manifest (format {fmt!r})"[:300])
    version = raw.get("version")
    if not (isinstance(version, list) and len(version) == 2 and all(type(v) is int for v in version)):
        raise CheckpointFormatError(f"manifest version {version!r} is not [major, minor]"[:300])
    major, minor = version
    reads = f"{FORMAT_VERSION[0]}.x"
    if major > FORMAT_VERSION[0]:
        raise CheckpointFormatError(
            f"checkpoint format version {major}.{minor} is newer than this gefen_ckpt reads "
            f"({reads}): upgrade gefen to load it"
        )
    if major != FORMAT_VERSION[0]:
        raise CheckpointFormatError(f"checkpoint format version {major}.{minor} is not supported "
                                    f"(this gefen_ckpt reads {reads} only)")


def parse_contract(raw, what: str) -> OptimizerContract:
    """``OptimizerContract.from_dict`` of stored data (a manifest's, a DCP description's, a torch
    file's record); anything wrong with it is a format error naming ``what``."""
    try:
        return OptimizerContract.from_dict(raw)
    except Exception as exc:  # a hostile contract can fail in many ways; all are format errors
        raise CheckpointFormatError(f"{what}: {exc}"[:500]) from None


def names_optimizer(name: str, implementation: str) -> bool:
    """Does ``name`` name the optimizer ``implementation`` (a contract's), in full or short, in any
    case (``adamw``, ``GefenMuonHybrid``, ``torch.optim.SGD``)?"""
    return name.lower() in (implementation.lower(), implementation.rsplit(".", 1)[-1].lower())


def _contract(x) -> OptimizerContract:
    _free(_map(x, "contract"), "contract")
    contract = parse_contract(x, "manifest contract")
    if contract.schema_version > SCHEMA_VERSION:
        fail("contract.schema_version", f"canonical-state schema {contract.schema_version} is newer than this "
                                        f"gefen_ckpt reads ({SCHEMA_VERSION}): upgrade gefen to load it")
    return contract


def missing_fields(leaf: OptimizerContract, present: Iterable[str], shape: Sequence[int] | None = None) -> list[str]:
    """The required per-parameter fields of ``leaf`` absent from ``present``: the non-optional
    ones, and for a layout whose fields depend on the parameter's dimensions
    (``DIMENSION_FIELDS``) those of a parameter of ``shape``. The one home of this rule for
    manifests (``validate``), live imports (``exchange``) and torch state_dicts."""
    have = set(present)
    required = {f.name for f in leaf.fields if not f.optional}
    by_dims = DIMENSION_FIELDS.get((leaf.implementation, leaf.version))
    if by_dims is not None and shape is not None:
        required.update(by_dims[0] if len(shape) >= 2 else by_dims[1])
    return sorted(required - have)


def _groups(x) -> dict[str, str | None]:
    """FQN -> owning child, for every FQN of every group."""
    owner: dict[str, str | None] = {}
    for i, g in enumerate(_list(x, "param_groups")):
        path = f"param_groups[{i}]"
        _free(_map(g, path, ("params",)), path)
        child = g.get("child")
        if child is not None:
            _str(child, f"{path}.child")
        for j, fqn in enumerate(_list(g["params"], f"{path}.params")):
            _str(fqn, f"{path}.params[{j}]")
            if fqn in owner:
                fail(f"{path}.params[{j}]", f"parameter {fqn!r} is in two groups"[:300])
            owner[fqn] = child
    return owner


def _spec(contract: OptimizerContract, child: str | None, field: str, path: str):
    try:
        return contract.leaf(child).field(field)
    except KeyError as exc:
        fail(path, str(exc)[:300])


def _head(raw: dict) -> tuple[OptimizerContract, dict[str, str | None]]:
    """Top-level keys, layout, informational maps, the contract and the param groups (FQN ->
    owning child)."""
    _map(raw, "", ("layout", "world_size", "contract", "param_groups", "writers", "rules", "globals", "params"))
    if raw["layout"] not in LAYOUTS:
        fail("layout", f"{raw['layout']!r} is not one of {LAYOUTS}"[:300])
    _int(raw["world_size"], "world_size", 1, 2**31)
    _int(raw.get("alignment", ALIGNMENT), "alignment", 1, 2**30)
    if raw.get("checksum", checksum.ALGORITHM) != checksum.ALGORITHM:
        fail("checksum", f"unsupported algorithm {raw['checksum']!r}"[:300])
    for key in ("topology", "created", "metadata"):
        _free(_map(raw.get(key, {}), key), key)
    return _contract(raw["contract"]), _groups(raw["param_groups"])


def _tensor_entries(raw: dict, contract: OptimizerContract,
                    owner: dict[str, str | None]) -> Iterator[tuple[str | None, str, str, str, tuple, object]]:
    """(fqn or None, field, path, dtype, shape, split) of every tensor, in manifest order (globals,
    then each parameter's fields: the ordinals of the indexes), checked against the contract and
    its parameter; then that no required field is missing."""
    for key, t in _map(raw["globals"], "globals").items():
        child, _, name = _str(key, "globals key").rpartition("/")
        path = f"globals[{key!r}]"
        spec = _spec(contract, child or None, name, path)
        if spec.geometry != "global":
            fail(path, f"field has geometry {spec.geometry!r}, not 'global'")
        dtype, shape = _dtype_shape(_map(t, path, ("dtype", "shape", "split")), path)
        if spec.dtype not in (LIKE_PARAM, dtype):
            fail(f"{path}.dtype", f"{dtype}, the contract says {spec.dtype}")
        yield None, key, path, dtype, shape, t["split"]

    with_state: set[str | None] = set()
    for fqn, e in _map(raw["params"], "params").items():
        path = f"params[{_str(fqn, 'params key')!r}]"[:300]
        _map(e, path, ("shape", "dtype", "fields"))
        if fqn not in owner:
            fail(path, "parameter is in no param group")
        child = e.get("child")
        if child != owner[fqn]:
            fail(f"{path}.child", f"{child!r}, but its param group belongs to {owner[fqn]!r}"[:300])
        param_dtype, param_shape = _dtype_shape(e, path)
        for name, t in _map(e["fields"], f"{path}.fields").items():
            where = f"{path}.fields[{_str(name, f'{path}.fields key')!r}]"[:400]
            spec = _spec(contract, child, name, where)
            dtype, shape = _dtype_shape(_map(t, where, ("dtype", "shape", "split")), where)
            if problem := spec.check_dtype(dtype, param_dtype):
                fail(f"{where}.dtype", problem)
            if problem := ("an optimizer-wide field" if spec.geometry == "global" else spec.check_shape(param_shape, shape)):
                fail(f"{where}.shape", problem)
            yield fqn, name, where, dtype, shape, t["split"]
        if e["fields"]:
            with_state.add(child)
            if missing := missing_fields(contract.leaf(child), e["fields"], param_shape):
                fail(f"{path}.fields", f"required field(s) {missing} are missing")
    for child in with_state:  # an optimizer (or child) with parameter state has its global fields
        for f in contract.leaf(child).global_fields:
            if not f.optional and global_key(child, f.name) not in raw["globals"]:
                fail("globals", f"required field {global_key(child, f.name)!r} is missing (the optimizer has "
                                "parameter state)")


def validate(raw: dict) -> Manifest:
    """Check a decoded manifest completely (its version first); raises ``CheckpointFormatError``
    naming the bad entry. The writers' indexes are checked when first read (``index.IndexSet``)."""
    _map(raw, "")
    check_version(raw)
    contract, owner = _head(raw)
    writers = _writers(raw["writers"])
    rules = parse_rules(raw["rules"], len(writers))
    order: list[SplitTensor] = []
    indexes = IndexSet(writers, order, {name: nbytes for w in writers for name, nbytes in w.files})
    tensors: dict[tuple[str | None, str], SplitTensor] = {}
    for fqn, field, path, dtype, shape, split in _tensor_entries(raw, contract, owner):
        split = parse_split(split, path, shape[0] if shape else 1, rules, len(writers))
        tensors[(fqn, field)] = SplitTensor(fqn, field, dtype, shape, split, len(order), indexes)
        order.append(tensors[(fqn, field)])
    files = tuple(FileRecord(name, nbytes) for w in writers for name, nbytes in w.files)
    return Manifest(raw, contract, files, tensors, tuple(writers), indexes)


def _writers(x) -> list[WriterPin]:
    """The ``writers``: ``[index, index_bytes, index_checksum, file, bytes, ...]`` each; every
    name a plain file name, listed once. All entries are checked at once in a few C-speed passes
    (16,384 writers in milliseconds); only when that fails are they checked one by one, to name
    the first bad entry."""
    x = _list(x, "writers")
    if not x:
        fail("writers", "no writers")
    if all(type(w) is list and len(w) >= 3 and len(w) % 2 == 1 for w in x):
        names = [w[0] for w in x] + [n for w in x for n in w[3::2]]
        sizes = [w[1] for w in x] + [n for w in x for n in w[4::2]]
        crcs = [w[2] for w in x]
        if (all(type(n) is str and "\n" not in n for n in names) and all(type(n) is int for n in sizes)
                and all(type(c) is int for c in crcs) and len(set(names)) == len(names) and MANIFEST_NAME not in names
                and _FILE_NAMES.fullmatch("\n".join(names)) and min(sizes) >= 0 and max(sizes) <= _MAX_INT
                and min(crcs) >= 0 and max(crcs) < 2**32 and max(w[1] for w in x) <= MAX_INDEX_BYTES):
            return [WriterPin.from_raw(w) for w in x]
    seen = set()
    for i, w in enumerate(x):
        if type(w) is not list or len(w) < 3 or len(w) % 2 == 0:
            fail(f"writers[{i}]", "expected [index, bytes, checksum, file, bytes, ...]")
        for name, size in zip([w[0], *w[3::2]], [w[1], *w[4::2]]):
            if type(name) is not str or name in seen or name == MANIFEST_NAME or not _FILE_NAME.fullmatch(name):
                what = "listed twice" if type(name) is str and name in seen else "not a plain file name"
                fail(f"writers[{i}]", f"{name!r} is {what}"[:300])
            if type(size) is not int or not 0 <= size <= _MAX_INT:
                fail(f"writers[{i}]", f"size of {name!r} is not a byte count"[:300])
            seen.add(name)
        if type(w[2]) is not int or not 0 <= w[2] < 2**32:
            fail(f"writers[{i}]", "the index checksum is not a uint32")
        if w[1] > MAX_INDEX_BYTES:
            fail(f"writers[{i}]", f"index {w[0]!r} is {w[1]:,} bytes, over the limit of {MAX_INDEX_BYTES:,}"[:300])
    return [WriterPin.from_raw(w) for w in x]


def build(state: CanonicalState, splits: dict, writers: Sequence[WriterPin], *, layout: str,
          world_size: int) -> dict:
    """The manifest of ``state``: ``splits`` maps each tensor key (fqn or None, field) to a rule,
    ``(parts, writers)`` or ``(parts, writers, sub)``, or explicit ``(start, stop, writer)`` parts.
    Rules sharing one writer tuple object are stored once (no 16,384-entry tuple hashed per tensor)."""
    import torch

    from gefen import __version__

    rules: dict[tuple, int] = {}
    kept: list[tuple] = []

    def split(key) -> int | list:
        s = splits[key]
        if isinstance(s, tuple) and len(s) in (2, 3) and isinstance(s[1], tuple):
            if (index := rules.get((s[0], id(s[1]), s[2:]))) is None:
                index = rules[(s[0], id(s[1]), s[2:])] = len(kept)
                kept.append((s[0], s[1], s[2] if len(s) == 3 else 1))
            return index
        return [list(p) for p in s]

    def tensor(key, source) -> dict:
        return {"dtype": dtype_name(source.dtype), "shape": list(source.shape), "split": split(key)}

    globals_ = {k: tensor((None, k), state.global_fields[k]) for k in sorted(state.global_fields)}
    params = {fqn: {"shape": list(e.shape), "dtype": dtype_name(e.dtype), "child": e.child,
                    "fields": {name: tensor((fqn, name), e.fields[name]) for name in sorted(e.fields)}}
              for fqn, e in _params_in_order(state)}
    return {  # the keys in their encoded order; the rules were gathered from the tensors above
        "format": FORMAT_NAME,
        "version": list(FORMAT_VERSION),
        "layout": layout,
        "world_size": world_size,
        "alignment": ALIGNMENT,
        "checksum": checksum.ALGORITHM,
        "contract": state.contract.to_dict(),
        "param_groups": plain(state.param_groups, "param_groups"),
        "writers": [w.to_raw() for w in writers],
        "rules": [{"kind": "chunk", "parts": p, "writers": list(ws), **({"sub": sub} if sub > 1 else {})}
                  for p, ws, sub in kept],
        "globals": globals_,
        "params": params,
        "topology": plain(state.metadata.get("source_topology", {}), "metadata"),
        "created": {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "writer": f"gefen {__version__}", "torch": torch.__version__.split("+")[0]},
        "metadata": plain({k: v for k, v in state.metadata.items() if k not in ("source_topology", "created")},
                          "metadata"),
    }


def _params_in_order(state: CanonicalState) -> list:
    """Parameters in param-group order (then any others in state order): the same on every
    rank of a job, whatever order each rank's state was filled in."""
    order = {fqn: i for i, fqn in enumerate(state.fqns())}
    return sorted(state.params.items(), key=lambda kv: order.get(kv[0], len(order)))


def tensor_order(state: CanonicalState) -> dict[tuple[str | None, str], int]:
    """Each tensor's ordinal in the manifest built from ``state`` (``build``'s and so
    ``validate``'s order: globals by key, parameters in group order, fields by name)."""
    keys = [(None, k) for k in sorted(state.global_fields)]
    keys += [(fqn, n) for fqn, e in _params_in_order(state) for n in sorted(e.fields)]
    return {k: i for i, k in enumerate(keys)}


def check_files(manifest: Manifest, listing: dict[str, int], where: str) -> None:
    """Every data file and index exists with the size the manifest records (else
    ``CheckpointCorruptError`` naming the file, its writer and what it holds). Runs before any
    tensor is allocated."""
    for w, pin in enumerate(manifest.writers):
        for name, nbytes in ((pin.index, pin.index_bytes), *pin.files):
            size = listing.get(name)
            if size != nbytes:
                what = "is missing (or not a regular file)" if size is None else f"has {size} bytes, the manifest says {nbytes} (truncated?)"
                kind, held = ("index", "") if name == pin.index else ("data file", _held(manifest, w, name))
                raise CheckpointCorruptError(f"{where}: {kind} {name} of writer {w} {what}{held}")


def _held(manifest: Manifest, writer: int, name: str) -> str:
    """"; it holds <tensors>" for a message about data file ``name`` (from its writer's index;
    empty when the index cannot tell)."""
    try:
        held = sorted({t.label for t in manifest.tensors.values()
                       for p in manifest.indexes.pieces(writer, t.ordinal) if p.file == name})
    except CheckpointError:
        return ""
    return f"; it holds {', '.join(held[:4])}{f' and {len(held) - 4} more' if len(held) > 4 else ''}" if held else ""


def total_tensor_bytes(manifest: Manifest) -> int:
    return sum(t.rows * t.row_bytes for t in manifest.tensors.values())


# ----- reading the committed manifest -------------------------------------------------------
def read_manifest_bytes(store: Store, listing: dict[str, int] | None = None) -> bytes:
    """The committed manifest's bytes; ``CheckpointIncompleteError`` when there is none."""
    listing = store.listing() if listing is None else listing
    size = listing.get(MANIFEST_NAME)
    if size is None:
        store.refuse_special(MANIFEST_NAME)
        leftovers = sum(1 for name in listing if name.endswith(".safetensors"))
        hint = f" ({leftovers} data files of a save that never committed)" if leftovers else ""
        raise CheckpointIncompleteError(f"no committed checkpoint at {store.url}: {MANIFEST_NAME} is missing{hint}")
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError(f"{store.url}: {MANIFEST_NAME} is {size} bytes, over the "
                                    f"{MAX_MANIFEST_BYTES}-byte limit")
    try:
        return store.read(MANIFEST_NAME, 0, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointIncompleteError(f"no committed checkpoint at {store.url}") from None


def parse_manifest(store: Store, data: bytes) -> Manifest:
    return validated(store, decoded(store, data))


def decoded(store: Store, data: bytes) -> dict:
    """The manifest's msgpack map, not yet validated."""
    with naming(store.path(MANIFEST_NAME), CheckpointFormatError):
        return decode(data)


def validated(store: Store, raw: dict) -> Manifest:
    with naming(store.path(MANIFEST_NAME), CheckpointFormatError):
        manifest = validate(raw)
    manifest.indexes.store = store
    return manifest


def listed_data_files(raw: dict, listing: dict[str, int]) -> dict[str, int]:
    """name -> size of the files a decoded, not yet validated manifest lists that are in the
    directory ``listing``, by name: what may be prefetched before validation (real directory
    entries only)."""
    names = _file_names(raw.get("writers"))
    return {name: listing[name] for name in sorted(names) if name in listing}


def _file_names(writers) -> set[str]:
    """Every file name (data files and indexes) a not yet validated ``writers`` array lists."""
    names = set()
    for w in writers if isinstance(writers, list) else ():
        if isinstance(w, list) and w:
            names.update(n for n in [w[0], *w[3::2]] if isinstance(n, str))
    return names


def committed_files(store: Store) -> set[str] | None:
    """The data files and indexes the committed manifest names (empty when there is none; None
    when it cannot be read): what a new save may delete once it has replaced that manifest. Only
    the top-level ``writers`` array is decoded (the rest is skipped in C): every save calls this."""
    try:
        data = read_manifest_bytes(store)
    except CheckpointIncompleteError:
        return set()
    except CheckpointFormatError:
        return None
    if _checksum_differs(data):
        return None
    unpacker = msgpack.Unpacker(max_buffer_size=len(data) + 1, **DECODING)
    unpacker.feed(data)
    writers = None
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "writers":
                writers = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # malformed: then nothing is deleted
        return None
    return _file_names(writers) if isinstance(writers, list) else None


def open_checkpoint(store: Store, *, whole: bool = True) -> Manifest:
    """The validated manifest, after checking that every data file exists with its recorded size;
    with ``whole=False`` (a reader of some rows) without the listing, a stat per file of the
    world's: an index is checked against its pin when first read, a short data file when read."""
    if whole:
        listing = store.listing()
        manifest = parse_manifest(store, read_manifest_bytes(store, listing))
        check_files(manifest, listing, store.url)
        return manifest
    try:
        data = store.read(MANIFEST_NAME, 0, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        data = read_manifest_bytes(store)  # raises naming what is there (or finds it, if it just appeared)
    return parse_manifest(store, data)  # ``decode`` refuses one over the size limit
