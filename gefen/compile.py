"""How the optimizers meet ``torch.compile``: ``step()`` is a graph break, never traced (README,
"torch.compile"): it calls C through ctypes and picks kernels and reads hyperparameters on the host.
"""

from __future__ import annotations

import torch

REASON = ("Gefen optimizers' step() runs eagerly (a fused C kernel via ctypes on CPU): compile the model "
          "or the training step without fullgraph=True and the step is a graph break")


def eager_step(step):
    """Mark an optimizer's ``step`` as never traced by Dynamo, with the reason when torch has one."""
    try:
        return torch.compiler.disable(step, reason=REASON)
    except TypeError:  # torch < 2.8: no reason argument
        return torch.compiler.disable(step)
