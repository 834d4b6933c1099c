"""``DistributedOptimizer``'s parameters with sparse gradients (an ``nn.Embedding(sparse=True)``): in no bucket,
each reduced on its own request, as Horovod reduces them. A sparse gradient that no rank had in a step (the
embedding unused in every rank's forward) is None after the wait, so the optimizer skips its parameter as torch
does in one process: an empty gradient would be stepped (SGD's momentum, Adagrad's and SparseAdam's step counts
move). Each rank tells whether it had one in a tiny allreduce (Max) of its own.

Before the first step nothing tells such a parameter from a dense one, so one that no rank used in the first step
(an embedding unused by the first batch, or frozen then) went in a dense bucket. Until some rank has had a gradient
for it, its ``.grad`` stays None between steps (``zero_grad`` does not point it at its bucket), so autograd hands
its gradient over as it comes. A sparse one is not copied into the bucket: the rank marks it (``GradientBuckets.
sparse``, a bit beside the bucket's presence elements), and after the wait every rank reads the same marks, takes
the parameter out of its bucket for good (``leave_sparse``) and reduces each rank's own gradient on its own as above,
in the same step: the optimizer gets a sparse gradient equal to one process's, with the rows each rank looked up,
zero ones too (a densified sum turned sparse drops rows that sum to zero, whose moments ``SparseAdam`` steps from
its second step on). Cost: that step waits for this one reduction after the buckets. Not handled: a parameter
that had dense gradients, then sparse ones with its ``.grad`` kept in the bucket (``optimizer.zero_grad()``): they
are added to the bucket densely."""

from __future__ import annotations

import torch

from aiacc.names import gradient_name

from .arrays import memory_order
from .mpi_ops import Max, allreduce_async_, sparse_allreduce_async
from .slots import view_as

__all__ = ["finish_sparse", "hand_over", "submit_sparse", "turn_sparse"]


def submit_sparse(opt, slot) -> None:
    """A parameter with sparse gradients (an ``nn.Embedding(sparse=True)``): in no bucket, reduced on
    its own as Horovod does it: allgathered indices and values, or densely with ``sparse_as_dense``
    (turned back into a sparse gradient before the update)."""
    if not slot.sparse:
        slot.sparse = True
        opt._aiacc_buckets.exclude(slot.index)
    p = slot.param
    grad = p.grad
    # whether any rank has a gradient: None on every rank stays None (see the module's doc)
    had = allreduce_async_(torch.tensor([int(grad is not None)], dtype=torch.int32),
                           name=f"{gradient_name(slot.name)}.present", op=Max,
                           process_set=opt._aiacc_process_set).wait
    if grad is None:  # unused on this rank: contributes nothing
        grad = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64),
                                       torch.empty((0,) + tuple(p.shape[1:]), dtype=p.dtype), p.shape,
                                       check_invariants=False)
    if opt._aiacc_sparse_as_dense:
        dense = (grad.to_dense() if grad.is_sparse else grad).contiguous()
        reduced = allreduce_async_(dense, name=gradient_name(slot.name), op=opt._aiacc_op,
                                   prescale_factor=opt._aiacc_prescale,
                                   postscale_factor=opt._aiacc_postscale,
                                   compression=opt._aiacc_compression,
                                   process_set=opt._aiacc_process_set).wait
    else:
        reduced = sparse_allreduce_async(grad if grad.is_sparse else grad.to_sparse(),
                                         name=gradient_name(slot.name), op=opt._aiacc_op,
                                         process_set=opt._aiacc_process_set)

    def result():
        out = reduced()
        return out if int(had()[0]) else None

    slot.handle = result


def finish_sparse(opt, slot) -> None:
    """Wait for the sparse gradient of ``slot`` (submitting it first if it was not) and put it in ``.grad``
    (None if no rank had one)."""
    if slot.handle is None:
        submit_sparse(opt, slot)
    result = slot.handle()
    slot.param.grad = result if result is None or result.is_sparse else result.to_sparse()
    slot.handle = None


def hand_over(opt, slot) -> None:
    """A bucketed gradient handed over in a tensor other than its bucket view: a sparse one stays ``p.grad`` and is
    marked (see the module's doc); a dense one is copied in (this rank's own kept while no rank has had one)."""
    grad = slot.param.grad
    if grad is not None and grad.is_sparse:
        slot.given = grad
        opt._aiacc_buckets.sparse(slot.index)
        return
    if slot.index in opt._aiacc_fresh:
        slot.held = grad
    opt._aiacc_adopt(slot)


def turn_sparse(opt, index=None) -> None:
    """After the wait of every bucket (or of ``index``'s): the parameters some rank had a sparse gradient for leave
    their buckets (the same on every rank) and their gradients, each rank's own, are reduced as sparse ones now; the
    views of the others in those buckets move to their new memory."""
    left, moved = opt._aiacc_buckets.leave_sparse(index)
    slots, sched = opt._aiacc_slot_list, opt._aiacc_sched
    for i in moved:
        slot = slots[i]
        old, slot.view = slot.view, view_as(slot, opt._aiacc_buckets, slot.order)
        slot.ptr = slot.view.data_ptr() if memory_order(slot.param) == slot.order else 0
        if slot.param.grad is old:
            slot.param.grad = slot.view
        if sched is not None and id(slot.param) in sched.versions:
            sched.versions[id(slot.param)] = slot.view._version
    for i in left:
        slot = slots[i]
        own = slot.given if slot.given is not None else slot.held  # (None: this rank had none)
        slot.sparse, slot.view, slot.ptr, slot.given, slot.held = True, None, 0, None, None
        opt._aiacc_fresh.discard(i)
        slot.param.grad = own
        submit_sparse(opt, slot)
