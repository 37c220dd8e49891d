"""Block quantisation of a moment: uint8 codes into a shared codebook, one fp32 scale per block."""

from __future__ import annotations

import torch

from gefen.codebook import nearest_code
from gefen.geometry import as_blocks


def dequantise(codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, period: int) -> torch.Tensor:
    """``codebook[codes] * scale`` as an fp32 tensor shaped like ``codes``."""
    values = codebook.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)
    as_blocks(values, period).mul_(scales.unsqueeze(-1))
    return values


def quantise(moment: torch.Tensor, codebook: torch.Tensor, period: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block max-abs scale and nearest code of ``moment / scale`` (code 0 where the scale is 0)."""
    blocks = as_blocks(moment, period)
    scales = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg())
    zero = scales == 0
    normalised = blocks / torch.where(zero, 1.0, scales).unsqueeze(-1)
    codes = nearest_code(normalised, codebook)
    codes.masked_fill_(zero.unsqueeze(-1), 0)
    return codes.view(moment.shape), scales
