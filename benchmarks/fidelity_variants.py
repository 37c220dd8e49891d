"""Prototype: a Gefen-like AdamW step with pluggable moment storage, for measurement only.

The production optimizer (``gefen.Gefen``) keeps an 8-bit first moment and a factored second
moment. Its loss gap to AdamW on real text is the factored second moment, so this eager torch
prototype tries per-element second-moment codes that fit next to a narrower first moment in
about one byte. Nothing here is used by ``gefen``; it exists to choose the next default.

Every tensor with two or more dimensions is stored per row of its global shape, as in Gefen
(``rows = shape[0]``, one scale per row): codes in the parameter's geometry plus per-row and
per-column statistics, so a row split still hands every rank whole rows and the state still
reshards bit-exactly. 1-D tensors keep exact fp32 moments (a negligible share).

Second-moment storage (``v``):

* ``"factored"``: row and column EMAs of g^2, ``vhat = outer(v_row, v_col) / mean(v_row)``
  (today's Gefen).
* ``"ratio"``: the factored estimate *and* a per-element code of ``log(v / vhat)`` in the fixed
  range +-``LOG_RANGE`` (no per-row scale: rows of 192 cannot afford a third fp32 per row under
  1.05 B/param), codebook learned with ``gefen.codebook.learn_codebook`` (the exact DP) from the
  first step's log-ratios.
* ``"rowlog"``: a per-element code of ``log v`` in ``[hi - 2 LOG_RANGE, hi]``, ``hi`` the row's
  max (one fp32 per row), uniform codes: coded against its own row scale, no factored reference.

Rounding of the re-quantised moments: ``"nearest"`` (as Gefen), or ``"stochastic"``, unbiased
rounding between the two neighbouring codes with a counter-based hash of (global element
index, step, seed): deterministic and independent of the world size and mesh, since the global
index of an element does not depend on the layout. Nearest rounding of an EMA with
``beta2 = 0.999`` freezes a coarse code (each step moves ``v`` by ~0.1%, far below a 4-bit step);
stochastic rounding keeps the EMA unbiased.
"""

from __future__ import annotations

import math

import torch

from gefen.codebook import learn_codebook

LOG_RANGE = 8.0  # |log(v / vhat)| is clamped here (e^8 ~ 3000x in v, 55x in sqrt(v))


def _hash_uniform(index: torch.Tensor, step: int, salt: int) -> torch.Tensor:
    """Uniform [0, 1) fp32 from a 32-bit integer mix of (index, step, salt): same bits on any
    layout because ``index`` is the element's global position."""
    x = (index * 0x9E3779B1 + step * 0x85EBCA77 + salt * 0xC2B2AE3D) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return (x >> 8).float() * (1.0 / (1 << 24))


def _histogram_fixed(items: list[torch.Tensor], num_bins: int) -> torch.Tensor:
    """Histogram of values already in [-1, 1] (no per-block normalisation: the range is fixed)."""
    idx = torch.cat([b.reshape(-1) for b in items]).add(1).div(2).mul(num_bins).long().clamp(0, num_bins - 1)
    return torch.bincount(idx, minlength=num_bins)


def encode(x: torch.Tensor, codebook: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """Codes of ``x`` (already in [-1, 1]) in a sorted codebook: nearest, or stochastic between
    the two neighbours when ``noise`` (uniform [0, 1), same shape) is given."""
    x = x.clamp(-1.0, 1.0)
    if noise is None:
        mids = (codebook[1:] + codebook[:-1]) / 2
        return torch.searchsorted(mids, x.contiguous())
    hi = torch.searchsorted(codebook, x.contiguous()).clamp(1, codebook.numel() - 1)
    lo_v, hi_v = codebook[hi - 1], codebook[hi]
    p_up = ((x - lo_v) / (hi_v - lo_v).clamp_min(1e-12)).clamp(0, 1)
    return torch.where(noise < p_up, hi, hi - 1)


class MomentVariant(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with the moments stored as configured.

    ``m_bits``: bits of the first-moment code (per-row max-abs scale, learned codebook);
    ``v``: ``"factored" | "ratio" | "rowlog"``; ``v_bits``: bits of the per-element second-moment
    code; ``rounding``: ``"nearest" | "stochastic"`` (applies to both codes).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 m_bits=8, v="factored", v_bits=0, rounding="nearest", v_codebook="learned", seed=0):
        if v not in ("factored", "ratio", "rowlog"):
            raise ValueError(f"unknown second-moment storage {v!r}")
        if (v == "factored") != (v_bits == 0) or m_bits + v_bits > 8:
            raise ValueError(f"bad bit split m_bits={m_bits}, v={v}, v_bits={v_bits}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.m_bits, self.v_mode, self.v_bits = m_bits, v, v_bits
        self.rounding, self.v_codebook, self.seed = rounding, v_codebook, seed
        self.m_book: torch.Tensor | None = None
        self.v_book: torch.Tensor | None = None

    # ----- accounting ---------------------------------------------------------------------------
    def state_bytes(self, stat_bytes: int = 4) -> int:
        """Bytes the state would take packed: ``m_bits + v_bits`` per element of matrices,
        per-row/per-column statistics of ``stat_bytes`` each (fp32 as stored; 2 = what bf16
        statistics would cost), exact fp32 moments of 1-D tensors, the codebooks."""
        total = 4 * sum(b.numel() for b in (self.m_book, self.v_book) if b is not None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() < 2:
                    total += 8 * p.numel()
                    continue
                rows, cols = p.shape[0], p[0].numel()
                total += math.ceil(p.numel() * (self.m_bits + self.v_bits) / 8) + stat_bytes * rows  # codes, m scale
                # factored statistics (also the ratio's reference), or the row's max log v
                total += stat_bytes * (rows if self.v_mode == "rowlog" else rows + cols)
        return total

    # ----- the step ----------------------------------------------------------------------------
    def _noise(self, shape, step: int, salt: int):
        if self.rounding != "stochastic":
            return None
        index = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)
        return _hash_uniform(index, step, salt + 7919 * self.seed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mats = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None and p.dim() >= 2]
        if self.m_book is None and mats:
            blocks = [p.grad.reshape(p.shape[0], 1, -1).float() for _, p in mats]
            self.m_book = learn_codebook(blocks, 2**self.m_bits)
        index = 0  # the parameter's position: its stream of rounding noise
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p, index)
                index += 1
        return loss

    def _update(self, group, p, index):
        beta1, beta2 = group["betas"]
        g = p.grad.float()
        st = self.state[p]
        step = st.get("step", 0) + 1
        st["step"] = step
        p.mul_(1 - group["lr"] * group["weight_decay"])
        if p.dim() < 2:  # exact AdamW
            m = st.setdefault("m", torch.zeros_like(g)).lerp_(g, 1 - beta1)
            v = st.setdefault("v", torch.zeros_like(g)).mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
            p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**step))
            return
        g2 = g.reshape(p.shape[0], -1)
        salt = 2 * index
        m = self._load_m(st, g2).lerp_(g2, 1 - beta1)
        m = self._store_m(st, m, step, salt)
        v = self._second_moment(st, g2, beta2, step, salt + 1)
        denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
        p.add_((m / denom).view_as(p), alpha=-group["lr"] / (1 - beta1**step))

    def _load_m(self, st, g2):
        if "m_code" not in st:
            return torch.zeros_like(g2)
        return self.m_book[st["m_code"].long()] * st["m_scale"][:, None]

    def _store_m(self, st, m, step, salt):
        scale = m.abs().amax(1)
        safe = torch.where(scale > 0, scale, 1.0)
        codes = encode(m / safe[:, None], self.m_book, self._noise(m.shape, step, salt))
        st["m_code"], st["m_scale"] = codes.to(torch.uint8), scale
        return self.m_book[codes] * scale[:, None]

    def _factored(self, st, g2, beta2):
        """Update the row/column EMAs; return (old estimate or None, new estimate)."""
        old = self._vhat(st) if "v_row" in st else None
        sq = g2.square()
        st["v_row"] = st.get("v_row", torch.zeros(g2.shape[0])) * beta2 + sq.mean(1) * (1 - beta2)
        st["v_col"] = st.get("v_col", torch.zeros(g2.shape[1])) * beta2 + sq.mean(0) * (1 - beta2)
        return old, self._vhat(st)

    @staticmethod
    def _vhat(st):
        mean = st["v_row"].mean().clamp_min(torch.finfo(torch.float32).tiny)
        return torch.outer(st["v_row"], st["v_col"]) / mean

    def _second_moment(self, st, g2, beta2, step, salt):
        tiny = torch.finfo(torch.float32).tiny
        if self.v_mode == "factored":
            return self._factored(st, g2, beta2)[1]
        if self.v_mode == "ratio":
            old, vhat = self._factored(st, g2, beta2)
            v_old = torch.zeros_like(g2) if old is None else old * torch.exp(self.v_book[st["v_code"].long()] * LOG_RANGE)
            v = v_old.mul_(beta2).addcmul_(g2, g2, value=1 - beta2)
            x = torch.log(v.clamp_min(tiny) / vhat.clamp_min(tiny)).div_(LOG_RANGE).clamp_(-1, 1)
            if self.v_book is None:  # learned once, from the first step's log-ratios
                self.v_book = (learn_codebook([x.unsqueeze(1)], 2**self.v_bits, histogram=_histogram_fixed)
                               if self.v_codebook == "learned" else torch.linspace(-1, 1, 2**self.v_bits))
            codes = encode(x, self.v_book, self._noise(x.shape, step, salt))
            st["v_code"] = codes.to(torch.uint8)
            return vhat * torch.exp(self.v_book[codes] * LOG_RANGE)
        # rowlog: log v in [hi - 2 LOG_RANGE, hi] (hi = the row's max), uniform codes
        levels = 2**self.v_bits - 1
        if "v_code" in st:
            v_old = torch.exp(st["v_hi"][:, None] + (st["v_code"].float() / levels - 1) * 2 * LOG_RANGE)
        else:
            v_old = torch.zeros_like(g2)
        v = v_old.mul_(beta2).addcmul_(g2, g2, value=1 - beta2)
        logv = torch.log(v.clamp_min(tiny))
        hi = logv.amax(1)
        x = ((logv - hi[:, None]) / LOG_RANGE + 1).clamp_(-1, 1)
        codes = encode(x, torch.linspace(-1, 1, levels + 1), self._noise(x.shape, step, salt))
        st["v_code"], st["v_hi"] = codes.to(torch.uint8), hi
        return torch.exp(hi[:, None] + (codes.float() / levels - 1) * 2 * LOG_RANGE)
