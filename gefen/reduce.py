"""The one seam through which the optimizers reach other ranks.

Every quantity the optimizers must agree on globally (period statistics, the codebook
histogram, the factored second moment's column sums) is summed through a ``Reducer``. A
single process uses ``LocalReducer``; the distributed issue plugs in a process-group reducer
without touching the math.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Reducer(Protocol):
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over every rank that holds a slice of the same parameters."""


class LocalReducer:
    """A single process holds every row already: nothing to reduce."""

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
