"""Counting the torch operations a block dispatches: what the "a few ops per step" and "no op per
tensor" tests measure (each op reaching the dispatcher can release the GIL and costs a launch)."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """``with CountOps() as counted: ...``; ``counted.ops`` counts each op by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
