"""gefen_ckpt.formats.torch_file: optimizer.state_dict() <-> CanonicalState, and torch files over fsspec."""

from __future__ import annotations

import copy

import pytest
import torch

from gefen import Gefen
from gefen.contract import join_composite, split_composite
from gefen_ckpt import CanonicalState, CheckpointError, CheckpointFormatError, CheckpointMismatchError
from gefen_ckpt.dist.optimizer_state import export_canonical, import_canonical
from gefen_ckpt.formats.torch_file import (
    TORCH_META_KEY,
    canonical_from_state_dict,
    infer_contract,
    is_torch_file,
    load_torch_state_dict,
    save_torch_state_dict,
    state_dict_from_canonical,
)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def make_opt(kind: str, model: torch.nn.Module):
    named = model.named_parameters()
    if kind == "gefen":
        return Gefen(named, lr=1e-2, weight_decay=0.01)
    if kind == "gefen_unfactored":
        return Gefen(named, lr=1e-2, factored_v_2d=False, moments="m8")
    if kind == "adamw":
        return torch.optim.AdamW(named, lr=1e-2)
    if kind == "adam":
        return torch.optim.Adam(named, lr=1e-2, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(named, lr=1e-2, momentum=0.9)
    raise ValueError(kind)


def train(model, opt, steps: int, start: int = 0):
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(32, 12, generator=g)
        y = torch.randn(32, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def canonical_tensors(state: CanonicalState) -> dict:
    return {k: src.read() for k, src in state.tensors()}


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k


KINDS = ["gefen", "gefen_unfactored", "adamw", "adam", "sgd"]
IMPL = {"gefen": "gefen.Gefen", "gefen_unfactored": "gefen.Gefen", "adamw": "torch.optim.AdamW",
        "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD"}


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_continues_bitwise(kind, tmp_path):
    # reference: uninterrupted run
    ref_model = make_model()
    ref_opt = make_opt(kind, ref_model)
    train(ref_model, ref_opt, 6)

    model = make_model()
    opt = make_opt(kind, model)
    train(model, opt, 3)
    sd = opt.state_dict()
    state = canonical_from_state_dict(sd)  # contract inferred from the field names
    assert state.contract.implementation == IMPL[kind]
    assert set(state.params) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert state.params[name].shape == tuple(p.shape)
        assert state.params[name].dtype == p.dtype
    # the canonical state equals export_canonical's
    exported = export_canonical(opt)
    assert exported.param_groups == state.param_groups
    assert_bitwise_equal(canonical_tensors(exported), canonical_tensors(state))

    url = str(tmp_path / "opt.pt")
    save_torch_state_dict(state_dict_from_canonical(state), url)
    assert is_torch_file(url)
    loaded = torch.load(url, map_location="cpu", weights_only=True)

    fresh_model = make_model()
    fresh_model.load_state_dict(model.state_dict())
    fresh = make_opt(kind, fresh_model)
    fresh.load_state_dict(loaded)
    train(fresh_model, fresh, 3, start=3)
    for (n, a), (_, b) in zip(ref_model.named_parameters(), fresh_model.named_parameters()):
        assert torch.equal(a, b), n
    ref_sd, new_sd = ref_opt.state_dict(), fresh.state_dict()
    for i, entry in ref_sd["state"].items():
        assert_same_tensors(entry, new_sd["state"][i])


@pytest.mark.parametrize("kind", ["gefen", "adamw"])
def test_canonical_round_trip_is_exact_and_loads_via_import(kind, tmp_path):
    model = make_model()
    opt = make_opt(kind, model)
    train(model, opt, 2)
    state = export_canonical(opt).materialize()
    sd = state_dict_from_canonical(state)
    assert sd[TORCH_META_KEY]["contract"]["implementation"] == IMPL[kind]
    for g in sd["param_groups"]:
        assert len(g["param_names"]) == len(g["params"])
    back = canonical_from_state_dict(sd)
    assert back.contract == state.contract
    assert back.param_groups == state.param_groups
    assert_bitwise_equal(canonical_tensors(state), canonical_tensors(back))
    # and a fresh optimizer takes it through import_canonical too
    fresh = make_opt(kind, make_model())
    import_canonical(fresh, back)
    assert_bitwise_equal(canonical_tensors(export_canonical(fresh)), canonical_tensors(state))


def test_torch_files_over_memory_fsspec():
    model = make_model()
    opt = make_opt("gefen", model)
    train(model, opt, 2)
    url = "memory://torch-format-test/sub/opt.pt"
    save_torch_state_dict(state_dict_from_canonical(export_canonical(opt)), url)
    assert is_torch_file(url)
    state = canonical_from_state_dict(load_torch_state_dict(url))
    assert_bitwise_equal(canonical_tensors(state), canonical_tensors(export_canonical(opt)))
    assert not is_torch_file("memory://torch-format-test/sub")


def test_recorded_param_dtype_survives(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = Gefen(model.named_parameters(), lr=1e-2)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    state = export_canonical(opt)
    assert state.params["weight"].dtype == torch.bfloat16
    back = canonical_from_state_dict(state_dict_from_canonical(state))
    assert back.params["weight"].dtype == torch.bfloat16
    # a plain state_dict (no record) falls back to float32 for Gefen, where nothing tells the dtype
    assert canonical_from_state_dict(opt.state_dict()).params["weight"].dtype == torch.float32


def test_inference_and_explicit_contract():
    model = make_model()
    opt = make_opt("adamw", model)
    train(model, opt, 1)
    sd = opt.state_dict()
    assert infer_contract(sd).implementation == "torch.optim.AdamW"
    assert canonical_from_state_dict(sd, "adam").contract.implementation == "torch.optim.Adam"
    with pytest.raises(CheckpointMismatchError, match="unknown optimizer"):
        canonical_from_state_dict(sd, "nope")
    # Gefen state named as AdamW: fields unknown to that contract
    gmodel = make_model()
    g = make_opt("gefen", gmodel)
    train(gmodel, g, 1)
    with pytest.raises(CheckpointMismatchError, match="unknown to torch.optim.AdamW"):
        canonical_from_state_dict(g.state_dict(), "torch.optim.AdamW")


def test_missing_param_names_is_a_clear_error():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    with pytest.raises(CheckpointMismatchError, match="named_parameters"):
        canonical_from_state_dict(opt.state_dict())


def test_bad_inputs():
    with pytest.raises(CheckpointFormatError):
        canonical_from_state_dict([1, 2])
    with pytest.raises(CheckpointFormatError):
        canonical_from_state_dict({"state": {}})
    model = make_model()
    opt = make_opt("adamw", model)
    train(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"][:, :3]
    with pytest.raises(CheckpointMismatchError, match="0.weight/exp_avg_sq"):
        canonical_from_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][99] = sd["state"][0]
    with pytest.raises(CheckpointFormatError, match="99"):
        canonical_from_state_dict(sd)


def test_load_refuses_pickled_code_and_garbage(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pt"
    torch.save({"state": {}, "param_groups": [], "x": Evil()}, evil)
    with pytest.raises(CheckpointFormatError, match="evil.pt"):
        load_torch_state_dict(str(evil))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"PK\x03\x04 definitely not a zip")
    with pytest.raises(CheckpointFormatError, match="junk.pt"):
        load_torch_state_dict(str(junk))
    with pytest.raises(CheckpointError, match="no such file"):
        load_torch_state_dict(str(tmp_path / "absent.pt"))
    save_torch_state_dict({"state": {}, "param_groups": []}, str(tmp_path / "deep" / "x.pt"))
    assert load_torch_state_dict(str(tmp_path / "deep" / "x.pt")) == {"state": {}, "param_groups": []}


class Composite:
    """A minimal composite optimizer (gefen.contract's composite convention, as GefenMuonHybrid)."""

    def __init__(self, model):
        named = list(model.named_parameters())
        self.children = {
            "main": Gefen([(n, p) for n, p in named if p.dim() == 2], lr=1e-2),
            "backup": torch.optim.AdamW([(n, p) for n, p in named if p.dim() != 2], lr=1e-2),
        }

    def contract(self):
        from gefen.contract import OptimizerContract, contract_of

        return OptimizerContract("test.Composite", "1", (), (),
                                 children=tuple((k, contract_of(o)) for k, o in self.children.items()))

    def state_dict(self):
        return join_composite({k: o.state_dict() for k, o in self.children.items()})

    def load_state_dict(self, sd):
        for k, child_sd in split_composite(sd, list(self.children)).items():
            self.children[k].load_state_dict(child_sd)

    def zero_grad(self):
        for o in self.children.values():
            o.zero_grad()

    def step(self):
        for o in self.children.values():
            o.step()


def test_composite_state_dicts():
    ref_model = make_model()
    ref = Composite(ref_model)
    train(ref_model, ref, 4)

    model = make_model()
    comp = Composite(model)
    train(model, comp, 2)
    sd = comp.state_dict()
    with pytest.raises(CheckpointMismatchError, match="composite"):
        canonical_from_state_dict(sd)
    state = canonical_from_state_dict(sd, comp.contract())
    exported = export_canonical(comp)
    assert state.param_groups == exported.param_groups
    assert {k: v.child for k, v in state.params.items()} == {k: v.child for k, v in exported.params.items()}
    assert_bitwise_equal(canonical_tensors(state), canonical_tensors(exported))
    assert "main/codebook" in state.global_fields
    # the nested form reads to the same state
    nested = {"state": {}, "param_groups": [], "children": {k: o.state_dict() for k, o in comp.children.items()}}
    old = canonical_from_state_dict(nested, comp.contract())
    assert old.param_groups == state.param_groups and old.global_fields.keys() == state.global_fields.keys()
    assert {k: v.child for k, v in old.params.items()} == {k: v.child for k, v in state.params.items()}
    assert_bitwise_equal(canonical_tensors(old), canonical_tensors(state))

    out = state_dict_from_canonical(state)
    assert [g["child"] for g in out["param_groups"]] == ["main", "backup"]
    assert sorted(out["state"]) == list(range(sum(len(g["params"]) for g in out["param_groups"])))
    back = canonical_from_state_dict(out)  # the recorded contract is used
    assert back.contract == comp.contract()
    fresh_model = make_model()
    fresh_model.load_state_dict(model.state_dict())
    fresh = Composite(fresh_model)
    fresh.load_state_dict(out)
    train(fresh_model, fresh, 2, start=2)
    for (n, a), (_, b) in zip(ref_model.named_parameters(), fresh_model.named_parameters()):
        assert torch.equal(a, b), n


def _hybrid(model):
    import gefen

    return gefen.GefenMuonHybrid(model, lr=1e-2)


def test_gefen_muon_hybrid_state_dicts():
    gefen = pytest.importorskip("gefen")
    if not hasattr(gefen, "GefenMuonHybrid"):
        pytest.skip("GefenMuonHybrid not merged")
    from gefen.contract import contract_of

    def model_fn():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 16),
                                   torch.nn.GELU(), torch.nn.Linear(16, 4))

    ref_model = model_fn()
    ref = _hybrid(ref_model)
    train(ref_model, ref, 4)
    model = model_fn()
    opt = _hybrid(model)
    train(model, opt, 2)
    sd = opt.state_dict()
    assert canonical_from_state_dict(sd).contract == contract_of(opt)  # the hybrid records its contract
    from gefen.contract import CONTRACT_KEY

    unrecorded = {k: v for k, v in sd.items() if k != CONTRACT_KEY}  # a file saved before it did
    with pytest.raises(CheckpointMismatchError, match="GefenMuonHybrid"):
        canonical_from_state_dict(unrecorded)
    named = canonical_from_state_dict(sd, "GefenMuonHybrid")  # children inferred, name given
    exact = canonical_from_state_dict(sd, contract_of(opt))
    assert [c.implementation for _, c in named.contract.children] == \
        [c.implementation for _, c in contract_of(opt).children]
    assert_bitwise_equal(canonical_tensors(named), canonical_tensors(export_canonical(opt)))
    out = state_dict_from_canonical(exact)
    fresh_model = model_fn()
    fresh_model.load_state_dict(model.state_dict())
    fresh = _hybrid(fresh_model)
    import_canonical(fresh, canonical_from_state_dict(out))
    fresh2 = _hybrid(model_fn())
    import_canonical(fresh2, named)  # the synthesised contract is accepted too
    train(fresh_model, fresh, 2, start=2)
    for (n, a), (_, b) in zip(ref_model.named_parameters(), fresh_model.named_parameters()):
        assert torch.equal(a, b), n


def test_composite_state_dict_with_a_leaf_optimizer_name():
    model = make_model()
    comp = Composite(model)
    train(model, comp, 1)
    for name in ("AdamW", "gefen.Gefen"):
        with pytest.raises(CheckpointMismatchError, match="not a composite"):
            canonical_from_state_dict(comp.state_dict(), name)
    from gefen.contract import contract_of

    with pytest.raises(CheckpointMismatchError, match="not a composite"):
        canonical_from_state_dict(comp.state_dict(), contract_of(comp.children["backup"]))
