"""Variables and Python objects across ranks."""

from __future__ import annotations

import sys

import numpy as np
import tensorflow as tf

import aiacc
from aiacc import global_process_set
from aiacc.exceptions import TensorMismatchError
from aiacc.names import describe
from aiacc.ops import Collective

from ._engine import Batch, labelled
from ._errors import to_tf
from ._graph import blocking_op
from .mpi_ops import _check_root, _graph_name, _is_global, _set_kwargs

__all__ = ["broadcast_variables", "model_variables", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "allgather_object"]


def model_variables(model) -> list:
    """``model.variables`` less Keras 3's ``SeedGenerator`` states (a ``Dropout``'s): what a broadcast makes equal.
    Each rank keeps its own random stream, as one process on the whole batch draws a mask per row and Horovod's
    Keras 2 callback (no seed variables there) leaves each rank's; broadcast, every rank drew the same masks."""
    seeds = set()
    flatten = getattr(model, "_flatten_layers", None)
    for layer in flatten(include_self=True, recursive=True) if flatten is not None else ():
        seeds.update(id(g.state) for g in getattr(layer, "_seed_generators", ()) if hasattr(g, "state"))
    return [v for v in model.variables if id(v) not in seeds]


def broadcast_variables(variables, root_rank: int = 0, process_set=global_process_set, inplace: bool = False,
                        name: str = "broadcast_variables"):
    """Assign ``root_rank``'s value of every variable (tf.Variable or Keras Variable) on every rank of
    ``process_set``.

    All broadcasts are handed to the engine before the first is waited for, so they travel together. They are
    named by position (``<name>.<i>``), not by the variables' names, which Keras numbers per process (an optimizer's
    slot variables after ``load_model`` on the root only, say): named so, the ranks waited for each other.
    First every rank's number of variables is allgathered (``<name>.count``): ranks that pass different
    numbers get a TensorMismatchError (FailedPreconditionError) naming each rank's, before any broadcast.
    Eagerly the variables are assigned at once; in a graph the grouped assign op is returned. The received
    value is copied into the variable's own memory by ``assign`` (the only copy; ``inplace`` is accepted for
    Horovod compatibility). With Keras on another backend (``KERAS_BACKEND=torch`` / ``jax``) its variables' values
    travel as numpy arrays.
    """
    variables = _variable_list(variables)
    root_rank = _check_root(root_rank, name, process_set)
    extra = _set_kwargs(process_set)
    if _keras_backend() not in (None, "tensorflow"):  # Keras variables of PyTorch (or JAX): through numpy
        import keras  # noqa: PLC0415 - imported already (see _keras_backend)

        _same_count(variables, name, process_set)
        values = [np.asarray(keras.ops.convert_to_numpy(v), order="C") for v in variables]
        handles = [aiacc.broadcast_async(_as_sent(a), root_rank, name=f"{name}.{i}", **extra)
                   for i, a in enumerate(values)]
        try:
            received = [aiacc.synchronize(h) for h in handles]
        except TensorMismatchError as e:  # (named by position: what each is, on this rank, added)
            raise labelled(e, _labels(variables, name)) from e
        for v, a, got in zip(variables, values, received):
            v.assign(got.view(a.dtype))
        return None
    # in a graph, the name made unique there (two calls in one tf.function, Horovod's TF2 example, run together)
    base = name if tf.executing_eagerly() else _graph_name(name)
    checked = _same_count(variables, base, process_set)
    batch = Batch(labels=_labels(variables, base))
    for i, v in enumerate(variables):
        with tf.control_dependencies(checked):  # (in a graph: not before the check)
            value = tf.identity(v) if checked else tf.convert_to_tensor(v)
        batch.submit(Collective.BROADCAST, [value], f"{base}.{i}", [value.shape], root=root_rank, **extra)
    assigns = [v.assign(out[0]) for v, out in zip(variables, batch.collect())]
    if not tf.executing_eagerly():
        return tf.group(*assigns)
    return None


def _variable_list(variables) -> list:
    """``broadcast_variables``' argument as a list of variables, before any broadcast (every rank refuses the same
    call); else a TypeError saying what to pass (a model was "'Sequential' object is not iterable", a tensor "Tensor.name
    is undefined when eager execution is enabled")."""
    what = type(variables).__name__
    if hasattr(variables, "assign"):
        raise TypeError(f"broadcast_variables takes a list of variables, not one {what}: pass [variable]")
    if hasattr(variables, "variables") or isinstance(variables, dict):
        hint = "model.variables" if hasattr(variables, "variables") else "list(variables.values())"
        raise TypeError(f"broadcast_variables takes a list of variables, not a {what}: pass {hint}")
    try:
        variables = list(variables)
    except TypeError:
        raise TypeError(f"broadcast_variables takes a list of variables, got {what}") from None
    for i, v in enumerate(variables):
        if not hasattr(v, "assign"):
            raise TypeError(f"broadcast_variables: element {i} of the list is a {type(v).__name__}, not a variable "
                            "(broadcast_variables assigns each variable; broadcast() returns a tensor)")
    return variables


def _labels(variables: list, base: str) -> dict:
    """The engine's name of each variable's broadcast -> the variable, by its path (its name) on this rank."""
    return {f"{base}.{i}": f"variable {getattr(v, 'path', None) or v.name!r}" for i, v in enumerate(variables)}


def _same_count(variables: list, base: str, process_set) -> list:
    """Raise TensorMismatchError (FailedPreconditionError) on every rank unless every rank passes as many
    variables, before any broadcast is submitted: the broadcasts are named by position, and a rank with more
    waited for the extra ones until the stall check while the others went on (or the job ended). One small
    allgather per call, of the count (``<base>.count``). In a graph: the op the broadcasts wait for, in a list."""
    n = len(variables)
    extra = _set_kwargs(process_set)

    def check(*_):
        if aiacc.outside_process_set(process_set):  # (the broadcasts raise the error that names the set)
            return [np.zeros((), np.int32)]
        counts = aiacc.allgather(np.array([n], np.int64), name=f"{base}.count", **extra).tolist()
        if len(set(counts)) > 1:
            ranks = list(range(len(counts))) if _is_global(process_set) else list(process_set.ranks)
            mine = [getattr(v, "path", None) or v.name for v in variables[min(counts):]]
            raise TensorMismatchError(
                f"{base}: the number of variables differs across ranks ("
                + "; ".join(f"rank {k}: {c}" for k, c in zip(ranks, counts)) + ")"
                + (f" (on rank {aiacc.rank()}: the ones past {min(counts)} are {describe(mine)})" if mine else "")
                + ": every rank must broadcast the same variables, in the same order")
        return [np.zeros((), np.int32)]

    if tf.executing_eagerly():
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - the TensorFlow class Horovod raises (see _errors)
            raise to_tf(exc).with_traceback(exc.__traceback__) from None
        return []
    return blocking_op(check, [tf.constant(n)], [tf.int32], name="aiacc_count")


# unsigned dtypes no reduction takes (Horovod's list has none of them), which a broadcast copies bit for bit as
# the signed ones: Keras keeps its seed generators' state (Dropout's) in uint32 on JAX
_BITS_AS = {np.dtype(np.uint32): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.int64)}


def _as_sent(array: np.ndarray) -> np.ndarray:
    signed = _BITS_AS.get(array.dtype)
    return array if signed is None else array.view(signed)


def _keras_backend():
    """Keras' backend where the script imported Keras, else None (its variables are then TensorFlow's)."""
    keras = sys.modules.get("keras")
    return keras.backend.backend() if keras is not None and hasattr(keras, "backend") else None


def broadcast_global_variables(root_rank: int):
    """TF1 graphs: the op that broadcasts every global variable (``tf.compat.v1.global_variables()``) from
    ``root_rank``. Eagerly there are no global variables: RuntimeError (use ``broadcast_variables``)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(<model/optimizer variables>) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank, name="broadcast_global_variables")


def broadcast_object(obj, root_rank: int = 0, session=None, name=None, process_set=global_process_set):
    """``obj`` of ``root_rank`` on every rank of ``process_set`` (any picklable object); ``session`` is
    ignored (objects travel outside the graph)."""
    return aiacc.broadcast_object(obj, root_rank, name=name, process_set=None if _is_global(process_set) else
                                  process_set)


def broadcast_object_fn(root_rank: int = 0, session=None, name=None, process_set=global_process_set):
    """Horovod's TF1 helper: a function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank``."""
    def broadcast_fn(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)

    return broadcast_fn


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """A list with every rank's ``obj`` (of ``process_set``), in rank order; ``session`` is ignored."""
    return aiacc.allgather_object(obj, name=name, process_set=None if _is_global(process_set) else process_set)
