"""Reading DCP checkpoints in the description layout, offline (``gefen-ckpt`` and ``read_dcp``).

That layout keeps each field under ``<key>.<fqn>/<field>``, optimizer-wide fields under
``<key>.__global__/<name>`` (``__global__/<child>/<name>`` in a composite optimizer) and a
description under ``<key>.__gefen__``: a uint8 tensor holding a 16-byte header (``GEFNDCP\\x01``
+ little-endian uint64 body length), a msgpack body (never pickle: ``format`` ``"gefen-dcp"``,
``format_version`` 1, ``schema_version``, ``contract``, ``param_groups`` and ``params``, a list of
``[fqn, global shape, dtype, child, has state]``) and zero padding. The tools read it like any
checkpoint; ``gefen-ckpt convert SRC DST --to dcp`` rewrites it in torch's stock layout, which
``GefenDCPState`` and torch's ``set_state_dict`` load.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gefen_ckpt.canonical import CanonicalState, ParamState
from gefen_ckpt.dcp_layout import DCPSource
from gefen_ckpt.errors import CheckpointFormatError
from gefen_ckpt.wire.dtypes import torch_dtype
from gefen_ckpt.wire.manifest import parse_contract

__all__ = ["META_KEY", "GLOBAL_PREFIX", "find_legacy_keys", "read_legacy", "unpack"]

META_KEY = "__gefen__"
GLOBAL_PREFIX = "__global__/"
_MAGIC = b"GEFNDCP\x01"
_HEADER = len(_MAGIC) + 8
_MAX_META = 1 << 30


def unpack(body: bytes, what: str) -> Any:
    """msgpack of untrusted bytes: a ``CheckpointFormatError`` for garbage, never a crash."""
    if len(body) > _MAX_META:
        raise CheckpointFormatError(f"{what} is implausibly large ({len(body)} bytes)")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CheckpointFormatError(f"{what} is not valid msgpack: {exc}") from None


def find_legacy_keys(metadata) -> list[str]:
    """State-dict keys under which a DCP checkpoint holds the description layout ('' = top level)."""
    return sorted("" if k == META_KEY else k[: -len(META_KEY) - 1]
                  for k in metadata.state_dict_metadata if k == META_KEY or k.endswith("." + META_KEY))


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckpointFormatError(f"malformed gefen DCP description: {msg}")


def _description(tensor: torch.Tensor) -> dict:
    """The decoded, structurally checked description (hostile bytes get ``CheckpointFormatError``)."""
    data = tensor.numpy().tobytes()
    _need(len(data) >= _HEADER and data[: len(_MAGIC)] == _MAGIC, "bad magic")
    length = int.from_bytes(data[len(_MAGIC):_HEADER], "little")
    _need(length <= len(data) - _HEADER, f"claims {length} bytes but holds {len(data) - _HEADER}")
    meta = unpack(data[_HEADER:_HEADER + length], "the gefen DCP description")
    _need(isinstance(meta, dict) and meta.get("format") == "gefen-dcp", "not a gefen-dcp description")
    _need(isinstance(meta.get("format_version"), int) and meta["format_version"] <= 1, "unknown format_version")
    _need(isinstance(meta.get("contract"), dict), "contract missing")
    meta["contract"] = parse_contract(meta["contract"], "the gefen DCP description's contract")
    groups = meta.get("param_groups")
    _need(isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                           and all(isinstance(f, str) for f in g["params"]) for g in groups),
          "param_groups must be a list of maps listing FQNs")
    _need(isinstance(meta.get("params"), list), "params must be a list")
    described = {}
    for entry in meta["params"]:
        _need(isinstance(entry, list) and len(entry) == 5, "a param entry must be [fqn, shape, dtype, child, state]")
        fqn, shape, dtype, child, has_state = entry
        _need(isinstance(fqn, str) and fqn not in described, f"bad or repeated FQN {fqn!r}")
        _need(child is None or isinstance(child, str), f"{fqn}: bad child {child!r}")
        if has_state is True:
            _need(isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape), f"{fqn}: bad shape {shape!r}")
            described[fqn] = (tuple(shape), torch_dtype(dtype, f"malformed gefen DCP description: {fqn}"), child)
    meta["params"] = described
    return meta


def read_legacy(reader, key: str) -> CanonicalState:
    """The ``CanonicalState`` saved under ``key`` in the description layout, its tensors lazy;
    ``reader`` is an opened DCP checkpoint (``DCPReader``)."""
    prefix = f"{key}." if key else ""
    smd = reader.metadata.state_dict_metadata
    md = smd[prefix + META_KEY]
    if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != torch.uint8 or len(md.size) != 1 \
            or md.size[0] > _MAX_META:
        raise CheckpointFormatError(f"{reader.path}: {prefix + META_KEY!r} is not a plausible description tensor")
    meta = _description(reader.read(prefix + META_KEY, 0, None))
    params: dict[str, ParamState] = {}
    global_fields = {}
    for full, md in smd.items():
        sub = full[len(prefix):]
        if not full.startswith(prefix) or sub == META_KEY:
            continue
        if sub.startswith(GLOBAL_PREFIX):
            global_fields[sub[len(GLOBAL_PREFIX):]] = DCPSource(reader, full)
            continue
        fqn, _, name = sub.rpartition("/")
        if fqn not in meta["params"]:
            if not key:
                continue  # a top-level description shares the namespace with other entries
            raise CheckpointFormatError(f"{reader.path}: entry {full!r} belongs to no parameter with state")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointFormatError(f"{reader.path}: {full!r} is not a tensor entry")
        shape, dtype, child = meta["params"][fqn]
        entry = params.setdefault(fqn, ParamState(shape, dtype, {}, child))
        src = entry.fields[name] = DCPSource(reader, full)
        try:
            spec = meta["contract"].leaf(child).field(name)
        except KeyError:
            raise CheckpointFormatError(f"{reader.path}: {fqn}/{name}: a field its contract does not have") from None
        if problem := spec.check(shape, src.shape, src.dtype, dtype):
            raise CheckpointFormatError(f"{fqn}/{name}: stored {problem}")
    return CanonicalState(meta["contract"], meta["param_groups"], params, global_fields,
                          metadata={"source_topology": {"kind": "dcp (description layout)"}})
