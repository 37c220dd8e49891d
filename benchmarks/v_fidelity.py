"""How faithful is Gefen's decoded second moment? An exact EMA of g^2 trained beside it.

Trains ``bench_quality``'s character LM with ``gefen.Gefen`` while an exact fp32 EMA of g^2
(AdamW's ``exp_avg_sq``, on the very gradients the optimizer sees, after clipping) runs beside
it, then compares, over every coded matrix's elements, the second moment the last step's
denominator used (``gefen.codecs.M4V4Codec.decode``) with the exact one:

* ``mean_log_ratio``: mean of ``log(v_decoded / v_exact)`` (0 = unbiased in log v);
* ``step_factor``: mean of ``(sqrt(v_exact / bc2) + eps) / (sqrt(v_decoded / bc2) + eps)``, how
  much larger the step is than the exact second moment gives (1 = unbiased where the step uses it);
* ``step_factor_p999``: its 99.9th percentile (a rare code making a rare large step shows here).

    python -m benchmarks.v_fidelity            # prints JSON for the short task, seeds 0 and 1
"""

from __future__ import annotations

import json

import torch

from benchmarks.bench_quality import CharLM, Task, corpus, fit
from gefen.codecs import M4V4Codec
from gefen.stochastic import ratio_table

#: the short task of tests/optim/test_quality_lm.py
SHORT = Task(d=64, layers=2, heads=4, context=64, batch=16, steps=150, warmup=20, eval_batches=8)


def probe(text: str = "stdlib", seed: int = 0, task: Task = SHORT, data=None, **gefen_kw) -> dict:
    """Train ``task`` with Gefen (``gefen_kw`` passed on) and an exact EMA of g^2 beside it."""
    from gefen import Gefen

    train_data, _, vocab = corpus(text) if data is None else data
    torch.manual_seed(seed)
    model = CharLM(vocab, task)
    opt = Gefen(model.named_parameters(), lr=task.lr, weight_decay=task.weight_decay, seed=seed, **gefen_kw)
    b2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    coded = [p for p in model.parameters() if p.dim() >= 2]
    exact = {p: torch.zeros(p.shape[0], p[0].numel()) for p in coded}

    def track_g2():
        for p in coded:
            g = p.grad.reshape(exact[p].shape).float()
            exact[p].mul_(b2).add_(g * g, alpha=1 - b2)

    fit(model, opt, train_data, task, seed, after_step=track_g2)
    codec = M4V4Codec(opt.codebook, ratio_table(opt.v_codebook))
    bc2 = 1 - b2**task.steps
    logs, factors, spread, per_matrix = [], [], [], []
    for name, p in model.named_parameters():
        if p not in exact:
            continue
        v_dec, v_ex = codec.decode(opt.state[p])[1].reshape(exact[p].shape), exact[p]
        live = v_ex > 0  # elements that never had a gradient (unused embedding rows) have no ratio
        lr_ = torch.log(v_dec.clamp_min(1e-38) / v_ex.clamp_min(1e-38))[live].double()
        f = ((v_ex / bc2).sqrt() + eps) / ((v_dec / bc2).sqrt() + eps)
        f = f[live].double()
        vhat = codec.vhat(opt.state[p]["v_row"], opt.state[p]["v_col"])
        spread.append(torch.log(v_ex.clamp_min(1e-38) / vhat.clamp_min(1e-38))[live].double())
        logs.append(lr_)
        factors.append(f)
        per_matrix.append({"name": name, "mean_log_ratio": lr_.mean().item(), "step_factor": f.mean().item()})
    logs, factors, spread = torch.cat(logs), torch.cat(factors), torch.cat(spread).float()
    q = torch.tensor([0.001, 0.01, 0.5, 0.99, 0.999])
    return {"text": text, "seed": seed, "steps": task.steps, "mean_log_ratio": logs.mean().item(),
            "log_ratio_std": logs.std().item(), "step_factor": factors.mean().item(),
            "step_factor_p999": torch.quantile(factors.float(), 0.999).item(),
            "step_factor_max": factors.max().item(), "per_matrix": per_matrix,
            "exact_vs_factored_log_quantiles": [round(x, 3) for x in torch.quantile(spread, q).tolist()],
            "v_codebook": [round(x, 4) for x in (opt.v_codebook * 8).tolist()]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    data = corpus("stdlib")
    print(json.dumps([{k: v for k, v in probe("stdlib", s, data=data).items() if k != "per_matrix"}
                      for s in (0, 1)], indent=1))
