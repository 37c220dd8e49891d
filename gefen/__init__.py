"""Gefen: memory-efficient PyTorch optimizers with ~1 byte of state per parameter. The optimizers
are imported on first use, so reading a checkpoint's contract does not import torch.
"""

from gefen._lazy import lazy_exports
from gefen.contract import FieldSpec, OptimizerContract, contract_of

_LAZY = {"Gefen": "gefen.optimizer", "GefenMuon": "gefen.muon", "GefenMuonHybrid": "gefen.hybrid",
         "split_params_for_muon": "gefen.hybrid"}

__all__ = ["Gefen", "GefenMuon", "GefenMuonHybrid", "split_params_for_muon", "contract_of", "OptimizerContract", "FieldSpec"]
__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
