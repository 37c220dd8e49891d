"""Moving state between AdamW and Gefen (gefen_ckpt.formats.convert, gefen_ckpt.formats.names, `convert --into`).

The fidelity tests train benchmarks/bench_convert.py's tiny next-token model (a few seconds on
one CPU core): one optimizer for K steps, then the converted state continues for K more steps
on the same batches as the unconverted optimizer does, and the two continuations are compared.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import gefen_ckpt
from benchmarks.bench_convert import LR, WD, adamw, dense_export, gefen, make_model, train, warm_start
from gefen import Gefen, GefenMuon, GefenMuonHybrid, split_params_for_muon
from gefen.contract import CONTRACT_KEY
from gefen_ckpt import CheckpointMismatchError
from gefen_ckpt.dist.optimizer_state import export_canonical, import_canonical
from gefen_ckpt.formats.convert import convert_state, dense_view
from gefen_ckpt.formats.names import name_state_dict, read_model_params
from gefen_ckpt.formats.torch_file import canonical_from_state_dict, state_dict_from_canonical
from gefen_cli.app import app

pytestmark = pytest.mark.usefixtures("one_thread")

runner = CliRunner()
K = 40
#: a converted optimizer's continuation may lose at most this much against the unconverted one,
#: over its first and its last 10 steps (measured with K = 40: AdamW -> Gefen -0.03 % / +0.01 %,
#: Gefen -> AdamW 0.00 %, a fresh Gefen +3.4 % / +0.2 %: `python -m benchmarks.bench_convert --quick`)
MARGIN = 0.005


@pytest.fixture(scope="module")
def adamw_run():
    """A model after K AdamW steps and the AdamW state (canonical, in memory)."""
    model = make_model()
    opt = adamw(model)
    train(model, opt, K)
    return model, export_canonical(opt).materialize()


# ----- fidelity -----------------------------------------------------------------------------
def test_adamw_to_gefen_continues_like_adamw():
    losses = warm_start(K)["losses"]
    for window in ("first 10", "last 10"):
        assert losses["converted into Gefen"][window] <= losses["AdamW continues"][window] * (1 + MARGIN), losses
    # right after the switch the warm start is what a fresh optimizer lacks
    assert losses["converted into Gefen"]["first 10"] < losses["fresh Gefen"]["first 10"], losses


def test_gefen_to_adamw_continues_like_gefen():
    result = dense_export(K)
    losses, report = result["losses"], result["report"]
    for window in ("first 10", "last 10"):
        assert losses["converted into AdamW"][window] <= losses["Gefen continues"][window] * (1 + MARGIN), losses
    assert report["first_moment"]["rel_error"] == 0 and report["second_moment"]["rel_error"] == 0


@pytest.mark.parametrize("moments,bound", [("m8", 0.01), ("m4v4", 0.11)])
def test_warm_start_carries_step_and_hyperparameters(adamw_run, moments, bound):
    trained, state = adamw_run
    converted = convert_state(state, "Gefen", moments=moments)
    report = converted.metadata["conversion"]
    assert report["from"] == "torch.optim.AdamW" and report["into"] == "gefen.Gefen"
    assert report["parameters"] == len(state.params) and report["restarted"] == []
    # one scale per row and 256 codes (m8; 0.002 measured) or 16 (m4v4, nearest codes: 0.090 measured)
    assert report["first_moment"]["rel_error"] < bound
    assert converted.contract.version == {"m8": "1", "m4v4": "2"}[moments]
    model = copy.deepcopy(trained)
    opt = Gefen(model.named_parameters(), lr=0.5, moments=moments)  # hyperparameters come from the state
    import_canonical(opt, converted)
    assert opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == WD
    assert opt.param_groups[0]["betas"] == (0.9, 0.999) and int(opt.state[model.mix.weight]["step"]) == K
    dense = adamw(copy.deepcopy(trained))
    dense.load_state_dict(state_dict_from_canonical(convert_state(converted, "AdamW")))
    assert dense.param_groups[0]["decoupled_weight_decay"] is True  # AdamW, not Adam
    assert float(dense.state[dense.param_groups[0]["params"][1]]["step"]) == K


def test_block_second_moment_when_not_factored(adamw_run):
    trained, state = adamw_run
    converted = convert_state(state, "Gefen", factored_v_2d=False, codebook_size=16, moments="m8")
    mix = converted.params["mix.weight"].fields
    assert "v_row" not in mix and tuple(mix["v"].shape) == (64, 1)  # one block per row: its mean
    torch.testing.assert_close(mix["v"].read()[:, 0], state.params["mix.weight"].fields["exp_avg_sq"].read().mean(1))
    opt = Gefen(copy.deepcopy(trained).named_parameters(), factored_v_2d=False, codebook_size=16, moments="m8")
    import_canonical(opt, converted)
    assert opt.codebook.numel() == 16 and opt.param_groups[0]["factored_v_2d"] is False
    with pytest.raises(CheckpointMismatchError, match="factored_v_2d=False needs moments='m8'"):
        convert_state(state, "Gefen", factored_v_2d=False)
    with pytest.raises(CheckpointMismatchError, match="codebook_size must be 16"):
        convert_state(state, "Gefen", codebook_size=64)


def test_round_trip_error_is_the_reported_error(adamw_run):
    _, state = adamw_run
    into = convert_state(state, "Gefen")
    back = convert_state(into, "AdamW")
    before, after = dense_view(state)[1], dense_view(back)[1]

    def rel(name: str) -> float:
        num = sum(float((getattr(after[f], name) - getattr(before[f], name)).double().square().sum()) for f in before)
        den = sum(float(getattr(before[f], name).double().square().sum()) for f in before)
        return (num / den) ** 0.5

    report = into.metadata["conversion"]
    assert rel("exp_avg") == pytest.approx(report["first_moment"]["rel_error"], rel=1e-6)
    assert rel("exp_avg_sq") == pytest.approx(report["second_moment"]["rel_error"], rel=1e-6)
    for fqn in ("norm.weight", "norm.bias", "mix.bias"):  # 1-D: per-element second moment, exact
        assert torch.equal(after[fqn].exp_avg_sq, before[fqn].exp_avg_sq), fqn
    # the factored form is Gefen's own: v_row / v_col are the row / column means of exp_avg_sq
    mix = into.params["mix.weight"].fields
    sq = state.params["mix.weight"].fields["exp_avg_sq"].read()
    torch.testing.assert_close(mix["v_row"].read(), sq.mean(1))
    torch.testing.assert_close(mix["v_col"].read(), sq.mean(0))
    assert into.params["mix.weight"].fields["step"].read().dtype == torch.int64


def test_codes_are_what_the_step_would_store(adamw_run):
    """A Gefen (m8) step with beta1 = 0 stores quantise(g): learned and quantised like a conversion."""
    _, state = adamw_run
    converted = convert_state(state, "Gefen", moments="m8")
    model = make_model()
    opt = Gefen(model.named_parameters(), betas=(0.0, 0.999), moments="m8")
    for n, p in model.named_parameters():
        p.grad = state.params[n].fields["exp_avg"].read().clone()
    opt.step()
    for n, p in model.named_parameters():  # the shape rule (a statistics-based rule agrees on these rows)
        assert int(opt.state[p]["period"]) == int(converted.params[n].fields["period"].read()), n
    torch.testing.assert_close(opt.codebook, converted.global_fields["codebook"].read(), rtol=0, atol=0)
    for n, p in model.named_parameters():
        assert torch.equal(opt.state[p]["m_code"], converted.params[n].fields["m_code"].read()), n
        assert torch.equal(opt.state[p]["m_scale"], converted.params[n].fields["m_scale"].read()), n


def test_m4v4_conversion_codes_are_the_nearest_and_decode_as_the_step_does(adamw_run):
    """The default layout: the first-moment codebook is the one a first step with g = exp_avg
    learns; 1-D moments are kept (exp_avg as the nearest bf16); each matrix element holds the
    nearest first-moment code of exp_avg / bf16(row max) and the nearest code of
    log(exp_avg_sq / vhat) / 8."""
    _, state = adamw_run
    converted = convert_state(state, "Gefen")
    model = make_model()
    opt = Gefen(model.named_parameters(), betas=(0.0, 0.999))
    for n, p in model.named_parameters():
        p.grad = state.params[n].fields["exp_avg"].read().clone()
    opt.step()
    codebook = converted.global_fields["codebook"].read()
    v_codebook = converted.global_fields["v_codebook"].read()
    assert torch.equal(opt.codebook, codebook)
    assert v_codebook[0] == -1 and v_codebook[-1] == 1 and (v_codebook.diff() >= 0).all()
    for n, p in model.named_parameters():
        fields = {k: src.read() for k, src in converted.params[n].fields.items()}
        m, v = (state.params[n].fields[k].read() for k in ("exp_avg", "exp_avg_sq"))
        if p.dim() < 2:
            assert torch.equal(fields["exp_avg"], m.bfloat16()) and torch.equal(fields["exp_avg_sq"], v), n
            continue
        m2, v2 = m.reshape(m.shape[0], -1), v.reshape(v.shape[0], -1)
        scale = fields["m_row_scale"]
        assert scale.dtype == torch.bfloat16 and torch.equal(scale, m2.abs().amax(1).bfloat16()), n
        x = m2 / scale.float()[:, None]
        mcode = (fields["mv_code"].reshape(m2.shape) & 15).long()
        best = (x[..., None] - codebook).abs().min(-1).values
        assert torch.equal((x - codebook[mcode]).abs(), best), n  # nearest (ties either way)
        v_row, v_col = fields["v_row"], fields["v_col"]
        torch.testing.assert_close(v_row, v2.mean(1))
        torch.testing.assert_close(v_col, v2.mean(0))
        vhat = (v_row / v_row.double().mean().float())[:, None] * v_col[None, :]
        tiny = torch.finfo(torch.float32).tiny
        r = (torch.log(v2.clamp_min(tiny) / vhat.clamp_min(tiny)) / 8).clamp(-1, 1)
        vcode = (fields["mv_code"].reshape(m2.shape) >> 4).long()
        assert ((r - v_codebook[vcode]).abs() <= (r[..., None] - v_codebook).abs().min(-1).values + 1e-6).all(), n


def test_muon_and_hybrid_targets(adamw_run):
    snapshot, state = adamw_run
    with pytest.raises(CheckpointMismatchError, match="2-D parameters only"):
        convert_state(state, "GefenMuon")
    model = copy.deepcopy(snapshot)
    routed = [n for n, _ in split_params_for_muon(model)[0]]
    hybrid_state = convert_state(state, "GefenMuonHybrid", muon_params=routed)
    assert {e.child for e in hybrid_state.params.values()} == {"muon", "backup"}
    opt = GefenMuonHybrid(model)
    import_canonical(opt, hybrid_state)
    assert opt.children["muon"].param_groups[0]["momentum"] == 0.9  # AdamW's beta1
    train(model, opt, 2, start=K)
    # by name alone the tied embedding is not recognised as one: routed by name, then refused on load
    by_name = convert_state(state, "GefenMuonHybrid")
    with pytest.raises(CheckpointMismatchError, match="different members"):
        import_canonical(GefenMuonHybrid(copy.deepcopy(snapshot)), by_name)
    # back to AdamW: Muon keeps no second moment, so those parameters start afresh
    dense = convert_state(export_canonical(opt), "AdamW")
    assert sorted(dense.metadata["conversion"]["restarted"]) == sorted(routed)
    into_gefen = convert_state(export_canonical(opt), "Gefen")  # the backup's state kept, Muon's restart
    assert sorted(into_gefen.metadata["conversion"]["restarted"]) == sorted(routed)
    muon, rest = split_params_for_muon(model)  # the hybrid's groups, which torch's positional loader needs
    hybrid_groups = [{"params": [p for _, p in muon], "param_names": [n for n, _ in muon]},
                     {"params": [p for _, p in rest], "param_names": [n for n, _ in rest]}]
    as_gefen = Gefen([dict(g) for g in hybrid_groups])
    import_canonical(as_gefen, into_gefen)
    assert not as_gefen.state.get(model.mix.weight) and as_gefen.state[model.tok.weight]
    train(model, as_gefen, 1, start=K + 2)
    back = torch.optim.AdamW([{"params": g["params"]} for g in hybrid_groups])
    back.load_state_dict(state_dict_from_canonical(dense))
    assert back.param_groups[0]["betas"] == (0.9, 0.999)  # Muon's momentum; AdamW's default beta2
    train(model, back, 1, start=K + 2)
    with pytest.raises(CheckpointMismatchError, match="adjust_lr"):
        convert_state(export_canonical(GefenMuon([(n, p) for n, p in model.named_parameters() if p.dim() == 2])),
                      "AdamW")


def test_what_cannot_be_carried():
    model = make_model()
    for opt, match in ((torch.optim.Adam(model.named_parameters(), weight_decay=0.1), "L2"),
                       (torch.optim.AdamW(model.named_parameters(), amsgrad=True), "amsgrad"),
                       (torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9), "no mapping")):
        train(model, opt, 1)
        with pytest.raises(CheckpointMismatchError, match=match):
            convert_state(export_canonical(opt), "Gefen")
    with pytest.raises(CheckpointMismatchError, match="no mapping"):
        convert_state(export_canonical(opt), "SGD")


def test_gefen_names_adamw_state_when_it_is_handed_one():
    model = make_model()
    opt = adamw(model)
    train(model, opt, 1)
    g = gefen(model)
    with pytest.raises(ValueError, match=r"torch.optim.AdamW's .*--into Gefen"):
        g.load_state_dict(opt.state_dict())
    assert not g.state  # untouched


# ----- names --------------------------------------------------------------------------------
def hf_split(model) -> tuple[list[str], list[str]]:
    """HuggingFace Trainer's two groups: decayed (not bias / norm), then the rest, in model order."""
    names = [n for n, _ in model.named_parameters()]
    rest = [n for n in names if n.endswith("bias") or "norm" in n]
    return [n for n in names if n not in rest], rest


def hf_order(model) -> list[str]:
    return [n for half in hf_split(model) for n in half]


def hf_groups(model, named: bool = False) -> list[dict]:
    params = dict(model.named_parameters())
    return [{"params": [params[n] for n in half], "weight_decay": wd, **({"param_names": half} if named else {})}
            for half, wd in zip(hf_split(model), (0.01, 0.0))]


@pytest.fixture()
def hf_checkpoint(tmp_path):
    """A Trainer-shaped checkpoint directory: optimizer.pt without names, model.safetensors."""
    model = make_model()
    opt = torch.optim.AdamW(hf_groups(model), lr=3e-3)
    train(model, opt, 3)
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")
    tensors = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # HF drops tied copies
    save_file(tensors, str(ckpt / "model.safetensors"))
    torch.save(model.state_dict(), tmp_path / "model.pt")  # registration order, buffer included
    (tmp_path / "names.txt").write_text("\n".join(hf_order(model)) + "\n")
    return ckpt, model, opt


def test_names_from_a_model_state_dict_and_a_names_file(hf_checkpoint, tmp_path):
    ckpt, model, opt = hf_checkpoint
    for option, value in (("--names-from", tmp_path / "model.pt"), ("--param-names", tmp_path / "names.txt")):
        dst = tmp_path / f"gefen{option}.pt"
        result = runner.invoke(app, ["convert", str(ckpt / "optimizer.pt"), str(dst), "--into", "Gefen",
                                     option, str(value), "--json", "--moments", "m8"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)["conversion"]
        assert report["parameters"] == len(hf_order(model)) and report["first_moment"]["rel_error"] < 0.01
        live = Gefen(hf_groups(model, named=True), lr=3e-3, moments="m8")
        import_canonical(live, canonical_from_state_dict(torch.load(dst, weights_only=True)))
        assert live.param_groups[0]["weight_decay"] == 0.01 and live.param_groups[1]["weight_decay"] == 0.0
        train(model, live, 1, start=3)
    # the tied head is listed once (as named_parameters() lists it); the float buffer stays and is skipped
    assert [n for n, _ in read_model_params(str(tmp_path / "model.pt"))] == \
        ["scale"] + [n for n, _ in model.named_parameters()]
    # every command that reads a torch state_dict takes the names (reshard, verify, diff)
    names = str(tmp_path / "names.txt")
    optimizer_pt = str(ckpt / "optimizer.pt")
    result = runner.invoke(app, ["reshard", optimizer_pt, str(tmp_path / "ws2"), "--world-size", "2",
                                 "--param-names", names])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["verify", optimizer_pt, "--names-from", str(tmp_path / "model.pt")]).exit_code == 0
    result = runner.invoke(app, ["diff", optimizer_pt, str(tmp_path / "ws2"), "--param-names", names])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["verify", str(tmp_path / "ws2"), "--param-names", names])
    assert result.exit_code == 2 and "records its names" in result.output  # only torch files take names
    # the same through the Python API: the model's names, in the optimizer's (grouped) order
    entries = [(n, tuple(t.shape)) for n, t in model.state_dict().items() if n != "head.weight"]
    named = name_state_dict(opt.state_dict(), model_params=entries)
    assert [n for g in named["param_groups"] for n in g["param_names"]] == hf_order(model)


def test_names_from_safetensors_is_refused_with_the_way_out(hf_checkpoint, tmp_path):
    ckpt, _, _ = hf_checkpoint
    for source in (ckpt, ckpt / "model.safetensors"):
        result = runner.invoke(app, ["convert", str(ckpt / "optimizer.pt"), str(tmp_path / "out.pt"),
                                     "--into", "Gefen", "--names-from", str(source)])
        assert result.exit_code == 1, result.output
        assert "safetensors does not keep the order" in result.output and "--param-names" in result.output
    assert not (tmp_path / "out.pt").exists()


def test_names_that_disagree_name_the_first_index(hf_checkpoint, tmp_path):
    ckpt, model, opt = hf_checkpoint
    sd = opt.state_dict()
    names = hf_order(model)
    with pytest.raises(CheckpointMismatchError, match="first disagreeing index 6"):
        name_state_dict(sd, names=names[:6])
    entries = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    swapped = [entries[1], entries[0], *entries[2:]]  # mix.weight before embed.weight: shapes disagree
    with pytest.raises(CheckpointMismatchError, match=r"index 0 of the state_dict \(shape \(48, 32\)\)"):
        name_state_dict(sd, model_params=swapped)
    named = name_state_dict(sd, names=names)
    with pytest.raises(CheckpointMismatchError, match=r"index 0: the state_dict names it 'tok.weight', x 'a'"):
        name_state_dict(named, names=["a", *names[1:]], source="x")
    # two equal-shaped parameters that could sit in either group: ambiguous, not guessed
    ambiguous = [("a", (4,)), ("b", (4,))]
    sd2 = {"state": {0: {"exp_avg": torch.zeros(4)}, 1: {"exp_avg": torch.zeros(4)}},
           "param_groups": [{"params": [0]}, {"params": [1]}]}
    with pytest.raises(CheckpointMismatchError, match="more than one way"):
        name_state_dict(sd2, model_params=ambiguous)
    (tmp_path / "short.txt").write_text("\n".join(names[:3]))
    result = runner.invoke(app, ["inspect", str(ckpt / "optimizer.pt"), "--param-names", str(tmp_path / "short.txt")])
    assert result.exit_code == 1 and "first disagreeing index 3" in result.output


# ----- the CLI ------------------------------------------------------------------------------
def test_cli_convert_round_trip_and_bad_input(tmp_path, adamw_run):
    snapshot, state = adamw_run
    src = tmp_path / "adamw.pt"
    torch.save(state_dict_from_canonical(state), src)
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "g"), "--into", "Gefen", "--to", "portable"])
    assert result.exit_code == 0, result.output
    assert "first moment relative error" in result.output and "second moment relative error" in result.output
    assert gefen_ckpt.read(str(tmp_path / "g")).contract.implementation == "gefen.Gefen"
    for to in ("torch", "dcp"):
        out = tmp_path / f"dense-{to}"
        result = runner.invoke(app, ["convert", str(tmp_path / "g"), str(out), "--into", "AdamW", "--to", to])
        assert result.exit_code == 0, result.output
    back = adamw(copy.deepcopy(snapshot))
    back.load_state_dict(torch.load(tmp_path / "dense-torch", weights_only=True))
    # a model + optimizer DCP checkpoint of torch's own flow (AdamW state through GefenDCPState)
    import torch.distributed.checkpoint as dcp

    from gefen_ckpt.dcp import GefenDCPState, GefenSavePlanner

    model = copy.deepcopy(snapshot)
    dcp.save({"model": model.state_dict(), "optim": GefenDCPState(back, model)}, checkpoint_id=tmp_path / "flow",
             planner=GefenSavePlanner())
    result = runner.invoke(app, ["convert", str(tmp_path / "flow"), str(tmp_path / "flow.pt"), "--into", "Gefen",
                                 "--to", "torch", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["conversion"]["from"] == "torch.optim.AdamW"
    # bad input: one line, exit 1 (the data cannot be converted so), nothing written
    for args, match in ((["--into", "GefenMuon"], "2-D parameters only"), (["--into", "SGD"], "no mapping"),
                        (["--optimizer", "Gefen", "--into", "Gefen"], "--optimizer names the optimizer that wrote")):
        dst = tmp_path / "never"
        result = runner.invoke(app, ["convert", str(src), str(dst), *args])
        assert result.exit_code == 1, result.output
        assert match in result.output and result.output.count("error:") == 1, result.output
        assert not dst.exists()


def test_hybrid_state_dict_records_its_contract_and_commands_take_optimizer(tmp_path):
    model = make_model()
    opt = GefenMuonHybrid(model)
    train(model, opt, 2)
    sd = opt.state_dict()
    torch.save(sd, tmp_path / "new.pt")
    torch.save({k: v for k, v in sd.items() if k != CONTRACT_KEY}, tmp_path / "old.pt")
    assert runner.invoke(app, ["inspect", str(tmp_path / "new.pt")]).exit_code == 0
    result = runner.invoke(app, ["inspect", str(tmp_path / "old.pt")])
    assert result.exit_code == 1 and "records no contract" in result.output
    for args in (["inspect", "old.pt"], ["verify", "old.pt"], ["diff", "old.pt", "new.pt"]):
        result = runner.invoke(app, [*args[:1], *(str(tmp_path / a) for a in args[1:]),
                                     "--optimizer", "GefenMuonHybrid"])
        assert result.exit_code == 0, (args, result.output)
    result = runner.invoke(app, ["verify", str(tmp_path / "new.pt"), "--optimizer", "AdamW"])
    assert result.exit_code == 1 and "holds gefen.GefenMuonHybrid state" in result.output
