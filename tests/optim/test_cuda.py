"""Gefen and gefen_ckpt on a CUDA device (skipped without one; `benchmarks/gpu.sh` runs them).

On CUDA both layouts' steps (m4v4, the default, and m8 with either second-moment form) run the
Triton kernels (gefen/triton; tests/optim/test_triton.py compares them with the eager reference on the
same device): they keep the state compressed, track the CPU step to fp32 rounding, and checkpoint
to CPU.
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


LAYOUTS = {"m4v4": {}, "m8 factored": {"moments": "m8"}, "m8 block": {"moments": "m8", "factored_v_2d": False}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_step_tracks_the_cpu_reference(layout):
    (cpu_params, cpu_opt), (gpu_params, gpu_opt) = (_run(d, **LAYOUTS[layout]) for d in ("cpu", "cuda"))
    for (name, a), (_, b) in zip(cpu_params, gpu_params):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-4, atol=1e-5, msg=name)
        sa, sb = cpu_opt.state[a], gpu_opt.state[b]
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            if value.dtype == torch.uint8:  # codes: equal but where a value sits on a boundary
                agree = (value == sb[key].cpu()).float().mean().item()
                assert agree > 0.99, f"{name}.{key}: only {agree:.1%} of the codes agree"
            else:
                torch.testing.assert_close(sb[key].cpu(), value, rtol=1e-4, atol=1e-6, msg=f"{name}.{key}")


@pytest.mark.parametrize("layout,launcher,batches", [("m4v4", "m4v4_update_", [3, 1]), ("m8 factored", "m8_update_", [4]),
                                                     ("m8 block", "m8_update_", [4])])
def test_cuda_step_runs_the_triton_kernels(layout, launcher, batches, monkeypatch):
    from gefen.triton import dispatch, launch

    assert dispatch.available(), dispatch._import_error
    monkeypatch.setattr(dispatch, "_logged", set())
    calls = []
    real = getattr(launch, launcher)
    monkeypatch.setattr(launch, launcher, lambda items, *a, **k: (calls.append(len(items)), real(items, *a, **k)))
    _run("cuda", steps=2, **LAYOUTS[layout])
    # m4v4: the three matrices in one batch, the 1-D norm in another; m8: every tensor in one
    assert calls == batches * 2
    assert not dispatch._logged, dispatch._logged  # no CUDA step fell back to the eager path


def test_cuda_bf16_parameters_keep_fp32_state():
    params, opt = _run("cuda", dtype=torch.bfloat16, moments="m8")
    for _, p in params:
        assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all()
        assert opt.state[p]["m_scale"].dtype == torch.float32
    params, opt = _run("cuda", dtype=torch.bfloat16)  # the default layout: bf16 row scale, fp32 statistics
    for _, p in params:
        assert p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all()
        st = opt.state[p]
        assert st["m_row_scale"].dtype == torch.bfloat16 if p.dim() >= 2 else st["exp_avg"].dtype == torch.bfloat16


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
