"""DistributedGradientTape and the Keras DistributedOptimizer over a process set (3 ranks).

Sets {0, 2} and {1}: the tape on ranks 0 and 2 averages their gradients (dense, in buckets, and an
embedding's IndexedSlices, allgathered), eagerly and in tf.function; rank 1 runs the same tape with the
even set, which it is not in, and keeps its own gradients (Horovod's behaviour). The Keras optimizer on
the odd set (one rank) applies that rank's own gradients. Checks are counted.
"""

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
import aiacc.keras as hvd_keras  # noqa: E402
from report import say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 3
even = hvd.add_process_set([0, 2])
odd = hvd.add_process_set([1])
checks = 0

w = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
emb = tf.Variable(np.ones((5, 2), np.float32))


def grads_of(rank, tape_fn):
    x = tf.constant(np.full((4, 2), rank + 1.0, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(x, w)) * (rank + 1) + tf.reduce_sum(tf.gather(emb, [rank, rank + 1]))
    return tape_fn(tape).gradient(loss, [w, emb])


def dense(g):
    return tf.convert_to_tensor(g).numpy()


local = [dense(g) for g in grads_of(r, lambda t: t)]
if r in (0, 2):
    per_rank = [[dense(g) for g in grads_of(k, lambda t: t)] for k in (0, 2)]
    mine_or_avg = [(a + b) / 2 for a, b in zip(*per_rank)]
else:
    mine_or_avg = local
for mode in ("eager", "tf.function"):
    fn = (lambda: grads_of(r, lambda t: hvd.DistributedGradientTape(t, process_set=even, name=f"ps.{mode}")))
    got = fn() if mode == "eager" else tf.function(fn)()
    for g, ref in zip(got, mine_or_avg):
        assert np.allclose(dense(g), ref), (mode, r, dense(g), ref)
        checks += 1
# Keras optimizer on the odd set: rank 1 alone (its own gradients); the even ranks are outside it
opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.5), process_set=odd, name="ps.keras")
v = tf.Variable(np.zeros(3, np.float32))
opt.apply([tf.constant(np.full(3, r + 1.0, np.float32))], [v])
assert np.allclose(v.numpy(), -0.5 * (r + 1)), (r, v.numpy())  # every rank: its own gradient
checks += 1
# overlapping sets, a tape without name= on each, in one tf.function: rank 1 has two; its second was numbered
# 'DistributedGradientTape#1' per trace, rank 2's only one on that set not (they waited 60 s, then an error)
pairs = [hvd.add_process_set([0, 1]), hvd.add_process_set([1, 2])]
pair_vars = [(ps, tf.Variable(np.ones(3))) for ps in pairs if ps.included()]


@tf.function
def pair_step():
    for ps, var in pair_vars:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * float(r + 1))
        var.assign_sub(0.1 * hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [var])[0])


pair_step()
for ps, var in pair_vars:  # the set's average of (rank + 1)
    assert np.allclose(var.numpy(), 1 - 0.1 * np.mean([k + 1 for k in ps.ranks])), (ps.ranks, var.numpy())
checks += 1
hvd.barrier()
say(f"OK rank={r} checks={checks}")
