"""``DistributedOptimizer``'s parameters with sparse gradients (an ``nn.Embedding(sparse=True)``): in no bucket,
each reduced on its own request, as Horovod reduces them. A sparse gradient that no rank had in a step (the
embedding unused in every rank's forward) is None after the wait, so the optimizer skips its parameter as torch
does in one process: an empty gradient would be stepped (SGD's momentum, Adagrad's and SparseAdam's step counts
move). Each rank tells whether it had one in a tiny allreduce (Max) of its own."""

from __future__ import annotations

import torch

from aiacc.names import gradient_name

from .mpi_ops import Max, allreduce_async_, sparse_allreduce_async

__all__ = ["finish_sparse", "submit_sparse"]


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
