"""The torch optimizer wrappers' check that every rank starts from the same parameters (see ``aiacc.same_start``).

``step()`` of ``DistributedOptimizer`` (and of its Adasum form) calls :func:`count_step` first: the second call
compares the values of the optimizer's parameters across the ranks of its process set, once, before that
step's update (Horovod's torch recipe broadcasts before the first step; a script that broadcasts after it is
covered too). Every later call costs one lookup and one comparison of an int.
"""

from __future__ import annotations

import torch

import aiacc
from aiacc.api import has_joined
from aiacc.same_start import check_same_start

__all__ = ["count_step"]

FIX = ("Broadcast rank 0's parameters and optimizer state before training: "
       "hvd.broadcast_parameters(model.state_dict(), root_rank=0) and "
       "hvd.broadcast_optimizer_state(optimizer, root_rank=0).")


def count_step(opt) -> None:
    """One more ``step()`` of the wrapper ``opt``; at the second, the check (on every rank of its set)."""
    d = opt.__dict__
    steps = d.get("_aiacc_steps_seen", 0)
    if steps >= 2:
        return
    d["_aiacc_steps_seen"] = steps + 1
    if steps == 1 and not has_joined():  # (after a join, the others' second step came in another epoch)
        process_set = d.get("_aiacc_process_set")
        engine = aiacc.engine_for(process_set)
        if engine is not None and engine.config.check_same_start:
            _compare(opt, process_set)


def _values(p: torch.Tensor):
    t = p.detach()
    if t.is_sparse:
        t = t.to_dense()
    return t.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8).cpu().numpy()


def _compare(opt, process_set) -> None:
    sched = opt.__dict__.get("_aiacc_sched")
    if sched is not None and sched.pending:  # (overlap_forward) the first step's updates, applied as step() would
        sched.flush()
    names = getattr(opt, "_parameter_names", {})
    # the optimizer's own parameters (its raw groups: the param_groups property would wait for the gradients)
    seen, named = set(), []
    for gi, group in enumerate(opt.__dict__["param_groups"]):
        for pi, p in enumerate(group["params"]):
            if id(p) not in seen:
                seen.add(id(p))
                named.append((names.get(p, f"param_groups.{gi}.{pi}"), p))
    check_same_start(((name, _values(p)) for name, p in named), "DistributedOptimizer", FIX, process_set,
                     stacklevel=5)
