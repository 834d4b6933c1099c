"""Memory over a long run of tf.function training steps through DistributedGradientTape (each step runs
aiacc's graph ops: the gradients' submit, the wait, the status op). With UCX's mmap hooks installed (the
``mpich`` wheel's default) every Python function TensorFlow runs from a graph kept ~150 B for good, ~280 B a
step here; aiacc turns the hooks off before MPI loads (aiacc.transport.mpi).

Prints ``grown=<bytes per step> ucx=<the variable's value>`` and ``OK rank=<r>``. argv: [steps]
"""

import gc
import os
import sys

import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import aiacc.tensorflow as hvd  # noqa: E402

hvd.init()
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 4000


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


w = tf.Variable(tf.ones([8, 4]))
b = tf.Variable(tf.zeros([4]))
x = tf.fill([2, 8], float(hvd.rank() + 1))


@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(x, w) + b)
    grads = hvd.DistributedGradientTape(tape).gradient(loss, [w, b])
    w.assign_sub(1e-6 * grads[0])
    b.assign_sub(1e-6 * grads[1])


for _ in range(1500):  # tracing, tf.data's threads, the engine's pools: what a run holds from its start
    step()
gc.collect()
before = rss()
for _ in range(STEPS):
    step()
gc.collect()
grown = (rss() - before) / STEPS
# the averaged gradient of b: the mean over ranks of 2 * (rank + 1) ... d(loss)/db = 2 rows of ones
expected_b = -1e-6 * 2 * (1500 + STEPS)
assert abs(float(b[0]) - expected_b) < 1e-6, (float(b[0]), expected_b)
print(f"grown={grown:.1f} ucx={os.environ.get('UCX_MEM_MMAP_HOOK_MODE')} rank={hvd.rank()}", flush=True)
print(f"OK rank={hvd.rank()}", flush=True)
