"""broadcast_parameters when the ranks' parameters differ by name: one clear error on every rank, naming the
parameters and the ranks that have them (before: each rank waited for the other's broadcasts, a hang until
the stall shutdown), also for parameters whose initialisation is deferred; the dicts stay as they were. Likewise a
value that is neither a Parameter nor an NDArray on one rank only."""

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import gluon, nd

from report import raises, say

hvd.init()
r, n = hvd.rank(), hvd.size()
others = "rank 1 has" if n == 2 else "ranks " + ",".join(str(k) for k in range(1, n)) + " have"

# a plain dict: 'a' on rank 0, 'b' on every other rank, 'w' on all (at 3 ranks the message named ranks 1 and 2
# as the only one each)
d = {"w": nd.ones((2, 2)) * r, ("a" if r == 0 else "b"): nd.ones(3) * r}
raises(hvd.TensorMismatchError, lambda: hvd.broadcast_parameters(d, root_rank=0),
       "broadcast_parameters", "only rank 0 has 'a'", f"only {others} 'b'")
assert float(d["w"].asnumpy()[0, 0]) == r, "a refused broadcast must change nothing"
say(f"NAMES_OK rank={r}")

# one parameter more on rank 1 (a Gluon ParameterDict, one of them deferred), with a prefix
net = gluon.nn.Sequential(prefix="model_")
with net.name_scope():
    net.add(gluon.nn.Dense(3, in_units=4))
    if r == 1:
        net.add(gluon.nn.Dense(2))  # in_units unknown: deferred initialisation
net.initialize()
raises(hvd.TensorMismatchError, lambda: hvd.broadcast_parameters(net.collect_params(), prefix="net."),
       "only rank 1 has", "'model_dense1_weight'", "'model_dense1_bias'",
       "; ".join(f"rank {k}: {4 if k == 1 else 2}" for k in range(n)))
say(f"EXTRA_OK rank={r}")

# what is not an NDArray on one rank only (a checkpoint read as numpy arrays on the root, say): the error on every
# rank, naming the key and the rank (before: that rank raised, the others waited for its broadcasts)
d = {"w": nd.ones(3) * r, "v": nd.ones(2)}
if r == 0:
    d["w"] = d["w"].asnumpy()
for exc in (TypeError, ValueError):  # Horovod raises ValueError there
    raises(exc, lambda: hvd.broadcast_parameters(d, root_rank=0), "'w' is a ndarray, not a Parameter or NDArray",
           "rank 0")
assert float(d["v"].asnumpy()[0]) == 1.0
say(f"TYPES_OK rank={r}")

# the same names everywhere still broadcast, deferred ones after the first forward
mx.random.seed(r)
same = gluon.nn.Dense(5, prefix="same_")
same.initialize(mx.init.Normal(1.0))
hvd.broadcast_parameters(same.collect_params(), root_rank=1)
same(nd.ones((1, 3)))
rows = hvd.allgather(same.weight.data().reshape((1, -1)), name="check.same").asnumpy()
assert all(np.array_equal(rows[0], row) for row in rows[1:]), "deferred parameter not broadcast"
hvd.barrier()
say(f"OK rank={r}")
