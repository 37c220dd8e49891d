"""Gefen: memory-efficient PyTorch optimizers with ~1 byte of state per parameter."""

from gefen.contract import FieldSpec, OptimizerContract, contract_of
from gefen.hybrid import GefenMuonHybrid, split_params_for_muon
from gefen.muon import GefenMuon
from gefen.optimizer import Gefen

__all__ = ["Gefen", "GefenMuon", "GefenMuonHybrid", "split_params_for_muon", "contract_of", "OptimizerContract", "FieldSpec"]
__version__ = "0.1.0"
