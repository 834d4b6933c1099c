"""aiacc.tensorflow collectives, eager and inside tf.function, against numpy references on every rank.

Also: gradients through allreduce / allgather / broadcast / alltoall / reducescatter / grouped_allreduce
against the math of Horovod's definitions, IndexedSlices (an embedding's gradient) both gathered and densified,
the zero-copy and alignment guarantees of the tensor bridge, and errors that name the tensor.
Inputs are deterministic functions of (rank, seed), so each rank computes what the others contributed.
"""


import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

import aiacc.tensorflow as hvd  # noqa: E402
from aiacc.tensorflow import _bridge  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def data(k, shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(1000 * seed + k)
    if np.dtype(dtype).kind in "iub":
        return rng.integers(0, 2 if np.dtype(dtype).kind == "b" else 5, size=shape).astype(dtype)
    return (rng.random(shape) + 0.5).astype(dtype)


def check(what, got, want, tol=1e-6):
    global checks
    got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.allclose(g, w, rtol=tol, atol=tol), f"{what}: max error {np.abs(g - w).max()} (tol {tol})\n{g}\n{w}"
    checks += 1


def ptr(a):
    return a.__array_interface__["data"][0]


MODES = [("eager", lambda f: f), ("function", tf.function)]

# ---- every dtype crosses the bridge (allreduce Sum; bool as Max) ---------------------------------------
DTYPES = [(tf.float16, 2e-3), (tf.bfloat16, 2e-2), (tf.float32, 1e-6), (tf.float64, 1e-12), (tf.int8, 0),
          (tf.uint8, 0), (tf.int16, 0), (tf.int32, 0), (tf.int64, 0), (tf.bool, 0)]
for mode, wrap in MODES:
    for seed, (dtype, tol) in enumerate(DTYPES):
        np_dtype = np.float32 if dtype == tf.bfloat16 else dtype.as_numpy_dtype
        ins = [data(k, (3, 4), np_dtype, seed) for k in range(n)]
        x = tf.cast(tf.constant(ins[r]), dtype)
        op = hvd.Max if dtype == tf.bool else hvd.Sum
        got = wrap(lambda t: hvd.allreduce(t, op=op, name=f"{mode}.dtype.{dtype.name}"))(x)
        assert got.dtype == dtype, f"{mode} {dtype.name}: result dtype {got.dtype}"
        want = np.max(ins, axis=0) if dtype == tf.bool else np.sum([a.astype(np.float64) for a in ins], axis=0)
        check(f"{mode} allreduce {dtype.name}", tf.cast(got, tf.float64), want, tol)


# ---- every collective, float32 and int32 ------------------------------------------------------------
def collectives(x, ragged, pairs):
    return {
        "avg": hvd.allreduce(x),
        "sum_scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
        "min": hvd.allreduce(x, op=hvd.Min),
        "max": hvd.allreduce(x, op=hvd.Max),
        "prod": hvd.allreduce(x, op=hvd.Product),
        "avg_legacy": hvd.allreduce(x, average=True),
        "gather": hvd.allgather(ragged),
        "bcast": hvd.broadcast(x, root_rank=n - 1),
        "a2a_equal": hvd.alltoall(pairs),
        "rs_sum": hvd.reducescatter(pairs, op=hvd.Sum),
        "rs_avg": hvd.reducescatter(tf.concat([pairs, pairs[:1]], 0)),
        "grouped": hvd.grouped_allreduce([x, x * 2], op=hvd.Sum),
    }


for mode, wrap in MODES:
    for dtype in (np.float32, np.int32):
        xs = [data(k, (3, 4), dtype, 7) for k in range(n)]
        rag = [data(k, (k + 1, 2), dtype, 8) for k in range(n)]  # rank k has k+1 rows
        prs = [data(k, (2 * n, 3), dtype, 9) for k in range(n)]
        spl = [[(k + j) % 2 + (1 if j == k else 0) for j in range(n)] for k in range(n)]  # rows k sends to j
        rag_a2a = [data(k, (sum(spl[k]), 2), dtype, 10) for k in range(n)]
        out = wrap(collectives)(tf.constant(xs[r]), tf.constant(rag[r]),
                                tf.constant(prs[r]))
        out_a2a = wrap(lambda t, s: hvd.alltoall(t, splits=s))(tf.constant(rag_a2a[r]), tf.constant(spl[r]))
        f64 = [a.astype(np.float64) for a in xs]
        total = np.sum(f64, axis=0)
        avg = total / n if dtype == np.float32 else total // n
        tag = f"{mode} {np.dtype(dtype).name}"
        check(f"{tag} avg", out["avg"], avg)
        check(f"{tag} avg_legacy", out["avg_legacy"], avg)
        if dtype == np.float32:
            check(f"{tag} sum_scaled", out["sum_scaled"], np.sum([a * 0.5 for a in f64], axis=0) * 3.0)
        check(f"{tag} min", out["min"], np.min(f64, axis=0))
        check(f"{tag} max", out["max"], np.max(f64, axis=0))
        check(f"{tag} prod", out["prod"], np.prod(f64, axis=0))
        check(f"{tag} allgather ragged", out["gather"], np.concatenate(rag))
        check(f"{tag} broadcast", out["bcast"], xs[n - 1])
        # alltoall with splits: rank r receives from each k the block k addressed to r
        want_rows = []
        for k in range(n):
            start = sum(spl[k][:r])
            want_rows.append(rag_a2a[k][start:start + spl[k][r]])
        rows, received = out_a2a
        check(f"{tag} alltoall splits rows", rows, np.concatenate(want_rows))
        check(f"{tag} alltoall received splits", received, [spl[k][r] for k in range(n)])
        check(f"{tag} alltoall equal", out["a2a_equal"], np.concatenate([p[2 * r:2 * r + 2] for p in prs]))
        check(f"{tag} reducescatter sum", out["rs_sum"], np.sum(prs, axis=0)[2 * r:2 * r + 2])
        uneven = [np.concatenate([p, p[:1]]).astype(np.float64) for p in prs]
        rows_per = [2 + (1 if k < 1 else 0) for k in range(n)]  # 2n+1 rows: rank 0 gets one more
        start = sum(rows_per[:r])
        rs_total = np.sum(uneven, axis=0)[start:start + rows_per[r]]
        check(f"{tag} reducescatter avg uneven", out["rs_avg"], rs_total / n if dtype == np.float32 else rs_total // n)
        check(f"{tag} grouped[0]", out["grouped"][0], total)
        check(f"{tag} grouped[1]", out["grouped"][1], total * 2)


# ---- complex64 / complex128, eager and in a tf.function: Sum, Average, scaled, fused with a real tensor ------
def cdata(k, shape, dtype, seed):
    return (data(k, shape, np.float64, seed) + 1j * (data(k, shape, np.float64, seed + 1) - 1)).astype(dtype)


def complex_ops(x, ragged):
    return (hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(x),
            hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0),
            hvd.grouped_allreduce([x, tf.math.real(x)], op=hvd.Sum), hvd.allgather(ragged), hvd.broadcast(x, n - 1))


for mode, wrap in MODES:
    for seed, (dtype, tol) in enumerate(((np.complex64, 1e-6), (np.complex128, 1e-12)), 40):
        xs = [cdata(k, (3, 4), dtype, seed) for k in range(n)]
        rag = [cdata(k, (k + 1, 2), dtype, seed + 5) for k in range(n)]
        total = np.sum([a.astype(np.complex128) for a in xs], axis=0)
        got = wrap(complex_ops)(tf.constant(xs[r]), tf.constant(rag[r]))
        assert all(t.dtype == tf.as_dtype(dtype) for t in (got[0], got[1], got[2], got[3][0], got[4], got[5]))
        for what, value, want in (("sum", got[0], total), ("average", got[1], total / n),
                                  ("scaled", got[2], total * 1.5 / n), ("grouped", got[3][0], total),
                                  ("grouped real", got[3][1], total.real), ("allgather", got[4], np.concatenate(rag)),
                                  ("broadcast", got[5], xs[n - 1])):
            value = value.numpy()
            assert value.shape == want.shape and np.allclose(value, want, rtol=tol, atol=tol), \
                f"{mode} {np.dtype(dtype).name} {what}: {value.ravel()[:3]} != {want.ravel()[:3]}"
            checks += 1
        # Min / Max / Product are not defined for complex numbers: refused naming the tensor, dtype and op
        raises((TypeError, tf.errors.InvalidArgumentError),
               lambda: wrap(lambda t: hvd.allreduce(t, op=hvd.Max, name=f"{mode}.cmax"))(tf.constant(xs[r])),
               f"'{mode}.cmax': op=Max is not defined for complex tensors ({np.dtype(dtype).name})")
        checks += 1


# ---- gradients against the single-process math --------------------------------------------------
def gradients(x, ragged, pairs, w_avg, w_gather, w_bcast, w_a2a, w_rs):
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, ragged, pairs])
        losses = {
            "allreduce avg": tf.reduce_sum(w_avg * hvd.allreduce(x, name="g.avg")),
            "allreduce sum scaled": tf.reduce_sum(
                w_avg * hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="g.sum")),
            "allgather": tf.reduce_sum(w_gather * hvd.allgather(ragged, name="g.gather")),
            "broadcast": tf.reduce_sum(w_bcast * hvd.broadcast(x, root_rank=n - 1, name="g.bcast")),
            "alltoall": tf.reduce_sum(w_a2a * hvd.alltoall(pairs, name="g.a2a")),
            "reducescatter": tf.reduce_sum(w_rs * hvd.reducescatter(pairs, op=hvd.Sum, name="g.rs")),
            "grouped": tf.add_n([tf.reduce_sum(w_avg * y)
                                 for y in hvd.grouped_allreduce([x, x], name="g.grouped")]),
        }
    sources = {"allreduce avg": x, "allreduce sum scaled": x, "allgather": ragged, "broadcast": x,
               "alltoall": pairs, "reducescatter": pairs, "grouped": x}
    return {k: tape.gradient(v, sources[k]) for k, v in losses.items()}


for mode, wrap in MODES:
    xs = [data(k, (3, 4), seed=20) for k in range(n)]
    rag = [data(k, (k + 1, 2), seed=21) for k in range(n)]
    prs = [data(k, (2 * n, 3), seed=22) for k in range(n)]
    rows = sum(k + 1 for k in range(n))
    w_avg = [data(k, (3, 4), seed=23) for k in range(n)]
    w_gather = [data(k, (rows, 2), seed=24) for k in range(n)]
    w_a2a = [data(k, (2 * n, 3), seed=25) for k in range(n)]
    w_rs = [data(k, (2, 3), seed=26) for k in range(n)]
    g = wrap(gradients)(*[tf.constant(a[r]) for a in (xs, rag, prs, w_avg, w_gather, w_avg, w_a2a, w_rs)])
    start = sum(k + 1 for k in range(r))
    check(f"{mode} grad allreduce avg", g["allreduce avg"], np.mean(w_avg, axis=0))
    check(f"{mode} grad allreduce sum scaled", g["allreduce sum scaled"], 1.5 * np.sum(w_avg, axis=0))
    # Horovod's definitions: allgather and broadcast average the upstream gradients over the ranks,
    # reducescatter (Sum) allgathers them times the number of ranks
    check(f"{mode} grad allgather", g["allgather"], np.mean(w_gather, axis=0)[start:start + r + 1])
    check(f"{mode} grad broadcast", g["broadcast"], np.mean(w_avg, axis=0) if r == n - 1 else np.zeros((3, 4)))
    # alltoall: my rows 2j..2j+1 went to rank j, where they sit at rows 2r..2r+1
    check(f"{mode} grad alltoall", g["alltoall"], np.concatenate([w_a2a[j][2 * r:2 * r + 2] for j in range(n)]))
    check(f"{mode} grad reducescatter", g["reducescatter"], n * np.concatenate(w_rs))
    check(f"{mode} grad grouped", g["grouped"], 2 * np.mean(w_avg, axis=0))


# ---- a DistributedGradientTape's jacobians are averaged as its gradients are (Horovod's tape computes each row
# with its gradient()); TensorFlow's pfor could not vectorize aiacc's graph ops: a ValueError about a TensorDataset
jac_w = tf.Variable(data(0, (3, 2), seed=27))


def jacobians(x, distributed=True, use_pfor=True):
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = tf.matmul(x, jac_w)
        y_sum = tf.reduce_sum(y ** 2, axis=0)
    if distributed:
        tape = hvd.DistributedGradientTape(tape, name="jac")
    return (tape.jacobian(y_sum, jac_w, experimental_use_pfor=use_pfor),
            tape.batch_jacobian(y, x, experimental_use_pfor=use_pfor))


jac_x = [data(k, (4, 3), seed=28) for k in range(n)]
jac_want = [np.mean([jacobians(tf.constant(a), distributed=False)[i].numpy() for a in jac_x], axis=0) for i in range(2)]
for mode, wrap in MODES:
    for use_pfor in (True, False):
        jac, batch_jac = wrap(jacobians)(tf.constant(jac_x[r]), use_pfor=use_pfor)
        check(f"{mode} jacobian, experimental_use_pfor={use_pfor}", jac, jac_want[0], tol=1e-5)
        check(f"{mode} batch_jacobian, experimental_use_pfor={use_pfor}", batch_jac, jac_want[1], tol=1e-5)


# ---- IndexedSlices: an embedding's gradient, gathered and densified --------------------------------
VOCAB, DIM = 10, 4
table0 = data(0, (VOCAB, DIM), seed=30)
ids = [np.random.default_rng(31 + k).integers(0, VOCAB, size=6) for k in range(n)]
ws = [data(k, (6, DIM), seed=32) for k in range(n)]


def dense_grad(k):
    g = np.zeros((VOCAB, DIM))
    np.add.at(g, ids[k], ws[k])
    return g


want_sparse_avg = np.mean([dense_grad(k) for k in range(n)], axis=0)


# a variable used by rank 0's loss only: with unconnected_gradients=ZERO every rank contributes (zeros where
# unconnected) and every rank gets the average (as the README says; without it the others wait, as in Horovod)
va, vb = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
for step in range(2):
    with tf.GradientTape() as tape_z:
        loss_z = tf.reduce_sum(va * va) + (tf.reduce_sum(vb * vb) if r == 0 else 0.0)
    ga, gb = hvd.DistributedGradientTape(tape_z, name="unconnected").gradient(
        loss_z, [va, vb], unconnected_gradients=tf.UnconnectedGradients.ZERO)
    check(f"unconnected=ZERO step {step}: the used variable", ga, [2.0, 4.0])
    check(f"unconnected=ZERO step {step}: the variable rank 0 alone uses", gb, [6.0 / n])


def embedding_grads(table, idx, w):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * tf.gather(table, idx))
    grad = tape.gradient(loss, table)
    assert isinstance(grad, tf.IndexedSlices)
    with tf.GradientTape() as tape2:
        loss2 = tf.reduce_sum(w * tf.gather(table, idx))
    dense_tape = hvd.DistributedGradientTape(tape2, sparse_as_dense=True, name="emb.dense")
    with tf.GradientTape() as tape3:
        loss3 = tf.reduce_sum(w * tf.gather(table, idx))
    sparse_tape = hvd.DistributedGradientTape(tape3, name="emb.sparse")
    return {
        "gathered": hvd.allreduce(grad, name="emb.allreduce"),
        "gathered_sum": hvd.allreduce(grad, op=hvd.Sum, name="emb.allreduce.sum"),
        "densified": hvd.allreduce(tf.convert_to_tensor(grad), name="emb.allreduce.dense"),
        "tape_dense": dense_tape.gradient(loss2, table),
        "tape_sparse": sparse_tape.gradient(loss3, table),
    }


for mode, wrap in MODES:
    table = tf.Variable(table0)
    out = wrap(embedding_grads)(table, tf.constant(ids[r]), tf.constant(ws[r]))
    for key in ("gathered", "gathered_sum", "tape_sparse"):
        assert isinstance(out[key], tf.IndexedSlices), f"{mode} {key}: {type(out[key])}"
        assert out[key].values.shape[0] == 6 * n, f"{mode} {key}: {out[key].values.shape}"
    for key in ("densified", "tape_dense"):
        assert not isinstance(out[key], tf.IndexedSlices), f"{mode} {key} should be dense"
    check(f"{mode} IndexedSlices average", tf.convert_to_tensor(out["gathered"]), want_sparse_avg)
    check(f"{mode} IndexedSlices sum", tf.convert_to_tensor(out["gathered_sum"]), want_sparse_avg * n)
    check(f"{mode} IndexedSlices densified", out["densified"], want_sparse_avg)
    check(f"{mode} tape sparse_as_dense", out["tape_dense"], want_sparse_avg)
    check(f"{mode} tape sparse", tf.convert_to_tensor(out["tape_sparse"]), want_sparse_avg)


# ---- no copies across the bridge, and TF never sees an unaligned DLPack buffer ----------------------
t = tf.random.normal([1000])
assert ptr(_bridge.to_numpy(t)) == ptr(np.from_dlpack(t)), "to_numpy copied the tensor"
b16 = tf.cast(t, tf.bfloat16)
assert ptr(_bridge.to_numpy(b16)) == ptr(np.from_dlpack(tf.bitcast(b16, tf.uint16))), "bfloat16 was copied"
from aiacc.tensors import aligned_empty  # noqa: E402

arr = aligned_empty((1000,), np.float32)
arr[:] = np.arange(1000)
assert ptr(np.from_dlpack(_bridge.from_numpy(arr))) == ptr(arr), "from_numpy copied an aligned array"
raw = np.arange(1001, dtype=np.float32)
unaligned = raw[1:]
assert ptr(unaligned) % 64, "test setup: the slice should be unaligned"
tens = _bridge.from_numpy(unaligned)  # TF would abort the process on this buffer; the bridge aligns a copy
assert ptr(np.from_dlpack(tens)) % 64 == 0 and np.array_equal(tens.numpy(), unaligned)
readonly = np.arange(8, dtype=np.float32)
readonly.flags.writeable = False
assert np.array_equal(_bridge.from_numpy(readonly).numpy(), readonly)
for mode, wrap in MODES:
    big = wrap(lambda v: hvd.allreduce(v, name=f"aligned.{mode}"))(t)
    assert ptr(np.from_dlpack(big)) % 64 == 0, f"{mode}: result not 64-byte aligned"
checks += 1

# ---- broadcast_variables / objects ----------------------------------------------------------------
v = tf.Variable(data(r, (5,), seed=40))
hvd.broadcast_variables([v], root_rank=n - 1)
check("broadcast_variables", v, data(n - 1, (5,), seed=40))
# two calls in one tf.function (Horovod's tensorflow2_mnist.py: the model's variables, then the optimizer's), with
# the default name: their broadcasts run together, so each call's names are made unique in the graph
pair = [tf.Variable(data(r, (5,), seed=41)), tf.Variable(data(r, (5,), seed=42))]


@tf.function
def broadcast_both():
    hvd.broadcast_variables(pair[:1], root_rank=0)
    hvd.broadcast_variables(pair[1:], root_rank=0)


broadcast_both()
check("broadcast_variables twice in one tf.function", tf.stack(pair), np.stack([data(0, (5,), seed=41),
                                                                                 data(0, (5,), seed=42)]))
obj = hvd.broadcast_object({"rank": r, "list": [r] * 3}, root_rank=n - 1)
assert obj == {"rank": n - 1, "list": [n - 1] * 3}, obj
assert hvd.allgather_object(r * 10) == [k * 10 for k in range(n)]
checks += 2


# ---- errors: clear, on every rank, never a hang ----------------------------------------------------
def expect(exc_types, words, fn):
    global checks
    raises(exc_types, fn, *words)
    checks += 1


shape = (2,) if r == 0 else (3,)
# Horovod's class and aiacc's, both: a mismatch is a FailedPreconditionError (see tf_horovod.py for graphs)
expect(hvd.TensorMismatchError, ["bad.eager", "shape"], lambda: hvd.allreduce(tf.ones(shape), name="bad.eager"))
expect(tf.errors.FailedPreconditionError, ["bad.eager2", "shape"],
       lambda: hvd.allreduce(tf.ones(shape), name="bad.eager2"))
expect(tf.errors.FailedPreconditionError, ["bad.function", "shape"],
       lambda: tf.function(lambda: hvd.allreduce(tf.ones(shape), name="bad.function"))())
# broadcast_variables sends each variable under its position (Keras numbers variable names per process): a mismatch
# names the variable too, which the error named only as 'broadcast_variables.0'
misfit = [tf.Variable(tf.zeros(shape), name="misfit")]


@tf.function
def broadcast_misfit():
    hvd.broadcast_variables(misfit, root_rank=0)


expect(tf.errors.FailedPreconditionError, ["'broadcast_variables.0'", "shape differs", "is variable 'misfit"],
       lambda: hvd.broadcast_variables(misfit, root_rank=0))
expect(tf.errors.FailedPreconditionError, ["shape differs", "is variable 'misfit"], broadcast_misfit)
# ... also when DistributedGradientTape finds it (its wait was a plain numpy_function: InvalidArgumentError in a
# graph, and eagerly the core's class only)
w_bad = tf.Variable(tf.ones(shape))


def tape_gradient():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w_bad * 2.0)
    return hvd.DistributedGradientTape(tape).gradient(loss, [w_bad])


expect(tf.errors.FailedPreconditionError, ["DistributedGradientTape", "shape differs across ranks"], tape_gradient)
expect(tf.errors.FailedPreconditionError, ["DistributedGradientTape", "shape differs across ranks"],
       tf.function(tape_gradient))
expect(TypeError, ["words", "string"], lambda: hvd.allreduce(tf.constant(["a", "b"]), name="words"))
expect(ValueError, ["allreduce", "not both"], lambda: hvd.allreduce(tf.ones(2), average=True, op=hvd.Sum))
expect(TypeError, ["u32", "uint32"], lambda: hvd.allgather(tf.ones([2], tf.uint32), name="u32"))
expect(ValueError, ["root", "root_rank=5"], lambda: hvd.broadcast(tf.ones(2), root_rank=5, name="root"))
expect(ValueError, ["scalar"], lambda: hvd.allgather(tf.constant(1.0), name="scalar"))
# tensors that are not dense: named, with what to pass instead (TensorFlow's conversion error named neither)
sparse_t, ragged_t = tf.sparse.from_dense(tf.ones([2])), tf.ragged.constant([[1.0], [2.0, 3.0]])
expect(TypeError, ["tensor 'sp' is a tf.SparseTensor", "tf.sparse.to_dense"], lambda: hvd.allreduce(sparse_t, name="sp"))
expect(TypeError, ["tensor 'sp' is a tf.SparseTensor"], lambda: hvd.grouped_allreduce([tf.ones(2), sparse_t], name="sp"))
expect(TypeError, ["tensor 'rg' is a tf.RaggedTensor", "to_tensor()"], lambda: hvd.allgather(ragged_t, name="rg"))
expect(TypeError, ["tensor 'rg' is a tf.RaggedTensor"], lambda: hvd.broadcast(ragged_t, 0, name="rg"))


def max_gradient():
    x = tf.Variable(tf.ones(3))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allreduce(x, op=hvd.Max, name="maxgrad"))
    return tape.gradient(y, x)


expect(NotImplementedError, ["maxgrad", "Max"], max_gradient)


def unnamed_min_gradient():
    x = tf.Variable(tf.ones(3))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allreduce(x, op=hvd.Min))
    return tape.gradient(y, x)


expect(NotImplementedError, ["allreduce of tensor '(unnamed)'", "Min"], unnamed_min_gradient)  # (was "tensor None")

# a tf.function differentiating an unnamed broadcast builds the same graph on every rank: the unnamed collective
# of the next tf.function, on a captured tensor, gets the same name everywhere (it was named from TensorFlow's
# counters, which the root's shorter gradient graph had left behind the others': a stall)
captured = tf.constant(np.ones(3))


@tf.function
def broadcast_gradient():
    with tf.GradientTape() as tape:
        tape.watch(captured)
        loss = tf.reduce_sum(hvd.broadcast(captured, 0))
    return tape.gradient(loss, captured)


@tf.function
def unnamed_on_captured():
    return hvd.allreduce(captured, op=hvd.Sum)


check("broadcast gradient in a tf.function", broadcast_gradient(), np.ones(3) * (1.0 if r == 0 else 0.0))
check("then an unnamed allreduce of a captured tensor", unnamed_on_captured(), np.full(3, float(n)))
expect(ValueError, ["gradient_predivide_factor"],
       lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0))
expect(RuntimeError, ["jit_compile", "'auto', turns XLA on where TensorFlow sees a GPU"],
       lambda: tf.function(lambda v: hvd.allreduce(v), jit_compile=True)(tf.ones(2)))
# the job's shape as ops, and join: aiacc's words too (XLA's named a PyFuncStateless / TensorDataset kernel)
expect(RuntimeError, ["aiacc_size: aiacc cannot run inside XLA-compiled code (jit_compile=True)"],
       lambda: tf.function(lambda v: v * tf.cast(hvd.size_op(), tf.float32), jit_compile=True)(tf.ones(2)))
expect(RuntimeError, ["join: aiacc cannot run inside XLA-compiled code"],
       lambda: tf.function(lambda: hvd.join(), jit_compile=True)())
expect(TypeError, ["DistributedGradientTape wraps a tf.GradientTape, not int"], lambda: hvd.DistributedGradientTape(42))
# one tensor given to a grouped call was taken as the list of its rows (each row reduced alone, no error)
for call in (hvd.grouped_allreduce, hvd.grouped_allgather, hvd.grouped_reducescatter):
    expect(TypeError, [f"{call.__name__} of 'one' takes a list of tensors, not one tensor (shape (2, 3))",
                       "(tensor), or pass [tensor]"], lambda: call(tf.ones((2, 3)), name="one"))
expect(ValueError, ["average", "op"], lambda: hvd.allreduce(tf.ones(2), average=True, op=hvd.Sum))
# a scale factor given as a tensor: eagerly its value; in a graph an error naming it (both were "Tensor is unhashable")
check("prescale_factor as an eager tensor", hvd.allreduce(tf.ones(2), op=hvd.Sum, prescale_factor=tf.constant(2.0),
                                                          name="factor.eager"), np.full(2, 2.0 * n))
expect(tf.errors.InvalidArgumentError, ["factor.graph", "postscale_factor=", "is not a number"],
       lambda: tf.function(lambda s: hvd.allreduce(tf.ones(2), postscale_factor=s, name="factor.graph"))(
           tf.constant(2.0)))
# the engine is still healthy afterwards
check("after errors", hvd.allreduce(tf.ones(4) * r, op=hvd.Sum, name="after"), np.full(4, n * (n - 1) / 2))

# Horovod's mpi_ops module holds the basics too (``from horovod.tensorflow.mpi_ops import Sum, rank``)
from aiacc.tensorflow import mpi_ops as horovod_mpi_ops  # noqa: E402

assert (horovod_mpi_ops.Sum, horovod_mpi_ops.Adasum, horovod_mpi_ops.rank(), horovod_mpi_ops.size()) == \
    (hvd.Sum, hvd.Adasum, r, n)
checks += 1

# second order through the collectives (a gradient penalty): each one's gradient is itself differentiable, as
# Horovod's registered gradients (it was None eagerly, an error about DatasetToSingleElement in a tf.function)
x_r = np.array([1.0 + r, 2.0])
xs = [np.array([1.0 + k, 2.0]) for k in range(n)]
y_avg = np.mean(xs, axis=0)
second_orders = {  # op -> (the op, this rank's second-order gradient of sum((d sum(op(x)^3) / dx)^2))
    "allreduce": (lambda x: hvd.allreduce(x, name="so.allreduce"), 36 * y_avg ** 3),
    "grouped_allreduce": (lambda x: hvd.grouped_allreduce([x], name="so.grouped")[0], 36 * y_avg ** 3),
    "allgather": (lambda x: hvd.allgather(x, name="so.allgather"), 18 * x_r ** 3),  # (Average, this rank's rows)
    "broadcast": (lambda x: hvd.broadcast(x, 0, name="so.broadcast"), 18 * xs[0] ** 3 * (r == 0)),
}


def second_order(op):
    x = tf.constant(x_r)
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            loss = tf.reduce_sum(op(x) ** 3)
        penalty = tf.reduce_sum(inner.gradient(loss, x) ** 2)
    return outer.gradient(penalty, x)


for label, (op, want) in second_orders.items():
    for how, run in (("eager", second_order), ("tf.function", tf.function(second_order))):
        got = run(op)
        assert got is not None, f"second order through {label} ({how}) is None"
        check(f"second order through {label} ({how})", got, want)

# alltoall's splits as a tf.Variable (TensorFlow refused it, captured in the custom gradient)
splits_var = tf.Variable([1] * n)
for how, run in (("eager", lambda: hvd.alltoall(tf.constant([10.0 * r + k for k in range(n)]), splits=splits_var,
                                               name="a2a.var")),
                 ("tf.function", tf.function(lambda: hvd.alltoall(tf.constant([10.0 * r + k for k in range(n)]),
                                                                  splits=splits_var, name="a2a.var.fn")))):
    rows, received = run()
    check(f"alltoall with splits a tf.Variable ({how})", rows, [10.0 * k + r for k in range(n)])
    assert received.numpy().tolist() == [1] * n, received

hvd.shutdown()
say(f"OK rank={r} checks={checks}")
