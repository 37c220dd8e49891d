"""Live healing through ``gefen_ckpt.torchft_transport.GefenTransport`` (torchft's
``CheckpointTransport``). Between two gloo ranks: the healthy replica sends its state as torchft's
Manager calls ``send_checkpoint``, the rejoining one receives it with ``recv_checkpoint``, loads it
as the Manager's ``load_state_dict`` callbacks would, and both continue: the continuations must be
bit-identical, also when each replica group is FSDP2-sharded over two ranks (rank i heals from
rank i; shards that are not the receiving rank's part are refused). A byte flipped in transit is
refused; a sender that stalls (before or mid-transfer) is named by the timeout, one that dies
mid-transfer as soon as its connection drops, and nothing is applied.
Then with torchft's real Manager and lighthouse (examples/torchft_heal.py): a replica killed
mid-run heals and ends bit-identical; a corrupted heal is refused, a heal whose sender stalls
mid-transfer times out, and in both cases the Manager's retry heals."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft", exc_type=ImportError)  # absent, or installed but unusable

from gefen import Gefen, GefenMuon, GefenMuonHybrid  # noqa: E402
from gefen_ckpt.errors import CheckpointCorruptError, CheckpointTimeoutError  # noqa: E402
from gefen_ckpt.torchft_transport import GefenTransport, decode_state, encode_state  # noqa: E402

from distributed import run  # noqa: E402

pytestmark = pytest.mark.dist
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchft_heal.py"
TIMEOUT = timedelta(seconds=20)
HEAL_AT, AFTER = 3, 2


def _model(seed: int, bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=bias), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=bias))


def _optimizer(kind: str, model: torch.nn.Module):
    if kind in ("m4v4", "m8"):
        return Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.1, moments=kind, factored_v_2d=kind == "m4v4")
    if kind == "muon":
        return GefenMuon(list(model.named_parameters()), lr=1e-2)
    return GefenMuonHybrid(model, lr=1e-2)


def _steps(model, opt, first: int, count: int) -> None:
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(100 + step)
        model.zero_grad()
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()


def _manager_state(model, opt, step: int) -> dict:
    """What torchft's Manager hands ``send_checkpoint``: the user state plus its own counters."""
    return {"user": {"default": {"model": model.state_dict(), "optim": opt.state_dict()}},
            "torchft": {"step": step, "batches_committed": 2 * step}}


def _snapshot(model, opt) -> dict:
    return {"params": {k: v.clone() for k, v in model.state_dict().items()},
            "groups": opt.state_dict()["param_groups"], "tensors": _optim_tensors(opt)}


def _optim_tensors(opt) -> dict:
    return {f"{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


def _heal(rank: int, world_size: int, kind: str) -> dict:
    pg = dist.distributed_c10d._get_default_group()
    transport = GefenTransport(pg, TIMEOUT)
    model = _model(seed=0 if rank == 0 else 1, bias=kind != "muon")  # the rejoining replica starts elsewhere
    opt = _optimizer(kind, model)
    if rank == 0:
        _steps(model, opt, 0, HEAL_AT)
        transport.send_checkpoint([1], HEAL_AT, _manager_state(model, opt, HEAL_AT), TIMEOUT)
        transport.disallow_checkpoint()
        before = None
    else:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        got = transport.recv_checkpoint(0, transport.metadata(), HEAL_AT, TIMEOUT)
        user = got["user"]["default"]
        model.load_state_dict(user["model"])
        opt.load_state_dict(user["optim"])
        assert got["torchft"] == {"step": HEAL_AT, "batches_committed": 2 * HEAL_AT}
    _steps(model, opt, HEAL_AT, AFTER)
    transport.shutdown()
    return {"after": _snapshot(model, opt), "before": before,
            "sent": transport.last_send.bytes, "received": transport.last_recv.bytes}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", ["m4v4", "m8", "muon", "hybrid"])
def test_heal_is_bit_exact(kind):
    healthy, healed = run(_heal, 2, kind, timeout=120)
    _assert_equal(healed["after"]["params"], healthy["after"]["params"])
    _assert_equal(healed["after"]["tensors"], healthy["after"]["tensors"])
    assert healed["after"]["groups"] == healthy["after"]["groups"]
    # negative control: the rejoining replica did start elsewhere
    assert any(not torch.equal(healed["before"][k], healthy["after"]["params"][k]) for k in healed["before"])
    assert healed["received"] == healthy["sent"] > 0


def _sharded(kind: str, seed: int, mesh):
    """The test model, FSDP2-sharded (each layer and the root) over ``mesh``, and its optimizer."""
    from torch.distributed.fsdp import fully_shard

    model = _model(seed, bias=kind != "muon")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _optimizer(kind, model)


def _local(state: dict) -> dict:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in state.items()}


def _fsdp_snapshot(model, opt) -> dict:
    return {"params": _local(model.state_dict()), "groups": opt.state_dict()["param_groups"],
            "tensors": _local({f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()
                               if isinstance(v, torch.Tensor)})}


def _fsdp_heal(rank: int, world_size: int, kind: str) -> dict:
    """Two replica groups of two ranks, each FSDP2 over its own ranks: replica 1 (ranks 2, 3)
    starts elsewhere and heals from replica 0, rank i from rank i, over the replicate dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    replica = mesh.get_coordinate()[0]
    model, opt = _sharded(kind, replica, mesh["shard"])
    transport = GefenTransport(mesh["replica"].get_group(), TIMEOUT, mesh=mesh["shard"])
    before = None
    if replica == 0:
        _steps(model, opt, 0, HEAL_AT)
        transport.send_checkpoint([1], HEAL_AT, _manager_state(model, opt, HEAL_AT), TIMEOUT)
    else:
        before = _local(model.state_dict())
        got = transport.recv_checkpoint(0, transport.metadata(), HEAL_AT, TIMEOUT)
        user = got["user"]["default"]
        assert all(isinstance(v, DTensor) for v in user["model"].values())
        model.load_state_dict(user["model"])
        opt.load_state_dict(user["optim"])
    _steps(model, opt, HEAL_AT, AFTER)
    return {"after": _fsdp_snapshot(model, opt), "before": before, "sent": transport.last_send.bytes,
            "received": transport.last_recv.bytes}


@pytest.mark.parametrize("kind", ["m4v4", "m8", "muon", "hybrid"])
def test_heal_fsdp2_replica_group_is_bit_exact(kind):
    out = run(_fsdp_heal, 4, kind, timeout=180)
    for shard in (0, 1):  # ranks 0, 1 healthy; 2, 3 healed
        healthy, healed = out[shard], out[2 + shard]
        _assert_equal(healed["after"]["params"], healthy["after"]["params"])
        _assert_equal(healed["after"]["tensors"], healthy["after"]["tensors"])
        assert healed["after"]["groups"] == healthy["after"]["groups"]
        assert any(not torch.equal(healed["before"][k], healthy["after"]["params"][k]) for k in healed["before"])
        assert healed["received"] == healthy["sent"] > 0


def _fsdp_misplaced(rank: int, world_size: int) -> list[str] | None:
    """Shards that are not this rank's part are refused, naming the tensor, before anything is
    returned: rank 1's shards sent to the joining replica's rank 0, and a receiver without a mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    cross = dist.new_group([1, 2])  # healthy shard 1 -> joining shard 0
    model, opt = _sharded("m4v4", 0, mesh["shard"])
    _steps(model, opt, 0, 1)
    state = _manager_state(model, opt, 1)
    if rank == 1:
        transport = GefenTransport(cross, TIMEOUT, mesh=mesh["shard"])
        transport.send_checkpoint([1], 1, state, TIMEOUT)
        transport.send_checkpoint([1], 1, state, TIMEOUT)
    if rank != 2:
        return None
    out = []
    for kept_mesh in (mesh["shard"], None):
        transport = GefenTransport(cross, TIMEOUT, mesh=kept_mesh)
        try:
            transport.recv_checkpoint(0, transport.metadata(), 1, TIMEOUT)
            out.append("applied")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_heal_refuses_shards_that_are_not_this_ranks_part():
    errors = run(_fsdp_misplaced, 4, timeout=180)[2]
    assert all(e.startswith("CheckpointMismatchError") and "replica rank 0" in e for e in errors), errors
    assert "offset" in errors[0] and "['user']['default']['model']['0.weight']" in errors[0], errors[0]
    assert "mesh=" in errors[1], errors[1]


def test_shared_codebooks_sent_once_and_values_round_trip():
    model = _model(0)
    opt = _optimizer("m4v4", model)
    _steps(model, opt, 0, 1)
    state = {"m": model.state_dict(), "o": opt.state_dict(), "v": (1, 2.5, None, "s", torch.bfloat16, b"\x00"),
             "ints": {3: [True, -7]}}
    enc = encode_state(state, 5)
    codebooks = {id(s["codebook"]) for s in opt.state_dict()["state"].values()}
    assert len(codebooks) == 1 and len(opt.state_dict()["state"]) == 4
    tensors = sum(1 for s in opt.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor))
    assert enc.count == len(model.state_dict()) + tensors - 2 * 3  # codebook, v_codebook: once, not 4 times
    out = decode_state(enc.manifest, 5, enc.pack.clone(), [t.clone() for t in enc.large], enc.large_crc)
    assert isinstance(out["m"], OrderedDict) and out["v"] == state["v"] and out["ints"] == state["ints"]
    got = out["o"]["state"]
    assert got[0]["codebook"] is got[2]["codebook"]
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert got[i][k].dtype == v.dtype and torch.equal(got[i][k], v), (i, k)


@pytest.mark.parametrize("change", ["runs", "many_runs", "dtype", "pack", "dims", "index", "tree", "order", "step"])
def test_hostile_manifests_are_refused_before_anything_is_built(change):
    import msgpack

    from gefen_ckpt.errors import CheckpointError, CheckpointFormatError

    enc = encode_state({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.int64)}, 1)
    raw = msgpack.unpackb(enc.manifest, raw=False)
    raw.update({"runs": {"runs": [["float32", 10**9, True]]},
                "many_runs": {"runs": [["float32", 50, True]] * 1000},  # each small, together > the manifest
                "dtype": {"runs": [["complex64", 2, True]]},
                "pack": {"pack": raw["pack"] + 8}, "dims": {"dims": raw["dims"][:-8]},
                "index": {"index": bytes(len(raw["index"]))},
                "tree": {"tree": msgpack.packb({"a": msgpack.ExtType(9, b"")})},
                "order": {"runs": [["float32", 1, False], ["int64", 1, True]]}, "step": {"step": 2}}[change])
    with pytest.raises(CheckpointError) as err:
        decode_state(msgpack.packb(raw, use_bin_type=True), 1, enc.pack, enc.large, enc.large_crc)
    assert isinstance(err.value, CheckpointFormatError) == (change != "step"), err.value
    assert decode_state(enc.manifest, 1, enc.pack, enc.large, enc.large_crc)["b"].tolist() == [1, 1, 1]  # the untouched one decodes


def test_refuses_values_it_cannot_send_pickle_free():
    with pytest.raises(Exception, match="cannot send a object"):
        encode_state({"x": object()}, 0)


class _Flip:
    """A process group that flips one byte of the message with tag ``tag`` (in transit)."""

    def __init__(self, pg, tag: int) -> None:
        self.pg, self.tag = pg, tag

    def send(self, tensors, dst, tag):
        if tag == self.tag:
            bad = tensors[0].clone()
            bad.view(torch.uint8).view(-1)[bad.nbytes // 2] ^= 0x10
            tensors = [bad]
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.pg.recv(tensors, src, tag)


def _corrupt(rank: int, world_size: int) -> list[str]:
    """Four transfers, a byte flipped in the packed buffer, in a large tensor, in the large
    tensors' checksums, in the manifest."""
    pg = dist.distributed_c10d._get_default_group()
    model = _model(0)
    opt = _optimizer("m8", model)
    _steps(model, opt, 0, 1)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    out = []
    for tag in (1002, 1004, 1003, 1001):  # pack, first large tensor, trailer, manifest
        transport = GefenTransport(_Flip(pg, tag) if rank == 0 else pg, timedelta(seconds=3), pack_bytes=256)
        try:
            if rank == 0:
                transport.send_checkpoint([1], 1, state, timedelta(seconds=3))
            else:
                transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=10))
            out.append("applied")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_corrupted_transfer_is_refused():
    sender, receiver = run(_corrupt, 2, timeout=120)
    assert all(r.startswith(CheckpointCorruptError.__name__) for r in receiver), receiver
    assert all("failed their CRC-32" in r and "replica rank 0" in r for r in receiver[:3]), receiver
    assert "manifest failed its CRC-32" in receiver[3]
    # the manifest was refused before the rest was received: the sender's wait runs out, naming the receiver
    assert sender[:3] == ["applied", "applied", "applied"]
    assert "replica rank 1" in sender[3], sender


def _stall(rank: int, world_size: int) -> str:
    transport = GefenTransport(dist.distributed_c10d._get_default_group(), timedelta(seconds=1))
    if rank == 0:
        time.sleep(4)  # alive, but never sends
        return "slept"
    start = time.monotonic()
    with pytest.raises(CheckpointTimeoutError) as err:
        transport.recv_checkpoint(0, transport.metadata(), 7, timedelta(seconds=1))
    assert time.monotonic() - start < 3
    return str(err.value)


def test_stalled_sender_is_named():
    _, message = run(_stall, 2, timeout=60)
    assert "replica rank 0" in message and "within 1s" in message, message


class _Hold:
    """A sender's process group that sends the first ``sent`` messages of a transfer, then stalls."""

    def __init__(self, pg, sent: int) -> None:
        self.pg, self.sent = pg, sent

    def send(self, tensors, dst, tag):
        if self.sent == 0:
            return _Done()
        self.sent -= 1
        return self.pg.send(tensors, dst, tag)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


def _mid_transfer_state() -> tuple:
    model = _model(0)
    opt = _optimizer("m8", model)
    _steps(model, opt, 0, 1)
    return model, opt, {"model": model.state_dict(), "optim": opt.state_dict()}


def _receive_or_refuse(timeout: float) -> dict:
    """The joining replica's side, as the Manager uses it: load only a state that arrived."""
    model = _model(1)
    opt = _optimizer("m8", model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    transport = GefenTransport(dist.distributed_c10d._get_default_group(), timedelta(seconds=timeout), pack_bytes=256)
    start = time.monotonic()
    try:
        got = transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=timeout))
        model.load_state_dict(got["model"])
        opt.load_state_dict(got["optim"])
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return {"error": error, "seconds": time.monotonic() - start, "unchanged": unchanged}


def _stall_mid_transfer(rank: int, world_size: int):
    if rank == 1:
        return _receive_or_refuse(timeout=2)
    *_, state = _mid_transfer_state()
    transport = GefenTransport(_Hold(dist.distributed_c10d._get_default_group(), sent=4), timedelta(seconds=2),
                               pack_bytes=256)
    transport.send_checkpoint([1], 1, state, timedelta(seconds=2))  # header, manifest, packed, 1st large
    time.sleep(5)  # alive, but the rest never comes
    return None


def test_sender_stalling_mid_transfer_is_named_within_the_timeout():
    got = run(_stall_mid_transfer, 2, timeout=60)[1]
    assert got["error"].startswith(CheckpointTimeoutError.__name__), got
    assert "replica rank 0" in got["error"] and "large tensor 1" in got["error"] and "within 2s" in got["error"], got
    assert got["seconds"] < 4 and got["unchanged"], got


def _die_mid_transfer(rank: int, world_size: int):
    if rank == 1:
        return _receive_or_refuse(timeout=30)
    *_, state = _mid_transfer_state()
    pg = dist.distributed_c10d._get_default_group()
    transport = GefenTransport(_Hold(pg, sent=4), timedelta(seconds=5), pack_bytes=256)
    transport.send_checkpoint([1], 1, state, timedelta(seconds=5))
    time.sleep(0.5)
    os._exit(3)  # the healthy replica's process dies mid-transfer


def test_sender_dying_mid_transfer_is_named_without_a_hang():
    """The receiver's wait ends as soon as the connection drops, long before its 30 s timeout."""
    from distributed import _result, _start

    with tempfile.TemporaryDirectory() as workdir:
        procs = _start(2, workdir, _die_mid_transfer, (), None)
        try:
            for p in procs:
                p.join(60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        assert procs[0].exitcode == 3
        got = _result(workdir, 1, {})
    assert got is not None and "ok" in got, got
    got = got["ok"]
    assert got["error"].startswith("CheckpointError") and "replica rank 0" in got["error"], got
    assert got["seconds"] < 15 and got["unchanged"], got


@pytest.mark.parametrize("args", [["--optimizer", "gefen"], ["--optimizer", "m8"], ["--optimizer", "muon"],
                                  ["--optimizer", "hybrid"], ["--flip-first-heal"], ["--stall-first-heal"]])
def test_torchft_manager_heals_a_killed_replica(args):
    out = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "replica 1 (life 1) finished at step 10; healed with" in out.stdout, out.stdout
    assert "replicas bit-identical at step 10" in out.stdout, out.stdout
    assert ("refused 1 failed transfer" in out.stdout) == (args[0] != "--optimizer"), out.stdout
    if "--stall-first-heal" in args:  # the timeout named the peer; the Manager's next heal succeeded
        assert "replica rank 0 did not complete the packed buffer" in out.stderr, out.stderr[-4000:]
