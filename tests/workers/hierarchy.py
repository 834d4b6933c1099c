"""Topology queries and hierarchical allreduce on emulated hosts (AIACC_HOSTS_PER_NODE)."""

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
e = aiacc.get_engine()
per_host = e.config.hosts_per_node or n
# consecutive ranks share an emulated host
assert aiacc.local_rank() == r % per_host, (aiacc.local_rank(), r, per_host)
assert aiacc.local_size() == min(per_host, n - (r // per_host) * per_host)
if r % per_host == 0:  # the hosts' first ranks form the cross communicator
    assert (aiacc.cross_rank(), aiacc.cross_size()) == (r // per_host, -(-n // per_host))
# Horovod's is_homogeneous: every host runs as many ranks (3 ranks on hosts of 2 and 1 do not)
assert aiacc.is_homogeneous() == (n % per_host == 0), (aiacc.is_homogeneous(), n, per_host)
for step in range(3):
    for op, red in ((aiacc.Sum, np.sum), (aiacc.Max, np.max), (aiacc.Min, np.min), (aiacc.Average, np.mean)):
        xs = [np.arange(1000, dtype=np.float64) * (k + 1) + step for k in range(n)]
        handles = [aiacc.allreduce_async(xs[r] + i, op=op, name=f"t{i}.{op}") for i in range(5)]
        for i, h in enumerate(handles):
            want = red(np.stack([x + i for x in xs]), axis=0)
            assert np.allclose(aiacc.synchronize(h), want), (op, i)
    big = np.full(300_000, r + 1.0, np.float32)  # reduced alone, in place
    assert np.array_equal(aiacc.allreduce(big, op=aiacc.Sum, name="big"), np.full(300_000, n * (n + 1) / 2, np.float32))
say(f"OK rank={r} local={aiacc.local_rank()}/{aiacc.local_size()} cross={aiacc.cross_rank()}/{aiacc.cross_size()} "
    f"hierarchical={e.executor.hierarchy is not None} homogeneous={aiacc.is_homogeneous()}")
