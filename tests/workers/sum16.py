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
        # (the mean is rounded to the wire, once per level: the sum is scaled before its rounding)
        assert np.allclose(avg, want / n, rtol=levels * eps, atol=0), (wname, count)
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
# an Average (or a postscale) whose sum does not fit float16 but whose result does: scaled in float32 before the
# rounding, as DDP's divide-first gives (it was inf: the sum was rounded to float16 first, as Horovod's is)
f16 = np.dtype(np.float16)
big = np.full(7, 40000.0, np.float32)  # 40000 is a float16; 2 x 40000 is not
for how, kwargs in (("avg", dict(op=aiacc.Average)), ("post", dict(op=aiacc.Sum, postscale_factor=1.0 / n))):
    want = np.full(7, 40000.0, np.float32)
    got = aiacc.allreduce(big, name=f"big.{how}", compression=aiacc.Compression.fp16, **kwargs)
    assert np.array_equal(got, want), (how, got)
    got = aiacc.allreduce(big.astype(f16), name=f"big.raw.{how}", **kwargs)
    assert got.dtype == f16 and np.array_equal(got, want.astype(f16)), (how, got)
    group = aiacc.grouped_allreduce([big.astype(f16), big[:3].astype(f16), np.ones(5, f16)], name=f"big.group.{how}",
                                    **kwargs)
    assert np.array_equal(group[0], want.astype(f16)) and np.array_equal(group[1], want[:3].astype(f16)), (how, group)
    assert np.array_equal(group[2], np.full(5, 1.0 if how == "avg" else 1.0, f16)), (how, group[2])
    rs = aiacc.reducescatter(np.full(3 * n, 40000.0, f16), name=f"big.rs.{how}", **kwargs)
    assert np.array_equal(rs, np.full(3, 40000.0, f16)), (how, rs)
    checks += 4
# ... and an Average is the float32 sum times 1/n rounded once (per level: each host's sum is scaled, then added)
xs = [np.random.default_rng(100 + k).uniform(-1000, 1000, 999).astype(f16) for k in range(n)]
per_host = aiacc.local_size() if levels == 2 else n
parts = []
for h in range(0, n, per_host):
    acc = xs[h].astype(np.float32)
    for x in xs[h + 1:h + per_host]:
        acc += x.astype(np.float32)
    parts.append((acc * np.float32(1.0 / n)).astype(f16))
want = parts[0]
for p in parts[1:]:
    want = (want.astype(np.float32) + p.astype(np.float32)).astype(f16)
got = aiacc.allreduce(xs[r], op=aiacc.Average, name="avg.once")
assert np.array_equal(got, want), (np.flatnonzero(got != want)[:5], got[:3], want[:3])
checks += 1
if "torch" in sys.argv[1:]:  # the same through DistributedOptimizer's buckets: a float16 model, fp16 compression
    import torch

    for half in (True, False):
        lin = torch.nn.Linear(4, 3, bias=False)
        lin = lin.half() if half else lin
        opt = aiacc.torch.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.0),
                                               named_parameters=lin.named_parameters(),
                                               compression=aiacc.Compression.none if half else aiacc.Compression.fp16)
        lin(torch.full((1, 4), 40000.0, dtype=lin.weight.dtype)).sum().backward()
        opt.step()
        assert torch.equal(lin.weight.grad, torch.full((3, 4), 40000.0, dtype=lin.weight.dtype)), (half, lin.weight.grad)
    checks += 1
say(f"OK rank={r} checks={checks} levels={levels}")
aiacc.shutdown()
