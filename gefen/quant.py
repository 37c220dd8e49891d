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


def block_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's max-abs scale, ``[..., blocks, P] -> [..., blocks]`` (-inf for empty blocks, so
    a MAX over the ranks holding a row's other columns ignores them)."""
    if not blocks.shape[-1]:
        return blocks.new_full(blocks.shape[:-1], float("-inf"))
    return torch.maximum(blocks.amax(-1), blocks.amin(-1).neg())


def quantise(moment: torch.Tensor, codebook: torch.Tensor, period: int,
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block max-abs scale and nearest code of ``moment / scale`` (code 0 where the scale is 0).
    ``scales`` given: the blocks' scales computed elsewhere (a block a column split cuts, whose
    max-abs is reduced over the ranks holding its other columns)."""
    blocks = as_blocks(moment, period)
    scales = block_scales(blocks) if scales is None else scales
    zero = scales == 0
    normalised = blocks / torch.where(zero, 1.0, scales).unsqueeze(-1)
    codes = nearest_code(normalised, codebook)
    codes.masked_fill_(zero.unsqueeze(-1), 0)
    return codes.view(moment.shape), scales
