"""Fusion buffers reduced through the host's shared-memory window (``aiacc.transport.shm``): results equal to
a reference computed from every rank's inputs, the same bytes on every rank, and proof (a count) of which
buckets took the window and which took MPI.

Run with AIACC_SHM_BYTES=16KiB and AIACC_FUSION_THRESHOLD=64KiB: a cycle then makes several buckets, one
after the other through the same window slots or (those larger than a slot) through MPI.
"""

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
engine = aiacc.get_engine()
shared = engine.executor.shared
slot = engine.config.shm_bytes
assert (shared is not None) == (slot > 0), (shared, slot)
checks = 0


def inputs(k: int, step: int, i: int, dtype) -> np.ndarray:
    """Rank ``k``'s tensor ``i`` at ``step`` (every rank can compute every rank's)."""
    rng = np.random.default_rng(1000 * step + 10 * i + k)
    size = 1 + (37 * i) % 150  # 24 of them fill at most 14.4 KB (float64): a slot
    if np.dtype(dtype).kind == "f":
        return rng.uniform(-2, 2, size).astype(dtype)
    return rng.integers(-50, 50, size).astype(dtype)


ops = {aiacc.Sum: np.add, aiacc.Average: np.add, aiacc.Min: np.minimum, aiacc.Max: np.maximum,
       aiacc.Product: np.multiply}
before = shared.reductions if shared is not None else 0
for step in range(4):  # the same names every step: remembered layouts, views of the result slot
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        for op, ufunc in ops.items():
            # a postscale is applied to the window's shares; a prescale makes pieces (the general path: MPI)
            pre, post = {np.float32: (1.0, 3.0), np.float64: (0.5, 3.0)}.get(dtype, (1.0, 1.0))
            arrays = [inputs(r, step, i, dtype) for i in range(24)]
            handles = [aiacc.allreduce_async_(a, op=op, name=f"w.{np.dtype(dtype)}.{op}.{i}", prescale_factor=pre,
                                              postscale_factor=post) for i, a in enumerate(arrays)]
            for i, h in enumerate(handles):
                got = aiacc.synchronize(h)
                assert got is arrays[i]
                parts = [inputs(k, step, i, dtype) * pre if pre != 1.0 else inputs(k, step, i, dtype) for k in range(n)]
                want = parts[0].copy()
                for p in parts[1:]:  # in rank order, as the window reduces
                    want = ufunc(want, p)
                if op == aiacc.Average:
                    if want.dtype.kind == "i":
                        want = (np.abs(want) // n) * np.sign(want)  # C's division: toward zero
                    else:
                        want = want / n
                if post != 1.0:
                    want = want * post
                want = want.astype(dtype)
                tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-12
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.allclose(got, want, rtol=tol, atol=tol), (step, np.dtype(dtype), op, i, got[:4], want[:4])
                checks += 1
            # every rank holds the same bytes
            mine = np.concatenate([a.view(np.uint8) for a in arrays])
            every = engine.comm.allgather(mine.tobytes())
            assert all(b == every[0] for b in every), (step, np.dtype(dtype), op)
            checks += 1
    # new results (out of place): views of one copy of the result slot, which the next bucket reuses
    mark = shared.reductions if shared is not None else 0
    sources = [np.full(50 + i, float(r + 1 + step), np.float32) for i in range(12)]
    handles = [aiacc.allreduce_async(a, op=aiacc.Average, name=f"w.out.{i}") for i, a in enumerate(sources)]
    results = [aiacc.synchronize(h) for h in handles]
    handles = [aiacc.allreduce_async(a, op=aiacc.Sum, name=f"w.out2.{i}") for i, a in enumerate(sources)]
    again = [aiacc.synchronize(h) for h in handles]  # (through the same slots)
    mean = sum(k + 1 + step for k in range(n)) / n
    assert all(np.allclose(x, mean) and x.shape == a.shape for x, a in zip(results, sources)), (step, results[0][:4])
    assert all(np.all(a == r + 1 + step) for a in sources)  # the inputs are left as they were
    assert all(np.allclose(x, mean * n) for x in again)
    if shared is not None and step > 0:
        assert shared.reductions > mark, (step, shared.reductions, mark)
    checks += 1
    # one group is one bucket: through the window once its name is cached (the first call of a name takes
    # the general path: pieces, MPI)
    mark = shared.reductions if shared is not None else 0
    grouped = [np.full(100 + i, float(r + 1 + step), np.float32) for i in range(10)]
    aiacc.grouped_allreduce_(grouped, op=aiacc.Sum, name="w.grouped")
    assert all(np.array_equal(g, np.full(g.size, sum(k + 1 + step for k in range(n)), np.float32)) for g in grouped)
    if shared is not None:
        assert shared.reductions == mark + (step > 0), (step, shared.reductions, mark)
    checks += 1
# A rank that has joined holds no requests: its buckets are pieces where the others' are runs, so a tensor
# agreed while a rank has joined is reduced through MPI on every rank (a bucket through the window on some
# ranks only hangs), whether its name is cached or new (agreed in the very cycle that announces the join:
# Horovod's test_horovod_join_allreduce hung there once).
for first in range(n):
    for cached in (True, False):
        names = [f"w.join.{i}" if cached else f"w.join.{first}.new.{i}" for i in range(2)]
        if cached:
            pair = [np.full(5 + i, float(r + 1), np.float32) for i in range(2)]
            for h in [aiacc.allreduce_async_(a, op=aiacc.Sum, name=nm) for a, nm in zip(pair, names)]:
                aiacc.synchronize(h)
        if r == first:
            aiacc.join()
        else:
            pair = [np.full(5 + i, float(r + 1), np.float32) for i in range(2)]
            for h in [aiacc.allreduce_async_(a, op=aiacc.Sum, name=nm) for a, nm in zip(pair, names)]:
                aiacc.synchronize(h)
            want = sum(k + 1 for k in range(n) if k != first)  # the joined rank contributes zeros
            assert all(np.all(a == want) for a in pair), (first, cached, pair)
            aiacc.join()
        checks += 1
used = (shared.reductions - before) if shared is not None else 0
if shared is not None:
    # from the second step on, the tensors of each op and dtype but float64 (prescaled) went through the
    # window (in one bucket or more), and the new results, and the group
    assert used >= 3 * (3 * len(ops) + 2), used
    # a bucket larger than a slot goes to MPI
    mark, allreduces = shared.reductions, engine.stats["allreduces"]
    big = [np.full(slot // 8, float(r), np.float32), np.full(slot // 8 + 16, float(r), np.float32)]
    for again in range(2):  # (the second call: the name is cached)
        if again:
            mark, allreduces = shared.reductions, engine.stats["allreduces"]
        for b in big:
            b[:] = r
        aiacc.grouped_allreduce_(big, op=aiacc.Sum, name="w.big")
        assert all(np.all(b == sum(range(n))) for b in big)
    assert (shared.reductions, engine.stats["allreduces"]) == (mark, allreduces + 1), \
        (shared.reductions, mark, engine.stats["allreduces"], allreduces)
    checks += 1
    # 16-bit floats keep to MPI (their sums run in float32 there), and so does bool (logical ops)
    for dtype, value, want in ((np.float16, 0.5 * (r + 1), 0.5 * n * (n + 1) / 2), (np.bool_, r == 0, True)):
        for again in range(2):
            mark, allreduces = shared.reductions, engine.stats["allreduces"]
            arrays = [np.full(64, value, dtype) for _ in range(8)]
            aiacc.grouped_allreduce_(arrays, op=aiacc.Sum, name=f"w.{np.dtype(dtype)}")
        assert all(np.all(a == np.asarray(want, dtype)) for a in arrays), (dtype, arrays[0][:4])
        assert (shared.reductions, engine.stats["allreduces"]) == (mark, allreduces + 1), dtype
        checks += 1
say(f"OK rank={r} checks={checks} window={used}")
aiacc.shutdown()
