"""Input checks shared by the optimizers: every error names the option or parameter at fault."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def check_range(name: str, value, low: float, high: float = math.inf, *, high_open: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number in ``[low, high]`` (or ``[low, high)``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (high_open and value == high):
        raise ValueError(f"{name} must be in [{low}, {high}{')' if high_open else ']'}, got {value!r}")


def check_betas(betas) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_range(f"betas[{i}]", b, 0.0, 1.0, high_open=True)


def param_label(group: dict, index: int) -> str:
    """Human name of a parameter for error messages: its FQN when the group has names."""
    names = group.get("param_names")
    return repr(names[index]) if names else f"#{index} of a param group"


def check_params(group: dict, existing_groups: Iterable[dict]) -> None:
    """Parameters must be distinct, floating, real tensors with unique names across the optimizer."""
    params = group["params"]
    seen: set[int] = set()
    for i, p in enumerate(params):
        label = param_label(group, i)
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {label} is a {type(p).__name__}, not a tensor")
        if not p.is_floating_point() or p.is_complex():
            raise TypeError(f"parameter {label} has dtype {p.dtype}; only real floating-point tensors are supported")
        if id(p) in seen:
            raise ValueError(f"parameter {label} appears twice in its param group")
        seen.add(id(p))
    names = group.get("param_names") or []
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate parameter names: {dup}")
    for other in existing_groups:
        clash = set(names) & set(other.get("param_names") or [])
        if clash:
            raise ValueError(f"parameter names already used by another param group: {sorted(clash)}")


def check_grad(grad: torch.Tensor, label: str) -> None:
    if grad.is_sparse:
        raise TypeError(f"parameter {label} has a sparse gradient; Gefen optimizers need dense gradients")
    if grad.is_complex():
        raise TypeError(f"parameter {label} has a complex gradient; only real gradients are supported")


def check_not_adam_state(state_dict: dict, implementation: str) -> None:
    """A torch Adam/AdamW state_dict handed to a Gefen optimizer: say so and how to convert it
    (otherwise the first complaint would be a missing hyperparameter)."""
    entries = state_dict.get("state")
    if isinstance(entries, dict) and any(isinstance(e, dict) and "exp_avg" in e and "m_code" not in e
                                         for e in entries.values()):
        short = implementation.rsplit(".", 1)[-1]
        raise ValueError(
            f"this is torch.optim.AdamW's (or Adam's) state, not {implementation}'s: convert it with "
            f"`gefen-ckpt convert SRC DST --into {short}` or gefen_ckpt.convert_state(state, into={short!r})"
        )
