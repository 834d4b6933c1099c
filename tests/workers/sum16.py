"""Sums of 16-bit floats (Compression.fp16 / .bf16, and float16 / bfloat16 arrays) accumulate in float32.

Checks exact results on values the wire type holds exactly, that a sum rounds once (not after every
rank's addition), the error bound on random values, and that every rank holds the same bytes.
Usage: sum16.py [torch]   (torch: aiacc.torch is imported, so its cast kernel is used)
"""

import sys

import numpy as np

import aiacc
import aiacc.transport.mpi as mpi_transport
from aiacc.compression import bfloat16_dtype
from report import say

# small chunks, so that 40_000 elements run as 10 chunks, 3 in progress at a time
mpi_transport.SUM16_CHUNK_ELEMENTS = 4096

if "torch" in sys.argv[1:]:
    import aiacc.torch  # noqa: F401 - registers the torch cast kernel

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
bf16 = bfloat16_dtype()
WIRE = {"fp16": (aiacc.Compression.fp16, np.dtype(np.float16), 2.0 ** -11),
        "bf16": (aiacc.Compression.bf16, bf16, 2.0 ** -8)}


def same_everywhere(a, name):
    got = aiacc.allgather(np.ascontiguousarray(a).reshape(1, -1).view(np.uint8), name=name + ".same")
    assert all(np.array_equal(got[i], got[0]) for i in range(n)), f"{name}: ranks hold different results"


levels = len(aiacc.get_engine().transport._levels)
checks = 0
for wname, (comp, wire, eps) in WIRE.items():
    for count in (1, 3, 1000, 40_000):  # 40_000: above the cast kernel's minimum, 10 chunks
        i = np.arange(count)
        xs = [((i * 7 + k) % 13 - 6).astype(np.float32) for k in range(n)]  # small integers: exact in 16 bits
        want = np.sum(xs, axis=0)
        got = aiacc.allreduce(xs[r], op=aiacc.Sum, name=f"{wname}.{count}", compression=comp)
        assert got.dtype == np.float32 and np.array_equal(got, want), (wname, count, got[:8], want[:8])
        avg = aiacc.allreduce(xs[r], op=aiacc.Average, name=f"{wname}.avg.{count}", compression=comp)
        assert np.allclose(avg, want / n, rtol=1e-6, atol=0), (wname, count)
        # an array of the 16-bit type itself takes the same path
        raw = aiacc.allreduce(xs[r].astype(wire), op=aiacc.Sum, name=f"{wname}.raw.{count}")
        assert raw.dtype == wire and np.array_equal(raw.astype(np.float32), want), (wname, count)
        same_everywhere(got, f"{wname}.{count}")
        checks += 4
    # rounded once per level: with 3 ranks on one level, 2048 + 1 + 1 in float16 is 2050 summed in float32,
    # 2048 when every addition rounds (with 2 ranks both give 2048: 2049 rounds to even); with hosts
    # (two levels) each host's sum is rounded, then their total
    big = 2048.0 if wname == "fp16" else 256.0
    values = [big if k == n - 1 else 1.0 for k in range(n)]
    x = np.full(5, values[r], np.float32)
    got = aiacc.allreduce(x, op=aiacc.Sum, name=f"{wname}.once", compression=comp)

    def rounded(v):
        return float(np.array([v], np.float32).astype(wire).astype(np.float32)[0])

    if levels == 2:
        per_host = aiacc.local_size()
        want_once = rounded(sum(rounded(sum(values[h:h + per_host])) for h in range(0, n, per_host)))
    else:
        want_once = rounded(sum(values))
    assert np.array_equal(got, np.full(5, want_once, np.float32)), (wname, got, want_once)
    # reducescatter rounds once too, over every rank (MPI's own 16-bit Reduce_scatter rounded each addition)
    rs = aiacc.reducescatter(np.full(2 * n, values[r], np.float32), op=aiacc.Sum, name=f"{wname}.rs.once",
                             compression=comp)
    assert np.array_equal(rs, np.full(2, rounded(sum(values)), np.float32)), (wname, rs, rounded(sum(values)))
    checks += 1
    # random positive values: each input rounded to the wire, the sum rounded once more
    rng = [np.random.default_rng(k) for k in range(n)]
    xs = [g.uniform(0.5, 1.0, 50_000).astype(np.float32) for g in rng]
    want = np.sum(np.stack(xs).astype(np.float64), axis=0)
    got = aiacc.allreduce(xs[r], op=aiacc.Sum, name=f"{wname}.random", compression=comp)
    err = float(np.max(np.abs(got - want) / want))
    assert err <= (1.5 + levels) * eps, (wname, err)  # the inputs' rounding, then once per level
    same_everywhere(got, f"{wname}.random")
    checks += 3
    # a reducescatter whose share spans several chunks (summed in float32 chunk by chunk): each element is the
    # wire-rounded inputs summed in float32 in rank order, rounded once
    share = 10_003
    ys = [g.uniform(0.5, 1.0, n * share).astype(np.float32) for g in rng]
    acc = ys[0].astype(wire).astype(np.float32)
    for y in ys[1:]:
        acc += y.astype(wire).astype(np.float32)
    want = acc.astype(wire).astype(np.float32)[r * share:(r + 1) * share]
    got = aiacc.reducescatter(ys[r], op=aiacc.Sum, name=f"{wname}.rs.chunks", compression=comp)
    assert np.array_equal(got, want), (wname, np.flatnonzero(got != want)[:5])
    checks += 1
say(f"OK rank={r} checks={checks} levels={levels}")
aiacc.shutdown()
