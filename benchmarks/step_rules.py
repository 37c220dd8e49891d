"""Gefen under other step-safety rules, for measuring the bounded-steps decision only.

The product's rule (docs/design.md, "Bounded steps"): the first-moment codebook holds an exact 0,
and the update's denominator is ``max(sqrt(v_hat), |m_hat| / step_bound(t)) + eps``. The rules
here swap one or both parts for the duration of each ``step()`` (restored after it, so a worker
process that runs several jobs keeps the product's rule between them):

* ``unguarded``: neither part (``sqrt(v_hat) + eps``, a codebook with no exact 0; m4v4's update
  still takes the fp32 first moment, as the product's does);
* ``zero-only``: the exact 0 without the floor;
* ``bound-1``: the floor at ``|m_hat|`` (a bound of 1 on every step);
* ``cap``: the floor at AdamW's lone-gradient step ``max(1, (1 - b1) / sqrt(1 - b2))`` on every
  step (no Cauchy-Schwarz growth from 1 at step 1).

``python -m benchmarks.bench_stability --rule NAME`` and ``bench_quality``'s ``gefen-<rule>``
optimizers use them.
"""

from __future__ import annotations

import contextlib
import math

import gefen.codebook as codebook
import gefen.functional as functional

_PRODUCT = (functional.inverse_step_bound, codebook.with_exact_zero)


def _cap(step: int, beta1: float, beta2: float) -> float:
    return 1.0 / max(1.0, (1.0 - beta1) / math.sqrt(1.0 - beta2))


#: rule -> (inverse_step_bound replacement or None (the product's), exact zero kept)
RULES = {
    "bounded": (None, True),
    "unguarded": (lambda step, beta1, beta2: 0.0, False),
    "zero-only": (lambda step, beta1, beta2: 0.0, True),
    "bound-1": (lambda step, beta1, beta2: 1.0, True),
    "cap": (_cap, True),
}


@contextlib.contextmanager
def rule(name: str):
    """Run the enclosed steps under rule ``name`` (every path reads these two functions at call time)."""
    inverse, zero = RULES[name]
    functional.inverse_step_bound = inverse or _PRODUCT[0]
    codebook.with_exact_zero = _PRODUCT[1] if zero else (lambda book: book.copy())
    try:
        yield
    finally:
        functional.inverse_step_bound, codebook.with_exact_zero = _PRODUCT


def under_rule(optimizer_cls, name: str):
    """A subclass of ``optimizer_cls`` (Gefen, GefenMuonHybrid, ...) whose steps run under rule ``name``."""
    if name == "bounded":
        return optimizer_cls

    class Ruled(optimizer_cls):
        def step(self, closure=None):
            with rule(name):
                return super().step(closure)

    Ruled.__name__ = f"{optimizer_cls.__name__}[{name}]"
    return Ruled
