"""Trials of the reliability failure classes, runnable against any checkout of this repository.

Usage (one checkout, or another one to compare with)::

    python benchmarks/reliability_trials.py                      # this checkout
    git archive main | tar -x -C /tmp/base && cp gefen/*.so /tmp/base/gefen/ && \\
        cp gefen_ckpt/*.so /tmp/base/gefen_ckpt/ && python benchmarks/reliability_trials.py --root /tmp/base

Each class runs a number of trials through public behaviour only (the API, the CLI, files on
disk), so the same script measures an older checkout; a trial fails when the outcome is the
defect the class names (a destroyed checkpoint, a non-``CheckpointError``, a flipped manifest
accepted, a half-applied load, an unbounded decode, a hang, a traceback, a leaked file).
Hooks slow or break one step where a race or a full disk would. Prints a markdown table and
writes ``benchmarks/out/reliability.json``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _setup(root: Path) -> None:
    sys.path[:0] = [str(root), str(root / "tests")]


# ----- helpers ------------------------------------------------------------------------------
def _trained(kind="adamw", seed=0, steps=1):
    from ckpt_util import trained

    return trained(kind, steps=steps, seed=seed)


def _loads(url, kind="adamw") -> bool:
    import gefen_ckpt

    from ckpt_util import fresh_like, make_model

    model = make_model(0)
    clone, fresh = fresh_like(model, kind)
    try:
        gefen_ckpt.load(fresh, url, model=clone)
        return True
    except Exception:  # noqa: BLE001 - a trial outcome
        return False


def _rewrite(url, change) -> None:
    import msgpack

    from gefen_ckpt.wire import manifest as mf

    path = os.path.join(url, mf.MANIFEST_NAME)
    with open(path, "rb") as f:
        m = msgpack.unpackb(f.read())
    change(m)
    data = mf.encode(m) if hasattr(mf, "encode") else msgpack.packb(m)
    with open(path, "wb") as f:
        f.write(data)


# ----- 1. concurrent writers ----------------------------------------------------------------
def concurrent_writers_delayed(n: int) -> dict:
    """Writer Y is held just before publishing its manifest while writer X saves; afterwards the
    committed checkpoint must load and every failure be a CheckpointError."""
    import gefen_ckpt
    import gefen_ckpt.io.storage as storage

    failures = 0
    real = storage.LocalStore.publish
    for i in range(n):
        url = tempfile.mkdtemp()
        model, opt = _trained(seed=i)
        gefen_ckpt.save(opt, url, model=model)
        at_publish, x_done = threading.Event(), threading.Event()

        def publish(self, *args, at_publish=at_publish, x_done=x_done, **kwargs):
            if threading.current_thread().name == "Y":
                at_publish.set()
                x_done.wait(20)
            return real(self, *args, **kwargs)

        storage.LocalStore.publish = publish
        errors = []

        def save_y(opt=opt, url=url, model=model, errors=errors, at_publish=at_publish):
            try:
                gefen_ckpt.save(opt, url, model=model)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                at_publish.set()

        y = threading.Thread(target=save_y, name="Y")
        y.start()
        at_publish.wait(20)
        try:
            gefen_ckpt.save(opt, url, model=model)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        x_done.set()
        y.join(30)
        storage.LocalStore.publish = real
        bad_error = any(not isinstance(e, gefen_ckpt.CheckpointError) for e in errors)
        failures += int(bad_error or not _loads(url))
        shutil.rmtree(url, ignore_errors=True)
    return {"trials": n, "failures": failures}


def _racer(root: str, url: str, rounds: int, seed: int, out) -> None:
    _setup(Path(root))
    import gefen_ckpt

    model, opt = _trained(seed=seed)
    other = 0
    for _ in range(rounds):
        try:
            gefen_ckpt.save(opt, url, model=model)
        except gefen_ckpt.CheckpointError:
            pass
        except Exception:  # noqa: BLE001 - the defect: a bare error
            other += 1
    out.put(other)


def concurrent_writers_racing(n: int, root: Path) -> dict:
    """Two processes saving to one location n/2 times each: a trial fails when a save raises
    something other than a CheckpointError; plus one failure if the result does not load."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    url, out = tempfile.mkdtemp(), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(root), url, n // 2, s, out)) for s in (0, 1)]
    for p in procs:
        p.start()
    bad = sum(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(60)
    bad += int(not _loads(url))
    shutil.rmtree(url, ignore_errors=True)
    return {"trials": n, "failures": bad}


# ----- 2. listing race ----------------------------------------------------------------------
def listing_race(n: int) -> dict:
    """An unrelated file is deleted between the directory read and its stat(): the committed
    checkpoint must still be found."""
    import gefen_ckpt
    import gefen_ckpt.io.storage as storage

    url = tempfile.mkdtemp()
    model, opt = _trained()
    gefen_ckpt.save(opt, url, model=model)
    real = os.scandir

    class Vanishing:
        def __init__(self, path):
            junk = os.path.join(url, "junk.tmp")
            open(junk, "wb").close()
            self.it = real(path)
            self.entries = list(self.it)
            os.unlink(junk)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            self.it.close()

    failures = 0
    storage.os.scandir = Vanishing
    try:
        for _ in range(n):
            try:
                gefen_ckpt.read_manifest(url)
            except gefen_ckpt.CheckpointError:
                failures += 1
    finally:
        storage.os.scandir = real
    shutil.rmtree(url, ignore_errors=True)
    return {"trials": n, "failures": failures}


# ----- 3. manifest bit flips ----------------------------------------------------------------
def manifest_flips() -> dict:
    """Every single-bit flip (bits 0 and 7 of each byte) of an AdamW manifest: a trial fails
    when the flipped manifest is accepted (decoded and validated)."""
    import gefen_ckpt
    from gefen_ckpt.wire import manifest as mf

    url = tempfile.mkdtemp()
    model, opt = _trained()
    gefen_ckpt.save(opt, url, model=model)
    data = Path(url, mf.MANIFEST_NAME).read_bytes()
    trials = failures = 0
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            flipped = bytearray(data)
            flipped[i] ^= bit
            trials += 1
            try:
                mf.validate(mf.decode(bytes(flipped)))
                failures += 1
            except gefen_ckpt.CheckpointError:
                pass
    shutil.rmtree(url, ignore_errors=True)
    return {"trials": trials, "failures": failures, "note": f"{len(data)}-byte manifest"}


# ----- 4. half-applied torch loads ----------------------------------------------------------
def torch_missing_fields() -> dict:
    """AdamW checkpoints lacking one parameter's ``step`` or ``exp_avg``: a trial fails when the
    load is not refused with a CheckpointError before changing the optimizer, or when the
    optimizer cannot step afterwards."""
    import gefen_ckpt

    from ckpt_util import same, snapshot, train

    model, opt = _trained(steps=2)
    trials = failures = 0
    for fqn in [n for n, _ in model.named_parameters()]:
        for field in ("step", "exp_avg"):
            url = tempfile.mkdtemp()
            gefen_ckpt.save(opt, url, model=model)
            _rewrite(url, lambda m, f=fqn, x=field: m["params"][f]["fields"].pop(x))
            target_model, target = _trained(seed=3)
            before = snapshot(target, target_model)
            trials += 1
            try:
                gefen_ckpt.load(target, url, model=target_model)
                refused = False
            except gefen_ckpt.CheckpointError:
                refused = True
            except Exception:  # noqa: BLE001
                refused = False
            untouched = same(snapshot(target, target_model), before)
            try:
                train(target_model, target, 1)
                steps = True
            except Exception:  # noqa: BLE001
                steps = False
            failures += int(not (refused and untouched and steps))
            shutil.rmtree(url, ignore_errors=True)
    return {"trials": trials, "failures": failures}


# ----- 5. unbounded decoding ----------------------------------------------------------------
def _hostile(kind: str, size: int) -> bytes:
    from gefen_ckpt.wire import manifest as mf

    body = {"empty maps": lambda: [{} for _ in range(size)], "nils": lambda: [None] * size,
            "short strings": lambda: ["ab"] * (size // 3), "small maps": lambda: [{"ab": "cd"} for _ in range(size // 7)],
            "pairs": lambda: [[[], []] for _ in range(size // 3)]}[kind]()
    return mf.encode({"format": "gefen-ckpt", "version": [2, 0], "metadata": {"x": body}})  # a valid checksum


def decoding_bombs(size: int = 4 * 2**20) -> dict:
    """Hostile manifests of ``size`` bytes: a trial fails when decoding and validating it costs
    more than 32x its size in Python objects or more than 10 s."""
    from gefen_ckpt.wire import manifest as mf

    kinds = ["empty maps", "nils", "short strings", "small maps", "pairs"]
    failures, worst = 0, {}
    for kind in kinds:
        data = _hostile(kind, size)
        tracemalloc.start()
        started = time.perf_counter()
        try:
            mf.validate(mf.decode(data))
        except Exception:  # noqa: BLE001
            pass
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        worst[kind] = round(peak / len(data), 1)
        failures += int(peak > 32 * len(data) or seconds > 10)
    return {"trials": len(kinds), "failures": failures, "note": f"peak/size {worst}"}


def shape_check_before_read() -> dict:
    """A manifest whose parameter shape differs from the live model's: a trial fails when any
    tensor data is read before the refusal."""
    import gefen_ckpt
    import gefen_ckpt.wire.reader as reader

    url = tempfile.mkdtemp()
    model, opt = _trained()
    gefen_ckpt.save(opt, url, model=model)

    def change(m):  # up.weight declared 24 x 32 (the same bytes: a valid manifest of another model)
        entry = m["params"]["up.weight"]
        entry["shape"] = [24, 32]
        for f in ("exp_avg", "exp_avg_sq"):
            entry["fields"][f]["shape"] = [24, 32]
            for piece in entry["fields"][f]["pieces"]:
                piece["rows"] = [0, 24]

    _rewrite(url, change)
    read, refused = [], []
    real = reader.stage_state

    def counting(*args, **kwargs):
        read.append(1)
        return real(*args, **kwargs)

    reader.stage_state = counting
    try:
        target_model, target = _trained(seed=3)
        try:
            gefen_ckpt.load(target, url, model=target_model)
        except gefen_ckpt.CheckpointMismatchError:
            refused.append(1)
    finally:
        reader.stage_state = real
    shutil.rmtree(url, ignore_errors=True)
    return {"trials": 1, "failures": int(bool(read) or not refused)}


# ----- 6. hangs -----------------------------------------------------------------------------
def _stall_world(rank: int, world_size: int, url: str, phase: str, stall: float) -> float | None:
    import torch

    import gefen_ckpt
    import gefen_ckpt.dist.sharded as sharded_io

    from ckpt_util import make_model

    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 40, (2, 4))).sum().backward()
    opt.step()
    if phase == "load":
        gefen_ckpt.save(opt, url, model=model)
    name = "write_pieces" if phase == "save" else "open_checkpoint"
    real = getattr(sharded_io, name)

    def slow(*args, **kwargs):
        if rank == 1:
            time.sleep(stall)
        return real(*args, **kwargs)

    setattr(sharded_io, name, slow)
    started = time.monotonic()
    call = gefen_ckpt.save if phase == "save" else gefen_ckpt.load
    try:
        try:
            call(opt, url, model=model, timeout=5.0)
        except TypeError:  # an API without the timeout parameter
            call(opt, url, model=model)
    except Exception:  # noqa: BLE001 - raised: how long it took is the outcome
        return time.monotonic() - started
    return None


def stalled_rank(stall: float = 40.0) -> dict:
    """Rank 1 of 2 stalls ``stall`` s in a save and in a load: a trial fails unless rank 0
    raises within 15 s."""
    from distributed import run

    failures = 0
    for phase in ("save", "load"):
        url = tempfile.mkdtemp()
        try:
            seconds = run(_stall_world, 2, url + "/ck", phase, stall, timeout=300)[0]
        except Exception:  # noqa: BLE001
            seconds = None
        failures += int(seconds is None or seconds > 15)
        shutil.rmtree(url, ignore_errors=True)
    return {"trials": 2, "failures": failures}


def _silent_server() -> tuple[socket.socket, int]:
    """A TCP endpoint that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def s3_silent_endpoint() -> dict:
    """An S3 endpoint that accepts and never answers, with a 2 s timeout asked through the API:
    a trial fails unless a CheckpointError arrives within 30 s."""
    import gefen_ckpt

    server, port = _silent_server()
    options = {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{port}", "skip_instance_cache": True,
               "config_kwargs": {"connect_timeout": 2, "read_timeout": 2, "retries": {"max_attempts": 1}}}
    started, ok = time.monotonic(), False
    try:
        gefen_ckpt.read_manifest("s3://bucket/ck", storage_options=options)
    except gefen_ckpt.CheckpointError:
        ok = time.monotonic() - started < 30
    except Exception:  # noqa: BLE001 - no such parameter, or a raw backend exception
        pass
    server.close()
    return {"trials": 1, "failures": int(not ok)}


# ----- 7. errors ----------------------------------------------------------------------------
def _cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from cli.app import main; sys.argv[0] = 'gefen-ckpt'; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, timeout=180)


def cli_errors(root: Path) -> dict:
    """A trial fails on a traceback, a wrong exit code (1 for data errors and verify's problems;
    an older checkout: 2 for errors), or an error line that does not name the path."""
    import gefen_ckpt

    url = tempfile.mkdtemp()
    model, opt = _trained("gefen_factored")
    gefen_ckpt.save(opt, url, model=model)
    cases = []

    def variant(change):
        dst = tempfile.mkdtemp()
        shutil.copytree(url, dst, dirs_exist_ok=True)
        _rewrite(dst, change)
        return dst

    def float8(m):
        m["contract"]["global_fields"][0]["dtype"] = "float8_e4m3fn"
        book = m["globals"]["codebook"]
        book["dtype"] = "float8_e4m3fn"
        piece = book["pieces"][0]
        piece["bytes"] //= 4
        book["shape"] = [piece["bytes"]]
        piece["rows"] = [0, piece["bytes"]]

    path = variant(float8)
    cases.append(("inspect float8 codebook", _cli(root, "inspect", path), {0, 1, 2}, path))
    for what, change in (("schema 99", lambda m: m["contract"].__setitem__("schema_version", 99)),
                         ("no codebook", lambda m: m["globals"].pop("codebook")),
                         ("no m_code", lambda m: next(iter(m["params"].values()))["fields"].pop("m_code"))):
        path = variant(change)
        cases.append((f"verify {what}", _cli(root, "verify", path), {1}, path))
    server, port = _silent_server()
    server.close()  # nothing listens: connection refused
    s3 = {"FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "FSSPEC_S3_KEY": "k", "FSSPEC_S3_SECRET": "s"}
    cases.append(("inspect unreachable s3", _cli(root, "inspect", "s3://bucket/ck", env=s3), {1, 2}, "bucket/ck"))
    cases.append(("verify unreachable s3", _cli(root, "verify", "s3://bucket/ck", env=s3), {1, 2}, "bucket/ck"))
    failures, notes = 0, []
    for what, done, codes, path in cases:
        bad = ("Traceback" in done.stderr or done.returncode not in codes
               or ("error:" in done.stderr and path not in done.stderr))
        failures += int(bad)
        if bad:
            notes.append(f"{what}: exit {done.returncode}")
    # disk full: the API error must name the file
    import gefen_ckpt.io.storage as storage

    real = storage.LocalWriter._write_out

    def full(self, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    storage.LocalWriter._write_out = full
    dst = tempfile.mkdtemp()
    try:
        gefen_ckpt.save(opt, dst, model=model, max_file_bytes=2**20)
        named = False
    except OSError as exc:
        named = dst in str(exc)
    finally:
        storage.LocalWriter._write_out = real
    failures += int(not named)
    if not named:
        notes.append("disk full: no path")
    return {"trials": len(cases) + 1, "failures": failures, "note": "; ".join(notes)}


# ----- 8. leaks -----------------------------------------------------------------------------
def failed_commit_leaks(n: int) -> dict:
    """Saves that fail at the commit (ENOSPC writing the manifest; a failed rename): a trial
    fails when files beyond the previous checkpoint's remain."""
    import gefen_ckpt
    import gefen_ckpt.io.storage as storage

    failures = trials = 0
    model, opt = _trained()
    for where in ("manifest write", "rename"):
        url = tempfile.mkdtemp()
        gefen_ckpt.save(opt, url, model=model)
        before = set(os.listdir(url))
        real_replace, real_create = storage.os.replace, storage.Store.create

        def replace(*args):
            raise OSError(errno.EIO, "Input/output error")

        def create(self, name, durable=True, real_create=real_create):
            if name.startswith("manifest.msgpack"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_create(self, name, durable)

        if where == "rename":
            storage.os.replace = replace
        else:
            storage.Store.create = create
        try:
            for _ in range(n // 2):
                trials += 1
                try:
                    gefen_ckpt.save(opt, url, model=model)
                except Exception:  # noqa: BLE001
                    pass
                failures += int(set(os.listdir(url)) != before)
                before = before | set(os.listdir(url))  # count each retry's new leak once
        finally:
            storage.os.replace, storage.Store.create = real_replace, real_create
        shutil.rmtree(url, ignore_errors=True)
    return {"trials": trials, "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=HERE.parent, help="checkout to test")
    parser.add_argument("--quick", action="store_true", help="fewer trials, no distributed stall")
    args = parser.parse_args()
    root = args.root.resolve()
    _setup(root)
    import torch

    torch.set_num_threads(1)
    n = 4 if args.quick else 20
    classes = {
        "1. concurrent writers (Y held at publish, X saves)": lambda: concurrent_writers_delayed(n // 2),
        "1. concurrent writers (2 processes racing)": lambda: concurrent_writers_racing(10 * n, root),
        "2. listing race (a file vanishes mid-listing)": lambda: listing_race(10 * n),
        "3. manifest single-bit flips accepted": manifest_flips,
        "4. torch load missing step/exp_avg": torch_missing_fields,
        "5. decoding bombs (4 MiB)": decoding_bombs,
        "5. shape check before any data read": shape_check_before_read,
        "6. stalled rank (save, load)": stalled_rank,
        "6. silent S3 endpoint, 2 s timeout asked": s3_silent_endpoint,
        "7. CLI/API errors (traceback, exit code, path)": lambda: cli_errors(root),
        "8. failed commit leaks (disk full, rename)": lambda: failed_commit_leaks(n // 2),
    }
    if args.quick:
        classes.pop("6. stalled rank (save, load)")
    results = {}
    for name, trial in classes.items():
        started = time.perf_counter()
        try:
            results[name] = trial()
        except Exception as exc:  # noqa: BLE001 - the table says so
            results[name] = {"trials": 0, "failures": 0, "note": f"could not run: {type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {results[name]}", flush=True)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "reliability.json").write_text(json.dumps({"root": str(root), "results": results}, indent=2))
    print("\n| failure class | trials | failures |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['trials']} | {r['failures']} |")


if __name__ == "__main__":
    main()
