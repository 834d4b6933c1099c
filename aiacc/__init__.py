"""aiacc: fast data-parallel training for PyTorch, TensorFlow 2 / Keras 3 and MXNet.

This package is the framework-free core (numpy + mpi4py). Framework users
import an adapter instead: ``import aiacc.torch as hvd``,
``import aiacc.tensorflow as hvd``, ``import aiacc.keras as hvd`` or
``import aiacc.mxnet as hvd``; each speaks Horovod's API.

Importing aiacc does no work: no MPI, no threads, no files. ``init()``
starts the engine when ``AIACC_ENABLE=1`` (``aiaccrun`` sets it).
"""

from .api import (
    add_process_set,
    check_root,
    engine_for,
    gradient_engine,
    outside_process_set,
    set_rank,
    set_size,
    switched_off,
    process_set_by_id,
    remove_process_set,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    allreduce_,
    allreduce_async_,
    grouped_allreduce_,
    grouped_allreduce_async_,
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    cross_rank,
    cross_size,
    get_engine,
    grouped_allreduce,
    grouped_allreduce_async,
    init,
    is_enabled,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_threads_supported,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    submit,
    submit_allreduce,
    summary,
    synchronize,
    synchronize_all,
)
from .compression import Compression
from .objects import (allgather_object, average_factors, broadcast_object, check_groups, check_same_keys,
                      gradient_factors)
from .exceptions import (
    AiaccError,
    ConfigError,
    DuplicateNameError,
    InvalidArgumentError,
    NotInitializedError,
    ShutdownError,
    StallError,
    TensorMismatchError,
)
from .ops import Adasum, Average, Collective, Max, Min, Product, ReduceOp, Sum
from .process_sets import ProcessSet, global_process_set

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "is_enabled", "rank", "size", "local_rank", "local_size",
    "start_timeline", "stop_timeline",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_allreduce_", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_async", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "synchronize", "synchronize_all", "poll",
    "submit", "submit_allreduce", "summary", "get_engine", "engine_for", "outside_process_set", "gradient_engine",
    "switched_off",
    "set_size", "set_rank", "check_root", "process_set_by_id", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "broadcast_object", "allgather_object", "check_same_keys", "average_factors",
    "gradient_factors", "check_groups",
    "Compression", "ReduceOp", "Collective", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "AiaccError", "ConfigError", "NotInitializedError", "TensorMismatchError", "InvalidArgumentError",
    "DuplicateNameError",
    "StallError", "ShutdownError",
]
