"""Data files are plain safetensors (the stock library reads them): one ``U8`` tensor spans the
data section, where every piece lies aligned (for a view of its dtype) at the offset its writer's
index records, the bytes between pieces zero."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import gefen_ckpt
from gefen_ckpt.io import native
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire import checksum, datafile
from gefen_ckpt.wire.dtypes import DTYPES, dtype_name, torch_dtype
from gefen_ckpt.wire.manifest import open_checkpoint
from gefen_ckpt.wire.reader import read_piece

from ckpt_util import OPTIMIZERS, Tiny, train

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model = Tiny(dim=64)  # pieces of 4 KiB and more (ALIGNMENT-aligned) beside smaller ones
    opt = OPTIMIZERS["hybrid_adamw"](model)
    train(model, opt, 3)
    state = gefen_ckpt.export_canonical(opt, model=model)
    url = str(tmp_path_factory.mktemp("df") / "ck")
    gefen_ckpt.write(state, url, world_size=2, max_file_bytes=8192)
    return url, state, gefen_ckpt.read_manifest(url)


def _files(manifest) -> list[str]:
    return [name for w in manifest["writers"] for name in w[3::2]]


def _pieces(url):
    """(tensor, piece) of every stored piece."""
    return [(t, p) for t in open_checkpoint(Store(url)).tensors.values() for p in t.pieces]


def test_stock_safetensors_loads_every_file(written):
    url, state, manifest = written
    data = {}
    for name in _files(manifest):
        path = os.path.join(url, name)
        tensors = load_file(path)  # the stock validator: contiguous offsets, sizes, dtypes
        with safe_open(path, "pt") as sf:
            assert set(sf.keys()) == {datafile.DATA_KEY}
            assert sf.metadata() == {"format": "gefen-ckpt", "version": "2.0"}
        data[name] = (tensors[datafile.DATA_KEY].numpy(), os.path.getsize(path) - tensors[datafile.DATA_KEY].numel())
    covered = {name: np.zeros(len(d), bool) for name, (d, _) in data.items()}
    for t, p in _pieces(url):
        stored, start = data[p.file]
        raw = stored[p.offset - start:p.offset - start + p.nbytes]
        assert zlib.crc32(raw) == p.checksum
        shape = (p.rows[1] - p.rows[0], *t.shape[1:]) if t.shape else ()
        want = state.params[t.fqn].fields[t.field] if t.fqn else state.global_fields[t.field]
        value = torch.from_numpy(raw.copy()).view(torch_dtype(t.dtype)).reshape(shape)
        assert torch.equal(value, want.read(*p.rows) if t.shape else want.read())
        covered[p.file][p.offset - start:p.offset - start + p.nbytes] = True
    gaps = [d[~covered[name]] for name, (d, _) in data.items()]
    assert sum(g.size for g in gaps) and not any(g.any() for g in gaps)  # padding there is, and it is zero


def test_every_piece_starts_aligned(written):
    url, _, manifest = written
    assert manifest["alignment"] == datafile.ALIGNMENT >= 64
    pieces = _pieces(url)
    assert any(p.nbytes >= datafile.ALIGN_FROM for _, p in pieces)
    for t, p in pieces:  # a large piece on an ALIGNMENT boundary, a small one on its dtype's size
        align = datafile.ALIGNMENT if p.nbytes >= datafile.ALIGN_FROM else DTYPES[t.dtype][1]
        assert p.offset % align == 0, (t.label, p)
    for name in _files(manifest):  # the data section itself starts on an ALIGNMENT boundary
        with open(os.path.join(url, name), "rb") as f:
            assert (8 + int.from_bytes(f.read(8), "little")) % datafile.ALIGNMENT == 0


def test_headers_agree_with_stock_parser(written):
    url, _, manifest = written
    for name in _files(manifest):
        path = os.path.join(url, name)
        with open(path, "rb") as fh:
            data = fh.read()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        assert (8 + n) % datafile.ALIGNMENT == 0
        assert set(header) == {"__metadata__", datafile.DATA_KEY}
        assert header[datafile.DATA_KEY]["data_offsets"] == [0, len(data) - 8 - n]
        with safe_open(path, "pt") as sf:
            assert list(sf.keys()) == [datafile.DATA_KEY]
            assert sf.get_slice(datafile.DATA_KEY).get_shape() == header[datafile.DATA_KEY]["shape"]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_lies_where_a_view_can_read_it_from_stock_safetensors(tmp_path, dtype):
    """Pieces of every dtype packed after an odd-sized one: each starts on a multiple of its
    dtype's size (of ``ALIGNMENT`` when large), so the stock library's ``U8`` tensor views it."""
    value = torch.arange(12).reshape(3, 4).to(torch_dtype(dtype)) if dtype != "bool" else torch.eye(3, 4, dtype=torch.bool)
    big = torch.zeros(datafile.ALIGN_FROM // value.element_size(), dtype=value.dtype)
    pieces = [torch.ones(3, dtype=torch.uint8), value, value[0, 0], big]
    entries = [datafile.Entry(str(i), dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
               for i, t in enumerate(pieces)]
    prefix, offsets, size = datafile.build_packed(entries, {"format": "gefen-ckpt", "version": "2.0"})
    blob = bytearray(size)
    blob[:len(prefix)] = prefix
    for off, t in zip(offsets, pieces):
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        blob[off:off + len(raw)] = raw
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(blob))
    data = load_file(str(path))[datafile.DATA_KEY]
    assert data.dtype == torch.uint8 and data.numel() == size - len(prefix)
    for off, t in zip(offsets[1:], pieces[1:]):
        at = off - len(prefix)
        assert off % (datafile.ALIGNMENT if t.numel() * t.element_size() >= datafile.ALIGN_FROM else t.element_size()) == 0
        view = data[at:at + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape)
        assert torch.equal(view.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_checksum_is_standard_crc32():
    data = os.urandom(100_000)
    assert checksum.update(checksum.update(0, data[:777]), data[777:]) == zlib.crc32(data)
    assert checksum.update(0, b"123456789") == 0xCBF43926  # the CRC-32/ISO-HDLC check value


@pytest.mark.skipif(not checksum.accelerated(), reason="no accelerated CRC-32 on this machine/build")
def test_accelerated_checksum_equals_zlib_at_every_length_and_alignment():
    data = np.random.default_rng(3).integers(0, 256, 70_000, dtype=np.uint8)
    lengths = list(range(0, 300)) + [4095, 4096, 4097, 65_536, 69_000]
    for offset in (0, 1, 7, 15):
        for n in lengths:
            piece = data[offset:offset + n]
            for start in (0, 0xDEADBEEF):
                assert checksum.update(start, piece) == zlib.crc32(piece, start), (offset, n, start)
    view = memoryview(bytearray(data.tobytes()))  # writable memoryview, as the reader passes
    assert checksum.update(0, view) == zlib.crc32(view)
    assert checksum.update(0, data.tobytes()) == zlib.crc32(data)  # read-only bytes


@pytest.mark.skipif(not native.io, reason="no fused read+checksum on this machine/build")
def test_fused_read_and_checksum(tmp_path):
    data = np.random.default_rng(4).integers(0, 256, 300_000, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    spans = [(0, 0), (5, 1), (17, 70_001), (100_000, 199_999), (299_990, 10), (299_995, 20), (400_000, 8)]
    outs = [np.full(n, 0xAB, np.uint8) for _, n in spans]
    fd = os.open(path, os.O_RDONLY)
    try:
        for chunk in (1, 4096, 2**20):
            got, crcs = native.read_hashed(fd, [o for o, _ in spans], [n for _, n in spans],
                                             [out.ctypes.data for out in outs], chunk)
            for (offset, n), out, g, crc in zip(spans, outs, got, crcs):
                stored = data[offset:offset + n]  # short at the end of the file: only what is there
                assert g == len(stored) and np.array_equal(out[:g], stored), (offset, n, chunk)
                assert crc == zlib.crc32(stored), (offset, n, chunk)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        native.read_hashed(fd, [0], [4], [outs[2].ctypes.data], 4096)  # a closed descriptor


@pytest.mark.parametrize("native", [True, False])
def test_checksums_of_ranges_in_memory(monkeypatch, native):
    if not native:
        monkeypatch.setattr("gefen_ckpt.io.native.lib", None)
    elif not checksum.accelerated():
        pytest.skip("no accelerated checksum on this machine/build")
    data = np.random.default_rng(5).integers(0, 256, 200_000, dtype=np.uint8)
    spans = [(0, 0), (3, 1), (7, 63), (64, 4096), (1, 150_001), (199_990, 10)]
    got = checksum.of_ranges(data, [o for o, _ in spans], [n for _, n in spans])
    assert got == [zlib.crc32(data[o:o + n]) for o, n in spans]


def test_header_text_is_what_json_dumps_writes():
    """The header is assembled as text for speed; it must stay byte-identical to json.dumps."""
    entries = [datafile.Entry("w", "float32", (3, 5), 60), datafile.Entry("c", "uint8", (7,), 7),
               datafile.Entry("s", "int64", (), 8)]
    prefix, offsets, size = datafile.build_packed(entries, {"format": "gefen-ckpt", "é": 'q"\\u\u00e9/x'})
    text = prefix[8:].rstrip(b" ")
    header = json.loads(text)
    assert text == json.dumps(header, separators=(",", ":")).encode()
    assert header[datafile.DATA_KEY] == {"dtype": "U8", "shape": [size - len(prefix)],
                                         "data_offsets": [0, size - len(prefix)]}
    assert offsets == [len(prefix), len(prefix) + 60, len(prefix) + 72]  # 60 bytes, 7, then 8 at a multiple of 8
    assert header["__metadata__"] == {"format": "gefen-ckpt", "é": 'q"\\u\u00e9/x'}
    assert datafile.packed_prefix(size - len(prefix), {"format": "gefen-ckpt", "é": 'q"\\u\u00e9/x'}) == prefix


def test_reads_refuse_a_destination_that_is_not_the_piece(written):
    url, _, manifest = written
    store = Store(url)
    m = open_checkpoint(store)
    t = next(t for t in m.tensors.values() if len(t.shape) == 2 and t.pieces[0].rows[1] - t.pieces[0].rows[0] > 1)
    piece = t.pieces[0]
    full = torch.empty((piece.rows[1] - piece.rows[0], *t.shape[1:]), dtype=torch_dtype(t.dtype))
    assert torch.equal(read_piece(store, t, piece, full), read_piece(store, t, piece))
    for bad in (torch.empty((2 * full.shape[0], *full.shape[1:]), dtype=full.dtype)[::2],  # strided
                full[1:],  # too small
                full.to("meta")):  # not in CPU memory
        with pytest.raises(ValueError, match="is not a contiguous"):
            read_piece(store, t, piece, bad)
