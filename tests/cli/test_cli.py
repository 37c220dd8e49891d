"""The `gefen-ckpt` CLI, through Typer's runner and through the real console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import gefen_ckpt
from gefen import Gefen, contract_of
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire.manifest import open_checkpoint
from gefen_cli.app import app

runner = CliRunner()
COMMANDS = ["inspect", "verify", "diff", "convert", "reshard"]


# ----- fixtures -----------------------------------------------------------------------------
def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


def batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    # row/column scale structure, so the Gefen periods are not trivial
    x = torch.randn(64, 48, generator=g) * torch.linspace(0.1, 3.0, 48)
    return x, torch.randn(64, 8, generator=g)


def train(model, opt, steps: int, start: int = 0):
    for i in range(start, start + steps):
        x, y = batch(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def trained(kind: str = "gefen", steps: int = 3):
    model = make_model()
    if kind == "gefen":
        opt = Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    train(model, opt, steps)
    return model, opt


@pytest.fixture(scope="module")
def gefen_ckpt_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module, Gefen]:
    model, opt = trained("gefen")
    path = tmp_path_factory.mktemp("ckpt") / "step-3"
    gefen_ckpt.save(opt, str(path))
    return path, model, opt


@pytest.fixture(scope="module", params=["m8", "m4v4"])
def layout_ckpt_dir(request, tmp_path_factory) -> tuple[Path, torch.nn.Module, Gefen]:
    """A checkpoint of each Gefen layout."""
    model = make_model()
    opt = Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.01, moments=request.param)
    train(model, opt, 3)
    path = tmp_path_factory.mktemp("ckpt") / "step-3"
    gefen_ckpt.save(opt, str(path))
    return path, model, opt


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def script() -> list[str]:
    exe = Path(sys.executable).with_name("gefen-ckpt")
    found = str(exe) if exe.exists() else shutil.which("gefen-ckpt")
    return [found] if found else [sys.executable, "-m", "gefen_cli.app"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([*script(), *map(str, args)], capture_output=True, text=True, timeout=120, env=env)


def piece(path: Path, fqn: str, field: str) -> tuple[Path, int, int]:
    """(data file, byte offset, byte count) of the first stored piece of ``fqn/field``."""
    p = open_checkpoint(Store(str(path))).tensors[(fqn, field)].pieces[0]  # any format version
    return path / p.file, p.offset, p.nbytes


def flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def one_line_error(result, *needles: str, code: int = 1) -> None:
    """One line on stderr, exit 1 (the data) or ``code`` (2: the usage)."""
    stderr = result.stderr.strip()
    assert result.exit_code == code, (result.exit_code, result.output)
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("error:") and "Traceback" not in result.output
    for needle in needles:
        assert needle in stderr, (needle, stderr)


def canonical_bits(state) -> dict:
    return {k: src.read().reshape(-1).contiguous().view(torch.uint8).clone() for k, src in state.tensors()}


# ----- help ---------------------------------------------------------------------------------
def test_help_of_every_command():
    top = invoke("--help")
    assert top.exit_code == 0
    for command in COMMANDS:
        assert command in top.stdout
        result = invoke(command, "--help")
        assert result.exit_code == 0, result.output
        assert "Examples" in result.stdout and f"gefen-ckpt {command}" in result.stdout


# ----- inspect ------------------------------------------------------------------------------
def test_inspect_json_matches_the_optimizer(layout_ckpt_dir):
    path, model, opt = layout_ckpt_dir
    m8 = opt.moments == "m8"
    result = invoke("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["format"] == "gefen-ckpt" and info["format_version"]
    assert info["optimizer"]["implementation"] == "gefen.Gefen"
    assert info["step"] == 3
    assert info["param_groups"][0]["hyperparameters"]["lr"] == 1e-2
    by_fqn = {p["fqn"]: p for p in info["params"]}
    names = dict(model.named_parameters())
    assert list(by_fqn) == list(names)
    numel = 0
    for fqn, p in names.items():
        entry, state = by_fqn[fqn], opt.state[p]
        assert entry["shape"] == list(p.shape)
        assert entry["period"] == (int(state["period"]) if m8 else None)  # m4v4 has no block fields
        fields = {f["name"]: f for f in entry["fields"]}
        books = {f.name for f in contract_of(opt).global_fields}  # every entry holds the shared codebooks
        assert set(fields) == set(state) - books
        for name, value in state.items():
            if name in books:
                continue
            assert fields[name]["shape"] == list(value.shape)
            assert fields[name]["dtype"] == str(value.dtype).removeprefix("torch.")
        numel += p.numel()
    assert not m8 or any(p["period"] > 1 for p in info["params"])
    books = [info["codebook"]] if m8 else info["codebook"]
    assert [cb["key"] for cb in books] == (["codebook"] if m8 else ["codebook", "v_codebook"])
    for cb in books:
        assert cb["size"] == (256 if m8 else 16) and cb["min"] == -1.0 and cb["max"] == 1.0 and cb["sorted"]
        assert set(cb["quantiles"]) == {"0.05", "0.25", "0.5", "0.75", "0.95"}
    totals = info["totals"]
    assert totals["numel"] == numel and totals["params"] == len(names)
    unique = {id(t): t for s in opt.state.values() for t in s.values()}  # the codebooks are shared by every entry
    books = [b for b in (opt.codebook, getattr(opt, "v_codebook", None)) if b is not None]
    assert all(id(b) in unique for b in books) and sum(b.nbytes for b in books) == (256 if m8 else 2 * 16) * 4
    state_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    assert totals["state_bytes"] == state_bytes
    assert totals["bytes_per_param"] == pytest.approx(state_bytes / numel)
    assert totals["files"] >= 1 and totals["file_bytes"] > state_bytes


def test_inspect_table(gefen_ckpt_dir):
    path, model, _ = gefen_ckpt_dir
    result = invoke("inspect", path)
    assert result.exit_code == 0, result.output
    for needle in ("gefen.Gefen", "step", "codebook", "v_codebook", "16 codes", "totals", "B/param",
                   *dict(model.named_parameters())):
        assert needle in result.stdout, needle


def test_inspect_reads_no_tensor_data(gefen_ckpt_dir, tmp_path):
    src, _, _ = gefen_ckpt_dir
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    file, offset, _ = piece(path, "0.weight", "mv_code")
    flip_byte(file, offset)  # a read of 0.weight/mv_code would fail its checksum
    assert invoke("inspect", path, "--json").exit_code == 0
    assert invoke("verify", path).exit_code == 1


def test_inspect_verifies_the_codebook_it_reads(gefen_ckpt_dir, tmp_path):
    src, _, _ = gefen_ckpt_dir
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    p = open_checkpoint(Store(str(path))).tensors[(None, "codebook")].pieces[0]
    flip_byte(path / p.file, p.offset + 5)
    one_line_error(invoke("inspect", path), "checksum mismatch", "codebook")


_WITHOUT_TORCH = """
import sys
from gefen_cli.app import main
sys.argv = ["gefen-ckpt", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
assert "torch" not in sys.modules, "torch was imported"
"""


@pytest.mark.parametrize("command", [("inspect",), ("inspect", "--json"), ("verify",), ("verify", "--json")])
def test_inspect_and_verify_of_a_portable_checkpoint_do_not_import_torch(gefen_ckpt_dir, command):
    """Importing torch takes seconds; a manifest and checksums need none of it."""
    src, _, _ = gefen_ckpt_dir
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, command[0], str(src), *command[1:]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert str(src) in done.stdout or "params" in done.stdout


# ----- verify -------------------------------------------------------------------------------
def test_verify_good_and_corrupt(gefen_ckpt_dir, tmp_path):
    src, _, _ = gefen_ckpt_dir
    good = invoke("verify", src)
    assert good.exit_code == 0 and "OK" in good.stdout
    report = json.loads(invoke("verify", src, "--json").stdout)
    assert report["ok"] and report["problems"] == [] and report["tensors"] > 0

    path = tmp_path / "bad"
    shutil.copytree(src, path)
    file, offset, nbytes = piece(path, "3.weight", "m_row_scale")
    flip_byte(file, offset + nbytes - 1)
    bad = invoke("verify", path)
    assert bad.exit_code == 1
    assert file.name in bad.stderr and "checksum" in bad.stderr and "3.weight/m_row_scale" in bad.stderr
    assert "FAILED" in bad.stderr
    report = json.loads(invoke("verify", path, "--json").stdout)
    assert not report["ok"] and any(file.name in p for p in report["problems"])


# ----- diff ---------------------------------------------------------------------------------
def test_diff_equal_unequal_and_atol(gefen_ckpt_dir, tmp_path):
    src, model, opt = gefen_ckpt_dir
    same = tmp_path / "same"
    gefen_ckpt.save(opt, str(same))
    equal = invoke("diff", src, same)
    assert equal.exit_code == 0 and "equal" in equal.stdout

    # a tiny change in one float field: different bit-exact, equal within a tolerance
    state = gefen_ckpt.read(str(src)).materialize()
    state.params["0.weight"].fields["v_row"].tensor.view(-1)[0] += 1e-6
    nudged = tmp_path / "nudged"
    gefen_ckpt.write(state, str(nudged))
    exact = invoke("diff", src, nudged, "--json")
    assert exact.exit_code == 1
    report = json.loads(exact.stdout)
    assert not report["equal"] and [d["key"] for d in report["differences"]] == ["0.weight/v_row"]
    assert report["differences"][0]["count"] == 1
    assert invoke("diff", src, nudged, "--atol", "1e-4").exit_code == 0
    assert invoke("diff", src, nudged, "--atol", "1e-9").exit_code == 1
    # a small --chunk streams many row chunks and finds the same thing
    assert invoke("diff", src, nudged, "--chunk", "64").exit_code == 1
    assert invoke("diff", src, same, "--chunk", "64").exit_code == 0

    # one more step: values and the step differ
    model2, opt2 = trained("gefen", steps=4)
    later = tmp_path / "later"
    gefen_ckpt.save(opt2, str(later))
    different = invoke("diff", src, later)
    assert different.exit_code == 1 and "different" in different.stdout and "step" in different.stdout


# ----- convert ------------------------------------------------------------------------------
def test_convert_portable_torch_portable(gefen_ckpt_dir, tmp_path):
    src, model, opt = gefen_ckpt_dir
    pt = tmp_path / "opt.pt"
    result = invoke("convert", src, pt, "--to", "torch")
    assert result.exit_code == 0, result.output
    sd = torch.load(pt, map_location="cpu", weights_only=True)
    fresh_model = make_model()
    fresh_model.load_state_dict(model.state_dict())
    fresh = Gefen(fresh_model.named_parameters(), lr=1e-2, weight_decay=0.01)
    fresh.load_state_dict(sd)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        for name, value in opt.state[p].items():
            assert torch.equal(value, fresh.state[q][name]), name
    assert torch.equal(fresh.codebook, opt.codebook)

    back = tmp_path / "back"
    result = invoke("convert", pt, back, "--to", "portable")
    assert result.exit_code == 0, result.output
    a, b = canonical_bits(gefen_ckpt.read(str(src))), canonical_bits(gefen_ckpt.read(str(back)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert gefen_ckpt.read(str(back)).contract == gefen_ckpt.read(str(src)).contract
    assert invoke("diff", src, back).exit_code == 0
    assert invoke("diff", src, pt).exit_code == 0  # a portable checkpoint against a torch file


def test_convert_torch_adamw_to_portable_then_inspect(tmp_path):
    model, opt = trained("adamw")
    pt = tmp_path / "adamw.pt"
    torch.save(opt.state_dict(), pt)
    out = tmp_path / "adamw-portable"
    result = invoke("convert", pt, out, "--to", "portable")
    assert result.exit_code == 0, result.output
    info = json.loads(invoke("inspect", out, "--json").stdout)
    assert info["optimizer"]["implementation"] == "torch.optim.AdamW"
    assert info["step"] == 3
    by_fqn = {p["fqn"]: p for p in info["params"]}
    for fqn, p in model.named_parameters():
        assert by_fqn[fqn]["shape"] == list(p.shape)
        assert {f["name"] for f in by_fqn[fqn]["fields"]} == {"step", "exp_avg", "exp_avg_sq"}
        assert by_fqn[fqn]["period"] is None
    assert info["totals"]["bytes_per_param"] > 8  # two fp32 moments (+ the per-parameter step)
    fresh = torch.optim.AdamW(make_model().named_parameters(), lr=1e-2)
    gefen_ckpt.load(fresh, str(out))
    for p, q in zip(model.parameters(), [q for g in fresh.param_groups for q in g["params"]]):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh.state[q]["exp_avg_sq"])
    # naming the optimizer explicitly works too, and a wrong name is a clear error
    assert invoke("convert", pt, tmp_path / "as-adam", "--to", "portable", "--optimizer", "Adam").exit_code == 0
    one_line_error(invoke("convert", pt, tmp_path / "x", "--to", "portable", "--optimizer", "Gefen"),
                       "holds torch.optim.AdamW state", "--into")


# ----- errors -------------------------------------------------------------------------------
def test_clear_one_line_errors(tmp_path, gefen_ckpt_dir):
    src, _, _ = gefen_ckpt_dir
    missing = tmp_path / "nope"
    for args in (("inspect", missing), ("verify", missing), ("diff", missing, src),
                 ("convert", missing, tmp_path / "o", "--to", "torch")):
        one_line_error(invoke(*args), "nope")
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    one_line_error(invoke("inspect", junk), "not a checkpoint")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    one_line_error(invoke("inspect", empty), "no committed checkpoint")
    assert invoke("verify", empty).exit_code == 1  # verify reports it as a problem

    model = make_model()
    unnamed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, unnamed, 1)
    pt = tmp_path / "unnamed.pt"
    torch.save(unnamed.state_dict(), pt)
    one_line_error(invoke("convert", pt, tmp_path / "o2", "--to", "portable"), "named_parameters")
    assert invoke("convert", src, tmp_path / "o3", "--to", "dense").exit_code == 2  # usage error


# ----- URLs ---------------------------------------------------------------------------------
def test_memory_and_file_urls(gefen_ckpt_dir):
    src, model, opt = gefen_ckpt_dir
    mem = "memory://cli-test/run/step-3"
    gefen_ckpt.save(opt, mem)
    info = json.loads(invoke("inspect", mem, "--json").stdout)
    assert info["optimizer"]["implementation"] == "gefen.Gefen" and info["step"] == 3
    assert invoke("verify", mem).exit_code == 0
    assert invoke("convert", mem, "memory://cli-test/run/opt.pt", "--to", "torch").exit_code == 0
    assert invoke("convert", "memory://cli-test/run/opt.pt", "memory://cli-test/run/back", "--to",
                  "portable").exit_code == 0
    assert invoke("diff", mem, "memory://cli-test/run/back").exit_code == 0
    assert invoke("diff", f"file://{src}", "memory://cli-test/run/opt.pt").exit_code == 0
    assert invoke("inspect", f"file://{src}").exit_code == 0
    one_line_error(invoke("inspect", "memory://cli-test/absent"), "absent")


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on loopback, s3fs as the client (skipped where they are not installed)."""
    import fsspec

    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"key": "testing", "secret": "testing",
                                "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("gefen-cli-bucket")
    try:
        yield
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        fsspec.filesystem("s3").clear_instance_cache()
        server.stop()


def test_s3_urls(gefen_ckpt_dir, s3_endpoint):
    src, _, opt = gefen_ckpt_dir
    url = "s3://gefen-cli-bucket/run/step-3"
    gefen_ckpt.save(opt, url)
    info = json.loads(invoke("inspect", url, "--json").stdout)
    assert info["step"] == 3 and info["totals"]["files"] >= 1
    assert invoke("verify", url).exit_code == 0
    assert invoke("convert", url, "s3://gefen-cli-bucket/run/opt.pt", "--to", "torch").exit_code == 0
    assert invoke("diff", src, "s3://gefen-cli-bucket/run/opt.pt").exit_code == 0
    one_line_error(invoke("inspect", "s3://gefen-cli-bucket/absent"), "absent")


# ----- the real console script ---------------------------------------------------------------
def test_console_script(gefen_ckpt_dir, tmp_path):
    src, model, opt = gefen_ckpt_dir
    assert run_script("--help").returncode == 0

    done = run_script("inspect", src, "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    shapes = {p["fqn"]: p["shape"] for p in info["params"]}
    assert shapes == {n: list(p.shape) for n, p in model.named_parameters()} and info["step"] == 3

    path = tmp_path / "bad"
    shutil.copytree(src, path)
    file, offset, _ = piece(path, "0.weight", "mv_code")
    flip_byte(file, offset)
    done = run_script("verify", path)
    assert done.returncode == 1 and file.name in done.stderr and "Traceback" not in done.stderr
    # (one-line errors with exit code 2 are checked in-process above: each script run costs a torch import)


def test_hybrid_round_trip(tmp_path):
    import gefen

    if not hasattr(gefen, "GefenMuonHybrid"):
        pytest.skip("GefenMuonHybrid not merged")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    opt = gefen.GefenMuonHybrid(model, lr=1e-2)
    for i in range(2):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        opt.step()
    src, pt, back = tmp_path / "hy", tmp_path / "hy.pt", tmp_path / "back"
    gefen_ckpt.save(opt, str(src))
    info = json.loads(invoke("inspect", src, "--json").stdout)
    assert info["optimizer"]["children"] == [["muon", "gefen.GefenMuon"], ["backup", "gefen.Gefen"]]
    assert {p["child"] for p in info["params"]} == {"muon", "backup"}
    assert invoke("convert", src, pt, "--to", "torch").exit_code == 0
    assert invoke("convert", pt, back, "--to", "portable").exit_code == 0
    assert invoke("diff", src, back).exit_code == 0
    # a plain torch.save of the hybrid's state_dict records its contract; one saved before it did
    # (no CONTRACT_KEY) needs the optimizer named
    from gefen.contract import CONTRACT_KEY

    torch.save(opt.state_dict(), tmp_path / "new.pt")
    assert invoke("convert", tmp_path / "new.pt", tmp_path / "n", "--to", "portable").exit_code == 0
    raw = tmp_path / "raw.pt"
    torch.save({k: v for k, v in opt.state_dict().items() if k != CONTRACT_KEY}, raw)
    one_line_error(invoke("convert", raw, tmp_path / "r", "--to", "portable"), "GefenMuonHybrid")
    assert invoke("convert", raw, tmp_path / "r", "--to", "portable", "--optimizer", "GefenMuonHybrid").exit_code == 0
    assert invoke("diff", src, tmp_path / "r").exit_code == 0  # only the contract version is unrecorded (a note)
