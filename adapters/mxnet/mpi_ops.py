"""Horovod's MXNet collectives on NDArrays, on aiacc's engine.

Each function waits until MXNet has finished writing its input (with the GIL
released), hands the engine numpy views of the NDArray memory (no copy), and
returns when the result is in place. Unlike Horovod's MXNet ops, which are
queued in MXNet's own engine, these calls return finished results; the
overlap of gradients with backpropagation comes from
:class:`aiacc.mxnet.DistributedTrainer`, which submits every gradient bucket as
soon as MXNet has computed its gradients.

Results whose size is known in advance (allreduce, broadcast) are written
straight into a new NDArray (or, for the ``*_`` variants, into the input);
allgather / alltoall / reducescatter results are allocated by the engine and
lent to MXNet through DLPack.

Results are of the input's kind: ``mx.np.ndarray`` for one (numpy semantics,
``npx.set_np()``), else legacy NDArrays (Horovod's are always legacy).

Every collective takes ``process_set`` (default: every rank of the job), as in
Horovod; the engine of that set runs it. Argument checks, result shapes and
scaling are the core's (:mod:`aiacc.api`): this module only converts NDArrays.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

import mxnet as mx

import aiacc
# Horovod's mpi_ops holds the basics too (scripts do ``from horovod.mxnet.mpi_ops import Sum, rank``): the core's
from aiacc import (Adasum, Max, Min, Product, Sum, cross_rank, cross_size, init, is_homogeneous,  # noqa: F401
                   is_initialized, local_rank, local_size, mpi_threads_supported, rank, shutdown, size,
                   start_timeline, stop_timeline)
from aiacc import Average, Collective, global_process_set
from aiacc.api import as_group
from aiacc.ops import average_or_op
from aiacc.process_sets import HorovodBasics

from .tensors import empty_like, like, numpy_view, to_ndarray, writable_view

__all__ = [
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather",
    "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter",
]

# what Horovod's own tests read from its core (``hvd.mpi_ops._basics``): the registered process sets
_basics = HorovodBasics()


def _label(name: Optional[str], default: str) -> str:
    return name if name is not None else default


def _views(tensors: Sequence, label: str) -> List[np.ndarray]:
    """Read-only numpy views of a group's NDArrays, each named in errors by its place in the group."""
    return [numpy_view(t, f"{label}[{i}]") for i, t in enumerate(tensors)]


# ---- allreduce ----------------------------------------------------------------------------------
def allreduce(tensor, average=None, name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set=global_process_set, op=None, compression=None):
    """``tensor`` reduced across the ranks of ``process_set`` (Average unless ``op``/``average`` say
    otherwise); a new NDArray. The input is not modified.

    ``compression`` (``Compression.fp16`` / ``.bf16``) casts on the wire only.
    """
    label = _label(name, "allreduce input")
    src = numpy_view(tensor, label)
    out = empty_like(tensor)
    dst = writable_view(out, label, "output of", exclusive=False)
    aiacc.submit(Collective.ALLREDUCE, src, name=name, op=average_or_op(average, op, "allreduce"),
                 prescale=prescale_factor, postscale=postscale_factor, compression=compression, priority=priority,
                 outputs=[dst], process_set=process_set).wait()
    return like(out, tensor)


def allreduce_(tensor, average=None, name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=global_process_set, op=None, compression=None):
    """In-place :func:`allreduce`: ``tensor`` holds the result afterwards; returns ``tensor``."""
    view = writable_view(tensor, _label(name, "allreduce_ input"))
    aiacc.submit(Collective.ALLREDUCE, view, name=name, op=average_or_op(average, op, "allreduce_"),
                 prescale=prescale_factor, postscale=postscale_factor, compression=compression, priority=priority,
                 outputs=[view], process_set=process_set).wait()
    return tensor


def grouped_allreduce(tensors: Sequence, average=None, name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=global_process_set,
                      op=None, compression=None):
    """Reduce a list of NDArrays as one unit (agreed and completed together); new NDArrays."""
    tensors = as_group(tensors, "grouped_allreduce", name)
    if not tensors:
        return []
    label = _label(name, "grouped_allreduce input")
    srcs = _views(tensors, label)
    outs = [empty_like(t) for t in tensors]
    dsts = [writable_view(o, f"{label}[{i}]", "output of", exclusive=False) for i, o in enumerate(outs)]
    aiacc.submit(Collective.ALLREDUCE, srcs, name=name, op=average_or_op(average, op, "grouped_allreduce"),
                 prescale=prescale_factor, postscale=postscale_factor, compression=compression, priority=priority,
                 outputs=dsts, process_set=process_set).wait()
    return [like(o, t) for o, t in zip(outs, tensors)]


def grouped_allreduce_(tensors: Sequence, average=None, name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=global_process_set,
                       op=None, compression=None):
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    tensors = as_group(tensors, "grouped_allreduce_", name)
    if not tensors:
        return tensors
    label = _label(name, "grouped_allreduce_ input")
    views = [writable_view(t, f"{label}[{i}]") for i, t in enumerate(tensors)]
    aiacc.submit(Collective.ALLREDUCE, views, name=name, op=average_or_op(average, op, "grouped_allreduce_"),
                 prescale=prescale_factor, postscale=postscale_factor, compression=compression, priority=priority,
                 outputs=views, process_set=process_set).wait()
    return tensors


# ---- allgather ----------------------------------------------------------------------------------
def allgather(tensor, name: Optional[str] = None, priority: int = 0, process_set=global_process_set):
    """Every rank's ``tensor`` (of ``process_set``, in the order of its ranks) concatenated along the
    first dimension, which may differ per rank."""
    src = numpy_view(tensor, _label(name, "allgather input"))
    result = aiacc.submit(Collective.ALLGATHER, src, name=name, priority=priority, process_set=process_set).wait()
    return like(to_ndarray(result, tensor.context), tensor)


def grouped_allgather(tensors: Sequence, name: Optional[str] = None, priority: int = 0,
                      process_set=global_process_set):
    """:func:`allgather` of each NDArray of the list, as one unit; a list of new NDArrays."""
    tensors = as_group(tensors, "grouped_allgather", name)
    srcs = _views(tensors, _label(name, "grouped_allgather input"))
    results = aiacc.submit(Collective.ALLGATHER, srcs, name=name, priority=priority, process_set=process_set).wait()
    return [like(to_ndarray(r, t.context), t) for r, t in zip(results, tensors)]


# ---- broadcast ----------------------------------------------------------------------------------
def broadcast(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0, process_set=global_process_set):
    """``root_rank``'s ``tensor`` on every rank, as a new NDArray (the input is not modified).
    ``root_rank`` is a rank of the job, also with a process set (as in Horovod)."""
    label = _label(name, "broadcast input")
    src = numpy_view(tensor, label)
    out = empty_like(tensor)
    dst = writable_view(out, label, "output of", exclusive=False)
    aiacc.submit(Collective.BROADCAST, src, name=name, root=root_rank, priority=priority, outputs=[dst],
                 process_set=process_set).wait()
    return like(out, tensor)


def broadcast_(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set=global_process_set):
    """In-place :func:`broadcast`: ``tensor`` holds ``root_rank``'s value afterwards; returns ``tensor``."""
    view = writable_view(tensor, _label(name, "broadcast_ input"))
    aiacc.submit(Collective.BROADCAST, view, name=name, root=root_rank, priority=priority, outputs=[view],
                 process_set=process_set).wait()
    return tensor


# ---- alltoall -----------------------------------------------------------------------------------
def alltoall(tensor, splits=None, name: Optional[str] = None, priority: int = 0, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to the i-th rank of ``process_set`` (equal parts if None);
    the rows received.

    With ``splits`` given (a list or an integer NDArray), returns ``(rows, received_splits)`` as
    Horovod's MXNet API does (``received_splits`` an int32 NDArray).
    """
    src = numpy_view(tensor, _label(name, "alltoall input"))
    given = splits is not None
    if isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()  # its dtype travels too: the core refuses splits that are not whole numbers
    out, received = aiacc.submit(Collective.ALLTOALL, src, name=name, splits=splits, priority=priority,
                                 process_set=process_set).wait()
    rows = like(to_ndarray(out, tensor.context), tensor)
    if not given:
        return rows
    return rows, like(mx.nd.array(np.asarray(received), ctx=mx.cpu(), dtype="int32"), tensor)


# ---- reducescatter ------------------------------------------------------------------------------
def reducescatter(tensor, op=Average, name: Optional[str] = None, priority: int = 0, process_set=global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, compression=None):
    """Reduce ``tensor`` across the ranks of ``process_set``; its i-th rank keeps the i-th block of
    rows (the first ``n % size`` ranks one more). ``compression`` casts on the wire only."""
    src = numpy_view(tensor, _label(name, "reducescatter input"))
    result = aiacc.submit(Collective.REDUCESCATTER, src, name=name, op=op, prescale=prescale_factor,
                          postscale=postscale_factor, compression=compression, priority=priority,
                          process_set=process_set).wait()
    return like(to_ndarray(result, tensor.context), tensor)


def grouped_reducescatter(tensors: Sequence, op=Average, name: Optional[str] = None, priority: int = 0,
                          process_set=global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, compression=None):
    """:func:`reducescatter` of each NDArray of the list, as one unit; a list of new NDArrays."""
    tensors = as_group(tensors, "grouped_reducescatter", name)
    srcs = _views(tensors, _label(name, "grouped_reducescatter input"))
    results = aiacc.submit(Collective.REDUCESCATTER, srcs, name=name, op=op, prescale=prescale_factor,
                           postscale=postscale_factor, compression=compression, priority=priority,
                           process_set=process_set).wait()
    return [like(to_ndarray(r, t.context), t) for r, t in zip(results, tensors)]
