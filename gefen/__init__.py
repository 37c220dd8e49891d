"""Gefen: memory-efficient PyTorch optimizers with ~1 byte of state per parameter."""

from gefen.contract import FieldSpec, OptimizerContract, contract_of
from gefen.optimizer import Gefen

__all__ = ["Gefen", "contract_of", "OptimizerContract", "FieldSpec"]
__version__ = "0.1.0"
