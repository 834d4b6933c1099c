"""An embedding table that no rank looks up in a step costs ~nothing on the wire once a step has shown that no rank had
its gradient, and every pattern still trains as one process on the global batch.

A Dense(1) over 3 features beside an Embedding(VOCAB, WIDTH) of 2 ids per row (float32, 4096 x 64: 1 MiB), against
one process whose loss has the embedding's term on rank 0's rows only where rank 0 alone looks it up. Per step, who
looks it up (``PHASES``): no rank, rank 0 only, every rank; ``dense``: rank 0 only, densely (one_hot @ table: a dense
gradient on rank 0, None on rank 1). Scenarios, each against one process (Adam, and SGD with momentum: a variable
stepped on zeros instead of skipped moves under momentum):

- ``tape`` / ``keras``: DistributedGradientTape eagerly, Keras' DistributedOptimizer in a custom loop: unused for
  three steps, then on rank 0 only, on none, dense on rank 0, on every rank, on none;
  ``tape`` also asserts that the steps in which no rank looks it up after the first send fewer than ``BOUND``
  bytes in allreduces (the Dense layer's gradients, the buckets' presence elements and alignment: far below the
  table's 1 MiB, which main sent every such step as zeros) and no rows in allgathers;
- ``function``: in tf.function (None-ness fixed when traced): unused, unused, every rank, unused.

``measure``: rank 0 prints the allreduce bytes and allgathers of each step (the figures of the README). Usage:
tf_unused_sparse.py [scenario ...] (default: tape keras function).
"""

import sys
import warnings

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc  # noqa: E402
import aiacc.tensorflow as hvd  # noqa: E402
import aiacc.tensorflow.keras as hvd_keras  # noqa: E402
from one_process import Checks  # noqa: E402
from report import say  # noqa: E402

warnings.filterwarnings("ignore", message="Gradients do not exist")  # Keras' warning for the skipped embedding
hvd.init()
r, n = hvd.rank(), hvd.size()
VOCAB, WIDTH, PART = 4096, 64, 4
B = PART * n
TABLE = VOCAB * WIDTH * 4
# bytes per step in allreduces when no rank looks the table up: the Dense layer's 4 floats and the presence elements
# of its bucket, each aligned to 64 bytes, well under 1 KiB; the table alone is 1 MiB
BOUND = 1024
STEPS = 10
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS, B, 3)).astype(np.float32)
IDS = rng.integers(0, VOCAB, size=(STEPS, B, 2)).astype(np.int32)
Y = rng.normal(size=(STEPS, B, 1)).astype(np.float32)
mine = slice(r * PART, (r + 1) * PART)
scenarios = sys.argv[1:] or ["tape", "keras", "function"]
checks = Checks()


def model():
    keras.utils.set_random_seed(1)
    emb, dense = keras.layers.Embedding(VOCAB, WIDTH), keras.layers.Dense(1)
    emb.build((None, 2))
    dense.build((None, 3))
    return emb, dense


def output(emb, dense, x, ids, phase, dist):
    """dense(x) plus the sum of the rows looked up; ``phase``: who looks up (one process: rank 0's rows only where
    rank 0 alone does; ``dense``: rank 0, through one_hot @ table)."""
    out = dense(x)
    if phase == "dall":  # (measure: dense on every rank)
        return out + tf.reduce_sum(tf.matmul(tf.one_hot(ids, VOCAB), emb.embeddings), axis=[1, 2])[:, None]
    if phase == "none" or (dist and phase in ("one", "dense") and r != 0):
        return out
    rows = ids[:PART] if not dist and phase in ("one", "dense") else ids
    if phase == "dense":
        term = tf.reduce_sum(tf.matmul(tf.one_hot(rows, VOCAB), emb.embeddings), axis=[1, 2])[:, None]
    else:
        term = tf.reduce_sum(emb(rows), axis=[1, 2])[:, None]
    if not dist and phase in ("one", "dense"):
        term = tf.concat([term, tf.zeros([B - PART, 1])], 0)
    return out + term


def sent():
    s = aiacc.summary()
    return s["allreduce_bytes"], s["allgather"]


def loop(dist, how, phases, optimizer, tag="", per_step=None):
    emb, dense = model()
    opt = keras.optimizers.Adam(0.05) if optimizer == "adam" else keras.optimizers.SGD(0.1, momentum=0.9)
    if dist and how == "keras":
        opt = hvd_keras.DistributedOptimizer(opt, name=f"unused_sparse.opt{tag}")
    every = emb.trainable_variables + dense.trainable_variables

    def step(x, ids, y, phase):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((output(emb, dense, x, ids, phase, dist) - y) ** 2)
        if dist and how != "keras":
            tape = hvd.DistributedGradientTape(tape, name=f"unused_sparse.{how}{tag}")
        grads = tape.gradient(loss, every)
        if dist and how == "tape":  # None where no rank looked it up (the optimizer skips it, as one process)
            assert (grads[0] is None) == (phase == "none"), (phase, grads[0])
            gathered.append(int(grads[0].values.shape[0]) if isinstance(grads[0], tf.IndexedSlices) else 0)
        opt.apply_gradients(zip(grads, every))

    fn = tf.function(step) if how == "function" else step
    gathered = []  # per step: the rows of the table's gradient (IndexedSlices) every rank received
    for k, phase in enumerate(phases):
        rows = mine if dist else slice(None)
        before = sent() if dist else None
        fn(tf.constant(X[k][rows]), tf.constant(IDS[k][rows]), tf.constant(Y[k][rows]), phase)
        if per_step is not None and dist:
            after = sent()
            per_step.append((phase, after[0] - before[0], after[1] - before[1], gathered[-1] if gathered else 0))
    return every


PHASES = ["none", "none", "none", "one", "none", "dense", "all", "none"]
for how in ("tape", "keras"):
    if how not in scenarios:
        continue
    for optimizer in ("adam", "sgd"):
        per_step = []
        got = loop(True, how, PHASES, optimizer, f".{optimizer}", per_step)
        checks.close(f"{how} {optimizer}", loop(False, how, PHASES, optimizer), got)
        if how == "tape":  # after the first step: the table's None costs no more than the Dense layer's bytes
            for k, (phase, nbytes, _, rows) in enumerate(per_step):
                if phase == "none" and k > 0:
                    assert nbytes < BOUND, f"{how} {optimizer} step {k}: {nbytes} bytes in allreduces (bound {BOUND})"
                    assert rows == 0, (k, rows)
            checks.count += 1
if "function" in scenarios:
    traced = ["none", "none", "all", "none"]
    per_step = []
    got = loop(True, "function", traced, "sgd", per_step=per_step)
    checks.close("tf.function", loop(False, "function", traced, "sgd"), got)
    assert per_step[1][1] < BOUND, f"tf.function step 1: {per_step[1][1]} bytes in allreduces (bound {BOUND})"
    checks.count += 1
if "measure" in scenarios:
    for name, phases in (("unused", ["none"] * 4), ("rank 0 only", ["one"] * 4), ("every rank", ["all"] * 4),
                         ("unused, then rank 0 only", ["none"] * 3 + ["one"] * 3),
                         ("unused, then dense on every rank", ["none"] * 2 + ["dall"] * 3)):
        per_step = []
        loop(True, "tape", phases, "adam", f".m{len(name)}{name[:3]}",
             per_step)
        if r == 0:
            say(f"MEASURE {name}: " + "; ".join(f"{p} {b} B allreduce, {g} allgathers of {rows} rows" for p, b, g, rows in per_step))

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
