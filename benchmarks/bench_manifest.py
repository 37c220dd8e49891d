"""Metadata scale: the checkpoint metadata of a 405B-parameter state on 16,384 ranks.

Builds what a sharded save of Gefen state (``synthetic_gefen``'s m8 fields: ``m_code``,
``m_scale``, ``v_row``/``v_col`` or ``v``, ``step``, ``period``) commits, for

* Llama-3-405B shapes (126 layers, d 16384, GQA k/v 1024 x 16384, MLP 53248, vocab 128256)
  saved by 16,384 ranks (the manifest, one index per rank);
* Llama-2-70B shapes (80 layers, d 8192, k/v 1024 x 8192, MLP 28672, vocab 32000) saved by
  1,024 ranks, and, as the baseline measured in the same run, the ``.metadata`` torch's own
  checkpointing (``get_state_dict`` + ``dcp.save`` on those ranks) writes for the same pieces: the
  same tensors under torch's keys (``optim.state.<fqn>.<field>``, the param groups as
  ``torch.save``d values: ``dcp_layout.stock_entries``), one chunk per rank of every row-sharded
  field (``torch.chunk``, as FSDP2's ``Shard(0)``), replicated fields once by rank 0, each rank's
  chunks in its ``__<rank>_0.distcp`` file at ``torch.save``'s lengths, and the ``Metadata``
  pickled as ``FileSystemWriter.finish`` pickles it, its objects shared as a gathered plan shares
  them (``_dcp_metadata``). The 405B state's ``.metadata`` is not built (tens of GB of Python
  objects); the table gives its size from the 70B file's bytes per chunk.

One piece per rank of every row-sharded field, replicated fields once by rank 0, one data file
per rank. No tensor data: data files are sparse files of the recorded sizes, whose pieces'
checksums are those of zeros (the codebook, the one piece ``inspect`` reads, verifies). Then,
each in a fresh process (wall time and peak RSS via ``getrusage(RUSAGE_CHILDREN)`` in a wrapper):

* ``gefen-ckpt inspect DIR --json``;
* one rank's load planning: open and validate the checkpoint, then find the pieces of its own
  rows of every tensor (``SplitTensor.pieces_in``: reads the indexes that hold them); for DCP,
  ``FileSystemReader.read_metadata`` and ``create_read_items_for_chunk_list`` (what
  ``DefaultLoadPlanner`` calls) for the same rows of every tensor;
* ``gefen-ckpt reshard DIR OUT --world-size N --dry-run --json``;
* the start-up baseline: ``inspect`` of a tiny checkpoint.

And the bytes one rank sends the committing rank in a save (``dist.sharded.commit_payload``
packed, for a rank of the 405B save). Quick mode: 8 layers, 128 ranks (and the 70B shapes on 64).

Resharding a small state to thousands of ranks (real data): Gefen (m4v4) over 200 tensors of
4096 x 16 (13M parameters) after one step, saved by one process, then
``gefen-ckpt reshard SRC DST --world-size 4096`` in a fresh process (wall, peak RSS, bytes on
disk by kind), checked bit for bit against the source (every tensor read whole from both); beside it, in this
process, ``gefen_ckpt.write`` of the same source to 512 ranks by the one-pass writer
(``wire.many_writers``) and by the writer-by-writer path (the baseline, same run). Quick: 1,024 and 128.
Run alone: ``python -m benchmarks.bench_manifest [--quick]``.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

from benchmarks.common import ROOT, md_table, write_json

SCRATCH = Path(__file__).resolve().parent / "scratch" / "manifest"
TOKEN = "0123456789abcdef"
_PEAK = """
import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""
#: One rank's load planning, in a fresh process: open, validate, find the pieces of its rows.
_PLAN = """
import sys, time
from gefen.replicas import chunk_rows
from gefen_ckpt.wire.manifest import open_checkpoint
from gefen_ckpt.io.storage import Store
url, rank = sys.argv[1], int(sys.argv[2])
start = time.perf_counter()
m = open_checkpoint(Store(url), whole=False)  # as a rank's load opens it (sharded_io.load_sharded)
world, found = m.raw["world_size"], 0
for t in m.tensors.values():
    a, b = chunk_rows(t.rows, world, rank) if t.shape else (0, 1)
    found += len(t.pieces_in(a, b)) if b > a else 0
print(time.perf_counter() - start, found, m.indexes.reads, file=sys.stderr)
"""
#: The same for DCP: read ``.metadata`` as torch's reader does, then plan the reads of the same
#: rows of every tensor with the function ``DefaultLoadPlanner`` uses.
_DCP_PLAN = """
import sys, time
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from gefen.replicas import chunk_rows
url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
md, found = FileSystemReader(url).read_metadata(), 0
for key, t in md.state_dict_metadata.items():
    if not isinstance(t, TensorStorageMetadata):
        found += 1  # a value: one read
        continue
    if not len(t.size):
        local = ChunkStorageMetadata(torch.Size([]), torch.Size([]))
    elif (rows := chunk_rows(t.size[0], world, rank))[1] > rows[0]:
        local = ChunkStorageMetadata(torch.Size([rows[0]] + [0] * (len(t.size) - 1)),
                                     torch.Size([rows[1] - rows[0], *t.size[1:]]))
    else:
        continue
    found += len(create_read_items_for_chunk_list(key, t, [local]))
print(time.perf_counter() - start, found, 1, file=sys.stderr)
"""


def llama_shapes(layers: int = 80, dim: int = 8192, kv: int = 1024, mlp: int = 28672,
                 vocab: int = 32000) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (dim, dim), p + "self_attn.k_proj.weight": (kv, dim),
                       p + "self_attn.v_proj.weight": (kv, dim), p + "self_attn.o_proj.weight": (dim, dim),
                       p + "mlp.gate_proj.weight": (mlp, dim), p + "mlp.up_proj.weight": (mlp, dim),
                       p + "mlp.down_proj.weight": (dim, mlp), p + "input_layernorm.weight": (dim,),
                       p + "post_attention_layernorm.weight": (dim,)})
    shapes.update({"model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)})
    return shapes


def llama3_405b_shapes(layers: int = 126) -> dict[str, tuple[int, ...]]:
    return llama_shapes(layers=layers, dim=16384, kv=1024, mlp=53248, vocab=128256)


def _fields(shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Gefen's m8 fields for a parameter (one block per row for matrices, as ``synthetic_gefen``)."""
    rows = shape[0]
    out = {"step": ("int64", ()), "period": ("int64", ()), "m_code": ("uint8", shape), "m_scale": ("float32", (rows, 1))}
    if len(shape) == 2:
        out.update(v_row=("float32", (rows,)), v_col=("float32", (shape[1],)))
    else:
        out["v"] = ("float32", (rows, 1))
    return out


def _contract():
    import torch

    import gefen
    from gefen.contract import contract_of

    return contract_of(gefen.Gefen([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, moments="m8"))


def _groups(shapes, contract) -> list[dict]:
    group = {"params": list(shapes), "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    group.update({h: 0.0 for h in contract.hyperparameters if h not in group})
    return [group]


def _tensors(shapes, contract):
    """(fqn or None, field, dtype, shape, row-sharded) of every tensor, in manifest (index ordinal) order."""
    out = [(None, "codebook", "float32", (256,), False)]
    for fqn, shape in shapes.items():
        for name, (dtype, s) in sorted(_fields(shape).items()):
            out.append((fqn, name, dtype, s, bool(s) and contract.field(name).row_sharded))
    return out


def _zeros_crc(nbytes: int, cache: dict) -> int:
    if nbytes not in cache:
        cache[nbytes] = zlib.crc32(bytes(nbytes))
    return cache[nbytes]


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as out:
        out.truncate(size)


def synthesize(root: Path, shapes: dict[str, tuple[int, ...]], ranks: int, kind: str = "gefen") -> dict:
    """Write the metadata (and, ``kind`` "gefen", sparse data files) of a ``ranks``-rank sharded
    save (``kind`` "dcp": DCP's ``.metadata`` alone); its stats."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    make = _synthesize if kind == "gefen" else _synthesize_dcp
    stats = make(root, shapes, ranks, _contract())
    stats.update(params=len(shapes), numel=sum(math.prod(s) for s in shapes.values()), ranks=ranks, files=ranks)
    return stats


def _synthesize(root: Path, shapes, ranks: int, contract) -> dict:
    """Per rank: a sparse data file and its index, the manifest pinning both. Indexes of 16,384
    ranks hold ~56M piece records, too many to build as Python lists here: each rank's index is
    made from a template of fixed-width msgpack records (``_FIXED``, every integer a uint32),
    shared by the ranks whose pieces have the same sizes, with the rows filled in by numpy. It
    decodes to what ``index.encode_index`` writes for those pieces; the real encoder's (smaller)
    size for one rank is reported beside it."""
    import numpy as np

    from gefen_ckpt.wire import checksum
    from gefen_ckpt.wire import manifest as mf
    from gefen_ckpt.wire.datafile import build_packed
    from gefen_ckpt.wire.dtypes import itemsize
    from gefen_ckpt.wire.index import encode_index, index_name

    entries = _tensors(shapes, contract)
    header_bytes = len(build_packed([], mf.FILE_METADATA)[0]) + 64
    crcs: dict[int, int] = {}
    rows = np.array([s[0] if s else 1 for _, _, _, s, _ in entries], np.int64)
    row_bytes = np.array([math.prod(s[1:]) * itemsize(d) for _, _, d, s, _ in entries], np.int64)
    items = np.array([itemsize(d) for _, _, d, _, _ in entries], np.int64)
    sharded = np.array([sh for *_, sh in entries])
    size = -(-rows // ranks)
    layouts: dict[bytes, tuple[np.ndarray, int]] = {}  # held rows per tensor -> (records, file bytes)
    pins, pieces_total, index_total, real_bytes = [], 0, 0, 0
    for rank in range(ranks):
        start = np.where(sharded, np.minimum(rank * size, rows), 0)
        stop = np.where(sharded, np.minimum(start + size, rows), rows if rank == 0 else 0)
        held = np.nonzero(stop > start)[0]
        counts = (stop - start)[held]
        signature = held.tobytes() + counts.tobytes()
        if signature not in layouts:  # offsets and checksums depend only on the pieces' sizes
            records, pos = np.zeros((len(held), len(_FIXED)), np.uint8), header_bytes
            records[:] = np.frombuffer(_FIXED, np.uint8)
            for i, (o, n) in enumerate(zip(held.tolist(), counts.tolist())):
                nbytes = n * int(row_bytes[o])
                pos += -pos % (64 if nbytes >= 4096 else int(items[o]))
                _put(records[i], _ORDINAL, o)
                _put(records[i], _OFFSET, pos)
                _put(records[i], _CRC, _zeros_crc(nbytes, crcs))
                pos += nbytes
            layouts[signature] = (records, pos)
        records, file_bytes = layouts[signature]
        records = records.copy()
        for column, values in ((_START, start[held]), (_STOP, stop[held])):
            records[:, column:column + 4] = values.astype(">u4").view(np.uint8).reshape(-1, 4)
        data = _index_head(rank, len(held)) + records.tobytes()
        if rank == ranks // 2:  # the real encoder's size for one rank
            parsed = [[int(o), [[int(a), int(b), 0, 0, 0]]] for o, a, b in zip(held, start[held], stop[held])]
            real_bytes = len(encode_index(rank, [[o, [[a, b, 0, int.from_bytes(r[_OFFSET:_OFFSET + 4], "big"),
                                                         int.from_bytes(r[_CRC:_CRC + 4], "big")]]]
                                                 for (o, [[a, b, *_]]), r in zip(parsed, records)]))
        name = index_name(TOKEN, rank)
        (root / name).write_bytes(data)
        data_name = f"data-{TOKEN}-r{rank:05d}-00000.safetensors"
        _sparse(root / data_name, file_bytes)
        pins.append([name, len(data), checksum.update(0, data), data_name, file_bytes])
        pieces_total += len(held)
        index_total += len(data)
    rules = [{"kind": "chunk", "parts": 1, "writers": [0]},
             {"kind": "chunk", "parts": ranks, "writers": list(range(ranks))}]
    params = {}
    for fqn, name, dtype, shape, is_sharded in entries[1:]:
        e = params.setdefault(fqn, {"shape": list(shapes[fqn]), "dtype": "float32", "child": None, "fields": {}})
        e["fields"][name] = {"dtype": dtype, "shape": list(shape), "split": 1 if is_sharded else 0}
    manifest = {
        "format": mf.FORMAT_NAME, "version": list(mf.FORMAT_VERSION), "layout": "sharded", "world_size": ranks,
        "alignment": 64, "checksum": "crc32", "contract": contract.to_dict(),
        "param_groups": _groups(shapes, contract), "writers": pins, "rules": rules,
        "globals": {"codebook": {"dtype": "float32", "shape": [256], "split": 0}}, "params": params,
        "topology": {"kind": "sharded", "world_size": ranks}, "created": {}, "metadata": {"step": 1000},
    }
    data = mf.encode(manifest)
    (root / mf.MANIFEST_NAME).write_bytes(data)
    return {"pieces": pieces_total, "manifest_bytes": len(data), "index_bytes": index_total,
            "index_bytes_encoder": real_bytes}


def _synthesize_dcp(root: Path, shapes, ranks: int, contract) -> dict:
    """DCP's ``.metadata`` for the pieces ``_synthesize`` writes (module docstring); its stats."""
    metadata, chunks = _dcp_metadata(root, shapes, ranks, contract)
    with open(root / ".metadata", "wb") as f:
        pickle.dump(metadata, f)  # as FileSystemWriter.finish writes it
    return {"pieces": chunks, "manifest_bytes": (root / ".metadata").stat().st_size, "index_bytes": 0}


def _stock(shapes, contract, source) -> tuple[dict, dict, dict]:
    """``dcp_layout.stock_entries`` (torch's layout under ``"optim"``) of the state ``_synthesize``
    describes, each tensor ``source(dtype name, shape)``."""
    import torch

    from gefen_ckpt.dcp.layout import stock_entries
    from gefen_ckpt.state.canonical import CanonicalState, ParamState

    entries = _tensors(shapes, contract)
    fields: dict[str, dict] = {}
    for fqn, name, dtype, shape, _ in entries[1:]:
        fields.setdefault(fqn, {})[name] = source(dtype, shape)
    state = CanonicalState(contract=contract, param_groups=_groups(shapes, contract),
                           params={fqn: ParamState(shapes[fqn], torch.float32, f) for fqn, f in fields.items()},
                           global_fields={"codebook": source(*entries[0][2:4])}, metadata={})
    return stock_entries(state, "optim", flat=False)


def _row_sharded(key: str, shape, contract) -> bool:
    name = key.rsplit(".", 1)[1]
    return bool(shape) and name != "codebook" and contract.field(name).row_sharded


def _dcp_metadata(root: Path, shapes, ranks: int, contract):
    """(``Metadata``, chunks) of ``get_state_dict`` + ``dcp.save`` of the state ``_synthesize``
    describes, on ``ranks`` ranks. Objects are shared as DCP's gathered plans share them: a string
    or ``torch.Size`` a rank made once is one object within that rank's chunks, and a fresh one per
    rank (the coordinator unpickles each rank's plan and write results apart)."""
    import io
    import uuid

    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from gefen.replicas import chunk_rows
    from gefen_ckpt.wire.dtypes import torch_dtype

    class Shape:  # a tensor source of a shape (stock_entries reads no data)
        def __init__(self, dtype: str, shape: tuple[int, ...]):
            self.dtype, self.shape = torch_dtype(dtype), tuple(shape)

    tensors, values, mappings = _stock(shapes, contract, Shape)

    def fresh(text: str) -> str:
        return text.encode().decode()  # an equal string, another object

    saved = {}  # torch.save's bytes around a tensor's data (how DCP writes each chunk), by dtype

    def length(dtype: torch.dtype, nbytes: int) -> int:
        if dtype not in saved:
            buffer = io.BytesIO()
            torch.save(torch.empty(0, dtype=dtype), buffer)
            saved[dtype] = len(buffer.getvalue())
        return saved[dtype] + nbytes

    md = {k: TensorStorageMetadata(TensorProperties(dtype=s.dtype), torch.Size(s.shape), []) for k, s in tensors.items()}
    md.update({k: BytesStorageMetadata() for k in values})
    storage, chunks = {}, 0
    for rank in range(ranks):
        path, end = fresh(f"__{rank}_0.distcp"), 0
        for key, src in tensors.items():
            shape = src.shape
            if _row_sharded(key, shape, contract):
                start, stop = chunk_rows(shape[0], ranks, rank)
            elif rank == 0:
                start, stop = 0, shape[0] if shape else 1
            else:
                continue
            if stop <= start:
                continue
            offsets = [start] + [0] * (len(shape) - 1) if shape else []
            sizes = [stop - start, *shape[1:]] if shape else []
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            index = MetadataIndex(fresh(key), torch.Size(offsets), len(md[key].chunks))
            nbytes = length(src.dtype, math.prod(sizes) * src.dtype.itemsize)
            md[key].chunks.append(chunk)
            storage[index] = _StorageInfo(path, end, nbytes)
            end, chunks = end + nbytes, chunks + 1
        for key, value in values.items() if rank == 0 else ():
            storage[MetadataIndex(fresh(key))] = _StorageInfo(path, end, len(value))
            end += len(value)
    planner = {fresh(k): v for k, v in mappings.items()}  # DefaultSavePlanner's merged flatten mappings
    return Metadata(md, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=str(root), save_id=uuid.uuid4().hex),
                    version=CURRENT_DCP_VERSION), chunks


def _stock_state_dict(shapes, contract) -> tuple[dict, set[str]]:
    """(the optimizer state dict torch's ``get_state_dict`` gives for the state ``_dcp_metadata``
    describes, its tensors zeros; its row-sharded tensors' keys)."""
    import io

    import torch

    from gefen_ckpt.state.canonical import EagerSource
    from gefen_ckpt.wire.dtypes import torch_dtype

    tensors, values, mappings = _stock(shapes, contract, lambda d, s: EagerSource(torch.zeros(s, dtype=torch_dtype(d))))
    optim: dict = {"state": {}, "param_groups": []}
    for key, (_, kind, where, name) in mappings.items():
        value = tensors[key].read() if key in tensors else torch.load(io.BytesIO(values[key]), weights_only=False)
        if kind == "param_groups":
            optim["param_groups"] += [{} for _ in range(where + 1 - len(optim["param_groups"]))]
            optim["param_groups"][where][name] = value
        else:
            optim["state"].setdefault(where, {})[name] = value
    return optim, {k for k, s in tensors.items() if _row_sharded(k, s.shape, contract)}


def _dcp_rank(rank: int, ranks: int, workdir: str, shapes) -> None:
    """One rank of the real ``dcp.save`` ``check_dcp_metadata`` compares with: row-sharded fields as
    ``Shard(0)`` DTensors (``torch.chunk``'s split), the rest replicated, under ``"optim"``."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    optim, sharded = _stock_state_dict(shapes, _contract())
    for fqn, entry in optim["state"].items():
        for name, value in entry.items():
            if f"optim.state.{fqn}.{name}" in sharded:
                entry[name] = distribute_tensor(value, mesh, [Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": optim}, checkpoint_id=str(Path(workdir) / "dcp"))
    dist.barrier()
    dist.destroy_process_group()


def check_dcp_metadata(ranks: int = 4) -> dict:
    """``_dcp_metadata`` against the ``.metadata`` a real ``dcp.save`` on ``ranks`` gloo ranks writes
    for a small state: the same keys and chunks, and the pickled bytes of each."""
    import tempfile

    import torch.multiprocessing as mp

    from gefen_ckpt.dcp.layout import safe_load_dcp_metadata

    shapes = llama_shapes(layers=2, dim=256, kv=64, mlp=512, vocab=1000)
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_dcp_rank, args=(ranks, workdir, shapes), nprocs=ranks)
        path = Path(workdir) / "dcp" / ".metadata"
        with open(path, "rb") as f:
            real = safe_load_dcp_metadata(f)
        real_bytes = path.stat().st_size
        made, _ = _dcp_metadata(Path(workdir) / "dcp", shapes, ranks, _contract())
    layout = {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(v, "chunks", ()))
              for k, v in real.state_dict_metadata.items()}
    same = layout == {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(v, "chunks", ()))
                      for k, v in made.state_dict_metadata.items()}
    return {"ranks": ranks, "chunks": sum(map(len, layout.values())), "same_chunks": same,
            "same_storage_keys": len(real.storage_data) == len(made.storage_data),
            "real_bytes": real_bytes, "emulated_bytes": len(pickle.dumps(made))}


#: One index record ``[ordinal, [[start, stop, 0, offset, checksum]]]`` as msgpack with every
#: integer a uint32 (0xce + 4 big-endian bytes) but the file position (0); the byte offsets of its fields.
_FIXED = bytes([0x92, 0xce, 0, 0, 0, 0, 0x91, 0x95, 0xce, 0, 0, 0, 0, 0xce, 0, 0, 0, 0, 0x00,
                0xce, 0, 0, 0, 0, 0xce, 0, 0, 0, 0])
_ORDINAL, _START, _STOP, _OFFSET, _CRC = 2, 9, 14, 20, 25


def _put(record, at: int, value: int) -> None:
    record[at:at + 4] = list(value.to_bytes(4, "big"))


def _index_head(writer: int, entries: int) -> bytes:
    """The index map up to its tensors array's items (``index.encode_index``'s keys, in order)."""
    import msgpack

    from gefen_ckpt.wire.index import INDEX_FORMAT

    return (b"\x84" + msgpack.packb("format") + msgpack.packb(INDEX_FORMAT) + msgpack.packb("version")
            + msgpack.packb([2, 0]) + msgpack.packb("writer") + msgpack.packb(writer) + msgpack.packb("tensors")
            + b"\xdd" + entries.to_bytes(4, "big"))


def commit_bytes(ranks: int) -> int:
    """Bytes one rank (the last of ``ranks``) sends the committing rank in a save:
    ``dist.sharded.commit_payload`` packed as it is sent, with a structure digest and no
    explicit rows (every tensor follows its rule)."""
    from gefen_ckpt.dist.collective import pack
    from gefen_ckpt.dist.sharded import commit_payload
    from gefen_ckpt.wire.index import WriterPin, index_name

    class Plan:
        digest, explicit = "0" * 32, {}

    rank = ranks - 1
    pin = WriterPin(((f"data-{TOKEN}-r{rank:05d}-00000.safetensors", 2**31 - 1),), index_name(TOKEN, rank),
                    2**20, 2**32 - 1)
    return len(pack({**commit_payload(pin, Plan()), "error": None}))


def cli(*args: str) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``python -m gefen_cli ARGS`` measured by a fresh wrapper."""
    return _measured(sys.executable, "-m", "gefen_cli", *args)


def _measured(*argv: str) -> tuple[float, int]:
    seconds, rss, _ = _measured_with_stderr(*argv)
    return seconds, rss


def _measured_with_stderr(*argv: str) -> tuple[float, int, str]:
    out = subprocess.run([sys.executable, "-c", _PEAK, *argv], check=True, capture_output=True, text=True, cwd=ROOT)
    seconds, rss = out.stdout.split()[-2:]
    return float(seconds), int(rss), out.stderr


def plan_one_rank(root: Path, rank: int, script: str = _PLAN, *args: str) -> tuple[float, int, dict]:
    """(process wall s, peak RSS, {"in_process_s", "pieces", "indexes_read"}) of one rank's planning
    (``script``: ``_PLAN``, or ``_DCP_PLAN`` with the world size, whose "pieces" are read items)."""
    seconds, rss, err = _measured_with_stderr(sys.executable, "-c", script, str(root), str(rank), *args)
    inner, pieces, reads = err.split()[-3:]
    return seconds, rss, {"in_process_s": float(inner), "pieces": int(pieces), "indexes_read": int(reads)}


def _case(name: str, shapes, ranks: int, target: int, kind: str) -> dict:
    root = SCRATCH / name
    started = time.perf_counter()
    stats = synthesize(root, shapes, ranks, kind)
    stats["synthesize_s"] = time.perf_counter() - started
    if kind == "dcp":  # DCP's load planning; it has no offline inspect or reshard
        seconds, rss, stats["planning"] = plan_one_rank(root, ranks // 2, _DCP_PLAN, str(ranks))
        runs = {"load planning (one rank)": (seconds, rss)}
    else:
        runs = {"inspect": cli("inspect", str(root), "--json")}
        seconds, rss, stats["planning"] = plan_one_rank(root, ranks // 2)
        runs["load planning (one rank)"] = (seconds, rss)
        runs[f"reshard --dry-run --world-size {target}"] = cli("reshard", str(root), str(SCRATCH / "out"),
                                                               "--world-size", str(target), "--dry-run", "--json")
    shutil.rmtree(root, ignore_errors=True)
    return {"stats": stats, "runs": {k: {"seconds": s, "peak_rss": r} for k, (s, r) in runs.items()}}


def small_state(root: Path) -> int:
    """Save Gefen's state over 200 tensors of 4096 x 16 after one step at ``root``; its bytes."""
    import torch

    import gefen
    import gefen_ckpt

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096, 16)) for _ in range(200)]
    opt = gefen.Gefen(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    gefen_ckpt.save(opt, str(root), model=torch.nn.ParameterList(params))
    return gefen_ckpt.read(str(root)).total_bytes()


def _on_disk(root: Path) -> dict:
    out = {"data": 0, "index": 0, "manifest": 0, "data_files": 0, "index_files": 0}
    for f in root.iterdir():
        kind = "data" if f.name.startswith("data-") else "index" if f.name.startswith("index-") else "manifest"
        out[kind] += f.stat().st_size
        if kind != "manifest":
            out[f"{kind}_files"] += 1
    return out


def _bit_exact(a: str, b: str) -> bool:
    """Every tensor of two checkpoints equal bit for bit (each read whole through ``gefen_ckpt.read``)."""
    import torch

    import gefen_ckpt

    ta, tb = dict(gefen_ckpt.read(a).tensors()), dict(gefen_ckpt.read(b).tensors())
    return ta.keys() == tb.keys() and all(torch.equal(s.read(), tb[k].read()) for k, s in ta.items())


def reshard_small(quick: bool) -> dict:
    """The many-rank reshard of a small state (module docstring)."""
    import gefen_ckpt
    from gefen_ckpt.io.storage import Store
    from gefen_ckpt.wire import many_writers
    from gefen_ckpt.wire.manifest import open_checkpoint

    ranks, side = (1024, 128) if quick else (4096, 512)
    src, dst = SCRATCH / "small", SCRATCH / "small-resharded"
    for path in (src, dst):  # what an interrupted run left
        shutil.rmtree(path, ignore_errors=True)
    state_bytes = small_state(src)
    seconds, rss = cli("reshard", str(src), str(dst), "--world-size", str(ranks))
    equal = _bit_exact(str(src), str(dst))
    out = {"ranks": ranks, "state_bytes": state_bytes, "seconds": seconds, "peak_rss": rss, "bit_exact": equal,
           "disk": _on_disk(dst), "writers": len(gefen_ckpt.read_manifest(str(dst))["writers"]),
           "side_ranks": side}
    out["pieces"] = sum(len(t.pieces) for t in open_checkpoint(Store(str(dst))).tensors.values())
    shutil.rmtree(dst, ignore_errors=True)
    source = gefen_ckpt.read(str(src))
    for name, path in (("one_pass", True), ("writer_by_writer", False)):
        real = many_writers.regular_plan
        if not path:
            many_writers.regular_plan = lambda *a, **k: None
        try:
            started = time.perf_counter()
            gefen_ckpt.write(source, str(dst), world_size=side)
            out[f"side_{name}_s"] = time.perf_counter() - started
        finally:
            many_writers.regular_plan = real
        shutil.rmtree(dst, ignore_errors=True)
    return out


def run(quick: bool) -> dict:
    if quick:
        cases = [("405b", llama3_405b_shapes(layers=8), 128, 96, "gefen"),
                 ("70b", llama_shapes(layers=8), 64, 48, "gefen"), ("70b-dcp", llama_shapes(layers=8), 64, 48, "dcp")]
    else:
        cases = [("405b", llama3_405b_shapes(), 16384, 12288, "gefen"),
                 ("70b", llama_shapes(), 1024, 768, "gefen"), ("70b-dcp", llama_shapes(), 1024, 768, "dcp")]
    try:
        synthesize(SCRATCH / "tiny", llama_shapes(layers=1, dim=64, kv=16, mlp=128, vocab=100), 2)
        baseline = cli("inspect", str(SCRATCH / "tiny"), "--json")
        results = {name: _case(name, shapes, ranks, target, v) for name, shapes, ranks, target, v in cases}
        dcp_check = check_dcp_metadata()
        small = reshard_small(quick)
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)
    big, dcp = results["405b"]["stats"], results["70b-dcp"]["stats"]
    data = {"baseline_inspect": {"seconds": baseline[0], "peak_rss": baseline[1]}, "cases": results,
            "commit_bytes_per_rank": commit_bytes(big["ranks"]),
            "dcp_metadata_bytes_estimate_405b": int(dcp["manifest_bytes"] / dcp["pieces"] * big["pieces"]),
            "dcp_check": dcp_check, "reshard_small": small}
    write_json("manifest", data)
    return {"title": "Metadata scale (405B parameters on 16,384 ranks; 70B on 1,024)",
            "markdown": _markdown(data), "plots": [], "data": data}


def _markdown(data: dict) -> str:
    mib = 2**20
    rows = []
    labels = {"405b": "405B, {ranks:,} ranks", "70b": "70B, {ranks:,} ranks",
              "70b-dcp": "70B, {ranks:,} ranks, DCP (baseline)"}
    for name, case in data["cases"].items():
        s = case["stats"]
        label = labels[name].format(ranks=s["ranks"])
        meta = (f"manifest {s['manifest_bytes'] / mib:.2f} MiB + {s['ranks']:,} indexes, "
                f"{s['index_bytes'] / s['ranks'] / 1024:.0f} KiB each" if s["index_bytes"]
                else f"`.metadata` {s['manifest_bytes'] / mib:.2f} MiB, {s['pieces']:,} chunks in it")
        for command, r in case["runs"].items():
            if command.startswith("load planning"):
                p = s["planning"]
                command += (f" ({p['in_process_s']:.2f} s after start-up; {p['pieces']:,} "
                            + (f"pieces from {p['indexes_read']} index{'es' if p['indexes_read'] != 1 else ''})"
                               if s["index_bytes"] else "read items from `.metadata`)"))
            rows.append([label, meta, command, f"{r['seconds']:.2f}", f"{r['peak_rss'] / mib:.0f}"])
            label, meta = "", ""
    big, ours, dcp = (data["cases"][k]["stats"] for k in ("405b", "70b", "70b-dcp"))
    plan_ours, plan_dcp = (data["cases"][k]["runs"]["load planning (one rank)"] for k in ("70b", "70b-dcp"))
    b = data["baseline_inspect"]
    return (
        f"What a sharded save of Gefen (m8) state commits: Llama-3-405B shapes ({big['params']:,} parameters, "
        f"{big['numel'] / 1e9:.0f}B elements, {big['pieces']:,} pieces) on {big['ranks']:,} ranks, and Llama-2-70B "
        f"shapes on {ours['ranks']:,} ranks, beside the `.metadata` torch's own `get_state_dict` + `dcp.save` "
        "writes for the same pieces on those ranks (the baseline, built and measured in the same run: "
        "`bench_manifest._dcp_metadata`). Indexes are written with fixed-width integers (the bench's template); "
        f"the library's encoder writes {big['index_bytes_encoder'] / 1024:.0f} KiB for one 405B rank. No tensor "
        "data (sparse files). Each command runs in a fresh process; peak RSS of that process. Start-up alone "
        f"(`inspect` of a tiny checkpoint): {b['seconds']:.2f} s, {b['peak_rss'] / mib:.0f} MiB.\n\n"
        + md_table(["state", "metadata", "command", "wall (s)", "peak RSS (MiB)"], rows)
        + f"\n\nFor the same 70B pieces ({ours['pieces']:,}; DCP's {dcp['pieces']:,} chunks add the codebook, which "
        f"torch's layout repeats in each parameter's state) DCP's `.metadata` is {dcp['manifest_bytes'] / mib:.1f} MiB, "
        f"{dcp['manifest_bytes'] / (ours['manifest_bytes'] + ours['index_bytes']):.1f}x the manifest and every index "
        f"together and {dcp['manifest_bytes'] / ours['manifest_bytes']:,.0f}x the manifest, and every rank of a DCP "
        f"load unpickles all of it: one rank's planning takes {dcp['planning']['in_process_s']:.2f} s after start-up "
        f"against {ours['planning']['in_process_s']:.2f} s (with start-up {plan_dcp['seconds']:.2f} s and "
        f"{plan_dcp['peak_rss'] / mib:,.0f} MiB against {plan_ours['seconds']:.2f} s and "
        f"{plan_ours['peak_rss'] / mib:,.0f} MiB; DCP's start-up includes importing torch). For the 405B "
        f"save it would be about {data['dcp_metadata_bytes_estimate_405b'] / mib:,.0f} MiB (the 70B file's bytes "
        f"per chunk times the pieces; not built). {_dcp_check_sentence(data['dcp_check'])} "
        f"Each rank of the 405B save sends the committing rank {data['commit_bytes_per_rank']} bytes "
        "(`dist.sharded.commit_payload`: its file names and sizes, its index's name, size and CRC, a structure "
        "digest).\n\n"
        "Targets (405B, 16,384 ranks): manifest <= 8 MiB; inspect <= 3 s and <= 300 MiB; one rank's load planning "
        "<= 1 s and <= 200 MiB; reshard --dry-run --world-size 12288 <= 15 s; <= 1 KiB per rank to commit. "
        f"In this run: {_verdicts(data)}.\n\n"
        + _small_markdown(data["reshard_small"], b["seconds"])
        + "\nRe-run: `python -m benchmarks.bench_manifest` (`--quick`: 8 layers, 128 and 64 ranks; the small "
        "state to 1,024 ranks).\n"
    )


def _dcp_check_sentence(c: dict) -> str:
    agree = "the same" if c["same_chunks"] and c["same_storage_keys"] else "NOT the same"
    return (f"The baseline's `.metadata` checked in this run against a real `dcp.save` by {c['ranks']} gloo ranks "
            f"of a 2-layer state: {agree} {c['chunks']} chunks and storage entries, {c['emulated_bytes']:,} bytes "
            f"pickled against {c['real_bytes']:,} written ({c['emulated_bytes'] / c['real_bytes'] - 1:+.1%}).")


def _verdicts(data: dict) -> str:
    """Each target of the 405B case, met or not, from this run's numbers."""
    case = data["cases"]["405b"]
    runs, mib = case["runs"], 2**20
    plan = runs["load planning (one rank)"]
    inner = case["stats"]["planning"]["in_process_s"]
    dry = next(v for k, v in runs.items() if k.startswith("reshard --dry-run"))
    checks = [("manifest", case["stats"]["manifest_bytes"] <= 8 * mib),
              ("inspect", runs["inspect"]["seconds"] <= 3 and runs["inspect"]["peak_rss"] <= 300 * mib),
              (f"load planning ({plan['seconds']:.2f} s with the interpreter's start-up, {inner:.2f} s after it)",
               plan["seconds"] <= 1 and plan["peak_rss"] <= 200 * mib),
              ("dry run", dry["seconds"] <= 15), ("commit bytes", data["commit_bytes_per_rank"] <= 1024)]
    out = [f"{name} {'met' if ok else 'NOT met'}" for name, ok in checks]
    if not checks[2][1] and inner <= 1:
        out[2] += " (met after start-up)"
    return "; ".join(out)


def _small_markdown(r: dict, startup: float) -> str:
    mb, d = 1e6, r["disk"]
    over = d["data"] / r["state_bytes"] - 1
    return (
        f"**Resharding a small state to {r['ranks']:,} ranks** (Gefen m4v4, 200 tensors of 4096 x 16, 13M "
        f"parameters, {r['state_bytes'] / mb:.1f} MB of state, saved by one process): "
        f"`gefen-ckpt reshard SRC DST --world-size {r['ranks']}` took **{r['seconds']:.1f} s** "
        f"({startup:.1f} s of it is the start-up measured above, plus importing torch) and "
        f"{r['peak_rss'] / 2**20:.0f} MiB peak RSS; bit-exact: {'yes' if r['bit_exact'] else 'NO'} (every tensor read back). "
        f"On disk: data {d['data'] / mb:.2f} MB in {d['data_files']:,} files ({over:+.1%} over the state: "
        f"{(d['data'] - r['state_bytes']) / max(1, d['data_files']):,.0f} bytes per file of header and alignment), "
        f"indexes {d['index'] / mb:.2f} MB in {d['index_files']:,} files ({d['index'] / r['pieces']:.1f} bytes per "
        f"piece: a writer's rows of a tensor are one piece with its own CRC-32, {r['pieces']:,} of them), manifest "
        f"{d['manifest'] / mb:.2f} MB; {r['writers']:,} writers (consecutive small parts share one). "
        f"Same source to {r['side_ranks']} ranks in this process: one-pass writer {r['side_one_pass_s']:.2f} s, "
        f"writer-by-writer path (the baseline) {r['side_writer_by_writer_s']:.2f} s.\n"
    )


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    print(result["markdown"])
    os.sys.stdout.flush()
