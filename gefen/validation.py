"""Input checks shared by the optimizers: every error names the option or parameter at fault."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def number(value):
    """A one-element real tensor (torch's optimizers take ``lr`` and ``betas`` as tensors) as a
    Python float; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.detach())
    return value


def plain_hyperparameters(group: dict) -> dict:
    """``group`` with tensor hyperparameters read as floats, once per step (so a scheduler that
    ``fill_``s a tensor ``lr`` is seen)."""
    return {k: v if k in ("params", "param_names") else
            (tuple(number(x) for x in v) if isinstance(v, tuple) else number(v)) for k, v in group.items()}


def check_range(name: str, value, low: float, high: float = math.inf, *, high_open: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number in ``[low, high]`` (or ``[low, high)``)."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"{name} must be a number or a one-element tensor, got a tensor of shape {tuple(value.shape)}")
    value = number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (high_open and value == high):
        raise ValueError(f"{name} must be in [{low}, {high}{')' if high_open else ']'}, got {value!r}")


def check_betas(betas) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_range(f"betas[{i}]", b, 0.0, 1.0, high_open=True)


def check_flags_and_seed(group: dict, flags: tuple[str, ...]) -> None:
    """The group's boolean options are bools and its ``seed`` (the rounding noise's) a non-negative int."""
    for flag in flags:
        if not isinstance(group.get(flag, False), bool):
            raise TypeError(f"{flag} must be a bool, got {group[flag]!r}")
    seed = group.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def check_adamw_options(*, foreach, fused, capturable: bool, differentiable: bool, amsgrad: bool) -> None:
    """torch.optim.AdamW's implementation switches, so Gefen is a drop-in: ``foreach`` / ``fused``
    are hints (one implementation serves both); the others are refused when asked for, with the reason."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {value!r}")
    refused = {
        "amsgrad": "the max of past second moments would need an uncompressed fp32 copy of v (4 bytes/param)",
        "capturable": "the step reads hyperparameters and picks kernels on the host, so it cannot be captured "
                      "in a CUDA graph",
        "differentiable": "the compressed state is re-quantised every step, which has no gradient",
    }
    for name, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(f"{name}=True is not supported by Gefen: {refused[name]}")


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
    """A torch Adam/AdamW state_dict handed to a Gefen optimizer: say so and how to convert it."""
    entries = state_dict.get("state")
    if isinstance(entries, dict) and any(_is_adam_entry(e) for e in entries.values()):
        short = implementation.rsplit(".", 1)[-1]
        raise ValueError(
            f"this is torch.optim.AdamW's (or Adam's) state, not {implementation}'s: convert it with "
            f"`gefen-ckpt convert SRC DST --into {short}` or gefen_ckpt.convert_state(state, into={short!r})"
        )


def _is_adam_entry(entry) -> bool:
    """torch Adam's per-parameter state: ``exp_avg`` with a floating-point step (Gefen's 1-D
    tensors keep ``exp_avg`` too, with an int64 step)."""
    if not isinstance(entry, dict) or "exp_avg" not in entry or "m_code" in entry:
        return False
    step = entry.get("step")
    return not (isinstance(step, torch.Tensor) and step.dtype == torch.int64)
