"""Dtype names: the manifest spells them like torch (``"float32"``), data files like safetensors.

Torch-free (reading a manifest needs no torch); ``torch_dtype``/``dtype_name`` import it.
"""

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


@functools.cache
def _by_torch() -> dict[torch.dtype, str]:
    import torch

    return {getattr(torch, name): name for name in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _by_torch()[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a gefen-ckpt checkpoint") from None


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise KeyError(name)
    return getattr(torch, name)


def safetensors_code(name: str) -> str:
    return DTYPES[name][0]


def itemsize(name: str) -> int:
    return DTYPES[name][1]
