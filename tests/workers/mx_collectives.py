"""aiacc.mxnet's NDArray collectives and the Module API, against numpy references on every rank.

Inputs are deterministic functions of (rank, seed), so each rank computes what
every rank contributed and checks the answer. Also: the Module API with
``DistributedOptimizer`` (2 ranks on half batches) against a 1-process Module
on the whole batch, and the errors a user gets for misuse.
"""

import pickle
import warnings

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from aiacc.mxnet.tensors import numpy_view, writable_view
from mxnet import nd

from report import assert_matches, raises, say

hvd.init()
r, n = hvd.rank(), hvd.size()
assert 0 <= hvd.local_rank() < hvd.local_size() <= n
checks = 0
DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]


def data(rank, dtype, shape, seed):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(1, 5, size=shape).astype(dtype)
    return (rng.random(shape) + 0.5).astype(dtype)


def block_of(rows, k):
    """Rank k's rows of a reducescatter of ``rows`` rows: the first ``rows % n`` ranks keep one more."""
    counts = [rows // n + (j < rows % n) for j in range(n)]
    return slice(sum(counts[:k]), sum(counts[:k + 1]))


def check(what, got, want, dtype):
    global checks
    assert isinstance(got, nd.NDArray), f"{what}: returned {type(got).__name__}, not an NDArray"
    assert_matches(what, got.asnumpy(), want, dtype, {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12})
    checks += 1


# ---- zero copy: the engine's views are MXNet's memory -----------------------------------------
x = nd.zeros((4, 5))
view = writable_view(x, "x")
view[1, 2] = 7.0
assert x.asnumpy()[1, 2] == 7.0, "a write through the view did not reach the NDArray"
assert numpy_view(x, "x").__array_interface__["data"][0] == view.__array_interface__["data"][0]
before = view.__array_interface__["data"][0]
hvd.allreduce_(x, op=hvd.Sum, name="zero_copy")
assert writable_view(x, "x").__array_interface__["data"][0] == before, "allreduce_ moved the NDArray's memory"
assert x.asnumpy()[1, 2] == 7.0 * n

# ---- allreduce family ----------------------------------------------------------------------------
shape = (3, 5)
for seed, dtype in enumerate(DTYPES):
    ins = [data(k, dtype, shape, seed) for k in range(n)]
    as64 = np.stack([a.astype(np.float64) for a in ins])
    mine = nd.array(ins[r], dtype=dtype)
    total = as64.sum(0)
    avg = total // n if np.dtype(dtype).kind in "iu" else total / n
    check(f"allreduce Average {dtype}", hvd.allreduce(mine, name=f"avg.{dtype}"), avg, dtype)
    check(f"allreduce average=False {dtype}", hvd.allreduce(mine, average=False, name=f"sum.{dtype}"), total, dtype)
    check(f"allreduce Min {dtype}", hvd.allreduce(mine, op=hvd.Min, name=f"min.{dtype}"), as64.min(0), dtype)
    check(f"allreduce Max {dtype}", hvd.allreduce(mine, op=hvd.Max, name=f"max.{dtype}"), as64.max(0), dtype)
    assert np.array_equal(mine.asnumpy(), ins[r]), f"allreduce modified its input ({dtype})"
    inplace = nd.array(ins[r], dtype=dtype)
    assert hvd.allreduce_(inplace, op=hvd.Sum, name=f"inplace.{dtype}") is inplace
    check(f"allreduce_ {dtype}", inplace, total, dtype)
    if np.dtype(dtype).kind == "f":
        got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"scaled.{dtype}")
        check(f"allreduce scaled {dtype}", got, total * 1.5, dtype)
    # allgather: a different first dimension on every rank
    rows = [data(k, dtype, (k + 1, 2), seed + 50) for k in range(n)]
    check(f"allgather {dtype}", hvd.allgather(nd.array(rows[r], dtype=dtype), name=f"gather.{dtype}"),
          np.concatenate(rows), dtype)
    # broadcast from the last rank, new array and in place
    root = n - 1
    check(f"broadcast {dtype}", hvd.broadcast(mine, root_rank=root, name=f"bcast.{dtype}"), ins[root], dtype)
    assert np.array_equal(mine.asnumpy(), ins[r]), "broadcast modified its input"
    target = nd.array(ins[r], dtype=dtype)
    assert hvd.broadcast_(target, root_rank=root, name=f"bcast_.{dtype}") is target
    check(f"broadcast_ {dtype}", target, ins[root], dtype)

# grouped allreduce: one unit, mixed dtypes and shapes
group = [nd.array(data(r, "float32", (4,), 90)), nd.array(data(r, "float64", (2, 3), 91), dtype="float64")]
want = [np.mean([data(k, "float32", (4,), 90) for k in range(n)], 0),
        np.mean([data(k, "float64", (2, 3), 91) for k in range(n)], 0)]
outs = hvd.grouped_allreduce(group, name="group")
for o, w, d in zip(outs, want, ["float32", "float64"]):
    check("grouped_allreduce", o, w, d)
assert hvd.grouped_allreduce_(group, name="group_") is not None
for o, w, d in zip(group, want, ["float32", "float64"]):
    check("grouped_allreduce_", o, w, d)

# alltoall: equal parts, then uneven splits (rank k sends k+j+1 rows to rank j)
full = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3) + 100 * r
got = hvd.alltoall(nd.array(full), name="a2a")
want = np.concatenate([(np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3) + 100 * k)[2 * r:2 * r + 2]
                       for k in range(n)])
check("alltoall", got, want, "float32")
splits = [r + j + 1 for j in range(n)]
mine = np.concatenate([np.full((s, 2), 10 * r + j, np.int32) for j, s in enumerate(splits)])
rows, received = hvd.alltoall(nd.array(mine, dtype="int32"), splits=splits, name="a2a.splits")
want = np.concatenate([np.full((k + r + 1, 2), 10 * k + r, np.int32) for k in range(n)])
check("alltoall splits", rows, want, "int32")
check("alltoall received_splits", received, np.array([k + r + 1 for k in range(n)]), "int32")

# reducescatter
block = data(r, "float32", (2 * n, 3), 77)
got = hvd.reducescatter(nd.array(block), op=hvd.Sum, name="rs")
check("reducescatter", got, np.sum([data(k, "float32", (2 * n, 3), 77) for k in range(n)], 0)[2 * r:2 * r + 2],
      "float32")

# grouped allgather / reducescatter (one unit; mixed dtypes, first dimensions that differ per rank)
rows = [data(k, "float32", (k + 2, 3), 80) for k in range(n)]
ints = [data(k, "int64", (2 * n + 1,), 81) for k in range(n)]
got = hvd.grouped_allgather([nd.array(rows[r]), nd.array(ints[r], dtype="int64")], name="gag")
check("grouped_allgather[0]", got[0], np.concatenate(rows), "float32")
check("grouped_allgather[1]", got[1], np.concatenate(ints), "int64")
blocks = [data(k, "float64", (2 * n, 3), 82) for k in range(n)]
got = hvd.grouped_reducescatter([nd.array(blocks[r], dtype="float64"), nd.array(ints[r], dtype="int64")],
                                op=hvd.Sum, name="grs")
check("grouped_reducescatter[0]", got[0], np.sum(blocks, 0)[2 * r:2 * r + 2], "float64")
check("grouped_reducescatter[1]", got[1], np.sum(ints, 0)[block_of(2 * n + 1, r)], "int64")
# reducescatter scaling, Horovod's rounding: integers scale through float64 and truncate
got = hvd.reducescatter(nd.array(ints[r][:2 * n], dtype="int64"), op=hvd.Sum, name="rs.int.scaled",
                        prescale_factor=0.7, postscale_factor=1.5)
want = np.trunc(np.sum([np.trunc(a[:2 * n] * 0.7) for a in ints], 0) * 1.5)
check("reducescatter int prescale/postscale", got, want[2 * r:2 * r + 2], "int64")
got = hvd.grouped_reducescatter([nd.array(blocks[r], dtype="float64")], op=hvd.Average, name="grs.scaled",
                                prescale_factor=0.5, postscale_factor=4.0)
check("grouped_reducescatter scaled", got[0], np.mean(blocks, 0)[2 * r:2 * r + 2] * 2.0, "float64")
got = hvd.reducescatter(nd.array(block), op=hvd.Sum, name="rs.fp16", compression=hvd.Compression.fp16)
# the float16 values are summed in float32 and the sum rounded once (numpy's float16 sum rounds after each addition)
halves = [data(k, "float32", (2 * n, 3), 77).astype(np.float16).astype(np.float32) for k in range(n)]
check("reducescatter fp16 on the wire", got,
      np.sum(halves, 0)[2 * r:2 * r + 2].astype(np.float16).astype(np.float32), "float32")
# Horovod's build queries: MPI only, CPU NDArrays only
assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and not hvd.gloo_enabled()
assert (hvd.nccl_built(), hvd.cuda_built(), hvd.ccl_built(), hvd.ddl_built(), hvd.rocm_built()) == (0, False, False,
                                                                                                   False, False)

# objects
assert hvd.broadcast_object({"from": r}, root_rank=1) == {"from": 1}
assert hvd.allgather_object(r * 10) == [k * 10 for k in range(n)]
from aiacc.mxnet.functions import allgather_object, broadcast_object  # noqa: E402 - Horovod's module path

assert broadcast_object([r], root_rank=0) == [0] and allgather_object(r) == list(range(n))
say(f"COLLECTIVES_OK rank={r} checks={checks}")

# ---- Module API: DistributedOptimizer vs one process on the whole batch -------------------------
STEPS, GLOBAL, FEAT = 20, 24, 10  # 24 rows split evenly over 2, 3 or 4 ranks
local = GLOBAL // n
rng = np.random.default_rng(3)
X = rng.standard_normal((STEPS, GLOBAL, FEAT)).astype(np.float32)
Y = rng.integers(0, 3, size=(STEPS, GLOBAL)).astype(np.float32)


def module(batch):
    d = mx.sym.Variable("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(d, num_hidden=16, name="fc1"), act_type="relu")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(h, num_hidden=3, name="fc2"), name="softmax")
    mod = mx.mod.Module(out, context=mx.cpu())
    mod.bind(data_shapes=[("data", (batch, FEAT))], label_shapes=[("softmax_label", (batch,))])
    return mod


mx.random.seed(200 + r)
dist = module(local)
dist.init_params(mx.init.Xavier())
args, auxs = dist.get_params()
hvd.broadcast_parameters(args, root_rank=0)
dist.set_params(args, auxs)
initial = {k: v.asnumpy() for k, v in args.items()}  # get_params() hands out live arrays
sgd = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / local)
wrapped = hvd.DistributedOptimizer(sgd)
assert isinstance(wrapped, hvd.DistributedOptimizer) and wrapped is not sgd
assert hvd.DistributedOptimizer(wrapped) is wrapped and wrapped._optimizer is sgd, "wrapped twice"
assert isinstance(pickle.loads(pickle.dumps(wrapped)), hvd.DistributedOptimizer), "unpickled optimizer lost aiacc"
dist.init_optimizer(optimizer=wrapped)
ref = module(GLOBAL)
ref.init_params(arg_params=args, aux_params=auxs)
ref.init_optimizer(optimizer=mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / GLOBAL))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for step in range(STEPS):
        xs, ys = X[step, r * local:(r + 1) * local], Y[step, r * local:(r + 1) * local]
        dist.forward(mx.io.DataBatch([nd.array(xs)], [nd.array(ys)]), is_train=True)
        dist.backward()
        dist.update()
        ref.forward(mx.io.DataBatch([nd.array(X[step])], [nd.array(Y[step])]), is_train=True)
        ref.backward()
        ref.update()
got, _ = dist.get_params()
want, _ = ref.get_params()
for k in want:
    a, b = got[k].asnumpy(), want[k].asnumpy()
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    assert rel <= 1e-5, f"Module API: {k} differs from the reference by {rel:.2e}"
    assert float(np.abs(a - initial[k]).max()) > 1e-3, f"Module API: {k} did not train"
# broadcast before training: the optimizer's same-start check (before the second step's first update) is quiet
assert not [w for w in seen if "do not train the same model" in str(w.message)], [str(w.message) for w in seen]
say(f"MODULE_OK rank={r}")

# the same Module without the broadcast (each rank its own initial weights): the check warns on every rank once,
# naming Module's parameters (the biases start at zero everywhere) and the other ranks
mx.random.seed(300 + r)
alone = module(local)
alone.init_params(mx.init.Xavier())
alone.init_optimizer(optimizer=hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1)))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for step in range(3):
        alone.forward(mx.io.DataBatch([nd.array(X[step, :local])], [nd.array(Y[step, :local])]), is_train=True)
        alone.backward()
        alone.update()
same = [str(w.message) for w in seen if "do not train the same model" in str(w.message)]
others = ", ".join(map(str, range(1, n)))
assert len(same) == 1 and f"'fc1_weight', 'fc2_weight' (2 of 4) on rank{'s' if n > 2 else ''} {others} are not " \
    "those of rank 0" in same[0] and "mod.set_params(arg_params, aux_params)" in same[0], same
say(f"MODULE_SAME_START_OK rank={r}")

# ---- misuse: clear errors -----------------------------------------------------------------------
raises(hvd.TensorMismatchError, lambda: hvd.allreduce(nd.ones((2 + r, 3)), name="bad.shape"),
       "bad.shape", "rank 0", "rank 1")
errors = {  # what the user does wrong -> words the message must contain
    "sparse": (lambda: hvd.allreduce(nd.sparse.zeros("row_sparse", (4, 2)), name="sparse"), "'sparse'"),
    "not an ndarray": (lambda: hvd.allreduce(np.ones(3), name="numpy"), "expected an mxnet NDArray"),
    "op and average": (lambda: hvd.allreduce(nd.ones(3), average=True, op=hvd.Sum, name="both"), "not both"),
    "root out of range": (lambda: hvd.broadcast(nd.ones(3), root_rank=n, name="root"), f"root_rank={n}"),
    "optimizer type": (lambda: hvd.DistributedOptimizer("sgd"), "mx.optimizer.Optimizer"),
    "predivide": (lambda: hvd.DistributedTrainer([], "sgd", gradient_predivide_factor=0.0),
                  "gradient_predivide_factor"),
    "params type": (lambda: hvd.broadcast_parameters([nd.ones(3)]), "ParameterDict or a dict"),
    # bool NDArrays are reduced as in every adapter (the core's dtypes): Average of bools is the core's error
    "bool average": (lambda: hvd.allreduce(nd.ones(3, dtype="bool"), name="flags"),
                     "'flags': op=Average is not defined for bool tensors"),
    # MXNet's bfloat16 (numpy sees a structured 'void16'): named as bfloat16, with what to do (was: "has dtype
    # void16, which aiacc does not support; supported: bfloat16, ...")
    "bfloat16": (lambda: hvd.allreduce(nd.ones(3, dtype="bfloat16"), name="half"),
                 "tensor 'half' is a bfloat16 NDArray, which aiacc.mxnet does not take"),
    "row_sparse": (lambda: hvd.allreduce(nd.ones((4, 2)).tostype("row_sparse"), name="rows"),
                   "storage type 'row_sparse'; aiacc.mxnet reduces dense NDArrays only: convert it with .tostype"),
    # one NDArray given to a grouped call was taken as the list of its rows (each row reduced alone, no error)
    "one NDArray grouped": (lambda: hvd.grouped_allreduce(nd.ones((3, 2)), name="one"),
                            "grouped_allreduce of 'one' takes a list of tensors, not one tensor (shape (3, 2))"),
    "one NDArray grouped_": (lambda: hvd.grouped_allreduce_(nd.ones((3, 2)), name="one"), "allreduce_(tensor)"),
    "one NDArray gathered": (lambda: hvd.grouped_allgather(nd.ones((3, 2)), name="one"), "allgather(tensor)"),
    "one NDArray scattered": (lambda: hvd.grouped_reducescatter(nd.ones((3, 2)), name="one"),
                              "reducescatter(tensor), or pass [tensor]"),
}
for what, (call, words) in errors.items():
    say(f"ERROR_OK rank={r} {what}: {raises((TypeError, ValueError), call, words)}")
# arguments a collective cannot run with: ValueErrors that MXNet code also catches as RuntimeError
# (Horovod's MXNet ops raise them as MXNetError, a RuntimeError); a scalar is Horovod's ValueError
arg_errors = {
    "float splits": (RuntimeError, lambda: hvd.alltoall(nd.ones(n), splits=nd.ones(n, dtype="float32"),
                                                        name="fsplits"),
                     "'fsplits'", "splits must have an integer dtype, got float32"),
    "splits too long": (RuntimeError, lambda: hvd.alltoall(nd.ones(n - 1), splits=nd.ones(n, dtype="int32"),
                                                           name="long"),
                        "'long'", f"must be {n} non-negative numbers summing to the first dimension {n - 1}"),
    "uneven rows": (RuntimeError, lambda: hvd.alltoall(nd.ones(n + 1), name="uneven"), "'uneven'",
                    f"first dimension {n + 1} is not divisible by {n} ranks"),
    "scalar reducescatter": (ValueError, lambda: hvd.reducescatter(nd.array(r), name="scalar"), "'scalar'",
                             "needs at least one dimension"),
    "scalar in a group": (ValueError, lambda: hvd.grouped_reducescatter([nd.zeros((3, 1)), nd.array(r)],
                                                                        name="pair"),
                          "tensor 1 of group 'pair'", "needs at least one dimension"),
}
for what, (kind, call, *words) in arg_errors.items():
    say(f"ERROR_OK rank={r} {what}: {raises(kind, call, *words)}")
hvd.barrier()  # shutdown() stops every rank: wait until all have finished their checks
# Horovod's mpi_ops module holds the basics too (``from horovod.mxnet.mpi_ops import Sum, rank``)
from aiacc.mxnet import mpi_ops as horovod_mpi_ops  # noqa: E402

assert (horovod_mpi_ops.Sum, horovod_mpi_ops.Adasum, horovod_mpi_ops.rank(), horovod_mpi_ops.size()) == \
    (hvd.Sum, hvd.Adasum, r, n)
say(f"OK rank={r}")
hvd.shutdown()
