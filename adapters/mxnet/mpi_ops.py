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
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

import mxnet as mx

import aiacc
from aiacc import Average, Collective
from aiacc.ops import average_or_op

from .tensors import empty_like, numpy_view, to_ndarray, writable_view

__all__ = [
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter",
]


def _label(name: Optional[str], default: str) -> str:
    return name if name is not None else default


def allreduce(tensor, average=None, name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op=None, compression=None):
    """``tensor`` reduced across ranks (Average unless ``op``/``average`` say otherwise); a new NDArray.

    The input is not modified. ``compression`` (``Compression.fp16`` / ``.bf16``) casts on the wire only.
    """
    label = _label(name, "allreduce input")
    src = numpy_view(tensor, label)
    out = empty_like(tensor)
    dst = writable_view(out, label, "output of", exclusive=False)
    aiacc.submit(Collective.ALLREDUCE, src, name=name, op=average_or_op(average, op, "allreduce"), prescale=prescale_factor,
                 postscale=postscale_factor, compression=compression, priority=priority, outputs=[dst]).wait()
    return out


def allreduce_(tensor, average=None, name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, op=None, compression=None):
    """In-place :func:`allreduce`: ``tensor`` holds the result afterwards; returns ``tensor``."""
    view = writable_view(tensor, _label(name, "allreduce_ input"))
    aiacc.submit(Collective.ALLREDUCE, view, name=name, op=average_or_op(average, op, "allreduce_"), prescale=prescale_factor,
                 postscale=postscale_factor, compression=compression, priority=priority, outputs=[view]).wait()
    return tensor


def grouped_allreduce(tensors: Sequence, average=None, name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, op=None, compression=None):
    """Reduce a list of NDArrays as one unit (agreed and completed together); new NDArrays."""
    tensors = list(tensors)
    if not tensors:
        return []
    label = _label(name, "grouped_allreduce input")
    srcs = [numpy_view(t, f"{label}[{i}]") for i, t in enumerate(tensors)]
    outs = [empty_like(t) for t in tensors]
    dsts = [writable_view(o, f"{label}[{i}]", "output of", exclusive=False) for i, o in enumerate(outs)]
    aiacc.submit(Collective.ALLREDUCE, srcs, name=name, op=average_or_op(average, op, "grouped_allreduce"), prescale=prescale_factor,
                 postscale=postscale_factor, compression=compression, priority=priority, outputs=dsts).wait()
    return outs


def grouped_allreduce_(tensors: Sequence, average=None, name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, op=None, compression=None):
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    label = _label(name, "grouped_allreduce_ input")
    views = [writable_view(t, f"{label}[{i}]") for i, t in enumerate(tensors)]
    aiacc.submit(Collective.ALLREDUCE, views, name=name, op=average_or_op(average, op, "grouped_allreduce_"), prescale=prescale_factor,
                 postscale=postscale_factor, compression=compression, priority=priority, outputs=views).wait()
    return tensors


def allgather(tensor, name: Optional[str] = None, priority: int = 0):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ per rank)."""
    src = numpy_view(tensor, _label(name, "allgather input"))
    result = aiacc.submit(Collective.ALLGATHER, src, name=name, priority=priority).wait()
    return to_ndarray(result, tensor.context)


def broadcast(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0):
    """``root_rank``'s ``tensor`` on every rank, as a new NDArray (the input is not modified)."""
    label = _label(name, "broadcast input")
    src = numpy_view(tensor, label)
    out = empty_like(tensor)
    dst = writable_view(out, label, "output of", exclusive=False)
    aiacc.submit(Collective.BROADCAST, src, name=name, root=root_rank, priority=priority, outputs=[dst]).wait()
    return out


def broadcast_(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0):
    """In-place :func:`broadcast`: ``tensor`` holds ``root_rank``'s value afterwards; returns ``tensor``."""
    view = writable_view(tensor, _label(name, "broadcast_ input"))
    aiacc.submit(Collective.BROADCAST, view, name=name, root=root_rank, priority=priority, outputs=[view]).wait()
    return tensor


def alltoall(tensor, splits=None, name: Optional[str] = None, priority: int = 0):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (equal parts if None); the rows received.

    With ``splits`` given, returns ``(rows, received_splits)`` as Horovod's MXNet API does
    (``received_splits`` an int32 NDArray).
    """
    src = numpy_view(tensor, _label(name, "alltoall input"))
    given = splits is not None
    if isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()
    out, received = aiacc.submit(Collective.ALLTOALL, src, name=name, splits=splits, priority=priority).wait()
    rows = to_ndarray(out, tensor.context)
    if not given:
        return rows
    return rows, mx.nd.array(np.asarray(received), ctx=mx.cpu(), dtype="int32")


def reducescatter(tensor, op=Average, name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
    """Reduce ``tensor`` across ranks; rank i keeps the i-th block of rows (the first ``n % size`` one more)."""
    src = numpy_view(tensor, _label(name, "reducescatter input"))
    result = aiacc.submit(Collective.REDUCESCATTER, src, name=name, op=op, prescale=prescale_factor,
                          postscale=postscale_factor, priority=priority).wait()
    return to_ndarray(result, tensor.context)

