"""A small real-text check of Gefen against AdamW: a character transformer LM on CPython's
standard-library sources (real text that ships with Python: no download).

d = 192, 2 pre-norm layers (4 heads), context 64, batch 16, 300 steps, cosine LR 2e-3 with 30
warm-up steps, weight decay 0.1, gradient clipping 1.0, one thread; held-out loss on the last
10% of the text (20 fixed batches), seeds 0 and 1. Rows of 192 and 768 make block-length rules
that depend on the row length differ. About 2 minutes per optimizer and seed on one core.

    python benchmarks/quality_lm.py            # prints JSON: held-out loss per optimizer and seed
"""

from __future__ import annotations

import glob
import json
import math
import os
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

from gefen import Gefen

D, LAYERS, HEADS, CONTEXT, BATCH, STEPS, WARMUP = 192, 2, 4, 64, 16, 300, 30


def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:60]
    text = "".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return data[:split], data[split:], len(chars)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class CharLM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(CONTEXT, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(src: torch.Tensor, gen: torch.Generator):
    ix = torch.randint(0, len(src) - CONTEXT - 1, (BATCH,), generator=gen)
    return torch.stack([src[i:i + CONTEXT] for i in ix]), torch.stack([src[i + 1:i + CONTEXT + 1] for i in ix])


def held_out_loss(make_optimizer, seed: int, data) -> float:
    train, held, vocab = data
    torch.manual_seed(seed)
    model = CharLM(vocab)
    opt = make_optimizer(model.named_parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(STEPS):
        x, y = batch(train, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        return sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                   for x, y in (batch(held, gen) for _ in range(20))) / 20


OPTIMIZERS = {
    "adamw": lambda named: torch.optim.AdamW(named, lr=2e-3, weight_decay=0.1),
    "gefen": lambda named: Gefen(named, lr=2e-3, weight_decay=0.1),
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    data = corpus()
    print(json.dumps({name: [held_out_loss(make, seed, data) for seed in (0, 1)] for name, make in OPTIMIZERS.items()}))
