"""aiacc.torch: Horovod's PyTorch API over aiacc's engine.

A Horovod script runs with only its import changed::

    import aiacc.torch as hvd

    hvd.init()
    torch.set_num_threads(1)  # one rank per core or GPU
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in shard_of_my_rank:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # each gradient is sent as soon as autograd produces it
        optimizer.step()                  # waits for the averaged gradients, then updates

and is launched with ``aiaccrun -np 2 python train.py``. With ``AIACC_ENABLE``
unset or 0, ``DistributedOptimizer`` returns the optimizer it was given and
the broadcasts do nothing: the script trains alone, unchanged.

CPU tensors are handed to the engine as numpy views, CUDA tensors as cupy
arrays through DLPack (reduced with NCCL; ``pip install 'aiacc[gpu]'``); no
copies either way. ``op=Adasum`` reduces CPU tensors (``aiacc/adasum.py``), and
``DistributedOptimizer(op=Adasum)`` is Horovod's Adasum optimizer (``adasum.py``). ``hvd.elastic``: Horovod's state API with restart-based recovery
(``aiaccrun --max-restarts N --elastic-dir DIR``, see ``aiacc/elastic.py``).

``SyncBatchNorm`` is Horovod's (statistics of the global batch); ``import aiacc.torch`` also registers
the ``aiacc`` backend of torch.distributed (``dist.init_process_group("aiacc")``, see ``backend.py``).
"""

from aiacc.exceptions import HorovodInternalError
from aiacc import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
    AiaccError,
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    TensorMismatchError,
    cross_rank,
    cross_size,
    init,
    is_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    summary,
)

from aiacc.build_info import (ccl_built, ddl_built, gloo_built, gloo_enabled, gpu_available, mpi_built,
                              mpi_enabled, rocm_built)

from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    Handle,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    sparse_allreduce_async,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from . import elastic
from .sync_batch_norm import SyncBatchNorm
from . import backend as _backend

_backend.register()  # dist.init_process_group("aiacc") (aiacc/torch/backend.py)


def nccl_built() -> int:
    """NCCL's version number when cupy's NCCL bindings can be loaded (CUDA tensors go over NCCL), else 0."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415

        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - no cupy, no NCCL library
        return 0


def cuda_built() -> bool:
    """True when CUDA tensors can be communicated (cupy installed and a GPU visible)."""
    from aiacc.transport.nccl import cupy_or_none  # noqa: PLC0415

    return cupy_or_none() is not None


__all__ = [
    "SyncBatchNorm", "elastic",
    "init", "shutdown", "is_initialized", "is_enabled", "rank", "size", "local_rank", "local_size",
    "start_timeline", "stop_timeline",
    "cross_rank", "cross_size", "is_homogeneous", "summary", "mpi_threads_supported", "mpi_built", "mpi_enabled",
    "gloo_built", "gloo_enabled",
    "nccl_built", "gpu_available", "cuda_built", "rocm_built", "ccl_built", "ddl_built", "sparse_allreduce_async",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_allgather",
    "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "synchronize", "poll", "barrier", "join", "Handle",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "Compression", "ReduceOp", "Average", "Sum", "Min", "Max", "Product",
    "AiaccError", "HorovodInternalError", "TensorMismatchError", "Adasum",
]
