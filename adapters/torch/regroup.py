"""``DistributedOptimizer.add_param_group``: a parameter group added after wrapping is averaged from the next step on.

DDP averages every trainable parameter of its module whatever the optimizer holds, so a DDP user adds a group
(fine-tuning: unfreeze the backbone and give it a learning rate of its own) and trains on. Horovod leaves the new
gradients unaveraged (the ranks drift apart without a word); aiacc refused them at ``step()``. Between steps the
wrapper lays its buckets out again over every parameter it now has, as if it had been wrapped anew: the next step
is a first step again (it learns the order the gradients come in and checks, in one collective, that every rank has
the same parameters; a rank that did not add the group is an error naming the parameters). The gradients kept so
far (``zero_grad()`` not called yet) stay what they are; the optimizer's state is untouched.
"""

from __future__ import annotations

import itertools
from collections import Counter

import aiacc
from aiacc.names import describe

from .slots import taken_error

__all__ = ["check_between_steps", "regroup"]

_added = itertools.count()  # groups added without names (the same sequence on every rank): names of their own


def check_between_steps(opt) -> bool:
    """Whether ``opt`` still averages (False after ``remove_hooks()``: a group added then is torch's alone); an error
    unless it is between steps (no gradient of this step handed over or being averaged)."""
    if opt._aiacc_taken:
        raise taken_error(opt._aiacc_taken)
    if opt._aiacc_slot_list and not opt._aiacc_hooks:
        return False
    sched = opt._aiacc_sched
    if sched is not None and sched.pending:  # (overlap_forward: the last step's updates, applied now)
        sched.flush()
    passes = opt.backward_passes_per_step
    busy = [s.name for s in opt._aiacc_slot_list if s.delay != passes or s.handle is not None]
    if busy:
        raise RuntimeError(
            f"DistributedOptimizer.add_param_group() was called after backward() and before step(): the gradients "
            f"of {describe(busy)} are being averaged. Add the group between steps (after step(), before the next "
            "backward)")
    return True


def regroup(opt) -> None:
    """After ``add_param_group``: ``opt`` averages the parameters of all its groups (see the module's doc)."""
    names = dict(opt._parameter_names)  # (named_parameters may name parameters the optimizer did not hold)
    serial = None
    for gi, group in enumerate(opt.param_groups):
        given = group.get("param_names")  # (torch >= 2.6: the optimizer made from named parameters)
        for pi, p in enumerate(group["params"]):
            if p in names:
                continue
            if given is not None and pi < len(given):
                names[p] = str(given[pi])
            else:
                serial = next(_added) if serial is None else serial
                names[p] = f"added{serial}.param_groups.{gi}.{pi}"
    in_groups = {id(p) for group in opt.param_groups for p in group["params"]}
    order = [p for p in names if id(p) in in_groups]
    taken = [n for n, k in Counter(names[p] for p in order).items() if k > 1]
    if taken:
        raise ValueError(f"DistributedOptimizer.add_param_group(): parameter names {describe(taken)} are given to "
                         "two parameters; names must be unique (they identify gradients across ranks)")
    for slot in opt._aiacc_slot_list:  # gradients out of the old buckets, as torch sees them (None after zero_grad)
        grad = slot.param.grad
        if grad is not None and grad is slot.view:
            slot.param.grad = None if slot.none else grad.clone()
    opt.remove_hooks()
    compression, factors, sparse_as_dense, overlap_forward, cap = opt._aiacc_args
    opt._aiacc_setup(aiacc.engine_for(opt._aiacc_process_set), opt._aiacc_process_set, names, order, compression,
                     opt.backward_passes_per_step, factors, sparse_as_dense, overlap_forward, cap)
