"""Variables and Python objects across ranks."""

from __future__ import annotations

import tensorflow as tf

import aiacc
from aiacc.ops import Collective

from ._engine import Batch
from .gradients import _label
from .mpi_ops import _check_root

__all__ = ["broadcast_variables", "broadcast_object", "allgather_object"]


def broadcast_variables(variables, root_rank: int = 0, name: str = "broadcast_variables"):
    """Assign ``root_rank``'s value of every variable (tf.Variable or Keras Variable) on every rank.

    All broadcasts are handed to the engine before the first is waited for, so they travel together.
    Eagerly the variables are assigned at once; inside ``tf.function`` the grouped assign op is returned.
    The received value is copied into the variable's own memory by ``assign`` (the only copy).
    """
    variables = list(variables)
    _check_root(root_rank, name)
    batch = Batch()
    for i, v in enumerate(variables):
        value = tf.convert_to_tensor(v)
        batch.submit(Collective.BROADCAST, [value], f"{name}.{i}{_label(v)}", [value.shape], root=int(root_rank))
    assigns = [v.assign(out[0]) for v, out in zip(variables, batch.collect())]
    if not tf.executing_eagerly():
        return tf.group(*assigns)
    return None


def broadcast_object(obj, root_rank: int = 0, session=None, name=None):
    """``obj`` of ``root_rank`` on every rank (any picklable object); ``session`` is ignored (TF1 only)."""
    return aiacc.broadcast_object(obj, root_rank, name=name)


def allgather_object(obj, session=None, name=None):
    """A list with every rank's ``obj``, in rank order; ``session`` is ignored (TF1 only)."""
    return aiacc.allgather_object(obj, name=name)
