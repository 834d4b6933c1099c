"""Horovod's TensorFlow collectives on aiacc's engine, eager and inside ``tf.function``, differentiable.

Gradients (as Horovod defines them; every rank must run the backward pass):

* ``allreduce`` (Average/Sum): the upstream gradients allreduced with the same op and scale factors.
* ``allgather``: the upstream gradients summed over ranks, this rank's rows kept.
* ``broadcast``: the upstream gradients summed over ranks on the root, zeros elsewhere.
* ``alltoall``: the upstream gradients sent back with an alltoall of the received splits.
* ``reducescatter`` (Average/Sum): the upstream gradients allgathered (and scaled).

Unnamed calls are matched across ranks by call order when eager; inside ``tf.function`` their default
name is unique in the traced graph (``aiacc.allreduce``, ``aiacc.allreduce_1``, ...), the same on every
rank and on every step, so the engine's response cache agrees on it with one bit.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

import aiacc
from aiacc.compression import Compression
from aiacc.ops import Average, Collective, ReduceOp, Sum, as_reduce_op, average_or_op

from ._engine import run_now

__all__ = ["allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]


def _name(kind: str, name: Optional[str]) -> Optional[str]:
    if name is not None:
        return str(name)
    if not tf.executing_eagerly():
        # unique within the traced graph, and the same on every rank and every step: cacheable
        return tf.compat.v1.get_default_graph().unique_name(f"aiacc.{kind}")
    return None


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _differentiable(op: ReduceOp, what: str) -> None:
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"the gradient of {what} with op={op} is not defined; only Average and Sum "
                                  "are differentiable")


def _zeros_for_none(dys, ys):
    return [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]


# ---- allreduce ------------------------------------------------------------------------------
def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, ignore_name_scope=False):
    """``tensor`` reduced across ranks (Average by default), as a new tensor of the same shape.

    A ``tf.IndexedSlices`` is allgathered instead (values and indices, values divided by the number of
    ranks for Average), as Horovod does; densify it first (``tf.convert_to_tensor``) to reduce it densely.
    ``device_dense``/``device_sparse``/``ignore_name_scope`` are accepted for Horovod compatibility.
    """
    op = average_or_op(average, op, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        return sparse_allreduce(tensor, op, prescale_factor, postscale_factor, name)
    tensor = tf.convert_to_tensor(tensor)
    name = _name("allreduce", name)
    kwargs = dict(op=op, prescale=prescale_factor, postscale=postscale_factor, compression=compression)

    @tf.custom_gradient
    def reduce(x):
        y = run_now(Collective.ALLREDUCE, [x], name, [x.shape], **kwargs)[0]

        def grad(dy):
            _differentiable(op, f"allreduce of tensor {name!r}")
            return run_now(Collective.ALLREDUCE, [dy], _grad_name(name), [dy.shape], **kwargs)[0]

        return y, grad

    return reduce(tensor)


def sparse_allreduce(slices: tf.IndexedSlices, op, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Horovod's allreduce of IndexedSlices: every rank's values and indices, gathered."""
    op = as_reduce_op(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"allreduce of IndexedSlices {name!r}: op={op} is not supported; use Average or Sum "
                         "(or sparse_as_dense=True)")
    values = allgather(slices.values, name=None if name is None else f"{name}.values")
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices")
    return tf.IndexedSlices(scale_gathered(values, op, prescale_factor, postscale_factor), indices,
                            dense_shape=slices.dense_shape)


def scale_gathered(values, op, prescale_factor, postscale_factor):
    factor = float(prescale_factor) * float(postscale_factor) / (aiacc.size() if op == ReduceOp.AVERAGE else 1)
    return values if factor == 1.0 else values * tf.cast(factor, values.dtype)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """A list of tensors reduced as one unit (agreed together, fused into as few messages as possible).

    IndexedSlices members are allgathered one by one as in :func:`allreduce`.
    """
    op = average_or_op(average, op, "grouped_allreduce")
    tensors = list(tensors)
    out = [None] * len(tensors)
    dense = []  # indices of the dense members, reduced together below
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = sparse_allreduce(t, op, prescale_factor, postscale_factor,
                                      None if name is None else f"{name}.{i}")
        else:
            dense.append(i)
    if not dense:
        return out
    xs = [tf.convert_to_tensor(tensors[i]) for i in dense]
    name = _name("grouped_allreduce", name)
    kwargs = dict(op=op, prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                  grouped=True)

    @tf.custom_gradient
    def reduce(*xs):
        ys = run_now(Collective.ALLREDUCE, xs, name, [x.shape for x in xs], **kwargs)

        def grad(*dys):
            _differentiable(op, f"grouped_allreduce {name!r}")
            dys = _zeros_for_none(dys, ys)
            return run_now(Collective.ALLREDUCE, dys, _grad_name(name), [d.shape for d in dys], **kwargs)

        return ys, grad

    for i, y in zip(dense, reduce(*xs)):
        out[i] = y
    return out


# ---- allgather, broadcast, alltoall, reducescatter ---------------------------------------
def _rows_of(x, name):
    """Every rank's number of rows of ``x`` (a collective)."""
    return run_now(Collective.ALLGATHER, [tf.shape(x, out_type=tf.int64)[:1]], name, [[aiacc.size()]])[0]


def allgather(tensor, name=None, ignore_name_scope=False):
    """Every rank's ``tensor`` concatenated along the first dimension (first dimensions may differ)."""
    tensor = tf.convert_to_tensor(tensor)
    name = _name("allgather", name)
    if tensor.shape.rank == 0:
        raise ValueError(f"allgather of tensor {name!r} needs at least one dimension (got a scalar)")

    @tf.custom_gradient
    def gather(x):
        y = run_now(Collective.ALLGATHER, [x], name, [[None] + x.shape[1:]])[0]

        def grad(dy):
            total = run_now(Collective.ALLREDUCE, [dy], _grad_name(name), [dy.shape], op=Sum)[0]
            rows = _rows_of(x, None if name is None else f"{name}.grad.rows")
            r = aiacc.rank()
            start = tf.reduce_sum(rows[:r])
            return total[start:start + rows[r]]

        return y, grad

    return gather(tensor)


def _check_root(root_rank, name):
    n = aiacc.size()
    if not 0 <= int(root_rank) < n:
        raise ValueError(f"broadcast of tensor {name!r}: root_rank={root_rank} is out of range for a job of "
                         f"{n} ranks (valid: 0..{n - 1})")


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False):
    """``root_rank``'s ``tensor`` on every rank."""
    tensor = tf.convert_to_tensor(tensor)
    name = _name("broadcast", name)
    _check_root(root_rank, name)
    root_rank = int(root_rank)

    @tf.custom_gradient
    def bcast(x):
        y = run_now(Collective.BROADCAST, [x], name, [x.shape], root=root_rank)[0]

        def grad(dy):
            total = run_now(Collective.ALLREDUCE, [dy], _grad_name(name), [dy.shape], op=Sum)[0]
            return total if aiacc.rank() == root_rank else tf.zeros_like(total)

        return y, grad

    return bcast(tensor)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (equal parts if None); returns the received rows,
    and with ``splits`` given ``(rows, received_splits)`` as Horovod does."""
    tensor = tf.convert_to_tensor(tensor)
    name = _name("alltoall", name)
    if tensor.shape.rank == 0:
        raise ValueError(f"alltoall of tensor {name!r} needs at least one dimension (got a scalar)")
    shapes = [[None] + tensor.shape[1:], [aiacc.size()]]

    @tf.custom_gradient
    def exchange(x):
        rows, received = run_now(Collective.ALLTOALL, [x], name, shapes, splits=splits)

        def grad(d_rows, d_received=None):
            if d_rows is None:
                d_rows = tf.zeros_like(rows)
            back = run_now(Collective.ALLTOALL, [d_rows], _grad_name(name), [x.shape, [aiacc.size()]],
                           splits=received)[0]
            return back

        return (rows, received), grad

    rows, received = exchange(tensor)
    return rows if splits is None else (rows, received)


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across ranks; rank i keeps the i-th block of rows (the first ``n % size`` ranks
    get one row more). ``compression`` is accepted for Horovod compatibility and not applied."""
    op = as_reduce_op(op)
    tensor = tf.convert_to_tensor(tensor)
    name = _name("reducescatter", name)
    if tensor.shape.rank == 0:
        raise ValueError(f"reducescatter of tensor {name!r} needs at least one dimension (got a scalar)")
    first = tensor.shape[0]
    n, r = aiacc.size(), aiacc.rank()
    mine = None if first is None else first // n + (1 if r < first % n else 0)
    kwargs = dict(op=op, prescale=prescale_factor, postscale=postscale_factor)

    @tf.custom_gradient
    def scatter(x):
        y = run_now(Collective.REDUCESCATTER, [x], name, [[mine] + x.shape[1:]], **kwargs)[0]

        def grad(dy):
            _differentiable(op, f"reducescatter of tensor {name!r}")
            full = run_now(Collective.ALLGATHER, [dy], _grad_name(name), [x.shape])[0]
            return scale_gathered(full, op, prescale_factor, postscale_factor)

        return y, grad

    return scatter(tensor)
