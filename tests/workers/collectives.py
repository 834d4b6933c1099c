"""Every collective and dtype against a numpy reference computed on each rank.

Inputs are deterministic functions of (rank, tensor), so each rank computes
what every other rank contributed and checks the engine's answer exactly
(integers) or to the dtype's precision (floats).
"""

import sys
import threading
import warnings

import numpy as np

import aiacc
from report import raises, say
from aiacc.compression import bfloat16_dtype

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
BF16 = bfloat16_dtype()
DTYPES = [np.float16, np.float32, np.float64, np.int16, np.uint16, np.int32, np.int64, np.uint8] + ([BF16] if BF16 is not None else [])
checks = 0


def tol(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return 2e-3
    if BF16 is not None and dtype == BF16:
        return 2e-2
    if dtype == np.float32:
        return 1e-6
    if dtype in (np.float64, np.complex128):
        return 1e-12
    if dtype == np.complex64:
        return 1e-6
    return 0


def data(rank, dtype, shape, seed):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(1, 5, size=shape).astype(dtype)
    return (rng.random(shape) + 0.5).astype(dtype)


def check(name, got, want, dtype, tolerance=None):
    global checks
    got = np.asarray(got)
    assert got.dtype == np.dtype(dtype), f"{name}: dtype {got.dtype} != {np.dtype(dtype)}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    wide = np.complex128 if got.dtype.kind == "c" else np.float64
    g, w = got.astype(wide), want.astype(wide)
    t = tol(dtype) if tolerance is None else tolerance
    if t == 0:
        assert np.array_equal(g, w), f"{name}: {g.ravel()[:6]} != {w.ravel()[:6]}"
    else:
        assert np.allclose(g, w, rtol=t, atol=t), f"{name}: max err {np.abs(g - w).max()} (tol {t})"
    checks += 1


REDUCERS = {
    aiacc.Sum: lambda xs: np.sum(xs, axis=0),
    aiacc.Min: lambda xs: np.min(xs, axis=0),
    aiacc.Max: lambda xs: np.max(xs, axis=0),
    aiacc.Product: lambda xs: np.prod(xs, axis=0),
}

def moved(make, dtype, dname, x, ins, seed, prefix=""):
    """allgather (a first dimension that differs per rank), broadcast of ``x`` from every root and alltoall of
    equal parts, of ``make(rank, dtype, shape, seed)`` arrays, against references from every rank's inputs (the
    real and the complex dtypes below). Returns the gathered parts."""
    parts = [make(k, dtype, (k + 1, 2), seed + 50) for k in range(n)]
    check(f"allgather {dname}", aiacc.allgather(parts[r], name=f"{prefix}ag.{dname}"), np.concatenate(parts), dtype)
    for root in range(n):
        check(f"broadcast root={root} {dname}", aiacc.broadcast(x, root, name=f"{prefix}bc.{root}.{dname}"),
              ins[root], dtype)
    rows = [make(k, dtype, (2 * n, 3), seed + 80) for k in range(n)]
    got = aiacc.alltoall(rows[r], name=f"{prefix}a2a.{dname}")
    check(f"alltoall {dname}", got, np.concatenate([rows[k][2 * r:2 * r + 2] for k in range(n)]), dtype)
    return parts


def scattered(make, dtype, dname, seed, wide, prefix=""):
    """reducescatter Sum of 7 rows, which do not divide evenly: the first 7 % n ranks get one more (the sum taken in
    ``wide``). Returns (every rank's rows, this rank's part of their sum in ``wide``)."""
    big = [make(k, dtype, (7, 2), seed + 120) for k in range(n)]
    base, extra = divmod(7, n)
    start = r * base + min(r, extra)
    mine = base + (1 if r < extra else 0)
    want = np.sum([b.astype(wide) for b in big], axis=0)[start:start + mine]
    check(f"reducescatter Sum {dname}", aiacc.reducescatter(big[r], op=aiacc.Sum, name=f"{prefix}rs.{dname}"),
          want.astype(dtype), dtype)
    return big, want


shape = (3, 5)
for seed, dtype in enumerate(DTYPES):
    dname = np.dtype(dtype).name
    ins = [data(k, dtype, shape, seed) for k in range(n)]
    as64 = [a.astype(np.float64) for a in ins]
    x = ins[r]
    # allreduce: every op
    for op, red in REDUCERS.items():
        check(f"allreduce {op} {dname}", aiacc.allreduce(x, op=op, name=f"ar.{op}.{dname}"), red(as64).astype(dtype), dtype)
    total = np.sum(as64, axis=0)
    avg_want = (total // n) if np.dtype(dtype).kind in "iu" else total / n
    check(f"allreduce Average {dname}", aiacc.allreduce(x, name=f"ar.avg.{dname}"), avg_want.astype(dtype), dtype)
    if np.dtype(dtype).kind in "iu":  # Horovod folds the average into the postscale: one factor, truncated once
        got = aiacc.allreduce(x, postscale_factor=3.0, name=f"ar.avg.post.{dname}")
        check(f"allreduce Average postscale {dname}", got, np.trunc(total * (3.0 / n)).astype(dtype), dtype)
    else:  # Max / Min with a NaN on rank 0: NaN on every rank (numpy's rule; MPI's own op is order-dependent)
        y = x.copy()
        y[0, 0] = np.nan if r == 0 else 1
        for op, red in ((aiacc.Max, np.max), (aiacc.Min, np.min)):
            got = aiacc.allreduce(y, op=op, name=f"ar.nan.{op}.{dname}").astype(np.float64)
            want = red([a.astype(np.float64) for a in ins], axis=0)
            assert np.isnan(got[0, 0]) and np.allclose(got.ravel()[1:], want.ravel()[1:]), f"{op} NaN {dname}: {got}"
            checks += 1
    if np.dtype(dtype).kind == "f":
        got = aiacc.allreduce(x, op=aiacc.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"ar.scaled.{dname}")
        check(f"allreduce scaled {dname}", got, (np.sum([a * 0.5 for a in as64], axis=0) * 3.0).astype(dtype), dtype)
    # the input is never modified
    assert np.array_equal(x, ins[r]), "allreduce modified its input"
    moved(data, dtype, dname, x, ins, seed)
    # alltoall with explicit splits
    splits_of = lambda k: [(k + j) % 3 for j in range(n)]  # noqa: E731
    srcs = [data(k, dtype, (sum(splits_of(k)), 2), seed + 90) for k in range(n)]
    got, received = aiacc.alltoall(srcs[r], splits=splits_of(r), name=f"a2av.{dname}")
    want_parts = []
    for k in range(n):
        start = sum(splits_of(k)[:r])
        want_parts.append(srcs[k][start:start + splits_of(k)[r]])
    check(f"alltoall splits {dname}", got, np.concatenate(want_parts), dtype)
    assert list(received) == [splits_of(k)[r] for k in range(n)], f"received splits {received}"
    scattered(data, dtype, dname, seed, np.float64)

# bool: every op reduces as numpy does on bool arrays (MPI itself has only logical ops for them)
flags = [np.array([k % 2 == 0, k == 0, True, False]) for k in range(n)]
for op, red in REDUCERS.items():
    check(f"allreduce {op} bool", aiacc.allreduce(flags[r], op=op, name=f"ar.{op}.bool"),
          red(np.stack(flags)).astype(bool), np.bool_)

# async forms, poll and synchronize
handles = [aiacc.allreduce_async(np.full(4, k + r, np.float32), op=aiacc.Sum, name=f"async.{k}") for k in range(50)]
for k, h in enumerate(handles):
    check(f"async {k}", aiacc.synchronize(h), np.full(4, n * k + n * (n - 1) / 2, np.float32), np.float32)
    assert aiacc.poll(h)
h = aiacc.allgather_async(np.array([r], np.int64), name="async.ag")
check("allgather_async", aiacc.synchronize(h), np.arange(n, dtype=np.int64), np.int64)
h = aiacc.broadcast_async(np.array([r + 10.0]), 0, name="async.bc")
check("broadcast_async", h.wait(), np.array([10.0]), np.float64)
out, _ = aiacc.synchronize(aiacc.alltoall_async(np.arange(n, dtype=np.int32) + 10 * r, name="async.a2a"))
check("alltoall_async", out, np.array([10 * k + r for k in range(n)], np.int32), np.int32)
check("reducescatter_async", aiacc.synchronize(aiacc.reducescatter_async(np.ones((n, 1), np.float32), name="async.rs")),
      np.ones((1, 1), np.float32), np.float32)

# grouped allreduce: mixed dtypes, one unit
g = aiacc.grouped_allreduce([np.full(3, r, np.float32), np.full((2, 2), r + 1, np.int64)], op=aiacc.Sum, name="group")
check("grouped f32", g[0], np.full(3, n * (n - 1) / 2, np.float32), np.float32)
check("grouped i64", g[1], np.full((2, 2), n * (n + 1) // 2, np.int64), np.int64)
g = aiacc.synchronize(aiacc.grouped_allreduce_async([np.ones(2), np.ones(1)], name="group.async"))
check("grouped_async", g[1], np.ones(1), np.float64)

# unnamed operations match up by call order
check("noname", aiacc.allreduce(np.array([float(r)]), op=aiacc.Max), np.array([n - 1.0]), np.float64)

# a large tensor (bigger than a fusion buffer slice) and a 0-d one
big = np.full(1 << 20, r + 1, np.float32)
check("large", aiacc.allreduce(big, op=aiacc.Sum, name="large"), np.full(1 << 20, n * (n + 1) / 2, np.float32), np.float32)
check("scalar", aiacc.allreduce(np.float64(r), op=aiacc.Sum, name="scalar"), np.array(n * (n - 1) / 2), np.float64)

# fp16 compression of float32 gradients: results come back as float32
x = np.linspace(0, 1, 100, dtype=np.float32) * (r + 1)
got = aiacc.allreduce(x, name="compressed", compression=aiacc.Compression.fp16)
# on the wire in float16: within float16's precision of the exact average
check("fp16 compression", got, (np.linspace(0, 1, 100) * (n + 1) / 2).astype(np.float32), np.float32, tolerance=2e-3)

# grouped allgather and reducescatter: first dimensions differ per rank and per tensor
ga = aiacc.grouped_allgather([data(r, np.float32, (r + 1, 2), 300), data(r, np.int64, (2 * r + 1,), 301)],
                             name="grouped.ag")
check("grouped allgather 0", ga[0], np.concatenate([data(k, np.float32, (k + 1, 2), 300) for k in range(n)]),
      np.float32)
check("grouped allgather 1", ga[1], np.concatenate([data(k, np.int64, (2 * k + 1,), 301) for k in range(n)]), np.int64)
parts = [[data(k, np.float64, (5, 3), 310), data(k, np.int32, (n + 1,), 311)] for k in range(n)]
rs = aiacc.grouped_reducescatter(parts[r], op=aiacc.Sum, prescale_factor=2.0, name="grouped.rs")
for i, (rows, dtype) in enumerate(((5, np.float64), (n + 1, np.int32))):
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    total = 2 * np.sum([parts[k][i].astype(np.float64) for k in range(n)], axis=0)
    check(f"grouped reducescatter {i}", rs[i], total[start:start + base + (1 if r < extra else 0)].astype(dtype), dtype)
# reducescatter with fp16 on the wire: float32 results within float16's precision
x = np.linspace(0, 1, 4 * n, dtype=np.float32).reshape(2 * n, 2) * (r + 1)
got = aiacc.reducescatter(x, op=aiacc.Average, name="rs.fp16", compression=aiacc.Compression.fp16)
want = (np.linspace(0, 1, 4 * n).reshape(2 * n, 2) * (n + 1) / 2)[2 * r:2 * r + 2].astype(np.float32)
check("reducescatter fp16", got, want, np.float32, tolerance=2e-3)

# a small result fused with large ones: kept (a loss logged every step), it holds about its own bytes
# (it was a view of the whole fused buffer: 1.2 GB after 100 steps of a 12 MB buffer)


def held(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.nbytes


big = [np.full(50_000, k + r, np.float32) for k in range(3)]
fused = 0
for attempt in range(100):  # (rounds after the first, whose four are fused into one collective: agreed by every rank)
    before = aiacc.summary()["allreduces"]
    handles = [aiacc.allreduce_async(b, op=aiacc.Sum, name=f"keep.big{k}") for k, b in enumerate(big)]
    small = aiacc.synchronize(aiacc.allreduce_async(np.array([r], np.float32), op=aiacc.Sum, name="keep.loss"))
    bigs = [aiacc.synchronize(h) for h in handles]
    if attempt and aiacc.summary()["allreduces"] == before + 1:
        assert held(small) < 1024, (attempt, held(small))  # (4 bytes, aligned: 68)
        fused += 1
        if fused == 3:
            break
else:
    raise AssertionError(f"four allreduces submitted together were fused {fused} times in 100 rounds")
check("fused small result", small, np.array([n * (n - 1) / 2], np.float32), np.float32)
assert np.array_equal(bigs[2], np.full(50_000, 2 * n + n * (n - 1) / 2, np.float32)), bigs[2][:4]
checks += 1

# python objects
obj = aiacc.broadcast_object({"rank": r, "data": list(range(r + 3))}, root_rank=n - 1)
assert obj == {"rank": n - 1, "data": list(range(n + 2))}, obj
assert aiacc.allgather_object(("r", r) * (r + 1)) == [("r", k) * (k + 1) for k in range(n)]
checks += 2


def make_config():  # a class defined in a function, and a lambda: cloudpickle carries them, as Horovod's
    class Config:
        scale = 3
    return Config


fn = aiacc.broadcast_object((lambda v: v * 2 + r) if r == 0 else None, root_rank=0, name="obj.lambda")
assert fn(5) == 10, fn(5)
assert aiacc.allgather_object(make_config() if r else None, name="obj.class")[-1].scale == 3
# an object that cannot be pickled: the error on every rank, naming the rank (the others waited for ever)
lock = threading.Lock()
raises(ValueError, lambda: aiacc.broadcast_object(lock if r == n - 1 else None, root_rank=n - 1, name="obj.lock"),
       f"broadcast_object 'obj.lock': the object of rank {n - 1} cannot be pickled")
raises(ValueError, lambda: aiacc.allgather_object(lock if r == 1 else r, name="obj.lock2"),
       "allgather_object 'obj.lock2': the object of rank 1 cannot be pickled")
checks += 4
# Average is the sum divided by n, rounded once (as torch's sum / n and DDP; a multiply by 1/n rounded to float32
# put 1/3 of a 3-rank average's elements 1 ulp off); pre/postscale factors multiply as in Horovod (its tests pin
# it): in the dtype, the factor rounded to it. Exact, against the engine's own Sum (its summation order); alone
# and fused with other tensors (grouped).
for dtype in (np.float32, np.float64):
    x = (np.arange(1, 2001) / 7 * (r + 1)).astype(dtype)
    parts = [x[:700], x[700:1500], x[1500:]]
    total = aiacc.allreduce(x, op=aiacc.Sum, name=f"exact.sum.{dtype.__name__}")
    pre = x * dtype(0.1)
    pre_total = aiacc.allreduce(pre, op=aiacc.Sum, name=f"exact.presum.{dtype.__name__}")
    for how, run in (("alone", lambda k, **kw: aiacc.allreduce(x, name=f"exact.{k}.{dtype.__name__}", **kw)),
                     ("grouped", lambda k, **kw: np.concatenate(aiacc.grouped_allreduce(
                         parts, name=f"exact.g.{k}.{dtype.__name__}", **kw)))):
        check(f"exact Average {how} {dtype.__name__}", run("avg"), total / dtype(n), dtype, tolerance=0)
        check(f"exact postscale {how} {dtype.__name__}", run("post", op=aiacc.Sum, postscale_factor=0.1),
              total * dtype(0.1), dtype, tolerance=0)
        check(f"exact prescale {how} {dtype.__name__}", run("pre", op=aiacc.Sum, prescale_factor=0.1), pre_total,
              dtype, tolerance=0)

# a float16 sum beyond its range is inf, without numpy's overflow warning (it leaked from the cast)
with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = aiacc.allreduce(np.full(4, 60000, np.float16), op=aiacc.Sum, name="f16.overflow")
check("float16 overflow", got, np.full(4, np.inf, np.float16), np.float16, tolerance=0)
# not a handle: a TypeError saying so (an AttributeError before)
raises(TypeError, lambda: aiacc.synchronize(12345), "synchronize() takes the handle an *_async call returned, not int 12345")
raises(TypeError, lambda: aiacc.poll(None), "poll() takes the handle an *_async call returned, not NoneType None")
checks += 2

# gradient_predivide_factor splits the average across prescale and postscale
op, pre, post = aiacc.average_factors(aiacc.Average, 4.0)
check("predivide", aiacc.allreduce(np.full(3, r + 1.0), op=op, prescale_factor=pre, postscale_factor=post,
                                   name="predivide"), np.full(3, (n + 1) / 2), np.float64)

# complex64 / complex128: every collective that is defined for them (Sum and Average, scaled, fused with real
# tensors, grouped; gathers, broadcasts, alltoall, reducescatter), against references from every rank's inputs
# (the names repeat over 3 steps: the later ones go through the cached runs and the host's shared window)
def cdata(rank, dtype, shape, seed):
    rng = np.random.default_rng(seed * 1000 + rank)
    return (rng.random(shape) + 0.5 + 1j * (rng.random(shape) - 0.5)).astype(dtype)


for seed, dtype in enumerate((np.complex64, np.complex128), 700):
    dname = np.dtype(dtype).name
    ins = [cdata(k, dtype, (3, 5), seed) for k in range(n)]
    total = np.sum([a.astype(np.complex128) for a in ins], axis=0)
    x = ins[r]
    check(f"allreduce Sum {dname}", aiacc.allreduce(x, op=aiacc.Sum, name=f"c.sum.{dname}"), total.astype(dtype), dtype)
    check(f"allreduce Average {dname}", aiacc.allreduce(x, name=f"c.avg.{dname}"), (total / n).astype(dtype), dtype)
    got = aiacc.allreduce(x, op=aiacc.Average, prescale_factor=0.5, postscale_factor=3.0, name=f"c.scaled.{dname}")
    check(f"allreduce scaled {dname}", got, (total * 0.5 * 3.0 / n).astype(dtype), dtype)
    assert np.array_equal(x, ins[r]), "allreduce modified its complex input"
    for step in range(3):  # complex and real tensors submitted together, in place and not
        reals = [data(r, np.float32, (7 + i,), seed + 10 * i + step) for i in range(3)]
        cplx = [cdata(r, dtype, (5 + i, 2), seed + 10 * i + step) for i in range(3)]
        hs = [aiacc.allreduce_async_(a, op=aiacc.Average, name=f"c.fused.f.{dname}.{i}") for i, a in enumerate(reals)]
        hc = [aiacc.allreduce_async(a, op=aiacc.Sum, name=f"c.fused.c.{dname}.{i}") for i, a in enumerate(cplx)]
        for i, h in enumerate(hc):
            want = np.sum([cdata(k, dtype, (5 + i, 2), seed + 10 * i + step) for k in range(n)], axis=0)
            check(f"fused complex {dname} {step} {i}", aiacc.synchronize(h), want, dtype)
        for i, h in enumerate(hs):
            want = np.mean([data(k, np.float32, (7 + i,), seed + 10 * i + step).astype(np.float64) for k in range(n)], 0)
            check(f"fused real {dname} {step} {i}", aiacc.synchronize(h), want.astype(np.float32), np.float32)
        g = aiacc.grouped_allreduce([cplx[0], reals[1], cplx[2].astype(np.complex128)], op=aiacc.Average,
                                    name=f"c.group.{dname}")
        srcs = [[cdata(k, dtype, (5, 2), seed + step), data(k, np.float32, (8,), seed + 10 + step),
                 cdata(k, dtype, (7, 2), seed + 20 + step).astype(np.complex128)] for k in range(n)]
        for i, dt in enumerate((dtype, np.float32, np.complex128)):
            want = np.mean([s[i].astype(np.complex128 if i != 1 else np.float64) for s in srcs], axis=0)
            check(f"grouped complex {dname} {step} {i}", g[i], want.astype(dt), dt)
    parts = moved(cdata, dtype, dname, x, ins, seed, "c.")
    big, want = scattered(cdata, dtype, dname, seed, np.complex128, "c.")
    check(f"reducescatter Average {dname}", aiacc.reducescatter(big[r], name=f"c.rs.avg.{dname}"),
          (want / n).astype(dtype), dtype)
    ga = aiacc.grouped_allgather([parts[r], data(r, np.int64, (r + 1,), 9)], name=f"c.gag.{dname}")
    check(f"grouped allgather {dname}", ga[0], np.concatenate(parts), dtype)
    rs = aiacc.grouped_reducescatter([big[r], big[r].real.copy()], op=aiacc.Sum, name=f"c.grs.{dname}")
    check(f"grouped reducescatter {dname}", rs[0], want.astype(dtype), dtype)
    check(f"grouped reducescatter real {dname}", rs[1], want.real.astype(rs[1].dtype), rs[1].dtype)
    # what is not defined for complex numbers: an error naming the tensor, its dtype and the op, on every rank,
    # before anything is sent (the job goes on)
    for op in (aiacc.Min, aiacc.Max, aiacc.Product):
        raises(TypeError, lambda: aiacc.allreduce(x, op=op, name=f"c.bad.{op}"),
               f"allreduce of tensor 'c.bad.{op}': op={op} is not defined for complex tensors ({dname})")
        raises(TypeError, lambda: aiacc.grouped_allreduce([reals[0], x], op=op, name=f"c.gbad.{op}"),
               f"allreduce of tensor 'c.gbad.{op}': op={op} is not defined for complex tensors ({dname})")
    raises(TypeError, lambda: aiacc.reducescatter(big[r], op=aiacc.Max, name="c.rsbad"),
           f"reducescatter of tensor 'c.rsbad': op=Max is not defined for complex tensors ({dname})")
    raises(TypeError, lambda: aiacc.allreduce(x, op=aiacc.Adasum, name="c.adasum"),
           f"allreduce of tensor 'c.adasum' with op=Adasum: Adasum combines float16, float32 and float64 host "
           f"arrays (as Horovod), not {dname}")
    raises(TypeError, lambda: aiacc.allreduce(x, op=aiacc.ReduceOp.BAND, name="c.band"),
           f"allreduce of tensor 'c.band': op=Band is a bitwise operation, defined for integer and bool tensors, "
           f"not {dname}")
    checks += 9
    # fp16 / bf16 compression leaves complex tensors as they are (as it leaves integers)
    got = aiacc.allreduce(x, op=aiacc.Sum, name=f"c.fp16.{dname}", compression=aiacc.Compression.fp16)
    check(f"fp16 compression {dname}", got, total.astype(dtype), dtype)
assert aiacc.allreduce(np.array([1.0]), name="c.after").item() == 1.0  # the engine goes on after the refusals

aiacc.barrier()
say(f"OK rank={r} checks={checks}")
aiacc.shutdown()
sys.exit(0)
