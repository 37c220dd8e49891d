"""Gefen and gefen_ckpt on a CUDA device (skipped without one; `benchmarks/gpu.sh` runs them).

CUDA has no fused kernel yet, so these check the eager step there: it runs, keeps the state
compressed, tracks the CPU reference to fp32 rounding, and its checkpoints load on CPU.
"""

from __future__ import annotations

import pytest
import torch

import gefen_ckpt
from gefen import Gefen, GefenMuon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SHAPES = {"embed": (512, 64), "up": (256, 64), "down": (64, 256), "norm": (64,)}


def _run(device: str, steps: int = 3, dtype=torch.float32, **kwargs):
    gen = torch.Generator().manual_seed(0)
    params = [(n, torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(device=device, dtype=dtype)))
              for n, s in SHAPES.items()]
    opt = Gefen(params, lr=1e-2, weight_decay=0.1, **kwargs)
    for _ in range(steps):
        for _, p in params:
            rows = torch.rand(p.shape[0], *[1] * (p.dim() - 1), generator=gen) + 0.1
            p.grad = (torch.randn(p.shape, generator=gen) * rows).to(device=device, dtype=dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("factored", [True, False])
def test_cuda_step_tracks_the_cpu_reference(factored):
    (cpu_params, cpu_opt), (gpu_params, gpu_opt) = (_run(d, factored_v_2d=factored, moments="m8")
                                                    for d in ("cpu", "cuda"))
    for (name, a), (_, b) in zip(cpu_params, gpu_params):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-4, atol=1e-5, msg=name)
        sa, sb = cpu_opt.state[a], gpu_opt.state[b]
        assert sb["m_code"].dtype == torch.uint8 and int(sb["period"]) == int(sa["period"])
        agree = (sa["m_code"] == sb["m_code"].cpu()).float().mean().item()
        assert agree > 0.99, f"{name}: only {agree:.1%} of the codes agree"


def test_cuda_bf16_parameters_keep_fp32_state():
    params, opt = _run("cuda", dtype=torch.bfloat16, moments="m8")
    for _, p in params:
        assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all()
        assert opt.state[p]["m_scale"].dtype == torch.float32
    params, opt = _run("cuda", dtype=torch.bfloat16)  # the default layout: bf16 row scale, fp32 statistics
    for _, p in params:
        assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all()
        st = opt.state[p]
        assert st["m_row_scale"].dtype == torch.bfloat16 if p.dim() >= 2 else st["exp_avg"].dtype == torch.float32


def test_muon_steps_on_cuda():
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(128, 64, generator=gen).cuda())
    opt = GefenMuon([("w", w)], lr=1e-2)
    before = w.detach().clone()
    w.grad = torch.randn(128, 64, generator=gen).cuda()
    opt.step()
    assert not torch.equal(w.detach(), before) and torch.isfinite(w).all()


def test_checkpoint_from_cuda_loads_on_cpu(tmp_path):
    gpu_params, gpu_opt = _run("cuda")
    gefen_ckpt.save(gpu_opt, str(tmp_path / "ck"))
    cpu_params = [(n, torch.nn.Parameter(p.detach().cpu())) for n, p in gpu_params]
    cpu_opt = Gefen(cpu_params, lr=1e-2, weight_decay=0.1)
    gefen_ckpt.load(cpu_opt, str(tmp_path / "ck"))
    for (_, g), (_, c) in zip(gpu_params, cpu_params):
        for key, value in gpu_opt.state[g].items():
            assert torch.equal(cpu_opt.state[c][key], value.cpu()), key
