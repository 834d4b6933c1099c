"""aiacc.tensorflow: Horovod's TensorFlow 2 API on aiacc's engine (TensorFlow >= 2.16 included).

    import tensorflow as tf
    import aiacc.tensorflow as hvd

    hvd.init()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    hvd.broadcast_variables(model.variables, root_rank=0)   # after the variables exist

Launch with ``aiaccrun -np N python train.py``. Every collective works eagerly and in graphs (``tf.function``
and TF1-style ``Session`` graphs; not inside XLA-compiled code), takes ``process_set=``, and is
differentiable; errors are the TensorFlow classes Horovod raises (``tf.errors.FailedPreconditionError``
for a mismatch across ranks, which is also an ``hvd.TensorMismatchError``). Inside ``tf.function``,
``DistributedGradientTape`` hands each gradient to the engine as soon as TensorFlow has computed it. With
``AIACC_ENABLE`` unset or 0 this is a job of one rank and ``DistributedGradientTape`` returns the tape it
is given. Keras 3 users: ``import aiacc.keras as hvd`` (see :mod:`aiacc.tensorflow.keras`).

``op=Adasum`` reduces floating-point CPU tensors in ``allreduce``, and gradients in
``DistributedGradientTape`` and Keras' ``DistributedOptimizer`` (each gradient on its own, as Horovod's
TensorFlow 2 wrappers do). ``hvd.SyncBatchNormalization`` is the Keras layer of :mod:`aiacc.keras`.
``DistributedOptimizer`` takes a TF1 ``tf.compat.v1.train.Optimizer`` (its ``compute_gradients`` averages)
or a Keras optimizer (:mod:`aiacc.keras`'s), as Horovod's; ``BroadcastGlobalVariablesHook`` is Horovod's TF1
session hook. Not provided: ``backward_passes_per_step`` for TF1 optimizers, elasticity itself
(``hvd.elastic`` has Horovod's state objects, for jobs that keep their ranks; see :mod:`aiacc.elastic`).
"""

import tensorflow as _tf

from aiacc import (Adasum, AiaccError, ConfigError, DuplicateNameError, InvalidArgumentError, NotInitializedError,
                   ProcessSet, ShutdownError, StallError, TensorMismatchError, add_process_set, barrier, cross_rank,
                   cross_size, global_process_set, init, is_enabled, is_homogeneous, is_initialized, local_rank,
                   local_size, mpi_threads_supported, rank, remove_process_set, shutdown, size, start_timeline,
                   stop_timeline, summary)
from aiacc.build_info import (ccl_built, ddl_built, gloo_built, gloo_enabled, gpu_available, mpi_built,
                              mpi_enabled, rocm_built)
from aiacc.exceptions import HorovodInternalError
from aiacc.ops import Average, Max, Min, Product, ReduceOp, Sum

from . import elastic
from .compression import Compression
from .functions import (allgather_object, broadcast_global_variables, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .gradients import DistributedGradientTape, PartialDistributedGradientTape
from .optimizer import BroadcastGlobalVariablesHook, DistributedOptimizer
from .mpi_ops import (allgather, allreduce, alltoall, broadcast, broadcast_, grouped_allgather, grouped_allreduce,
                      grouped_reducescatter, join, local_rank_op, local_size_op, process_set_included_op, rank_op,
                      reducescatter, size_op)


def nccl_built() -> int:
    """0: TensorFlow's GPU tensors reach aiacc through host memory, NCCL never carries them."""
    return 0


def cuda_built() -> bool:
    """False: aiacc.tensorflow communicates through host memory (GPU tensors are copied to it)."""
    return False


def _executing_eagerly() -> bool:
    """Horovod's ``hvd._executing_eagerly``: TensorFlow's eager mode."""
    return _tf.executing_eagerly()


def __getattr__(name: str):
    # Horovod's hvd.SyncBatchNormalization (a Keras layer): Keras loads only when a script asks for it
    if name == "SyncBatchNormalization":
        from .keras import _keras2  # noqa: PLC0415

        if _keras2.tf_keras_is_keras2():  # Keras 2 (TF_USE_LEGACY_KERAS=1): tf.keras' layer, as Horovod's
            return _keras2.sync_batch_normalization()
        from .keras._sync_bn import SyncBatchNormalization  # noqa: PLC0415

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "is_enabled", "rank", "size", "local_rank", "local_size",
    "start_timeline", "stop_timeline", "DistributedOptimizer", "BroadcastGlobalVariablesHook",
    "cross_rank", "cross_size", "is_homogeneous", "summary", "mpi_threads_supported", "mpi_built", "mpi_enabled",
    "gloo_built", "gloo_enabled",
    "nccl_built", "gpu_available", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "barrier", "join",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "size_op", "local_size_op", "rank_op", "local_rank_op",
    "process_set_included_op", "broadcast_variables", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "allgather_object", "DistributedGradientTape", "PartialDistributedGradientTape",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set", "elastic",
    "Compression", "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "AiaccError", "HorovodInternalError", "ConfigError", "NotInitializedError", "TensorMismatchError",
    "InvalidArgumentError", "DuplicateNameError", "StallError", "ShutdownError",
]
