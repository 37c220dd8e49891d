"""Moving state between AdamW and Gefen: does a converted optimizer continue like the original?

A tiny next-token model (``TinyLM``: embeddings of the last two tokens, an MLP, a head tied to
the embedding) learns a fixed, peaked Markov "language" on one CPU thread. Warm start: AdamW
trains K steps, then from the same weights and batches (1) AdamW continues, (2) its state
converted into Gefen (``gefen_ckpt.convert_state``) continues, (3) a fresh Gefen continues
(what a run without conversion would do). Dense export: Gefen trains K steps, then Gefen and
its state converted into AdamW continue. Losses are means over the first and the last 10
continued steps, each against a baseline from the same run. The conversion's own
errors (relative Frobenius error of the first moment and of the second moment's factored form)
come from the conversion report; the round trip AdamW -> Gefen -> AdamW has exactly these errors.
``quick`` uses K = 40, the full run K = 200.

``tests/ckpt/test_convert.py`` trains the same task (K = 40) and asserts the margins. Writes
``benchmarks/out/convert.json``. Run alone with ``python -m benchmarks.bench_convert [--quick]``.
"""

from __future__ import annotations

import copy
import sys
import time

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_convert.py`
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table, write_json
from gefen import Gefen
from gefen_ckpt.dist.optimizer_state import export_canonical, import_canonical
from gefen_ckpt.formats.convert import convert_state
from gefen_ckpt.formats.torch_file import state_dict_from_canonical

VOCAB, CONTEXT, LR, WD = 48, 2, 3e-3, 0.01
_g = torch.Generator().manual_seed(7)
TRANSITIONS = torch.softmax(torch.randn(VOCAB, VOCAB, generator=_g) * 3, dim=1)  # a peaked bigram language


class TinyLM(torch.nn.Module):
    """Next-token logits from the last CONTEXT tokens. ``tok`` is an embedding by module type,
    not by name; the head is tied to it; ``scale`` is a buffer among the parameters."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, width)
        self.mix = torch.nn.Linear(CONTEXT * width, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.out = torch.nn.Linear(64, width)
        self.register_buffer("scale", torch.ones(()))
        self.head = torch.nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # twice in state_dict(), once in named_parameters()

    def forward(self, ctx: torch.Tensor) -> torch.Tensor:
        h = self.tok(ctx).flatten(1)
        return self.head(self.out(torch.nn.functional.gelu(self.norm(self.mix(h)))) * self.scale)


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def batch(i: int, size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` (the same for every optimizer): contexts and next tokens."""
    g = torch.Generator().manual_seed(1000 + i)
    tokens = [torch.randint(0, VOCAB, (size,), generator=g)]
    for _ in range(CONTEXT):
        tokens.append(torch.multinomial(TRANSITIONS[tokens[-1]], 1, generator=g).squeeze(1))
    seq = torch.stack(tokens, 1)
    return seq[:, :CONTEXT], seq[:, CONTEXT]


def train(model, opt, steps: int, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        ctx, target = batch(i)
        loss = torch.nn.functional.cross_entropy(model(ctx), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def final_loss(losses: list[float]) -> float:
    """Mean of the last 10 steps' training losses."""
    return sum(losses[-10:]) / 10


def windows(losses: list[float]) -> dict:
    """Mean loss of the first and of the last 10 continued steps."""
    return {"first 10": sum(losses[:10]) / 10, "last 10": final_loss(losses)}


def adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.named_parameters(), lr=LR, weight_decay=WD)


def gefen(model) -> Gefen:
    return Gefen(model.named_parameters(), lr=LR, weight_decay=WD)


def warm_start(k: int) -> dict:
    """AdamW for k steps, then AdamW / converted Gefen / fresh Gefen for k more."""
    model = make_model()
    opt = adamw(model)
    train(model, opt, k)
    snapshot, state = copy.deepcopy(model), export_canonical(opt).materialize()
    t0 = time.perf_counter()
    converted = convert_state(state, "Gefen")
    seconds = time.perf_counter() - t0
    losses = {"AdamW continues": windows(train(model, opt, k, start=k))}
    warm_model = copy.deepcopy(snapshot)
    warm = gefen(warm_model)
    import_canonical(warm, converted)
    losses["converted into Gefen"] = windows(train(warm_model, warm, k, start=k))
    cold_model = copy.deepcopy(snapshot)
    losses["fresh Gefen"] = windows(train(cold_model, gefen(cold_model), k, start=k))
    return {"losses": losses, "report": converted.metadata["conversion"], "convert_s": seconds}


def dense_export(k: int) -> dict:
    """Gefen for k steps, then Gefen / its state converted into AdamW for k more."""
    model = make_model()
    opt = gefen(model)
    train(model, opt, k)
    snapshot = copy.deepcopy(model)
    converted = convert_state(export_canonical(opt), "AdamW")
    losses = {"Gefen continues": windows(train(model, opt, k, start=k))}
    dense_model = copy.deepcopy(snapshot)
    dense = adamw(dense_model)
    dense.load_state_dict(state_dict_from_canonical(converted))  # torch's own loader
    losses["converted into AdamW"] = windows(train(dense_model, dense, k, start=k))
    return {"losses": losses, "report": converted.metadata["conversion"]}


def run(quick: bool = False) -> dict:
    torch.set_num_threads(1)
    k = 40 if quick else 200
    data = {"k": k, "quick": quick, "warm_start": warm_start(k), "dense_export": dense_export(k)}
    write_json("convert", data)
    return {"title": "Converting state between AdamW and Gefen (CPU)", "markdown": _markdown(data), "plots": [],
            "data": data}


def _markdown(data: dict) -> str:
    k, warm, dense = data["k"], data["warm_start"], data["dense_export"]
    rows = []
    for trained, block in ((f"AdamW {k} steps, then", warm), (f"Gefen {k} steps, then", dense)):
        base = next(iter(block["losses"].values()))
        rows += [[trained, name] + [f"{v[w]:.4f} ({v[w] / base[w] - 1:+.2%})" for w in ("first 10", "last 10")]
                 for name, v in block["losses"].items()]
    r = warm["report"]
    return "\n\n".join([
        f"`python -m benchmarks.bench_convert` (module docstring: the task). Mean training loss of the first and "
        f"of the last 10 of {k} continued steps, and its change against the first row of each block (the "
        "unconverted optimizer, measured in the same run).",
        md_table(["trained", "continues", "loss, first 10 steps", "loss, last 10 steps"], rows),
        md_table(["AdamW -> Gefen conversion", "relative error", "worst parameter"], [
            ["first moment (codes x scales vs exp_avg)", f"{r['first_moment']['rel_error']:.4f}",
             f"{r['first_moment']['worst']['fqn']} {r['first_moment']['worst']['rel_error']:.4f}"],
            ["second moment (factored / block form vs exp_avg_sq)", f"{r['second_moment']['rel_error']:.4f}",
             f"{r['second_moment']['worst']['fqn']} {r['second_moment']['worst']['rel_error']:.4f}"],
        ]),
        f"Gefen -> AdamW is exact with respect to Gefen's state (errors {dense['report']['first_moment']['rel_error']:g} "
        f"and {dense['report']['second_moment']['rel_error']:g}): the dense moments are the ones Gefen's step uses. "
        f"The conversion itself took {warm['convert_s'] * 1e3:.0f} ms here.",
    ])


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    print(result["markdown"])
