"""aiacc.tensorflow where Horovod's TensorFlow API asks more than tf_ops.py checks, on 2 or more ranks.

* Graphs (a TF1 ``Session``, ``tf.function``): collectives created in a different order on each rank,
  more of them than TensorFlow has inter-op threads, all run by one ``Session.run`` (or one call); they
  must match by their names (derived from the graph) and finish, with every rank's result against a
  numpy reference. Named after their inputs: a mismatch names the input.
* Errors are the classes Horovod raises: FailedPreconditionError for a mismatch across ranks (eagerly also
  aiacc's TensorMismatchError; in graphs through the native status op, and without it the fallback),
  InvalidArgumentError for arguments, NotImplementedError for IndexedSlices with other ops or scaling.
* ``tf.IndexedSlices``: Horovod's average (true division: integer values become floating point).
* uint16; grouped_allgather / grouped_reducescatter and their gradients; process sets; rank_op & co;
  broadcast_ and broadcast_global_variables; Compression.compress/decompress on TF tensors.
* DistributedGradientTape.register_local_source and PartialDistributedGradientTape; elastic
  TensorFlowState / KerasState; BroadcastGlobalVariablesCallback(local_variables=); join as a tensor.

Inputs are deterministic functions of (rank, seed), so each rank computes what the others contributed.
"""

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402

import aiacc.keras as hvd_keras  # noqa: E402
import aiacc.tensorflow as hvd  # noqa: E402
from aiacc.tensorflow import _native  # noqa: E402
from aiacc.adasum import combine  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
ADASUM = n & (n - 1) == 0  # Adasum runs on a power-of-2 number of ranks; on others each entry point refuses it
NOT_ADASUM = ["Adasum runs on a power-of-2 number of ranks", f"not {n}"]
checks = 0


def data(k, shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(1000 * seed + k)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 7, size=shape).astype(dtype)
    return (rng.random(shape) + 0.5).astype(dtype)


def value(t):
    if isinstance(t, tf.IndexedSlices):
        t = tf.convert_to_tensor(t)
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def check(what, got, want, tol=1e-6, dtype=None):
    global checks
    got, want = value(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if dtype is not None:
        assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype} != {np.dtype(dtype)}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.allclose(g, w, rtol=tol, atol=tol), f"{what}: max error {np.abs(g - w).max()}\n{g}\n{w}"
    checks += 1


def expect(exc_types, words, fn):
    global checks
    raises(exc_types, fn, *words)
    checks += 1


def session(threads):
    return tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads))


# ---- graphs: collectives in a different order on each rank, more than there are threads ---------------
K = 6
ins = [[data(k, (s + 1, 3), seed=s) for k in range(n)] for s in range(K)]  # collective s has s+1 rows
order = list(range(K)) if r == 0 else list(reversed(range(K)))


def build(ops):
    """Collective s of each kind, created in this rank's order; inputs named after s (so are the collectives)."""
    out = {}
    for s in order:
        x = tf.constant(ins[s][r], name=f"x{s}")
        out[s] = (hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, root_rank=s % n)) if ops \
            else hvd.allreduce(x, op=hvd.Sum)
    return out


def check_built(what, out):
    for s in range(K):
        summed, gathered, bcast = out[s]
        check(f"{what} allreduce {s}", summed, np.sum(ins[s], axis=0))
        check(f"{what} allgather {s}", gathered, np.concatenate(ins[s]))
        check(f"{what} broadcast {s}", bcast, ins[s][s % n])


for threads in (1, 2):
    with tf.Graph().as_default():
        ops = build(True)
        with session(threads) as sess:
            check_built(f"Session({threads} thread)", sess.run(ops))
            check_built(f"Session({threads} thread) again", sess.run(ops))  # the same names, agreed by the cache
check_built("tf.function", tf.function(lambda: build(True))())

# a graph names its unnamed collectives after their inputs: a mismatch names the input
with tf.Graph().as_default():
    bad = hvd.allreduce(tf.ones([2 + r], name="mismatched_input"))
    with session(2) as sess:
        expect(tf.errors.FailedPreconditionError, ["aiacc.allreduce.mismatched_input_0", "shape"],
               lambda: sess.run(bad))


# ---- errors: Horovod's classes -------------------------------------------------------------------------
assert _native.status_op() is not None, "the native status op could not be built (see the warning above)"
expect((tf.errors.FailedPreconditionError, hvd.TensorMismatchError), ["eager.dtype", "dtype"],
       lambda: hvd.allgather(tf.ones([2], tf.int32 if r == 0 else tf.float32), name="eager.dtype"))
for err in (tf.errors.FailedPreconditionError, hvd.TensorMismatchError):
    expect(err, ["eager.root", "root"], lambda: hvd.broadcast(tf.ones([2]), root_rank=r, name=f"eager.root.{err.__name__}"))
expect(tf.errors.FailedPreconditionError, ["function.dims", "shape"],
       lambda: tf.function(lambda: hvd.reducescatter(tf.ones([4, 2 + r]), name="function.dims"))())
expect((tf.errors.InvalidArgumentError, ValueError), ["divisible"], lambda: hvd.alltoall(tf.ones([n + 1])))
with tf.Graph().as_default():
    split = hvd.alltoall(tf.ones([n + 1]))
    with session(2) as sess:
        expect(tf.errors.InvalidArgumentError, ["divisible"], lambda: sess.run(split))
expect(ValueError, ["scalar"], lambda: hvd.reducescatter(tf.constant(1.0)))
if ADASUM:
    check("Adasum of equal tensors: themselves", hvd.allreduce(tf.ones([2]), op=hvd.Adasum), np.ones(2, np.float32))
else:
    expect(NotImplementedError, NOT_ADASUM, lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum))
# without the native op (no compiler), a graph's mismatch still fails, as InvalidArgumentError
built, _native._loaded = _native._loaded, False
try:
    with tf.Graph().as_default():
        fallback = hvd.allreduce(tf.ones([2 + r]), name="fallback")
        with session(2) as sess:
            expect(tf.errors.InvalidArgumentError, ["fallback", "shape"], lambda: sess.run(fallback))
finally:
    _native._loaded = built


# ---- IndexedSlices: Horovod's semantics ----------------------------------------------------------------
def slices_of(k, dtype):
    return tf.IndexedSlices(tf.constant(data(k, (2, 3), dtype, seed=50)), tf.constant([k, k + 1]),
                            dense_shape=tf.constant([n + 1, 3]))


def dense_of(k, dtype):
    out = np.zeros((n + 1, 3))
    np.add.at(out, [k, k + 1], data(k, (2, 3), dtype, seed=50))
    return out


for dtype, avg_dtype in ((np.int32, np.float64), (np.float32, np.float32), (np.uint8, np.float32)):
    total = np.sum([dense_of(k, dtype) for k in range(n)], axis=0)
    for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
        avg, summed = wrap(lambda: (hvd.allreduce(slices_of(r, dtype), op=hvd.Average),
                                    hvd.allreduce(slices_of(r, dtype), op=hvd.Sum)))()
        check(f"{mode} IndexedSlices {np.dtype(dtype).name} average", avg, total / n, dtype=avg_dtype)
        check(f"{mode} IndexedSlices {np.dtype(dtype).name} sum", summed, total, dtype=dtype)
    grouped = hvd.grouped_allreduce([slices_of(r, dtype), tf.constant(data(r, (2,), dtype, 51))], op=hvd.Sum)
    check(f"grouped IndexedSlices {np.dtype(dtype).name}", grouped[0], total, dtype=dtype)
    check(f"grouped dense {np.dtype(dtype).name}", grouped[1], np.sum([data(k, (2,), dtype, 51) for k in range(n)], 0))
expect(NotImplementedError, ["Min"], lambda: hvd.allreduce(slices_of(r, np.float32), op=hvd.Min))
expect(NotImplementedError, ["Adasum"], lambda: hvd.grouped_allreduce([slices_of(r, np.float32)], op=hvd.Adasum))
expect(NotImplementedError, ["prescale_factor"], lambda: hvd.allreduce(slices_of(r, np.float32), op=hvd.Sum,
                                                                       prescale_factor=2.0))


# ---- uint16, grouped_allgather, grouped_reducescatter (and gradients) -----------------------------------
for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
    u16 = [data(k, (3, 2), np.uint16, 60) for k in range(n)]
    s16, g16, b16 = wrap(lambda: (hvd.allreduce(tf.constant(u16[r]), op=hvd.Sum), hvd.allgather(tf.constant(u16[r])),
                                  hvd.broadcast(tf.constant(u16[r]), root_rank=1)))()
    check(f"{mode} uint16 allreduce", s16, np.sum(u16, axis=0), dtype=np.uint16)
    check(f"{mode} uint16 allgather", g16, np.concatenate(u16), dtype=np.uint16)
    check(f"{mode} uint16 broadcast", b16, u16[1], dtype=np.uint16)

    rag = [[data(k, (k + 1 + j, 2), seed=61 + j) for k in range(n)] for j in range(2)]  # rank k: k+1+j rows
    full = [[data(k, (2 * n + j, 3), seed=63 + j) for k in range(n)] for j in range(2)]
    w_g = [data(0, (sum(k + 1 + j for k in range(n)), 2), seed=65 + j) for j in range(2)]
    w_s = [data(r, (2 + (1 if j and r == 0 else 0), 3), seed=67 + j) for j in range(2)]

    def grouped(xs, ys):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(xs + ys)
            gathered = hvd.grouped_allgather(xs)
            scattered = hvd.grouped_reducescatter(ys, op=hvd.Sum, prescale_factor=0.5)
            loss = tf.add_n([tf.reduce_sum(w * g) for w, g in zip(w_g, gathered)] +
                            [tf.reduce_sum(w * s) for w, s in zip(w_s, scattered)])
        return gathered, scattered, tape.gradient(loss, xs), tape.gradient(loss, ys)

    gathered, scattered, dx, dy = wrap(grouped)([tf.constant(a[r]) for a in rag], [tf.constant(a[r]) for a in full])
    for j in range(2):
        check(f"{mode} grouped_allgather[{j}]", gathered[j], np.concatenate(rag[j]))
        rows = [2 + (1 if j and k == 0 else 0) for k in range(n)]  # 2n+j rows: rank 0 one more when j = 1
        start = sum(rows[:r])
        check(f"{mode} grouped_reducescatter[{j}]", scattered[j], 0.5 * np.sum(full[j], axis=0)[start:start + rows[r]])
        mine = sum(k + 1 + j for k in range(r))
        check(f"{mode} grad grouped_allgather[{j}]", dx[j], w_g[j][mine:mine + r + 1 + j])  # w_g is the same everywhere
        w_all = np.concatenate([data(k, (2 + (1 if j and k == 0 else 0), 3), seed=67 + j) for k in range(n)])
        check(f"{mode} grad grouped_reducescatter[{j}]", dy[j], n * 0.5 * w_all)


# ---- process sets (a set of one rank each; sizes, rows and roots are the set's) -----------
alone = [hvd.add_process_set([k]) for k in range(n)]
me = alone[r]
x = data(r, (4, 3), seed=70)
for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
    out = wrap(lambda t: (hvd.allreduce(t, op=hvd.Sum, process_set=me), hvd.allgather(t, process_set=me),
                          hvd.reducescatter(t, op=hvd.Sum, process_set=me), hvd.alltoall(t, process_set=me),
                          hvd.broadcast(t, root_rank=r, process_set=me),
                          hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum, process_set=me),
                          hvd.grouped_allgather([t], process_set=me), hvd.grouped_reducescatter([t], process_set=me),
                          hvd.allreduce(t, op=hvd.Sum)))(tf.constant(x))
    wants = [x, x, x, x, x, [x, 2 * x], [x], [x], np.sum([data(k, (4, 3), seed=70) for k in range(n)], 0)]
    for k, (got, want) in enumerate(zip(out, wants)):
        check(f"{mode} process set result {k}", got, want)
check("size_op of a set", hvd.size_op(process_set_id=me.process_set_id), 1)
check("process_set_included_op", hvd.process_set_included_op(alone[(r + 1) % n].process_set_id), 0)
expect(ValueError, ["not in process set"], lambda: hvd.allreduce(tf.ones(2), process_set=alone[(r + 1) % n]))
fake = hvd.ProcessSet([0])
fake.process_set_id = 10  # (as Horovod's test does: an id nobody registered)
with tf.Graph().as_default():  # at the call, not when the graph runs (Horovod's ValueError)
    expect(ValueError, ["allreduce of 'fake'", "process_set_id=10", "is not a registered process set"],
           lambda: hvd.allreduce(tf.ones(2), name="fake", process_set=fake))
    expect(ValueError, ["allgather of", "is not a registered process set"],
           lambda: hvd.allgather(tf.ones(2), process_set=hvd.ProcessSet([1])))
check("broadcast_object in a set", np.asarray(hvd.broadcast_object(r, root_rank=r, process_set=me)), r)
check("allgather_object in a set", np.asarray(hvd.allgather_object(r, process_set=me)), [r])
for ps in alone:
    hvd.remove_process_set(ps)


# ---- rank_op & co, broadcast_, broadcast_global_variables, Compression -------------------------------------
check("rank_op", hvd.rank_op(), r)
check("size_op", hvd.size_op(), n)
check("local_rank_op", hvd.local_rank_op(), hvd.local_rank())
check("local_size_op", hvd.local_size_op(), hvd.local_size())
with tf.Graph().as_default():
    ops = [hvd.rank_op(), hvd.size_op(), hvd.local_size_op()]
    v = tf.Variable(data(r, (3,), seed=80))
    w = tf.compat.v1.Variable(data(r, (2, 2), seed=81), use_resource=False)
    bcast = hvd.broadcast_([v, w], root_rank=1)
    with session(2) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        check("graph rank_op, size_op, local_size_op", sess.run(ops), [r, n, hvd.local_size()])
        values = sess.run(bcast)
        check("graph broadcast_ (resource variable)", values[0], data(1, (3,), seed=80))
        check("graph broadcast_ (ref variable)", values[1], data(1, (2, 2), seed=81))
        check("graph broadcast_: the variable itself", sess.run(w), data(1, (2, 2), seed=81))
        sess.run(tf.compat.v1.assign(v, data(r, (3,), seed=82)))
        sess.run(hvd.broadcast_global_variables(0))
        check("graph broadcast_global_variables", sess.run(v), data(0, (3,), seed=82))
eager_var = tf.Variable(data(r, (3,), seed=83))
check("eager broadcast_", hvd.broadcast_([eager_var], root_rank=0)[0], data(0, (3,), seed=83))
check("eager broadcast_: the variable itself", eager_var, data(0, (3,), seed=83))
# one variable, or a tensor in the list: refused before any broadcast (one variable's rows were broadcast, then
# AttributeError: 'EagerTensor' object has no attribute 'assign', as in Horovod)
expect(TypeError, ["broadcast_ takes a list of variables, not one ResourceVariable: pass [variable]"],
       lambda: hvd.broadcast_(eager_var, root_rank=0))
expect(TypeError, ["broadcast_: element 1 of the list is a EagerTensor, not a variable"],
       lambda: hvd.broadcast_([eager_var, tf.ones(2)], root_rank=0))
expect(RuntimeError, ["eager"], lambda: hvd.broadcast_global_variables(0))
# broadcast_variables of a model, one variable, a dict, a tensor: each named, before any broadcast (they were
# "'Sequential' object is not iterable", "Cannot iterate over a scalar tensor", "'str' object has no attribute
# 'name'", "Tensor.name is undefined when eager execution is enabled")
bad_model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
for bad, words in [(bad_model, "not a Sequential: pass model.variables"),
                   (eager_var, "not one ResourceVariable: pass [variable]"),
                   ({"a": eager_var}, "not a dict: pass list(variables.values())"),
                   ([eager_var, tf.ones(2)], "element 1 of the list is a EagerTensor, not a variable")]:
    expect(TypeError, ["broadcast_variables", words], lambda: hvd.broadcast_variables(bad, root_rank=0))
# a tape over a set never registered: named when made (it said DistributedOptimizer, at the first gradient())
with tf.GradientTape() as unregistered:
    pass
expect(ValueError, ["DistributedGradientTape: [0, 1] is not a registered process set"],
       lambda: hvd.DistributedGradientTape(unregistered, process_set=[0, 1]))
for dtype, wire in ((tf.float64, tf.float16), (tf.float32, tf.float16), (tf.float16, tf.float16), (tf.int32, tf.int32)):
    compressed, ctx = hvd.Compression.fp16.compress(tf.ones([3], dtype))
    restored = hvd.Compression.fp16.decompress(compressed, ctx)
    assert compressed.dtype == wire and restored.dtype == dtype, (dtype, compressed.dtype, restored.dtype)
    checks += 1
check("fp16 compression in an allreduce", hvd.allreduce(tf.constant(x, tf.float64), op=hvd.Sum,
                                                         compression=hvd.Compression.fp16),
      np.sum([data(k, (4, 3), seed=70) for k in range(n)], 0), tol=1e-2)
check("broadcast_object_fn", np.asarray(hvd.broadcast_object_fn(root_rank=1)(r * 7)), 7)


# ---- local sources: their gradients stay on the rank, divided by the number of ranks ------------------------
def two_layer_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(r + 1)),
                              keras.layers.Dense(1, kernel_initializer="ones")])
    return model


feats = data(r, (4, 3), seed=90)
for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
    model = two_layer_model()
    local = model.layers[0].trainable_weights

    def grads(partial):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(model(tf.constant(feats)) ** 2)
        own = tape.gradient(loss, model.trainable_weights)
        if partial:
            dist = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[0], name=f"partial.{mode}")
        else:
            dist = hvd.DistributedGradientTape(tape, name=f"local.{mode}")
            for v in local:
                dist.register_local_source(v)
        # Horovod's use_generic_names, positionally (its fourth argument) and by keyword
        if partial:
            return own, dist.gradient(loss, model.trainable_weights, None, True)
        return own, dist.gradient(loss, model.trainable_weights, use_generic_names=True)

    for partial in (False, True):
        own, got = wrap(lambda: grads(partial))()
        all_own = hvd.allgather(tf.stack([tf.reshape(g, [-1])[0] for g in own])[tf.newaxis])  # first entry of each
        for i, (o, g) in enumerate(zip(own, got)):
            if i < len(local):
                check(f"{mode} partial={partial} local gradient {i}", g, value(o) / n)
            else:
                check(f"{mode} partial={partial} averaged gradient {i} (first entry)", tf.reshape(g, [-1])[0],
                      np.mean(value(all_own)[:, i]))


# the same for the Keras optimizer: PartialDistributedOptimizer(local_layers=) and register_local_var
# (Horovod's scale_local_gradients=False on DistributedOptimizer: the local gradients unscaled; it was a TypeError)
for how in ("partial", "register", "unscaled"):
    model = two_layer_model()
    local = model.layers[0].trainable_weights
    if how == "partial":
        opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), name="partial.opt",
                                                    local_layers=model.layers[0])
    else:
        opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), name=f"{how}.opt",
                                             scale_local_gradients=how == "register")
        for v in local:
            opt.register_local_var(v)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant(feats)) ** 2)
    own = tape.gradient(loss, model.trainable_weights)
    before = [value(w) for w in model.trainable_weights]
    all_own = [value(hvd.allgather(g[tf.newaxis], name=f"{how}.own.{i}")) for i, g in enumerate(own)]
    opt.apply(own, model.trainable_weights)
    assert not [v.path for v in opt.variables if any(v is w for w in model.trainable_weights)], \
        f"Keras {how}: the model's variables joined the optimizer's ({[v.path for v in opt.variables]})"
    for i, (w, b) in enumerate(zip(model.trainable_weights, before)):
        if i < len(local):
            check(f"Keras {how}: local variable {i} took its own gradient (/ size where scaled)", w,
                  b - value(own[i]) / (1 if how == "unscaled" else n))
        else:
            check(f"Keras {how}: variable {i} took the average", w, b - all_own[i].mean(axis=0), tol=1e-5)


# ---- DistributedGradientTape made inside the tape's with block (Horovod's scripts do): its gradient after the
# block and, for a persistent tape, inside it too, eagerly and in a tf.function (a segfault before: the copy
# popped the recording the block had popped) ---------------------------------------------------------------------
inside_w = tf.Variable(np.ones((3, 1), np.float32))
inside_x = tf.ones((2, 3)) * (r + 1)


def wrapped_inside(persistent):
    with tf.GradientTape(persistent=persistent) as tape:
        loss = tf.reduce_sum(tf.matmul(inside_x, inside_w))
        tape = hvd.DistributedGradientTape(tape, name=f"inside.{persistent}")
        early = tape.gradient(loss, [inside_w])[0] if persistent else None
    late = tape.gradient(loss, [inside_w])[0]
    return late if early is None else (early, late)


want_inside = np.full((3, 1), 2.0 * np.mean(np.arange(1, n + 1)), np.float32)  # mean over ranks of 2 * (r + 1)
for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
    check(f"{mode}: tape wrapped inside its block, gradient after it", wrap(lambda: wrapped_inside(False))(),
          want_inside)
    for when, got in zip(("inside", "after"), wrap(lambda: wrapped_inside(True))()):
        check(f"{mode}: persistent tape wrapped inside its block, gradient {when} it", got, want_inside)


# ---- a gradient None on one rank only in the first step: the average of rank 0's and the others' zeros (it was an
# error, and before that "shape differs across ranks (rank 0: (1,); rank 1: ())", from the placeholder of the None
# gradient); again in the next step (see tf_presence.py for training) -----------------------------------------------
lonely = tf.Variable([3.0])
shared = tf.Variable([1.0, 2.0])


def lonely_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(shared) + (tf.reduce_sum(lonely) if r == 0 else 0.0)
    return hvd.DistributedGradientTape(tape, name="lonely").gradient(loss, [shared, lonely])


for attempt in range(2):
    got = lonely_step()
    check(f"a gradient None on ranks > 0, step {attempt}", got[1], np.array([1.0 / n], np.float32))
    check(f"a gradient every rank has, step {attempt}", got[0], np.array([1.0, 1.0], np.float32))

# ---- unnamed tapes in one tf.function: a GAN's two models (the same layers, so the same variable names and
# shapes) and a persistent tape asked twice. Their reductions are in flight together; they shared names (a
# DuplicateNameError abort) or buckets ("marked ready twice"), and now each gets a prefix of its own ----------
keras.utils.set_random_seed(5)
G, D = [keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(3)]) for _ in range(2)]


def losses(x):
    return tf.reduce_sum(G(x) ** 2), tf.reduce_sum(tf.abs(D(x))), tf.reduce_sum(tf.sin(G(x)))


def flat_grads(grads):
    return np.concatenate([value(g).ravel() for g in grads])


@tf.function
def gan_step(x):
    with tf.GradientTape() as tg:
        lg, _, _ = losses(x)
    with tf.GradientTape() as td:
        _, ld, _ = losses(x)
    tg, td = hvd.DistributedGradientTape(tg), hvd.DistributedGradientTape(td)
    return tg.gradient(lg, G.trainable_variables), td.gradient(ld, D.trainable_variables)


@tf.function
def asked_twice(x):
    with tf.GradientTape(persistent=True) as tape:
        lg, _, ls = losses(x)
    tape = hvd.DistributedGradientTape(tape)
    return tape.gradient(lg, G.trainable_variables), tape.gradient(ls, G.trainable_variables)


for step in range(3):  # the first step settles the buckets, the others reuse them
    x = [data(k, (4, 3), seed=95 + step) for k in range(n)]
    own = []  # every rank's own gradients, from plain tapes
    for k in range(n):
        with tf.GradientTape(persistent=True) as tape:
            lg, ld, ls = losses(tf.constant(x[k]))
        own.append([flat_grads(tape.gradient(loss, m.trainable_variables))
                    for loss, m in ((lg, G), (ld, D), (ls, G))])
    want = [np.mean([o[j] for o in own], axis=0) for j in range(3)]
    got_g, got_d = gan_step(tf.constant(x[r]))
    check(f"two unnamed tapes in tf.function, step {step}: generator", flat_grads(got_g), want[0], tol=1e-5)
    check(f"two unnamed tapes in tf.function, step {step}: discriminator", flat_grads(got_d), want[1], tol=1e-5)
    first, second = asked_twice(tf.constant(x[r]))
    check(f"persistent tape asked twice in tf.function, step {step}: first", flat_grads(first), want[0], tol=1e-5)
    check(f"persistent tape asked twice in tf.function, step {step}: second", flat_grads(second), want[2], tol=1e-5)


# ---- op=Adasum in the tape and the Keras optimizer: each gradient combined on its own (Horovod's TF2 rule) -----
def adasum_of(own, tag):
    """The reference: every rank's gradients (allgathered), combined tensor by tensor with the paper's formula,
    pairwise in a tree (ranks 0 and 1, 2 and 3, then those pairs' results, ...)."""
    out = []
    for i, g in enumerate(own):
        level = list(value(hvd.allgather(tf.reshape(g, [1, -1]), name=f"adasum.ref.{tag}.{i}")).astype(np.float64))
        while len(level) > 1:
            level = [combine(a, b, np.empty_like(a)) for a, b in zip(level[0::2], level[1::2])]
        out.append(level[0].reshape(g.shape))
    return out


if ADASUM:
    ada_feats = data(r, (4, 3), seed=95) * (r + 1)
    for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
        model = two_layer_model()

        def ada_grads():
            with tf.GradientTape(persistent=True) as tape:
                loss = tf.reduce_sum(model(tf.constant(ada_feats)) ** 2)
            own = tape.gradient(loss, model.trainable_weights)
            return own, hvd.DistributedGradientTape(tape, op=hvd.Adasum, name=f"adasum.{mode}").gradient(
                loss, model.trainable_weights)

        own, got = wrap(ada_grads)()
        for i, (g, w) in enumerate(zip(got, adasum_of(own, mode))):
            check(f"{mode} tape op=Adasum: gradient {i} is the Adasum of the ranks' own", g, w, tol=1e-5)

    model = two_layer_model()
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum, name="adasum.opt")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant(ada_feats)) ** 2)
    own = tape.gradient(loss, model.trainable_weights)
    before = [value(w) for w in model.trainable_weights]
    opt.apply(own, model.trainable_weights)
    for i, (w, b, d) in enumerate(zip(model.trainable_weights, before, adasum_of(own, 'opt'))):
        check(f"Keras DistributedOptimizer(op=Adasum): variable {i}", w, b - d, tol=1e-5)

    # an embedding's IndexedSlices gradient: refused without sparse_as_dense (naming it), combined densely with it
    table = tf.Variable(data(0, (5, 2), seed=96))
    rows = tf.constant([0, 3] if r == 0 else [3, 4])
    for dense in (False, True):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(tf.gather(table, rows) * (r + 1.0))
        dist = hvd.DistributedGradientTape(tape, op=hvd.Adasum, sparse_as_dense=dense, name=f"adasum.sparse.{dense}")
        if dense:
            own = [tf.convert_to_tensor(tape.gradient(loss, [table])[0])]
            check("tape op=Adasum, sparse_as_dense: the Adasum of the dense gradients",
                  dist.gradient(loss, [table])[0], adasum_of(own, 'sparse')[0], tol=1e-5)
        else:
            expect(NotImplementedError, ["adasum.sparse.False.0", "IndexedSlices", "sparse_as_dense=True"],
                   lambda: dist.gradient(loss, [table]))
else:  # refused when the wrapper is made, naming the number of ranks
    expect(NotImplementedError, NOT_ADASUM, lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum))
    expect(NotImplementedError, NOT_ADASUM,
           lambda: hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum, name="adasum.opt"))
expect(ValueError, ["DistributedGradientTape", "gradient_predivide_factor=2.0", "op=Average only"],
       lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum, gradient_predivide_factor=2.0))
expect(ValueError, ["DistributedOptimizer", "op=Min", "Average, Sum or Adasum"],
       lambda: hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Min))

# a float64 model's optimizer after a float32 one over the same places (one variable each): its gradients were cast to
# float32 for the sum (the first one's record of their dtypes), 1e-12 lost: exact in float64 now
for dtype in ("float32", "float64"):
    var64 = keras.Variable(np.zeros(2), dtype=dtype)
    grad64 = tf.constant([1 + 1e-12, 1 / 3], tf.float64) * (r + 1)
    hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum).apply_gradients([(tf.cast(grad64, dtype),
                                                                                             var64)])
    check(f"{dtype} optimizer after another on the same places", var64,
          -np.array([1 + 1e-12, 1 / 3], dtype) * (n * (n + 1) / 2), tol=0.0, dtype=dtype)


# ---- TF1: a DistributedGradientTape in a graph a Session runs (Horovod's test_partial_distributed_gradient_tape
# does so): run more than twice, with each rank's own variable (the same-start check reads them in the graph, at the
# second run, and warns; once Python read them there, which failed the second run) -------------------------------
with tf.Graph().as_default():
    tv = tf.compat.v1.get_variable("tape_v", initializer=np.full(3, 1.0 + r, np.float32))
    with tf.GradientTape() as tape:
        tape_loss = tf.reduce_sum(tv * tv)
    tape_grad = hvd.DistributedGradientTape(tape).gradient(tape_loss, [tv])[0]
    with session(2) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for run in range(3):
            check(f"TF1 graph: DistributedGradientTape's averaged gradient, run {run + 1}", sess.run(tape_grad),
                  np.full(3, np.mean([2.0 * (1.0 + k) for k in range(n)])))


# ---- TF1: hvd.DistributedOptimizer of a tf.compat.v1.train.Optimizer, BroadcastGlobalVariablesHook -----------
with tf.Graph().as_default():
    w = tf.compat.v1.get_variable("w", initializer=np.full(3, 10.0 * (r + 1), np.float32))
    u = tf.compat.v1.get_variable("u", initializer=np.full(2, 1.0 + r, np.float32))  # registered local
    feats1 = tf.constant(data(r, (3,), seed=97))
    loss = tf.reduce_sum(w * feats1) + tf.reduce_sum(u * u)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    assert isinstance(opt, tf.compat.v1.train.Optimizer) and type(opt._optimizer).__name__ == "GradientDescentOptimizer"
    opt.register_local_var(u)
    train = opt.apply_gradients(opt.compute_gradients(loss))
    hooks = [hvd.BroadcastGlobalVariablesHook(0)]
    with tf.compat.v1.train.MonitoredSession(session_creator=tf.compat.v1.train.ChiefSessionCreator(
            config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2)), hooks=hooks) as sess:
        check("BroadcastGlobalVariablesHook: rank 0's variables", sess.run(w), np.full(3, 10.0))
        check("BroadcastGlobalVariablesHook: also the local one", sess.run(u), np.full(2, 1.0))
        sess.run(train)
        mean_feats = np.mean([data(k, (3,), seed=97) for k in range(n)], axis=0)
        check("TF1 DistributedOptimizer: the averaged gradient applied", sess.run(w), 10.0 - mean_feats, tol=1e-5)
        check("TF1 DistributedOptimizer: a local variable's own gradient / size", sess.run(u), np.full(2, 1.0 - 2.0 / n))
expect(TypeError, ["DistributedOptimizer", "TF1 optimizer", "Keras", "int"], lambda: hvd.DistributedOptimizer(3))
keras_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), name="via.tf")  # Horovod: the Keras wrapper
assert isinstance(keras_opt, keras.optimizers.SGD) and keras_opt._aiacc_reducer.prefix == "via.tf", keras_opt
checks += 1


# ---- elastic state, BroadcastGlobalVariablesCallback(local_variables=) ---------------------------------------
weights = [tf.Variable(np.full((2, 2), float(r + 1))), tf.Variable(np.full((2,), float(r + 1)))]
state = hvd.elastic.TensorFlowState(weights, batch=20 + r, epoch=10 + r)
state.sync()
check("TensorFlowState.sync", [value(w).sum() for w in weights], [4.0, 2.0])
assert (state.batch, state.epoch) == (20, 10), (state.batch, state.epoch)
weights[0].assign(np.zeros((2, 2)))
state.batch = 99
state.restore()
check("TensorFlowState.restore", value(weights[0]), np.ones((2, 2)))
assert state.batch == 20, state.batch
weights[0].assign(np.full((2, 2), 5.0))
state.batch = 21
state.commit()
state.restore()
check("TensorFlowState.commit", value(weights[0]), np.full((2, 2), 5.0))
assert state.batch == 21, state.batch
checks += 3

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(r))])
kstate = hvd_keras.elastic.KerasState(model, keras.optimizers.SGD(0.1), epoch=r)
kstate.sync()
check("KerasState.sync", model.layers[0].kernel, np.zeros((3, 2)))
assert kstate.epoch == 0
checks += 1

# a state made before model.compile tracks the optimizer compile gives it (it tracked none: a restore left Adam's
# step count and moments where they were); a commit inside a tf.function is an error saying so (it ran once, while
# traced, and kept graph tensors that a restore could not use)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
kstate = hvd_keras.elastic.KerasState(model, epoch=0)
model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.1), name="elastic.late"), loss="mse")
model.fit(np.ones((4, 3)), np.zeros((4, 2)), batch_size=2, epochs=1, verbose=0, shuffle=False)
kstate.commit()
moments = [value(v).copy() for v in model.optimizer.variables[1:]]
model.fit(np.ones((4, 3)), np.zeros((4, 2)), batch_size=2, epochs=1, verbose=0, shuffle=False)
kstate.restore()
check("KerasState made before compile: restore() gives back the optimizer's steps", model.optimizer.iterations, 2)
for k, (v, m) in enumerate(zip(model.optimizer.variables[1:], moments)):
    check(f"KerasState made before compile: optimizer variable {k + 1}", v, m)
raises(hvd.elastic.ElasticStateError, tf.function(lambda: kstate.commit() or tf.constant(0), autograph=False),
       "not inside a tf.function")
checks += 1

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(r)),
                          keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(r))])
model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
model.fit(np.ones((2, 3)), np.ones((2, 3)), epochs=1, verbose=0, callbacks=[
    hvd_keras.callbacks.BroadcastGlobalVariablesCallback(1, local_variables=model.layers[0].variables)])
check("callback: a local variable keeps this rank's value", model.layers[0].kernel, np.full((3, 3), float(r)))
check("callback: the others have the root's", model.layers[1].kernel, np.full((3, 3), 1.0))
# Horovod's other spellings: one variable (was "A Keras Variable cannot be used as a boolean"), register_local_var
# (was missing); and the learning-rate callbacks put the epoch's lr in its logs, as Horovod's do
for how in ("one", "register"):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(r))])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.0), name=f"local.{how}"), loss="mse")
    if how == "one":
        callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(1, local_variables=model.layers[0].kernel)
    else:
        callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(1)
        callback.register_local_var(model.layers[0].kernel)
    model.fit(np.ones((2, 3)), np.ones((2, 3)), epochs=1, verbose=0, callbacks=[callback])
    check(f"callback ({how}): a local variable keeps this rank's value", model.layers[0].kernel,
          np.full((3, 3), float(r)))
    check(f"callback ({how}): the others have the root's", model.layers[0].bias, np.zeros(3))
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.0), name="lr.logs"), loss="mse")
history = model.fit(np.ones((2, 3)), np.ones((2, 3)), epochs=2, verbose=0, callbacks=[
    hvd_keras.callbacks.LearningRateScheduleCallback(0.25, multiplier=0.5)])
check("LearningRateScheduleCallback: the lr in the epoch's logs", history.history["lr"], [0.25, 0.125])

# ---- join: Horovod's tensor (the rank that joined last); a joined rank adds zeros to the others' sums -----------
if r == n - 1:
    check("allreduce while the other rank has joined", hvd.allreduce(tf.ones(2), op=hvd.Sum), np.ones(2))
else:
    checks += 1
check("join", hvd.join(), n - 1)
last = tf.function(hvd.join)()
check("join in tf.function: the same rank everywhere", np.asarray(hvd.allgather_object(int(last))), [int(last)] * n)

hvd.shutdown()
say(f"OK rank={r} checks={checks}")
