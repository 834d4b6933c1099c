"""Elastic misuse in TensorFlow that a restart would meet again: ``TensorFlowState()`` without variables in eager
mode (it held tf.compat.v1.global_variables(), empty there: a restart resumed with untrained weights) is an
error at once; ``state.commit()`` inside a ``tf.function`` ends the job without restarts (autograph wrapped the
ElasticStateError in a StagingError, and ``aiaccrun --max-restarts`` started the job again for nothing).
Usage: tf_elastic_misuse.py"""

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

import aiacc.tensorflow as hvd  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r = hvd.rank()
raises(hvd.elastic.ElasticStateError, lambda: hvd.elastic.TensorFlowState(step=0), "global_variables(), which is "
       "empty in eager mode", "variables=model.variables + optimizer.variables")
w = tf.Variable(np.ones(3, np.float32))
state = hvd.elastic.TensorFlowState(variables=[w], step=0)
say(f"CHECKED rank={r} restarts={hvd.elastic.restart_count()}")


@tf.function
def step():
    w.assign_add(hvd.allreduce(tf.ones(3), name="g"))
    state.commit()


@hvd.elastic.run
def train(state):
    step()


train(state)
