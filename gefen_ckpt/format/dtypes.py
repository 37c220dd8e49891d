"""Dtype names: the manifest spells them like torch (``"float32"``), data files like safetensors."""

from __future__ import annotations

import torch

#: manifest name -> (torch dtype, safetensors code, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, str, int]] = {
    "float64": (torch.float64, "F64", 8),
    "float32": (torch.float32, "F32", 4),
    "float16": (torch.float16, "F16", 2),
    "bfloat16": (torch.bfloat16, "BF16", 2),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3", 1),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2", 1),
    "int64": (torch.int64, "I64", 8),
    "int32": (torch.int32, "I32", 4),
    "int16": (torch.int16, "I16", 2),
    "int8": (torch.int8, "I8", 1),
    "uint64": (torch.uint64, "U64", 8),
    "uint32": (torch.uint32, "U32", 4),
    "uint16": (torch.uint16, "U16", 2),
    "uint8": (torch.uint8, "U8", 1),
    "bool": (torch.bool, "BOOL", 1),
}
_BY_TORCH = {t: name for name, (t, _, _) in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a gefen-ckpt checkpoint") from None


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name][0]


def safetensors_code(name: str) -> str:
    return DTYPES[name][1]


def itemsize(name: str) -> int:
    return DTYPES[name][2]
