"""CUDA arrays through the engine: NCCL collectives, device fusion, fp16 on device, mixed host+device.

Every result is compared with the same operation on host (numpy) arrays, which go over MPI.
"""

import cupy as cp
import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
e = aiacc.get_engine()
rng = np.random.default_rng(r)
host = [rng.random(s).astype(np.float32) for s in (7, 1000, 33, 50_000)]
dev = [cp.asarray(h) for h in host]
for op in (aiacc.Sum, aiacc.Average, aiacc.Max):
    hh = [aiacc.allreduce_async(h, op=op, name=f"h{i}.{op}") for i, h in enumerate(host)]
    dd = [aiacc.allreduce_async(d, op=op, name=f"d{i}.{op}") for i, d in enumerate(dev)]  # fused on device
    for a, b in zip(hh, dd):
        got = aiacc.synchronize(b)
        assert isinstance(got, cp.ndarray), type(got)
        np.testing.assert_allclose(cp.asnumpy(got), aiacc.synchronize(a), rtol=1e-6)
# fp16 compression cast on the device
got = aiacc.allreduce(dev[1], name="fp16", compression=aiacc.Compression.fp16)
np.testing.assert_allclose(cp.asnumpy(got), aiacc.allreduce(host[1], name="fp16.host"), rtol=2e-3, atol=2e-3)
# allgather / broadcast / alltoall / reducescatter on device vs host
x = cp.arange((r + 1) * 3, dtype=cp.float32).reshape(r + 1, 3)
np.testing.assert_array_equal(cp.asnumpy(aiacc.allgather(x, name="ag.d")), aiacc.allgather(cp.asnumpy(x), name="ag.h"))
np.testing.assert_array_equal(cp.asnumpy(aiacc.broadcast(dev[0], 0, name="bc.d")), aiacc.broadcast(host[0], 0, name="bc.h"))
a2a = cp.arange(2 * n, dtype=cp.int64) + 100 * r
np.testing.assert_array_equal(cp.asnumpy(aiacc.alltoall(a2a, name="a2a.d")), aiacc.alltoall(cp.asnumpy(a2a), name="a2a.h"))
rs = cp.ones((2 * n + 1, 2), cp.float32) * (r + 1)
np.testing.assert_array_equal(cp.asnumpy(aiacc.reducescatter(rs, op=aiacc.Sum, name="rs.d")),
                              aiacc.reducescatter(cp.asnumpy(rs), op=aiacc.Sum, name="rs.h"))
assert e._nccl is not None, "CUDA arrays did not go through NCCL"
say(f"OK rank={r}")
