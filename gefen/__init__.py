"""Gefen: memory-efficient PyTorch optimizers with ~1 byte of state per parameter.

The optimizers are imported on first use, so that reading a checkpoint's contract (the
``gefen-ckpt inspect``/``verify`` path) does not pay for importing torch.
"""

import importlib

from gefen.contract import FieldSpec, OptimizerContract, contract_of

_LAZY = {"Gefen": "gefen.optimizer", "GefenMuon": "gefen.muon", "GefenMuonHybrid": "gefen.hybrid",
         "split_params_for_muon": "gefen.hybrid"}

__all__ = ["Gefen", "GefenMuon", "GefenMuonHybrid", "split_params_for_muon", "contract_of", "OptimizerContract", "FieldSpec"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gefen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
