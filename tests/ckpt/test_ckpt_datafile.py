"""Data files are plain safetensors (the stock library reads them) with aligned tensor data."""

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
from gefen_ckpt import native
from gefen_ckpt.storage import Store
from gefen_ckpt.wire import checksum, datafile
from gefen_ckpt.wire.dtypes import DTYPES, torch_dtype
from gefen_ckpt.wire.manifest import open_checkpoint
from gefen_ckpt.wire.reader import read_piece

from ckpt_util import trained

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("format_1x")]  # 1.x internals; 2.0: test_format2.py


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model, opt = trained("hybrid_adamw")
    state = gefen_ckpt.export_canonical(opt, model=model)
    url = str(tmp_path_factory.mktemp("df") / "ck")
    gefen_ckpt.write(state, url, world_size=2, max_file_bytes=8192)
    return url, state, gefen_ckpt.read_manifest(url)


def _pieces(manifest):
    tensors = list(manifest["globals"].values())
    tensors += [t for e in manifest["params"].values() for t in e["fields"].values()]
    return [(t, p) for t in tensors for p in t["pieces"]]


def test_stock_safetensors_loads_every_file(written):
    url, _, manifest = written
    by_key = {}
    for f in manifest["files"]:
        path = os.path.join(url, f["name"])
        tensors = load_file(path)  # the stock validator: contiguous offsets, sizes, dtypes
        with safe_open(path, "pt") as sf:
            assert set(sf.keys()) == set(tensors)
            assert sf.metadata() == {"format": "gefen-ckpt", "version": "1.1"}
        by_key.update({(f["name"], k): v for k, v in tensors.items()})
    for t, p in _pieces(manifest):
        stored = by_key[(manifest["files"][p["file"]]["name"], p["key"])]
        assert str(stored.dtype).removeprefix("torch.") == t["dtype"]
        assert zlib.crc32(stored.contiguous().reshape(-1).view(torch.uint8).numpy()) == p["checksum"]
    pads = [v for (_, k), v in by_key.items() if k.startswith(datafile.PAD_PREFIX)]
    assert pads and all(v.dtype == torch.uint8 and not v.any() for v in pads)


def test_every_tensor_starts_aligned(written):
    _, _, manifest = written
    assert manifest["alignment"] == datafile.ALIGNMENT >= 64
    fp32 = [p for t, p in _pieces(manifest) if t["dtype"] == "float32"]
    assert fp32 and all(p["offset"] % datafile.ALIGNMENT == 0 for _, p in _pieces(manifest))


def test_headers_agree_with_stock_parser(written):
    url, _, manifest = written
    for f in manifest["files"]:
        path = os.path.join(url, f["name"])
        with open(path, "rb") as fh:
            data = fh.read()
        header = datafile.parse_header(data, len(data))
        assert (8 + int.from_bytes(data[:8], "little")) % datafile.ALIGNMENT == 0
        with safe_open(path, "pt") as sf:
            for key in sf.keys():
                assert list(sf.get_slice(key).get_shape()) == list(header[key][1])


def test_build_rejects_reserved_and_duplicate_keys():
    with pytest.raises(ValueError):
        datafile.build([datafile.Entry("a", "uint8", (1,), 1), datafile.Entry("a", "uint8", (1,), 1)], {})
    with pytest.raises(ValueError):
        datafile.build([datafile.Entry(datafile.PAD_PREFIX + "0", "uint8", (1,), 1)], {})


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_dtype_round_trips_through_stock_safetensors(tmp_path, dtype):
    value = torch.arange(12).reshape(3, 4).to(torch_dtype(dtype)) if dtype != "bool" else torch.eye(3, 4, dtype=torch.bool)
    entries = [datafile.Entry("x", dtype, (3, 4), value.numel() * value.element_size()),
               datafile.Entry("s", dtype, (), value.element_size())]
    prefix, offsets, size = datafile.build(entries, {})
    blob = bytearray(size)
    blob[:len(prefix)] = prefix
    for off, t in zip(offsets, [value, value[0, 0]]):
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        blob[off:off + len(raw)] = raw
        assert off % datafile.ALIGNMENT == 0
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(blob))
    try:
        loaded = load_file(str(path))
    except (TypeError, ValueError) as exc:  # an old safetensors without this dtype
        pytest.skip(f"safetensors cannot load {dtype}: {exc}")
    assert torch.equal(loaded["x"].view(torch.uint8), value.view(torch.uint8))
    assert loaded["s"].shape == ()


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
        monkeypatch.setattr("gefen_ckpt.native.lib", None)
    elif not checksum.accelerated():
        pytest.skip("no accelerated checksum on this machine/build")
    data = np.random.default_rng(5).integers(0, 256, 200_000, dtype=np.uint8)
    spans = [(0, 0), (3, 1), (7, 63), (64, 4096), (1, 150_001), (199_990, 10)]
    got = checksum.of_ranges(data, [o for o, _ in spans], [n for _, n in spans])
    assert got == [zlib.crc32(data[o:o + n]) for o, n in spans]


def test_header_text_is_what_json_dumps_writes():
    """The header is assembled as text for speed; it must stay byte-identical to json.dumps."""
    entries = [datafile.Entry("w", "float32", (3, 5), 60), datafile.Entry('q"\\u\u00e9/x@0:7', "uint8", (7,), 7),
               datafile.Entry("s", "int64", (), 8)]
    prefix, offsets, size = datafile.build(entries, {"format": "gefen-ckpt", "é": "x"})
    text = prefix[8:].rstrip(b" ")
    header = json.loads(text)
    assert text == json.dumps(header, separators=(",", ":")).encode()
    assert [header[e.key]["data_offsets"][0] + len(prefix) for e in entries] == offsets
    assert header["__metadata__"] == {"format": "gefen-ckpt", "é": "x"}


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
