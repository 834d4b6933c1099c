"""``SyncBatchNormalization``: Keras 3 batch normalization with the statistics of the global batch."""

import keras
import tensorflow as tf

import aiacc
from aiacc.tensorflow import Sum, allreduce, global_process_set


@keras.saving.register_keras_serializable(package="aiacc")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics are those of the global batch across the
    ranks (of ``process_set``): one allreduce of the per-channel sum, sum of squares and row count per
    forward, differentiable (its gradient is the allreduce of the gradients), so outputs, gradients and the
    moving statistics equal those of one BatchNormalization over the global batch. Per-rank batch sizes may
    differ. Keras's own ``synchronized=True`` reduces through a ``tf.distribute`` strategy; this one through
    aiacc. Masks are not supported (an error says so); in inference, or in a job of one rank, it is the
    plain layer."""

    def __init__(self, *args, process_set=global_process_set, **kwargs):
        backend = keras.backend.backend()
        if backend != "tensorflow":  # (its statistics are reduced with TensorFlow ops)
            raise NotImplementedError(f"SyncBatchNormalization: works on Keras' TensorFlow backend, not {backend!r} "
                                      "(KERAS_BACKEND); use keras.layers.BatchNormalization (statistics per rank)")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization: synchronized=True is Keras's tf.distribute reduction; "
                             "leave it unset (this layer synchronizes through aiacc)")
        if kwargs.get("renorm"):
            raise ValueError("SyncBatchNormalization: renorm=True is not supported")
        if kwargs.pop("fused", False) is not False:  # (Horovod's argument; Keras 3 has no fused kernel)
            raise ValueError("SyncBatchNormalization does not support fused=True (Horovod's rule); leave it False")
        super().__init__(*args, **kwargs)
        self.process_set = process_set

    def _moments(self, inputs, mask):
        ranks = aiacc.set_size(self.process_set)
        if ranks == 1:
            return super()._moments(inputs, mask)
        if mask is not None:
            raise ValueError(f"SyncBatchNormalization {self.name!r}: masked inputs are not supported")
        axes = self._reduction_axes
        x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        local = tf.concat([tf.reduce_sum(x, axes), tf.reduce_sum(tf.square(x), axes), tf.reshape(count, [1])], 0)
        total = allreduce(local, op=Sum, name=f"{self.name}.moments", process_set=self.process_set)
        channels = tf.shape(local)[0] // 2
        n = total[-1]
        mean = total[:channels] / n
        variance = tf.maximum(total[channels:2 * channels] / n - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
