"""The collectives of aiacc.keras: Horovod's Keras signatures, and on Keras' PyTorch and JAX backends the
backend's tensors in and out.

Horovod's Keras module names a value's collective second, ``allreduce(value, name=None, average=None,
prescale_factor=1.0, postscale_factor=1.0, op=None, compression=...)`` and ``reducescatter(value, name=None,
op=Average)``, where :mod:`aiacc.tensorflow`'s functions (TensorFlow's signatures) take ``average`` and
``device_dense`` second: ``hvd.allreduce(x, "loss", False)`` from a Horovod Keras script summed there, and
averaged here before; the value is ``value=`` by keyword in each (``allgather(value, name)``, ``broadcast(value,
root_rank, name)``). The keywords of aiacc.tensorflow's functions (``process_set=``, ...) pass through.

On Keras' PyTorch and JAX backends the collectives take what such a script holds (the backend's tensors, a
torch tensor that requires grad included, whose value is sent; Keras variables; numpy arrays; Python numbers)
and return the backend's tensors, as ``keras.ops`` does (before: TensorFlow tensors, and a torch tensor that
requires grad failed in TensorFlow's conversion); ``alltoall`` with ``splits`` returns both parts so. They
are not differentiable there: gradients are reduced by :class:`DistributedOptimizer`. TensorFlow tensors
given there get TensorFlow tensors back; on TensorFlow's backend nothing is converted.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from aiacc import tensorflow as _tf

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "alltoall", "reducescatter", "grouped_reducescatter"]

_NATIVE = keras.backend.backend() != "tensorflow"  # fixed when Keras is imported (KERAS_BACKEND, keras.json)
_TF_TYPES = (tf.Tensor, tf.Variable, tf.IndexedSlices)


def _sent(value):
    """What TensorFlow's conversion takes: TensorFlow's and numpy's values as they are, others through numpy
    (``keras.ops.convert_to_numpy`` detaches a torch tensor and brings it to the host; Python lists and numbers
    go through the backend first, so that their dtype is Keras' float32, not numpy's float64)."""
    if isinstance(value, (*_TF_TYPES, np.ndarray)):
        return value
    if type(value).__name__.endswith("Tracer") and type(value).__module__.startswith("jax"):
        raise TypeError("aiacc.keras' collectives run eagerly, not inside a jitted JAX function (Keras' train step "
                        "on JAX): compile with run_eagerly=True to call them there, or let DistributedOptimizer "
                        "reduce the gradients")
    if isinstance(value, (list, tuple, int, float, bool)):
        value = keras.ops.convert_to_tensor(value)
    return keras.ops.convert_to_numpy(value)


def _native(result):
    if isinstance(result, (tuple, list)):
        return type(result)(_native(r) for r in result)
    return keras.ops.convert_to_tensor(result.numpy())


def _each(fn):
    """``fn(value, ...)`` taking and returning the backend's tensors on a backend other than TensorFlow."""
    if not _NATIVE:
        return fn

    @functools.wraps(fn)
    def call(value, *args, **kwargs):
        if isinstance(value, _TF_TYPES):
            return fn(value, *args, **kwargs)
        return _native(fn(_sent(value), *args, **kwargs))
    return call


def _group(fn):
    """``fn(values, ...)`` likewise, for a list."""
    if not _NATIVE:
        return fn

    @functools.wraps(fn)
    def call(values, *args, **kwargs):
        values = list(values)
        if values and all(isinstance(v, _TF_TYPES) for v in values):
            return fn(values, *args, **kwargs)
        return _native(fn([_sent(v) for v in values], *args, **kwargs))
    return call


_allreduce, _reducescatter = _each(_tf.allreduce), _each(_tf.reducescatter)
grouped_allreduce, grouped_allgather = _group(_tf.grouped_allreduce), _group(_tf.grouped_allgather)
grouped_reducescatter = _group(_tf.grouped_reducescatter)
_allgather, _broadcast, alltoall = _each(_tf.allgather), _each(_tf.broadcast), _each(_tf.alltoall)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=_tf.Compression.none, **kwargs):
    """``value`` reduced across the ranks (Average by default; ``average=False`` is Sum), in Horovod's Keras
    argument order; further keywords as :func:`aiacc.tensorflow.allreduce` takes them."""
    return _allreduce(value, average=average, compression=compression, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, name=name, **kwargs)


def allgather(value, name=None, **kwargs):
    """Every rank's ``value`` concatenated along the first dimension, in Horovod's Keras argument order."""
    return _allgather(value, name=name, **kwargs)


def broadcast(value, root_rank, name=None, **kwargs):
    """``root_rank``'s ``value`` on every rank, in Horovod's Keras argument order."""
    return _broadcast(value, root_rank, name=name, **kwargs)


def reducescatter(value, name=None, op=_tf.Average, **kwargs):
    """``value`` reduced across the ranks, rank i keeping the i-th block of rows, in Horovod's Keras argument
    order; further keywords as :func:`aiacc.tensorflow.reducescatter` takes them."""
    return _reducescatter(value, op=op, name=name, **kwargs)


def broadcast_(variables, root_rank, name=None, process_set=_tf.global_process_set):
    """Assign ``root_rank``'s value of each variable on every rank; returns their new values. On Keras'
    PyTorch and JAX backends the variables are Keras variables and the values the backend's tensors."""
    variables = list(variables)
    if not _NATIVE or all(isinstance(v, tf.Variable) for v in variables):
        return _tf.broadcast_(variables, root_rank, name=name, process_set=process_set)
    for i, v in enumerate(variables):
        if not isinstance(v, keras.Variable):
            raise TypeError(f"broadcast_ assigns variables: element {i} is a {type(v).__module__}."
                            f"{type(v).__qualname__}; pass keras.Variables, or use broadcast(value, root_rank) "
                            "for a value")
    values = [_tf.broadcast(_sent(v), root_rank, name=None if name is None else f"{name}.{i}",
                            process_set=process_set) for i, v in enumerate(variables)]
    for v, value in zip(variables, values):
        v.assign(value.numpy())
    return _native(values)
