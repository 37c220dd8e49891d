"""Helpers shared by the checkpoint-format tests: a tiny transformer-ish model, optimizer
factories, deterministic training, bitwise snapshots of optimizer state, and synthetic
Gefen states of any size (valid for ``Gefen.load_state_dict``, built without stepping)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import gefen
import gefen_ckpt
from gefen.contract import contract_of


class Tiny(nn.Module):
    """Embedding, two hidden matrices, a norm and an untied head (every routing case of the hybrid)."""

    def __init__(self, vocab: int = 40, dim: int = 16, hidden: int = 48):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.lm_head(self.norm(h))


def make_model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


OPTIMIZERS = {
    "gefen_factored": lambda m: gefen.Gefen(m.named_parameters(), lr=1e-2, weight_decay=0.01),
    "gefen_block": lambda m: gefen.Gefen(m.named_parameters(), lr=1e-2, factored_v_2d=False, moments="m8"),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01),
    "muon": lambda m: gefen.GefenMuon([(n, p) for n, p in m.named_parameters() if n in ("up.weight", "down.weight")],
                                      lr=1e-2),
    "hybrid_gefen": lambda m: gefen.GefenMuonHybrid(m, lr=1e-2, backup="gefen"),
    "hybrid_adamw": lambda m: gefen.GefenMuonHybrid(m, lr=1e-2, backup="adamw"),
}


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 40, (8, 12), generator=gen)
        target = torch.randint(0, 40, (8, 12), generator=gen)
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def trained(kind: str, steps: int = 3, seed: int = 0):
    model = make_model(seed)
    opt = OPTIMIZERS[kind](model)
    train(model, opt, steps)
    return model, opt


def fresh_like(model: nn.Module, kind: str):
    """A copy of ``model`` (same weights) with a new, empty optimizer of ``kind``."""
    clone = copy.deepcopy(model)
    return clone, OPTIMIZERS[kind](clone)


def snapshot(opt: torch.optim.Optimizer, model: nn.Module) -> dict:
    """Everything about the optimizer's state, owned, for bitwise comparison (empty if no state)."""
    state = gefen_ckpt.export_canonical(opt, model=model)
    out = {"groups": [dict(g) for g in state.param_groups], "contract": contract_of(opt).to_dict()}
    for key, src in state.tensors():
        out[key] = src.read().clone()
    return out


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, -0.0 != 0.0)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    x, y = x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)
    if x.numel() % 8 == 0 and x.storage_offset() % 8 == 0 and y.storage_offset() % 8 == 0:
        x, y = x.view(torch.int64), y.view(torch.int64)  # 8 bytes at a time: much faster than uint8
    return torch.equal(x, y)


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not (bits_equal(x, y) if isinstance(x, torch.Tensor) else x == y):
            return False
    return True


def canonical_equal(a: gefen_ckpt.CanonicalState, b: gefen_ckpt.CanonicalState) -> bool:
    ta, tb = dict(a.tensors()), dict(b.tensors())
    if ta.keys() != tb.keys() or a.param_groups != b.param_groups or a.contract != b.contract:
        return False
    return all(bits_equal(ta[k].read(), tb[k].read()) for k in ta)


# ----- large synthetic Gefen states ---------------------------------------------------------
def transformer_shapes(dim: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    shapes = {"embed.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attn.qkv.weight": (3 * dim, dim), p + "attn.out.weight": (dim, dim),
                       p + "mlp.up.weight": (4 * dim, dim), p + "mlp.down.weight": (dim, 4 * dim),
                       p + "norm1.weight": (dim,), p + "norm2.weight": (dim,)})
    shapes["norm.weight"] = (dim,)
    return shapes


def synthetic_gefen(shapes: dict[str, tuple[int, ...]], seed: int):
    """(params, Gefen optimizer) whose state is random but valid: one block per row for
    matrices (always a legal period), per-element state for vectors, a sorted codebook."""
    gen = torch.Generator().manual_seed(seed)
    params = [(name, nn.Parameter(torch.zeros(shape))) for name, shape in shapes.items()]
    opt = gefen.Gefen(params, lr=1e-3, moments="m8")  # m8 state, written directly
    codebook = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values
    codebook[0], codebook[-1] = -1.0, 1.0
    state = {}
    for i, (_, p) in enumerate(params):
        rows, row_numel = p.shape[0], p[0].numel()
        period = row_numel if p.dim() >= 2 else 1
        entry = {
            "step": torch.tensor(seed + 1, dtype=torch.int64),
            "period": torch.tensor(period, dtype=torch.int64),
            "m_code": torch.randint(0, 256, tuple(p.shape), dtype=torch.uint8, generator=gen),
            "m_scale": torch.rand(rows, row_numel // period, generator=gen),
        }
        if p.dim() == 2:
            entry["v_row"] = torch.rand(rows, generator=gen)
            entry["v_col"] = torch.rand(p.shape[1], generator=gen)
        else:
            entry["v"] = torch.rand(rows, row_numel // period, generator=gen)
        state[i] = entry
    sd = opt.state_dict()
    sd["state"] = state
    sd["global_state"] = {"codebook": codebook}
    opt.load_state_dict(sd)
    return params, opt


# ----- the crash-safety worker (runs in a forked child that the test SIGKILLs) -------------
CRASH_SHAPES = transformer_shapes(dim=512, layers=6, vocab=8000)  # ~23M params: ~24 MB of state


def crash_worker(sources: list[str], url: str, fresh_url: str, ready, saves) -> None:
    """Copy checkpoint ``sources[0]`` into the empty ``fresh_url``, then write the sources in
    turn over ``url`` forever (streamed from the source files), until killed; ``saves``
    counts the completed saves."""
    torch.set_num_threads(1)
    ready.set()
    gefen_ckpt.write(gefen_ckpt.read(sources[0]), fresh_url)
    saves.value += 1
    i = 1
    while True:
        gefen_ckpt.write(gefen_ckpt.read(sources[i % 2]), url)
        saves.value += 1
        i += 1
