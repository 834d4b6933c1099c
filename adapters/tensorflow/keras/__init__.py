"""aiacc.keras (also ``aiacc.tensorflow.keras``): Horovod's Keras API for Keras 3, on Keras' TensorFlow,
PyTorch and JAX backends (``KERAS_BACKEND=torch``: gradients handed to buckets during backward, see
``_torch_buckets``; ``jax``: averaged through one host callback per step, see ``_optimizer``; TensorFlow stays
installed, the engine's bridge is TensorFlow's).

    import keras
    import aiacc.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_shard, y_shard, epochs=10, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=1e-3 * hvd.size(), warmup_epochs=3),
    ], verbose=1 if hvd.rank() == 0 else 0)

``model.fit`` runs unchanged: the wrapped optimizer averages the gradients before every update, handing
each to the engine as soon as TensorFlow has computed it. XLA (``jit_compile=True``) cannot call into
aiacc on TensorFlow's backend: compile with ``jit_compile=False`` where Keras would pick XLA (machines with
a GPU); on JAX's backend the compiled step calls out to aiacc through a host callback. With
``AIACC_ENABLE`` unset or 0, ``DistributedOptimizer`` returns the optimizer it is given.
The collectives take Horovod's Keras arguments (``allreduce(value, name, average, ...)``) and, on the PyTorch and
JAX backends, the backend's tensors in and out (see ``_collectives``).
"""

from aiacc.tensorflow import (Adasum, Average, Compression, Max, Min, Product, ProcessSet, ReduceOp, Sum,
                              add_process_set, allgather_object, barrier, broadcast_global_variables, broadcast_object,
                              broadcast_variables, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                              gloo_enabled, global_process_set, init, is_enabled, is_homogeneous, is_initialized, join,
                              local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                              remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline, summary)

from ._collectives import (allgather, allreduce, alltoall, broadcast, broadcast_, grouped_allgather, grouped_allreduce,
                           grouped_reducescatter, reducescatter)
from . import callbacks, elastic
from ._optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from ._sync_bn import SyncBatchNormalization
from .callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback, LearningRateWarmupCallback,
                        MetricAverageCallback)

__all__ = [
    "init", "shutdown", "is_initialized", "is_enabled", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "summary", "mpi_threads_supported", "mpi_built", "mpi_enabled",
    "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "barrier", "join",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "broadcast_variables", "broadcast_global_variables",
    "broadcast_object", "allgather_object", "ProcessSet", "add_process_set", "remove_process_set",
    "global_process_set", "DistributedOptimizer", "PartialDistributedOptimizer", "callbacks", "elastic", "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback", "LearningRateWarmupCallback", "LearningRateScheduleCallback", "Compression", "ReduceOp", "Average", "Sum", "Min", "Max",
    "Product", "Adasum", "SyncBatchNormalization", "start_timeline", "stop_timeline", "load_model",
]
