"""A blocking collective inside a graph (a TF1 ``Session`` or ``tf.function``) that holds no inter-op thread.

The problem (seen in Horovod's test suite, 2 ranks): a collective in a graph is a Python function that
hands its tensors to the engine and waits for the result. TensorFlow runs a graph's ops on a few inter-op
threads (one per core by default), in no fixed order. When a graph holds more independent collectives
than there are threads, every thread of rank 0 could be waiting for a collective rank 1 had not reached,
because every thread of rank 1 was waiting for one rank 0 had not reached: the job hung. Naming does not
help there (the names matched; the threads were gone), and neither does waiting in a separate op: a wait
op blocks a thread just the same.

What this module does: the Python function runs inside a one-element tf.data pipeline::

    inputs ──► from_tensors ──► map(fn) ──► get_single_element ──► outputs
                                 (inline)    (on tf.data's own threads)

``get_single_element`` runs on a thread pool of tf.data's own that grows as needed, and a map without
inter-op parallelism runs its function inline on that thread: a waiting collective holds none of
TensorFlow's inter-op threads, so every collective of a graph reaches the engine, in whatever order the
executor picks, and the engine matches them by name (derived from the graph, see ``mpi_ops._name``).
Measured here: 8 collectives waiting on each other in a Session with 2 inter-op threads complete (the
plain ``numpy_function`` ran them 2 at a time and timed out); about 0.5 ms per op. Inside ``tf.function``
the op is also taken out of the chain that automatic control dependencies put stateful ops in: program
order is no order the ranks need to agree on, names are (Horovod's ops are not in that chain either).

Errors: the function returns a status (code, message) next to its outputs, and ``AiaccStatus`` (see
``_native``) fails the step with that code, so a mismatch is a ``FailedPreconditionError`` as in Horovod.
Without the native op the function raises, and TensorFlow picks the class from the Python exception's.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable, List, Sequence

import numpy as np
import tensorflow as tf

from . import _errors, _native
from ._ordering import exempt_from_automatic_control_dependencies

logger = logging.getLogger(__name__)

__all__ = ["blocking_op", "process_token", "check_process"]

# This process's mark, the first input of every numpy_function aiacc puts in a graph. TensorFlow runs such a
# function only in the process that traced it: a SavedModel keeps the op as a key into that process's
# registry, which another process maps to whatever it registered under the same key (another aiacc op: its
# results, silently; seen: an Average that returned 3 x the sum). A mark from another process is this error.
_PROCESS_TOKEN = uuid.uuid4().hex.encode()
FOREIGN_GRAPH = ("this graph holds aiacc collectives traced in another process (a SavedModel loaded here?): "
                 "TensorFlow runs aiacc's graph ops only in the process that traced them. Save models for serving "
                 "without them (model.save(), or a tf.function that calls no hvd op), and train with the "
                 "functions of the training script itself")


def process_token() -> tf.Tensor:
    """The mark of this process, as a graph constant (see :func:`check_process`)."""
    return tf.constant(_PROCESS_TOKEN)


def check_process(token) -> None:
    """Raise unless ``token`` (a numpy_function's first input) was made by this process."""
    if bytes(token) != _PROCESS_TOKEN:
        raise RuntimeError(FOREIGN_GRAPH)

try:  # private, hence guarded: the map of tf.data that runs its function inline
    from tensorflow.python.data.ops.map_op import _MapDataset
except ImportError:  # pragma: no cover - another TensorFlow layout
    _MapDataset = None

_OK = (np.int32(0), np.bytes_(b""))


def _placeholder(dtype: tf.DType) -> np.ndarray:
    return np.zeros(0, dtype=dtype.as_numpy_dtype)


def blocking_op(fn: Callable, inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType], name: str,
                independent: bool = True) -> List[tf.Tensor]:
    """The outputs of ``fn(*arrays) -> [arrays]`` (which may block until other ranks take part), as graph
    tensors of ``out_dtypes``. ``independent``: inside tf.function, out of automatic control dependencies'
    chain (a collective); False keeps program order (join, barrier)."""
    status = _native.status_op()
    out_dtypes = list(out_dtypes)

    if status is None:
        def body(token, *arrays):
            try:
                check_process(token)
                return fn(*arrays)
            except Exception as exc:  # noqa: BLE001 - leaves the op as the closest class TF allows
                raise _errors.to_tf(exc) from exc
        tout = out_dtypes
    else:
        def body(token, *arrays):
            try:
                check_process(token)
                return [*_OK, *fn(*arrays)]
            except Exception as exc:  # noqa: BLE001 - becomes the op's status, see AiaccStatus
                code, message = _errors.code_and_message(exc)
                return [np.int32(code), np.bytes_(message.encode()), *map(_placeholder, out_dtypes)]
        tout = [tf.int32, tf.string] + out_dtypes

    def call(*tensors):
        return tuple(tf.numpy_function(body, [process_token(), *tensors], tout, stateful=True, name=name))

    if _MapDataset is None:
        outs = call(*inputs)
        pipeline_op = outs[0].op
    else:
        dataset = _MapDataset(tf.data.Dataset.from_tensors(tuple(inputs)), call, use_inter_op_parallelism=False)
        outs = tf.nest.flatten(dataset.get_single_element())
        pipeline_op = outs[0].op
    if independent:
        exempt_from_automatic_control_dependencies(pipeline_op)
    if status is None:
        return list(outs)
    check = status(outs[0], outs[1])
    if independent:
        exempt_from_automatic_control_dependencies(check)
    with tf.control_dependencies([check]):
        return [tf.identity(o) for o in outs[2:]]
