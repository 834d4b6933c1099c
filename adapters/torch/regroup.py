"""``DistributedOptimizer``: the parameters it averages change between steps (frozen, unfrozen, groups added or
replaced), and it follows, as if it had been wrapped anew.

DDP averages the parameters of its module that required gradients when it was built, whatever happens later, so a
DDP user who unfreezes a backbone builds DDP again; Horovod leaves the new gradients unaveraged (the ranks drift apart
without a word) and steps a parameter frozen since on zeros; aiacc refused them at ``step()``. Now the wrapper lays
its buckets out again over the parameters of its groups that require gradients when it sees them change:

- ``add_param_group`` and ``param_groups = [...]`` (when the set of parameters changes): at once, between steps;
- a parameter of its groups unfrozen (``requires_grad=True``), or one put in a group with torch's own
  ``add_param_group`` / list methods: at the step that follows (``synchronize()``), by a look at the parameters out
  of the buckets that the step already made (O(frozen) a step; nothing for those in buckets);
- a parameter of the buckets frozen (``requires_grad=False``): at the step that follows, seen as its gradient is not
  handed over (the loop over the gradients missing at ``step()``: nothing more in the steady state). Its gradient
  is None on every rank in that step, so the optimizer skips it as in one process.

Each change is a first step again for the buckets: the gradients of that step are averaged with the buckets as they
were (those of parameters unfrozen or added in that step, each on its own: once), and the next step learns the order
the gradients come in, checks in one collective that every rank has the same parameters, and settles the buckets.
A script that goes back and forth between a few trainable sets (a GAN's two sub-networks under one optimizer, a
fine-tuning schedule) goes back to the buckets it had for a set: the last ``LAYOUTS_KEPT`` settled layouts are kept,
keyed by the trainable parameters (name, shape, dtype, device, memory order), and one is taken up again instead of
laying the buckets out anew (no new buffers, no first step: the next backward copies each gradient into its bucket
once, as after ``model.zero_grad()``). Only after a change every rank confirmed (``retire``: the ranks agree on the
new list, so each takes the same layout up); ``opt._aiacc_rebuilds`` counts the layouts made anew. What the change's
own step costs stays: its gradients new to the buckets are averaged one by one, and the old buckets are sent once more
to tell the ranks of the change.
Every rank must make the change at the same point between steps: the rank that changes sends its old buckets once
more, marked (``GradientBuckets.retire``), which the next buckets of a rank that did not change meet, so that every
rank raises an error naming the ranks and the parameters at once instead of waiting for the stall inspector.
The gradients kept so far stay what they are; the optimizer's state is untouched.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

import aiacc
from aiacc.names import describe, gradient_name

from .mpi_ops import allreduce_async_, synchronize
from .same_start import count_step
from .arrays import memory_order
from .slots import taken_error, view_as

__all__ = ["apply_change", "check_between_steps", "detect_change", "regroup", "set_groups", "HINT", "LAYOUTS_KEPT"]

LAYOUTS_KEPT = 2  # settled bucket layouts an optimizer keeps to go back to (each holds its buffers)

_added = itertools.count()  # groups added without names (the same sequence on every rank): names of their own

HINT = (" (DistributedOptimizer: freeze or unfreeze parameters with requires_grad, add_param_group() or assign "
        "param_groups on every rank, after the same step)")


def check_between_steps(opt, what: str = "add_param_group() was called") -> bool:
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
            f"DistributedOptimizer.{what} after backward() and before step(): the gradients "
            f"of {describe(busy)} are being averaged. Change the parameters between steps (after step(), before the "
            "next backward)")
    if opt.__dict__.get("_aiacc_steps_seen", 0) == 1:
        # between the first and second step: the second step's same-start check (a collective) made now, before the
        # regroup's, on every rank that changes (a rank changing alone waited in the regroup while the others waited
        # in the check, until the stall shutdown; now the regroup meets their step: a mismatch naming it)
        count_step(opt)
    return True


def set_groups(opt, groups) -> None:
    """``opt.param_groups = groups``: between steps, as ``add_param_group`` when the parameters change (a list of
    the same parameters, as ``load_state_dict`` assigns, changes nothing)."""
    d = opt.__dict__
    old = d.get("param_groups")
    same = old is not None and {id(p) for g in old for p in g["params"]} == {id(p) for g in groups for p in g["params"]}
    if same or "_aiacc_slots" not in d or not check_between_steps(opt, "param_groups was assigned"):
        d["param_groups"] = groups
        return
    d["param_groups"] = groups
    regroup(opt)


def detect_change(opt) -> None:
    """At ``step()`` (before the missing gradients go): ``opt._aiacc_change`` is set when a parameter of its groups
    requires gradients and is in no bucket (unfrozen, or put in a group since), or one in a bucket left the groups
    (frozen ones are seen by the caller's loop). The groups' lists are compared by id (one tuple per group)."""
    if opt._aiacc_taken:
        raise taken_error(opt._aiacc_taken)
    groups = opt.__dict__["param_groups"]
    ids = [tuple(map(id, group["params"])) for group in groups]
    if ids != opt._aiacc_param_ids:  # (a group added, or a parameter put in place of another)
        opt._aiacc_param_ids = ids
        held = {i for t in ids for i in t}
        known = set(map(id, opt._aiacc_untracked)) | set(opt._aiacc_slots)
        new = {id(p): p for group in groups for p in group["params"] if id(p) not in known}
        opt._aiacc_untracked = [p for p in opt._aiacc_untracked if id(p) in held] + list(new.values())
        if any(id(slot.param) not in held for slot in opt._aiacc_slot_list):
            opt._aiacc_change = True
    if opt._aiacc_untracked and any(p.requires_grad for p in opt._aiacc_untracked):
        opt._aiacc_change = True


def apply_change(opt) -> None:
    """At the end of ``synchronize()`` once ``detect_change`` (or a frozen gradient) saw a change: regroup, keeping
    this step's averaged gradients, and average those of the parameters new to the buckets."""
    opt._aiacc_change = None
    regroup(opt, mid_step=True)


def _names(opt):
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
    return names, order


def regroup(opt, mid_step: bool = False) -> None:
    """``opt`` averages the parameters of all its groups that require gradients (see the module's doc). ``mid_step``:
    at the end of ``synchronize()``, the step's gradients averaged and kept for the update."""
    names, order = _names(opt)
    trainable = [p for p in order if p.requires_grad]
    labels = [gradient_name(names[p]) for p in trainable]
    old = opt._aiacc_buckets
    before = [spec.label for spec in old.params]
    if labels == before:  # the same gradients: nothing to lay out again (a frozen parameter put in a group)
        opt._parameter_names = names
        opt._aiacc_param_ids = [tuple(map(id, group["params"])) for group in opt.param_groups]
        opt._aiacc_untracked = [p for p in order if not p.requires_grad]
        return
    pending, setup_name = [], old.setup_name  # (never settled: the new set meets the other ranks' first step)
    kept = None
    if old.established:
        known = set(before)
        mine = [x for p, x in zip(trainable, labels) if x not in known and p.grad is not None] if mid_step else []
        pending, setup_name = set().union(*old.retire(labels, mine)), None
        # every rank changed to ``labels`` (retire checked): each keeps the same old layout and takes the same up
        layouts = opt.__dict__.setdefault("_aiacc_layouts", {})
        layouts[_key([(s.param, s.name, s.dtype, s.device, s.order) for s in opt._aiacc_slot_list])] = \
            (old, set(opt._aiacc_fresh))
        kept = layouts.pop(_key([(p, names[p], p.dtype, p.device, memory_order(p)) for p in trainable]), None)
        while len(layouts) > LAYOUTS_KEPT:
            del layouts[next(iter(layouts))]
    for slot in opt._aiacc_slot_list:  # gradients out of the old buckets, as torch sees them (None after zero_grad)
        grad = slot.param.grad
        if grad is not None and grad is slot.view:
            slot.param.grad = grad.clone() if mid_step or not slot.none else None
    opt.remove_hooks()
    compression, factors, sparse_as_dense, overlap_forward, cap = opt._aiacc_args
    opt._aiacc_setup(aiacc.engine_for(opt._aiacc_process_set), opt._aiacc_process_set, names, order, compression,
                     opt.backward_passes_per_step, factors, sparse_as_dense, overlap_forward, cap,
                     setup_name if kept is None else kept[0].setup_name)
    if kept is None:
        opt._aiacc_rebuilds = getattr(opt, "_aiacc_rebuilds", 0) + 1
    else:
        _take_up(opt, *kept)
    if pending:
        _average_new(opt, [(p, x) for p, x in zip(trainable, labels) if x in pending])


def _key(params) -> tuple:
    """What a bucket layout was made for: each trainable parameter's (name, shape, dtype, device, memory order)."""
    return tuple((name, tuple(p.shape), dtype, device, order) for p, name, dtype, device, order in params)


def _take_up(opt, buckets, fresh) -> None:
    """The optimizer, just set up anew over the same trainable parameters as ``buckets`` (settled, kept since it
    was left), uses them: its slots get their views, and ``p.grad`` stays as it is until the next backward or
    ``zero_grad()`` puts it in (``fresh``: the gradients no rank had had when it was left; see sparse_grads)."""
    opt._aiacc_buckets = buckets
    opt._aiacc_fresh = fresh
    opt._aiacc_settled = True
    for slot in opt._aiacc_slot_list:
        if buckets.excluded(slot.index):
            slot.sparse = True
            continue
        slot.view = view_as(slot, buckets, slot.order)
        slot.ptr = slot.view.data_ptr() if memory_order(slot.param) == slot.order else 0


def _average_new(opt, new) -> None:
    """The gradients of this step of the parameters new to the buckets (some rank has one: None elsewhere counts as
    zeros, as in a bucket), averaged one by one as the buckets would have (op, factors, compression)."""
    waits = []
    for p, label in new:
        grad = p.grad
        sparse = grad is not None and grad.is_sparse
        dense = torch.zeros(p.shape, dtype=p.dtype, device=p.device) if grad is None else \
            (grad.to_dense() if sparse else grad).contiguous()
        handle = allreduce_async_(dense, name=f"{label}.regroup", op=opt._aiacc_op, prescale_factor=opt._aiacc_prescale,
                                  postscale_factor=opt._aiacc_postscale, process_set=opt._aiacc_process_set,
                                  compression=opt._aiacc_compression)
        waits.append((p, sparse, dense, handle))
    for p, sparse, dense, handle in waits:
        synchronize(handle)
        p.grad = dense.to_sparse(p.grad.sparse_dim()) if sparse else dense
