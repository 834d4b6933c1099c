"""Errors raised by aiacc. Every message names what was wrong: the variable,
the tensor, the rank."""

__all__ = [
    "AiaccError",
    "HorovodInternalError",
    "ConfigError",
    "NotInitializedError",
    "TensorMismatchError",
    "DuplicateNameError",
    "StallError",
    "ShutdownError",
]


class AiaccError(RuntimeError):
    """Base class of aiacc's errors (the counterpart of Horovod's ``HorovodInternalError``)."""


# Horovod's name for the errors of its engine: scripts that catch it catch aiacc's.
HorovodInternalError = AiaccError


class ConfigError(AiaccError, ValueError):
    """An ``AIACC_*`` variable or a flag has a value aiacc does not accept."""


class NotInitializedError(AiaccError, ValueError):
    """A collective or query was called before ``init()`` (or after ``shutdown()``)."""


class TensorMismatchError(AiaccError, ValueError):
    """Ranks submitted the same tensor name with different shape, dtype, op or root."""


class DuplicateNameError(AiaccError, ValueError):
    """A tensor name was submitted again while the first one is still in flight."""


class StallError(AiaccError):
    """Some ranks never submitted a tensor that others are waiting for."""


class ShutdownError(AiaccError):
    """The engine was shut down (on this or another rank) before the operation completed."""
