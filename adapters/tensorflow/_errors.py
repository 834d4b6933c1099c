"""The one place where the errors of aiacc's collectives become TensorFlow's error classes.

Horovod's TensorFlow ops fail with ``tf.errors.OpError`` subclasses, and scripts (and Horovod's tests)
catch those: a mismatch across ranks is a ``FailedPreconditionError``, a bad argument an
``InvalidArgumentError``, a shut-down engine an ``UnknownError``. aiacc's core raises its own classes
(:mod:`aiacc.exceptions`). Eagerly, :func:`to_tf` turns one into an exception of a class that is both: the
TensorFlow class Horovod raises *and* the core's class (``except hvd.TensorMismatchError`` and ``except
tf.errors.FailedPreconditionError`` both catch a mismatch), with the core's message. Inside a graph, a
Python exception can only leave a ``numpy_function`` as ``InvalidArgumentError`` (ValueError, TypeError),
``UnimplementedError`` or ``UnknownError`` (TensorFlow's py_func maps classes, not codes): there
:func:`code_and_message` gives the status that ``_graph`` makes the op fail with.

Which class (Horovod's ``ConvertStatus`` of its ``Status`` types):

=======================================================  =====================================
core exception                                           TensorFlow class
=======================================================  =====================================
TensorMismatchError (shape, dtype, op, root differ),     FailedPreconditionError
NotInitializedError
InvalidArgumentError, DuplicateNameError, ValueError,    InvalidArgumentError
TypeError (arguments a collective cannot run with)
NotImplementedError (op=Adasum)                          UnimplementedError
ShutdownError, StallError, other AiaccError              UnknownError
=======================================================  =====================================
"""

from __future__ import annotations

import functools
from typing import Tuple

import tensorflow as tf

from aiacc.exceptions import AiaccError, NotInitializedError, TensorMismatchError

__all__ = ["to_tf", "code_and_message", "tf_class_of"]


def tf_class_of(exc: BaseException):
    """The ``tf.errors.OpError`` subclass Horovod raises for ``exc`` (None: leave ``exc`` as it is)."""
    if isinstance(exc, tf.errors.OpError):
        return None
    if isinstance(exc, (TensorMismatchError, NotInitializedError)):
        return tf.errors.FailedPreconditionError
    if isinstance(exc, (ValueError, TypeError)):
        return tf.errors.InvalidArgumentError
    if isinstance(exc, NotImplementedError):
        return tf.errors.UnimplementedError
    if isinstance(exc, AiaccError):
        return tf.errors.UnknownError
    return None


@functools.lru_cache(maxsize=None)
def _both(tf_class: type, core_class: type) -> type:
    """``class <core name>(tf_class, core_class)``: caught as either."""
    def __reduce__(self):  # pickles as the plain TensorFlow error (the class is made at run time)
        return tf_class, (None, None, self.message)

    return type(core_class.__name__, (tf_class, core_class), {"__module__": __name__, "__reduce__": __reduce__})


def to_tf(exc: BaseException) -> BaseException:
    """``exc`` as the TensorFlow error Horovod would raise, still an instance of ``exc``'s own class (so
    existing ``except`` clauses keep working); ``exc`` itself when no TensorFlow class applies."""
    tf_class = tf_class_of(exc)
    if tf_class is None:
        return exc
    converted = _both(tf_class, type(exc))(None, None, str(exc))
    converted.__dict__.update({k: v for k, v in vars(exc).items() if not k.startswith("_")})
    return converted


def code_and_message(exc: BaseException) -> Tuple[int, str]:
    """(TensorFlow error code, message) for a graph op that fails with ``exc``."""
    if isinstance(exc, tf.errors.OpError):
        return int(exc.error_code), exc.message
    tf_class = tf_class_of(exc) or tf.errors.UnknownError
    message = str(exc) if tf_class_of(exc) is not None else f"{type(exc).__name__}: {exc}"
    return int(tf_class(None, None, "").error_code), message
