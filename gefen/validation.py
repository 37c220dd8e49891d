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


def check_range(name: str, value, low: float, high: float = math.inf, *, high_open: bool = False,
                torch_says: str | None = None, torch_checks_high: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number in ``[low, high]`` (or ``[low, high)``).
    ``torch_says``: torch's own message (``{}`` for the value) for a value torch's optimizer refuses
    too (below ``low``, NaN, and above ``high`` if ``torch_checks_high``); ours then starts with it,
    so code matching torch's text matches ours."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element ({name} must be a number or a one-element tensor, got a "
                         f"tensor of shape {tuple(value.shape)})")
    shown, value = value, number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    interval = f"[{low}, {high}{')' if high_open else ']'}"
    below = not value >= low  # NaN too, as torch's ``not low <= value``
    above = value > high or (high_open and value == high)
    if torch_says and (below or (above and torch_checks_high)):
        raise ValueError(f"{torch_says.format(shown)} ({name} must be a finite number in {interval})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if below or above:
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def check_betas(betas) -> None:
    """AdamW's rules and words: a pair, both numbers or both one-element tensors, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"betas must be either both floats or both Tensors (got {betas!r})")
    for i, b in enumerate(betas):
        check_range(f"betas[{i}]", b, 0.0, 1.0, high_open=True, torch_checks_high=True,
                    torch_says=f"Invalid beta parameter at index {i}: {{}}")


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
        "amsgrad": "the max of past second moments would need an uncompressed fp32 copy of v (4 bytes/param); "
                   "use torch.optim.AdamW(amsgrad=True) for it",
        "capturable": "the step reads hyperparameters and picks kernels on the host, so it cannot be captured "
                      "in a CUDA graph; step Gefen outside the graph, or use torch.optim.AdamW(capturable=True)",
        "differentiable": "the compressed state is re-quantised every step, which has no gradient; use "
                          "torch.optim.AdamW(differentiable=True) to differentiate through the step",
    }
    for name, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(f"{name}=True is not supported by Gefen: {refused[name]}")


def param_label(group: dict, index: int) -> str:
    """Human name of a parameter for error messages: its FQN when the group has names."""
    names = group.get("param_names")
    return repr(names[index]) if names else f"#{index} of a param group"


def check_params(group: dict, existing_groups: Iterable[dict]) -> None:
    """Parameters must be floating-point tensors with unique names across the optimizer. A tensor
    listed twice in a group passes (torch warns and goes on; the step updates it once), and
    complex tensors are refused at ``step()``, where torch's optimizers refuse them (``check_step_param``)."""
    for i, p in enumerate(group["params"]):
        label = param_label(group, i)
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {label} is a {type(p).__name__}, not a tensor")
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(f"parameter {label} has dtype {p.dtype}; only real floating-point tensors are supported")
    names = group.get("param_names") or []
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate parameter names: {dup}")
    for other in existing_groups:
        clash = set(names) & set(other.get("param_names") or [])
        if clash:
            raise ValueError(f"parameter names already used by another param group: {sorted(clash)}")


#: torch's words where its optimizer refuses a parameter at ``step()`` (None: it does not); our
#: message starts with them. Adam's fused step refuses complex parameters, its others view them as real.
TORCH_STEP_REFUSALS = {
    "Adam": {"sparse": "Adam does not support sparse gradients, please consider SparseAdam instead",
             "complex": None},
    "Muon": {"sparse": "Muon does not support sparse gradients", "complex": "Muon does not support complex parameters"},
}


def check_step_param(param: torch.Tensor, grad: torch.Tensor, label: str, torch_name: str, ours: str) -> None:
    """Refuse, before any state changes, what the step cannot take, as torch's optimizer ``torch_name``
    refuses it: RuntimeError at ``step()`` (``ours``: the optimizer's name in the message)."""
    said = TORCH_STEP_REFUSALS[torch_name]
    if grad.is_sparse:
        raise RuntimeError(f"{said['sparse']} (parameter {label} has a sparse gradient; {ours} needs dense gradients)")
    if param.is_complex() or grad.is_complex():
        first = said["complex"] or f"{ours} does not support complex parameters"
        raise RuntimeError(f"{first} (parameter {label} is {param.dtype}): the compressed state follows real rows; "
                           "keep a real parameter (e.g. torch.view_as_real of the complex one) and view it as "
                           "complex in the forward (torch.view_as_complex)")
    if param.is_meta or grad.is_meta:
        raise RuntimeError(f"{ours} cannot step meta tensors: parameter {label} is on the meta device; materialise "
                           "and initialise the tensors this optimizer holds first (build it after "
                           "module.to_empty(device=...), or call to_empty under "
                           "torch.__future__.set_swap_module_params_on_conversion(True))")


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
    """torch Adam's per-parameter state: ``exp_avg`` (no codes) with a floating-point step, or
    (older torch's Python ``step``) moments of one dtype. Gefen's 1-D tensors keep ``exp_avg`` too,
    in bfloat16 beside a float32 ``exp_avg_sq``, with an integral step."""
    if not isinstance(entry, dict) or "exp_avg" not in entry or "m_code" in entry or "mv_code" in entry:
        return False
    step, m, v = entry.get("step"), entry.get("exp_avg"), entry.get("exp_avg_sq")
    if isinstance(step, torch.Tensor):
        return step.dtype != torch.int64
    if isinstance(step, bool) or not isinstance(step, int):
        return True
    return isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and m.dtype == v.dtype
