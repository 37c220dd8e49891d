"""Train a small model with Gefen next to AdamW on CPU; print both losses and state sizes.

The first half of `make demo` (examples/demo.py; the second is train_reshard_resume.py). Writes nothing.
"""

from __future__ import annotations

import torch

from gefen import Gefen


def make_task(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(2048, 8, generator=g)
    return x, y


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 256),
        torch.nn.GELU(), torch.nn.Linear(256, 8),
    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = {id(t): t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    books = optimizer.global_books() if hasattr(optimizer, "global_books") else {}  # Gefen's codebooks,
    tensors.update({id(b): b for name in books if (b := getattr(optimizer, name)) is not None})  # shared: once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def train(optimizer_cls, lr: float, steps: int = 300, **kwargs) -> tuple[float, int, int]:
    x, y = make_task()
    model = make_model()
    opt = optimizer_cls(model.named_parameters() if optimizer_cls is Gefen else model.parameters(), lr=lr, **kwargs)
    print(f"  {optimizer_cls.__name__:<6} training {steps} steps ...", flush=True)
    for step in range(steps):
        idx = torch.randint(0, len(x), (128,), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"  {optimizer_cls.__name__:<6} step {step + 1:>3}/{steps}  batch loss {loss.item():.5f}", flush=True)
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    return final, state_bytes(opt), sum(p.numel() for p in model.parameters())


def main() -> None:
    torch.set_num_threads(2)
    results = []
    for name, cls in (("AdamW", torch.optim.AdamW), ("Gefen", Gefen)):
        results.append((name, *train(cls, lr=2e-3, weight_decay=0.01)))
    print(f"\n{'optimizer':<10} {'final loss':>11} {'state bytes':>12} {'bytes/param':>12}")
    for name, loss, nbytes, nparams in results:
        print(f"{name:<10} {loss:>11.5f} {nbytes:>12,} {nbytes / nparams:>12.3f}")


if __name__ == "__main__":
    main()
