"""aiacc.mxnet: Horovod's MXNet API on aiacc's engine (Apache MXNet 1.9.1).

    import aiacc.mxnet as hvd

    hvd.init()
    net.initialize(ctx=mx.cpu())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    ...
    loss.backward()
    trainer.step(batch_size)            # gradients averaged across ranks, overlapped with backward

and launch with ``aiaccrun -np 2 python train.py``.

What it offers: ``init``, ``shutdown``, ``rank``, ``size``, ``local_rank``, ``local_size``,
``cross_rank``, ``cross_size``; NDArray collectives ``allreduce`` / ``allreduce_``,
``grouped_allreduce`` / ``grouped_allreduce_``, ``allgather``, ``grouped_allgather``,
``broadcast`` / ``broadcast_``, ``alltoall``, ``reducescatter``, ``grouped_reducescatter``;
process sets (``ProcessSet``, ``add_process_set``, ``remove_process_set``,
``global_process_set``; ``process_set=`` on every collective and on ``DistributedTrainer`` /
``DistributedOptimizer``); ``broadcast_parameters`` (Gluon ``ParameterDict`` or dict),
``broadcast_object`` / ``allgather_object``; ``DistributedTrainer`` (a ``gluon.Trainer``
reducing through the engine instead of a kvstore) and ``DistributedOptimizer`` (Module API);
Horovod's build queries (``mpi_built``, ``nccl_built``, ...). With ``AIACC_ENABLE`` unset or 0
the trainer is a plain ``gluon.Trainer`` and ``DistributedOptimizer(opt)`` returns ``opt``.

NDArrays reach the engine as numpy views of MXNet's own memory (DLPack), and
results are written back in place; see :mod:`aiacc.mxnet.tensors`. CPU
NDArrays only (the MXNet wheel here is a CPU build). ``DistributedTrainer``
keeps the gradients in the core's gradient buckets (each ``Parameter``'s
gradient NDArray is a view of its bucket) and overlaps communication with
backward: MXNet's dependency engine calls back the moment a bucket's
gradients are final and the bucket is submitted right there, one request
(:mod:`aiacc.mxnet.gradients`). The NDArray collectives return finished
results (Horovod's are queued in MXNet's engine instead).

numpy compatibility: MXNet 1.9.1 (the last release) refers to ``numpy.bool``,
an alias numpy 1.24 removed, so ``import mxnet`` fails with numpy 1.26.
Importing this package restores ``numpy.bool = bool`` (the builtin it aliased,
and the only removed alias MXNet needs at import or run time) before it
imports MXNet, and only if numpy lacks it. Import ``aiacc.mxnet`` before
``mxnet``, or set the alias yourself first, or run a script that imports
``mxnet`` first with ``python -m aiacc.mxnet SCRIPT ARGS`` (``__main__.py``).
"""

import numpy as _np

if "bool" not in _np.__dict__:  # numpy >= 1.24 removed the alias; numpy 2 brought np.bool back
    _np.bool = bool

import mxnet as _mx  # noqa: E402,F401 - after the numpy fix above

from aiacc import (  # noqa: E402
    Adasum, Average, ProcessSet, add_process_set, global_process_set, remove_process_set, Compression, Max, Min,
    Product, Sum, allgather_object, barrier, broadcast_object, cross_rank, cross_size, init, is_enabled,
    is_homogeneous, is_initialized, join, local_rank, local_size, mpi_threads_supported, rank, shutdown, size,
    start_timeline, stop_timeline, summary)
from aiacc.build_info import (  # noqa: E402
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    gpu_available,
    mpi_built,
    mpi_enabled,
    rocm_built,
)
from aiacc.exceptions import (  # noqa: E402
    AiaccError,
    DuplicateNameError,
    InvalidArgumentError,
    NotInitializedError,
    ShutdownError,
    StallError,
    TensorMismatchError,
)

from .mpi_ops import (  # noqa: E402
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from .optimizer import DistributedOptimizer, broadcast_parameters  # noqa: E402
from .trainer import DistributedTrainer  # noqa: E402
from . import elastic  # noqa: E402



def nccl_built() -> int:
    """0: aiacc.mxnet communicates CPU NDArrays only, so NCCL never carries MXNet's tensors."""
    return 0


def cuda_built() -> bool:
    """False: aiacc.mxnet communicates CPU NDArrays only (the MXNet wheel here is a CPU build)."""
    return False


__all__ = [
    "init", "shutdown", "is_initialized", "is_enabled", "rank", "size", "local_rank", "local_size",
    "start_timeline", "stop_timeline",
    "cross_rank", "cross_size", "is_homogeneous", "summary", "mpi_threads_supported", "mpi_built", "mpi_enabled",
    "gloo_built", "gloo_enabled",
    "nccl_built", "gpu_available", "cuda_built", "rocm_built", "ccl_built", "ddl_built",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather",
    "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "barrier", "join",
    "broadcast_object", "allgather_object", "elastic",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "broadcast_parameters", "DistributedOptimizer", "DistributedTrainer",
    "Compression", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "AiaccError", "NotInitializedError", "TensorMismatchError", "InvalidArgumentError", "DuplicateNameError",
    "StallError", "ShutdownError",
]
