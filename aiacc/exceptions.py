"""Errors raised by aiacc. Every message names what was wrong: the variable,
the tensor, the rank."""

__all__ = [
    "AiaccError",
    "HorovodInternalError",
    "ConfigError",
    "NotInitializedError",
    "TensorMismatchError",
    "InvalidArgumentError",
    "DuplicateNameError",
    "StallError",
    "ShutdownError",
    "MembersMissingError",
    "HostsUpdatedInterrupt",
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


class InvalidArgumentError(AiaccError, ValueError):
    """A collective was called with arguments it cannot run with (a 0-d tensor where rows are needed,
    alltoall splits that do not fit, a root out of range), found on the calling rank before anything
    is sent. A ValueError, and like every error of a collective an AiaccError (a RuntimeError):
    Horovod's MXNet ops raise these as ``MXNetError``, a RuntimeError."""


class DuplicateNameError(AiaccError, ValueError):
    """A tensor name was submitted again while the first one is still in flight."""


class StallError(AiaccError):
    """Some ranks never submitted a tensor that others are waiting for."""


class ShutdownError(AiaccError):
    """The engine was shut down (on this or another rank) before the operation completed."""


class MembersMissingError(AiaccError):
    """Members of a process set of its members only did not all come to make it within the timeout given
    (``missing``: their ranks in the job); nothing was made."""

    def __init__(self, message: str, missing=()):
        super().__init__(message)
        self.missing = list(missing)


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's ``horovod.common.exceptions.HostsUpdatedInterrupt(skip_sync)``, a RuntimeError as there. Horovod
    raises it from ``state.commit()`` when hosts joined or left; the ranks of an aiacc job stay the same within a
    start, so aiacc never raises it. A script that raises it inside ``hvd.elastic.run`` ends the start like any
    error: under ``aiaccrun --max-restarts N --elastic-dir DIR`` the job starts again and resumes from the last
    commit (Horovod resets the job without going back to the commit; ``skip_sync`` has no effect here)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the hosts of the job were updated (HostsUpdatedInterrupt)")
        self.skip_sync = skip_sync
