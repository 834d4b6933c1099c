"""Ranks submit the same tensors in different orders, at different times.

After the first step every tensor is in the response cache: later steps must
not need the slow (gather) path at all.
"""

import time

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
rng = np.random.default_rng(r)
names = [f"grad.{i}" for i in range(40)]
engine = aiacc.get_engine()
slow_after_first = None
for step in range(6):
    order = rng.permutation(len(names))
    handles = {}
    for k, i in enumerate(order):
        if r == 1 and k % 10 == 0:
            time.sleep(0.003)  # rank 1 lags: tensors arrive in different cycles
        x = np.full(i + 1, float(i * (r + 1) + step), dtype=np.float32)
        handles[i] = aiacc.allreduce_async(x, op=aiacc.Sum, name=names[i])
    for i, h in handles.items():
        want = np.full(i + 1, i * n * (n + 1) / 2 + step * n, dtype=np.float32)
        got = aiacc.synchronize(h)
        assert np.array_equal(got, want), f"step {step} {names[i]}: {got[:3]} != {want[:3]}"
    if step == 0:
        slow_after_first = engine.negotiator.slow_cycles
assert engine.negotiator.slow_cycles == slow_after_first, (
    f"cached tensors took the slow path: {engine.negotiator.slow_cycles} slow cycles after step 1 "
    f"vs {slow_after_first}")
say(f"OK rank={r} slow_cycles={slow_after_first}")
