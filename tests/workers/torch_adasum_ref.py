"""The one-process reference of ``DistributedOptimizer(op=Adasum)`` for the torch workers that replay every rank
(``torch_odds.py``, ``torch_adasum_zero.py``): aiacc/adasum.py's formula for two ranks, in float64, and one step()
of each replayed rank's optimizer combined with it."""

import numpy as np
import torch


def adasum_np(a, b):  # aiacc/adasum.py's formula, float64
    tiny = float(np.sqrt(np.finfo(np.float64).tiny))
    ab, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    return (1.0 - ab / aa * 0.5 if aa >= tiny else 1.0) * a + (1.0 - ab / bb * 0.5 if bb >= tiny else 1.0) * b


def adasum_steps(opts):
    """One step() of each replayed rank's optimizer in ``opts`` (rank order, two ranks): every rank's optimizer
    steps on its own gradients from the synchronized parameters, and each parameter moves to its start + the Adasum
    of the ranks' changes."""
    params = [[p for group in o.param_groups for p in group["params"]] for o in opts]
    starts = [[p.detach().clone() for p in ps] for ps in params]
    for o in opts:
        o.step()
    with torch.no_grad():
        for i, ps in enumerate(zip(*params)):
            deltas = [(ps[k] - starts[k][i]).numpy().ravel() for k in range(len(opts))]
            combined = torch.from_numpy(adasum_np(*deltas)).reshape(ps[0].shape)
            for k in range(len(opts)):
                ps[k].copy_(starts[k][i] + combined)
