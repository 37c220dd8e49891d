"""One codec per state layout: a tensor's moments as the layout's fields and back, for the step's
reference and gefen_ckpt's conversions. Rounding is the caller's (the step's stochastic, a conversion's nearest)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gefen.codebook import nearest_code
from gefen.geometry import as_blocks
from gefen.quant import dequantise, quantise
from gefen.stochastic import LOG_RANGE, TINY


def row_abs_max(m: torch.Tensor) -> torch.Tensor:
    """max |m| of each row of a ``[rows, cols]`` tensor (0 for rows without columns)."""
    return m.abs().amax(1) if m.shape[1] else m.new_zeros(m.shape[0])


@dataclass(frozen=True)
class M8Codec:
    """Contract version "1" (and GefenMuon's momentum): ``m_code`` into ``codebook`` times
    ``m_scale``, each block's max-abs; the second moment factored (``v_row``, ``v_col``) or per block."""

    codebook: torch.Tensor

    def encode(self, m: torch.Tensor, v: torch.Tensor | None, period: int, factored: bool) -> dict:
        """Nearest codes of ``m``; ``v`` (None: GefenMuon) as the step accumulates it (means of an EMA)."""
        codes, scales = quantise(m, self.codebook, period)
        fields = {"period": torch.tensor(period, dtype=torch.int64), "m_code": codes, "m_scale": scales}
        if v is not None:
            fields.update({"v_row": v.mean(1), "v_col": v.mean(0)} if factored else {"v": as_blocks(v, period).mean(-1)})
        return fields

    @staticmethod
    def factored(v_row: torch.Tensor, v_col: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """``outer(v_row, v_col) / mean`` (``mean``: of ``v_row``)."""
        return torch.outer(v_row, v_col).div_(mean)

    def decode(self, fields: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 ``(m, v)`` shaped like the parameter (``v`` None without its fields)."""
        period, shape = int(fields["period"]), fields["m_code"].shape
        m, v = dequantise(fields["m_code"], fields["m_scale"], self.codebook, period), fields.get("v")
        if "v_row" in fields and "v_col" in fields:
            v_row = fields["v_row"].float()
            v = self.factored(v_row, fields["v_col"].float(), v_row.double().mean().float().clamp_min(TINY))
        elif v is not None:
            v = v.float().unsqueeze(-1).expand(*v.shape, period)
        return m, None if v is None else v.reshape(shape).clone()


@dataclass(frozen=True)
class M4V4Codec:
    """Contract version "2", a tensor of >= 2 dims: one byte per element (``pack``), its first moment
    ``codebook[low nibble]`` times its row's bf16 max-abs ``m_row_scale``, the second ``vhat * R[high
    nibble]`` (``R``: ``ratio = ratio_table(v_codebook)``); bytes and moments ``[rows, row_numel]``."""

    codebook: torch.Tensor
    ratio: torch.Tensor | None = None

    @staticmethod
    def pack(m_code: torch.Tensor, v_code: torch.Tensor) -> torch.Tensor:
        return m_code | (v_code << 4)

    @staticmethod
    def unpack(mv_code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``pack``'s inverse: the first and second moment's codes."""
        return mv_code & 15, mv_code >> 4

    @staticmethod
    def vhat(v_row: torch.Tensor, v_col: torch.Tensor, total: torch.Tensor | None = None,
             rows: int | None = None) -> torch.Tensor:
        """``(v_row / mean)[i] * v_col[j]``, ``mean = max(total / rows, TINY)`` rounded once from float64
        (``total``, ``rows``: of ``v_row`` over every rank; default: these rows)."""
        total = v_row.sum(dtype=torch.float64) if total is None else total
        mean = (total / max(v_row.numel() if rows is None else rows, 1)).float().clamp_min(TINY)
        return (v_row / mean)[:, None] * v_col[None, :]

    @staticmethod
    def normalise(m: torch.Tensor, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m / scale, scale)``, the bf16 ``scale`` of ``row_max``, the rows' max |m|."""
        scale = row_max.to(torch.bfloat16)
        return m / torch.where(scale == 0, 1.0, scale.float())[:, None], scale

    def momentum(self, mv_code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.codebook.take(self.unpack(mv_code)[0].long()) * scale.float()[:, None]

    def second_moment(self, mv_code: torch.Tensor, vhat: torch.Tensor) -> torch.Tensor:
        return vhat * self.ratio.take(self.unpack(mv_code)[1].long())

    def decode(self, fields: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(m, v)`` shaped like the parameter, as the last step used them (all rows given)."""
        codes, vhat = fields["mv_code"].flatten(1), self.vhat(fields["v_row"].float(), fields["v_col"].float())
        m, v = self.momentum(codes, fields["m_row_scale"]), self.second_moment(codes, vhat)
        return m.view(fields["mv_code"].shape), v.view(fields["mv_code"].shape)

    def encode_nearest(self, m: torch.Tensor, v: torch.Tensor, v_codebook: torch.Tensor) -> dict:
        """Moments shaped like the parameter as fields, nearest codes (the second moment's in log ratio)."""
        shape, m, v = m.shape, m.flatten(1), v.flatten(1)
        x, scale = self.normalise(m, row_abs_max(m))
        v_row, v_col = v.double().mean(1).float(), v.double().mean(0).float()
        log_ratio = torch.log(v.clamp_min(TINY) / self.vhat(v_row, v_col).clamp_min(TINY)).div_(LOG_RANGE)
        codes = self.pack(nearest_code(x, self.codebook), nearest_code(log_ratio.clamp_(-1.0, 1.0), v_codebook))
        return {"mv_code": codes.reshape(shape), "m_row_scale": scale, "v_row": v_row, "v_col": v_col}
