"""Horovod's TensorFlow collectives on aiacc's engine, eager and inside graphs, differentiable.

Every collective takes ``process_set`` (default: every rank of the job), as in Horovod; the engine of that
set runs it, and sizes and ranks below are the set's. Errors are TensorFlow's classes, as Horovod raises
them (a mismatch across ranks is a ``FailedPreconditionError``; see ``_errors``).

Gradients (as Horovod defines them; every rank must run the backward pass):

* ``allreduce`` / ``grouped_allreduce`` (Average/Sum): the upstream gradients allreduced with the same op
  and scale factors.
* ``allgather`` / ``grouped_allgather``: the upstream gradients averaged over the ranks, this rank's rows
  kept.
* ``broadcast``: the upstream gradients averaged over the ranks on the root, zeros elsewhere.
* ``alltoall``: the upstream gradients sent back with an alltoall of the received splits.
* ``reducescatter`` / ``grouped_reducescatter``: the upstream gradients allgathered, times the set's
  size for Sum and times the scale factors.

Names: a collective is matched across ranks by its name. Eagerly an unnamed one is matched by call order.
In a graph (a TF1 ``Session`` or ``tf.function``) its name comes from the graph, as Horovod's does: the
kind and the name of its input tensor, in the current name scope, made unique in the graph
(``aiacc.allreduce.dense_kernel_0``, ...; an eager tensor the function captured, which TensorFlow names by a
process-wide counter, is left out of the name), so the ranks agree on it whatever order their executors run
the ops in, and on every step (the engine's response cache agrees on it with one bit). A given name is
made unique in the graph the same way (``ignore_name_scope=True``: used as given).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

import aiacc
# Horovod's mpi_ops holds the basics too (scripts do ``from horovod.tensorflow.mpi_ops import Sum, rank``): the core's
from aiacc import (Adasum, Max, Min, Product, Sum, cross_rank, cross_size, init, is_homogeneous,  # noqa: F401
                   is_initialized, local_rank, local_size, mpi_threads_supported, rank, shutdown, size,
                   start_timeline, stop_timeline)
from aiacc import global_process_set
from aiacc.api import as_group
from aiacc.compression import custom_compressor
from aiacc.exceptions import InvalidArgumentError
from aiacc.names import derived_name
from aiacc.process_sets import HorovodBasics
from aiacc.requests import check_name, check_rows, listed_splits
from aiacc.ops import (Average, Collective, ReduceOp, as_reduce_op, average_or_op, check_sparse_op,
                       reducescatter_grad_scale, scatter_rows)

from ._engine import check_not_xla, run_now
from ._graph import blocking_op, check_process, process_token
from ._errors import to_tf
from .compression import Compression

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "alltoall", "reducescatter", "grouped_reducescatter", "size_op", "local_size_op", "rank_op",
           "local_rank_op", "process_set_included_op", "join"]

# what Horovod's own tests read from its core (``hvd.mpi_ops._basics``): the registered process sets
_basics = HorovodBasics()


# ---- names, process sets ------------------------------------------------------------------------
def _graph_name(base: str, scoped: bool = True) -> str:
    """``base`` made unique in the current graph, in the current name scope (``scoped``) or as it is."""
    graph = tf.compat.v1.get_default_graph()
    if scoped:
        return graph.unique_name(base)
    with graph.name_scope(None):  # the top level: ``base`` already holds its scope
        return graph.unique_name(base)


def _name(kind: str, name: Optional[str], tensors: Sequence = (), ignore_name_scope: bool = False) -> Optional[str]:
    """The engine's name of a collective (see the module docstring); None: matched by call order."""
    if name is not None and name.__class__ is not str:
        try:
            check_name(Collective[kind.replace("grouped_", "").upper()], name)
        except TypeError as exc:
            raise to_tf(exc) from None
    if tf.executing_eagerly():
        return name
    if name is not None:
        return name if ignore_name_scope else _graph_name(name)
    inputs = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors]
    label = "_".join(dict.fromkeys(re.sub(r"[^A-Za-z0-9_]", "_", t.name) for t in (inputs[:1] + inputs[-1:])
                                   if not _counted(t.name)))
    return _graph_name(f"aiacc.{kind}.{label}" if label else f"aiacc.{kind}")


def _counted(tensor_name: str) -> bool:
    """A tensor named by TensorFlow's process-wide counter (``"53:0"``: an eager tensor a ``tf.function`` captured),
    whose number differs across ranks once any rank built a graph of its own; such a name is left out."""
    return tensor_name.rsplit(":", 1)[0].rsplit("/", 1)[-1].isdigit()


def _derived(name: Optional[str], suffix: str) -> Optional[str]:
    """The core's name of a collective that belongs to ``name`` (its gradient, its row counts), made unique in
    a graph too, where a gradient may be built more than once."""
    derived = derived_name(name, suffix)
    return derived if derived is None or tf.executing_eagerly() else _graph_name(derived, scoped=False)


def _is_global(process_set) -> bool:
    return process_set is None or process_set is global_process_set


def _set_size(process_set) -> int:
    """The core's ``set_size``, its error as TensorFlow's class."""
    try:
        return aiacc.set_size(process_set)
    except InvalidArgumentError as exc:
        raise to_tf(exc) from None


def _static_size(process_set) -> Optional[int]:
    """The set's size for a shape known while tracing; None for a set that is not registered (the engine then
    raises its error, as it does in every adapter)."""
    return None if getattr(process_set, "process_set_id", 0) is None else _set_size(process_set)


def _set_kwargs(process_set) -> dict:
    return {} if _is_global(process_set) else {"process_set": process_set}


def _differentiable(op: ReduceOp, what: str) -> None:
    # (Horovod's TensorFlow gradient of a Min/Max/Product allreduce is the allreduce of the gradients with that op,
    # which is not the derivative: refused here rather than a wrong number)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"the gradient of {what} with op={op} is not defined; only Average and Sum "
                                  "are differentiable")


def _zeros_for_none(dys, ys):
    return [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]


def _needs_rows(tensor, kind: Collective, name: Optional[str], index: Optional[int] = None) -> None:
    """The core's check of a 0-d tensor, while tracing (its shape then is needed), as TensorFlow's class."""
    if tensor.shape.rank == 0:
        try:
            check_rows(kind, "(unnamed)" if name is None else name, 0, index)
        except InvalidArgumentError as exc:
            raise to_tf(exc) from None


# ---- allreduce ------------------------------------------------------------------------------
def _sparse_ops(op, prescale_factor, postscale_factor, name) -> None:
    """The core's rule for ``tf.IndexedSlices`` (allgathered, not reduced)."""
    label = "(unnamed)" if name is None else name
    check_sparse_op(op, f"allreduce of IndexedSlices {label!r}", prescale_factor, postscale_factor)


def _average_gathered(values, op, process_set):
    """Horovod's average of gathered IndexedSlices values: divided by the set's size, in TensorFlow's true
    division (integer values become floating point, as in Horovod)."""
    return values / tf.cast(_set_size(process_set), values.dtype) if op == ReduceOp.AVERAGE else values


def _dense(tensor, name):
    """``tensor`` as a dense ``tf.Tensor``; a ``tf.SparseTensor`` or ``tf.RaggedTensor`` is refused naming the
    tensor (TensorFlow's own conversion error names neither the tensor nor what to do)."""
    if isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
        kind, fix = (("tf.SparseTensor", "tf.sparse.to_dense(t)") if isinstance(tensor, tf.SparseTensor)
                     else ("tf.RaggedTensor", "t.to_tensor() or t.flat_values"))
        raise TypeError(f"tensor {name or '(unnamed)'!r} is a {kind}; aiacc communicates dense tensors (and, in "
                        f"allreduce, tf.IndexedSlices): pass {fix}")
    return tf.convert_to_tensor(tensor)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """``tensor`` reduced across the ranks of ``process_set`` (Average by default), as a new tensor.

    A ``tf.IndexedSlices`` is allgathered instead (values and indices; for Average the values are divided
    by the number of ranks), as Horovod does: only Sum and Average, no scale factors. Densify it first
    (``tf.convert_to_tensor``) to reduce it densely. ``compression`` casts on the wire.
    ``device_dense``/``device_sparse`` are accepted for Horovod compatibility.
    """
    op = average_or_op(average, op, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        _sparse_ops(op, prescale_factor, postscale_factor, name)
        name = _name("allreduce", name, [tensor], ignore_name_scope)
        values = allgather(tensor.values, name=_derived(name, "values"), process_set=process_set,
                           ignore_name_scope=True)
        indices = allgather(tensor.indices, name=_derived(name, "indices"), process_set=process_set,
                            ignore_name_scope=True)
        return tf.IndexedSlices(_average_gathered(values, op, process_set), indices, dense_shape=tensor.dense_shape)
    custom = custom_compressor(compression)
    if custom is not None:  # Horovod's way with a compressor of one's own: compress, reduce, decompress
        compressed, ctx = custom.compress(tensor)
        return custom.decompress(allreduce(compressed, None, device_dense, device_sparse, Compression.none, op,
                                           prescale_factor, postscale_factor, name, process_set, ignore_name_scope), ctx)
    tensor = _dense(tensor, name)
    name = _name("allreduce", name, [tensor], ignore_name_scope)
    kwargs = dict(op=op, prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                  **_set_kwargs(process_set))

    return _reduce([tensor], name, kwargs, f"allreduce of tensor {name or '(unnamed)'!r}")[0]


def _reduce(xs, name, kwargs, what: str):
    """The allreduce of ``xs`` (one request), differentiable to any order: its gradient is the same allreduce of
    the upstream gradients, itself differentiable, as Horovod's registered gradients (a gradient penalty through
    ``hvd.allreduce``; the gradient made by ``run_now`` alone was None eagerly, and an error in a tf.function)."""

    @tf.custom_gradient
    def reduce(*xs):
        ys = run_now(Collective.ALLREDUCE, list(xs), name, [x.shape for x in xs], **kwargs)

        def grad(*dys):
            _differentiable(kwargs["op"], what)
            return _reduce(_zeros_for_none(dys, ys), _derived(name, "grad"), kwargs, what)

        return ys, grad

    return reduce(*xs)


def scale_gathered(values, op, prescale_factor, postscale_factor, process_set=None):
    """Gathered IndexedSlices values of a gradient, scaled as an allreduce with these factors would be
    (``DistributedGradientTape``'s sparse gradients), over the ranks of ``process_set``."""
    factor = float(prescale_factor) * float(postscale_factor) / (_set_size(process_set) if op == ReduceOp.AVERAGE
                                                                 else 1)
    return values if factor == 1.0 else values * tf.cast(factor, values.dtype)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """A list of tensors reduced as one unit (agreed together, fused into as few messages as possible).

    ``tf.IndexedSlices`` members are allgathered (grouped too), as in :func:`allreduce`.
    """
    tensors = as_group(tensors, "grouped_allreduce", name)
    if not tensors:
        return tensors
    op = average_or_op(average, op, "grouped_allreduce")
    custom = custom_compressor(compression)
    if custom is not None:  # (as allreduce; sparse members are allgathered uncompressed)
        pairs = [(t, None) if isinstance(t, tf.IndexedSlices) else custom.compress(t) for t in tensors]
        out = grouped_allreduce([c for c, _ in pairs], None, device_dense, device_sparse, Compression.none, op,
                                prescale_factor, postscale_factor, process_set, ignore_name_scope, name)
        return [o if isinstance(t, tf.IndexedSlices) else custom.decompress(o, ctx)
                for t, o, (_, ctx) in zip(tensors, out, pairs)]
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _sparse_ops(op, prescale_factor, postscale_factor, name)
    out = [None] * len(tensors)
    if sparse:
        slices = [tensors[i] for i in sparse]
        group = _name("grouped_allreduce", name, slices, ignore_name_scope)
        values = grouped_allgather([s.values for s in slices], name=_derived(group, "values"),
                                   ignore_name_scope=True, process_set=process_set)
        indices = grouped_allgather([s.indices for s in slices], name=_derived(group, "indices"),
                                    ignore_name_scope=True, process_set=process_set)
        for i, s, v, k in zip(sparse, slices, values, indices):
            out[i] = tf.IndexedSlices(_average_gathered(v, op, process_set), k, dense_shape=s.dense_shape)
    if not dense:
        return out
    xs = [_dense(tensors[i], name) for i in dense]
    group = _name("grouped_allreduce", name, xs, ignore_name_scope) if not sparse else _derived(group, "dense")
    kwargs = dict(op=op, prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                  grouped=True, **_set_kwargs(process_set))

    for i, y in zip(dense, _reduce(xs, group, kwargs, f"grouped_allreduce {group or '(unnamed)'!r}")):
        out[i] = y
    return out


# ---- allgather ----------------------------------------------------------------------------------
def _rows_of(xs, name, process_set):
    """Every rank's number of rows of each tensor of ``xs`` (one collective): a [size, len(xs)] tensor."""
    counts = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])[tf.newaxis]
    rows = run_now(Collective.ALLGATHER, [counts], name, [[_set_size(process_set), len(xs)]],
                   **_set_kwargs(process_set))[0]
    return rows


def _my_rows(grads, xs, name, process_set):
    """Horovod's gradient of an allgather: each upstream gradient averaged over the ranks, this rank's
    rows kept."""
    kwargs = _set_kwargs(process_set)
    reduced = [_reduce([g], _derived(name, f"grad.{i}") if len(grads) > 1 else _derived(name, "grad"),
                       dict(op=Average, **kwargs), "an allgather's gradient")[0] for i, g in enumerate(grads)]
    rows = _rows_of(xs, _derived(name, "grad.rows"), process_set)
    r = aiacc.set_rank(process_set)
    starts = tf.reduce_sum(rows[:r], axis=0)
    return [g[starts[i]:starts[i] + rows[r, i]] for i, g in enumerate(reduced)]


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's ``tensor`` (of ``process_set``, in the order of its ranks) concatenated along the first
    dimension (first dimensions may differ)."""
    tensor = _dense(tensor, name)
    name = _name("allgather", name, [tensor], ignore_name_scope)
    _needs_rows(tensor, Collective.ALLGATHER, name)
    kwargs = _set_kwargs(process_set)

    @tf.custom_gradient
    def gather(x):
        y = run_now(Collective.ALLGATHER, [x], name, [[None] + x.shape[1:]], **kwargs)[0]

        def grad(dy):
            return _my_rows([dy], [x], name, process_set)[0]

        return y, grad

    return gather(tensor)


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """:func:`allgather` of each tensor of the list, as one unit."""
    tensors = [_dense(t, name) for t in as_group(tensors, "grouped_allgather", name)]
    if not tensors:
        return tensors
    name = _name("grouped_allgather", name, tensors, ignore_name_scope)
    for i, t in enumerate(tensors):
        _needs_rows(t, Collective.ALLGATHER, name, i)
    kwargs = dict(grouped=True, **_set_kwargs(process_set))

    @tf.custom_gradient
    def gather(*xs):
        ys = run_now(Collective.ALLGATHER, xs, name, [[None] + x.shape[1:] for x in xs], **kwargs)

        def grad(*dys):
            return _my_rows(_zeros_for_none(dys, ys), xs, name, process_set)

        return ys, grad

    return list(gather(*tensors))


# ---- broadcast ----------------------------------------------------------------------------------
def _check_root(root_rank, what: str, process_set) -> int:
    """The core's root check, its error as TensorFlow's class (in a graph: while tracing)."""
    try:
        return aiacc.check_root(root_rank, what, None if _is_global(process_set) else process_set)
    except InvalidArgumentError as exc:
        raise to_tf(exc) from None


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``root_rank``'s ``tensor`` on every rank of ``process_set``; ``root_rank`` is a rank of the job."""
    tensor = _dense(tensor, name)
    name = _name("broadcast", name, [tensor], ignore_name_scope)
    root_rank = _check_root(root_rank, f"broadcast of tensor {name or '(unnamed)'!r}", process_set)
    kwargs = _set_kwargs(process_set)

    @tf.custom_gradient
    def bcast(x):
        y = run_now(Collective.BROADCAST, [x], name, [x.shape], root=root_rank, **kwargs)[0]

        def grad(dy):
            total = _reduce([dy], _derived(name, "grad"), dict(op=Average, **kwargs), "a broadcast's gradient")[0]
            # times 1 on the root and 0 elsewhere, not zeros_like: a graph would prune the allreduce away on the other
            # ranks; and the same ops on every rank, so that TensorFlow's name counters stay equal across ranks (the
            # unnamed collectives of later graphs are named from them: a rank-dependent graph made them differ)
            return total * tf.constant(1 if aiacc.rank() == root_rank else 0, total.dtype)

        return y, grad

    return bcast(tensor)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assign ``root_rank``'s value of each variable on every rank; returns the variables' new values (read
    after the assignment). The received value is copied into the variable by ``assign``."""
    if hasattr(variables, "assign"):  # (one variable: its rows were taken for the list, AttributeError: 'assign')
        raise TypeError(f"broadcast_ takes a list of variables, not one {type(variables).__name__}: pass [variable]")
    variables = list(variables)
    for i, v in enumerate(variables):  # (before any broadcast: every rank refuses the same call)
        if not hasattr(v, "assign"):
            raise TypeError(f"broadcast_: element {i} of the list is a {type(v).__name__}, not a variable (broadcast_ "
                            "assigns each variable; broadcast() returns a tensor)")
    out = []
    for i, v in enumerate(variables):
        label = None if name is None else f"{name}.{i}"
        value = broadcast(tf.convert_to_tensor(v), root_rank, name=label, process_set=process_set)
        assign = v.assign(value)
        if tf.executing_eagerly():
            out.append(_read(v))
        else:
            with tf.control_dependencies([assign]):
                out.append(_read(v))
    return out


def _read(variable):
    """A tf.Variable's value, or a Keras 3 variable's (which has no ``read_value``)."""
    return variable.read_value() if hasattr(variable, "read_value") else tf.identity(tf.convert_to_tensor(variable))


# ---- alltoall -----------------------------------------------------------------------------------
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i of ``process_set`` (equal parts if None); returns the
    received rows, and with ``splits`` given ``(rows, received_splits)`` as Horovod does."""
    tensor = _dense(tensor, name)
    name = _name("alltoall", name, [tensor], ignore_name_scope)
    _needs_rows(tensor, Collective.ALLTOALL, name)
    n = _static_size(process_set)
    kwargs = _set_kwargs(process_set)
    shapes = [[None] + tensor.shape[1:], [n]]
    if isinstance(splits, (list, tuple)):  # (as the core reads a list: whole floats count)
        splits = listed_splits(name, splits)
    elif isinstance(splits, tf.Variable):  # (read here: captured in the custom gradient, TensorFlow refused it)
        splits = tf.convert_to_tensor(splits)

    @tf.custom_gradient
    def exchange(x):
        rows, received = run_now(Collective.ALLTOALL, [x], name, shapes, splits=splits, **kwargs)

        def grad(d_rows, d_received=None):
            if d_rows is None:
                d_rows = tf.zeros_like(rows)
            return run_now(Collective.ALLTOALL, [d_rows], _derived(name, "grad"), [x.shape, [n]], splits=received,
                           **kwargs)[0]

        return (rows, received), grad

    rows, received = exchange(tensor)
    return rows if splits is None else (rows, received)


# ---- reducescatter ------------------------------------------------------------------------------
def _scattered_rows(tensor, process_set) -> Optional[int]:
    """How many rows this rank keeps (the core's split), when known while tracing."""
    n = _static_size(process_set)
    # (a rank outside the set: unknown here, the collective's own error names it)
    r = None if n is None or aiacc.outside_process_set(process_set) else aiacc.set_rank(process_set)
    if tensor.shape[0] is None or r is None:
        return None
    return scatter_rows(tensor.shape[0], n)[r]


def _reducescatter_grads(dys, xs, name, op, prescale_factor, postscale_factor, process_set):
    """Horovod's gradient of a reducescatter: the upstream gradients allgathered, times the set's size for
    Sum and times the scale factors."""
    _differentiable(op, f"reducescatter of tensor {name or '(unnamed)'!r}")
    factor = reducescatter_grad_scale(op, _set_size(process_set), prescale_factor, postscale_factor)
    dys = [dy if factor == 1 else dy * tf.cast(factor, dy.dtype) for dy in dys]
    return [run_now(Collective.ALLGATHER, [dy], _derived(name, f"grad.{i}" if len(dys) > 1 else "grad"), [x.shape],
                    **_set_kwargs(process_set))[0] for i, (dy, x) in enumerate(zip(dys, xs))]


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across the ranks of ``process_set``; rank i keeps the i-th block of rows (the
    first ``n % size`` ranks get one row more). ``compression`` casts on the wire."""
    tensor = _dense(tensor, name)
    custom = custom_compressor(compression)
    if custom is not None:  # (as allreduce: Horovod compresses around its reducescatter too)
        small, ctx = custom.compress(tensor)
        return custom.decompress(reducescatter(small, device_dense, Compression.none, op, name, process_set,
                                               ignore_name_scope, prescale_factor, postscale_factor), ctx)
    op = as_reduce_op(op)
    name = _name("reducescatter", name, [tensor], ignore_name_scope)
    _needs_rows(tensor, Collective.REDUCESCATTER, name)
    kwargs = dict(op=op, prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                  **_set_kwargs(process_set))
    mine = _scattered_rows(tensor, process_set)

    @tf.custom_gradient
    def scatter(x):
        y = run_now(Collective.REDUCESCATTER, [x], name, [[mine] + x.shape[1:]], **kwargs)[0]

        def grad(dy):
            return _reducescatter_grads([dy], [x], name, op, prescale_factor, postscale_factor, process_set)[0]

        return y, grad

    return scatter(tensor)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0, name=None,
                          ignore_name_scope=False):
    """:func:`reducescatter` of each tensor of the list, as one unit."""
    tensors = [_dense(t, name) for t in as_group(tensors, "grouped_reducescatter", name)]
    if not tensors:
        return tensors
    custom = custom_compressor(compression)
    if custom is not None:  # (as allreduce)
        cs = [custom.compress(t) for t in tensors]
        out = grouped_reducescatter([c for c, _ in cs], device_dense, Compression.none, op, process_set,
                                    prescale_factor, postscale_factor, name, ignore_name_scope)
        return [custom.decompress(o, ctx) for o, (_, ctx) in zip(out, cs)]
    op = as_reduce_op(op)
    name = _name("grouped_reducescatter", name, tensors, ignore_name_scope)
    for i, t in enumerate(tensors):
        _needs_rows(t, Collective.REDUCESCATTER, name, i)
    kwargs = dict(op=op, prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                  grouped=True, **_set_kwargs(process_set))
    shapes = [[_scattered_rows(t, process_set)] + t.shape[1:] for t in tensors]

    @tf.custom_gradient
    def scatter(*xs):
        ys = run_now(Collective.REDUCESCATTER, xs, name, shapes, **kwargs)

        def grad(*dys):
            return _reducescatter_grads(_zeros_for_none(dys, ys), xs, name, op, prescale_factor, postscale_factor,
                                        process_set)

        return ys, grad

    return list(scatter(*tensors))


# ---- the job's shape as ops ---------------------------------------------------------------------
def _value_op(fn, name: Optional[str], what: str):
    """An int32 scalar that is ``fn()`` when it runs (eagerly: now; in a graph: each time the graph runs,
    as Horovod's ops do)."""
    if tf.executing_eagerly():
        return tf.constant(fn(), tf.int32)
    check_not_xla(name or what)  # (XLA's own error named a PyFuncStateless kernel)

    def body(mark):
        check_process(mark)
        return np.int32(fn())

    value = tf.numpy_function(body, [process_token()], tf.int32, stateful=False, name=name or what)
    value.set_shape([])
    return value


def size_op(process_set_id=0, name=None):
    """The number of ranks (of the process set with this id) as an int32 tensor."""
    return _value_op(lambda: _set_size(aiacc.process_set_by_id(process_set_id)), name, "aiacc_size")


def local_size_op(name=None):
    """The number of ranks on this host as an int32 tensor."""
    return _value_op(aiacc.local_size, name, "aiacc_local_size")


def rank_op(name=None):
    """This process's rank as an int32 tensor."""
    return _value_op(aiacc.rank, name, "aiacc_rank")


def local_rank_op(name=None):
    """This process's rank on its host as an int32 tensor."""
    return _value_op(aiacc.local_rank, name, "aiacc_local_rank")


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank is in the process set with this id, else 0, as an int32 tensor."""
    return _value_op(lambda: int(bool(aiacc.process_set_by_id(process_set_id).included() or process_set_id == 0)), name,
                     "aiacc_process_set_included")


def join():
    """Tell the other ranks this rank has no more data (see :func:`aiacc.join`); the rank that joined last,
    as an int32 tensor (in a graph: when the op runs)."""
    if tf.executing_eagerly():
        try:
            return tf.constant(aiacc.join(), tf.int32)
        except Exception as exc:  # noqa: BLE001 - the TensorFlow class Horovod raises (see _errors)
            raise to_tf(exc).with_traceback(exc.__traceback__) from None
    check_not_xla("join")  # (XLA's own error named a TensorDataset kernel)
    # in program order (not independent): a join marks the end of this rank's collectives
    last = blocking_op(lambda _: [np.asarray(aiacc.join(), np.int32)], [tf.constant(0)], [tf.int32], name="aiacc_join",
                       independent=False)[0]
    last.set_shape([])
    return last
