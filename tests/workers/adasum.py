"""Adasum (op=Adasum) on 4 ranks, against a reference tree written here from the paper's formula.

Orthogonal tensors add up, parallel ones average (Horovod's own two checks), random ones equal the tree
((r0 + r1) + (r2 + r3)) where x + y = (1 - x.y / 2|x|^2) x + (1 - x.y / 2|y|^2) y; every rank ends with
the same bytes; a grouped call combines each tensor on its own; tiny float16 values (whose squares underflow
in float16) still average; under fp16 compression the vectors travel as float16 (Horovod's compress,
Adasum, decompress), with numpy's float16 roundings bit for bit at a gradient's size too. A process set of 2 ranks runs it; one of 3 ranks is refused (a power of 2 is
needed, as in Horovod), naming the count, and so is Adasum while a rank has joined.
"""

import numpy as np

import aiacc
from aiacc.adasum import combine
from report import raises, say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
assert n == 4
checks = 0


def pair(x, y):
    return (1 - x @ y / (2 * (x @ x))) * x + (1 - x @ y / (2 * (y @ y))) * y


def same_everywhere(name, got):
    everyone = aiacc.allgather_object(got.tobytes(), name=f"{name}.bytes")
    assert all(b == everyone[0] for b in everyone), f"{name}: ranks differ"


rng = np.random.default_rng(7)
q, _ = np.linalg.qr(rng.normal(size=(40, n)))
got = aiacc.allreduce(q[:, r].copy(), op=aiacc.Adasum, name="orthogonal")
assert np.allclose(got, q.sum(1), atol=1e-12), got
checks += 1

v, c = rng.normal(size=33), rng.normal(size=n)
got = aiacc.allreduce((v * c[r]).astype(np.float32), op=aiacc.Adasum, name="parallel")
assert np.allclose(got, v * c.mean(), rtol=1e-5, atol=1e-6), got
checks += 1

rows = rng.normal(size=(n, 17))
want = pair(pair(rows[0], rows[1]), pair(rows[2], rows[3]))
x = rows[r].copy()
h = aiacc.allreduce_async_(x, op=aiacc.Adasum, name="random")
assert aiacc.synchronize(h) is x and np.allclose(x, want, rtol=1e-12), (x, want)
same_everywhere("random", x)
checks += 1

other = rng.normal(size=(n, 2, 3))
a, b = aiacc.grouped_allreduce([rows[r].copy(), other[r].copy()], op=aiacc.Adasum, name="grouped")
assert np.allclose(a, want, rtol=1e-12)
flat = other.reshape(n, -1)
assert np.allclose(b.ravel(), pair(pair(flat[0], flat[1]), pair(flat[2], flat[3])), rtol=1e-12)
checks += 1

tiny = np.finfo(np.float16).tiny  # its square is 0 in float16
scales = np.array([1.0, 2.0, 3.0, 4.0])
t = (np.full(64, tiny, np.float64) * scales[r]).astype(np.float16)
got = aiacc.allreduce(t, op=aiacc.Adasum, name="tiny")
assert got.dtype == np.float16 and np.allclose(got.astype(np.float64), tiny * scales.mean(), rtol=1e-3), got
checks += 1

# compression=fp16 (Horovod compresses before its Adasum allreduce and decompresses after): the vectors
# travel as float16, each level's input rounded to it, and so is the result (then back to float32)
def half(v):
    return v.astype(np.float16).astype(np.float64)


h16 = half(rows)
want16 = half(pair(half(pair(h16[0], h16[1])), half(pair(h16[2], h16[3]))))
got = aiacc.allreduce(rows[r].astype(np.float32), op=aiacc.Adasum, name="fp16", compression=aiacc.Compression.fp16)
assert got.dtype == np.float32 and np.array_equal(got, want16.astype(np.float32)), (got, want16)
assert not np.array_equal(got, want.astype(np.float32))  # (uncompressed, it would not be float16's)
same_everywhere("fp16", got)
checks += 1

# the same at a gradient's size (blocks of the engine's float16 casts, aiacc.half), values mostly in float16's
# subnormal range (an SGD step's change), prescaled and postscaled: numpy's casts, bit for bit
big = rng.normal(size=(n, 70_001)) * np.exp(rng.uniform(-16, -6, size=(n, 70_001)))
x16 = half(half(big.astype(np.float32)) * 0.5)  # compressed, prescaled, rounded by the first level
up = [half(combine(x16[0], x16[1], np.empty(70_001))), half(combine(x16[2], x16[3], np.empty(70_001)))]
want16 = half(half(combine(up[0], up[1], np.empty(70_001))) * 3.0)
got = aiacc.allreduce(big[r].astype(np.float32), op=aiacc.Adasum, name="fp16.big", prescale_factor=0.5,
                      postscale_factor=3.0, compression=aiacc.Compression.fp16)
assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want16.astype(np.float32).view(np.uint32))
assert np.mean(np.abs(x16) < np.finfo(np.float16).tiny) > 0.3  # (float16 subnormals: numpy's slowest casts)
same_everywhere("fp16.big", got)
checks += 1

two = aiacc.add_process_set([1, 3])
three = aiacc.add_process_set([0, 1, 2])
if r in (1, 3):
    got = aiacc.allreduce(rows[r].copy(), op=aiacc.Adasum, name="two", process_set=two)
    assert np.allclose(got, pair(rows[1], rows[3]), rtol=1e-12)
    checks += 1
if r in (0, 1, 2):
    raises(NotImplementedError, lambda: aiacc.allreduce(rows[r].copy(), op=aiacc.Adasum, name="three",
                                                       process_set=three), "power-of-2", "not 3")
    checks += 1

if r == 3:
    aiacc.join()
else:
    raises(Exception, lambda: aiacc.allreduce(rows[r].copy(), op=aiacc.Adasum, name="joined"),
           "Adasum", "join()")
    aiacc.join()
checks += 1
aiacc.shutdown()
say(f"OK rank={r} checks={checks}")
