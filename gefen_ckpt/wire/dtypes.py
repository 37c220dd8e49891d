"""How the format spells values: dtype names (the manifest like torch, ``"float32"``; data files
like safetensors) and plain data (hyperparameters, metadata). Torch-free: reading a manifest
needs no torch; the functions that take torch objects import it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: manifest name (also the ``torch`` attribute) -> (safetensors code, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint64": ("U64", 8),
    "uint32": ("U32", 4),
    "uint16": ("U16", 2),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}


#: manifest name -> little-endian numpy dtype, where numpy has one (bfloat16 and the float8s have none)
NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int16": "<i2",
         "int8": "i1", "uint64": "<u8", "uint32": "<u4", "uint16": "<u2", "uint8": "u1", "bool": "?"}


@functools.cache
def _by_torch() -> dict[torch.dtype, str]:
    import torch

    return {getattr(torch, name): name for name in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _by_torch()[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a gefen-ckpt checkpoint") from None


def torch_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """The format's dtype ``name`` as a torch dtype; any other name is a format error naming ``what``."""
    import torch

    if not isinstance(name, str) or name not in DTYPES:
        from gefen_ckpt.errors import CheckpointFormatError

        raise CheckpointFormatError(f"{what}: unknown dtype {name!r}"[:300])
    return getattr(torch, name)


def plain(value, what: str | None = None):
    """``value`` as msgpack-able plain data: one-element tensors as numbers, tuples and sets as
    lists, dtypes by name, str-keyed dicts and lists element by element. Anything else is a
    ``ValueError`` naming ``what``, or, when ``what`` is None, its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v, what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: plain(v, what) for k, v in value.items()}
    if type(value).__module__.startswith("torch"):
        import torch

        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if isinstance(value, torch.dtype):
            return dtype_name(value)
    if what is None:
        return str(value)
    raise ValueError(f"{what}: {type(value).__name__} values cannot be stored as plain data")


def itemsize(name: str) -> int:
    return DTYPES[name][1]
