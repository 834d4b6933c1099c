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

Launch with ``aiaccrun -np N python train.py``. Every collective works eagerly and inside
``tf.function`` (not inside XLA-compiled code), and is differentiable. Inside ``tf.function``,
``DistributedGradientTape`` hands each gradient to the engine as soon as TensorFlow has computed it.
With ``AIACC_ENABLE`` unset or 0 this is a job of one rank and ``DistributedGradientTape`` returns the
tape it is given. Keras 3 users: ``import aiacc.keras as hvd`` (see :mod:`aiacc.tensorflow.keras`).
"""

from aiacc import (AiaccError, ConfigError, DuplicateNameError, NotInitializedError, ShutdownError, StallError,
                   TensorMismatchError, barrier, cross_rank, cross_size, init, is_enabled, is_initialized, join,
                   local_rank, local_size, mpi_threads_supported, rank, shutdown, size)
from aiacc.compression import Compression
from aiacc.ops import Average, Max, Min, Product, ReduceOp, Sum

from .functions import allgather_object, broadcast_object, broadcast_variables
from .gradients import DistributedGradientTape
from .mpi_ops import allgather, allreduce, alltoall, broadcast, grouped_allreduce, reducescatter

__all__ = [
    "init", "shutdown", "is_initialized", "is_enabled", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_threads_supported", "barrier", "join",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
    "broadcast_variables", "broadcast_object", "allgather_object", "DistributedGradientTape",
    "Compression", "ReduceOp", "Average", "Sum", "Min", "Max", "Product",
    "AiaccError", "ConfigError", "NotInitializedError", "TensorMismatchError", "DuplicateNameError",
    "StallError", "ShutdownError",
]
