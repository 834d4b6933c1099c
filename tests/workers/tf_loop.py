"""A custom training loop with DistributedGradientTape: 2 or more ranks on a share of every batch against one model
trained on the whole batch, inside tf.function and eagerly, with an embedding (IndexedSlices gradients)
both gathered and densified. Then broadcast_variables; a backprop holding stateful ops (an aiacc
collective's gradient, a side effect) trained in tf.function exactly as eagerly; results that are views
of the gradient buckets (zero copy), kept intact when held across steps; and steps of a larger model for
the timeline (the test reads it to see buckets sent while later gradients were still being computed),
whose traced graph must make every gradient wait for the submit of the one before it. That model's
backprop takes about 2.5 ms per hidden layer, 20 ms per step, on this 2-core machine when idle; with one
inter-op thread, as the top of this file sets, TensorFlow's executor used to leave the weight gradients,
and so every submit, to the end of it (see aiacc.tensorflow._ordering).

argv: [steps of the timeline model]
"""

import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
from aiacc.tensorflow import _buckets  # noqa: E402
from report import say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
STEPS, VOCAB, SEQ = 20, 40, 5
part = 8  # each rank's rows of every global batch
BATCH = part * n
checks = 0

rng = np.random.default_rng(0)
X = rng.integers(0, VOCAB, size=(STEPS, BATCH, SEQ)).astype(np.int32)
Y = rng.integers(0, 3, size=(STEPS, BATCH)).astype(np.int32)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((SEQ,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])


def make_step(model, opt, distributed, densify, **tape_args):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if distributed:
            tape = hvd.DistributedGradientTape(tape, **tape_args)
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:  # Adam updates only the rows present in IndexedSlices, every row of a dense gradient
            grads = [tf.convert_to_tensor(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def train(distributed, compiled, densify=False, lr=0.01, optimizer=keras.optimizers.Adam, **tape_args):
    model = build(0)
    opt = optimizer(lr)
    step = make_step(model, opt, distributed, densify, **tape_args)
    if compiled:
        step = tf.function(step)
    for s in range(STEPS):
        if distributed:
            x, y = X[s, r * part:(r + 1) * part], Y[s, r * part:(r + 1) * part]
        else:
            x, y = X[s], Y[s]
        step(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in model.trainable_variables]


def compare(what, got, want, tol=1e-5):
    global checks
    for g, w, v in zip(got, want, build(0).trainable_variables):
        rel = np.abs(g - w).max() / np.abs(w).max()
        assert rel <= tol, f"{what}: variable {v.path} differs from the single-process run by {rel:.2e} (relative)"
    checks += 1


reference = train(False, True)
reference_dense = train(False, True, densify=True)
compare("tf.function, embedding gradients gathered", train(True, True), reference)
compare("tf.function, sparse_as_dense", train(True, True, sparse_as_dense=True), reference_dense)
compare("eager", train(True, False), reference)
compare("tf.function, gradient_predivide_factor=2", train(True, True, gradient_predivide_factor=2.0), reference)
compare("tf.function, fp16 compression", train(True, True, compression=hvd.Compression.fp16), reference, tol=2e-2)
# op=Sum: the summed gradient of n shares is n times the average: SGD with 1/n the rate
compare("tf.function, op=Sum", train(True, True, op=hvd.Sum, lr=0.1 / n, optimizer=keras.optimizers.SGD),
        train(False, True, lr=0.1, optimizer=keras.optimizers.SGD))

# broadcast_variables makes differently seeded models equal to the root's
model = build(100 + r)
before = hvd.allgather_object([v.numpy() for v in model.variables])
assert any(not np.array_equal(a, b) for a, b in zip(before[0], before[-1])), "seeds should give different weights"
hvd.broadcast_variables(model.variables, root_rank=n - 1)
after = hvd.allgather_object([v.numpy() for v in model.variables])
for k in range(n):
    for a, b in zip(after[k], before[n - 1]):
        assert np.array_equal(a, b), f"rank {k} does not hold rank {n - 1}'s variables after broadcast_variables"
checks += 1

# Backprop holding stateful ops (the gradient of an aiacc collective used by the model, a side effect like
# tf.print): the control edges that order the gradients' submits must leave the graph acyclic, every such
# op must still run, and tf.function must train exactly as eager code does.
side_effects = []


@tf.custom_gradient
def watched(h):
    def grad(dy):
        tf.numpy_function(lambda total: side_effects.append(total), [tf.reduce_sum(dy)], [], stateful=True)
        return tf.identity(dy)
    return tf.identity(h), grad


def train_with_stateful_backprop(compiled):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(16, activation="tanh") for _ in range(3)] + [keras.layers.Dense(3)]
    opt = keras.optimizers.SGD(0.1)

    def forward(x):
        h = hvd.allreduce(layers[0](x), name="activation")  # its gradient: a blocking aiacc op in backprop
        h = watched(layers[1](h))
        return layers[3](layers[2](h))

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, forward(x))
        tape = hvd.DistributedGradientTape(tape, name="stateful_backprop")
        variables = [v for layer in layers for v in layer.trainable_variables]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    step = tf.function(step) if compiled else step
    for s in range(3):
        step(tf.one_hot(X[s, r * part:(r + 1) * part, 0], VOCAB), tf.constant(Y[s, r * part:(r + 1) * part]))
    return [v.numpy() for layer in layers for v in layer.trainable_variables]


eager_run = train_with_stateful_backprop(False)
del side_effects[:]
compiled_run = train_with_stateful_backprop(True)
assert len(side_effects) == 3, f"the stateful op in backprop ran {len(side_effects)} times in 3 steps"
for a, b in zip(compiled_run, eager_run):
    assert np.allclose(a, b, rtol=1e-5, atol=1e-6), "tf.function with stateful backprop differs from eager"
checks += 1



def buckets_of(prefix):
    """The gradient buckets of the tape named ``prefix``."""
    found = [b for b in _buckets._table.values() if b.specs[0].label.startswith(f"{prefix}.")]
    assert len(found) == 1, [b.specs[0].label for b in _buckets._table.values()]
    return found[0]


def ptr(tensor):
    return np.from_dlpack(tensor).__array_interface__["data"][0]


# Results are views of the gradient buckets. One still held when the next step's gradients go in moves its
# bucket to new memory first (it is never overwritten under its holder); one let go costs no copy.
keras.utils.set_random_seed(0)
small = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def small_grads(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(small(x) ** 2)
    return hvd.DistributedGradientTape(tape, name="held").gradient(loss, small.trainable_variables)


def small_reference(seed):
    per_rank = []
    for k in range(n):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(small(tf.fill([2, 4], float(seed + k))) ** 2)
        per_rank.append([g.numpy() for g in tape.gradient(loss, small.trainable_variables)])
    return [np.mean(gs, axis=0) for gs in zip(*per_rank)]


def check_held_results(mode, fn):
    first = fn(tf.fill([2, 4], float(1 + r)))
    kept = [g.numpy().copy() for g in first]
    second = fn(tf.fill([2, 4], float(5 + r)))  # first is still held: its buckets move
    for got, want, ref in zip(first, kept, small_reference(1)):
        assert np.array_equal(got.numpy(), want), f"{mode}: a result held across steps was overwritten"
        assert np.allclose(want, ref, rtol=1e-5, atol=1e-6), f"{mode}: wrong average"
    for got, ref in zip(second, small_reference(5)):
        assert np.allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6), f"{mode}: wrong average after the move"
    held = buckets_of("held")
    assert held.renewed > 0, f"{mode}: held results should have moved their buckets"
    return held


def check_results_are_the_buckets(mode, fn, held):
    renewed = held.renewed
    third = fn(tf.fill([2, 4], float(9 + r)))  # nothing held: no copy, the results are the buckets' memory
    assert held.renewed == renewed, f"{mode}: {held.renewed - renewed} buckets copied though no result was held"
    for i, got in enumerate(third):
        assert ptr(got) == held.buckets.view(i).__array_interface__["data"][0], f"{mode}: result {i} was copied"
        assert ptr(got) % 64 == 0


for mode, fn in (("eager", small_grads), ("tf.function", tf.function(small_grads))):
    check_results_are_the_buckets(mode, fn, check_held_results(mode, fn))
checks += 1

# a model whose backward pass takes long enough to see gradients go out while others are computed
keras.utils.set_random_seed(0)
big = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(512, activation="relu") for _ in range(8)]
                       + [keras.layers.Dense(10)])
big_opt = keras.optimizers.SGD(0.01)
xb = tf.random.normal([256, 512])
yb = tf.random.uniform([256], 0, 10, tf.int32)


@tf.function
def big_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, big(x, training=True))
    tape = hvd.DistributedGradientTape(tape, name="overlap")
    grads = tape.gradient(loss, big.trainable_variables)
    big_opt.apply_gradients(zip(grads, big.trainable_variables))
    return loss


for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0):
    big_step(xb, yb)

# What makes that overlap certain, in the traced graph: no gradient can be computed before the gradient
# before it (in backprop order) has been handed to the engine, whatever order TF's executor prefers.
graph = big_step.get_concrete_function(xb, yb).graph
submits = [op for op in graph.get_operations() if op.name.startswith("aiacc_submit")]
# every gradient in one submit op; a small one shares its op with the next (a layer's bias with its kernel,
# the last small layer with the one before), a 1 MiB kernel closes its group (each op's first input is the mark of
# the process that traced it, _graph.process_token)
assert sorted(len(op.inputs) - 1 for op in submits) == [2] * 7 + [4], [(op.name, len(op.inputs)) for op in submits]


def needs(op, wanted):
    seen, stack = set(), [op]
    while stack:
        o = stack.pop()
        if o is wanted:
            return True
        if o not in seen:
            seen.add(o)
            stack.extend([t.op for t in o.inputs] + list(o.control_inputs))
    return False


for earlier, later in zip(submits, submits[1:]):  # (input 0 is the process mark; 1 the first gradient)
    assert needs(later.inputs[1].op, earlier), f"{later.inputs[1].name} can be computed before {earlier.name} ran"
checks += 1

# 40 tiny gradients: 16 to a submit op at most (its inputs' order is backprop's), the sums right
tiny = [tf.Variable(tf.ones([3]) * (k + r)) for k in range(40)]


@tf.function
def tiny_step():
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * v) for v in tiny])
    return hvd.DistributedGradientTape(tape, name="tiny").gradient(loss, tiny)


tiny_graph = tiny_step.get_concrete_function().graph
sizes = sorted(len(op.inputs) - 1 for op in tiny_graph.get_operations() if op.name.startswith("aiacc_submit"))
assert sizes == [8, 16, 16], sizes
for k, g in enumerate(tiny_step()):  # d(v*v)/dv = 2v, averaged over the ranks' k + r
    assert np.allclose(g.numpy(), 2 * (k + (n - 1) / 2)), (k, g.numpy())
checks += 1
if len(sys.argv) > 1:  # the steps ran: the buckets were settled, and the results were never copied out
    overlap = buckets_of("overlap")
    assert len(overlap.describe()) > 1 and overlap.renewed == 0, (overlap.describe(), overlap.renewed)
    checks += 1


# Second order: a gradient penalty differentiates the reduced gradients (the reduction's adjoint is the same
# reduction of the upstream gradients, as Horovod's op gradients). With the outer tape distributed too, the
# result equals one process's derivative of the penalty of the whole batch's gradient.
PX = rng.standard_normal((n * 4, 3)).astype(np.float32)
PW = rng.standard_normal((3, 1)).astype(np.float32)


def penalty_loss(w, x):
    return tf.reduce_mean(tf.tanh(x @ w)) ** 2 + tf.reduce_sum(w ** 3)


def penalty_reference(combine):
    w = tf.Variable(PW)
    with tf.GradientTape() as outer:
        gs = []
        for k in range(n):
            with tf.GradientTape() as inner:
                loss = penalty_loss(w, PX[4 * k:4 * (k + 1)])
            gs.append(inner.gradient(loss, w))
        penalty = tf.reduce_sum(combine(gs) ** 2)
    return outer.gradient(penalty, w).numpy()


def penalty_step(w, op, name):
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            loss = penalty_loss(w, PX[4 * r:4 * (r + 1)])
        g = hvd.DistributedGradientTape(inner, op=op, name=name).gradient(loss, [w])[0]
        penalty = tf.reduce_sum(g ** 2)
    return hvd.DistributedGradientTape(outer, name=f"{name}.outer").gradient(penalty, [w])[0]


@tf.function
def penalty_inner(w):
    with tf.GradientTape() as inner:
        loss = penalty_loss(w, PX[4 * r:4 * (r + 1)])
    return hvd.DistributedGradientTape(inner, name="penalty.fn").gradient(loss, [w])[0]


def compare_penalty(what, got, want):
    global checks
    assert np.allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6), f"{what}: {np.ravel(got)} != {np.ravel(want)}"
    checks += 1


w = tf.Variable(PW)
mean = penalty_reference(lambda gs: tf.add_n(gs) / n)
compare_penalty("penalty eager", penalty_step(w, hvd.Average, "penalty.eager"), mean)
compare_penalty("penalty tf.function", tf.function(penalty_step)(w, hvd.Average, "penalty.graph"), mean)
compare_penalty("penalty Sum", penalty_step(w, hvd.Sum, "penalty.sum"), penalty_reference(tf.add_n))
penalty_inner(w)  # traced before a tape records: differentiable all the same
with tf.GradientTape() as outer:
    penalty = tf.reduce_sum(penalty_inner(w) ** 2)
compare_penalty("penalty of a tf.function", hvd.DistributedGradientTape(outer, name="penalty.fn.outer").gradient(
    penalty, [w])[0], mean)
try:
    penalty_step(w, hvd.Adasum, "penalty.adasum")
    raise AssertionError("the derivative of Adasum-reduced gradients was not refused")
except NotImplementedError as e:
    if n & (n - 1) == 0:
        assert "op=Adasum" in str(e) and "DistributedGradientTape 'penalty.adasum'" in str(e), e
    else:  # (Adasum itself is refused first: it runs on a power-of-2 number of ranks)
        assert f"Adasum runs on a power-of-2 number of ranks, not {n}" in str(e), e
checks += 1

hvd.shutdown()
say(f"OK rank={r} checks={checks}")
